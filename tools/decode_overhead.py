# Usage:
#   python tools/decode_overhead.py time GGUF [--threads 2] [--batch 1]
#       [--context 200] [--acts q8] [--reps 60]
#   python tools/decode_overhead.py check GGUF OUT.npz [--threads 2] [--acts q8]
#   python tools/decode_overhead.py compare A.npz B.npz
"""How much of a GGUF model's decode step is spent outside its matmuls.

``time``: a decode step of BATCH one-token sequences with CONTEXT cached
tokens each (``tools/decode_step.py``: random cache contents) through
``build_metadata``, ``forward`` and ``compute_logits``, then the step's
matmuls alone: every quantized projection's ``quant_kernels.matmul`` calls
(the head's included) on arrays of the step's shapes, as the step makes
them. Steps and matmul passes alternate, so the machine's load moves both
alike; medians of wall time and of the process's CPU time. The difference
is the step's time outside the matmul kernels: attention, norms, SwiGLU,
the embedding, metadata and the Python between them.

``check``: what a change to the step must leave exactly as it was, saved
to OUT.npz: the logits of the ``time`` step at batches 1 and 16, and
greedy tokens with their top-5 logprobs from the offline ``LLM``, one
stream and 16 at once; ``compare`` says whether two such files are equal
bit for bit. Save each side from a process that loaded the kernels from
numba's disk cache (run ``check`` twice after changing them): a process
that compiled them gave other bits than later ones, in both trees of an
A/B (2026-12: logits of the batch-16 step, or the 16-stream tokens).
"""

import argparse
import sys
import time
from typing import Any

import numpy as np
from decode_step import decode_step

from structllm.model import quant_kernels
from structllm.model._paddle import set_num_threads
from structllm.model.loader import load_model
from structllm.model.quantized import QuantizedLinear

BS = 16


def _load(args: argparse.Namespace) -> Any:
    set_num_threads(args.threads)  # as the engine core does: kernels and Paddle
    return load_model(
        args.gguf,
        num_threads=args.threads,
        quantized_activations=args.acts,
        max_model_len=1024,
    ).model


def _matmul_pass(model: Any, rows: int) -> tuple[Any, int]:
    """A function running the step's matmuls once on arrays of its shapes,
    and how many kernel calls that is."""
    calls: list[tuple[Any, ...]] = []
    linears = [lin for _, lin in model.weights.linears()]
    for lin in linears:
        if not isinstance(lin, QuantizedLinear):
            raise SystemExit(f"{type(lin).__name__} is not quantized: not a GGUF?")
        x = np.random.default_rng(0).standard_normal((rows, lin.in_features))
        x = x.astype(np.float32)
        for part in lin.parts:
            out = np.empty((rows, part.rows), np.float32)
            calls.append((x, part.raw, part.qtype, part.rows, lin.in_features, out))
    acts = linears[0].activations

    def run() -> None:
        for x, raw, qtype, n, k, out in calls:
            quant_kernels.matmul(x, raw, qtype, n, k, out=out, activations=acts)

    return run, len(calls)


def time_steps(args: argparse.Namespace) -> None:
    model = _load(args)
    step = decode_step(args.batch, args.context, BS)
    kv = model.allocate_kv_cache(step.num_blocks)
    step.fill(kv)
    matmuls, n_calls = _matmul_pass(model, args.batch)
    wall: dict[str, list[float]] = {"step": [], "matmuls": []}
    cpu: dict[str, list[float]] = {"step": [], "matmuls": []}
    for rep in range(args.reps + 5):
        for name, f in (("step", lambda: step.run(model, kv)), ("matmuls", matmuls)):
            c0, t0 = time.process_time(), time.perf_counter()
            f()
            t1, c1 = time.perf_counter(), time.process_time()
            if rep >= 5:
                wall[name].append(t1 - t0)
                cpu[name].append(c1 - c0)

    def ms(xs: list[float]) -> float:
        return 1e3 * float(np.median(xs))

    outside = [s - m for s, m in zip(wall["step"], wall["matmuls"], strict=True)]
    outside_cpu = [s - m for s, m in zip(cpu["step"], cpu["matmuls"], strict=True)]
    print(
        f"{args.gguf.rsplit('/', 1)[-1]} acts={args.acts} threads={args.threads} "
        f"B={args.batch} ctx={args.context}: step {ms(wall['step']):.2f} ms "
        f"(cpu {ms(cpu['step']):.2f}), matmuls {ms(wall['matmuls']):.2f} ms "
        f"(cpu {ms(cpu['matmuls']):.2f}, {n_calls} calls), outside "
        f"{ms(outside):.2f} ms (cpu {ms(outside_cpu):.2f})",
        flush=True,
    )


def check(args: argparse.Namespace) -> None:
    from structllm import LLM, SamplingParams

    found: dict[str, np.ndarray] = {}
    model = _load(args)
    for batch in (1, 16):
        step = decode_step(batch, 100, BS)
        kv = model.allocate_kv_cache(step.num_blocks)
        step.fill(kv)
        meta = model.attention.build_metadata(step.seqs)
        hidden = model.forward(step.ids, step.positions, kv, meta)
        found[f"logits_b{batch}"] = model.compute_logits(hidden).numpy()
    del model
    llm = LLM(
        args.gguf,
        num_threads=args.threads,
        quantized_activations=args.acts,
        num_blocks=64,
        max_model_len=1024,
        show_progress=False,
    )
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=5)
    prompts = [f"Write a short story number {i} about a lighthouse." for i in range(16)]
    for name, batch in (("one", prompts[:1]), ("sixteen", prompts)):
        outs = llm.generate(batch, params, use_tqdm=False)
        for i, out in enumerate(outs):
            c = out.outputs[0]
            found[f"{name}{i}_tokens"] = np.asarray(c.token_ids, np.int64)
            entries = [sorted(lp.items()) for lp in c.logprobs or ()]
            found[f"{name}{i}_logprobs"] = np.asarray(
                [[(t, v.logprob) for t, v in e] for e in entries], np.float64
            )
    np.savez(args.out, **found)
    print(f"saved {len(found)} arrays to {args.out}")


def compare(a_path: str, b_path: str) -> None:
    a, b = np.load(a_path), np.load(b_path)
    if set(a.files) != set(b.files):
        raise SystemExit(f"different arrays: {sorted(set(a.files) ^ set(b.files))}")
    bad = [k for k in a.files if not np.array_equal(a[k], b[k])]
    if bad:
        for k in bad:
            diff = np.abs(a[k].astype(np.float64) - b[k].astype(np.float64))
            print(f"{k}: differs, max |a - b| {diff.max():.3g}")
        raise SystemExit(1)
    print(f"identical: {len(a.files)} arrays")


def main() -> None:
    if sys.argv[1:2] == ["compare"]:
        compare(sys.argv[2], sys.argv[3])
        return
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["time", "check"])
    p.add_argument("gguf")
    p.add_argument("out", nargs="?")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--acts", default="q8")
    p.add_argument("--reps", type=int, default=60)
    args = p.parse_args()
    if args.mode == "time":
        time_steps(args)
    else:
        check(args)


if __name__ == "__main__":
    main()
