# Usage: python tools/bench_kv_dtype.py [BATCH] [CONTEXT] [STEPS] [MODEL]
#   e.g. 16 200 30, 16 400 20, 1 200 60; MODEL: a checkpoint or GGUF file
#   (default: the bench checkpoint, written to a temporary folder)
"""One decode step of a model over a float32, a bfloat16 and a float16 KV
cache.

The same model and inputs; the caches alternate step by step in one
process, so the machine's drift hits all alike. Prints the medians and
the median of the per-step ratios (float32 time / 16-bit time).
"""

import sys
import tempfile
import time

import numpy as np
from decode_step import decode_step

from structllm.bench.model import write_bench_checkpoint
from structllm.model._paddle import set_num_threads
from structllm.model.loader import load_model

B = int(sys.argv[1]) if len(sys.argv) > 1 else 16
CTX = int(sys.argv[2]) if len(sys.argv) > 2 else 200
STEPS = int(sys.argv[3]) if len(sys.argv) > 3 else 30
MODEL = sys.argv[4] if len(sys.argv) > 4 else None
BS = 16
KINDS = ("auto", "bfloat16", "float16")


def main() -> None:
    set_num_threads(2)
    if MODEL is None:
        path = tempfile.mkdtemp()
        write_bench_checkpoint(path)
    else:
        path = MODEL
    step = decode_step(B, CTX, BS)
    model = load_model(path, backend="eager", num_threads=2).model
    caches = {}
    for kv in KINDS:
        model.set_kv_cache_dtype(kv)
        caches[kv] = model.allocate_kv_cache(step.num_blocks)
        step.fill(caches[kv])
    times: dict[str, list[float]] = {kv: [] for kv in caches}
    for _ in range(STEPS + 3):
        for kv, cache in caches.items():
            start = time.perf_counter()
            step.run(model, cache)
            times[kv].append(time.perf_counter() - start)
    full = np.array(times["auto"][3:])
    report = [f"B={B} ctx={CTX}: float32 KV {np.median(full) * 1e3:.2f} ms"]
    for kv in KINDS[1:]:
        half = np.array(times[kv][3:])
        report.append(
            f"{kv} KV {np.median(half) * 1e3:.2f} ms (ratio {np.median(full / half):.3f})"
        )
    print(", ".join(report))


if __name__ == "__main__":
    main()
