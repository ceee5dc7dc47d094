"""Quantized projections: GGUF weights kept in their blocks, float checkpoints
quantized at load, and where they may not run."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from structllm.errors import EngineConfigError, ModelLoadError
from structllm.formats import GGUFFile
from structllm.model import quant_kernels, quantize
from structllm.model._paddle import paddle
from structllm.model.attention import SequenceSlice
from structllm.model.linear import DenseLinear
from structllm.model.llama import KEPT_LOGITS_ROWS
from structllm.model.loader import build_model, load_model
from structllm.model.parallel import load_model_shard
from structllm.model.quantized import (
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedPart,
)
from structllm.models import make_tiny_model
from tests.gguf_convert import convert
from tests.test_gguf_loading import PROMPT, _logits

pytestmark = pytest.mark.skipif(
    not quant_kernels.available(), reason="the quantized kernels need numba"
)


def _checkpoint(tmp_path: Path, arch: str, **kw: Any) -> Path:
    directory = tmp_path / arch
    make_tiny_model(directory, arch=arch, seed=11, **kw)  # type: ignore[arg-type]
    return directory


def _close(a: np.ndarray, b: np.ndarray) -> None:
    """Equal up to float32 sums in another order (the kernels reassociate)."""
    scale = float(np.abs(b).max())
    np.testing.assert_allclose(a, b, atol=2e-5 * scale, rtol=0)


@pytest.mark.parametrize(
    ("arch", "qtype", "kw"),
    [
        ("llama", "Q4_1", {}),  # q/k rows permuted in the file
        ("llama", "Q8_0", {"tie_word_embeddings": True}),  # the head reads token_embd
        ("qwen2", "Q4_0", {}),  # biases beside quantized q/k/v
        ("qwen3", "Q8_0", {}),
        ("mistral", "F16", {}),
    ],
)
def test_kept_blocks_compute_the_dequantized_model(
    tmp_path: Path, arch: str, qtype: str, kw: dict[str, Any]
) -> None:
    directory = _checkpoint(tmp_path, arch, **kw)
    convert(directory, tmp_path / "m.gguf", qtype=qtype)
    kept = load_model(tmp_path / "m.gguf").model
    dense = load_model(tmp_path / "m.gguf", quantization="none").model
    layer = kept.weights.layers[0]
    assert isinstance(layer.qkv, QuantizedLinear) and isinstance(
        layer.down, QuantizedLinear
    )
    assert isinstance(kept.weights.lm_head, QuantizedLinear)
    _close(_logits(kept), _logits(dense))


def test_quantized_weights_cache_float16_by_default(tmp_path: Path) -> None:
    """``auto`` caches keys and values as float16 for quantized weights (as
    llama.cpp does on the same file: half the cache's memory), as float32
    for float ones; either may be asked for by name. The float16 cache's
    logits stay within its rounding of the float32 cache's."""
    directory = _checkpoint(tmp_path, "llama")
    convert(directory, tmp_path / "m.gguf", qtype="Q8_0")
    kept = load_model(tmp_path / "m.gguf").model
    dense = load_model(tmp_path / "m.gguf", quantization="none").model
    at_load = load_model(directory, quantization="q8_0").model
    assert [m.resolved_kv_cache_dtype() for m in (kept, dense, at_load)] == [
        "float16",
        "float32",
        "float16",
    ]
    assert kept.allocate_kv_cache(1)[0][0].dtype == paddle.float16
    assert kept.kv_cache_bytes_per_block() * 2 == dense.kv_cache_bytes_per_block()
    caches = kept.allocate_kv_cache(4)
    meta = kept.attention.build_metadata([SequenceSlice(0, 9, [0, 1, 2])])
    ids, positions = paddle.to_tensor(np.array(PROMPT)), paddle.arange(9)
    half = kept.compute_logits(kept.forward(ids, positions, caches, meta)).numpy()
    full = _logits(kept)  # float32 by name
    assert kept.resolved_kv_cache_dtype() == "float32"
    error = np.abs(half - full).max()
    assert 0 < error < 1e-3 * (full.max() - full.min())  # measured: 2e-4
    kept.set_kv_cache_dtype("float16")
    dense.set_kv_cache_dtype("float16")  # a float model's on request
    assert dense.allocate_kv_cache(1)[0][0].dtype == paddle.float16


def test_pieces_of_different_types_fuse(tmp_path: Path) -> None:
    """A Q4_K_M file keeps some attn_v in another type than attn_q and attn_k."""
    directory = _checkpoint(tmp_path, "llama")
    types = {"model.layers.0.self_attn.v_proj.weight": "Q8_0"}
    convert(directory, tmp_path / "m.gguf", qtype="Q4_1", types=types)
    kept = load_model(tmp_path / "m.gguf").model
    qkv = kept.weights.layers[0].qkv
    assert isinstance(qkv, QuantizedLinear) and qkv.types == ("Q4_1", "Q8_0")
    assert kept.weights.layers[1].qkv.types == ("Q4_1",)  # one weight, one call
    _close(
        _logits(kept),
        _logits(load_model(tmp_path / "m.gguf", quantization="none").model),
    )


@pytest.mark.parametrize("rows", [1, 3])
def test_host_arrays_multiply_as_tensors_do(rows: int) -> None:
    """``matmul_into`` writes each part's columns (straight into them at one
    row, through a copy at more); the tensor call is the same product."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((12, 32)).astype(np.float32)
    halves = w[8:].astype(np.float16)
    lin = QuantizedLinear(
        (
            QuantizedPart(w[:8].view(np.uint8), quant_kernels.GGMLType.F32),
            QuantizedPart(halves.view(np.uint8), quant_kernels.GGMLType.F16),
        ),
        32,
    )
    x = rng.standard_normal((rows, 32)).astype(np.float32)
    out = np.full((rows, 12), np.nan, np.float32)
    assert lin.matmul_into(x, out) is out
    exact = x @ np.concatenate([w[:8], halves.astype(np.float32)]).T
    _close(out, exact)
    np.testing.assert_array_equal(lin(paddle.to_tensor(x)).numpy(), out)


def test_a_decode_step_multiplies_host_views(tmp_path: Path) -> None:
    """Decode rows alone take the step buffers' host views into the
    quantized projections (q/k/v of two types among them): their logits
    are the dequantized model's."""
    directory = _checkpoint(tmp_path, "llama")
    types = {"model.layers.0.self_attn.v_proj.weight": "Q8_0"}
    convert(directory, tmp_path / "m.gguf", qtype="Q4_1", types=types)
    kept = load_model(tmp_path / "m.gguf").model
    dense = load_model(tmp_path / "m.gguf", quantization="none").model
    assert kept.weights.layers[0].qkv.types == ("Q4_1", "Q8_0")
    for rows in (1, 3):
        _close(_decode_logits(kept, rows), _decode_logits(dense, rows))


def _decode_logits(model: Any, rows: int) -> np.ndarray:
    """Logits of a step of ``rows`` one-token sequences, each after a
    5-token prompt (prefilled the step before), over a float32 cache."""
    model.set_kv_cache_dtype("float32")
    caches = model.allocate_kv_cache(2 * rows)
    prompt = [SequenceSlice(0, 5, [2 * r, 2 * r + 1]) for r in range(rows)]
    ids = np.arange(5 * rows) % 7 + 1
    model.forward(
        paddle.to_tensor(ids),
        paddle.to_tensor(np.tile(np.arange(5), rows)),
        caches,
        model.attention.build_metadata(prompt),
    )
    decode = [SequenceSlice(5, 1, [2 * r, 2 * r + 1]) for r in range(rows)]
    meta = model.attention.build_metadata(decode)
    assert meta.num_decodes == meta.num_tokens == rows
    hidden = model.forward(
        paddle.to_tensor(np.arange(rows) + 3),
        paddle.to_tensor(np.full(rows, 5)),
        caches,
        meta,
    )
    return np.asarray(model.compute_logits(hidden).numpy())


def test_a_quantized_heads_logits_reuse_their_memory(tmp_path: Path) -> None:
    """Up to KEPT_LOGITS_ROWS rows, compute_logits writes into memory the
    model keeps (the next call's); more rows get their own."""
    directory = _checkpoint(tmp_path, "llama")
    convert(directory, tmp_path / "m.gguf", qtype="Q8_0")
    model = load_model(tmp_path / "m.gguf").model
    head = model.weights.lm_head
    assert isinstance(head, QuantizedLinear)
    rng = np.random.default_rng(5)
    hidden = rng.standard_normal((KEPT_LOGITS_ROWS + 1, head.in_features))
    hidden = hidden.astype(np.float32)

    def fresh(rows: np.ndarray) -> np.ndarray:  # as many rows: the same kernel
        return np.asarray(head(paddle.to_tensor(rows)).numpy())

    three = model.compute_logits(paddle.to_tensor(hidden[:3]))
    np.testing.assert_array_equal(three.numpy(), fresh(hidden[:3]))
    two = model.compute_logits(paddle.to_tensor(hidden[3:5]))
    np.testing.assert_array_equal(two.numpy(), fresh(hidden[3:5]))
    np.testing.assert_array_equal(three.numpy()[:2], two.numpy())  # overwritten
    many = model.compute_logits(paddle.to_tensor(hidden))
    np.testing.assert_array_equal(many.numpy(), fresh(hidden))
    np.testing.assert_array_equal(two.numpy(), fresh(hidden[3:5]))  # not reused


def test_the_weights_stay_as_small_as_the_file(tmp_path: Path) -> None:
    directory = _checkpoint(tmp_path, "llama", tie_word_embeddings=True)
    convert(directory, tmp_path / "m.gguf", qtype="Q4_0")
    model = load_model(tmp_path / "m.gguf").model
    with GGUFFile.open(tmp_path / "m.gguf") as f:
        projections = sum(
            t.nbytes
            for name, t in f.tensors.items()
            if t.type.name == "Q4_0" and name != "token_embd.weight"
        )
        head = f.tensors["token_embd.weight"].nbytes
    kept = sum(
        lin.nbytes
        for _, lin in model.weights.linears()
        if isinstance(lin, QuantizedLinear)
    )
    assert kept == projections + head


def test_the_embedding_stays_in_its_blocks(tmp_path: Path) -> None:
    directory = _checkpoint(tmp_path, "llama", tie_word_embeddings=True)
    convert(directory, tmp_path / "m.gguf", qtype="Q8_0")
    kept = load_model(tmp_path / "m.gguf").model.weights
    table = load_model(tmp_path / "m.gguf", quantization="none", backend="inference")
    table = table.model.weights.embed  # the float32 table (eager: the head's panels)
    assert isinstance(kept.embed, QuantizedEmbedding)
    head = kept.lm_head
    assert isinstance(head, QuantizedLinear)
    assert np.shares_memory(kept.embed.part.raw, head.parts[0].raw)  # no copy
    ids = paddle.to_tensor(np.array([5, 0, 5, table.shape[0] - 1], np.int64))
    want = paddle.nn.functional.embedding(ids, table).numpy()
    np.testing.assert_array_equal(kept.embed.lookup(ids).numpy(), want)
    with pytest.raises(IndexError):
        kept.embed.lookup(paddle.to_tensor(np.array([table.shape[0]], np.int64)))
    # a lookup a step keeps nothing alive (paddle.to_tensor kept a list each)
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(300):
        kept.embed.lookup(ids)
    gc.collect()
    assert len(gc.get_objects()) - before < 30


def test_the_predictors_refuse_quantized_weights_by_name(tmp_path: Path) -> None:
    directory = _checkpoint(tmp_path, "llama")
    convert(directory, tmp_path / "m.gguf", qtype="Q8_0")
    with pytest.raises(
        ModelLoadError, match=r"inference backend does not run quantized"
    ):
        load_model(tmp_path / "m.gguf", backend="inference")
    # auto picks eager for them
    assert isinstance(
        load_model(tmp_path / "m.gguf", backend="auto").model.weights.lm_head,
        QuantizedLinear,
    )


@pytest.mark.parametrize("quantization", ["q8_0", "q4_0", "q4_1"])
def test_a_float_checkpoint_is_quantized_at_load(
    tmp_path: Path, quantization: str
) -> None:
    directory = _checkpoint(tmp_path, "qwen2")
    loaded = load_model(directory, quantization=quantization)
    qtype = int(quant_kernels.GGMLType[quantization.upper()])
    # the expectation: every projection's weight through quantize + dequantize
    plain = load_model(directory, quantization="none")
    tensors = dict(load_file(directory / "model.safetensors"))
    for name, w in list(tensors.items()):
        if w.ndim == 2 and name != "model.embed_tokens.weight":
            raw = quantize.quantize(np.ascontiguousarray(w, np.float32), qtype)
            tensors[name] = quant_kernels.dequantize_rows(raw, qtype, w.shape[1])
    linears: dict[str, Any] = {}
    if plain.config.tie_word_embeddings:
        # the head quantizes the embedding's rows; the lookup keeps floats
        embed = np.ascontiguousarray(tensors["model.embed_tokens.weight"], np.float32)
        raw = quantize.quantize(embed, qtype)
        head = quant_kernels.dequantize_rows(raw, qtype, embed.shape[1])
        linears["lm_head"] = DenseLinear(paddle.to_tensor(head), transposed=True)
    expected = build_model(plain.config, tensors, linears=linears)
    assert all(
        isinstance(lin, QuantizedLinear) for _, lin in loaded.model.weights.linears()
    )
    _close(_logits(loaded.model), _logits(expected))


def _through_q4_k(name: str, w: np.ndarray, num_layers: int = 2) -> np.ndarray:
    """The HF weight ``name`` as its q4_k quantization at load dequantizes it
    (float32): in the type llama.cpp's Q4_K_M mix gives it."""
    w = np.ascontiguousarray(w, np.float32)
    piece = name.removesuffix(".weight")
    kind = quantize.tensor_type(
        quant_kernels.GGMLType.Q4_K, piece, w.shape[1], num_layers
    )
    raw = quantize.quantize(w, kind)
    return quant_kernels.dequantize_rows(raw, kind, w.shape[1])


@pytest.mark.parametrize(
    ("hidden", "types"),
    [
        # every row whole super-blocks: Q6_K for the head and layer 1's v, down
        (256, {"Q4_K", "Q6_K"}),
        # down_proj's 512 inputs Q4_K (layer 1 Q6_K), the rest Q5_0 (layer 1's
        # v and the head Q8_0: Q6_K's fallback)
        (192, {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}),
    ],
)
def test_q4_k_at_load_computes_the_dequantized_model(
    tmp_path: Path, hidden: int, types: set[str]
) -> None:
    directory = _checkpoint(
        tmp_path, "qwen2", hidden_size=hidden, intermediate_size=512
    )  # qwen2: biases beside q/k/v, a tied head (quantized, the lookup float)
    loaded = load_model(directory, quantization="q4_k")
    plain = load_model(directory, quantization="none")
    tensors = dict(load_file(directory / "model.safetensors"))
    for name, w in list(tensors.items()):
        if w.ndim == 2 and name != "model.embed_tokens.weight":
            tensors[name] = _through_q4_k(name, w)
    head = _through_q4_k(
        "model.embed_tokens.weight", tensors["model.embed_tokens.weight"]
    )
    linears: dict[str, Any] = {
        "lm_head": DenseLinear(paddle.to_tensor(head), transposed=True)
    }
    expected = build_model(plain.config, tensors, linears=linears)
    found = {
        t
        for _, lin in loaded.model.weights.linears()
        for t in (lin.types if isinstance(lin, QuantizedLinear) else ("float",))
    }
    assert found == types
    _close(_logits(loaded.model), _logits(expected))


def test_q4_k_greedy_tokens_are_the_dequantized_checkpoints(tmp_path: Path) -> None:
    """Through the engine: ``LLM(quantization="q4_k")`` generates the greedy
    tokens of a float32 checkpoint holding the dequantized Q4_K weights."""
    from safetensors.numpy import save_file

    from structllm import LLM, SamplingParams

    directory = _checkpoint(tmp_path, "llama", hidden_size=256, intermediate_size=512)
    dequantized = tmp_path / "dequantized"
    dequantized.mkdir()
    tensors = dict(load_file(directory / "model.safetensors"))
    for name, w in list(tensors.items()):
        if w.ndim == 2 and name != "model.embed_tokens.weight":
            tensors[name] = _through_q4_k(name, w)
    save_file(tensors, str(dequantized / "model.safetensors"))
    for f in directory.iterdir():
        if f.name != "model.safetensors":
            (dequantized / f.name).write_bytes(f.read_bytes())
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["hello world", "the quick brown fox", "1 2 3"]
    got = LLM(str(directory), quantization="q4_k").generate(prompts, params)
    want = LLM(str(dequantized), model_backend="eager").generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [
        o.outputs[0].token_ids for o in want
    ]


def test_quantizing_at_load_is_refused_where_it_cannot_be(tmp_path: Path) -> None:
    directory = _checkpoint(tmp_path, "llama", hidden_size=48, num_heads=4)
    with pytest.raises(
        EngineConfigError, match=r"48 inputs, not a multiple of the 32"
    ) as info:
        load_model(directory, quantization="q8_0")
    assert info.value.field == "quantization"
    convert(_checkpoint(tmp_path, "qwen3"), tmp_path / "m.gguf", qtype="Q8_0")
    with pytest.raises(EngineConfigError, match="already quantized"):
        load_model(tmp_path / "m.gguf", quantization="q4_0")
    with pytest.raises(EngineConfigError, match="tensor-parallel ranks hold float32"):
        load_model_shard(tmp_path / "m.gguf", 2, 0, quantization="q8_0")
    with pytest.raises(EngineConfigError, match="must be one of"):
        load_model(tmp_path / "m.gguf", quantization="int3")


def test_q8_activations_run_the_q8_kernels(tmp_path: Path) -> None:
    directory = _checkpoint(tmp_path, "llama")
    loaded = load_model(directory, quantization="q4_1", quantized_activations="q8")
    linears = [lin for _, lin in loaded.model.weights.linears()]
    assert all(
        isinstance(lin, QuantizedLinear) and lin.activations == "q8" for lin in linears
    )
    lin = linears[0]
    assert isinstance(lin, QuantizedLinear)
    part = lin.parts[0]
    x = np.random.default_rng(0).standard_normal((3, lin.in_features), np.float32)
    got = lin(paddle.to_tensor(x)).numpy()
    n = lin.in_features
    want = quant_kernels.matmul(x, part.raw, part.qtype, part.rows, n, activations="q8")
    np.testing.assert_array_equal(got, want)  # the q8 kernel's, not the float one's
    floats = quant_kernels.matmul(x, part.raw, part.qtype, part.rows, n)
    assert not np.array_equal(want, floats)
    # the load compiled (or loaded) the kernels the steps call
    assert quant_kernels._matmul_rows.signatures and quant_kernels._matmul8.signatures


def test_q8_activations_are_refused_where_they_cannot_be(tmp_path: Path) -> None:
    directory = _checkpoint(tmp_path, "llama")
    with pytest.raises(EngineConfigError, match="float model takes float") as info:
        load_model(directory, quantized_activations="q8")
    assert info.value.field == "quantized_activations"
    with pytest.raises(EngineConfigError, match="must be one of float, q8") as info:
        load_model(directory, quantization="q8_0", quantized_activations="q4")
    assert info.value.field == "quantized_activations"
    with pytest.raises(EngineConfigError, match="take float activations") as info:
        load_model_shard(directory, 2, 0, quantized_activations="q8")
    assert info.value.field == "quantized_activations"


def test_dropping_copied_pieces_pages_keeps_the_map_readable(tmp_path: Path) -> None:
    from structllm.model.gguf_loader import _unmap_copied

    directory = _checkpoint(tmp_path, "llama", hidden_size=256, intermediate_size=512)
    convert(directory, tmp_path / "m.gguf", qtype="Q8_0")
    with GGUFFile.open(tmp_path / "m.gguf") as f:
        raw = f.raw("blk.0.ffn_up.weight")  # 512 rows of 272 bytes: whole pages
        before = raw.copy()
        _unmap_copied([raw], [])  # its pages dropped: read again from the file
        np.testing.assert_array_equal(raw, before)
        _unmap_copied([raw], [raw])  # a part that reads the map keeps it
        np.testing.assert_array_equal(raw, before)


def test_the_engine_takes_quantized_activations(tmp_path: Path) -> None:
    """``quantized_activations`` reaches the model through the engine's
    settings: q8 runs (its greedy tokens are the q8 kernels', so only the run
    and the refusal are asserted here), and a float model refuses it by name."""
    from structllm import LLM, SamplingParams

    directory = _checkpoint(tmp_path, "llama")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = LLM(str(directory), quantization="q4_1", quantized_activations="q8")
    out = llm.generate(["hello"], params)[0]
    assert len(out.outputs[0].token_ids) == 4
    with pytest.raises(EngineConfigError) as info:
        LLM(str(directory), quantized_activations="q8")
    assert info.value.field == "quantized_activations"
