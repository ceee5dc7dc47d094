"""``structllm bench scopes``: what the engine gains from knowing the scopes.

Two closed-loop workloads over the engine core (no tokenizer, no front end;
the deadlines and pins the front end would send, sent directly):

- ``deadlines``: ``--clients`` background clients without deadlines, each
  sending its next request as soon as its last one ends, more of them than
  the batch holds (``--max-num-seqs``), so some always wait; beside them a
  stream of short requests, one every ``--short-interval`` seconds, each
  with a deadline ``--short-deadline`` seconds after it is sent. Run with
  ``scheduling_order`` "edf" and "fcfs" (two cores, runs alternating). For
  the short requests: TTFT and the miss rate (dropped at the deadline, or
  finished after it); for all: the tokens the core skipped because their
  deadline had passed (work a core without deadlines would have computed
  for nobody), against the tokens it ran.
- ``pin``: an agent loop: each turn is a shared system prompt
  (``--system-len``), the turn's own history, and a short answer; between
  turns, other traffic (``--pressure`` prompts of ``--pressure-len``) fills a
  KV cache too small for both (``--num-blocks``), evicting what is not held.
  Run once with the system prompt pinned (``CoreRequest.pin``, as
  ``AsyncLLM.pin`` sends it) and once without: each turn's TTFT.

TTFT is from submission to the end of the step that produced the first
token. Greedy, EOS ignored.
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from structllm.bench.model import add_bench_model_args, bench_engine_args

__all__ = ["add_scopes_args", "run_scopes"]

WORKLOADS = ("deadlines", "pin")


def add_scopes_args(p: argparse.ArgumentParser) -> None:
    add_bench_model_args(p)
    p.set_defaults(max_num_seqs=8)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--background-len", type=int, nargs=2, default=[128, 32],
                   metavar=("PROMPT", "OUTPUT"))  # fmt: skip
    p.add_argument("--short-len", type=int, nargs=2, default=[32, 8],
                   metavar=("PROMPT", "OUTPUT"))  # fmt: skip
    p.add_argument("--short-requests", type=int, default=20)
    p.add_argument("--short-interval", type=float, default=0.2, help="seconds")
    p.add_argument("--short-deadline", type=float, default=0.5, help="seconds")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--turn-len", type=int, default=32)
    p.add_argument("--answer-len", type=int, default=8)
    p.add_argument("--pressure", type=int, default=6)
    p.add_argument("--pressure-len", type=int, default=256)
    p.add_argument("--num-blocks", type=int, default=96, help="pin workload's pool")
    p.add_argument("--repeats", type=int, default=1, help="runs per mode")
    p.add_argument("--json", default=None, help="write the results here")


def _params(max_tokens: int) -> Any:
    from structllm.params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def drive_deadlines(core: Any, ns: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """The background clients and the short stream until every short one ended."""
    from structllm.core.request import CoreRequest

    rng = np.random.default_rng(ns.seed)
    ids = itertools.count()
    bg_prompt, bg_out = ns.background_len
    short_prompt, short_out = ns.short_len

    def toks(n: int) -> tuple[int, ...]:
        return tuple(int(t) for t in rng.integers(1, vocab, size=n))

    def send(kind: str, n: int, out: int, deadline: float | None) -> None:
        rid = f"{kind}{next(ids)}"
        core.add_request(
            CoreRequest(
                request_id=rid,
                prompt_token_ids=toks(n),
                params=_params(out),
                deadline=deadline,
            )
        )
        sent[rid] = (time.monotonic(), deadline)

    sent: dict[str, tuple[float, float | None]] = {}
    ttft: list[float] = []
    missed = shorts_done = computed = 0
    before = core.statistics().scheduler
    for _ in range(ns.clients):
        send("bg", bg_prompt, bg_out, None)
    start = time.monotonic()
    next_short, shorts_sent = start, 0
    while shorts_done < ns.short_requests:
        now = time.monotonic()
        if shorts_sent < ns.short_requests and now >= next_short:
            send("short", short_prompt, short_out, now + ns.short_deadline)
            shorts_sent += 1
            next_short += ns.short_interval
        step = core.step()
        computed += step.num_batched_tokens
        now = time.monotonic()
        for out in step.outputs:
            t0, deadline = sent[out.request_id]
            short = out.request_id.startswith("short")
            if short and out.new_token_ids and out.queue_s is not None:
                ttft.append(now - t0)
            if out.finish_reason is None:
                continue
            del sent[out.request_id]
            if short:
                shorts_done += 1
                late = deadline is not None and now > deadline
                missed += out.finish_reason == "abort" or late
            else:  # the client sends its next request
                send("bg", bg_prompt, bg_out, None)
    core.abort_requests(list(sent))
    after = core.statistics().scheduler
    return {
        "seconds": time.monotonic() - start,
        "short_ttft_p50_ms": 1e3 * float(np.percentile(ttft, 50)) if ttft else None,
        "short_ttft_p90_ms": 1e3 * float(np.percentile(ttft, 90)) if ttft else None,
        "short_miss_rate": missed / ns.short_requests,
        "expired": after.num_expired - before.num_expired,
        "skipped_tokens": after.expired_tokens_skipped - before.expired_tokens_skipped,
        "computed_tokens": computed,
    }


def drive_pin(core: Any, ns: argparse.Namespace, vocab: int, pin: bool) -> list[float]:
    """The agent's turns under cache pressure; each turn's TTFT (seconds)."""
    from structllm.core.request import CoreRequest

    rng = np.random.default_rng(ns.seed)
    system = tuple(int(t) for t in rng.integers(1, vocab, size=ns.system_len))
    ids = itertools.count()

    def run(
        prompt: tuple[int, ...], out: int, rid: str | None = None, pin: bool = False
    ) -> float:
        """Submit, step to the end; the TTFT."""
        rid = rid or f"r{next(ids)}"
        core.add_request(
            CoreRequest(
                request_id=rid, prompt_token_ids=prompt, params=_params(out), pin=pin
            )
        )
        t0, first = time.perf_counter(), None
        while core.has_unfinished_requests():
            for o in core.step().outputs:
                if o.request_id == rid and first is None:
                    first = time.perf_counter() - t0
        assert first is not None
        return first

    core.reset_prefix_cache()
    if pin:
        run(system, 1, "system-pin", pin=True)
    history: tuple[int, ...] = ()
    ttft = []
    for _ in range(ns.turns):
        for _ in range(ns.pressure):  # other traffic, one after another
            noise = tuple(int(t) for t in rng.integers(1, vocab, size=ns.pressure_len))
            run(noise, 4)
        history += tuple(int(t) for t in rng.integers(1, vocab, size=ns.turn_len))
        ttft.append(run((*system, *history), ns.answer_len))
    core.abort_requests(["system-pin"])
    return ttft


def run_scopes(ns: argparse.Namespace) -> int:
    from structllm.bench.model import bench_model
    from structllm.config import EngineConfig
    from structllm.core.engine_core import EngineCore
    from structllm.model._paddle import default_num_threads

    threads = ns.num_threads or default_num_threads()
    workloads = [w for w in ns.workloads.split(",") if w]
    results: dict[str, Any] = {"threads": threads}
    with tempfile.TemporaryDirectory() as tmp:
        model = bench_model(ns, Path(tmp))
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        engine = bench_engine_args(ns, threads)
        if "deadlines" in workloads:
            cores = {
                order: EngineCore(
                    EngineConfig(model=model, scheduling_order=order, **engine)
                )
                for order in ("edf", "fcfs")
            }
            runs: dict[str, list[dict[str, Any]]] = {o: [] for o in cores}
            for _ in range(ns.repeats):
                for order, core in cores.items():
                    runs[order].append(drive_deadlines(core, ns, vocab))
            results["deadlines"] = {
                o: {k: _median([r[k] for r in rs]) for k in rs[0]}
                for o, rs in runs.items()
            }
            _print_deadlines(results["deadlines"], ns)
        if "pin" in workloads:
            core = EngineCore(
                EngineConfig(
                    model=model,
                    **{**engine, "max_model_len": 1024, "num_blocks": ns.num_blocks},
                )
            )
            turns: dict[str, list[list[float]]] = {"pinned": [], "unpinned": []}
            for _ in range(ns.repeats):
                for mode in turns:
                    turns[mode].append(drive_pin(core, ns, vocab, mode == "pinned"))
            results["pin"] = {
                m: [1e3 * float(np.median(t)) for t in zip(*ts, strict=True)]
                for m, ts in turns.items()
            }
            _print_pin(results["pin"], ns)
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, indent=2))
    return 0


def _median(values: list[Any]) -> Any:
    known = [v for v in values if v is not None]
    return float(np.median(known)) if known else None


def _print_deadlines(r: dict[str, dict[str, Any]], ns: argparse.Namespace) -> None:
    print(
        f"deadlines: {ns.clients} background clients (max_num_seqs "
        f"{ns.max_num_seqs}), {ns.short_requests} short requests due "
        f"{ns.short_deadline:g}s after they are sent"
    )
    print("order  short TTFT p50/p90 ms  missed  expired  skipped/computed tokens")
    for order, x in r.items():
        p50, p90 = x["short_ttft_p50_ms"], x["short_ttft_p90_ms"]
        ttft = "-" if p50 is None else f"{p50:.0f} / {p90:.0f}"
        print(
            f"{order:<6} {ttft:>20}  {x['short_miss_rate']:>6.0%}  "
            f"{x['expired']:>7.0f}  {x['skipped_tokens']:.0f} / "
            f"{x['computed_tokens']:.0f}"
        )


def _print_pin(r: dict[str, list[float]], ns: argparse.Namespace) -> None:
    print(
        f"pin: {ns.turns} agent turns on a {ns.system_len}-token system prompt, "
        f"{ns.pressure} x {ns.pressure_len}-token prompts between turns, "
        f"{ns.num_blocks} KV blocks"
    )
    print("mode      TTFT per turn (ms)")
    for mode, ttft in r.items():
        print(f"{mode:<9} " + " ".join(f"{t:.0f}" for t in ttft))
