"""``structllm bench prefix``: TTFT and throughput with prefix caching on vs off.

Three closed-loop workloads over the engine core (no tokenizer, no front
end), each run with caching on and off in the same process, alternating,
so drift on a noisy machine hits both:

- ``chat``: conversations sharing one long system prompt; each turn's prompt
  is the system prompt, the whole history (user messages and the model's
  answers) and a new user message; a conversation sends its next turn as
  soon as the last one finishes;
- ``fewshot``: independent questions behind one shared few-shot prefix,
  all submitted at once;
- ``none``: random prompts that share nothing (the cost of caching when it
  cannot help), all submitted at once.

TTFT is from submission to the end of the step that produced the first
token. Greedy, EOS ignored: both modes produce the same tokens (checked).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from structllm.bench.model import add_bench_model_args, bench_engine_args

__all__ = ["Session", "add_prefix_args", "make_sessions", "run_prefix"]

WORKLOADS = ("chat", "fewshot", "none")


def add_prefix_args(p: argparse.ArgumentParser) -> None:
    add_bench_model_args(p)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument(
        "--user-len", type=int, nargs=2, default=[32, 64], metavar=("MIN", "MAX")
    )
    p.add_argument("--answer-len", type=int, default=32)
    p.add_argument("--fewshot-len", type=int, default=384)
    p.add_argument("--fewshot-requests", type=int, default=32)
    p.add_argument("--unshared-requests", type=int, default=32)
    p.add_argument(
        "--unshared-input-len",
        type=int,
        nargs=2,
        default=[16, 256],
        metavar=("MIN", "MAX"),
    )
    p.add_argument(
        "--unshared-output-len",
        type=int,
        nargs=2,
        default=[16, 64],
        metavar=("MIN", "MAX"),
    )
    p.add_argument("--repeats", type=int, default=3, help="on/off pairs per workload")
    p.add_argument("--json", default=None, help="write the results here")


@attrs.frozen
class Session:
    """A shared ``prefix``, then turns of (user tokens, answer length)."""

    prefix: tuple[int, ...]
    turns: tuple[tuple[tuple[int, ...], int], ...]


def make_sessions(workload: str, ns: argparse.Namespace, vocab: int) -> list[Session]:
    """The sessions of ``workload``, deterministic in ``ns.seed``."""
    rng = np.random.default_rng(ns.seed)

    def toks(n: int) -> tuple[int, ...]:
        return tuple(rng.integers(3, vocab, size=n).tolist())

    def between(lo_hi: list[int]) -> int:
        return int(rng.integers(lo_hi[0], lo_hi[1] + 1))

    if workload == "chat":
        system = toks(ns.system_len)
        return [
            Session(
                system,
                tuple(
                    (toks(between(ns.user_len)), ns.answer_len) for _ in range(ns.turns)
                ),
            )
            for _ in range(ns.conversations)
        ]
    if workload == "fewshot":
        shots = toks(ns.fewshot_len)
        return [
            Session(shots, ((toks(between(ns.user_len)), ns.answer_len),))
            for _ in range(ns.fewshot_requests)
        ]
    if workload == "none":
        return [
            Session(
                (),
                (
                    (
                        toks(between(ns.unshared_input_len)),
                        between(ns.unshared_output_len),
                    ),
                ),
            )
            for _ in range(ns.unshared_requests)
        ]
    raise ValueError(f"unknown workload {workload!r}; choose from {WORKLOADS}")


@attrs.define(eq=False)
class _Live:
    session: int
    turn: int
    prompt: tuple[int, ...]
    submitted: float
    tokens: list[int] = attrs.Factory(list)


def drive(core: Any, sessions: list[Session]) -> dict[str, Any]:
    """Run every session to its end on ``core`` (an EngineCore); measure."""
    from structllm.core.request import CoreRequest
    from structllm.params import SamplingParams

    live: dict[str, _Live] = {}
    ttft: list[float] = []
    answers: dict[tuple[int, int], tuple[int, ...]] = {}
    counter = 0

    def submit(s: int, turn: int, history: tuple[int, ...], now: float) -> None:
        nonlocal counter
        user, answer_len = sessions[s].turns[turn]
        prompt = (*history, *user)
        rid = f"{s}.{turn}.{counter}"
        counter += 1
        core.add_request(
            CoreRequest(
                request_id=rid,
                prompt_token_ids=prompt,
                params=SamplingParams(
                    temperature=0, max_tokens=answer_len, ignore_eos=True
                ),
            )
        )
        live[rid] = _Live(s, turn, prompt, now)

    before = core.statistics().scheduler
    start = time.perf_counter()
    for s, session in enumerate(sessions):
        submit(s, 0, session.prefix, start)
    computed = produced = steps = 0
    forward_s = host_s = 0.0
    while core.has_unfinished_requests():
        step = core.step()
        now = time.perf_counter()
        steps += 1
        computed += step.num_batched_tokens
        forward_s += step.forward_s + step.sample_s
        # scheduling and bookkeeping (hashing, cache lookups and registration)
        host_s += step.total_s - step.forward_s - step.sample_s
        for out in step.outputs:
            rec = live[out.request_id]
            if not rec.tokens:
                ttft.append(now - rec.submitted)
            rec.tokens += out.new_token_ids
            produced += len(out.new_token_ids)
            if out.finish_reason is not None:
                del live[out.request_id]
                answers[(rec.session, rec.turn)] = tuple(rec.tokens)
                if rec.turn + 1 < len(sessions[rec.session].turns):
                    submit(rec.session, rec.turn + 1, (*rec.prompt, *rec.tokens), now)
    elapsed = time.perf_counter() - start
    after = core.statistics().scheduler
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    return {
        "seconds": elapsed,
        "requests": len(ttft),
        "output_tokens": produced,
        "tokens_per_s": produced / elapsed,
        "computed_tokens": computed,
        "steps": steps,
        "forward_s": forward_s,
        "host_s": host_s,
        "ttft_p50_ms": 1e3 * float(np.percentile(ttft, 50)),
        "ttft_p90_ms": 1e3 * float(np.percentile(ttft, 90)),
        "ttft_mean_ms": 1e3 * float(np.mean(ttft)),
        "hit_rate": hits / queries if queries else 0.0,
        "answers": answers,
    }


def run_prefix(ns: argparse.Namespace) -> int:
    from structllm.bench.model import bench_model
    from structllm.config import EngineConfig
    from structllm.core.engine_core import EngineCore
    from structllm.model._paddle import default_num_threads

    threads = ns.num_threads or default_num_threads()
    workloads = [w for w in ns.workloads.split(",") if w]
    with tempfile.TemporaryDirectory() as tmp:
        model = bench_model(ns, Path(tmp))
        config = json.loads((Path(model) / "config.json").read_text())
        cores = {
            mode: EngineCore(
                EngineConfig(
                    model=model,
                    enable_prefix_caching=mode == "on",
                    **bench_engine_args(ns, threads),
                )
            )
            for mode in ("on", "off")
        }
        results: dict[str, Any] = {
            "model": {
                k: config[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")
            },
            "threads": threads,
            "workloads": {},
        }
        for w in workloads:
            sessions = make_sessions(w, ns, config["vocab_size"])
            longest = max(
                len(s.prefix) + sum(len(u) + a for u, a in s.turns) for s in sessions
            )
            for core in cores.values():  # warm-up: grow every buffer, untimed
                drive(core, [Session((), (((5,) * min(longest, 4000), 4),))])
            runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
            for _ in range(ns.repeats):
                for mode, core in cores.items():
                    core.reset_prefix_cache()  # every run starts cold
                    runs[mode].append(drive(core, sessions))
            for r_on, r_off in zip(runs["on"], runs["off"], strict=True):
                if r_on.pop("answers") != r_off.pop("answers"):
                    raise SystemExit(f"{w}: outputs differ with caching on and off")
            results["workloads"][w] = _summarise(runs, len(sessions))
            if w == workloads[0]:
                _print_header(results)
            _print_workload(w, results["workloads"][w])
            if ns.json:  # after each workload, so a long run keeps what it has
                Path(ns.json).write_text(json.dumps(results, indent=2))
    return 0


def _summarise(runs: dict[str, list[dict[str, Any]]], sessions: int) -> dict[str, Any]:
    med = {
        mode: {k: float(np.median([r[k] for r in rs])) for k in rs[0]}
        for mode, rs in runs.items()
    }
    pairs = list(zip(runs["on"], runs["off"], strict=True))
    return {
        "sessions": sessions,
        "median": med,
        "runs": runs,
        # per alternating pair, then the median: robust to drift
        "ttft_p50_speedup": float(
            np.median([f["ttft_p50_ms"] / o["ttft_p50_ms"] for o, f in pairs])
        ),
        "throughput_ratio": float(
            np.median([o["tokens_per_s"] / f["tokens_per_s"] for o, f in pairs])
        ),
        # what caching adds to the host side of the steps, as a fraction of
        # the caching-off run's model time: the noise-free part of its cost
        "host_overhead": float(
            np.median([(o["host_s"] - f["host_s"]) / f["forward_s"] for o, f in pairs])
        ),
    }


def _print_header(r: dict[str, Any]) -> None:
    m = r["model"]
    print(
        f"model: hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, vocab "
        f"{m['vocab_size']}; {r['threads']} threads"
    )
    print(
        f"{'workload':<9}{'caching':>8}{'reqs':>6}{'TTFT p50':>10}{'p90':>9}"
        f"{'out tok/s':>11}{'computed':>10}{'hit rate':>10}",
        flush=True,
    )


def _print_workload(name: str, w: dict[str, Any]) -> None:
    for mode in ("on", "off"):
        s = w["median"][mode]
        print(
            f"{name:<9}{mode:>8}{s['requests']:>6.0f}{s['ttft_p50_ms']:>8.0f}ms"
            f"{s['ttft_p90_ms']:>7.0f}ms{s['tokens_per_s']:>11.1f}"
            f"{s['computed_tokens']:>10.0f}{100 * s['hit_rate']:>9.1f}%"
        )
    print(
        f"{'':<9}TTFT p50 off/on {w['ttft_p50_speedup']:.2f}x, throughput on/off "
        f"{w['throughput_ratio']:.3f} (medians of {len(w['runs']['on'])} "
        "alternating pairs)",
        flush=True,
    )
    print(
        f"{'':<9}host-side cost of caching: {100 * w['host_overhead']:+.2f}% of the "
        "model time",
        flush=True,
    )
