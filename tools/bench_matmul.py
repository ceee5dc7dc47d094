# Single-thread matmul GFLOP/s: eager paddle.matmul vs numpy/OpenBLAS.
# Usage: OMP_NUM_THREADS=1 python tools/bench_matmul.py
import time

import numpy as np

from structllm.model._paddle import paddle

paddle.base.core.set_num_threads(1)
try:
    import threadpoolctl

    threadpoolctl.threadpool_limits(1)
except ImportError:
    pass


def best(f, n=30):
    r = 1e9
    for _ in range(5):
        t = time.thread_time()
        for _ in range(n):
            f()
        r = min(r, (time.thread_time() - t) / n)
    return r


for m, k, n in [
    (16, 512, 1536),
    (16, 512, 3072),
    (16, 1536, 512),
    (1, 512, 3072),
    (256, 512, 3072),
]:
    a = np.random.rand(m, k).astype(np.float32)
    b = np.random.rand(k, n).astype(np.float32)
    pa, pb = paddle.to_tensor(a), paddle.to_tensor(b)
    tp = best(lambda pa=pa, pb=pb: paddle.matmul(pa, pb))
    tn = best(lambda a=a, b=b: a @ b)
    fl = 2 * m * k * n
    print(
        f"{m}x{k}x{n}: paddle {tp * 1e3:.3f} ms {fl / tp / 1e9:.1f} GF/s | numpy {tn * 1e3:.3f} ms {fl / tn / 1e9:.1f} GF/s"
    )
