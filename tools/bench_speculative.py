"""Speculative decoding (n-gram prompt lookup) against none, side by side.

    PYTHONPATH=src python tools/bench_speculative.py single [--rounds 3]
    PYTHONPATH=src python tools/bench_speculative.py batch [--clients 1 4 16]

``single``: SmolLM2-135M-Instruct (``smollm2``), one request at a time,
greedy, chat template; a prompt-grounded workload (rewrite a paragraph, fix
a bug in given code) and open-ended chat, the prompts of
:mod:`structllm.bench.grounded` (``structllm bench throughput --workload
grounded --speculative-config JSON`` runs them through the bench). Two engines in this process, one
with ``speculative_config`` and one without, run the same prompts
alternately; reported per workload: median time per output token after
the first (TPOT, the inter-token latency a stream sees on average), output
tok/s, the acceptance rate, and whether the outputs are identical.

``batch``: C requests at once (``LLM.generate``, EOS ignored), with and
without speculation, output tok/s; with ``disable_by_batch_size`` off (the
default here) it speculates at any batch size: where it stops paying.

``crossover``: the same, measured in CPU time (the process's, one thread
each engine) per output token, which other work on a shared machine does
not inflate as it does wall time: where speculation stops paying for
the work it adds, which sets ``disable_by_batch_size``'s default.

``--draft REF`` adds a third engine, ``{"method": "draft_model", "model":
REF}`` with the same ``k``, to either command (``--draft smollm2``: the
target drafting for itself, every proposal right but each costing a
target-sized forward: an upper bound on acceptance, not on speed).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from structllm import LLM, SamplingParams
from structllm.bench.grounded import CHAT, GROUNDED
from structllm.bench.grounded import chat_prompt as grounded_chat_prompt

NGRAM: dict[str, Any] = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 5,
    "disable_by_batch_size": None,
}
DRAFT: dict[str, Any] = {
    "method": "draft_model",
    "model": None,  # --draft
    "num_speculative_tokens": 4,
    "disable_by_batch_size": None,
}


def chat_prompt(llm: LLM, text: str) -> list[int]:
    """``text`` as a user turn (as plain text where the model has no template)."""
    return grounded_chat_prompt(llm.tokenizer, text)


def one_stream(
    llm: LLM, prompt: list[int], max_tokens: int
) -> tuple[float, int, list[int]]:
    """(seconds per output token after the first, tokens, token ids)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    first = last = None
    tokens: list[int] = []
    for out in llm.stream({"prompt_token_ids": prompt}, params):
        now = time.perf_counter()
        tokens = list(out.outputs[0].token_ids)
        if first is None:
            first = now
        last = now
    assert first is not None and last is not None
    n = len(tokens)
    return (last - first) / max(1, n - 1), n, tokens


def spec_counts(llm: LLM) -> tuple[int, int]:
    s = llm.core.statistics().scheduler
    return s.num_draft_tokens, s.num_accepted_tokens


def engines_for(model: str, **kw: Any) -> dict[str, LLM]:
    """``none`` and ``ngram``, and ``draft`` when ``--draft`` names one."""
    engines = {
        "none": LLM(model, **kw),
        "ngram": LLM(model, speculative_config=NGRAM, **kw),
    }
    if DRAFT["model"] is not None:
        engines["draft"] = LLM(model, speculative_config=DRAFT, **kw)
    return engines


def single(args: argparse.Namespace) -> None:
    engines = engines_for("smollm2", show_progress=False)
    spec = [k for k in engines if k != "none"]
    for name, texts in [("grounded", GROUNDED), ("chat", CHAT)]:
        tpot: dict[str, list[float]] = {k: [] for k in engines}
        rate: dict[str, list[float]] = {k: [] for k in engines}
        same = dict.fromkeys(spec, True)
        drafted = dict.fromkeys(spec, 0)
        accepted = dict.fromkeys(spec, 0)
        llm0 = engines["none"]
        prompts = [chat_prompt(llm0, t) for t in texts]
        for r in range(args.rounds):
            for prompt in prompts:
                order = list(engines) if r % 2 == 0 else list(engines)[::-1]
                outs = {}
                for key in order:
                    llm = engines[key]
                    before = spec_counts(llm)
                    start = time.perf_counter()
                    s, n, toks = one_stream(llm, prompt, args.max_tokens)
                    wall = time.perf_counter() - start
                    after = spec_counts(llm)
                    tpot[key].append(s)
                    rate[key].append(n / wall)
                    outs[key] = toks
                    if key != "none":
                        drafted[key] += after[0] - before[0]
                        accepted[key] += after[1] - before[1]
                for key in spec:
                    same[key] &= outs["none"] == outs[key]
        p50 = {k: statistics.median(v) * 1000 for k, v in tpot.items()}
        tps = {k: statistics.median(v) for k, v in rate.items()}
        for key in spec:
            print(
                f"{name:9s} TPOT p50 none {p50['none']:.1f} ms, {key} "
                f"{p50[key]:.1f} ms: {p50['none'] / p50[key]:.2f}x; "
                f"tok/s {tps['none']:.1f} vs {tps[key]:.1f}; acceptance "
                f"{accepted[key]}/{drafted[key]} = "
                f"{accepted[key] / max(1, drafted[key]):.2f}; "
                f"identical: {same[key]}"
            )


def batch(args: argparse.Namespace) -> None:
    kw: dict[str, Any] = {"show_progress": False, "max_num_seqs": 16}
    engines = engines_for(args.model, **kw)
    llm0 = engines["none"]
    texts = [*GROUNDED, *CHAT] * 3
    for clients in args.clients:
        prompts = [
            {"prompt_token_ids": chat_prompt(llm0, texts[i % len(texts)])}
            for i in range(clients)
        ]
        params = SamplingParams(
            temperature=0, max_tokens=args.max_tokens, ignore_eos=True
        )
        rates: dict[str, list[float]] = {k: [] for k in engines}
        for r in range(args.rounds):
            order = list(engines) if r % 2 == 0 else list(engines)[::-1]
            for key in order:
                start = time.perf_counter()
                outs = engines[key].generate(prompts, params, use_tqdm=False)
                wall = time.perf_counter() - start
                n = sum(len(o.outputs[0].token_ids) for o in outs)
                rates[key].append(n / wall)
        med = {k: statistics.median(v) for k, v in rates.items()}
        print(
            f"{clients:3d} clients: output tok/s none {med['none']:.1f}"
            + "".join(
                f", {k} {v:.1f}: {v / med['none']:.2f}x"
                for k, v in med.items()
                if k != "none"
            )
        )


def crossover(args: argparse.Namespace) -> None:
    """CPU ms per output token, with and without speculation, per batch."""
    import tempfile
    from pathlib import Path

    from structllm.bench.model import write_bench_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model == "bench":
            model = str(Path(tmp) / "bench")
            write_bench_checkpoint(model)
        kw: dict[str, Any] = {
            "show_progress": False,
            "max_num_seqs": 16,
            "num_threads": 1,
            "max_model_len": 1024,
            "kv_cache_memory": 1 << 30,
        }
        engines = engines_for(model, **kw)
        llm0 = engines["none"]
        texts = [*GROUNDED, *CHAT] * 4
        params = SamplingParams(
            temperature=0, max_tokens=args.max_tokens, ignore_eos=True
        )
        for llm in engines.values():  # warm-up, not measured
            llm.generate([chat_prompt(llm0, texts[0])], params, use_tqdm=False)
        for clients in args.clients:
            prompts = [
                {"prompt_token_ids": chat_prompt(llm0, texts[i % len(texts)])}
                for i in range(clients)
            ]
            cpu: dict[str, list[float]] = {k: [] for k in engines}
            rate: dict[str, float] = {}
            for r in range(args.rounds):
                order = list(engines) if r % 2 == 0 else list(engines)[::-1]
                for key in order:
                    before = spec_counts(engines[key])
                    start = time.process_time()
                    outs = engines[key].generate(prompts, params, use_tqdm=False)
                    used = time.process_time() - start
                    n = sum(len(o.outputs[0].token_ids) for o in outs)
                    cpu[key].append(1e3 * used / n)
                    after = spec_counts(engines[key])
                    proposed = after[0] - before[0]
                    rate[key] = (after[1] - before[1]) / proposed if proposed else 0.0
            med = {k: statistics.median(v) for k, v in cpu.items()}
            print(
                f"{clients:3d} clients: CPU ms per output token none "
                f"{med['none']:.2f}"
                + "".join(
                    f", {k} {v:.2f} ({med['none'] / v:.2f}x, acceptance {rate[k]:.2f})"
                    for k, v in med.items()
                    if k != "none"
                ),
                flush=True,
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("single")
    s.add_argument("--rounds", type=int, default=2)
    s.add_argument("--max-tokens", type=int, default=128)
    b = sub.add_parser("batch")
    b.add_argument("--model", default="smollm2")
    b.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    b.add_argument("--rounds", type=int, default=2)
    b.add_argument("--max-tokens", type=int, default=64)
    b.add_argument(
        "--disable-by-batch-size",
        type=int,
        default=None,
        help="speculative_config's (default: none, speculate at any batch size)",
    )
    c = sub.add_parser("crossover")
    c.add_argument("--model", default="bench", help="bench: the 27.8M checkpoint")
    c.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16])
    c.add_argument("--rounds", type=int, default=3)
    c.add_argument("--max-tokens", type=int, default=64)
    for q in (s, b, c):
        q.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
        q.add_argument("--prompt-lookup-min", type=int, default=2)
        q.add_argument(
            "--draft",
            metavar="REF",
            default=None,
            help="also a draft model's proposals (any model reference)",
        )
    args = p.parse_args()
    for spec in (NGRAM, DRAFT):
        spec["num_speculative_tokens"] = args.num_speculative_tokens
        if args.command == "batch":
            spec["disable_by_batch_size"] = args.disable_by_batch_size
    NGRAM["prompt_lookup_min"] = args.prompt_lookup_min
    DRAFT["model"] = args.draft
    {"single": single, "batch": batch, "crossover": crossover}[args.command](args)


if __name__ == "__main__":
    main()
