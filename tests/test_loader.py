"""Loading HF-layout checkpoints: formats, shards, dtypes, progress, errors."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import numpy as np
import pytest

from structllm.errors import ModelLoadError, UnsupportedModelError
from structllm.model._paddle import paddle
from structllm.model.attention import SequenceSlice
from structllm.model.checkpoint import write_random_checkpoint
from structllm.model.config import ModelConfig, tiny_random_config
from structllm.model.llama import LlamaForCausalLM
from structllm.model.loader import LoadProgress, load_model

CONFIG = attrs.evolve(tiny_random_config(), tie_word_embeddings=False)
PROMPT = [3, 141, 59, 26, 53, 58, 97]


def _logits(model: LlamaForCausalLM) -> np.ndarray:
    caches = model.allocate_kv_cache(4)
    meta = model.attention.build_metadata([SequenceSlice(0, len(PROMPT), [0, 1, 2])])
    hidden = model.forward(
        paddle.to_tensor(np.array(PROMPT)),
        paddle.to_tensor(np.arange(len(PROMPT))),
        caches,
        meta,
    )
    return model.compute_logits(hidden).numpy()


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    write_random_checkpoint(tmp_path / "m", CONFIG, seed=5)
    return tmp_path / "m"


def test_safetensors_equals_dummy_with_same_seed(checkpoint: Path) -> None:
    loaded = load_model(checkpoint, block_size=4)
    dummy = load_model(checkpoint, load_format="dummy", seed=5, block_size=4)
    assert loaded.config == CONFIG
    np.testing.assert_array_equal(_logits(loaded.model), _logits(dummy.model))


def test_sharded_checkpoint(tmp_path: Path, checkpoint: Path) -> None:
    write_random_checkpoint(tmp_path / "sharded", CONFIG, seed=5, shards=3)
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) == 3
    a = load_model(tmp_path / "sharded", block_size=4)
    b = load_model(checkpoint, block_size=4)
    np.testing.assert_array_equal(_logits(a.model), _logits(b.model))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_checkpoint_loads_as_float32(
    tmp_path: Path, checkpoint: Path, dtype: str
) -> None:
    write_random_checkpoint(tmp_path / dtype, CONFIG, seed=5, dtype=dtype)
    half = load_model(tmp_path / dtype, block_size=4)
    assert half.config.checkpoint_dtype == dtype
    assert half.model.dtype == paddle.float32
    full = _logits(load_model(checkpoint, block_size=4).model)
    # weights rounded to 8 (bf16) or 11 (fp16) mantissa bits
    tol = 0.5 if dtype == "bfloat16" else 0.05
    np.testing.assert_allclose(_logits(half.model), full, atol=tol, rtol=0)


def test_half_precision_compute_needs_a_gpu(checkpoint: Path) -> None:
    if paddle.is_compiled_with_cuda():
        pytest.skip("a GPU build can compute in bfloat16")
    with pytest.raises(ModelLoadError, match="needs a GPU"):
        load_model(checkpoint, dtype="bfloat16")


def test_progress_events(checkpoint: Path) -> None:
    events: list[LoadProgress] = []
    load_model(checkpoint, on_progress=events.append)
    total = events[0].total
    assert total == 3 + 9 * CONFIG.num_hidden_layers
    assert [e.done for e in events] == list(range(total + 1))
    assert {e.stage for e in events} == {"weights"}


def test_tiny_needs_no_files() -> None:
    loaded = load_model("tiny-random")
    assert loaded.path is None
    assert loaded.config.vocab_size == 258


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load_model(tmp_path)


def test_unsupported_architecture(checkpoint: Path) -> None:
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (checkpoint / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model(checkpoint)


def test_shape_mismatch_names_the_tensor(checkpoint: Path) -> None:
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (checkpoint / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"mlp\.gate_proj\.weight.*\(128, 64\)"):
        load_model(checkpoint)


def test_truncated_file(checkpoint: Path) -> None:
    f = checkpoint / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        load_model(checkpoint)


def test_corrupt_header(checkpoint: Path) -> None:
    f = checkpoint / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:16] = b"garbage!"
    f.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        load_model(checkpoint)


def test_no_weights(checkpoint: Path) -> None:
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_model(checkpoint)


def test_missing_shard(tmp_path: Path) -> None:
    write_random_checkpoint(tmp_path, CONFIG, shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"00002-of-00002.*missing"):
        load_model(tmp_path)


def test_missing_tensor(tmp_path: Path) -> None:
    config = attrs.evolve(CONFIG, tie_word_embeddings=True)
    write_random_checkpoint(tmp_path, config)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"lm_head\.weight"):
        load_model(tmp_path)


def test_config_roundtrip() -> None:
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"):
        config = attrs.evolve(
            tiny_random_config(), architecture=arch, qkv_bias=arch.startswith("Qwen2")
        )
        assert ModelConfig.from_hf(config.to_hf()) == config
