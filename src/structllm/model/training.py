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
Face tensors, so a trained model is saved as any checkpoint is. Both train
and save dense Linears only: another kind is refused by name.
"""

from __future__ import annotations

import math

import numpy as np

from structllm.model._paddle import paddle
from structllm.model.config import ModelConfig
from structllm.model.linear import DenseLinear, Linear, check_backend
from structllm.model.llama import (
    LlamaForCausalLM,
    attention_inputs,
    embed_tokens,
    layer_output,
    rms_norm,
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
    """Every weight tensor of ``model``, made to collect gradients (once
    each: a tied head's is the embedding)."""
    w = model.weights
    check_backend(w.linears(), "training")
    tensors = [w.embed, w.norm, *_parameters(w.lm_head)]
    for layer in w.layers:
        for name in _LAYER_FIELDS:
            field = getattr(layer, name)
            if isinstance(field, Linear):
                tensors += _parameters(field)
            elif field is not None:
                tensors.append(field)
    unique = list({id(t): t for t in tensors}.values())
    for t in unique:
        t.stop_gradient = False
    return unique


def _parameters(linear: Linear) -> list[paddle.Tensor]:
    assert isinstance(linear, DenseLinear)  # check_backend: training's only kind
    return [linear.weight, *([linear.bias] if linear.bias is not None else [])]


def causal_lm_logits(model: LlamaForCausalLM, tokens: paddle.Tensor) -> paddle.Tensor:
    """Logits ``(B, T, V)`` for ``tokens`` ``(B, T)``, each row from position 0."""
    c = model.config
    if any(c.layer_window(i) is not None for i in range(c.num_hidden_layers)):
        raise ValueError("training supports full attention only (no sliding window)")
    b, t = tokens.shape
    nh, kvh, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    positions = paddle.tile(paddle.arange(t, dtype="int64"), [b])  # (B T,)
    cos, sin = model.rope_tables(positions)
    x = embed_tokens(model.weights.embed, tokens.reshape([-1]))
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
    hidden = rms_norm(x, model.weights.norm, c.rms_norm_eps)
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
    "o",
    "post_attention_norm",
    "gate_up",
    "down",
    "q_norm",
    "k_norm",
)


def hf_tensors(config: ModelConfig, model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    """The weights as Hugging Face names and ``(out, in)`` layout, float32."""

    def arr(t: paddle.Tensor) -> np.ndarray:
        return np.ascontiguousarray(t.detach().astype("float32").numpy())

    def linear(prefix: str, fused: Linear, *parts: tuple[str, int]) -> None:
        assert isinstance(fused, DenseLinear)  # check_backend
        w = arr(fused.in_out_weight()).T  # (out, in)
        b = None if fused.bias is None else arr(fused.bias)  # (out,)
        start = 0
        for name, size in parts:
            out[f"{prefix}{name}.weight"] = np.ascontiguousarray(
                w[start : start + size]
            )
            if b is not None:
                out[f"{prefix}{name}.bias"] = b[start : start + size]
            start += size

    w = model.weights
    check_backend(w.linears(), "training")
    out: dict[str, np.ndarray] = {"model.embed_tokens.weight": arr(w.embed)}
    kv, i_size = config.kv_size, config.intermediate_size
    qkv = (("q_proj", config.q_size), ("k_proj", kv), ("v_proj", kv))
    mlp = (("gate_proj", i_size), ("up_proj", i_size))
    for i, layer in enumerate(w.layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = arr(layer.input_norm)
        out[f"{p}.post_attention_layernorm.weight"] = arr(layer.post_attention_norm)
        linear(f"{p}.self_attn.", layer.qkv, *qkv)
        linear(f"{p}.self_attn.", layer.o, ("o_proj", config.hidden_size))
        linear(f"{p}.mlp.", layer.gate_up, *mlp)
        linear(f"{p}.mlp.", layer.down, ("down_proj", config.hidden_size))
        if layer.q_norm is not None and layer.k_norm is not None:
            out[f"{p}.self_attn.q_norm.weight"] = arr(layer.q_norm)
            out[f"{p}.self_attn.k_norm.weight"] = arr(layer.k_norm)
    out["model.norm.weight"] = arr(w.norm)
    if not config.tie_word_embeddings:
        linear("", w.lm_head, ("lm_head", config.vocab_size))
    return out
