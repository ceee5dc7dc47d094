"""The compiled CPU attention kernels against plain numpy and Paddle ops."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import attrs
import numpy as np
import pytest

from structllm.model import kernels
from structllm.model._paddle import paddle
from structllm.model.attention import SequenceSlice, slots_for
from structllm.model.config import tiny_random_config
from structllm.model.llama import attention_inputs
from structllm.model.loader import build_model, random_hf_tensors


def _reference_decode(q, k_cache, v_cache, tables, lens, window, scale, bs):
    """Softmax attention of each row's one query over its gathered keys."""
    b_len, nh, _ = q.shape
    kvh = k_cache.shape[0]
    out = np.zeros_like(q)
    for b in range(b_len):
        n = int(lens[b])
        start = max(0, n - window) if window else 0
        slots = slots_for(tables[b], start, n, bs)
        for head in range(nh):
            h = head // (nh // kvh)
            scores = (k_cache[h, slots] @ q[b, head]) * scale
            p = np.exp(scores - scores.max())
            out[b, head] = (p / p.sum()) @ v_cache[h, slots]
    return out


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("window", [None, 3, 40])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("d", [16, 24, 48, 64, 128])
def test_decode_attention_matches_numpy(
    d: int,
    heads: int,
    kv_heads: int,
    window: int | None,
    parallel: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Head sizes of whole vectors (16: one, 48: an odd count, 64 and 128:
    the chunks of 4) and one of none (24, element by element)."""
    if parallel:  # the threaded path, whatever the batch's size
        monkeypatch.setattr(kernels, "_PARALLEL_MIN_WORK", 0)
        monkeypatch.setattr(kernels, "_threads", 2)
    rng = np.random.default_rng(heads * 10 + kv_heads + d)
    bs, num_blocks = 4, 64
    lens = np.array([1, 5, 17, 33, 60], dtype=np.int64)
    blocks = rng.permutation(num_blocks)
    tables = np.zeros((len(lens), 16), dtype=np.int64)
    at = 0
    for i, n in enumerate(lens):
        need = -(-int(n) // bs)
        tables[i, :need] = blocks[at : at + need]
        at += need
    k_cache = rng.standard_normal((kv_heads, num_blocks * bs, d)).astype(np.float32)
    v_cache = rng.standard_normal((kv_heads, num_blocks * bs, d)).astype(np.float32)
    q = rng.standard_normal((len(lens), heads, d)).astype(np.float32)
    got = kernels.decode_attention(q, k_cache, v_cache, tables, lens, window, 0.25, bs)
    want = _reference_decode(q, k_cache, v_cache, tables, lens, window, 0.25, bs)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_decode_attention_reads_caches_of_any_layout(dtype: str) -> None:
    """A cache that is a strided view (every other slot) takes the element
    path and gives what a contiguous copy of it gives the vector path."""
    rng = np.random.default_rng(7)
    kvh, nh, d, bs = 2, 6, 64, 16
    wide = [rng.standard_normal((kvh, 256, d)).astype(np.float32) for _ in range(2)]
    wide = [_to_bits(c, dtype) for c in wide]
    k_view, v_view = (c[:, ::2] for c in wide)
    k_copy, v_copy = (np.ascontiguousarray(c) for c in (k_view, v_view))
    tables = np.array([[5, 1, 7, 3], [0, 2, 4, 6]], dtype=np.int64)
    lens = np.array([50, 64], dtype=np.int64)
    q = rng.standard_normal((2, nh, d)).astype(np.float32)
    got = kernels.decode_attention(q, k_view, v_view, tables, lens, None, 0.125, bs)
    dense = kernels.decode_attention(q, k_copy, v_copy, tables, lens, None, 0.125, bs)
    k_copy, v_copy = _from_bits(k_copy), _from_bits(v_copy)
    want = _reference_decode(q, k_copy, v_copy, tables, lens, None, 0.125, bs)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(dense, want, atol=2e-6, rtol=1e-5)


def _to_bits(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` as a cache of ``dtype`` holds it, rounded as Paddle casts (the
    16-bit kinds as their bits, ``kernels.CACHE_BITS``)."""
    if dtype == "float32":
        return x
    bits = paddle.cast(paddle.to_tensor(x), dtype).view(paddle.int16).numpy()
    return bits.view(kernels.CACHE_BITS[dtype])


def _from_bits(bits: np.ndarray) -> np.ndarray:
    """A cache's elements as float32."""
    if bits.dtype == np.uint16:  # bfloat16
        return (bits.astype(np.uint32) << 16).view(np.float32)
    if bits.dtype == np.int16:  # float16
        return bits.view(np.float16).astype(np.float32)
    return bits


def test_the_exp_of_the_kernels_is_accurate_to_an_ulp() -> None:
    x = -np.geomspace(1e-8, 87, 100_000).astype(np.float32)
    x = np.concatenate([x, [np.float32(0.0)]])
    got = np.array([kernels._exp(v) for v in x[::97]], np.float32)
    want = np.exp(x[::97].astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=3e-7)


@pytest.mark.parametrize(
    "family", ["LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen2ForCausalLM"]
)
def test_rope_and_write_matches_the_paddle_ops(family: str) -> None:
    qk_norm = family == "Qwen3ForCausalLM"  # the q/k norm
    qkv_bias = family == "Qwen2ForCausalLM"  # the bias, added by the kernel
    config = attrs.evolve(
        tiny_random_config(),
        architecture=family,
        qk_norm=qk_norm,
        qkv_bias=qkv_bias,
        head_dim=24,
    )
    model = build_model(config, dict(random_hf_tensors(config, seed=1)), block_size=4)
    layer = model.weights.layers[0]
    rng = np.random.default_rng(0)
    x = paddle.to_tensor(rng.standard_normal((6, config.hidden_size)).astype("float32"))
    positions = np.array([0, 1, 2, 9, 30, 31], dtype=np.int64)
    cos, sin = model.rope_tables(paddle.to_tensor(positions))
    q, k, v = attention_inputs(config, layer, x, cos, sin)

    from structllm.model.llama import rms_norm

    h = rms_norm(x, layer.input_norm, config.rms_norm_eps)
    qkv = layer.qkv(h).numpy()  # without the bias: the kernel adds it
    k_cache, v_cache = (np.zeros((config.num_key_value_heads, 40, 24), "float32"),) * 2
    k_cache, v_cache = k_cache.copy(), v_cache.copy()
    slots = np.array([7, 3, 20, 0, 39, 11], dtype=np.int64)
    q_out = np.empty((6, config.num_attention_heads, 24), np.float32)
    kernels.rope_and_write(
        qkv,
        positions,
        model._rope.cos,
        model._rope.sin,
        config.num_attention_heads,
        layer.q_norm.numpy() if qk_norm else None,
        layer.k_norm.numpy() if qk_norm else None,
        config.rms_norm_eps,
        k_cache,
        v_cache,
        slots,
        q_out,
        bias=layer.qkv.bias.numpy() if qkv_bias else None,
    )
    assert (layer.qkv.bias is not None) == qkv_bias
    np.testing.assert_allclose(q_out, q.numpy(), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(
        k_cache[:, slots].transpose(1, 0, 2), k.numpy(), atol=1e-5, rtol=1e-5
    )
    np.testing.assert_allclose(
        v_cache[:, slots].transpose(1, 0, 2), v.numpy(), atol=1e-6, rtol=1e-6
    )
    untouched = np.setdiff1d(np.arange(40), slots)
    assert not k_cache[:, untouched].any() and not v_cache[:, untouched].any()


@pytest.mark.parametrize("threaded", [False, True])
@pytest.mark.parametrize("qwen", [False, True])
def test_rope_write_attend_is_rope_and_write_then_decode_attention(
    threaded: bool, qwen: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One call a layer, the two kernels' arithmetic bit for bit (Qwen's
    bias and q/k norms included; the threaded attention too)."""
    if threaded:
        if kernels.numba.config.NUMBA_NUM_THREADS < 2:
            pytest.skip("one thread: nothing to spread")
        monkeypatch.setattr(kernels, "_threads", 2)
    rng = np.random.default_rng(4)
    nh, kvh, d, bs, b = 6, 2, 16, 4, 3
    lens = np.array([5, 1, 9], np.int64)
    tables = np.array([[0, 1, 0], [2, 0, 0], [3, 4, 5]], np.int64)
    slots = np.array(
        [
            t[(n - 1) // bs] * bs + (n - 1) % bs
            for t, n in zip(tables, lens, strict=True)
        ]
    )
    qkv = rng.standard_normal((b, (nh + 2 * kvh) * d)).astype(np.float32)
    positions = lens - 1
    table = rng.standard_normal((12, d)).astype(np.float32)
    norm = rng.standard_normal(d).astype(np.float32) if qwen else None
    bias = rng.standard_normal(qkv.shape[1]).astype(np.float32) if qwen else None
    cache = rng.standard_normal((kvh, 6 * bs, d)).astype(np.float32)

    def rope(k_cache: np.ndarray, v_cache: np.ndarray, q: np.ndarray) -> None:
        kernels.rope_and_write(
            qkv, positions, table, -table, nh, norm, norm, 1e-6, k_cache,
            v_cache, slots, q, bias=bias,
        )  # fmt: skip

    want_k, want_v = cache.copy(), cache[::-1].copy()
    q = np.empty((b, nh, d), np.float32)
    rope(want_k, want_v, q)
    want = kernels.decode_attention(q, want_k, want_v, tables, lens, 3, 0.25, bs)
    k_cache, v_cache = cache.copy(), cache[::-1].copy()
    out = np.full((b, nh, d), np.nan, np.float32)
    fn, args = kernels.rope_write_attend_call(
        qkv, positions, table, -table, norm, norm, 1e-6, k_cache, v_cache,
        slots, np.empty_like(q), tables, lens, 3, 0.25, bs, out, bias=bias,
        threaded=threaded,
    )  # fmt: skip
    fn(*args)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(k_cache, want_k)
    np.testing.assert_array_equal(v_cache, want_v)


def test_kernels_refuse_slots_and_positions_outside_their_arrays() -> None:
    cache = np.zeros((2, 8, 4), np.float32)
    new = np.zeros((1, 2, 4), np.float32)
    with pytest.raises(IndexError, match="slot out of range"):
        kernels.write_kv(new, new, cache, cache, np.array([8]))
    with pytest.raises(IndexError, match="slot out of range"):
        kernels.write_kv(new, new, cache, cache, np.array([-1]))
    qkv = np.zeros((1, 3 * 2 * 4), np.float32)  # two q, k and v heads of 4
    table = np.zeros((16, 4), np.float32)
    q_out = np.zeros((1, 2, 4), np.float32)
    with pytest.raises(IndexError, match="position out of range"):
        kernels.rope_and_write(
            qkv, np.array([16]), table, table, 2, None, None, 1e-6,
            cache, cache, np.array([0]), q_out,
        )  # fmt: skip


def test_a_block_table_too_short_for_its_length_is_refused() -> None:
    model = build_model(
        tiny_random_config(),
        dict(random_hf_tensors(tiny_random_config())),
        block_size=4,
    )
    # the kernels read block tables unchecked: one too short never gets there
    with pytest.raises(IndexError):
        model.attention.build_metadata([SequenceSlice(4, 1, [0])])  # 5 tokens


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_caches_round_as_paddle_casts_and_attend_on_those_values(
    dtype: str,
) -> None:
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(4096) * np.exp(rng.uniform(-30, 30, 4096))).astype(
        np.float32
    )
    # ties round to even; float16 also overflows to inf (from 65520) and has
    # subnormals (below 2**-14)
    x[:7] = [0.0, -0.0, 1 + 2**-8, 1 + 2**-11, 65520.0, -7e4, 3 * 2**-25]
    bits = kernels.CACHE_BITS[dtype]
    k_cache = np.zeros((1, 4096, 1), bits)
    v_cache = np.zeros((1, 4096, 1), bits)
    new = x.reshape(-1, 1, 1)
    kernels.write_kv(new, new, k_cache, v_cache, np.arange(4096))
    np.testing.assert_array_equal(k_cache.reshape(-1), _to_bits(x, dtype))

    # attention over a 16-bit cache is attention over the rounded values
    kvh, d, bs = 2, 16, 4
    k16 = rng.standard_normal((kvh, 32, d)).astype(np.float32)
    v16 = rng.standard_normal((kvh, 32, d)).astype(np.float32)
    k_bits, v_bits = (np.zeros((kvh, 32, d), bits) for _ in range(2))
    flat = np.arange(32)
    kernels.write_kv(
        k16.transpose(1, 0, 2), v16.transpose(1, 0, 2), k_bits, v_bits, flat
    )

    tables = np.array([[3, 1, 0, 2], [5, 7, 6, 4]], dtype=np.int64)
    lens = np.array([13, 16], dtype=np.int64)
    q = rng.standard_normal((2, 4, d)).astype(np.float32)
    got = kernels.decode_attention(q, k_bits, v_bits, tables, lens, None, 0.25, bs)
    k, v = _from_bits(k_bits), _from_bits(v_bits)
    np.testing.assert_array_equal(k, _from_bits(_to_bits(k16, dtype)))
    want = _reference_decode(q, k, v, tables, lens, None, 0.25, bs)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


def test_host_views_of_a_freed_cache_are_dropped() -> None:
    # the kernels keep numpy views of the KV caches between steps; a cache
    # the engine frees (a restart, a new runner) must not stay alive here
    model = build_model(
        tiny_random_config(),
        dict(random_hf_tensors(tiny_random_config())),
        block_size=4,
    )
    caches = model.allocate_kv_cache(4)
    meta = model.attention.build_metadata([SequenceSlice(0, 3, [1])])
    model.forward(
        paddle.to_tensor(np.array([5, 6, 7])),
        paddle.to_tensor(np.arange(3)),
        caches,
        meta,
    )
    views = model.attention._views._views
    assert len(views) == 2 * len(caches)
    del caches
    assert not views


def _python(code: str, **env: str) -> str:
    """Run ``code`` in a fresh interpreter; its last line of output."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_the_threaded_decode_is_not_served_the_serial_ones_cached_code(
    tmp_path: Path,
) -> None:
    # numba's disk cache keys code by function and signature, not by compile
    # options: when both entry points compiled one function, the threaded
    # one loaded the serial code the other had cached, and ran on one thread
    call = """
        import numpy as np
        from structllm.model import kernels
        q = np.ones((2, 2, 4), np.float32); cache = np.ones((2, 8, 4), np.float32)
        args = (q, cache, cache, np.zeros((2, 2), np.int64), np.full(2, 3, np.int64),
                0, 1.0, 4, np.empty_like(q))
        kernel = kernels.{}
        kernel(*args)
        print(sum(kernel.stats.cache_hits.values()))
        """
    cache = {"NUMBA_CACHE_DIR": str(tmp_path)}
    assert _python(call.format("_decode_attention"), **cache) == "0"  # compiled
    assert _python(call.format("_decode_attention"), **cache) == "1"  # cached
    assert _python(call.format("_decode_attention_parallel"), **cache) == "0"


@pytest.mark.skipif(not kernels.SHARED_OPENMP, reason="Paddle ships no libiomp5")
def test_threaded_kernels_run_on_the_threads_paddles_matmuls_use() -> None:
    # a second OpenMP runtime puts a thread of its own on the core where
    # MKL's worker spins after each matmul: no faster than one thread
    layer, before, after = _python(
        """
        import os
        import numba, numpy as np
        from structllm.model import kernels
        from structllm.model._paddle import paddle, set_num_threads
        set_num_threads(2)
        x = paddle.ones([256, 256])
        paddle.matmul(x, x)  # MKL's threads start
        before = len(os.listdir("/proc/self/task"))
        kernels._PARALLEL_MIN_WORK = 0
        q = np.ones((4, 2, 8), np.float32); cache = np.ones((2, 16, 8), np.float32)
        kernels.decode_attention(q, cache, cache, np.zeros((4, 4), np.int64),
                                 np.full(4, 3, np.int64), None, 1.0, 4)
        print(numba.threading_layer(), before, len(os.listdir("/proc/self/task")))
        """
    ).split()
    assert layer == "omp"
    assert after == before


@pytest.mark.skipif(not kernels.SHARED_OPENMP, reason="Paddle ships no libiomp5")
@pytest.mark.parametrize(("given", "want"), [(None, "1"), ("7", "7")])
def test_openmp_workers_spin_briefly_unless_told(given: str | None, want: str) -> None:
    # Intel's runtime spins 200 ms after each parallel region by default:
    # a core burnt between steps (docs/benchmarks.md); the environment's
    # value wins
    code = f"""
        import ctypes, os
        os.environ.pop("KMP_BLOCKTIME", None)
        if {given!r} is not None:
            os.environ["KMP_BLOCKTIME"] = {given!r}
        from structllm.model import kernels
        from structllm.model._paddle import paddle, set_num_threads
        set_num_threads(2)
        x = paddle.ones([64, 64])
        paddle.matmul(x, x)
        kernels.warm_up()
        print(ctypes.CDLL(None).kmp_get_blocktime())
        """
    assert _python(code) == want


def test_add_rms_norm_and_swiglu_match_paddles_ops() -> None:
    from structllm.model.llama import _swiglu, rms_norm

    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 48)) * 3).astype(np.float32)
    delta = rng.standard_normal((5, 48)).astype(np.float32)
    weight = rng.standard_normal(48).astype(np.float32)
    want_x = paddle.to_tensor(x) + paddle.to_tensor(delta)
    want_normed = rms_norm(want_x, paddle.to_tensor(weight), 1e-5)
    normed = np.full_like(x, np.nan)
    got_x = x.copy()
    assert kernels.add_rms_norm(got_x, weight, 1e-5, normed, delta=delta) is normed
    np.testing.assert_allclose(got_x, want_x.numpy(), rtol=1e-6)
    np.testing.assert_allclose(normed, want_normed.numpy(), rtol=1e-5, atol=1e-6)
    # no delta: the norm alone, x untouched
    alone = kernels.add_rms_norm(got_x.copy(), weight, 1e-5, np.empty_like(x))
    want = rms_norm(paddle.to_tensor(got_x), paddle.to_tensor(weight), 1e-5)
    np.testing.assert_allclose(alone, want.numpy(), rtol=1e-5, atol=1e-6)

    # gates far into both tails: the sigmoid neither overflows nor loses them
    gate_up = (rng.standard_normal((3, 2 * 40)) * 30).astype(np.float32)
    gate_up[0, :4] = [0.0, -100.0, 100.0, -1e-30]
    out = np.full((3, 40), np.nan, np.float32)
    assert kernels.swiglu(gate_up, out) is out
    want = _swiglu(paddle.to_tensor(gate_up)).numpy()
    np.testing.assert_allclose(out, want, rtol=2e-6, atol=1e-30)
    with pytest.raises(ValueError, match="gate_up is"):
        kernels.swiglu(gate_up[:, :-1], out)


def test_step_buffers_keep_the_last_batch_sizes() -> None:
    from structllm.model.attention import StepBuffers

    buffers = StepBuffers(keep=2)
    one, _ = buffers.get("x", (1, 8))
    assert buffers.get("x", (1, 8))[0] is one  # reused
    view = buffers.get("y", (1, 4))[1]
    view[...] = 7.0
    assert (buffers.get("y", (1, 4))[1] == 7.0).all()  # kept as left
    buffers.get("x", (2, 8))
    buffers.get("x", (1, 8))  # batch 1 is the most recent again
    buffers.get("x", (3, 8))  # drops batch 2, the oldest
    assert buffers.get("x", (1, 8))[0] is one
    assert len(buffers._by_rows) == 2 and 2 not in buffers._by_rows


@pytest.mark.skipif(not kernels.SHARED_OPENMP, reason="Paddle ships no libiomp5")
def test_starting_the_kernels_threads_keeps_paddles_openmp_thread_count() -> None:
    # numba's OpenMP layer sets the runtime's thread count to all of its
    # threads when it starts: Paddle's own count must be set after that
    threads = _python(
        """
        import ctypes
        from structllm.model import kernels
        from structllm.model._paddle import set_num_threads
        set_num_threads(2)
        kernels.warm_up()
        print(ctypes.CDLL(None).omp_get_max_threads())
        """,
        NUMBA_NUM_THREADS="4",
    )
    assert threads == "2"


def test_released_linking_ir_is_parsed_again_for_a_later_compile() -> None:
    """The IR numba keeps of each loaded kernel goes once (a second call
    finds none); the kernels still run, and a function compiled afterwards
    that calls one links it from the kept bitcode."""
    import numba

    x = np.linspace(-4, 4, 33).astype(np.float32)
    before = [kernels._exp(v) for v in x]
    kernels.release_linking_ir()
    assert kernels.release_linking_ir() == 0  # nothing left to release
    library = next(iter(kernels._exp.overloads.values())).library
    assert library._shared_module is None
    assert [kernels._exp(v) for v in x] == before
    parse = library._get_module_for_linking
    parsed: list[object] = []
    library._get_module_for_linking = lambda: parsed.append(1) or parse()

    @numba.njit
    def twice(v: float) -> float:
        return kernels._exp(v) * 2.0

    np.testing.assert_allclose(
        [twice(v) for v in x], 2 * np.exp(x.astype(np.float64)), rtol=1e-5
    )
    assert parsed  # linked from the bitcode
    library._get_module_for_linking = parse
