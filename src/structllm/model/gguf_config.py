"""GGUF metadata as a ``config.json``: what llama.cpp reads, in transformers' terms.

A GGUF file says its architecture in ``general.architecture`` and keeps the
hyperparameters under that prefix (``llama.block_count``, ...), as
llama.cpp's ``llama-arch.cpp`` names them. :func:`hf_config_from_gguf`
writes the ``config.json`` a Hugging Face checkpoint of the same model would
carry, so :meth:`ModelConfig.from_hf` applies the same defaults and the same
refusals to both. The rule for what it cannot map is the one config.json
has: a key that changes the output and that structllm does not implement is
refused by name; keys that do not change it (``general.*`` descriptions, the
tokenizer's, which the text layer reads) are ignored.

Pure: a mapping in, a dict out; the file is read by ``structllm.formats``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from structllm.errors import ModelLoadError, UnsupportedModelError
from structllm.formats.gguf_values import GGUFMetadata

__all__ = ["GGUF_ARCHITECTURES", "hf_config_from_gguf"]

#: ``general.architecture`` values structllm runs, and the HF class of each.
#: Mistral GGUFs say ``llama`` (llama.cpp runs them as Llama).
GGUF_ARCHITECTURES: Mapping[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

#: keys under ``{arch}.`` read here (or that cannot change the output)
_KNOWN = {
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.layer_norm_rms_epsilon",
    "attention.sliding_window",
    "rope.freq_base",
    "rope.dimension_count",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scale_linear",
    "rope.scaling.original_context_length",
    "rope.scaling.finetuned",
    "rope.scaling.attn_factor",
    "rope.scaling.yarn_beta_fast",
    "rope.scaling.yarn_beta_slow",
    "vocab_size",
    # neutral at their neutral values (checked below)
    "expert_count",
    "expert_used_count",
    "attention.causal",
    "pooling_type",
}

#: keys that are harmless at these values only
_NEUTRAL: Mapping[str, tuple[Any, ...]] = {
    "expert_count": (0,),
    "expert_used_count": (0,),
    "attention.causal": (True,),
    # llama.cpp's unspecified, none, mean, last: only embeddings read it
    # (core/pooling.py); CLS (2) and rank (4) are refused
    "pooling_type": (-1, 0, 1, 3),
    "rope.scaling.finetuned": (True, False),
}


def hf_config_from_gguf(
    metadata: Mapping[str, Any],
    tensor_shapes: Mapping[str, Sequence[int]],
    *,
    source: str,
    rope_freqs: np.ndarray | None = None,
) -> dict[str, Any]:
    """The ``config.json`` dict of the model in a GGUF file.

    ``tensor_shapes`` are the file's tensors (numpy order), for what only the
    tensors tell: a separate output head, biases, q/k norms. ``rope_freqs``
    is the file's ``rope_freqs.weight`` if it has one (Llama 3.1's
    frequency factors, which llama.cpp keeps as a tensor). ``source`` (the
    file name) prefixes every error.
    """
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{source}: general.architecture={arch!r} is not supported; "
            f"structllm runs {', '.join(GGUF_ARCHITECTURES)}"
        )
    prefix = f"{arch}."
    for key in metadata:  # not items(): the tokenizer's arrays stay unread
        if not key.startswith(prefix):
            continue
        name = key[len(prefix) :]
        value = metadata[key]
        if name not in _KNOWN:
            raise UnsupportedModelError(
                f"{source}: {key}={_short(value)} is not read by structllm and "
                "may change the output; refusing rather than guessing"
            )
        if name in _NEUTRAL and _scalar(value, key, source) not in _NEUTRAL[name]:
            raise UnsupportedModelError(
                f"{source}: {key}={_short(value)} changes the output and "
                f"structllm's {arch} does not implement it"
            )

    def get(name: str, default: Any = None) -> Any:
        value = metadata.get(prefix + name, default)
        return _scalar(value, prefix + name, source) if value is not None else None

    def need(name: str) -> Any:
        if prefix + name not in metadata:
            raise ModelLoadError(f"{source}: metadata lacks {prefix + name}")
        return get(name)

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = int(get("attention.key_length", hidden // heads))
    value_dim = int(get("attention.value_length", head_dim))
    if value_dim != head_dim:
        raise UnsupportedModelError(
            f"{source}: {prefix}attention.value_length={value_dim} differs from "
            f"key_length={head_dim}; structllm needs one head_dim"
        )
    rope_dims = get("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise UnsupportedModelError(
            f"{source}: {prefix}rope.dimension_count={rope_dims} rotates part of "
            f"a head of {head_dim}; structllm rotates whole heads only"
        )
    vocab = get("vocab_size")
    if vocab is None:
        tokens = _array_length(metadata, "tokenizer.ggml.tokens")
        if tokens is not None:
            vocab = tokens
        elif "token_embd.weight" in tensor_shapes:
            vocab = tensor_shapes["token_embd.weight"][0]
        else:
            raise ModelLoadError(f"{source}: no vocab size in metadata or tensors")
    context = int(need("context_length"))
    d: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": context,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    for key, field in (
        ("tokenizer.ggml.bos_token_id", "bos_token_id"),
        ("tokenizer.ggml.eos_token_id", "eos_token_id"),
    ):
        if key in metadata:
            d[field] = int(_scalar(metadata[key], key, source))
    scaling = _rope_scaling(get, prefix, source, context)
    if rope_freqs is not None:
        if scaling is not None:
            raise UnsupportedModelError(
                f"{source}: rope_freqs.weight and {prefix}rope.scaling.type "
                "together: llama.cpp applies both; structllm will not"
            )
        scaling = _llama3_from_factors(
            np.asarray(rope_freqs, np.float64), d["rope_theta"], head_dim, source
        )
    if scaling is not None:
        d["rope_scaling"] = scaling
    window = get("attention.sliding_window")
    if arch == "llama":
        d["attention_bias"] = "blk.0.attn_q.bias" in tensor_shapes
        d["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_shapes
        if window:
            # a window on every layer is Mistral's; Llama has none
            d["architectures"] = ["MistralForCausalLM"]
            d["model_type"] = "mistral"
            d["sliding_window"] = int(window)
    elif window:
        raise UnsupportedModelError(
            f"{source}: {prefix}attention.sliding_window={window}: llama.cpp's "
            f"{arch} has no window either; structllm will not guess its layers"
        )
    if arch == "qwen3":
        d["attention_bias"] = "blk.0.attn_q.bias" in tensor_shapes
    return d


def _rope_scaling(
    get: Any, prefix: str, source: str, context: int
) -> dict[str, Any] | None:
    kind = get("rope.scaling.type")
    factor = get("rope.scaling.factor")
    if kind is None and get("rope.scale_linear") not in (None, 1, 1.0):
        kind, factor = "linear", get("rope.scale_linear")
    if kind in (None, "none") or (factor in (None, 0, 1, 1.0) and kind != "yarn"):
        return None
    orig = get("rope.scaling.original_context_length")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        d: dict[str, Any] = {
            "rope_type": "yarn",
            "factor": float(factor),
            "original_max_position_embeddings": int(orig or context),
        }
        for key, field in (
            ("rope.scaling.yarn_beta_fast", "beta_fast"),
            ("rope.scaling.yarn_beta_slow", "beta_slow"),
            ("rope.scaling.attn_factor", "attention_factor"),
        ):
            if get(key) is not None:
                d[field] = float(get(key))
        return d
    raise UnsupportedModelError(
        f"{source}: {prefix}rope.scaling.type={kind!r} is not supported "
        "(none, linear, yarn)"
    )


def _llama3_from_factors(
    factors: np.ndarray, theta: float, head_dim: int, source: str
) -> dict[str, Any]:
    """The llama3 ``rope_scaling`` whose per-frequency divisors are ``factors``.

    llama.cpp divides each RoPE frequency by the tensor's factor; that is
    Llama 3's scaling when the factors are the ones its parameters give.
    Those of Llama 3.1 and 3.2 (low 1, high 4, original context 8192, as
    convert_hf_to_gguf.py computes them) are recognised; any other tensor
    is refused.
    """
    if factors.shape != (head_dim // 2,):
        raise ModelLoadError(
            f"{source}: rope_freqs.weight has shape {factors.shape}, expected "
            f"({head_dim // 2},)"
        )
    factor = float(factors.max())
    orig, low_factor, high_factor = 8192, 1.0, 4.0
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    low, high = orig / low_factor, orig / high_factor
    wavelen = 2 * np.pi / inv
    smooth = (orig / wavelen - low_factor) / (high_factor - low_factor)
    expected = np.where(
        wavelen < high,
        1.0,
        np.where(wavelen > low, factor, 1 / ((1 - smooth) / factor + smooth)),
    )
    if not np.allclose(factors, expected, rtol=1e-4, atol=0):
        raise UnsupportedModelError(
            f"{source}: rope_freqs.weight holds frequency factors that are not "
            "Llama 3's (factor, low 1, high 4, original context 8192); structllm "
            "will not guess the RoPE"
        )
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low_factor,
        "high_freq_factor": high_factor,
        "original_max_position_embeddings": orig,
    }


def _scalar(value: Any, key: str, source: str) -> Any:
    """A metadata value that must be one number, bool or string: per-layer
    arrays (``feed_forward_length`` per block) are refused unless uniform."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, list):
        if value and all(v == value[0] for v in value):
            return value[0]
        raise UnsupportedModelError(
            f"{source}: {key}={_short(value)} varies per layer; structllm needs "
            "one value for every layer"
        )
    if isinstance(value, np.generic):
        return value.item()
    return value


def _short(value: Any) -> str:
    text = repr(value.tolist() if isinstance(value, np.ndarray) else value)
    return text if len(text) <= 80 else text[:77] + "..."


def _array_length(metadata: Mapping[str, Any], key: str) -> int | None:
    """The length of the array ``key``, without building it from a GGUF
    file's map (49k strings for ``tokenizer.ggml.tokens``)."""
    if isinstance(metadata, GGUFMetadata):
        return metadata.array_length(key)
    value = metadata.get(key)
    return None if value is None else len(value)
