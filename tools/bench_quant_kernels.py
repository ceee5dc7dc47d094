"""Quantized matmul kernels (model/quant_kernels.py) against numpy float32.

SmolLM2-135M's projections for one decode step: 30 layers of qkv (576 ->
960), o (576 -> 576), gate_up (576 -> 3072) and down (1536 -> 576), and the
tied head (576 -> 49152, Q8_0 as in the published GGUF files), at batch 1
and 16. For each weight type: time a token, GB/s of weight bytes read (a
step reads the weights once whatever the batch), and the same step as
numpy's float32 ``x @ W.T`` on the dequantized weights, timed in turns with
it (best of N each: the machine is shared). Each thread count runs in its
own process, numpy's OpenBLAS limited to the same count.

``--baseline FILE`` also times another copy of quant_kernels.py (say
``git show main:src/structllm/model/quant_kernels.py > /tmp/old.py``) in
the same turns, so a kernel change is measured against the old one side by
side; the load average is printed with each row.

``--activations q8`` times this copy with ``matmul(..., activations="q8")``
(the baseline with its default, float activations); with ``--kernels``
the baseline takes the same activations, and without a baseline this
copy's float activations are the baseline column.

``--kernels`` times each kernel alone on one thread (``threaded=False``):
for each type, each of SmolLM2's matrix shapes its blocks divide, ``T`` of
1, 2, 4, 8 and 16 tokens, a "step" of 30 copies of the matrix (as 30
layers: weights from L3, not L2) called once each; the figure is one
thread's CPU time a call (``time.thread_time``, which preemption by other
processes does not inflate), the median of ``--repeats`` steps, and GB/s
of weight bytes over it. With ``--baseline`` the old copy runs the same
steps alternately with this one. With ``--gguf FILE`` it then times the
file's own step (every projection and the head, each tensor in its own
type), summed by weight type. Runs in this process, no children.

``--prefill T`` compares, for T tokens through gate_up and down, the
kernel with dequantizing 256-row tiles into numpy's BLAS and with float32.

``--peaks``: one thread's arithmetic ceilings, the ones the kernels are
measured against: float32 FMAs (``_vfma``) and byte dot products
(``_vdotacc``, ``vpdpbusd`` with VNNI), ten 16-lane chains in flight, G
multiply-adds a second.

Usage:
  PYTHONPATH=src python tools/bench_quant_kernels.py [--threads 1 2]
      [--types Q8_0 Q4_0 Q4_1 Q4_K Q6_K] [--repeats 10] [--gguf FILE.gguf]
      [--baseline OLD_quant_kernels.py]
  PYTHONPATH=src python tools/bench_quant_kernels.py --prefill 256
  PYTHONPATH=src python tools/bench_quant_kernels.py --peaks
  PYTHONPATH=src python tools/bench_quant_kernels.py --kernels
      [--types Q8_0 Q5_0 Q4_K Q6_K] [--tokens 1 2 4 8 16]
      [--baseline OLD_quant_kernels.py] [--gguf FILE.gguf]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial

import numpy as np

HIDDEN, INTER, LAYERS, VOCAB = 576, 1536, 30, 49152
SHAPES = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]


def _random_raw(qk, kind, rows, n, rng):  # type: ignore[no-untyped-def]
    """Weights of ``kind``: quantized from normal floats where
    ``structllm.model.quantize`` quantizes, else random bytes with small
    finite f16 scales."""
    from structllm.model import quantize as qz

    if kind in qz.QUANTIZE_TYPES:
        return qz.quantize(rng.standard_normal((rows, n), dtype=np.float32), kind)
    values, size = qk.block_layout(kind)
    raw = rng.integers(0, 256, (rows, n // values, size), dtype=np.uint8)
    halves = {qk.GGMLType.Q4_K: (0, 2), qk.GGMLType.Q5_K: (0, 2)}
    for at in halves.get(kind, (208,) if kind == qk.GGMLType.Q6_K else (0,)):
        d = (rng.standard_normal((rows, n // values)) * 0.01).astype(np.float16)
        raw[:, :, at : at + 2] = d.view(np.uint8).reshape(rows, -1, 2)
    return raw.reshape(rows, -1)


def _model(qk, kind, gguf_path):  # type: ignore[no-untyped-def]
    """[(raw, qtype, out, in)] of one decode step's projections."""
    rng = np.random.default_rng(0)
    if gguf_path:
        import gguf

        reader = gguf.GGUFReader(gguf_path)
        t = {x.name: x for x in reader.tensors}

        def raw(name: str) -> np.ndarray:
            return np.ascontiguousarray(t[name].data)

        kind = qk.GGMLType(int(t["blk.0.attn_q.weight"].tensor_type))
        weights = []
        for i in range(LAYERS):
            p = f"blk.{i}."
            qkv = np.concatenate(
                [
                    raw(p + "attn_q.weight"),
                    raw(p + "attn_k.weight"),
                    raw(p + "attn_v.weight"),
                ]
            )
            up = np.concatenate([raw(p + "ffn_gate.weight"), raw(p + "ffn_up.weight")])
            for w, (o, n) in zip(
                (qkv, raw(p + "attn_output.weight"), up, raw(p + "ffn_down.weight")),
                SHAPES,
                strict=True,
            ):
                weights.append((w, kind, o, n))
        head = t["token_embd.weight"]
        weights.append(
            (raw(head.name), qk.GGMLType(int(head.tensor_type)), VOCAB, HIDDEN)
        )
        return kind.name + " (file)", weights
    # rows of a size a K-quant's 256 does not divide take llama-quantize's
    # fallback type (llama.cpp's tensor_type_fallback): SmolLM2's 576
    fallback = {
        qk.GGMLType.Q4_K: qk.GGMLType.Q5_0,
        qk.GGMLType.Q5_K: qk.GGMLType.Q5_1,
        qk.GGMLType.Q6_K: qk.GGMLType.Q8_0,
    }
    weights = []
    for _ in range(LAYERS):
        for o, n in SHAPES:
            t = kind if n % qk.block_layout(kind)[0] == 0 else fallback[kind]
            weights.append((_random_raw(qk, t, o, n, rng), t, o, n))
    head = _random_raw(qk, qk.GGMLType.Q8_0, VOCAB, HIDDEN, rng)
    weights.append((head, qk.GGMLType.Q8_0, VOCAB, HIDDEN))
    label = (
        kind.name
        if kind not in fallback
        else f"{kind.name} (down; rest {fallback[kind].name})"
    )
    return label, weights


def _best_in_turns(fns: list[Callable[[], None]], repeats: int) -> list[float]:
    for f in fns:
        f()  # compile, fault the pages in
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, f in enumerate(fns):
            # the other library's idle threads spin for a while after a call
            # (OpenBLAS ~0.1 s, Intel's OpenMP 0.2 s), holding a core
            time.sleep(0.25)
            start = time.perf_counter()
            f()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def _quantized_step(qk, weights, xs, outs, **options) -> None:  # type: ignore[no-untyped-def]
    for (w, t, o, n), y in zip(weights, outs, strict=True):
        qk.matmul(xs[n], w, t, o, n, out=y, **options)


def _dense_step(weights, floats, xs, outs) -> None:  # type: ignore[no-untyped-def]
    for (_, _, _, n), f, y in zip(weights, floats, outs, strict=True):
        np.matmul(xs[n], f.T, out=y)


def _tiles(qk, x, w, kind, o, n, y, rows=256) -> None:  # type: ignore[no-untyped-def]
    """Prefill the other way: 256-row tiles dequantized into numpy's BLAS."""
    tile = np.empty((rows, n), np.float32)
    for r0 in range(0, o, rows):
        r1 = min(o, r0 + rows)
        qk.dequantize_rows(w, kind, n, r0, r1, out=tile[: r1 - r0])
        y[:, r0:r1] = x @ tile[: r1 - r0].T


def child(args: argparse.Namespace) -> None:
    from structllm.model import kernels
    from structllm.model import quant_kernels as qk

    kernels.set_num_threads(args.threads)
    qk.warm_up()
    base = _baseline(args.baseline)
    sources = [(qk.GGMLType[name], None) for name in args.types]
    if args.gguf:
        sources.append((None, args.gguf))
    for kind, path in sources:
        name, weights = _model(qk, kind, path)
        floats = [qk.dequantize_rows(w, t, n) for w, t, _, n in weights]
        nbytes = sum(w.nbytes for w, *_ in weights)
        rng = np.random.default_rng(1)
        for batch in args.batches:
            xs = {
                n: rng.standard_normal((batch, n), dtype=np.float32)
                for n in (HIDDEN, INTER)
            }
            outs = [np.empty((batch, o), np.float32) for _, _, o, _ in weights]

            options = {}
            if args.activations != "float":
                options["activations"] = args.activations
            quantized = partial(_quantized_step, qk, weights, xs, outs, **options)
            dense = partial(_dense_step, weights, floats, xs, outs)
            steps = [quantized, dense]
            if base is not None:
                steps.append(partial(_quantized_step, base, weights, xs, outs))
            tq, tf, *tb = _best_in_turns(steps, args.repeats)
            print(
                json.dumps(
                    {
                        "type": name,
                        "threads": args.threads,
                        "batch": batch,
                        "ms_token": tq / batch * 1e3,
                        "gbs": nbytes / tq / 1e9,
                        "mb": nbytes / 1e6,
                        "f32_ms_token": tf / batch * 1e3,
                        "f32_gbs": sum(f.nbytes for f in floats) / tf / 1e9,
                        "base_ms_token": tb[0] / batch * 1e3 if tb else None,
                        "load": _load(),
                    }
                ),
                flush=True,
            )


def _baseline(path: str | None):  # type: ignore[no-untyped-def]
    """Another copy of quant_kernels.py, imported under its own name."""
    if not path:
        return None
    import importlib.util

    spec = importlib.util.spec_from_file_location("quant_kernels_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # numba's cache finds its globals by name
    spec.loader.exec_module(module)
    module.warm_up()
    return module


def _load() -> str:
    """The 1-minute load average and the cores this process may use."""
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    return f"{load} on {len(os.sched_getaffinity(0))} cores"


def prefill(args: argparse.Namespace) -> None:
    from structllm.model import kernels
    from structllm.model import quant_kernels as qk

    kernels.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    t_len = args.prefill
    for kind in (qk.GGMLType[name] for name in args.types):
        for o, n in [(2 * INTER, 1024), (HIDDEN, INTER)]:  # gate_up: 256 | n
            w = _random_raw(qk, kind, o, n, rng)
            f = qk.dequantize_rows(w, kind, n)
            x = rng.standard_normal((t_len, n), dtype=np.float32)
            y = np.empty((t_len, o), np.float32)

            fns = [
                partial(qk.matmul, x, w, kind, o, n, out=y),
                partial(_tiles, qk, x, w, kind, o, n, y),
                partial(np.matmul, x, f.T, out=y),
            ]
            tk, tt, tf = _best_in_turns(fns, args.repeats)
            gflop = 2 * t_len * o * n / 1e9
            print(
                f"{kind.name} T={t_len} {n}->{o} threads={args.threads}: kernel"
                f" {tk * 1e3:.2f} ms ({gflop / tk:.0f} GFLOP/s), tiles+BLAS"
                f" {tt * 1e3:.2f} ms, numpy f32 {tf * 1e3:.2f} ms",
                flush=True,
            )


#: SmolLM2's matrices (out, in) the --kernels mode times, and the head's
KERNEL_SHAPES = [*SHAPES, (VOCAB, HIDDEN)]


def _cpu_seconds(fn: Callable[[], None], calls: int) -> float:
    """One thread's CPU seconds a call of ``fn`` (which makes ``calls``)."""
    start = time.thread_time()
    fn()
    return (time.thread_time() - start) / calls


def _kernel_step(matmul, ws, x, y, kind, o, n) -> None:  # type: ignore[no-untyped-def]
    """One call of ``matmul`` on each copy of the weight, one thread."""
    for w in ws:
        matmul(x, w, kind, o, n, out=y, threaded=False)


def _matmuls(qk, base, activations: str):  # type: ignore[no-untyped-def]
    """The matmuls --kernels times side by side: this copy's (with
    ``activations``), then the baseline's (the same activations: a kernel
    against its old self), or without one this copy's with float
    activations when ``activations`` is another (q8 against float in one
    process)."""
    mine = partial(qk.matmul, activations=activations)
    if base is not None:
        return [mine, partial(base.matmul, activations=activations)]
    return [mine, qk.matmul] if activations != "float" else [mine]


def kernel_times(args: argparse.Namespace) -> None:
    from structllm.model import kernels
    from structllm.model import quant_kernels as qk

    kernels.set_num_threads(1)
    qk.warm_up(q8=True)
    base = _baseline(args.baseline)
    mods = _matmuls(qk, base, args.activations)
    heads = {qk.GGMLType[name] for name in args.head_types}
    rng = np.random.default_rng(0)
    print(
        "| type | out x in | T | us/call | GB/s |"
        + (" baseline us/call | baseline GB/s | speed-up |" if len(mods) > 1 else "")
    )
    print("|---|---|---:|---:|---:|" + "---:|---:|---:|" * (len(mods) > 1))
    for kind in (qk.GGMLType[name] for name in args.types):
        values = qk.block_layout(kind)[0]
        for o, n in KERNEL_SHAPES:
            if n % values or (o == VOCAB and kind not in heads):
                continue
            copies = 1 if o == VOCAB else LAYERS
            w0 = _random_raw(qk, kind, o, n, rng)
            ws = [w0.copy() for _ in range(copies)]
            for t_len in args.tokens:
                x = rng.standard_normal((t_len, n), dtype=np.float32)
                y = np.empty((t_len, o), np.float32)
                steps = [partial(_kernel_step, m, ws, x, y, kind, o, n) for m in mods]
                for step in steps:
                    step()  # compile, fault in
                times: list[list[float]] = [[] for _ in steps]
                for _ in range(args.repeats):  # alternately
                    for i, step in enumerate(steps):
                        times[i].append(_cpu_seconds(step, copies))
                med = [float(np.median(t)) for t in times]
                gbs = [w0.nbytes / s / 1e9 for s in med]
                row = f"| {kind.name} | {o} x {n} | {t_len} |"
                row += f" {med[0] * 1e6:.1f} | {gbs[0]:.1f} |"
                if len(mods) > 1:
                    row += f" {med[1] * 1e6:.1f} | {gbs[1]:.1f} |"
                    row += f" {med[1] / med[0]:.2f}x |"
                print(row, flush=True)
    if args.gguf:
        _file_step_times(qk, mods, args)


def _file_weights(path: str):  # type: ignore[no-untyped-def]
    """[(raw, type, out, in)] of every projection of a GGUF file's decode
    step, each tensor its own (a Q4_K_M file mixes Q5_0, Q8_0, Q4_K, Q6_K),
    and the tied head."""
    import gguf

    reader = gguf.GGUFReader(path)
    weights = []
    for t in reader.tensors:
        if t.name.endswith(".weight") and len(t.shape) == 2:
            n, o = (int(v) for v in t.shape)
            weights.append((np.ascontiguousarray(t.data), int(t.tensor_type), o, n))
    return weights


def _file_step_times(qk, mods, args) -> None:  # type: ignore[no-untyped-def]
    """One thread's CPU time of a whole decode step's matmuls of the file,
    ``T`` tokens, by type, this copy and the baseline alternately."""
    weights = _file_weights(args.gguf)
    rng = np.random.default_rng(1)
    by_type: dict[int, list] = {}  # type: ignore[type-arg]
    for w in weights:
        by_type.setdefault(w[1], []).append(w)
    print(
        f"\n{args.gguf}: one thread's CPU ms a step, by weight type (numpy f32:"
        " the dequantized weights' x @ W.T, OPENBLAS_NUM_THREADS=1 wanted)"
    )
    print(
        "| type | matrices | MB | T | ms | GB/s |"
        + " baseline ms | speed-up |" * (len(mods) > 1)
        + " numpy f32 ms |"
    )
    print("|---|---:|---:|---:|---:|---:|" + "---:|---:|" * (len(mods) > 1) + "---:|")
    for kind, group in sorted(by_type.items()):
        mb = sum(w.nbytes for w, *_ in group) / 1e6
        for t_len in args.tokens:
            xs = {
                n: rng.standard_normal((t_len, n), dtype=np.float32) for *_, n in group
            }
            ys = [np.empty((t_len, o), np.float32) for _, _, o, _ in group]

            def step(m, group=group, xs=xs, ys=ys) -> None:  # type: ignore[no-untyped-def]
                for (w, k, o, n), y in zip(group, ys, strict=True):
                    m(xs[n], w, k, o, n, out=y, threaded=False)

            floats = [qk.dequantize_rows(w, k, n) for w, k, _, n in group]

            def dense(group=group, xs=xs, ys=ys, floats=floats) -> None:  # type: ignore[no-untyped-def]
                for (_, _, _, n), f, y in zip(group, floats, ys, strict=True):
                    np.matmul(xs[n], f.T, out=y)

            steps = [partial(step, m) for m in mods] + [dense]
            for f in steps:
                f()
            times: list[list[float]] = [[] for _ in steps]
            for _ in range(args.repeats):
                for i, f in enumerate(steps):
                    times[i].append(_cpu_seconds(f, 1))
            med = [float(np.median(t)) for t in times]
            row = f"| {qk.GGMLType(kind).name} | {len(group)} | {mb:.1f} | {t_len} |"
            row += f" {med[0] * 1e3:.2f} | {mb / 1e3 / med[0]:.1f} |"
            if len(mods) > 1:
                row += f" {med[1] * 1e3:.2f} | {med[1] / med[0]:.2f}x |"
            print(row + f" {med[-1] * 1e3:.2f} |", flush=True)


def peaks(steps: int = 20_000_000, turns: int = 3) -> None:
    """One thread's float32 FMA and byte dot-product rates (see the module doc)."""
    import numba

    from structllm.model import quant_kernels as qk

    fma, zero, floats, total = qk._vfma, qk._vzero, qk._vfloats, qk._vsum
    dot, bytes_, ints, itotal = qk._vdotacc, qk._bint8s, qk._vints, qk._visum

    @numba.njit
    def float_chains(n: int, a: np.ndarray) -> float:  # pragma: no cover
        x, y = floats(a, 0), floats(a, 16)
        s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = s8 = s9 = zero()
        for _ in range(n):
            s0, s1, s2, s3, s4 = (
                fma(x, s0, y),
                fma(x, s1, y),
                fma(x, s2, y),
                fma(x, s3, y),
                fma(x, s4, y),
            )
            s5, s6, s7, s8, s9 = (
                fma(x, s5, y),
                fma(x, s6, y),
                fma(x, s7, y),
                fma(x, s8, y),
                fma(x, s9, y),
            )
        return total(s0 + s1 + s2 + s3 + s4 + s5 + s6 + s7 + s8 + s9)

    @numba.njit
    def byte_chains(n: int, b: np.ndarray, c: np.ndarray) -> int:  # pragma: no cover
        u, v = bytes_(b, 0), bytes_(b, 64)
        s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = s8 = s9 = ints(c, 0)
        for _ in range(n):
            s0, s1, s2, s3, s4 = (
                dot(s0, u, v),
                dot(s1, u, v),
                dot(s2, u, v),
                dot(s3, u, v),
                dot(s4, u, v),
            )
            s5, s6, s7, s8, s9 = (
                dot(s5, u, v),
                dot(s6, u, v),
                dot(s7, u, v),
                dot(s8, u, v),
                dot(s9, u, v),
            )
        return itotal(s0 + s1 + s2 + s3 + s4 + s5 + s6 + s7 + s8 + s9)

    a = np.full(32, 0.5, np.float32)
    b, c = np.ones(128, np.int8), np.zeros(16, np.int32)
    float_chains(10, a), byte_chains(10, b, c)  # compile
    for _ in range(turns):
        t = time.thread_time()
        float_chains(steps, a)
        f = steps * 10 * 16 / (time.thread_time() - t) / 1e9
        t = time.thread_time()
        byte_chains(steps, b, c)
        i = steps * 10 * 64 / (time.thread_time() - t) / 1e9
        print(
            f"one thread: float32 FMA {f:.1f}, byte dot products {i:.1f} G multiply-adds/s"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument(
        "--types", nargs="*", default=["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]
    )
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--gguf", help="also time this GGUF file's own weights")
    p.add_argument("--prefill", type=int, help="tokens: compare prefill paths")
    p.add_argument("--baseline", help="an older quant_kernels.py to time alongside")
    p.add_argument(
        "--activations",
        default="float",
        help="matmul's activations option (q8: quantized activations); the"
        " baseline keeps its default",
    )
    p.add_argument(
        "--kernels", action="store_true", help="one-thread CPU time a kernel call"
    )
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument(
        "--head-types",
        nargs="+",
        default=["Q8_0", "Q6_K"],
        help="types whose --kernels rows include the 49152 x 576 head",
    )
    p.add_argument(
        "--peaks", action="store_true", help="one thread's FMA and byte-dot peaks"
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.peaks:
        peaks()
        return
    if args.kernels:
        kernel_times(args)
        return
    if args.child:
        args.threads = args.threads[0]
        (prefill if args.prefill else child)(args)
        return
    rows = []
    for threads in args.threads:
        env = dict(
            os.environ,
            OPENBLAS_NUM_THREADS=str(threads),
            OMP_NUM_THREADS=str(threads),
            MKL_NUM_THREADS=str(threads),
        )
        argv = [
            sys.executable,
            __file__,
            "--child",
            "--threads",
            str(threads),
            "--types",
            *args.types,
            "--batches",
            *map(str, args.batches),
            "--repeats",
            str(args.repeats),
        ]
        if args.gguf:
            argv += ["--gguf", args.gguf]
        if args.prefill:
            argv += ["--prefill", str(args.prefill)]
        if args.baseline:
            argv += ["--baseline", args.baseline]
        argv += ["--activations", args.activations]
        run = subprocess.run(
            argv, env=env, check=True, stdout=subprocess.PIPE, text=True
        )
        for line in run.stdout.splitlines():
            if line.startswith("{"):
                rows.append(json.loads(line))
            else:
                print(line)
    if not rows:
        return
    base = args.baseline is not None
    print(
        "| type | threads | batch | weights MB | ms/token | GB/s | f32 ms/token"
        " | f32 GB/s | speed-up vs f32 |"
        + (" baseline ms/token | speed-up vs baseline |" if base else "")
        + " load |"
    )
    print(
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|---:|" * base + "---|"
    )
    for r in rows:
        extra = ""
        if base:
            b = r["base_ms_token"]
            extra = f" {b:.3f} | {b / r['ms_token']:.2f}x |"
        print(
            f"| {r['type']} | {r['threads']} | {r['batch']} | {r['mb']:.0f} |"
            f" {r['ms_token']:.3f} | {r['gbs']:.1f} | {r['f32_ms_token']:.3f} |"
            f" {r['f32_gbs']:.1f} | {r['f32_ms_token'] / r['ms_token']:.2f}x |"
            + extra
            + f" {r['load']} |"
        )


if __name__ == "__main__":
    main()
