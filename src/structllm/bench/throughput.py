"""``structllm bench throughput``: offline tokens/s, structllm vs transformers.

Every system gets the same checkpoint, the same prompts (token ids) and the
same number of output tokens per prompt (EOS ignored), in one run, so the
ratios are meaningful on a noisy machine. transformers runs in a child
process (torch and Paddle each bring their own math libraries), with the
same thread count, and only if ``torch`` and ``transformers`` import.

``--speculative-config JSON`` (vLLM's form, as ``serve`` takes it) runs
structllm's engines with speculative decoding and adds the same run
without it right after (``structllm, no speculation``); each speculating
system reports its proposed and accepted tokens and the acceptance rate.
``--workload grounded`` (rewrite, summarise, edit given text or code:
where prompt lookup pays) or ``chat`` (open-ended) sends real prompts in
the model's chat template instead of random token ids
(:mod:`structllm.bench.grounded`); they are meant for a real model, such as
``--model smollm2``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import attrs
import numpy as np

from structllm.bench.hf import run_baselines
from structllm.bench.model import add_bench_model_args, bench_engine_args, bench_model
from structllm.bench.throughput_report import print_report
from structllm.config import EngineConfig, add_arguments
from structllm.errors import EngineConfigError
from structllm.speculative_config import SpeculativeConfig, speculative_config

__all__ = ["add_throughput_args", "make_workload", "run_throughput"]


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    add_bench_model_args(p)
    add_arguments(p, EngineConfig, only=("speculative_config",))
    p.add_argument(
        "--workload",
        default="random",
        choices=["random", "grounded", "chat"],
        help="random token ids (--input-len), or real prompts that rewrite or "
        "edit given text (grounded) or chat openly (chat), for a real --model",
    )
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument(
        "--input-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX")
    )
    p.add_argument(
        "--output-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX")
    )
    p.add_argument(
        "--batch-size", type=int, default=16, help="static batch size for HF"
    )
    p.add_argument(
        "--hf",
        default="auto",
        choices=["auto", "off"],
        help="run the transformers baselines when torch is importable",
    )
    p.add_argument(
        "--hf-python", default=sys.executable, help="python with torch + transformers"
    )
    p.add_argument("--hf-modes", default="single,static,continuous")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--skip-async", action="store_true", help="skip the AsyncLLM run")
    p.add_argument(
        "--compare-backend",
        default="eager",
        choices=["eager", "inference", "none"],
        help="also run LLM.generate with this model_backend (default: auto)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="EngineCore / AsyncLLM runs, alternating (median reported)",
    )


def make_workload(
    n: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab: int,
    seed: int,
) -> list[tuple[list[int], int]]:
    """``n`` (prompt token ids, output length) pairs, deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        plen = int(rng.integers(input_len[0], input_len[1] + 1))
        olen = int(rng.integers(output_len[0], output_len[1] + 1))
        out.append((rng.integers(3, vocab, size=plen).tolist(), olen))
    return out


def _model_shape(model: str) -> dict[str, int]:
    """hidden_size, num_hidden_layers and vocab_size of any model reference."""
    from structllm.model.config import ModelConfig
    from structllm.models import resolve_model

    config = ModelConfig.from_path(resolve_model(model))
    return {
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "vocab_size": config.vocab_size,
    }


def _workload(
    ns: argparse.Namespace, model: str, vocab: int
) -> list[tuple[list[int], int]]:
    if ns.workload == "random":
        return make_workload(
            ns.num_prompts, tuple(ns.input_len), tuple(ns.output_len), vocab, ns.seed
        )
    from structllm.bench.grounded import text_workload
    from structllm.text.tokenizer import load_tokenizer

    return text_workload(
        ns.workload,
        ns.num_prompts,
        tuple(ns.output_len),
        load_tokenizer(model),
        ns.seed,
    )


def run_throughput(ns: argparse.Namespace) -> int:
    from structllm.model._paddle import default_num_threads

    threads = ns.num_threads or default_num_threads()
    try:
        spec = speculative_config(ns.speculative_config)
    except EngineConfigError as exc:  # names the setting: no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        model = bench_model(ns, Path(tmp))
        shape = _model_shape(model)
        work = _workload(ns, model, shape["vocab_size"])
        total_out = sum(o for _, o in work)
        results: dict[str, Any] = {
            "model": shape,
            "workload": ns.workload,
            "speculative_config": None if spec is None else attrs.asdict(spec),
            "num_prompts": len(work),
            "input_tokens": sum(len(p) for p, _ in work),
            "output_tokens": total_out,
            "threads": threads,
            "systems": {},
        }
        results["systems"]["structllm"] = _bench_structllm(
            model, work, ns, threads, spec=spec
        )
        if spec is not None:  # the same without speculation, right after
            results["systems"]["structllm, no speculation"] = _bench_structllm(
                model, work, ns, threads
            )
        if ns.compare_backend != "none":
            # the same run on another model backend, right after
            name = f"structllm, {ns.compare_backend} backend"
            results["systems"][name] = _bench_structllm(
                model, work, ns, threads, backend=ns.compare_backend, spec=spec
            )
        # core and front end alternate, so drift on a noisy machine hits both;
        # the overhead is the median of the per-pair ratios
        cores, fronts = [], []
        for _ in range(ns.repeats):
            cores.append(_bench_core(model, work, ns, threads, spec))
            if not ns.skip_async:
                fronts.append(anyio.run(_bench_async, model, work, ns, threads, spec))
        results["systems"]["structllm EngineCore (direct)"] = _median_run(cores)
        if fronts:
            results["systems"]["structllm AsyncLLM (core process)"] = _median_run(
                fronts
            )
            ratios = [
                c["tokens_per_s"] / f["tokens_per_s"] - 1
                for c, f in zip(cores, fronts, strict=True)
            ]
            results["frontend_overhead"] = float(np.median(ratios))
            results["frontend_overhead_runs"] = ratios
        results["overhead"] = _bench_overhead(model, ns, threads, shape["vocab_size"])
        if ns.hf != "off":
            results["systems"].update(run_baselines(ns, model, work, threads))
    print_report(results)
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, indent=2))
    return 0


def _bench_structllm(
    model: str,
    work: list[tuple[list[int], int]],
    ns: argparse.Namespace,
    threads: int,
    backend: str = "auto",
    spec: SpeculativeConfig | None = None,
) -> dict[str, float]:
    from structllm.llm import LLM
    from structllm.params import SamplingParams

    llm = LLM(
        model,
        show_progress=False,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        num_threads=threads,
        max_model_len=4096,
        kv_cache_memory=2 << 30,
        model_backend=backend,
        speculative_config=spec,
    )
    # warm-up: one short request, not timed
    llm.generate(
        [_warmup_prompt(work)],
        SamplingParams(max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    params = [
        SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in work
    ]
    before = _spec_counts(llm.core.statistics().scheduler)
    start = time.perf_counter()
    outs = llm.generate(
        [{"prompt_token_ids": p} for p, _ in work], params, use_tqdm=False
    )
    elapsed = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outs)
    after = _spec_counts(llm.core.statistics().scheduler)
    return {
        "seconds": elapsed,
        "output_tokens": produced,
        "tokens_per_s": produced / elapsed,
        **_acceptance(spec, before, after),
    }


def _spec_counts(stats: Any) -> tuple[int, int]:
    """(proposed, accepted) tokens of a scheduler's statistics."""
    return stats.num_draft_tokens, stats.num_accepted_tokens


def _acceptance(
    spec: SpeculativeConfig | None, before: tuple[int, int], after: tuple[int, int]
) -> dict[str, float]:
    """A speculating system's proposed and accepted tokens over the timed
    run, and their ratio (nothing for a system that does not speculate)."""
    if spec is None:
        return {}
    proposed, accepted = after[0] - before[0], after[1] - before[1]
    return {
        "proposed_tokens": proposed,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
    }


def _warmup_prompt(work: list[tuple[list[int], int]]) -> list[int]:
    """The longest prompt: warming up with it grows every buffer once, untimed."""
    return max((p for p, _ in work), key=len)


def _median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"])
    return ordered[len(ordered) // 2]


def _bench_core(
    model: str,
    work: list[tuple[list[int], int]],
    ns: argparse.Namespace,
    threads: int,
    spec: SpeculativeConfig | None = None,
) -> dict[str, float]:
    """The engine core stepped directly: no tokenizer, no front end."""
    from structllm.config import EngineConfig
    from structllm.core.engine_core import EngineCore
    from structllm.core.request import CoreRequest
    from structllm.params import SamplingParams

    args = bench_engine_args(ns, threads)
    core = EngineCore(EngineConfig(model=model, speculative_config=spec, **args))
    for i, (p, o) in enumerate([(_warmup_prompt(work), 8), *work]):
        core.add_request(
            CoreRequest(
                request_id=str(i),
                prompt_token_ids=tuple(p),
                params=SamplingParams(temperature=0, max_tokens=o, ignore_eos=True),
            )
        )
        if i == 0:  # warm-up request, not timed
            while core.has_unfinished_requests():
                core.step()
            before = _spec_counts(core.statistics().scheduler)
            start = time.perf_counter()
    produced = 0
    while core.has_unfinished_requests():
        produced += sum(len(o.new_token_ids) for o in core.step().outputs)
    elapsed = time.perf_counter() - start
    after = _spec_counts(core.statistics().scheduler)
    return {
        "seconds": elapsed,
        "output_tokens": produced,
        "tokens_per_s": produced / elapsed,
        **_acceptance(spec, before, after),
    }


async def _bench_async(
    model: str,
    work: list[tuple[list[int], int]],
    ns: argparse.Namespace,
    threads: int,
    spec: SpeculativeConfig | None = None,
) -> dict[str, float]:
    """All prompts at once through AsyncLLM with its core process."""
    from structllm.engine.frontend.async_llm import AsyncLLM
    from structllm.params import SamplingParams

    produced = 0

    async with AsyncLLM.open(
        model,
        executor="process",
        show_progress=False,
        speculative_config=spec,
        **bench_engine_args(ns, threads),
    ) as llm:
        await llm.complete(
            {"prompt_token_ids": _warmup_prompt(work)}, SamplingParams(max_tokens=8)
        )

        async def one(prompt: list[int], n: int) -> None:
            nonlocal produced
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            out = await llm.complete({"prompt_token_ids": prompt}, params)
            produced += len(out.token_ids)

        s = llm.statistics()
        before = s.spec_decode_num_draft_tokens, s.spec_decode_num_accepted_tokens
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for p, o in work:
                tg.start_soon(one, p, o)
        elapsed = time.perf_counter() - start
        s = llm.statistics()
        after = s.spec_decode_num_draft_tokens, s.spec_decode_num_accepted_tokens
    return {
        "seconds": elapsed,
        "output_tokens": produced,
        "tokens_per_s": produced / elapsed,
        **_acceptance(spec, before, after),
    }


def _bench_overhead(
    model: str, ns: argparse.Namespace, threads: int, vocab: int
) -> dict[str, float]:
    """Decode steps at batch ``max_num_seqs``: step wall time / forward time."""
    from structllm.config import EngineConfig
    from structllm.core.engine_core import EngineCore
    from structllm.core.request import CoreRequest
    from structllm.params import SamplingParams

    core = EngineCore(
        EngineConfig(
            model=model,
            max_num_seqs=ns.max_num_seqs,
            num_threads=threads,
            max_model_len=1024,
            kv_cache_memory=1 << 30,
        )
    )
    rng = np.random.default_rng(ns.seed)
    for i in range(ns.max_num_seqs):
        core.add_request(
            CoreRequest(
                request_id=str(i),
                prompt_token_ids=tuple(rng.integers(3, vocab, 64).tolist()),
                params=SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
            )
        )
    total = forward = 0.0
    steps = 0
    while core.has_unfinished_requests():
        s = core.step()
        if s.num_seqs == ns.max_num_seqs and s.num_batched_tokens == ns.max_num_seqs:
            total += s.total_s
            forward += s.forward_s
            steps += 1
    return {
        "batch": ns.max_num_seqs,
        "decode_steps": steps,
        "step_ms": 1e3 * total / steps,
        "forward_ms": 1e3 * forward / steps,
        "overhead": total / forward - 1.0,
    }
