# Usage: python tools/profile_step.py [BATCH] [CONTEXT] [REPS] [BACKENDS]
#   e.g. 16 200 20 and 1 200 50; BACKENDS: comma-separated, in order
#   (default eager,inference). Give one backend a process to time it alone:
#   a process that has built oneDNN predictors runs eager Paddle slower.
#   KERNELS=0: attention by Paddle ops instead of the CPU kernels;
#   KV_CACHE_DTYPE=bfloat16: a bfloat16 KV cache.
"""Where one decode step of the bench model spends its time, both backends.

Times ``build_metadata``, ``forward`` + ``compute_logits``, and inside them
the attention calls and the predictor calls (wrapped with timers), median
over REPS steps; BATCH one-token sequences with CONTEXT cached tokens each.
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
from structllm.model._paddle import set_num_threads
from structllm.model.loader import load_model

B = int(sys.argv[1]) if len(sys.argv) > 1 else 16
CTX = int(sys.argv[2]) if len(sys.argv) > 2 else 200
REPS = int(sys.argv[3]) if len(sys.argv) > 3 else 20
BACKENDS = sys.argv[4].split(",") if len(sys.argv) > 4 else ["eager", "inference"]
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


def main() -> None:
    set_num_threads(2)
    d = tempfile.mkdtemp()
    write_bench_checkpoint(d)
    step = decode_step(B, CTX, BS)
    for backend in BACKENDS:
        m = load_model(d, backend=backend, num_threads=2).model
        m.attention.use_kernels = os.environ.get("KERNELS", "1") == "1"
        m.set_kv_cache_dtype(os.environ.get("KV_CACHE_DTYPE", "auto"))
        kv = m.allocate_kv_cache(step.num_blocks)
        step.fill(kv)
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


if __name__ == "__main__":
    main()
