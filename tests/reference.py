"""A deliberately naive numpy Llama forward: no cache, no fusion, HF layout.

Independent of structllm's model code, so tests can check the paged Paddle
forward (and the loader's fusing and transposing) against it. Its RoPE too:
the scaled frequencies are written below from their published definitions,
element by element, and checked against values recorded from transformers
(tests/test_rope.py); only the config's fields come from structllm.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from structllm.model.config import ModelConfig


def rope_parameters(config: ModelConfig) -> dict[str, Any] | None:
    """The config's RoPE scaling as the Hugging Face dict it was read from."""
    sc = config.rope_scaling
    if sc is None:
        return None
    keys = (
        "rope_type", "factor", "low_freq_factor", "high_freq_factor",
        "original_max_position_embeddings", "beta_fast", "beta_slow",
        "attention_factor", "mscale", "mscale_all_dim", "truncate",
    )  # fmt: skip
    return {k: getattr(sc, k) for k in keys}


def rope_frequencies(
    head_dim: int, theta: float, max_position_embeddings: int, rope: Any
) -> tuple[list[float], float]:
    """Inverse frequencies (head_dim/2) and the cos/sin factor of a RoPE.

    ``rope`` is a Hugging Face ``rope_scaling`` dict (None: plain RoPE,
    Su et al. 2021: theta ** (-2i / d)). The scalings, from their sources:

    - linear (position interpolation, Chen et al. 2023): positions divided
      by ``factor``, so every frequency is;
    - dynamic (NTK-aware, transformers' ``_compute_dynamic_ntk_parameters``):
      base * ((factor * L / max_pos) - (factor - 1)) ** (d / (d - 2)) at a
      length L; structllm runs inside max_pos, where L = max_pos: the base;
    - llama3 (Llama 3.1's ``apply_scaling``, meta-llama/llama-models):
      wavelengths shorter than old_len / high_freq_factor kept, longer than
      old_len / low_freq_factor divided by ``factor``, a linear blend in
      old_len / wavelength between;
    - yarn (Peng et al. 2023, "YaRN", as transformers'
      ``_compute_yarn_parameters`` discretises it): dimension i interpolated
      (divided by ``factor``) or extrapolated (kept) by a ramp between the
      dimensions that turn ``beta_fast`` and ``beta_slow`` times over the
      original context (floored/ceiled unless ``truncate`` is false); cos
      and sin scaled by sqrt(1/t) = 0.1 ln(factor) + 1 (or the ratio of
      two such with ``mscale`` / ``mscale_all_dim``, or ``attention_factor``).
    """
    d = head_dim
    plain = [theta ** (-(2 * i) / d) for i in range(d // 2)]
    kind = None if rope is None else rope.get("rope_type", rope.get("type"))
    if kind in (None, "default"):
        return plain, 1.0
    factor = float(rope["factor"])
    if kind == "linear":
        return [f / factor for f in plain], 1.0
    if kind == "dynamic":
        length = max_position_embeddings
        base = theta * ((factor * length / max_position_embeddings) - (factor - 1)) ** (
            d / (d - 2)
        )
        return [base ** (-(2 * i) / d) for i in range(d // 2)], 1.0
    old_len = rope.get("original_max_position_embeddings") or max_position_embeddings
    if kind == "llama3":
        low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        out = []
        for freq in plain:
            wavelen = 2 * math.pi / freq
            if wavelen < old_len / high:
                out.append(freq)
            elif wavelen > old_len / low:
                out.append(freq / factor)
            else:
                smooth = (old_len / wavelen - low) / (high - low)
                out.append((1 - smooth) * freq / factor + smooth * freq)
        return out, 1.0
    assert kind == "yarn", kind

    def dim_turning(rotations: float) -> float:  # the dimension that turns so often
        return d * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo = dim_turning(rope.get("beta_fast") or 32)
    hi = dim_turning(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    if lo == hi:
        hi += 0.001
    out = []
    for i, freq in enumerate(plain):
        ramp = min(
            max((i - lo) / (hi - lo), 0.0), 1.0
        )  # 0: extrapolate, 1: interpolate
        out.append(freq / factor * ramp + freq * (1 - ramp))

    def sqrt_one_over_t(m: float = 1.0) -> float:
        return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0

    scale = rope.get("attention_factor")
    if scale is None:
        mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and all_dim:
            scale = sqrt_one_over_t(mscale) / sqrt_one_over_t(all_dim)
        else:
            scale = sqrt_one_over_t()
    return out, float(scale)


def reference_rope(config: ModelConfig) -> tuple[np.ndarray, float]:
    """:func:`rope_frequencies` of ``config``: (head_dim/2,) float64, factor."""
    inv, scale = rope_frequencies(
        config.head_dim,
        config.rope_theta,
        config.max_position_embeddings,
        rope_parameters(config),
    )
    return np.asarray(inv, dtype=np.float64), scale


def reference_logits(
    config: ModelConfig, w: Mapping[str, np.ndarray], ids: Sequence[int]
) -> np.ndarray:
    """Logits (T, V) for every position of ``ids``, float64."""
    c = config
    x = reference_hidden(config, w, ids)
    head = w["model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"]
    return x @ head.astype(np.float64).T


def reference_hidden(
    config: ModelConfig, w: Mapping[str, np.ndarray], ids: Sequence[int]
) -> np.ndarray:
    """The last hidden states (T, H), after the final norm, float64: what
    the head reads, and what embeddings pool."""
    c = config
    t = len(ids)
    nh, kvh, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim

    def f(name: str) -> np.ndarray:
        return w[name].astype(np.float64)

    def rms(x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + c.rms_norm_eps) * g

    inv_freq, scale = reference_rope(c)
    ang = np.outer(np.arange(t), inv_freq)  # (T, d/2)
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
    return rms(x, f("model.norm.weight"))
