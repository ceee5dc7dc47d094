# Usage: python tools/profile_step.py [BATCH] [CONTEXT] [REPS] [BACKENDS] [PREFILL]
#   e.g. 16 200 20 and 1 200 50; BACKENDS: comma-separated, in order
#   (default eager,inference). Give one backend a process to time it alone:
#   a process that has built oneDNN predictors runs eager Paddle slower.
#   PREFILL: also time the same step with one prompt of that many tokens
#   added (the step a new request's first token waits for under load:
#   16 200 20 eager 40). KERNELS=0: attention by Paddle ops instead of the
#   CPU kernels; KV_CACHE_DTYPE=bfloat16: a bfloat16 KV cache.
"""Where one decode step of the bench model spends its time, both backends.

Times ``build_metadata``, ``forward`` + ``compute_logits``, and inside them
the attention calls and the predictor calls (wrapped with timers), median
over REPS steps; BATCH one-token sequences with CONTEXT cached tokens each.
With PREFILL, the decode step alternates with a mixed one (the same decode
rows and a PREFILL-token prompt, the prompt's last row sampled as the
engine samples it) and a step of that prompt alone, and each line gives the
process's CPU time next to the wall time: on a shared machine CPU time
moves less with the load, and the mixed/decode ratio is what a new
request's first token pays (docs/benchmarks.md, "Where time to first token
goes").
"""

import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from decode_step import decode_step

from structllm.bench.model import write_bench_checkpoint
from structllm.model._paddle import paddle, set_num_threads
from structllm.model.attention import SequenceSlice
from structllm.model.loader import load_model

B = int(sys.argv[1]) if len(sys.argv) > 1 else 16
CTX = int(sys.argv[2]) if len(sys.argv) > 2 else 200
REPS = int(sys.argv[3]) if len(sys.argv) > 3 else 20
BACKENDS = sys.argv[4].split(",") if len(sys.argv) > 4 else ["eager", "inference"]
PREFILL = int(sys.argv[5]) if len(sys.argv) > 5 else 0
BS = 16
timers: dict[str, list[float]] = {}


def timed(label: str, f: Callable[..., Any]) -> Callable[..., Any]:
    def call(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        r = f(*a, **k)
        timers.setdefault(label, [0.0])[-1] += time.perf_counter() - t
        return r

    return call


def med(xs: list[float]) -> float:
    return 1e3 * float(np.median(xs[3:]))


def with_prompt(
    seqs: list[SequenceSlice], n: int, first_block: int
) -> tuple[list[SequenceSlice], paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    """``seqs`` plus one ``n``-token prompt in blocks from ``first_block``:
    the slices, token ids, positions and the rows to sample (the decode
    rows and the prompt's last)."""
    blocks = list(range(first_block, first_block + -(-n // BS)))
    mixed = [*seqs, SequenceSlice(0, n, blocks)]
    rng = np.random.default_rng(1)
    positions = [s.context_len for s in seqs] + list(range(n))
    rows = [*range(len(seqs)), len(seqs) + n - 1]
    return (
        mixed,
        paddle.to_tensor(rng.integers(0, 512, len(positions)).astype(np.int64)),
        paddle.to_tensor(np.array(positions, np.int64)),
        paddle.to_tensor(np.array(rows, np.int64)),
    )


def main() -> None:
    set_num_threads(2)
    d = tempfile.mkdtemp()
    write_bench_checkpoint(d)
    step = decode_step(B, CTX, BS)
    prompt_blocks = -(-PREFILL // BS)
    for backend in BACKENDS:
        m = load_model(d, backend=backend, num_threads=2).model
        m.attention.use_kernels = os.environ.get("KERNELS", "1") == "1"
        m.set_kv_cache_dtype(os.environ.get("KV_CACHE_DTYPE", "auto"))
        kv = m.allocate_kv_cache(step.num_blocks + prompt_blocks)
        step.fill(kv)
        if PREFILL:
            mixed_steps(m, kv, step.seqs, step.ids, step.positions, step.num_blocks)
            continue
        m.attention.forward = timed("attention", m.attention.forward)
        m.attention.forward_qkv = timed("attention", m.attention.forward_qkv)
        for name in ("_first", "_last", "_head"):
            if hasattr(m, name):
                setattr(m, name, timed("predictors", getattr(m, name)))
        if hasattr(m, "_mid"):
            m._mid = [timed("predictors", p) for p in m._mid]
        totals, metas = [], []
        for _ in range(REPS + 3):
            for v in timers.values():
                v.append(0.0)
            t0 = time.perf_counter()
            meta = m.attention.build_metadata(step.seqs)
            t1 = time.perf_counter()
            m.compute_logits(m.forward(step.ids, step.positions, kv, meta)).numpy()
            totals.append(time.perf_counter() - t1)
            metas.append(t1 - t0)
        parts = ", ".join(f"{k} {med(v):.2f} ms" for k, v in timers.items())
        print(
            f"{backend:9s} B={B} ctx={CTX}: metadata {med(metas):.2f} ms, "
            f"forward+logits {med(totals):.2f} ms; {parts}",
            flush=True,
        )
        timers.clear()


def mixed_steps(
    m: Any,
    kv: Any,
    seqs: list[SequenceSlice],
    ids: paddle.Tensor,
    positions: paddle.Tensor,
    first_block: int,
) -> None:
    """The decode step, the same with a PREFILL-token prompt, and the prompt
    alone, alternating; wall and CPU medians of each, and mixed/decode."""
    mixed = with_prompt(seqs, PREFILL, first_block)
    alone = with_prompt([], PREFILL, first_block)
    steps = {
        f"{B} decodes": (seqs, ids, positions, None),
        f"{B} decodes + {PREFILL}-token prompt": mixed,
        f"{PREFILL}-token prompt alone": alone,
    }
    wall: dict[str, list[float]] = {k: [] for k in steps}
    cpu: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(REPS + 3):
        for name, (s, t, p, rows) in steps.items():
            w0, c0 = time.perf_counter(), time.process_time()
            hidden = m.forward(t, p, kv, m.attention.build_metadata(s))
            if rows is not None:
                hidden = paddle.gather(hidden, rows)
            m.compute_logits(hidden).numpy()
            wall[name].append(time.perf_counter() - w0)
            cpu[name].append(time.process_time() - c0)
    base_wall, base_cpu = med(wall[f"{B} decodes"]), med(cpu[f"{B} decodes"])
    for name in steps:
        w, c = med(wall[name]), med(cpu[name])
        print(
            f"{name:34s} ctx={CTX}: wall {w:7.2f} ms ({w / base_wall:.2f}x), "
            f"CPU {c:7.2f} ms ({c / base_cpu:.2f}x)",
            flush=True,
        )


if __name__ == "__main__":
    main()
