"""The weights of a GGUF file under their Hugging Face names.

llama.cpp names tensors its own way (``blk.0.attn_q.weight``) and, for the
Llama architecture, stores q and k with the rows of each head interleaved
for its RoPE (``convert_hf_to_gguf.py``'s ``LlamaModel.permute``), where
transformers rotates halves. :func:`read_gguf_tensors` maps the names,
undoes that permutation and dequantizes to float32, so the loader builds a
GGUF model exactly as it builds a safetensors checkpoint (Qwen2 and Qwen3
are stored unpermuted: llama.cpp runs them with the halves-rotating RoPE).

Numpy only; the file is read through ``structllm.formats.gguf``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from structllm.errors import ModelLoadError
from structllm.formats.gguf import GGUFFile
from structllm.model.config import ModelConfig

__all__ = ["gguf_to_hf_name", "read_gguf_tensors"]

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
}

#: tensors the config already accounts for (read by ModelConfig.from_gguf)
_IN_CONFIG = frozenset({"rope_freqs.weight"})


def gguf_to_hf_name(name: str) -> str | None:
    """The HF name of GGUF tensor ``name``; None if it is not a weight we know."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        inner = _LAYER.get(parts[2])
        if inner is not None:
            return f"model.layers.{int(parts[1])}.{inner}"
    return None


def read_gguf_tensors(
    file: GGUFFile,
    config: ModelConfig,
    shapes: Mapping[str, tuple[int, ...]],
) -> Iterator[tuple[str, np.ndarray]]:
    """``shapes``' tensors from ``file`` as float32, HF names and layout.

    Every tensor of the file must be one the config uses (as the safetensors
    loader insists: an unused tensor means config and weights disagree), and
    every tensor the config needs must be there with its shape.
    """
    source = Path(file.path).name
    by_hf: dict[str, str] = {}
    for name in file.tensors:
        if name in _IN_CONFIG:
            continue
        hf = gguf_to_hf_name(name)
        if hf is None or hf not in shapes:
            if hf == "lm_head.weight" and config.tie_word_embeddings:
                continue  # pragma: no cover - the config unties when it exists
            raise ModelLoadError(
                f"{source}: tensor {name} is not a weight structllm's "
                f"{config.model_type} with this metadata uses"
            )
        by_hf[hf] = name
    missing = [n for n in shapes if n not in by_hf]
    if missing:
        raise ModelLoadError(
            f"{source} lacks {len(missing)} tensors the metadata implies, e.g. "
            + ", ".join(missing[:3])
        )
    permuted = config.model_type in ("llama", "mistral")
    for hf, name in ((hf, by_hf[hf]) for hf in shapes):
        info = file.tensors[name]
        if tuple(info.shape) != shapes[hf]:
            raise ModelLoadError(
                f"{source}: tensor {name} at offset {info.offset} has shape "
                f"{tuple(info.shape)}, the metadata implies {shapes[hf]}"
            )
        array = file.dequantize(name)
        if permuted and hf.endswith(("q_proj.weight", "q_proj.bias")):
            array = _unpermute(array, config.num_attention_heads)
        elif permuted and hf.endswith(("k_proj.weight", "k_proj.bias")):
            array = _unpermute(array, config.num_key_value_heads)
        yield hf, array


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: within each head, rows ``(2, d/2)``
    were stored as ``(d/2, 2)`` (pairs interleaved for its RoPE)."""
    rows = w.shape[0]
    # (heads, d/2, 2, ...) -> (heads, 2, d/2, ...) -> (rows, ...)
    return np.ascontiguousarray(
        w.reshape(heads, rows // heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )
