"""``structllm bench speculative``: speculative decoding against none, side by side.

Engines in one process, one without ``speculative_config`` and one with
n-gram prompt lookup (``{"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_min": a, "prompt_lookup_max": 5}``), and a draft model's
(``--draft REF``) if asked, run the same prompts alternately, so drift on a
noisy machine hits them alike. The prompts are
:mod:`structllm.bench.grounded`'s, greedy, in the model's chat template.

``single``: one request at a time (default model ``smollm2``), the
prompt-grounded workload and open-ended chat; per workload and engine: the
median time per output token after the first (TPOT, the inter-token
latency a stream sees on average), output tok/s, proposed and accepted
tokens, and whether the outputs equal the engine's without speculation.

``batch``: C requests at once (``LLM.generate``, EOS ignored), output
tok/s per engine; ``--disable-by-batch-size`` (default: none, so it
speculates at any batch size) shows where it stops paying.

``crossover``: as ``batch`` (default model: ``bench``, the random
checkpoint of ``bench throughput``), in CPU time per output token (the
process's, one thread by default), which other work on a shared machine
does not inflate as it does wall time; it sets ``disable_by_batch_size``'s
default (docs/benchmarks.md).

``--draft smollm2`` on smollm2 is the target drafting for itself: every
proposal right, each costing a target-sized forward; an upper bound on
acceptance, not on speed. ``--json PATH`` writes the figures printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from structllm.bench.grounded import CHAT, GROUNDED, chat_prompt

if TYPE_CHECKING:
    from structllm.llm import LLM

__all__ = ["add_speculative_args", "run_speculative"]

#: ``--model bench``: write the bench checkpoint and measure on it
BENCH = "bench"


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    """``single``, ``batch`` and ``crossover``, with the engines' flags."""
    sub = p.add_subparsers(dest="speculative", required=True)
    single = sub.add_parser("single", help="one stream at a time: TPOT, acceptance")
    single.add_argument("--model", default="smollm2")
    single.add_argument("--rounds", type=int, default=2)
    single.add_argument("--max-tokens", type=int, default=128)
    batch = sub.add_parser("batch", help="C requests at once: output tok/s")
    batch.add_argument("--model", default="smollm2")
    batch.add_argument("--rounds", type=int, default=2)
    batch.add_argument("--max-tokens", type=int, default=64)
    batch.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    batch.add_argument(
        "--disable-by-batch-size",
        type=int,
        default=None,
        help="speculative_config's (default: none, speculate at any batch size)",
    )
    cross = sub.add_parser("crossover", help="C requests at once: CPU ms per token")
    cross.add_argument(
        "--model", default=BENCH, help="bench (default): the bench checkpoint"
    )
    cross.add_argument("--rounds", type=int, default=3)
    cross.add_argument("--max-tokens", type=int, default=64)
    cross.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16])
    for q in (single, batch, cross):
        q.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
        q.add_argument("--prompt-lookup-min", type=int, default=2)
        q.add_argument(
            "--draft",
            metavar="REF",
            default=None,
            help="also a draft model's proposals (any model reference)",
        )
        q.add_argument(
            "--num-threads",
            type=int,
            default=1 if q is cross else None,
            help="each engine's threads" + (" (default: 1)" if q is cross else ""),
        )
        q.add_argument("--json", default=None, metavar="PATH", help="write figures")


def _specs(ns: argparse.Namespace) -> dict[str, dict[str, Any] | None]:
    """Each engine's ``speculative_config``: none, ngram, and the draft's."""
    limit = getattr(ns, "disable_by_batch_size", None)
    k = ns.num_speculative_tokens
    specs: dict[str, dict[str, Any] | None] = {
        "none": None,
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": ns.prompt_lookup_min,
            "prompt_lookup_max": max(5, ns.prompt_lookup_min),
            "disable_by_batch_size": limit,
        },
    }
    if ns.draft is not None:
        specs["draft"] = {
            "method": "draft_model",
            "model": ns.draft,
            "num_speculative_tokens": k,
            "disable_by_batch_size": limit,
        }
    return specs


def _engines(
    model: str, specs: dict[str, dict[str, Any] | None], **kw: Any
) -> dict[str, LLM]:
    from structllm.llm import LLM

    return {
        name: LLM(model, speculative_config=spec, show_progress=False, **kw)
        for name, spec in specs.items()
    }


def _counts(llm: LLM) -> tuple[int, int]:
    """(proposed, accepted) tokens so far."""
    s = llm.core.statistics().scheduler
    return s.num_draft_tokens, s.num_accepted_tokens


def _orders(names: list[str], rounds: int) -> list[list[str]]:
    """Each round's order: who goes first alternates."""
    return [names if r % 2 == 0 else names[::-1] for r in range(rounds)]


def _one_stream(
    llm: LLM, prompt: list[int], max_tokens: int
) -> tuple[float, float, list[int]]:
    """(seconds per output token after the first, output tok/s, token ids)."""
    from structllm.params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    first = last = None
    tokens: list[int] = []
    start = time.perf_counter()
    for out in llm.stream({"prompt_token_ids": prompt}, params):
        now = time.perf_counter()
        tokens = list(out.outputs[0].token_ids)
        first = now if first is None else first
        last = now
    assert first is not None and last is not None
    n = len(tokens)
    return (last - first) / max(1, n - 1), n / (last - start), tokens


def single(
    model: str,
    specs: dict[str, dict[str, Any] | None],
    *,
    rounds: int,
    max_tokens: int,
    num_threads: int | None = None,
) -> dict[str, dict[str, dict[str, Any]]]:
    """Per workload and engine: ``tpot_p50_ms``, ``tokens_per_s`` (median),
    ``proposed_tokens``, ``accepted_tokens``, ``acceptance_rate`` and
    ``identical`` (its outputs equal the engine's without speculation)."""
    engines = _engines(model, specs, num_threads=num_threads)
    tokenizer = engines["none"].tokenizer
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for workload, texts in [("grounded", GROUNDED), ("chat", CHAT)]:
        prompts = [chat_prompt(tokenizer, t) for t in texts]
        tpot: dict[str, list[float]] = {k: [] for k in engines}
        rate: dict[str, list[float]] = {k: [] for k in engines}
        counts = dict.fromkeys(engines, (0, 0))
        same = dict.fromkeys(engines, True)
        for order in _orders(list(engines), rounds):
            for prompt in prompts:
                outputs = {}
                for key in order:
                    before = _counts(engines[key])
                    s, tps, outputs[key] = _one_stream(engines[key], prompt, max_tokens)
                    after = _counts(engines[key])
                    tpot[key].append(s)
                    rate[key].append(tps)
                    p, a = counts[key]
                    counts[key] = (p + after[0] - before[0], a + after[1] - before[1])
                for key in engines:
                    same[key] &= outputs[key] == outputs["none"]
        out[workload] = {
            key: {
                "tpot_p50_ms": 1e3 * statistics.median(tpot[key]),
                "tokens_per_s": statistics.median(rate[key]),
                **_acceptance(*counts[key]),
                "identical": same[key],
            }
            for key in engines
        }
    return out


def _acceptance(proposed: int, accepted: int) -> dict[str, float]:
    return {
        "proposed_tokens": proposed,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
    }


def _batches(
    model: str,
    specs: dict[str, dict[str, Any] | None],
    *,
    clients: list[int],
    rounds: int,
    max_tokens: int,
    clock: Callable[[], float],
    **kw: Any,
) -> dict[int, dict[str, dict[str, float]]]:
    """Per number of clients and engine: ``seconds_per_token`` by
    ``clock`` (median over the rounds) and the acceptance of the last."""
    from structllm.params import SamplingParams

    engines = _engines(model, specs, max_num_seqs=max(16, *clients), **kw)
    tokenizer = engines["none"].tokenizer
    texts = [*GROUNDED, *CHAT]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    warm = [{"prompt_token_ids": chat_prompt(tokenizer, texts[0])}]
    for llm in engines.values():  # the first forwards build kernels: not timed
        llm.generate(warm, params, use_tqdm=False)
    out: dict[int, dict[str, dict[str, float]]] = {}
    for c in clients:
        prompts = [
            {"prompt_token_ids": chat_prompt(tokenizer, texts[i % len(texts)])}
            for i in range(c)
        ]
        per_token: dict[str, list[float]] = {k: [] for k in engines}
        counts: dict[str, tuple[int, int]] = {}
        for order in _orders(list(engines), rounds):
            for key in order:
                before = _counts(engines[key])
                start = clock()
                outs = engines[key].generate(prompts, params, use_tqdm=False)
                used = clock() - start
                after = _counts(engines[key])
                n = sum(len(o.outputs[0].token_ids) for o in outs)
                per_token[key].append(used / n)
                counts[key] = (after[0] - before[0], after[1] - before[1])
        out[c] = {
            key: {
                "seconds_per_token": statistics.median(per_token[key]),
                **_acceptance(*counts[key]),
            }
            for key in engines
        }
    return out


def run_speculative(ns: argparse.Namespace) -> int:
    specs = _specs(ns)
    results: dict[str, Any] = {"command": ns.speculative, "specs": specs}
    with tempfile.TemporaryDirectory() as tmp:
        model = ns.model
        if model == BENCH:
            from structllm.bench.model import write_bench_checkpoint

            model = str(Path(tmp) / BENCH)
            write_bench_checkpoint(model)
        if ns.speculative == "single":
            results["workloads"] = figures = single(
                model,
                specs,
                rounds=ns.rounds,
                max_tokens=ns.max_tokens,
                num_threads=ns.num_threads,
            )
            _print_single(figures)
        else:
            cpu = ns.speculative == "crossover"
            results["clients"] = batches = _batches(
                model,
                specs,
                clients=ns.clients,
                rounds=ns.rounds,
                max_tokens=ns.max_tokens,
                clock=time.process_time if cpu else time.perf_counter,
                num_threads=ns.num_threads,
                max_model_len=1024,
                kv_cache_memory=1 << 30,
            )
            _print_batches(batches, cpu=cpu)
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, indent=2))
    return 0


def _print_single(figures: dict[str, dict[str, dict[str, Any]]]) -> None:
    for workload, engines in figures.items():
        none = engines["none"]
        for key, f in engines.items():
            if key == "none":
                continue
            print(
                f"{workload:9s} TPOT p50 none {none['tpot_p50_ms']:.1f} ms, {key} "
                f"{f['tpot_p50_ms']:.1f} ms: "
                f"{none['tpot_p50_ms'] / f['tpot_p50_ms']:.2f}x; tok/s "
                f"{none['tokens_per_s']:.1f} vs {f['tokens_per_s']:.1f}; acceptance "
                f"{f['accepted_tokens']}/{f['proposed_tokens']} = "
                f"{f['acceptance_rate']:.2f}; identical: {f['identical']}"
            )


def _print_batches(
    batches: dict[int, dict[str, dict[str, float]]], *, cpu: bool
) -> None:
    for clients, engines in batches.items():
        none = engines["none"]["seconds_per_token"]
        if cpu:
            line = f"CPU ms per output token none {1e3 * none:.2f}"
            line += "".join(
                f", {k} {1e3 * f['seconds_per_token']:.2f} "
                f"({none / f['seconds_per_token']:.2f}x, acceptance "
                f"{f['acceptance_rate']:.2f})"
                for k, f in engines.items()
                if k != "none"
            )
        else:
            line = f"output tok/s none {1 / none:.1f}"
            line += "".join(
                f", {k} {1 / f['seconds_per_token']:.1f}: "
                f"{none / f['seconds_per_token']:.2f}x"
                for k, f in engines.items()
                if k != "none"
            )
        print(f"{clients:3d} clients: {line}", flush=True)
