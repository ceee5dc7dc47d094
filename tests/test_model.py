"""The Paddle decoder against a naive reference, through the paged KV cache."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from structllm.model._paddle import paddle
from structllm.model.attention import SequenceSlice
from structllm.model.config import ModelConfig, RopeScaling, tiny_random_config
from structllm.model.llama import LlamaForCausalLM
from structllm.model.loader import build_model, random_hf_tensors
from tests.reference import reference_logits

# float32 end to end; logits have a spread of ~8, so 1e-3 absolute is tight
ATOL = 1e-3

CONFIGS = {
    "llama-gqa-tied": tiny_random_config(),
    "llama-mha-untied": attrs.evolve(
        tiny_random_config(), num_key_value_heads=4, tie_word_embeddings=False
    ),
    "qwen2-bias": attrs.evolve(
        tiny_random_config(), architecture="Qwen2ForCausalLM", qkv_bias=True
    ),
    "llama3-rope": attrs.evolve(
        tiny_random_config(),
        rope_theta=500000.0,
        rope_scaling=RopeScaling(
            rope_type="llama3", factor=8.0, original_max_position_embeddings=64
        ),
    ),
    "sliding-window": attrs.evolve(
        tiny_random_config(), architecture="MistralForCausalLM", sliding_window=5
    ),
    "linear-rope": attrs.evolve(
        tiny_random_config(), rope_scaling=RopeScaling(rope_type="linear", factor=2.0)
    ),
    "yarn-rope": attrs.evolve(
        tiny_random_config(),
        rope_theta=1e6,
        rope_scaling=RopeScaling(
            rope_type="yarn", factor=4.0, original_max_position_embeddings=16
        ),
    ),
    "dynamic-rope": attrs.evolve(
        tiny_random_config(), rope_scaling=RopeScaling(rope_type="dynamic", factor=2.0)
    ),
    "llama-all-biases": attrs.evolve(
        tiny_random_config(), qkv_bias=True, o_bias=True, mlp_bias=True
    ),
    "qwen3-qk-norm-head-dim-24": attrs.evolve(
        tiny_random_config(),
        architecture="Qwen3ForCausalLM",
        head_dim=24,
        qk_norm=True,
        tie_word_embeddings=False,
    ),
    # three layers: the oneDNN backend then has two "between" predictors, and
    # a bias in each (one shared predictor kept the first layer's weights)
    "qwen2-three-layers": attrs.evolve(
        tiny_random_config(),
        architecture="Qwen2ForCausalLM",
        qkv_bias=True,
        num_hidden_layers=3,
    ),
    "qwen2-sliding-layer-1": attrs.evolve(
        tiny_random_config(),
        architecture="Qwen2ForCausalLM",
        qkv_bias=True,
        sliding_window=4,
        sliding_layers=(1,),
    ),
}


def _model(
    config: ModelConfig,
    block_size: int = 4,
    backend: str = "eager",
    attention: str = "kernels",
) -> LlamaForCausalLM:
    model = build_model(
        config,
        dict(random_hf_tensors(config, seed=3)),
        block_size=block_size,
        backend=backend,
    )
    # the compiled CPU kernels (model/kernels.py), or Paddle ops alone
    assert model.attention.use_kernels
    model.attention.use_kernels = attention == "kernels"
    return model


def _run(model, seqs, token_ids, positions, caches):
    meta = model.attention.build_metadata(seqs)
    hidden = model.forward(
        paddle.to_tensor(np.asarray(token_ids, dtype=np.int64)),
        paddle.to_tensor(np.asarray(positions, dtype=np.int64)),
        caches,
        meta,
    )
    return model.compute_logits(hidden).numpy()


@pytest.mark.parametrize("attention", ["kernels", "ops"])
@pytest.mark.parametrize("backend", ["eager", "inference"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_mixed_paged_batch_matches_reference(
    name: str, backend: str, attention: str
) -> None:
    config = CONFIGS[name]
    block_size = 4
    model = _model(config, block_size, backend, attention)
    weights = dict(random_hf_tensors(config, seed=3))
    rng = np.random.default_rng(0)
    # four sequences with shuffled, interleaved blocks in one pool
    lengths = [1, 7, 12, 21]
    prompts = [rng.integers(0, 256, size=n).tolist() for n in lengths]
    blocks = rng.permutation(40).tolist()
    tables, start = [], 0
    for n in lengths:
        need = -(-n // block_size)
        tables.append(blocks[start : start + need])
        start += need
    caches = model.allocate_kv_cache(40)
    expected = [reference_logits(config, weights, p) for p in prompts]

    # step 1: sequences 0 and 1 whole, 2 and 3 a first chunk of 5 and 9
    done = [0, 0, 0, 0]
    plan = [[1, 7, 5, 9], [0, 0, 7, 10], [0, 0, 0, 2]]
    for step in plan:
        # one-token chunks first, as the metadata builder requires
        order = sorted((i for i in range(4) if step[i]), key=lambda i: step[i] > 1)
        seqs, ids, pos, rows = [], [], [], []
        for i in order:
            n = step[i]
            seqs.append(SequenceSlice(done[i], n, tables[i]))
            ids += prompts[i][done[i] : done[i] + n]
            pos += range(done[i], done[i] + n)
            rows.append((i, done[i], n))
            done[i] += n
        logits = _run(model, seqs, ids, pos, caches)
        r = 0
        for i, first, n in rows:
            np.testing.assert_allclose(
                logits[r : r + n], expected[i][first : first + n], atol=ATOL, rtol=0
            )
            r += n
    assert done == lengths


@pytest.mark.parametrize("attention", ["kernels", "ops"])
def test_decode_after_prefill_matches_reference(attention: str) -> None:
    config = CONFIGS["llama-gqa-tied"]
    model = _model(config, block_size=4, attention=attention)
    weights = dict(random_hf_tensors(config, seed=3))
    ids = list(range(40, 58))
    expected = reference_logits(config, weights, ids)
    caches = model.allocate_kv_cache(8)
    table = [6, 2, 7, 0, 5]
    got = [_run(model, [SequenceSlice(0, 9, table)], ids[:9], range(9), caches)]
    for p in range(9, len(ids)):
        got.append(_run(model, [SequenceSlice(p, 1, table)], [ids[p]], [p], caches))
    np.testing.assert_allclose(np.concatenate(got), expected, atol=ATOL, rtol=0)


def test_decode_rows_must_come_first() -> None:
    model = _model(tiny_random_config())
    with pytest.raises(ValueError, match="one-token"):
        model.attention.build_metadata(
            [SequenceSlice(0, 3, [0]), SequenceSlice(3, 1, [1])]
        )


@pytest.mark.parametrize("attention", ["kernels", "ops"])
def test_gather_refuses_a_slot_outside_the_cache(attention: str) -> None:
    # host gathers use np.take(mode="clip") into reused buffers, and the
    # kernels read unchecked; the range is checked first, so a bad block
    # table raises instead of reading another slot (or outside the cache)
    model = _model(tiny_random_config(), block_size=4, attention=attention)
    caches = model.allocate_kv_cache(2)  # 8 slots
    # the new token goes to block 0 (valid); its past sits in block 5 (not)
    meta = model.attention.build_metadata([SequenceSlice(4, 1, [5, 0])])
    with pytest.raises(IndexError, match=r"(slot|block) out of range"):
        model.forward(
            paddle.to_tensor(np.array([1], dtype=np.int64)),
            paddle.to_tensor(np.array([4], dtype=np.int64)),
            caches,
            meta,
        )


#: how far a 16-bit cache's logits may be from the float32 reference's
_KV_ERROR = {"bfloat16": 0.2, "float16": 0.03}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", ["llama-gqa-tied", "qwen3-qk-norm-head-dim-24"])
def test_a_16_bit_kv_cache_stays_near_the_reference(name: str, dtype: str) -> None:
    # keys and values rounded to bfloat16 (8 bits of mantissa): the logits
    # (spread ~8) move by up to ~0.08 on these random models, float16 (11
    # bits) by up to ~0.01, against 1e-3 in float32; prefill chunks and
    # decodes alike read the cache through the kernels. A wrong conversion
    # moves them by whole units.
    config = CONFIGS[name]
    model = _model(config, block_size=4)
    model.set_kv_cache_dtype(dtype)
    weights = dict(random_hf_tensors(config, seed=3))
    ids = list(range(40, 58))
    expected = reference_logits(config, weights, ids)
    caches = model.allocate_kv_cache(8)
    assert caches[0][0].dtype == getattr(paddle, dtype)
    table = [6, 2, 7, 0, 5]
    got = [_run(model, [SequenceSlice(0, 5, table)], ids[:5], range(5), caches)]
    got.append(_run(model, [SequenceSlice(5, 4, table)], ids[5:9], range(5, 9), caches))
    for p in range(9, len(ids)):
        got.append(_run(model, [SequenceSlice(p, 1, table)], [ids[p]], [p], caches))
    got = np.concatenate(got)
    err = np.abs(got - expected).max()
    assert err < _KV_ERROR[dtype]
    assert (got.argmax(-1) == expected.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("attention", ["kernels", "ops"])
def test_a_position_past_the_rope_tables_is_refused(attention: str) -> None:
    # neither the kernels nor Paddle's indexing of the tables on CPU check
    # a position: the step's positions are checked once, before any layer
    model = _model(tiny_random_config(), block_size=4, attention=attention)
    caches = model.allocate_kv_cache(2)
    meta = model.attention.build_metadata([SequenceSlice(0, 1, [0])])
    limit = model._rope.cos.shape[0]
    with pytest.raises(IndexError, match="position out of range"):
        model.forward(
            paddle.to_tensor(np.array([1], dtype=np.int64)),
            paddle.to_tensor(np.array([limit], dtype=np.int64)),
            caches,
            meta,
        )
