"""A deliberately naive numpy Llama forward: no cache, no fusion, HF layout.

Independent of structllm's model code, so tests can check the paged Paddle
forward (and the loader's fusing and transposing) against it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from structllm.model.config import ModelConfig
from structllm.model.llama import rope_attention_factor, rope_inv_freq


def reference_logits(
    config: ModelConfig, w: Mapping[str, np.ndarray], ids: Sequence[int]
) -> np.ndarray:
    """Logits (T, V) for every position of ``ids``, float64."""
    c = config
    t = len(ids)
    nh, kvh, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim

    def f(name: str) -> np.ndarray:
        return w[name].astype(np.float64)

    def rms(x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + c.rms_norm_eps) * g

    ang = np.outer(np.arange(t), rope_inv_freq(c))  # (T, d/2)
    scale = rope_attention_factor(c)
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :] * scale
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :] * scale

    def rope(x: np.ndarray) -> np.ndarray:
        rot = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
        return x * cos + rot * sin

    x = f("model.embed_tokens.weight")[list(ids)]
    for n in range(c.num_hidden_layers):
        p = f"model.layers.{n}."
        causal = np.tril(np.ones((t, t), dtype=bool))
        window = c.layer_window(n)
        if window is not None:  # query i sees keys j with i - j < window
            causal &= np.subtract.outer(np.arange(t), np.arange(t)) < window
        h = rms(x, f(p + "input_layernorm.weight"))
        q = h @ f(p + "self_attn.q_proj.weight").T
        k = h @ f(p + "self_attn.k_proj.weight").T
        v = h @ f(p + "self_attn.v_proj.weight").T
        if c.qkv_bias:
            q = q + f(p + "self_attn.q_proj.bias")
            k = k + f(p + "self_attn.k_proj.bias")
            v = v + f(p + "self_attn.v_proj.bias")
        q, k = q.reshape(t, nh, d), k.reshape(t, kvh, d)
        if c.qk_norm:
            q = rms(q, f(p + "self_attn.q_norm.weight"))
            k = rms(k, f(p + "self_attn.k_norm.weight"))
        q = rope(q)
        k = np.repeat(rope(k), nh // kvh, axis=1)
        v = np.repeat(v.reshape(t, kvh, d), nh // kvh, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
        s = np.where(causal[None], s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        a = np.einsum("hqk,khd->qhd", s, v).reshape(t, nh * d)
        o = a @ f(p + "self_attn.o_proj.weight").T
        x = x + (o + f(p + "self_attn.o_proj.bias") if c.o_bias else o)
        h = rms(x, f(p + "post_attention_layernorm.weight"))
        gate = h @ f(p + "mlp.gate_proj.weight").T
        up = h @ f(p + "mlp.up_proj.weight").T
        if c.mlp_bias:
            gate = gate + f(p + "mlp.gate_proj.bias")
            up = up + f(p + "mlp.up_proj.bias")
        down = (gate / (1 + np.exp(-gate)) * up) @ f(p + "mlp.down_proj.weight").T
        x = x + (down + f(p + "mlp.down_proj.bias") if c.mlp_bias else down)
    x = rms(x, f("model.norm.weight"))
    head = f("model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight")
    return x @ head.T
