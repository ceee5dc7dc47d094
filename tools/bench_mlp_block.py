# Eager Paddle vs Paddle Inference + oneDNN on the bench model's MLP block.
# Usage: python tools/bench_mlp_block.py
import tempfile
import time

import numpy as np
import paddle.inference as pi

from structllm.model._paddle import paddle

paddle.base.core.set_num_threads(2)
H, INTER = 512, 1536


def rms(x, w):
    return x * paddle.rsqrt((x * x).mean(axis=-1, keepdim=True) + 1e-6) * w


class MLP(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.norm = self.create_parameter(
            [H], default_initializer=paddle.nn.initializer.Constant(1.0)
        )
        self.gu = self.create_parameter([H, 2 * INTER])
        self.down = self.create_parameter([INTER, H])

    def forward(self, x):
        h = rms(x, self.norm)
        return x + paddle.matmul(
            paddle.nn.functional.swiglu(paddle.matmul(h, self.gu)), self.down
        )


paddle.seed(0)
m = MLP()
m.eval()

path = tempfile.mkdtemp() + "/mlp"
t0 = time.perf_counter()
st = paddle.jit.to_static(
    m, input_spec=[paddle.static.InputSpec([None, H], "float32")], full_graph=True
)
paddle.jit.save(st, path)
t1 = time.perf_counter()


def predictor(mkldnn):
    cfg = pi.Config(path + ".json", path + ".pdiparams")
    cfg.disable_gpu()
    cfg.set_cpu_math_library_num_threads(2)
    cfg.enable_mkldnn() if mkldnn else cfg.disable_mkldnn()
    cfg.disable_glog_info()
    return pi.create_predictor(cfg)


p = predictor(True)
t2 = time.perf_counter()
print(f"to_static+save {t1 - t0:.2f}s, predictor {t2 - t1:.2f}s")


def best(f, n=30):
    r = 1e9
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            f()
        r = min(r, (time.perf_counter() - t) / n)
    return r


inp = p.get_input_handle(p.get_input_names()[0])
out = p.get_output_handle(p.get_output_names()[0])
for T in (1, 16, 256):
    x = np.random.rand(T, H).astype(np.float32)

    def run(x=x):
        inp.reshape(x.shape)
        inp.copy_from_cpu(x)
        p.run()
        return out.copy_to_cpu()

    px = paddle.to_tensor(x)
    ref = m(px).numpy()
    got = run()
    te = best(lambda px=px: m(px))
    ts = best(run)
    print(
        f"T={T}: eager {te * 1e3:.3f} ms, inference+onednn {ts * 1e3:.3f} ms, x{te / ts:.2f}, max diff {np.abs(ref - got).max():.2e}"
    )
