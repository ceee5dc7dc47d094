"""Train the decoder: the inference model's own layer code under autograd.

Serving never trains; this exists so the built-in ``tiny`` model can be
trained by structllm itself (``tools/train_tiny.py``, ``nox -s train-tiny``).
The forward here calls the very functions the engine runs every step
(:func:`~structllm.model.llama.attention_inputs`,
:func:`~structllm.model.llama.layer_output`, the RoPE tables, the final norm
and the head); only attention differs: dense and causal over whole
sequences, instead of paged over a KV cache. A test checks that both give
the same logits on the same weights.

:func:`hf_tensors` turns the fused, ``(in, out)`` weights back into Hugging
Face tensors, so a trained model is saved as any checkpoint is.
"""

from __future__ import annotations

import math

import numpy as np

from structllm.model._paddle import paddle
from structllm.model.config import ModelConfig
from structllm.model.llama import (
    LlamaForCausalLM,
    _rms_norm,
    attention_inputs,
    layer_output,
)

__all__ = [
    "causal_lm_logits",
    "causal_lm_loss",
    "hf_tensors",
    "initial_hf_tensors",
    "trainable_weights",
]


def initial_hf_tensors(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Weights to start training from: norms at 1, the rest N(0, 0.02).

    GPT-2's scheme, with the projections that write into the residual stream
    (``o_proj``, ``down_proj``) scaled down by ``sqrt(2 * layers)``.
    """
    from structllm.model.loader import hf_tensor_shapes

    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    residual = 0.02 / math.sqrt(2 * config.num_hidden_layers)
    for name, shape in hf_tensor_shapes(config).items():
        if name.endswith("norm.weight"):
            t = np.ones(shape)
        elif name.endswith(".bias"):
            t = np.zeros(shape)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            t = residual * rng.standard_normal(shape)
        else:
            t = 0.02 * rng.standard_normal(shape)
        out[name] = t.astype(np.float32)
    return out


def trainable_weights(model: LlamaForCausalLM) -> list[paddle.Tensor]:
    """Every weight tensor of ``model``, made to collect gradients."""
    w = model.weights
    tensors = [w.embed, w.norm, *([w.lm_head] if w.lm_head is not None else [])]
    for layer in w.layers:
        for name in _LAYER_FIELDS:
            t = getattr(layer, name)
            if t is not None:
                tensors.append(t)
    for t in tensors:
        t.stop_gradient = False
    return tensors


def causal_lm_logits(model: LlamaForCausalLM, tokens: paddle.Tensor) -> paddle.Tensor:
    """Logits ``(B, T, V)`` for ``tokens`` ``(B, T)``, each row from position 0."""
    c = model.config
    if any(c.layer_window(i) is not None for i in range(c.num_hidden_layers)):
        raise ValueError("training supports full attention only (no sliding window)")
    b, t = tokens.shape
    nh, kvh, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    positions = paddle.tile(paddle.arange(t, dtype="int64"), [b])  # (B T,)
    cos, sin = model.rope_tables(positions)
    x = paddle.nn.functional.embedding(tokens.reshape([-1]), model.weights.embed)
    causal = paddle.to_tensor(np.triu(np.full((t, t), -np.inf, np.float32), 1))
    for layer in model.weights.layers:
        q, k, v = attention_inputs(c, layer, x, cos, sin)  # (B T, heads, d)
        q = q.reshape([b, t, nh, d]).transpose([0, 2, 1, 3])  # (B, nh, T, d)
        k = k.reshape([b, t, kvh, d]).transpose([0, 2, 1, 3])  # (B, kvh, T, d)
        v = v.reshape([b, t, kvh, d]).transpose([0, 2, 1, 3])
        if kvh != nh:  # GQA: each kv head serves nh / kvh query heads
            k = paddle.repeat_interleave(k, nh // kvh, axis=1)  # (B, nh, T, d)
            v = paddle.repeat_interleave(v, nh // kvh, axis=1)
        scores = paddle.matmul(q, k, transpose_y=True) / math.sqrt(d) + causal
        attn = paddle.matmul(paddle.nn.functional.softmax(scores, axis=-1), v)
        attn = attn.transpose([0, 2, 1, 3]).reshape([b * t, nh * d])  # (B T, nh d)
        x = layer_output(c, layer, x, attn)
    hidden = _rms_norm(x, model.weights.norm, c.rms_norm_eps)
    return model.compute_logits(hidden).reshape([b, t, -1])


def causal_lm_loss(model: LlamaForCausalLM, tokens: paddle.Tensor) -> paddle.Tensor:
    """Mean next-token cross-entropy over ``tokens`` ``(B, T + 1)``."""
    logits = causal_lm_logits(model, tokens[:, :-1])
    return paddle.nn.functional.cross_entropy(
        logits.reshape([-1, logits.shape[-1]]), tokens[:, 1:].reshape([-1, 1])
    )


_LAYER_FIELDS = (
    "input_norm",
    "qkv",
    "qkv_bias",
    "o",
    "o_bias",
    "post_attention_norm",
    "gate_up",
    "gate_up_bias",
    "down",
    "down_bias",
    "q_norm",
    "k_norm",
)


def hf_tensors(config: ModelConfig, model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    """The weights as Hugging Face names and ``(out, in)`` layout, float32."""

    def arr(t: paddle.Tensor) -> np.ndarray:
        return np.ascontiguousarray(t.detach().astype("float32").numpy())

    def linear(prefix: str, fused: paddle.Tensor, *parts: tuple[str, int]) -> None:
        w = arr(fused).T  # (out, in)
        start = 0
        for name, size in parts:
            out[f"{prefix}.{name}.weight"] = np.ascontiguousarray(
                w[start : start + size]
            )
            start += size

    def bias(prefix: str, fused: paddle.Tensor | None, *parts: tuple[str, int]) -> None:
        if fused is None:
            return
        b, start = arr(fused), 0
        for name, size in parts:
            out[f"{prefix}.{name}.bias"] = b[start : start + size]
            start += size

    w = model.weights
    out: dict[str, np.ndarray] = {"model.embed_tokens.weight": arr(w.embed)}
    kv, i_size = config.kv_size, config.intermediate_size
    qkv = (("q_proj", config.q_size), ("k_proj", kv), ("v_proj", kv))
    mlp = (("gate_proj", i_size), ("up_proj", i_size))
    for i, layer in enumerate(w.layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = arr(layer.input_norm)
        out[f"{p}.post_attention_layernorm.weight"] = arr(layer.post_attention_norm)
        linear(f"{p}.self_attn", layer.qkv, *qkv)
        bias(f"{p}.self_attn", layer.qkv_bias, *qkv)
        linear(f"{p}.self_attn", layer.o, ("o_proj", config.hidden_size))
        bias(f"{p}.self_attn", layer.o_bias, ("o_proj", config.hidden_size))
        linear(f"{p}.mlp", layer.gate_up, *mlp)
        bias(f"{p}.mlp", layer.gate_up_bias, *mlp)
        linear(f"{p}.mlp", layer.down, ("down_proj", config.hidden_size))
        bias(f"{p}.mlp", layer.down_bias, ("down_proj", config.hidden_size))
        if layer.q_norm is not None and layer.k_norm is not None:
            out[f"{p}.self_attn.q_norm.weight"] = arr(layer.q_norm)
            out[f"{p}.self_attn.k_norm.weight"] = arr(layer.k_norm)
    out["model.norm.weight"] = arr(w.norm)
    if w.lm_head is not None:
        out["lm_head.weight"] = np.ascontiguousarray(arr(w.lm_head).T)
    return out
