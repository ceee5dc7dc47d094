# Usage: python tools/bench_backends.py NUM_PROMPTS batch|b1 PAIRS [procs]
#   e.g. 16 batch 3 (max_num_seqs 16) and 4 b1 3 (batch-1 decode)
#   procs: every run in a fresh process (alternating eager, inference). Use
#   it on Intel CPUs: a process that has built oneDNN predictors runs eager
#   Paddle slower, so the in-process pairs understate eager there.
"""Alternating A/B: EngineCore throughput, eager vs inference backend, same workload."""

import os
import subprocess
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

NUM = int(sys.argv[1])
B1 = sys.argv[2] == "b1" if len(sys.argv) > 2 else False
PAIRS = int(sys.argv[3]) if len(sys.argv) > 3 else 3
MODE = sys.argv[4] if len(sys.argv) > 4 else "same"
BACKENDS = ("eager", "inference")
work = make_workload(NUM, (16, 256), (16, 128), 512, 0)


def make_core(d, backend):
    return EngineCore(
        EngineConfig(
            model=d,
            model_backend=backend,
            max_num_seqs=1 if B1 else 16,
            max_model_len=4096,
            num_threads=2,
            kv_cache_memory=1 << 30,
        )
    )


def warm_up(core):
    core.add_request(
        CoreRequest(
            request_id="w",
            prompt_token_ids=tuple(work[0][0]),
            params=SamplingParams(max_tokens=4, ignore_eos=True),
        )
    )
    while core.has_unfinished_requests():
        core.step()


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


def load() -> str:
    return f"load {os.getloadavg()[0]:.1f}"


if MODE.startswith("one:"):  # a child of the procs mode
    core = make_core(os.environ["BENCH_MODEL"], MODE[4:])
    warm_up(core)
    print(*run(core))
    sys.exit()

d = tempfile.mkdtemp()
write_bench_checkpoint(d)
ratios = []
if MODE == "procs":
    env = {**os.environ, "BENCH_MODEL": d}

    def run_in_child(backend):
        argv = [sys.executable, __file__, *sys.argv[1:3], "1", "one:" + backend]
        out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True)
        tok_s, n = out.stdout.split()[-2:]
        return float(tok_s), int(n)

    runs = dict.fromkeys(BACKENDS, run_in_child)
else:
    cores = {b: make_core(d, b) for b in BACKENDS}
    for core in cores.values():
        warm_up(core)
    runs = {b: (lambda b, c=cores[b]: run(c)) for b in BACKENDS}
for r in range(PAIRS):
    before = load()
    e, n = runs["eager"]("eager")
    i, _ = runs["inference"]("inference")
    ratios.append(i / e)
    print(
        f"pair {r} ({before}): eager {e:.1f} tok/s, inference {i:.1f} tok/s, "
        f"ratio {i / e:.2f} ({n} tokens)",
        flush=True,
    )
print("median ratio", float(np.median(ratios)))
