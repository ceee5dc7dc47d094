"""Model configuration: what a Hugging Face ``config.json`` means, read exactly.

The reader never guesses. For each supported family it applies the defaults
of that family's transformers config class to the fields a checkpoint leaves
out, reads both the older (4.x: ``rope_theta``, ``rope_scaling``,
``torch_dtype``) and the current (5.x: ``rope_parameters``, ``dtype``) forms,
and refuses with :class:`~structllm.errors.UnsupportedModelError`, naming the
field and its value, anything that would change the output and that structllm
does not implement. Fields that do not change the output (``use_cache``,
``initializer_range``, ``attention_dropout``, ...) are ignored.

The supported matrix is in docs/models.md.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from structllm.errors import ModelLoadError, UnsupportedModelError

__all__ = [
    "ROPE_TYPES",
    "SUPPORTED_ARCHITECTURES",
    "ModelConfig",
    "RopeScaling",
    "tiny_random_config",
]

#: HF ``architectures`` names we implement, and their ``model_type``.
SUPPORTED_ARCHITECTURES: Mapping[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
}

#: ``rope_type`` values we implement besides ``default``.
ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3")

#: Defaults of each family's transformers config class, for absent fields.
#: ``None`` for head_dim means hidden_size // num_attention_heads; for
#: num_key_value_heads it means num_attention_heads.
_FAMILY_DEFAULTS: Mapping[str, Mapping[str, Any]] = {
    "llama": {
        "num_key_value_heads": None,
        "head_dim": None,
        "max_position_embeddings": 2048,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "qwen2": {
        "num_key_value_heads": 32,
        "head_dim": None,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "qwen3": {
        "num_key_value_heads": 32,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "mistral": {
        "num_key_value_heads": 8,
        "head_dim": None,
        "max_position_embeddings": 131072,
        "sliding_window": 4096,
    },
}

#: Fields of other families that change the math, with the values that do
#: not: a config carrying one with any other value is refused.
_FOREIGN_FIELDS: Mapping[str, tuple[Any, ...]] = {
    "partial_rotary_factor": (None, 1, 1.0),
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "logits_scaling": (None, 1, 1.0),
    "logit_scale": (None, 1, 1.0),
    "embedding_multiplier": (None, 1, 1.0),
    "residual_multiplier": (None, 1, 1.0),
    "attention_multiplier": (None,),
    "query_pre_attn_scalar": (None,),
    "scale_emb": (None, 1, 1.0),
    "scale_depth": (None,),
    "use_qk_norm": (None, False),
    "qk_layernorm": (None, False),
    "clip_qkv": (None,),
    "use_parallel_residual": (None, False),
    "quantization_config": (None,),
    "no_rope_layers": (None,),
    "num_experts": (None, 0),
    "num_local_experts": (None, 0),
    "alibi": (None, False),
}

_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "float64": "float32",
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
}


def _refuse(field: str, value: Any, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"config.json: {field}={value!r} {why}")


@attrs.frozen(kw_only=True)
class RopeScaling:
    """A non-default RoPE (``rope_scaling`` / ``rope_parameters``).

    ``linear``: positions divided by ``factor``. ``llama3``: Llama 3.1's
    wavelength-dependent blend. ``dynamic``: NTK scaling, which transformers
    applies only past ``max_position_embeddings`` (structllm's context limit
    for it, so inside it the frequencies are the default ones). ``yarn``:
    NTK-by-parts interpolation with an attention factor applied to cos/sin.
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    #: llama3 and yarn; None until read (then max_position_embeddings)
    original_max_position_embeddings: int | None = None
    #: yarn only
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf(
        cls,
        d: Mapping[str, Any] | None,
        *,
        max_position_embeddings: int | None = None,
        original_max_position_embeddings: Any = None,
    ) -> RopeScaling | None:
        """Read a ``rope_scaling`` or ``rope_parameters`` dict (``rope_theta`` in it is ignored)."""
        if not d:
            return None
        if not isinstance(d, Mapping):
            raise _refuse("rope_scaling", d, "is not an object")
        rope_type = d.get("rope_type", d.get("type", "default"))
        if rope_type == "default":
            return None
        if rope_type not in ROPE_TYPES:
            raise _refuse(
                "rope_scaling.rope_type",
                rope_type,
                f"is not supported (supported: default, {', '.join(ROPE_TYPES)})",
            )
        if d.get("partial_rotary_factor") not in (None, 1, 1.0):
            raise _refuse(
                "rope_parameters.partial_rotary_factor",
                d["partial_rotary_factor"],
                "is not supported (RoPE over the whole head only)",
            )
        orig = original_max_position_embeddings
        if orig is None:
            orig = d.get("original_max_position_embeddings")
        if orig is None and rope_type in ("llama3", "yarn"):
            orig = max_position_embeddings
        factor = d.get("factor")
        if factor is None and rope_type == "yarn" and orig and max_position_embeddings:
            factor = max_position_embeddings / orig
        if factor is None:
            raise _refuse(f"rope_scaling ({rope_type})", dict(d), "has no factor")
        kw: dict[str, Any] = {"rope_type": rope_type, "factor": float(factor)}
        if orig is not None:
            kw["original_max_position_embeddings"] = int(orig)
        if rope_type == "llama3":
            for name in ("low_freq_factor", "high_freq_factor"):
                if name not in d:
                    raise _refuse(
                        f"rope_scaling ({rope_type})", dict(d), f"has no {name}"
                    )
                kw[name] = float(d[name])
        if rope_type == "yarn":
            # transformers: `or` defaults, so 0/None mean 32 and 1
            kw["beta_fast"] = float(d.get("beta_fast") or 32)
            kw["beta_slow"] = float(d.get("beta_slow") or 1)
            kw["truncate"] = bool(d.get("truncate", True))
            for name in ("attention_factor", "mscale", "mscale_all_dim"):
                if d.get(name) is not None:
                    kw[name] = float(d[name])
        return cls(**kw)

    def to_hf(self) -> dict[str, Any]:
        d: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor}
        if self.original_max_position_embeddings is not None:
            d["original_max_position_embeddings"] = (
                self.original_max_position_embeddings
            )
        if self.rope_type == "llama3":
            d["low_freq_factor"] = self.low_freq_factor
            d["high_freq_factor"] = self.high_freq_factor
        if self.rope_type == "yarn":
            d.update(beta_fast=self.beta_fast, beta_slow=self.beta_slow)
            if not self.truncate:
                d["truncate"] = False
            for name in ("attention_factor", "mscale", "mscale_all_dim"):
                if getattr(self, name) is not None:
                    d[name] = getattr(self, name)
        return d

    def yarn_attention_factor(self) -> float:
        """The factor transformers multiplies yarn's cos and sin by."""
        if self.attention_factor is not None:
            return self.attention_factor

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return mscale(self.factor, self.mscale) / mscale(
                self.factor, self.mscale_all_dim
            )
        return mscale(self.factor)


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
    #: q/k/v projections carry a bias (always for Qwen2, attention_bias else)
    qkv_bias: bool = False
    #: o_proj carries a bias (Llama and Qwen3 attention_bias)
    o_bias: bool = False
    #: gate/up/down projections carry a bias (Llama mlp_bias)
    mlp_bias: bool = False
    #: per-head RMSNorm of q and k before RoPE (Qwen3)
    qk_norm: bool = False
    #: a query at position p sees keys j with p - j < sliding_window
    sliding_window: int | None = None
    #: the layers the window applies to; None = every layer (Mistral)
    sliding_layers: tuple[int, ...] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    #: dtype the checkpoint was saved in (``torch_dtype`` / ``dtype``)
    checkpoint_dtype: str = "float32"

    def __attrs_post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) < 1:
                raise ModelLoadError(
                    f"config.json: {name} must be >= 1, got {getattr(self, name)}"
                )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_theta <= 0:
            raise ModelLoadError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ModelLoadError(
                f"sliding_window must be >= 1, got {self.sliding_window}"
            )

    @property
    def model_type(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer``, or None for full attention."""
        if self.sliding_window is None:
            return None
        if self.sliding_layers is None or layer in self.sliding_layers:
            return self.sliding_window
        return None

    @property
    def max_context_len(self) -> int:
        """The longest sequence this config defines positions for.

        ``max_position_embeddings``, except for yarn, whose frequencies are
        fixed and which extends ``original_max_position_embeddings`` by
        ``factor`` (as vLLM derives it).
        """
        sc = self.rope_scaling
        if sc is not None and sc.rope_type == "yarn":
            orig = sc.original_max_position_embeddings or self.max_position_embeddings
            return max(self.max_position_embeddings, int(orig * sc.factor))
        return self.max_position_embeddings

    @property
    def num_parameters(self) -> int:
        h, i, layers = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        per_layer += 3 * h * i + 2 * h
        if self.qkv_bias:
            per_layer += self.q_size + 2 * self.kv_size
        if self.o_bias:
            per_layer += h
        if self.mlp_bias:
            per_layer += 2 * i + h
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        head = 0 if self.tie_word_embeddings else h * self.vocab_size
        return self.vocab_size * h + layers * per_layer + h + head

    def kv_cache_bytes_per_token(self, dtype: str = "float32") -> int:
        elem = 4 if dtype == "float32" else 2
        return 2 * self.num_hidden_layers * self.kv_size * elem

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Build from a parsed ``config.json``, refusing what we do not implement."""
        if not isinstance(d, Mapping):
            raise ModelLoadError("config.json must hold a JSON object")
        arch = _architecture(d)
        family = SUPPORTED_ARCHITECTURES[arch]
        defaults = _FAMILY_DEFAULTS[family]

        def get(name: str) -> Any:
            return d[name] if name in d else defaults.get(name)

        for name, neutral in _FOREIGN_FIELDS.items():
            if name in d and d[name] not in neutral:
                raise _refuse(
                    name,
                    d[name],
                    f"changes the output and structllm's {arch} does not implement it",
                )
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise _refuse("hidden_act", act, "is not supported (silu only)")
        try:
            heads = _int(d, "num_attention_heads")
            hidden = _int(d, "hidden_size")
            layers = _int(d, "num_hidden_layers")
            kv_heads = get("num_key_value_heads")
            kv_heads = heads if kv_heads is None else int(kv_heads)
            head_dim = get("head_dim")
            head_dim = hidden // heads if head_dim is None else int(head_dim)
            max_pos = int(get("max_position_embeddings"))
            eos = d.get("eos_token_id")
            eos_ids = (
                () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
            )
            window, sliding_layers = _sliding(d, family, get, layers)
            theta, scaling = _rope(d, max_pos)
            bias = bool(get("attention_bias"))
            dtype = d.get("dtype") or d.get("torch_dtype") or "float32"
            if dtype not in _DTYPES:
                raise _refuse(
                    "dtype",
                    dtype,
                    f"is not a dtype structllm reads ({', '.join(_DTYPES)})",
                )
            return cls(
                architecture=arch,
                vocab_size=_int(d, "vocab_size"),
                hidden_size=hidden,
                intermediate_size=_int(d, "intermediate_size"),
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                head_dim=head_dim,
                max_position_embeddings=max_pos,
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                qkv_bias=family == "qwen2" or (family in ("llama", "qwen3") and bias),
                o_bias=family in ("llama", "qwen3") and bias,
                mlp_bias=family == "llama" and bool(get("mlp_bias")),
                qk_norm=family == "qwen3",
                sliding_window=window,
                sliding_layers=sliding_layers,
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
                checkpoint_dtype=_DTYPES[dtype],
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

    @classmethod
    def from_gguf(cls, path: Path) -> ModelConfig:
        """The config of a GGUF file's model, from its metadata (mapped to
        config.json fields by :mod:`structllm.model.gguf_config`)."""
        from structllm.formats.gguf import GGUFFile

        with GGUFFile.open(path) as f:
            return cls.from_gguf_file(f)

    @classmethod
    def from_gguf_file(cls, f: Any) -> ModelConfig:
        """:meth:`from_gguf` on an open ``structllm.formats.gguf.GGUFFile``."""
        from structllm.model.gguf_config import hf_config_from_gguf

        source = Path(f.path).name
        freqs = (
            f.dequantize("rope_freqs.weight")
            if "rope_freqs.weight" in f.tensors
            else None
        )
        d = hf_config_from_gguf(
            f.metadata,
            {name: t.shape for name, t in f.tensors.items()},
            source=source,
            rope_freqs=freqs,
        )
        try:
            return cls.from_hf(d)
        except UnsupportedModelError as exc:
            raise UnsupportedModelError(f"{source} (GGUF metadata): {exc}") from exc
        except ModelLoadError as exc:
            raise ModelLoadError(f"{source} (GGUF metadata): {exc}") from exc

    @classmethod
    def from_path(cls, path: Path | None) -> ModelConfig:
        """The config of resolved model files (``structllm.models.resolve_model``):
        a checkpoint directory, a GGUF file, or None for ``"tiny-random"``."""
        if path is None:
            return tiny_random_config()
        if path.is_dir():
            return cls.from_directory(path)
        if path.is_file():
            return cls.from_gguf(path)
        raise ModelLoadError(f"model {str(path)!r} does not exist")

    def to_hf(self, *, legacy: bool = False) -> dict[str, Any]:
        """The ``config.json`` a checkpoint with this config carries.

        The current transformers form (``rope_parameters``, ``dtype``), or
        with ``legacy`` the 4.x form (``rope_theta``, ``rope_scaling``,
        ``torch_dtype``).
        """
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
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids)
            if len(self.eos_token_ids) != 1
            else self.eos_token_ids[0],
        }
        if self.model_type in ("llama", "qwen3"):
            d["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            d["mlp_bias"] = self.mlp_bias
        if self.model_type == "mistral":
            d["sliding_window"] = self.sliding_window
        if self.model_type in ("qwen2", "qwen3"):
            d["use_sliding_window"] = self.sliding_window is not None
            d["sliding_window"] = self.sliding_window
            d["layer_types"] = [
                "full_attention"
                if self.layer_window(i) is None
                else "sliding_attention"
                for i in range(self.num_hidden_layers)
            ]
        rope = self.rope_scaling.to_hf() if self.rope_scaling else None
        if legacy:
            d["rope_theta"] = self.rope_theta
            d["rope_scaling"] = rope
            d["torch_dtype"] = self.checkpoint_dtype
        else:
            d["rope_parameters"] = {
                "rope_theta": self.rope_theta,
                **(rope or {"rope_type": "default"}),
            }
            d["dtype"] = self.checkpoint_dtype
        return d

    def describe(self, dtype: str = "float32") -> dict[str, str]:
        """What structllm understood, as label -> value lines (``structllm inspect``)."""
        sc = self.rope_scaling
        rope = f"theta {self.rope_theta:g}"
        if sc is not None:
            rope += f", {sc.rope_type} factor {sc.factor:g}"
            if sc.original_max_position_embeddings is not None:
                rope += f", original context {sc.original_max_position_embeddings}"
            if sc.rope_type == "llama3":
                rope += (
                    f", low/high freq factor {sc.low_freq_factor:g}/"
                    f"{sc.high_freq_factor:g}"
                )
            if sc.rope_type == "yarn":
                rope += (
                    f", beta fast/slow {sc.beta_fast:g}/{sc.beta_slow:g}, "
                    f"attention factor {sc.yarn_attention_factor():.4f}"
                )
        else:
            rope += ", default"
        kind = (
            "MHA"
            if self.num_key_value_heads == self.num_attention_heads
            else "MQA"
            if self.num_key_value_heads == 1
            else "GQA"
        )
        biases = [
            n
            for n, on in (
                ("qkv", self.qkv_bias),
                ("o", self.o_bias),
                ("mlp", self.mlp_bias),
            )
            if on
        ]
        if self.sliding_window is None:
            window = "none (full attention)"
        elif self.sliding_layers is None:
            window = f"{self.sliding_window} on every layer"
        else:
            window = (
                f"{self.sliding_window} on layers "
                f"{', '.join(map(str, self.sliding_layers)) or 'none'}"
            )
        kv = self.kv_cache_bytes_per_token(dtype)
        return {
            "family": f"{self.model_type} ({self.architecture})",
            "parameters": f"{self.num_parameters:,} ({self.num_parameters / 1e6:.2f}M)",
            "layers": str(self.num_hidden_layers),
            "hidden / intermediate": f"{self.hidden_size} / {self.intermediate_size}",
            "attention": (
                f"{kind}: {self.num_attention_heads} query heads, "
                f"{self.num_key_value_heads} KV heads, head_dim {self.head_dim}"
                + (", q/k RMSNorm" if self.qk_norm else "")
            ),
            "biases": ", ".join(biases) or "none",
            "vocab": str(self.vocab_size),
            "tied embeddings": "yes" if self.tie_word_embeddings else "no",
            "RoPE": rope,
            "sliding window": window,
            "norm": f"RMSNorm eps {self.rms_norm_eps:g}",
            "context": (
                f"{self.max_context_len} positions "
                f"(max_position_embeddings {self.max_position_embeddings})"
            ),
            "dtype": f"checkpoint {self.checkpoint_dtype}, compute {dtype}",
            "KV cache": f"{kv:,} bytes per token ({dtype})",
            "eos / bos": f"{list(self.eos_token_ids)} / {self.bos_token_id}",
        }


def _int(d: Mapping[str, Any], name: str) -> int:
    value = d[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelLoadError(f"config.json: {name} must be an integer, got {value!r}")
    return value


def _architecture(d: Mapping[str, Any]) -> str:
    archs = d.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    arch: str | None = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None and not archs:
        # no architectures: transformers' AutoModelForCausalLM goes by model_type
        by_type = {t: a for a, t in SUPPORTED_ARCHITECTURES.items()}
        arch = by_type.get(d.get("model_type", ""))
    if arch is None:
        raise UnsupportedModelError(
            f"config.json: architectures={archs!r} (model_type="
            f"{d.get('model_type')!r}) is not supported; structllm implements "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _rope(d: Mapping[str, Any], max_pos: int) -> tuple[float, RopeScaling | None]:
    """``rope_theta`` and scaling from either form, with transformers' precedence.

    transformers 5 takes ``rope_scaling`` (4.x) over ``rope_parameters``
    (5.x), then fills ``rope_theta`` from the dict, else the top-level field,
    else 10000; a top-level ``original_max_position_embeddings`` wins over
    the dict's.
    """
    params = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise _refuse("rope_parameters", params, "is not an object")
    nested = [k for k, v in params.items() if isinstance(v, Mapping)]
    if nested:
        raise _refuse(
            "rope_parameters",
            dict(params),
            "is nested per layer type; structllm supports one RoPE for all layers",
        )
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    if d.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise _refuse(
            "partial_rotary_factor",
            d["partial_rotary_factor"],
            "is not supported (RoPE over the whole head only)",
        )
    scaling = RopeScaling.from_hf(
        params,
        max_position_embeddings=max_pos,
        original_max_position_embeddings=d.get("original_max_position_embeddings"),
    )
    return float(theta), scaling


def _sliding(
    d: Mapping[str, Any], family: str, get: Any, layers: int
) -> tuple[int | None, tuple[int, ...] | None]:
    """The window and the layers it covers, as each family's transformers reads them."""
    if family == "llama":
        return None, None  # LlamaAttention has no window, whatever the config says
    if family == "mistral":
        if "layer_types" in d and len(set(d["layer_types"] or [])) > 1:
            raise _refuse(
                "layer_types",
                d["layer_types"],
                "mixes attention types; MistralForCausalLM ignores it and "
                "structllm will not guess (alternating windows are Ministral's)",
            )
        window = get("sliding_window")
        return (int(window) if window else None), None
    # Qwen2 / Qwen3: the window only when use_sliding_window, on the layers
    # layer_types marks, which default to those >= max_window_layers
    window = get("sliding_window") if get("use_sliding_window") else None
    types = d.get("layer_types")
    if types is None:
        start = int(get("max_window_layers"))
        types = [
            "sliding_attention"
            if window is not None and i >= start
            else "full_attention"
            for i in range(layers)
        ]
    if len(types) != layers or not set(types) <= {
        "full_attention",
        "sliding_attention",
    }:
        raise _refuse(
            "layer_types",
            types,
            f"must list full_attention or sliding_attention for each of {layers} layers",
        )
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if window is None:
        if sliding:
            # transformers then builds a sliding mask with no window: refuse
            raise _refuse(
                "layer_types",
                types,
                "marks sliding layers but use_sliding_window is false",
            )
        return None, None
    if not sliding:
        return None, None
    return int(window), sliding


def tiny_random_config() -> ModelConfig:
    """The config of the ``"tiny-random"`` built-in model (see structllm.models)."""
    from structllm.models import TINY_RANDOM_CONFIG

    return ModelConfig.from_hf(TINY_RANDOM_CONFIG)
