"""model/linear.py: the one seam every projection goes through.

A second kind of Linear (``_OutIn``: the HF ``(out, in)`` layout kept and
multiplied transposed, running eager only) stands in for the quantized
formats to come: every eager path must run it, into the callers' buffers,
and the backends that cannot must refuse it by name when the model is built.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import numpy as np
import pytest

from structllm.errors import ModelLoadError
from structllm.model._paddle import paddle
from structllm.model.attention import SequenceSlice
from structllm.model.config import ModelConfig, tiny_random_config
from structllm.model.linear import (
    Backend,
    ColumnParallelLoader,
    DenseLinear,
    Linear,
    LinearLoader,
    RowParallelLoader,
)
from structllm.model.llama import LlamaForCausalLM
from structllm.model.loader import build_model, projection_loaders, random_hf_tensors
from structllm.model.training import hf_tensors, trainable_weights
from tests.reference import reference_logits

ATOL = 1e-3  # as tests/test_model.py: logits spread ~8


@attrs.define(eq=False)
class _OutIn(Linear):
    kind: ClassVar[str] = "out-in"
    backends: ClassVar[frozenset[Backend]] = frozenset(("eager",))

    weight: paddle.Tensor  # (out, in)
    bias: paddle.Tensor | None = None
    calls: list[bool] = attrs.Factory(list)  # whether each call had out=

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def __call__(
        self, x: paddle.Tensor, out: paddle.Tensor | None = None
    ) -> paddle.Tensor:
        self.calls.append(out is not None)
        return paddle.matmul(x, self.weight, transpose_y=True, out=out)


def _out_in(
    config: ModelConfig, tensors: dict[str, np.ndarray], modules: list[str]
) -> dict[str, Linear]:
    """``modules`` as _OutIn Linears, their HF pieces taken out of ``tensors``."""
    loaders = projection_loaders(config)
    out: dict[str, Linear] = {}
    for module in modules:
        loader = loaders[module]
        w = np.concatenate([tensors.pop(p + ".weight") for p in loader.pieces])
        bias = None
        if loader.has_bias:
            bias = np.concatenate([tensors.pop(p + ".bias") for p in loader.pieces])
        out[module] = _OutIn(
            paddle.to_tensor(w), None if bias is None else paddle.to_tensor(bias)
        )
    return out


#: the first layer's projections and the head
MODULES = [
    "model.layers.0.self_attn.qkv_proj",
    "model.layers.0.self_attn.o_proj",
    "model.layers.0.mlp.gate_up_proj",
    "model.layers.0.mlp.down_proj",
    "lm_head",
]
UNTIED = attrs.evolve(tiny_random_config(), tie_word_embeddings=False)
BIASED = attrs.evolve(UNTIED, qkv_bias=True, o_bias=True, mlp_bias=True)


def _logits(model: LlamaForCausalLM, ids: list[int]) -> np.ndarray:
    """A prefill of 9 tokens, then one decode step a token."""
    caches = model.allocate_kv_cache(8)
    table = [6, 2, 7, 0, 5]

    def run(seq: SequenceSlice, tokens: list[int], positions: range) -> np.ndarray:
        meta = model.attention.build_metadata([seq])
        hidden = model.forward(
            paddle.to_tensor(np.asarray(tokens, dtype=np.int64)),
            paddle.to_tensor(np.asarray(positions, dtype=np.int64)),
            caches,
            meta,
        )
        return model.compute_logits(hidden).numpy()

    got = [run(SequenceSlice(0, 9, table), ids[:9], range(9))]
    for p in range(9, len(ids)):
        got.append(run(SequenceSlice(p, 1, table), [ids[p]], range(p, p + 1)))
    return np.concatenate(got)


@pytest.mark.parametrize("attention", ["kernels", "ops"])
@pytest.mark.parametrize("config", [UNTIED, BIASED], ids=["unbiased", "biased"])
def test_every_path_runs_another_kind_of_linear(
    config: ModelConfig, attention: str
) -> None:
    # unbiased decodes take the kernels' buffered path (_decode_layers),
    # biased ones the per-layer one; "ops" the eager functions the
    # predictors and training trace
    tensors = dict(random_hf_tensors(config, seed=3))
    ids = list(range(40, 56))
    expected = reference_logits(config, dict(tensors), ids)
    linears = _out_in(config, tensors, MODULES)
    model = build_model(config, tensors, block_size=4, linears=linears)
    model.attention.use_kernels = attention == "kernels"
    assert model.weights.layers[0].down is linears["model.layers.0.mlp.down_proj"]
    np.testing.assert_allclose(_logits(model, ids), expected, atol=ATOL, rtol=0)
    assert all(len(lin.calls) == 8 for lin in linears.values()), "every step"  # type: ignore[attr-defined]
    buffered = linears["model.layers.0.self_attn.qkv_proj"].calls  # type: ignore[attr-defined]
    assert any(buffered) == (attention == "kernels")


def test_a_tied_head_reads_the_embedding_and_may_be_given() -> None:
    config = tiny_random_config()
    assert config.tie_word_embeddings
    tensors = dict(random_hf_tensors(config, seed=3))
    embed = tensors["model.embed_tokens.weight"]
    model = build_model(config, dict(tensors))
    head = model.weights.lm_head
    assert isinstance(head, DenseLinear) and head.transposed
    assert head.weight is model.weights.embed  # no copy
    assert (head.in_features, head.out_features) == (
        config.hidden_size,
        config.vocab_size,
    )
    np.testing.assert_array_equal(head.in_out_weight().numpy(), embed.T)
    given = _OutIn(paddle.to_tensor(embed))
    model = build_model(config, dict(tensors), linears={"lm_head": given})
    assert model.weights.lm_head is given


def test_the_backends_that_cannot_run_a_kind_refuse_it_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = UNTIED
    tensors = dict(random_hf_tensors(config, seed=3))
    module = "model.layers.0.mlp.down_proj"

    def model(backend: str) -> LlamaForCausalLM:
        t = dict(tensors)
        return build_model(
            config, t, backend=backend, linears=_out_in(config, t, [module])
        )

    with pytest.raises(ModelLoadError, match=rf"inference .* out-in .*\({module}"):
        model("inference")
    # auto picks the predictors where they are faster, if they can run it
    monkeypatch.setattr("structllm.model.loader.cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr("structllm.model.kernels.available", lambda: False)
    monkeypatch.setattr("structllm.model.loader.AUTO_INFERENCE_MIN_PARAMETERS", 0)
    assert type(model("auto")) is LlamaForCausalLM
    assert type(build_model(config, dict(tensors), backend="auto")).__name__ == (
        "CompiledLlamaForCausalLM"
    )
    eager = model("eager")
    for train in (trainable_weights, lambda m: hf_tensors(config, m)):
        with pytest.raises(ModelLoadError, match=rf"training .* out-in .*{module}"):
            train(eager)


def test_given_linears_must_fit_and_replace_their_tensors() -> None:
    config = UNTIED
    tensors = dict(random_hf_tensors(config, seed=3))
    qkv = "model.layers.1.self_attn.qkv_proj"
    given = _out_in(config, dict(tensors), [qkv])  # its tensors left in
    with pytest.raises(ModelLoadError, match=rf"{qkv} is given as a Linear and as"):
        build_model(config, dict(tensors), linears=given)
    with pytest.raises(ModelLoadError, match="not projections of this model"):
        build_model(
            config, dict(tensors), linears={"model.layers.1.q_proj": given[qkv]}
        )
    o = "model.layers.1.self_attn.o_proj"
    t = dict(tensors)
    o_linear = _out_in(config, t, [qkv, o])[o]
    with pytest.raises(ModelLoadError, match=rf"out-in Linear given for {qkv} maps"):
        build_model(config, t, linears={qkv: o_linear, o: o_linear})
    with pytest.raises(ModelLoadError, match="not weights of this model"):
        build_model(config, {**tensors, "model.layers.0.mlp.extra.weight": np.ones(2)})
    t = dict(tensors)
    del t["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(
        ModelLoadError, match=r"lack model\.layers\.1\.mlp\.up_proj\.weight"
    ):
        build_model(config, t)


def test_dense_linear_is_one_matmul_into_the_buffer_given() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 4)).astype(np.float32)  # (in, out)
    x = rng.standard_normal((3, 6)).astype(np.float32)
    linear = DenseLinear(paddle.to_tensor(w))
    assert (linear.in_features, linear.out_features) == (6, 4)
    np.testing.assert_allclose(linear(paddle.to_tensor(x)).numpy(), x @ w, rtol=1e-6)
    buffer = paddle.zeros([3, 4])
    got = linear(paddle.to_tensor(x), out=buffer)
    np.testing.assert_allclose(buffer.numpy(), x @ w, rtol=1e-6)
    assert got.data_ptr() == buffer.data_ptr()
    transposed = DenseLinear(
        paddle.to_tensor(np.ascontiguousarray(w.T)), transposed=True
    )
    assert (transposed.in_features, transposed.out_features) == (6, 4)
    np.testing.assert_allclose(
        transposed(paddle.to_tensor(x)).numpy(), x @ w, rtol=1e-6
    )


def test_loaders_cut_a_rank_s_part_and_fuse_it() -> None:
    rng = np.random.default_rng(1)
    q = rng.standard_normal((8, 5)).astype(np.float32)  # (out, in): 4 heads of 2
    k = rng.standard_normal((4, 5)).astype(np.float32)  # 2 kv heads
    qb, kb = (rng.standard_normal(n).astype(np.float32) for n in (8, 4))
    qk = ColumnParallelLoader(
        ("a.q", "a.k"), has_bias=True, rows=(range(4, 8), range(2, 4))
    )
    slices = qk.slices()
    assert slices == {
        "a.q.weight": (slice(4, 8), slice(None)),
        "a.q.bias": (slice(4, 8),),
        "a.k.weight": (slice(2, 4), slice(None)),
        "a.k.bias": (slice(2, 4),),
    }
    full = {"a.q.weight": q, "a.q.bias": qb, "a.k.weight": k, "a.k.bias": kb}
    parts = {n: paddle.to_tensor(full[n][s]) for n, s in slices.items()}
    built = qk.build(parts, "float32")
    assert not parts, "consumed"
    np.testing.assert_array_equal(
        built.weight.numpy(), np.concatenate([q[4:], k[2:]]).T
    )
    assert built.bias is not None
    np.testing.assert_allclose(built.bias.numpy(), np.concatenate([qb[4:], kb[2:]]))
    assert (built.in_features, built.out_features) == (5, 6)

    down = RowParallelLoader(("m.down",), has_bias=True, columns=range(2, 5))
    assert down.slices() == {
        "m.down.weight": (slice(None), slice(2, 5)),
        "m.down.bias": (slice(None),),  # whole: added once, after the sum
    }
    assert LinearLoader(("lm_head",)).slices() == {"lm_head.weight": (slice(None),) * 2}
    with pytest.raises(ModelLoadError, match=r"lack m\.down\.bias"):
        down.build({"m.down.weight": paddle.zeros([4, 3])}, "float32")
    with pytest.raises(ValueError, match="2 pieces, 1 row ranges"):
        ColumnParallelLoader(("a", "b"), rows=(range(2),))
