# Usage: PYTHONPATH=src python tools/bench_tensor_parallel.py [BATCH] [CONTEXT] [REPS]
#   e.g. 16 200 30; PIN=1 pins rank r to CPU r
"""What tensor parallelism costs on CPU: the all-reduces of a decode step.

The 27.8M bench model (hidden 512, 8 layers, so 16 all-reduces of a
``(BATCH, 512)`` float32 tensor a step) decodes BATCH one-token sequences
with CONTEXT cached tokens each (random cache contents, as
tools/profile_step.py). TP=1 runs in this process with 1 and 2 Paddle
threads; TP=2 is two gloo ranks of 1 thread each (``paddle.distributed.spawn``).
Prints median step times, the time inside the all-reduces, and a lone
all-reduce of the same tensor timed back to back.
"""

import json
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
from decode_step import decode_step

from structllm.bench.model import write_bench_checkpoint
from structllm.model._paddle import paddle, set_num_threads
from structllm.model.config import ModelConfig
from structllm.model.llama import LlamaForCausalLM
from structllm.model.parallel import all_reduce_sum, load_shard, plan_shards

B = int(sys.argv[1]) if len(sys.argv) > 1 else 16
CTX = int(sys.argv[2]) if len(sys.argv) > 2 else 200
REPS = int(sys.argv[3]) if len(sys.argv) > 3 else 30
BS = 16


def step_times(
    m: LlamaForCausalLM, before_step: Callable[[], None] = lambda: None
) -> list[float]:
    """Seconds of each of REPS decode steps (after 3 warm-up steps)."""
    step = decode_step(B, CTX, BS)
    kv = m.allocate_kv_cache(step.num_blocks)
    step.fill(kv)
    times = []
    for _ in range(REPS + 3):
        before_step()
        t = time.perf_counter()
        step.run(m, kv)
        times.append(time.perf_counter() - t)
    return times[3:]


def rank_main(directory: Path) -> None:
    paddle.distributed.init_parallel_env()
    set_num_threads(1)
    rank = paddle.distributed.get_rank()
    if os.environ.get("PIN") == "1":
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    reduce_s: list[float] = []

    def timed_reduce(x: paddle.Tensor) -> paddle.Tensor:
        t = time.perf_counter()
        all_reduce_sum(x)
        reduce_s[-1] += time.perf_counter() - t
        return x

    def new_step() -> None:
        paddle.distributed.barrier()  # both ranks start the step together
        reduce_s.append(0.0)

    plan = plan_shards(ModelConfig.from_directory(directory), 2, rank)
    m = load_shard(directory, plan, block_size=BS, all_reduce=timed_reduce)
    steps = step_times(m, new_step)
    lone: dict[int, float] = {}
    for n in (1, B * plan.config.hidden_size):
        x = paddle.ones([n])
        times = []
        for _ in range(203):
            t = time.perf_counter()
            all_reduce_sum(x)
            times.append(time.perf_counter() - t)
        lone[n] = 1e3 * float(np.median(times[3:]))
    if rank == 0:
        result = {
            "step_ms": 1e3 * float(np.median(steps)),
            "reduce_per_step_ms": 1e3 * float(np.median(reduce_s[3:])),
            "reduces_per_step": 2 * plan.config.num_hidden_layers,
            "lone_reduce_ms": lone[B * plan.config.hidden_size],
            "lone_1_float_ms": lone[1],
        }
        (directory / "tp2.json").write_text(json.dumps(result))


def main() -> None:
    d = Path(tempfile.mkdtemp())
    write_bench_checkpoint(d)
    config = ModelConfig.from_directory(d)
    print(f"B={B} ctx={CTX} reps={REPS} load average {os.getloadavg()[0]:.1f}")
    for threads in (1, 2):
        set_num_threads(threads)
        m = load_shard(d, plan_shards(config, 1, 0), block_size=BS)
        ms = 1e3 * float(np.median(step_times(m)))
        print(f"TP=1, {threads} thread(s): step {ms:.1f} ms")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Your model will be trained under CPUONLY")
        paddle.distributed.spawn(rank_main, args=(d,), nprocs=2, backend="gloo")
    r = json.loads((d / "tp2.json").read_text())
    n = r["reduces_per_step"]
    print(
        f"TP=2, 1 thread a rank: step {r['step_ms']:.1f} ms, of which "
        f"{r['reduce_per_step_ms']:.2f} ms in {n} all-reduces "
        f"({r['reduce_per_step_ms'] / n:.3f} ms each); "
        f"a lone ({B}, {config.hidden_size}) all-reduce {r['lone_reduce_ms']:.3f} ms"
        f", of one float {r['lone_1_float_ms']:.3f} ms"
    )
    print(f"load average after {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
