"""GGUF files as models: metadata to config, names and q/k order, tokenizer, errors.

The files are written by ``tests/gguf_convert.py`` from generated Hugging
Face checkpoints, as llama.cpp's converter writes them; the same weights
loaded from the safetensors directory are the expectation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from structllm import LLM, AsyncLLM, SamplingParams
from structllm.cli import main as cli_main
from structllm.errors import ModelLoadError, UnsupportedModelError
from structllm.formats.gguf import GGUFFile
from structllm.model._paddle import paddle
from structllm.model.attention import SequenceSlice
from structllm.model.config import ModelConfig
from structllm.model.gguf_config import hf_config_from_gguf
from structllm.model.loader import build_model, load_model
from structllm.model.parallel import load_shard, plan_shards
from structllm.models import make_tiny_model
from tests import gguf_bytes as gb
from tests.gguf_convert import convert

PROMPT = [3, 141, 59, 26, 53, 58, 97, 11, 200]


def _logits(model: Any) -> np.ndarray:
    """The prompt's logits over a float32 cache (a quantized model's default
    is float16: these compare the weights' arithmetic)."""
    model.set_kv_cache_dtype("float32")
    caches = model.allocate_kv_cache(4)
    meta = model.attention.build_metadata([SequenceSlice(0, len(PROMPT), [0, 1, 2])])
    hidden = model.forward(
        paddle.to_tensor(np.array(PROMPT)),
        paddle.to_tensor(np.arange(len(PROMPT))),
        caches,
        meta,
    )
    return np.asarray(model.compute_logits(hidden).numpy())


def _checkpoint(tmp_path: Path, arch: str, **kw: Any) -> Path:
    directory = tmp_path / arch
    make_tiny_model(directory, arch=arch, seed=7, **kw)  # type: ignore[arg-type]
    return directory


@pytest.mark.parametrize(
    ("arch", "kw"),
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True, "num_kv_heads": 1}),
        ("qwen2", {}),
        ("qwen3", {}),
        ("mistral", {"sliding_window": 4}),
    ],
)
def test_a_float_gguf_computes_its_checkpoint(
    tmp_path: Path, arch: str, kw: dict[str, Any]
) -> None:
    directory = _checkpoint(tmp_path, arch, **kw)
    convert(directory, tmp_path / "m.gguf")
    ours = load_model(tmp_path / "m.gguf")
    theirs = load_model(directory)
    # the file keeps eps as float32 (llama.cpp computes with that value)
    assert ours.config == attrs.evolve(
        theirs.config,
        bos_token_id=ours.config.bos_token_id,
        rms_norm_eps=float(np.float32(theirs.config.rms_norm_eps)),
    )
    np.testing.assert_allclose(_logits(ours.model), _logits(theirs.model), atol=1e-5)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "F16", "BF16"])
def test_quantized_weights_load_as_the_file_holds_them(
    tmp_path: Path, qtype: str
) -> None:
    directory = _checkpoint(tmp_path, "llama")
    held = convert(directory, tmp_path / "m.gguf", qtype=qtype)
    # dequantized on load (kept in their blocks: tests/test_quantized_linear.py)
    ours = load_model(tmp_path / "m.gguf", quantization="none")
    expected = build_model(ours.config, dict(held))  # dense: Paddle's matmul
    # the served model's packed projections sum in another order
    np.testing.assert_allclose(_logits(ours.model), _logits(expected), atol=1e-4)
    # and the quantization is real: not the float weights
    if qtype.startswith("Q"):
        plain = _logits(load_model(directory).model)
        assert np.abs(_logits(ours.model) - plain).max() > 1e-4


def test_llm_runs_a_gguf_file_with_its_own_tokenizer(tmp_path: Path) -> None:
    directory = _checkpoint(tmp_path, "llama")
    convert(directory, tmp_path / "m.gguf")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompt = "The cat sat on the mat, and"
    [ours] = LLM(str(tmp_path / "m.gguf"), show_progress=False).generate(
        [prompt], params
    )
    [theirs] = LLM(str(directory), show_progress=False).generate([prompt], params)
    assert ours.prompt_token_ids == theirs.prompt_token_ids
    assert ours.token_ids == theirs.token_ids
    assert ours.text == theirs.text


def test_a_directory_holding_one_gguf_file_loads_it(tmp_path: Path) -> None:
    directory = _checkpoint(tmp_path, "qwen2")
    (tmp_path / "only").mkdir()
    convert(directory, tmp_path / "only" / "model.gguf")
    assert load_model(tmp_path / "only").config.model_type == "qwen2"


def test_inspect_reads_the_metadata(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = _checkpoint(tmp_path, "qwen3")
    convert(directory, tmp_path / "m.gguf", qtype="Q8_0")
    assert cli_main(["inspect", str(tmp_path / "m.gguf")]) == 0
    out = capsys.readouterr().out
    assert "qwen3 (Qwen3ForCausalLM)" in out and "q/k RMSNorm" in out
    assert "GGUF v3" in out and "Q8_0" in out


# --- what the file says that structllm will not guess -----------------------


def test_unknown_architecture_keys_are_refused_by_name(tmp_path: Path) -> None:
    directory = _checkpoint(tmp_path, "llama")
    convert(
        directory,
        tmp_path / "m.gguf",
        metadata={"llama.attn_logit_softcapping": 30.0},
    )
    with pytest.raises(
        UnsupportedModelError, match=r"m\.gguf.*llama\.attn_logit_softcapping"
    ):
        load_model(tmp_path / "m.gguf")


def test_unknown_architectures_are_refused(tmp_path: Path) -> None:
    directory = _checkpoint(tmp_path, "llama")
    convert(directory, tmp_path / "m.gguf", arch="gemma3")
    with pytest.raises(UnsupportedModelError, match=r"general\.architecture='gemma3'"):
        load_model(tmp_path / "m.gguf")


def test_a_tensor_the_metadata_does_not_use_is_refused(tmp_path: Path) -> None:
    # q/k/v biases in the file, but a Llama without attention_bias would drop
    # the o bias: convert a Qwen2 checkpoint and call it Llama
    directory = _checkpoint(tmp_path, "qwen2")
    convert(directory, tmp_path / "m.gguf", arch="llama")
    config = ModelConfig.from_gguf(tmp_path / "m.gguf")
    assert config.qkv_bias and config.o_bias  # Llama's attention_bias means both
    with pytest.raises(ModelLoadError, match=r"lacks 2 tensors.*o_proj\.bias"):
        load_model(tmp_path / "m.gguf")


def test_a_missing_tensor_is_named(tmp_path: Path) -> None:
    directory = _checkpoint(tmp_path, "llama")
    convert(directory, tmp_path / "m.gguf", drop=("model.layers.1.mlp.up_proj.weight",))
    with pytest.raises(
        ModelLoadError, match=r"lacks 1 tensors.*layers\.1\.mlp\.up_proj"
    ):
        load_model(tmp_path / "m.gguf")


def test_a_shape_that_disagrees_with_the_metadata_names_tensor_and_offset(
    tmp_path: Path,
) -> None:
    directory = _checkpoint(tmp_path, "llama")
    config = json.loads((directory / "config.json").read_text())
    config["intermediate_size"] = 96
    (directory / "config.json").write_text(json.dumps(config))
    convert(directory, tmp_path / "m.gguf")  # weights still of 128
    with pytest.raises(
        ModelLoadError, match=r"tensor blk\.0\.ffn_\w+\.weight at offset \d+ has shape"
    ):
        load_model(tmp_path / "m.gguf")


def test_a_truncated_file_is_a_load_error(tmp_path: Path) -> None:
    directory = _checkpoint(tmp_path, "llama")
    convert(directory, tmp_path / "m.gguf")
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "m.gguf").write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError, match=r"m\.gguf"):
        load_model(tmp_path / "m.gguf")


# --- metadata mapping, key by key ------------------------------------------

BASE: dict[str, Any] = {
    "general.architecture": "llama",
    "llama.context_length": 4096,
    "llama.embedding_length": 256,
    "llama.block_count": 2,
    "llama.feed_forward_length": 512,
    "llama.attention.head_count": 4,
    "llama.attention.head_count_kv": 2,
    "llama.attention.layer_norm_rms_epsilon": 1e-5,
    "llama.rope.freq_base": 500000.0,
    "llama.vocab_size": 1000,
}
SHAPES = {"token_embd.weight": (1000, 256)}


def _config(metadata: Mapping[str, Any], **kw: Any) -> ModelConfig:
    return ModelConfig.from_hf(
        hf_config_from_gguf(metadata, SHAPES, source="x.gguf", **kw)
    )


def test_the_basic_keys_map_as_llama_cpp_reads_them() -> None:
    c = _config(BASE)
    assert (c.hidden_size, c.num_hidden_layers, c.intermediate_size) == (256, 2, 512)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 64)
    assert c.rope_theta == 500000.0 and c.rms_norm_eps == pytest.approx(1e-5)
    assert c.tie_word_embeddings and c.max_position_embeddings == 4096
    assert c.rope_scaling is None and c.sliding_window is None


def test_vocab_size_is_the_token_count_without_reading_the_tokens(
    tmp_path: Path,
) -> None:
    """As llama.cpp's n_vocab; from a file, the count is the array's header
    (the tokens themselves are the tokenizer's, never built for a config)."""
    base = {k: v for k, v in BASE.items() if k != "llama.vocab_size"}
    tokens = [f"t{i}" for i in range(900)]
    assert _config({**base, "tokenizer.ggml.tokens": tokens}).vocab_size == 900
    assert _config(base).vocab_size == 1000  # else the embedding's rows
    kvs = [gb.kv("tokenizer.ggml.tokens", gb.ARRAY, (gb.STRING, tokens))]
    for key, value in base.items():
        kind = {str: gb.STRING, int: gb.UINT32, float: gb.FLOAT32}[type(value)]
        kvs.append(gb.kv(key, kind, value))
    path = tmp_path / "x.gguf"
    path.write_bytes(gb.build(kvs).data)
    with GGUFFile.open(path) as f:
        md = f.metadata
        looked_up: list[str] = []
        getitem = type(md).__getitem__

        def spy(self: Any, key: str) -> Any:
            looked_up.append(key)
            return getitem(self, key)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(type(md), "__getitem__", spy)
            assert _config(md).vocab_size == 900
        assert looked_up and "tokenizer.ggml.tokens" not in looked_up


def test_head_dim_comes_from_key_length() -> None:
    c = _config(
        {**BASE, "llama.attention.key_length": 32, "llama.attention.value_length": 32}
    )
    assert c.head_dim == 32
    with pytest.raises(UnsupportedModelError, match=r"value_length=48"):
        _config(
            {
                **BASE,
                "llama.attention.key_length": 32,
                "llama.attention.value_length": 48,
            }
        )


def test_partial_rotary_is_refused() -> None:
    with pytest.raises(UnsupportedModelError, match=r"rope.dimension_count=32"):
        _config({**BASE, "llama.rope.dimension_count": 32})


def test_rope_scaling_linear_and_yarn() -> None:
    c = _config(
        {**BASE, "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    )
    assert c.rope_scaling is not None
    assert (c.rope_scaling.rope_type, c.rope_scaling.factor) == ("linear", 4.0)
    c = _config(
        {
            **BASE,
            "llama.rope.scaling.type": "yarn",
            "llama.rope.scaling.factor": 4.0,
            "llama.rope.scaling.original_context_length": 1024,
            "llama.rope.scaling.yarn_beta_fast": 16.0,
        }
    )
    sc = c.rope_scaling
    assert sc is not None and sc.rope_type == "yarn" and sc.factor == 4.0
    assert sc.original_max_position_embeddings == 1024 and sc.beta_fast == 16.0
    with pytest.raises(UnsupportedModelError, match=r"longrope"):
        _config(
            {
                **BASE,
                "llama.rope.scaling.type": "longrope",
                "llama.rope.scaling.factor": 2.0,
            }
        )


def _llama3_factors(factor: float, theta: float, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for Llama 3.1 (written out again)."""
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * np.pi / freq
        if wavelen < 8192 / 4.0:
            out.append(1.0)
        elif wavelen > 8192 / 1.0:
            out.append(factor)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def test_llama3_frequency_factors_become_llama3_scaling() -> None:
    freqs = _llama3_factors(8.0, 500000.0, 64)
    c = _config(BASE, rope_freqs=freqs)
    sc = c.rope_scaling
    assert sc is not None and sc.rope_type == "llama3" and sc.factor == 8.0
    assert (sc.low_freq_factor, sc.high_freq_factor) == (1.0, 4.0)
    assert sc.original_max_position_embeddings == 8192
    with pytest.raises(UnsupportedModelError, match=r"rope_freqs.weight"):
        _config(BASE, rope_freqs=freqs * 1.5)


def test_sliding_window_is_mistral_on_llama_and_refused_elsewhere() -> None:
    c = _config({**BASE, "llama.attention.sliding_window": 4096})
    assert c.model_type == "mistral" and c.sliding_window == 4096
    qwen = {k.replace("llama.", "qwen2."): v for k, v in BASE.items()}
    qwen["general.architecture"] = "qwen2"
    assert _config(qwen).qkv_bias
    with pytest.raises(UnsupportedModelError, match=r"qwen2.attention.sliding_window"):
        _config({**qwen, "qwen2.attention.sliding_window": 4096})


def test_per_layer_arrays_must_be_uniform() -> None:
    c = _config({**BASE, "llama.feed_forward_length": np.array([512, 512], np.uint32)})
    assert c.intermediate_size == 512
    with pytest.raises(
        UnsupportedModelError, match=r"feed_forward_length.*varies per layer"
    ):
        _config({**BASE, "llama.feed_forward_length": np.array([512, 1024], np.uint32)})


def test_missing_keys_are_named() -> None:
    partial = {k: v for k, v in BASE.items() if k != "llama.block_count"}
    with pytest.raises(
        ModelLoadError, match=r"x\.gguf: metadata lacks llama\.block_count"
    ):
        _config(partial)


def test_neutral_values_of_foreign_keys_pass() -> None:
    assert _config({**BASE, "llama.expert_count": 0}).num_hidden_layers == 2
    with pytest.raises(UnsupportedModelError, match=r"llama.expert_count=8"):
        _config({**BASE, "llama.expert_count": 8})
    # an embedding model's pooling (read by embeddings only): unspecified,
    # none, mean and last load; CLS and rank are refused by name
    for pooling in (-1, 0, 1, 3):
        assert _config({**BASE, "llama.pooling_type": pooling}).num_hidden_layers == 2
    for pooling in (2, 4):
        with pytest.raises(UnsupportedModelError, match=r"llama.pooling_type="):
            _config({**BASE, "llama.pooling_type": pooling})


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tensor_parallel_rank_reads_its_slices_of_a_gguf_file(
    tmp_path: Path, rank: int
) -> None:
    directory = _checkpoint(tmp_path, "llama")  # 4 q heads, 2 kv heads
    convert(directory, tmp_path / "m.gguf")
    ours = load_shard(
        tmp_path / "m.gguf",
        plan_shards(ModelConfig.from_gguf(tmp_path / "m.gguf"), 2, rank),
        block_size=4,
        all_reduce=lambda x: x,
    )
    theirs = load_shard(
        directory,
        plan_shards(ModelConfig.from_directory(directory), 2, rank),
        block_size=4,
        all_reduce=lambda x: x,
    )
    for mine, other in zip(ours.weights.layers, theirs.weights.layers, strict=True):
        for name in ("qkv", "o", "gate_up", "down"):  # packed: PackedLinear
            np.testing.assert_array_equal(
                getattr(mine, name).panels, getattr(other, name).panels
            )


@pytest.mark.anyio
async def test_async_llm_serves_a_gguf_file(tmp_path: Path) -> None:
    """The core process loads the file (kept quantized), the front end
    tokenizes with the file's own tokenizer."""
    directory = _checkpoint(tmp_path, "llama")
    convert(directory, tmp_path / "m.gguf", qtype="Q8_0")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    [expected] = LLM(str(tmp_path / "m.gguf"), show_progress=False).generate(
        ["The cat sat"], params
    )
    async with AsyncLLM.open(str(tmp_path / "m.gguf")) as llm:
        out = await llm.complete("The cat sat", params)
    assert out.token_ids == expected.token_ids and out.text == expected.text
