"""Model configuration: the subset of a Hugging Face ``config.json`` we use."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from structllm.errors import ModelLoadError, UnsupportedModelError

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig", "RopeScaling", "tiny_config"]

#: HF ``architectures`` names we implement, and their ``model_type``.
SUPPORTED_ARCHITECTURES: Mapping[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}


@attrs.frozen(kw_only=True)
class RopeScaling:
    """``rope_scaling`` from config.json; ``rope_type`` linear or llama3."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_hf(cls, d: Mapping[str, Any] | None) -> RopeScaling | None:
        if not d:
            return None
        rope_type = d.get("rope_type", d.get("type"))
        if rope_type in (None, "default"):
            return None
        if rope_type not in ("linear", "llama3"):
            raise UnsupportedModelError(
                f"rope_scaling type {rope_type!r} is not supported "
                "(supported: linear, llama3)"
            )
        kw: dict[str, Any] = {"rope_type": rope_type, "factor": float(d["factor"])}
        for name in (
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ):
            if name in d:
                kw[name] = d[name]
        return cls(**kw)


@attrs.frozen(kw_only=True)
class ModelConfig:
    """Shapes and constants of a Llama-family decoder."""

    architecture: str = "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    #: q/k/v projections carry a bias (always for Qwen2, optional for Llama)
    qkv_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    #: dtype the checkpoint was saved in (``torch_dtype``)
    checkpoint_dtype: str = "float32"

    def __attrs_post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def model_type(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def num_parameters(self) -> int:
        h, i, layers = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        per_layer += 3 * h * i + 2 * h
        if self.qkv_bias:
            per_layer += self.q_size + 2 * self.kv_size
        head = 0 if self.tie_word_embeddings else h * self.vocab_size
        return self.vocab_size * h + layers * per_layer + h + head

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Build from a parsed ``config.json``, checking what we rely on."""
        archs = d.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"architectures {archs!r} not supported; structllm implements "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"hidden_act {act!r} not supported (silu only)")
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            head_dim = d.get("head_dim") or hidden // heads
            eos = d.get("eos_token_id")
            eos_ids = (
                () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
            )
            window = d.get("sliding_window")
            if arch == "Qwen2ForCausalLM":
                if d.get("use_sliding_window", False):
                    # Qwen2 windows only layers >= max_window_layers
                    raise UnsupportedModelError(
                        "Qwen2 use_sliding_window=true (per-layer windows) is not "
                        "supported"
                    )
                window = None
            return cls(
                architecture=arch,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(d.get("rope_theta", 10000.0)),
                rope_scaling=RopeScaling.from_hf(d.get("rope_scaling")),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                qkv_bias=arch == "Qwen2ForCausalLM" or bool(d.get("attention_bias")),
                sliding_window=int(window) if window else None,
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
                checkpoint_dtype=str(
                    d.get("torch_dtype") or d.get("dtype") or "float32"
                ),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(
                f"config.json is missing or has a bad field: {exc!r}"
            ) from exc

    @classmethod
    def from_directory(cls, path: Path) -> ModelConfig:
        file = path / "config.json"
        if not file.is_file():
            raise ModelLoadError(
                f"{file} not found: a model directory needs config.json"
            )
        try:
            data = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"{file} is not valid JSON: {exc}") from exc
        return cls.from_hf(data)

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` a checkpoint with this config carries."""
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": self.checkpoint_dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids)
            if len(self.eos_token_ids) != 1
            else self.eos_token_ids[0],
        }
        if self.model_type == "llama":
            d["attention_bias"] = self.qkv_bias
            d["mlp_bias"] = False
        if self.model_type == "mistral":
            d["sliding_window"] = self.sliding_window
        if self.model_type == "qwen2":
            d["use_sliding_window"] = False
            d["sliding_window"] = None
        if self.rope_scaling is not None:
            d["rope_scaling"] = attrs.asdict(self.rope_scaling)
        return d


def tiny_config(vocab_size: int = 258) -> ModelConfig:
    """The built-in ``tiny`` model: byte tokenizer, 2 layers, GQA, tied head."""
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=256,
        eos_token_ids=(257,),
    )
