"""Packed float32 panels (model/panel_kernels.py) against Paddle's matmul.

The 27.8M bench checkpoint's 32 projections (8 layers of qkv 512 -> 1536,
o 512 -> 512, gate_up 512 -> 3072, down 1536 -> 512; random weights), one
step's worth at each row count: ``panel_kernels.matmul`` on the packed
weights against ``paddle.matmul`` on the ``(in, out)`` tensors a
``DenseLinear`` holds, into preallocated outputs, timed in turns (best of
``--repeats`` steps, 3 turns each). Both on ``--threads`` threads. Prints
ms a step, GB/s of weights (a step reads each weight once) and the ratio.

Usage:
  python tools/bench_panels.py [--threads 2] [--rows 1 4 8 16 32 64 256]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

SHAPES = [(1536, 512), (512, 512), (3072, 512), (512, 1536)] * 8  # (out, in)


def _best(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(3):
        for name, fn in fns.items():
            fn()
            start = time.perf_counter()
            for _ in range(repeats):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / repeats)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 256])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    from structllm.model import panel_kernels
    from structllm.model._paddle import paddle, set_num_threads

    set_num_threads(args.threads)  # Paddle's and the kernels'
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal(s, dtype=np.float32) for s in SHAPES]
    panels = [panel_kernels.pack(w) for w in weights]
    tensors = [paddle.to_tensor(np.ascontiguousarray(w.T)) for w in weights]
    gb = sum(w.nbytes for w in weights) / 1e9
    print(f"{len(weights)} weights, {gb * 1e3:.0f} MB, {args.threads} threads")
    for rows in args.rows:
        x = rng.standard_normal((rows, 1536), dtype=np.float32)
        xs = {n: np.ascontiguousarray(x[:, :n]) for n in (512, 1536)}
        xt = {n: paddle.to_tensor(v) for n, v in xs.items()}
        outs = [np.empty((rows, out), np.float32) for out, _ in SHAPES]
        touts = [paddle.empty([rows, out], "float32") for out, _ in SHAPES]

        def packed(xs: dict = xs, outs: list = outs) -> None:
            for (_, n), w, o in zip(SHAPES, panels, outs, strict=True):
                panel_kernels.matmul(xs[n], w, o)

        def dense(xt: dict = xt, touts: list = touts) -> None:
            for (_, n), w, o in zip(SHAPES, tensors, touts, strict=True):
                paddle.matmul(xt[n], w, out=o)

        best = _best({"panels": packed, "paddle": dense}, args.repeats)
        a, b = best["panels"], best["paddle"]
        print(
            f"rows {rows:4d}: panels {a * 1e3:7.2f} ms ({gb / a:5.1f} GB/s), "
            f"paddle {b * 1e3:7.2f} ms ({gb / b:5.1f} GB/s): {b / a:.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
