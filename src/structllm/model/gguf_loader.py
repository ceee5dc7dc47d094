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

import ctypes
import mmap
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from structllm.errors import ModelLoadError
from structllm.formats.gguf import GGUFFile
from structllm.model.config import ModelConfig

if TYPE_CHECKING:
    from structllm.model.linear import Linear

__all__ = ["gguf_to_hf_name", "read_gguf_quantized", "read_gguf_tensors"]

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
    names = _tensor_names(file, config, shapes)
    for hf in shapes:
        yield hf, _dequantized(file, config, hf, names[hf])


def read_gguf_quantized(
    file: GGUFFile,
    config: ModelConfig,
    shapes: Mapping[str, tuple[int, ...]],
) -> tuple[dict[str, Any], dict[str, Linear]]:
    """The weights of ``file`` with its projections kept in their blocks:
    ``(tensors, linears)`` for :func:`~structllm.model.loader.build_model`.

    Each projection whose pieces are all of a type the quantized kernels
    multiply (``quant_kernels.MATMUL_TYPES`` but F32) becomes a
    :class:`QuantizedLinear` over the file's own rows (q/k rows of a Llama
    file put back in Hugging Face order, row by row); a tied head reads the
    embedding's rows. Everything else (norms, biases, the embedding the
    lookup reads, projections of other types) is float32 in ``tensors``,
    but for the embedding of a file whose projections are kept: a
    :class:`~structllm.model.quantized.QuantizedEmbedding` over its rows (the
    tied head's), when their type is one the kernels read.
    """
    from structllm.model import quant_kernels
    from structllm.model.loader import projection_loaders
    from structllm.model.quantized import (
        QuantizedEmbedding,
        QuantizedLinear,
        QuantizedPart,
    )

    names = _tensor_names(file, config, shapes)
    loaders: dict[str, Any] = dict(projection_loaders(config))
    if config.tie_word_embeddings:
        loaders["lm_head"] = None  # the embedding's rows
    kept = {int(t) for t in quant_kernels.MATMUL_TYPES} - {0}  # not F32
    linears: dict[str, Linear] = {}
    consumed: set[str] = set()
    for module, loader in loaders.items():
        pieces = ("model.embed_tokens",) if loader is None else tuple(loader.pieces)
        infos = [file.tensors[names[p + ".weight"]] for p in pieces]
        if not all(int(info.type) in kept for info in infos):
            continue
        in_features = infos[0].shape[1]
        parts, mapped = [], []
        for piece, info in zip(pieces, infos, strict=True):
            raw = file.raw(info.name).reshape(info.shape[0], -1)
            mapped.append(raw)
            parts.append(
                QuantizedPart(_in_hf_order(config, piece, raw), int(info.type))
            )
        bias = None
        if loader is not None and loader.has_bias:
            biases = [p + ".bias" for p in pieces]
            bias = _paddle_tensor(
                np.concatenate(
                    [_dequantized(file, config, b, names[b]) for b in biases]
                )
            )
            consumed.update(biases)
        linears[module] = linear = QuantizedLinear.fuse(parts, in_features, bias)
        _unmap_copied(mapped, (p.raw for p in linear.parts))
        if loader is not None:
            consumed.update(p + ".weight" for p in pieces)
    embed = "model.embed_tokens.weight"
    info = file.tensors[names[embed]]
    tensors: dict[str, Any] = {}
    if linears and int(info.type) in kept:  # eager only, as the Linears
        raw = file.raw(info.name).reshape(info.shape[0], -1)
        part = QuantizedPart(raw, int(info.type))
        tensors[embed] = QuantizedEmbedding(part, info.shape[1])
        consumed.add(embed)
    tensors.update(
        (hf, _dequantized(file, config, hf, names[hf]))
        for hf in shapes
        if hf not in consumed
    )
    return tensors, linears


#: ``madvise``'s advice to drop a range's pages from the process (Linux)
_MADV_DONTNEED = 4


def _unmap_copied(mapped: list[np.ndarray], kept: Iterable[np.ndarray]) -> None:
    """Drop from the process the file pages of pieces a fused weight copied
    (q/k/v, gate/up): the copy is what the kernels read, and the map's pages
    would stay resident beside it (43 MB of SmolLM2 Q4_1's 98). The map is
    read-only and shared, so a page dropped here that a neighbouring tensor
    still uses is read back from the page cache on its next access."""
    if sys.platform != "linux":
        return
    kept = list(kept)
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    for raw in mapped:
        if any(np.shares_memory(raw, k) for k in kept):
            continue  # a part reads the map itself
        start = -(-raw.ctypes.data // page) * page  # whole pages inside it
        stop = (raw.ctypes.data + raw.nbytes) // page * page
        if stop > start:
            madvise(start, stop - start, _MADV_DONTNEED)


def _paddle_tensor(array: np.ndarray) -> Any:
    from structllm.model._paddle import paddle

    return paddle.to_tensor(array)


def _in_hf_order(config: ModelConfig, piece: str, rows: np.ndarray) -> np.ndarray:
    """Rows of ``piece``'s weight (any row layout: floats or raw blocks) in
    Hugging Face's order: a Llama file's q and k rows are interleaved."""
    if config.model_type not in ("llama", "mistral"):
        return rows
    if piece.endswith("q_proj"):
        return _unpermute(rows, config.num_attention_heads)
    if piece.endswith("k_proj"):
        return _unpermute(rows, config.num_key_value_heads)
    return rows


def _dequantized(file: GGUFFile, config: ModelConfig, hf: str, name: str) -> np.ndarray:
    return _in_hf_order(config, hf.rsplit(".", 1)[0], file.dequantize(name))


def _tensor_names(
    file: GGUFFile,
    config: ModelConfig,
    shapes: Mapping[str, tuple[int, ...]],
) -> dict[str, str]:
    """HF name -> the file's tensor name, for every tensor of ``shapes``,
    each checked: present, with the shape the config implies, and none of
    the file's left over."""
    source = Path(file.path).name
    by_hf: dict[str, str] = {}
    for name in file.tensors:
        if name in _IN_CONFIG:
            continue
        hf = gguf_to_hf_name(name)
        if hf is None or hf not in shapes:
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
    for hf, name in by_hf.items():
        info = file.tensors[name]
        if tuple(info.shape) != shapes[hf]:
            raise ModelLoadError(
                f"{source}: tensor {name} at offset {info.offset} has shape "
                f"{tuple(info.shape)}, the metadata implies {shapes[hf]}"
            )
    return by_hf


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: within each head, rows ``(2, d/2)``
    were stored as ``(d/2, 2)`` (pairs interleaved for its RoPE). Rows may
    be floats or a quantized weight's raw block rows: whole rows move."""
    rows = w.shape[0]
    # (heads, d/2, 2, ...) -> (heads, 2, d/2, ...) -> (rows, ...)
    return np.ascontiguousarray(
        w.reshape(heads, rows // heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )
