"""Float32 projections packed as 32-column panels: the kernels' product, the
Linear around them, and which models are packed at load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from structllm.errors import ModelLoadError
from structllm.model import kernels, panel_kernels
from structllm.model._paddle import paddle
from structllm.model.linear import DenseLinear, check_backend
from structllm.model.loader import build_model, load_model, random_hf_tensors
from structllm.model.packed import PackedEmbedding, PackedLinear, pack_linears
from structllm.models import make_tiny_model
from tests.test_gguf_loading import _logits
from tests.test_quantized_linear import _decode_logits

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason="the panel kernels need numba"
)


def _close(a: np.ndarray, b: np.ndarray) -> None:
    """Equal up to float32 sums in another order (the kernels reassociate)."""
    scale = float(np.abs(b).max(initial=0.0))
    np.testing.assert_allclose(a, b, atol=2e-5 * scale, rtol=0)


@pytest.mark.parametrize(
    ("out_features", "in_features"), [(64, 16), (45, 7), (100, 600)]
)
def test_pack_lays_out_panels_and_unpack_inverts_it(
    out_features: int, in_features: int
) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((out_features, in_features)).astype(np.float32)
    panels = panel_kernels.pack(w)
    count = -(-out_features // 32)
    assert panels.shape == (count, in_features * 32) and panels.flags.c_contiguous
    p, k, r = count - 1, in_features - 1, (out_features - 1) % 32
    assert panels[p, 32 * k + r] == w[32 * p + r, k]
    assert panels[0, 32 * 3 % panels.shape[1] + 1] == w[1, 3 % in_features]
    if out_features % 32:  # the last panel's columns past the weight: zero
        assert not panels.reshape(count, in_features, 32)[-1, :, r + 1 :].any()
    np.testing.assert_array_equal(panel_kernels.unpack(panels, out_features), w)


@pytest.mark.parametrize("threaded", [False, True])
@pytest.mark.parametrize(
    ("out_features", "in_features"),
    [(32, 16), (96, 300), (45, 7), (160, 1100), (33, 0)],  # 1100: 5 x 220 inputs
)
def test_the_panels_multiply_as_numpy_does(
    out_features: int, in_features: int, threaded: bool
) -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((out_features, in_features)).astype(np.float32)
    panels = panel_kernels.pack(w)
    for t_len in (0, 1, 3, 8, 9, 17, 64, 71, 130):
        x = rng.standard_normal((t_len, in_features)).astype(np.float32)
        out = np.full((t_len, out_features), np.nan, np.float32)
        assert panel_kernels.matmul(x, panels, out, threaded=threaded) is out
        _close(out, x.astype(np.float64) @ w.T.astype(np.float64))


def test_a_tokens_result_does_not_depend_on_the_call() -> None:
    """Eight-token and one-token sweeps add each lane's inputs in the same
    order, and threads split by panel: a row's bits are its own."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((200, 700)).astype(np.float32)
    panels = panel_kernels.pack(w)
    x = rng.standard_normal((39, 700)).astype(np.float32)
    whole = panel_kernels.matmul(x, panels, np.empty((39, 200), np.float32))
    for t in (0, 8, 33, 37, 38):  # sweeps of 8, 8, 4, 2 and 1 tokens
        alone = np.empty((1, 200), np.float32)
        panel_kernels.matmul(x[t : t + 1], panels, alone, threaded=False)
        np.testing.assert_array_equal(alone[0], whole[t])


def test_a_packed_linear_checks_its_arrays_and_computes_the_dense_product() -> None:
    rng = np.random.default_rng(3)
    w = rng.standard_normal((40, 24)).astype(np.float32)  # (in, out)
    bias = paddle.to_tensor(rng.standard_normal(24).astype(np.float32))
    lin = PackedLinear.from_dense(DenseLinear(paddle.to_tensor(w), bias))
    assert (lin.in_features, lin.out_features, lin.bias) == (40, 24, bias)
    x = rng.standard_normal((5, 40)).astype(np.float32)
    out = np.empty((5, 24), np.float32)
    assert lin.matmul_into(x, out) is out
    _close(out, x @ w)
    np.testing.assert_array_equal(lin(paddle.to_tensor(x)).numpy(), out)
    with pytest.raises(ValueError, match="x has 39 columns; the panels hold 40"):
        lin.matmul_into(x[:, :39].copy(), out)
    with pytest.raises(ValueError, match="out has 23 columns, not out_features 24"):
        lin.matmul_into(x, out[:, :23].copy())
    with pytest.raises(ValueError, match=r"out is \(4, 24\), not \(5, 24\)"):
        lin.matmul_into(x, out[:4].copy())
    with pytest.raises(ValueError, match="33 to 64 outputs"):
        panel_kernels.matmul(x, np.zeros((2, 40 * 32), np.float32), out)
    with pytest.raises(ValueError, match="x must be a 2-D float32 array, not float64"):
        lin.matmul_into(x.astype(np.float64), out)
    with pytest.raises(ValueError, match="out must be C-contiguous"):
        lin.matmul_into(x, np.empty((24, 5), np.float32).T)
    with pytest.raises(ValueError, match="do not hold 57 outputs"):
        PackedLinear(lin.panels, 25 + 32)
    # a tied head's (V, H) embedding reads as its transpose
    tied = PackedLinear.from_dense(DenseLinear(paddle.to_tensor(w.T), transposed=True))
    np.testing.assert_array_equal(tied.panels, lin.panels)


def test_only_the_eager_backend_runs_packed_linears() -> None:
    w = paddle.to_tensor(np.ones((32, 32), np.float32))
    lin = PackedLinear.from_dense(DenseLinear(w))
    check_backend([("p", lin)], "eager")
    for backend in ("inference", "training"):
        with pytest.raises(ModelLoadError, match=f"{backend} .* packed .*\\(p is"):
            check_backend([("p", lin)], backend)  # type: ignore[arg-type]


def _checkpoint(tmp_path: Path, **kw: Any) -> Path:
    directory = tmp_path / "m"
    make_tiny_model(directory, seed=5, **kw)
    return directory


@pytest.mark.parametrize("tied", [False, True])
def test_a_served_model_is_packed_and_computes_the_dense_one(
    tmp_path: Path, tied: bool
) -> None:
    directory = _checkpoint(tmp_path, tie_word_embeddings=tied)
    served = load_model(directory).model
    dense = build_model(served.config, _hf(directory))
    layer = served.weights.layers[0]
    for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
        assert isinstance(lin, PackedLinear)
    assert isinstance(served.weights.lm_head, PackedLinear)
    embed = served.weights.embed
    if tied:  # the table once: the embedding reads the head's panels
        assert (
            isinstance(embed, PackedEmbedding) and embed.head is served.weights.lm_head
        )
        ids = paddle.to_tensor(np.array([0, 5, served.config.vocab_size - 1]))
        np.testing.assert_array_equal(
            embed.lookup(ids).numpy(), dense.weights.embed.numpy()[ids.numpy()]
        )
        with pytest.raises(IndexError, match="token id -1 is outside"):
            embed.lookup(paddle.to_tensor(np.array([3, -1])))
        with pytest.raises(IndexError, match=f"{served.config.vocab_size} is outside"):
            embed.lookup(paddle.to_tensor(np.array([served.config.vocab_size])))
    else:
        assert isinstance(embed, paddle.Tensor)
    assert all(type(lin) is DenseLinear for _, lin in dense.weights.linears())
    _close(_logits(served), _logits(dense))  # a prefill
    for rows in (1, 3):  # decode steps on the step buffers' host views
        _close(_decode_logits(served, rows), _decode_logits(dense, rows))


def _hf(directory: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(directory / "model.safetensors"))


def test_what_is_not_packed(tmp_path: Path) -> None:
    """The predictors' and training's models keep Paddle weights: only the
    serving loaders pack, and only an eager float32 model on the CPU."""
    directory = _checkpoint(tmp_path)
    config = load_model(directory).config
    tensors = dict(random_hf_tensors(config, seed=1))
    model = build_model(config, dict(tensors))
    assert all(type(lin) is DenseLinear for _, lin in model.weights.linears())
    assert pack_linears(model) == 4 * config.num_hidden_layers + 1
    assert pack_linears(model) == 0  # nothing dense is left
    half = build_model(config, dict(tensors), dtype="bfloat16")
    assert pack_linears(half) == 0
    inference = load_model(directory, backend="inference").model
    assert all(type(lin) is DenseLinear for _, lin in inference.weights.linears())
