"""Write a Hugging Face checkpoint directory as a GGUF file, as llama.cpp's
``convert_hf_to_gguf.py`` would (the test oracle's side of GGUF loading).

Written here from the format's documentation with the ``gguf`` package's
writer, independently of ``structllm.model.gguf_loader``: tensor names,
llama's q/k row permutation, metadata keys, the byte-level BPE tokenizer.
Returns the float32 weights the file really holds (quantized and
dequantized again by ``gguf``), in HF names and layout, for comparisons.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import load_file

LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf: str) -> str:
    if hf in GLOBAL:
        return GLOBAL[hf]
    _, _, n, rest = hf.split(".", 3)
    return f"blk.{n}.{LAYER[rest]}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's halves interleaved."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def convert(
    directory: Path,
    out: Path,
    *,
    qtype: str = "F32",
    metadata: Mapping[str, Any] | None = None,
    drop: tuple[str, ...] = (),
    arch: str | None = None,
    types: Mapping[str, str] | None = None,
) -> dict[str, np.ndarray]:
    """``directory`` as ``out`` (``arch``: say another general.architecture;
    ``types``: the type of particular HF tensors, overriding ``qtype``)."""
    config = json.loads((directory / "config.json").read_text())
    arch = arch or {"mistral": "llama"}.get(config["model_type"], config["model_type"])
    tensors: dict[str, np.ndarray] = {}
    for f in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(f))
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    if head_dim != config["hidden_size"] // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    rope = config.get("rope_parameters") or {}
    w.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    w.add_rope_dimension_count(head_dim)
    if config.get("sliding_window") and config["model_type"] == "mistral":
        w.add_sliding_window(config["sliding_window"])
    _tokenizer(w, directory)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_array(key, value)
    held: dict[str, np.ndarray] = {}
    permuted = arch == "llama"
    for hf, array in tensors.items():
        if hf in drop or (hf == "lm_head.weight" and config["tie_word_embeddings"]):
            continue
        array = array.astype(np.float32)
        stored = array
        if permuted and ".q_proj." in hf:
            stored = permute(array, heads)
        elif permuted and ".k_proj." in hf:
            stored = permute(array, kv_heads)
        tensor_type = (types or {}).get(hf, qtype)
        if array.ndim == 2 and tensor_type != "F32":
            kind = gguf.GGMLQuantizationType[tensor_type]
            data = gguf.quants.quantize(stored, kind)
            w.add_tensor(gguf_name(hf), data, raw_dtype=kind)
            # quantization is per row: what the file holds, in HF row order
            held[hf] = gguf.quants.dequantize(gguf.quants.quantize(array, kind), kind)
        else:
            w.add_tensor(gguf_name(hf), stored)
            held[hf] = array
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def _tokenizer(w: gguf.GGUFWriter, directory: Path) -> None:
    """The byte-level BPE of ``tokenizer.json`` as llama.cpp's gpt2 model."""
    tok = json.loads((directory / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(
        [
            gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL
            for t in tokens
        ]
    )
    w.add_token_merges(merges)
    cfg = json.loads((directory / "tokenizer_config.json").read_text())
    if cfg.get("eos_token"):
        w.add_eos_token_id(vocab[cfg["eos_token"]])
    w.add_add_bos_token(False)
    template = directory / "chat_template.jinja"
    if cfg.get("chat_template"):
        w.add_chat_template(cfg["chat_template"])
    elif template.is_file():
        w.add_chat_template(template.read_text())
