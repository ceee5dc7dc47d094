"""Reading config.json: both transformers forms, family defaults, refusals."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import attrs
import pytest

from structllm.cli import main
from structllm.errors import ModelLoadError, UnsupportedModelError
from structllm.model.checkpoint import write_random_checkpoint
from structllm.model.config import ModelConfig, RopeScaling, tiny_random_config
from structllm.model.loader import load_model

# config.json files as published (4.x form), abridged of nothing that matters
LLAMA_31_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.42.3",
    "use_cache": True,
    "vocab_size": 128256,
}
QWEN25_7B_YARN: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "rope_scaling": {
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
        "type": "yarn",
    },
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 152064,
}
QWEN3_8B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
MISTRAL_7B: dict[str, Any] = {
    "architectures": ["MistralForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.34.0",
    "use_cache": True,
    "vocab_size": 32768,
}
PUBLISHED = {
    "llama-3.1-8b": LLAMA_31_8B,
    "qwen2.5-7b-yarn": QWEN25_7B_YARN,
    "qwen3-8b": QWEN3_8B,
    "mistral-theta-5e5": MISTRAL_7B,
}


def as_v5(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` as transformers 5 writes it: rope_parameters and dtype."""
    d = copy.deepcopy(d)
    rope = d.pop("rope_scaling", None) or {}
    if "type" in rope:
        rope["rope_type"] = rope.pop("type")
    rope.setdefault("rope_type", "default")
    rope["rope_theta"] = d.pop("rope_theta", 10000.0)
    d["rope_parameters"] = rope
    d["dtype"] = d.pop("torch_dtype")
    d["transformers_version"] = "5.24.0"
    return d


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_both_forms_read_the_same(name: str) -> None:
    old = PUBLISHED[name]
    assert ModelConfig.from_hf(old) == ModelConfig.from_hf(as_v5(old))


def test_rope_theta_from_the_current_form() -> None:
    # the case: a 5.x Mistral with theta 5e5 used to read 10000
    config = ModelConfig.from_hf(as_v5(MISTRAL_7B))
    assert config.rope_theta == 500000.0
    assert config.sliding_window is None
    assert config.checkpoint_dtype == "bfloat16"


def test_published_configs_read_as_transformers_reads_them() -> None:
    llama = ModelConfig.from_hf(LLAMA_31_8B)
    assert llama.rope_scaling == RopeScaling(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    assert llama.eos_token_ids == (128001, 128008, 128009)
    assert (llama.head_dim, llama.rms_norm_eps) == (128, 1e-5)
    assert not (llama.qkv_bias or llama.o_bias or llama.mlp_bias)

    qwen = ModelConfig.from_hf(QWEN25_7B_YARN)
    assert qwen.qkv_bias and not qwen.o_bias
    assert qwen.sliding_window is None  # use_sliding_window is false
    assert qwen.rope_scaling is not None and qwen.rope_scaling.rope_type == "yarn"
    assert qwen.max_context_len == 4 * 32768  # yarn extends the context

    qwen3 = ModelConfig.from_hf(QWEN3_8B)
    assert qwen3.qk_norm and qwen3.head_dim == 128
    assert qwen3.rope_theta == 1e6 and qwen3.rope_scaling is None


def test_family_defaults_fill_absent_fields() -> None:
    # transformers' config classes: Mistral windows 4096 by default, Qwen3's
    # head_dim is 128 whatever hidden/heads is, Llama has no window at all
    mistral = {k: v for k, v in MISTRAL_7B.items() if k != "sliding_window"}
    assert ModelConfig.from_hf(mistral).sliding_window == 4096
    qwen3 = {k: v for k, v in QWEN3_8B.items() if k != "head_dim"}
    assert ModelConfig.from_hf({**qwen3, "hidden_size": 1024}).head_dim == 128
    llama = ModelConfig.from_hf({**LLAMA_31_8B, "sliding_window": 4096})
    assert llama.sliding_window is None
    no_rope = {k: v for k, v in LLAMA_31_8B.items() if not k.startswith("rope")}
    assert ModelConfig.from_hf(no_rope).rope_theta == 10000.0


def test_qwen_sliding_layers_follow_max_window_layers_and_layer_types() -> None:
    base = {**QWEN3_8B, "num_hidden_layers": 4, "use_sliding_window": True}
    config = ModelConfig.from_hf({**base, "sliding_window": 64, "max_window_layers": 2})
    assert config.sliding_window == 64 and config.sliding_layers == (2, 3)
    assert [config.layer_window(i) for i in range(4)] == [None, None, 64, 64]
    explicit = ModelConfig.from_hf(
        {
            **base,
            "sliding_window": 64,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        }
    )
    assert explicit.sliding_layers == (0, 2)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hidden_act", "gelu"),
        ("partial_rotary_factor", 0.5),
        ("final_logit_softcapping", 30.0),
        ("attn_logit_softcapping", 50.0),
        ("quantization_config", {"quant_method": "gptq", "bits": 4}),
        ("use_qk_norm", True),
        ("qk_layernorm", True),
        ("clip_qkv", 8.0),
        ("logits_scaling", 8.0),
        ("embedding_multiplier", 12.0),
        ("residual_multiplier", 0.22),
        ("attention_multiplier", 0.0078),
        ("query_pre_attn_scalar", 256),
        ("use_parallel_residual", True),
        ("num_local_experts", 8),
        ("dtype", "int8"),
    ],
)
def test_fields_that_change_the_output_are_refused_by_name(
    field: str, value: Any
) -> None:
    with pytest.raises(UnsupportedModelError, match=rf"{field}={value!r}"):
        ModelConfig.from_hf({**LLAMA_31_8B, field: value})


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_type"),
        ({"rope_scaling": {"type": "su", "factor": 4.0}}, "rope_type"),
        (
            {
                "rope_scaling": {
                    "rope_type": "linear",
                    "factor": 2.0,
                    "partial_rotary_factor": 0.5,
                }
            },
            "partial_rotary_factor",
        ),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"rope_scaling": {"rope_type": "linear"}}, "factor"),
        (
            {
                "rope_scaling": None,
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                },
            },
            "nested per layer type",
        ),
        ({"architectures": ["GemmaForCausalLM"], "model_type": "gemma"}, "Gemma"),
    ],
)
def test_unsupported_rope_and_architectures_are_refused(
    change: dict[str, Any], named: str
) -> None:
    with pytest.raises(UnsupportedModelError, match=named):
        ModelConfig.from_hf({**LLAMA_31_8B, **change})


def test_window_layouts_structllm_would_have_to_guess_are_refused() -> None:
    with pytest.raises(UnsupportedModelError, match="layer_types"):
        ModelConfig.from_hf(
            {
                **MISTRAL_7B,
                "num_hidden_layers": 2,
                "layer_types": ["sliding_attention", "full_attention"],
            }
        )
    with pytest.raises(UnsupportedModelError, match="use_sliding_window is false"):
        ModelConfig.from_hf(
            {
                **QWEN3_8B,
                "num_hidden_layers": 2,
                "layer_types": ["sliding_attention", "full_attention"],
            }
        )


@pytest.mark.parametrize(
    "config",
    [
        attrs.evolve(tiny_random_config(), rope_theta=5e5),
        attrs.evolve(tiny_random_config(), qkv_bias=True, o_bias=True, mlp_bias=True),
        attrs.evolve(
            tiny_random_config(),
            architecture="Qwen3ForCausalLM",
            qk_norm=True,
            head_dim=24,
            sliding_window=8,
            sliding_layers=(1,),
            rope_scaling=RopeScaling(
                rope_type="yarn", factor=4.0, original_max_position_embeddings=512
            ),
        ),
        attrs.evolve(
            tiny_random_config(),
            architecture="MistralForCausalLM",
            sliding_window=16,
            rope_scaling=RopeScaling(rope_type="dynamic", factor=2.0),
        ),
    ],
)
def test_written_configs_read_back_in_both_forms(config: ModelConfig) -> None:
    assert ModelConfig.from_hf(config.to_hf()) == config
    assert ModelConfig.from_hf(config.to_hf(legacy=True)) == config


def test_tensors_the_config_does_not_use_are_refused(tmp_path: Path) -> None:
    # weights with biases under a config that says there are none: running
    # without them would be a different model
    write_random_checkpoint(
        tmp_path, attrs.evolve(tiny_random_config(), qkv_bias=True, o_bias=True)
    )
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["attention_bias"] = False
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"does not use.*_proj\.bias"):
        load_model(tmp_path)


def test_inspect_prints_what_will_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(as_v5(QWEN3_8B)))
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "qwen3 (Qwen3ForCausalLM)" in out
    assert "GQA: 32 query heads, 8 KV heads, head_dim 128, q/k RMSNorm" in out
    assert "theta 1e+06, default" in out
    # 2 (K and V) x 36 layers x 8 heads x 128 x 4 bytes
    assert f"{2 * 36 * 8 * 128 * 4:,} bytes per token" in out


def test_inspect_reports_a_refusal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({**LLAMA_31_8B, "final_logit_softcapping": 30.0})
    )
    assert main(["inspect", str(tmp_path)]) == 2
    assert "final_logit_softcapping=30.0" in capsys.readouterr().err
