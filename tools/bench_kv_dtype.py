# Usage: python tools/bench_kv_dtype.py [BATCH] [CONTEXT] [STEPS]
#   e.g. 16 200 30, 16 400 20, 1 200 60
"""One decode step of the bench model over a float32 and a bfloat16 KV cache.

The same model and inputs; the two caches alternate step by step in one
process, so the machine's drift hits both alike. Prints the medians and
the median of the per-pair ratios (float32 time / bfloat16 time).
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
BS = 16


def main() -> None:
    set_num_threads(2)
    d = tempfile.mkdtemp()
    write_bench_checkpoint(d)
    step = decode_step(B, CTX, BS)
    model = load_model(d, backend="eager", num_threads=2).model
    caches = {}
    for kv in ("auto", "bfloat16"):
        model.set_kv_cache_dtype(kv)
        caches[kv] = model.allocate_kv_cache(step.num_blocks)
        step.fill(caches[kv])
    times: dict[str, list[float]] = {kv: [] for kv in caches}
    for _ in range(STEPS + 3):
        for kv, cache in caches.items():
            start = time.perf_counter()
            step.run(model, cache)
            times[kv].append(time.perf_counter() - start)
    full, half = np.array(times["auto"][3:]), np.array(times["bfloat16"][3:])
    print(
        f"B={B} ctx={CTX}: float32 KV {np.median(full) * 1e3:.2f} ms, bfloat16 KV "
        f"{np.median(half) * 1e3:.2f} ms, median pair ratio {np.median(full / half):.3f}"
    )


if __name__ == "__main__":
    main()
