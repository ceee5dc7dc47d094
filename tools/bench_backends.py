# Usage: python tools/bench_backends.py NUM_PROMPTS batch|b1 PAIRS
#   e.g. 16 batch 3 (max_num_seqs 16) and 4 b1 3 (batch-1 decode)
"""Alternating A/B: EngineCore throughput, eager vs inference backend, same workload."""

import sys
import tempfile
import time

import numpy as np

from structllm.bench.model import write_bench_checkpoint
from structllm.bench.throughput import make_workload
from structllm.config import EngineConfig
from structllm.core.engine_core import EngineCore
from structllm.core.request import CoreRequest
from structllm.params import SamplingParams

d = tempfile.mkdtemp()
write_bench_checkpoint(d)
work = make_workload(int(sys.argv[1]), (16, 256), (16, 128), 512, 0)
B1 = sys.argv[2] == "b1" if len(sys.argv) > 2 else False
cores = {
    b: EngineCore(
        EngineConfig(
            model=d,
            model_backend=b,
            max_num_seqs=1 if B1 else 16,
            max_model_len=4096,
            num_threads=2,
            kv_cache_memory=1 << 30,
        )
    )
    for b in ("eager", "inference")
}


def run(core):
    for i, (p, o) in enumerate(work):
        core.add_request(
            CoreRequest(
                request_id=str(i),
                prompt_token_ids=tuple(p),
                params=SamplingParams(temperature=0, max_tokens=o, ignore_eos=True),
            )
        )
    n = 0
    t = time.perf_counter()
    while core.has_unfinished_requests():
        n += sum(len(x.new_token_ids) for x in core.step().outputs)
    return n / (time.perf_counter() - t), n


for core in cores.values():  # warm-up
    core.add_request(
        CoreRequest(
            request_id="w",
            prompt_token_ids=tuple(work[0][0]),
            params=SamplingParams(max_tokens=4, ignore_eos=True),
        )
    )
    while core.has_unfinished_requests():
        core.step()
ratios = []
for r in range(int(sys.argv[3]) if len(sys.argv) > 3 else 3):
    e, n = run(cores["eager"])
    i, _ = run(cores["inference"])
    ratios.append(i / e)
    print(
        f"pair {r}: eager {e:.1f} tok/s, inference {i:.1f} tok/s, ratio {i / e:.2f} ({n} tokens)",
        flush=True,
    )
print("median ratio", float(np.median(ratios)))
