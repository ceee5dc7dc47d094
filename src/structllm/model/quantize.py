"""Quantizers: float32 weights as llama.cpp's GGUF blocks, and which type
each projection of a float checkpoint gets when ``quantization=`` asks for
one at load (:func:`quantize_projections`).

:func:`quantize` writes the bytes llama.cpp's ``quantize_row_*_ref`` writes
(no importance matrix), vectorised in numpy over every block of a weight at
once: the 32-value types are a few passes over the values; the K-quants'
scale searches (Q4_K's 21 trials of a scale and a min per 32 values,
Q6_K's 19 of a scale per 16) run every trial over all sub-blocks together,
values along the first axis so that each float32 sum adds in the C's order.
Which type each weight gets is :func:`tensor_type`'s: for ``q4_k``,
llama.cpp's Q4_K_M mix of Q4_K and Q6_K. The blocks are what
:mod:`structllm.model.quant_kernels` multiplies from (its layouts,
:func:`~structllm.model.quant_kernels.row_bytes`).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import numpy as np

from structllm.errors import EngineConfigError
from structllm.model import quant_kernels
from structllm.model._paddle import paddle
from structllm.model.linear import Linear
from structllm.model.quant_kernels import GGMLType, row_bytes
from structllm.model.quantized import QuantizedLinear, QuantizedPart

__all__ = [
    "QUANTIZE_TYPES",
    "quantize",
    "quantize_projections",
    "tensor_type",
    "use_more_bits",
]

#: types :func:`quantize` writes
QUANTIZE_TYPES = frozenset(
    {
        GGMLType.Q8_0,
        GGMLType.Q4_0,
        GGMLType.Q4_1,
        GGMLType.Q5_0,
        GGMLType.Q4_K,
        GGMLType.Q6_K,
    }
)


def quantize_projections(
    config: Any,
    tensors: MutableMapping[str, Any],
    qtype_name: str,
) -> dict[str, Linear]:
    """Every projection of a float checkpoint quantized as ``qtype_name``
    (``"Q8_0"``...) asks, as ``build_model``'s ``linears``: the HF weights and
    biases of each projection are taken out of ``tensors``; a tied head
    quantizes the embedding's rows (the lookup keeps the float embedding).
    Each weight's type is :func:`tensor_type`'s (for ``Q4_K``, llama.cpp's
    Q4_K_M mix). Refuses (:class:`EngineConfigError` on ``quantization``) a
    type the kernels cannot quantize to, and a weight whose rows are not
    whole blocks.
    """
    from structllm.model.loader import projection_loaders

    qtype = int(quant_kernels.GGMLType[qtype_name])
    if qtype not in {int(t) for t in QUANTIZE_TYPES}:
        raise EngineConfigError(
            f"quantization={qtype_name.lower()} is not one the CPU kernels quantize to",
            field="quantization",
        )
    loaders: dict[str, Any] = dict(projection_loaders(config))
    if config.tie_word_embeddings:
        loaders["lm_head"] = None
    out: dict[str, Linear] = {}
    for module, loader in loaders.items():
        pieces = ("model.embed_tokens",) if loader is None else tuple(loader.pieces)
        parts = []
        in_features = 0
        for piece in pieces:
            name = piece + ".weight"
            w = tensors[name] if loader is None else tensors.pop(name)
            w = _float32(w)  # (out, in)
            in_features = w.shape[1]
            kind = int(tensor_type(qtype, piece, in_features, config.num_hidden_layers))
            per_block = quant_kernels.block_layout(kind)[0]
            if w.shape[1] % per_block:
                raise EngineConfigError(
                    f"quantization={qtype_name.lower()}: {name} has {w.shape[1]} "
                    f"inputs, not a multiple of the {per_block}-value block",
                    field="quantization",
                )
            parts.append(QuantizedPart(quantize(w, kind), kind))
        bias = None
        if loader is not None and loader.has_bias:
            bias = paddle.to_tensor(
                np.concatenate([_float32(tensors.pop(p + ".bias")) for p in pieces])
            )
        out[module] = QuantizedLinear.fuse(parts, in_features, bias)
    return out


# -- which type each weight gets (llama.cpp's llama_tensor_get_type) -----------

#: the projections Q4_K_M gives 6 bits in :func:`use_more_bits`' layers
_MORE_BITS = (".self_attn.v_proj", ".mlp.down_proj")

#: the pieces that are the output head (a tied head reads the embedding)
_HEAD = ("lm_head", "model.embed_tokens")

#: ``llama-quantize``'s type where a row is not whole 256-value super-blocks
_FALLBACK = {GGMLType.Q4_K: GGMLType.Q5_0, GGMLType.Q6_K: GGMLType.Q8_0}


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the first and last eighth of the layers
    (rounded down) and every third layer between; 14 of 30 on SmolLM2-135M,
    4 of 8 (0, 3, 6, 7) on the bench model."""
    eighth = num_layers // 8
    return layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2


def tensor_type(qtype: int, piece: str, in_features: int, num_layers: int) -> GGMLType:
    """The type ``llama-quantize`` (no importance matrix) gives the HF weight
    ``piece`` (``model.layers.3.self_attn.v_proj``, ``lm_head``, or
    ``model.embed_tokens`` as a tied head) of ``in_features`` inputs when a
    model of ``num_layers`` layers is quantized to ``qtype``.

    ``Q4_K`` is its Q4_K_M mix (``llama_tensor_get_type`` in
    ``src/llama-quant.cpp``, for a dense model): Q6_K for the output head
    and for ``v_proj`` and ``down_proj`` in :func:`use_more_bits`' layers,
    Q4_K for the rest; then a weight whose rows are not whole super-blocks
    takes the fallback, Q5_0 for Q4_K and Q8_0 for Q6_K (so SmolLM2's
    576-input head and ``v_proj`` are Q8_0, its other 576-input weights
    Q5_0, its ``down_proj`` Q6_K or Q4_K: the types of its published Q4_K_M
    file). Not applied: the C's rules for fused QKV weights, experts and
    70B Llamas (Q5_K ``attn_v``). Other types are every weight's
    (``llama-quantize`` would give a Q4_0 or Q4_1 model a Q6_K head too:
    not done here)."""
    kind = GGMLType(qtype)
    if kind == GGMLType.Q4_K:
        if piece in _HEAD:
            kind = GGMLType.Q6_K
        elif piece.endswith(_MORE_BITS):
            layer = int(piece.split(".")[2])  # model.layers.N....
            if use_more_bits(layer, num_layers):
                kind = GGMLType.Q6_K
    if in_features % 256 and kind in _FALLBACK:
        kind = _FALLBACK[kind]
    return kind


# -- quantizers (llama.cpp's quantize_row_*_ref, vectorised in numpy) ------------


def _round_away(v: np.ndarray) -> np.ndarray:
    """C's ``roundf`` (halves away from zero) in float32, exactly: the
    whole part plus one if the fraction is at least a half."""
    a = np.abs(v)
    whole = np.floor(a)
    rounded: np.ndarray = np.copysign(whole + np.floor(2 * (a - whole)), v)
    return rounded


def _inverse(d: np.ndarray) -> np.ndarray:
    safe = np.where(d == 0, np.float32(1.0), d)
    inverse: np.ndarray = np.where(d == 0, np.float32(0.0), np.float32(1.0) / safe)
    return inverse.astype(np.float32)


def _halves(d: np.ndarray) -> np.ndarray:
    """float32 ``(n, 1)`` as ``(n, 2)`` bytes of IEEE halves."""
    halves: np.ndarray = d.astype(np.float16).view(np.uint8)
    return halves


def _nibbles(q: np.ndarray) -> np.ndarray:
    """``(n, 32)`` values 0..15 as 16 bytes: value j low, value j + 16 high."""
    q = q.astype(np.uint8)
    packed: np.ndarray = q[:, :16] | (q[:, 16:] << np.uint8(4))
    return packed


# Q4_K is llama.cpp's ``quantize_row_q4_K_ref``: each 32-value sub-block gets
# a scale and a min from ``make_qkx2_quants``' search (21 trial scales; for
# each, the weighted least-squares scale and min of its quants; the fit of
# least weighted squared error kept), then the super-block's 8 scales and 8
# mins are quantized to 6 bits against its f16 ``d`` and ``dmin``, and the
# values are quantized again against what the blocks will hold. Arrays are
# ``(32, m)``, value i of sub-block s at ``[i, s]``: each of the C's float32
# sums is then 31 vector adds over every sub-block, in the C's order, so the
# bytes are the C's (compiled without fused multiply-adds), not just close.

#: super-blocks quantized a pass (Q4_K, Q6_K): each temporary is 256 KB
_Q4_K_CHUNK = 256


def _nearest_int(v: np.ndarray) -> np.ndarray:
    """llama.cpp's ``nearest_int``: float32 ``v + 1.5 * 2**23`` read as bits
    (the nearest integer, ties to even, for ``|v| < 2**22``; the C's bits
    past that too)."""
    bits = (v + np.float32(12582912.0)).view(np.int32)
    near: np.ndarray = (bits & np.int32(0x007FFFFF)) - np.int32(0x00400000)
    return near


def _sum_in_order(a: np.ndarray) -> np.ndarray:
    """``(32, m)`` -> ``(m,)``: each column summed from row 0 down, in float32."""
    total: np.ndarray = a[0].copy()
    for row in a[1:]:
        total += row
    return total


def _weighted_error(
    x: np.ndarray,
    w: np.ndarray,
    q: np.ndarray,
    scale: np.ndarray,
    low: np.ndarray,
    buf: np.ndarray,
) -> np.ndarray:
    """``sum(w * (scale * q + low - x)^2)`` per column, the C's way round."""
    np.multiply(q, scale, out=buf)
    buf += low
    buf -= x
    buf *= buf
    buf *= w
    return _sum_in_order(buf)


def _make_qkx2(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``make_qkx2_quants(32, 15, x, weights, ..., -1, 0.1, 20, false)`` for
    every column of ``x`` ``(32, m)``, with Q4_K's weights ``sqrt(mean(x^2)) +
    |x|``: ``(scale (m,), min (m,) (the C's ``the_min``, >= 0), quants (32,
    m) float32)``.

    The 21 trials round with ``np.rint`` (the C's ``nearest_int`` wherever
    ``|v| < 2**22``: every sub-block that is not flat to a few ulps)."""
    f = np.float32
    buf = x * x
    av_x = np.sqrt(_sum_in_order(buf) / f(32))
    w = av_x + np.abs(x)
    sum_w = _sum_in_order(w)
    sum_x = _sum_in_order(np.multiply(w, x, out=buf))
    high = x.max(axis=0)
    low = np.minimum(x.min(axis=0), f(0))
    flat = high == low  # all zero, or all one value <= 0: no quants
    iscale = f(15) / (high - low)
    scale = f(1) / iscale
    q = np.clip(_nearest_int(iscale * (x - low)), 0, 15).astype(np.float32)
    best = _weighted_error(x, w, q, scale, low, buf)
    # the quants kept are those of (kept_iscale, kept_low): made again at the
    # end, rather than copied from each better trial (a masked copy costs
    # several passes over the values)
    kept_iscale, kept_low = iscale, low.copy()
    trial = q  # its buffer: the first quants are made again at the end too
    for step in range(21):
        # low changes as better fits are found: the trials after see it
        iscale = (f(-1) + f(0.1) * f(step) + f(15)) / (high - low)
        np.subtract(x, low, out=trial)
        trial *= iscale
        np.rint(trial, out=trial)
        np.clip(trial, f(0), f(15), out=trial)
        wl = np.multiply(w, trial, out=buf)
        sum_l = _sum_in_order(wl)
        sum_l2 = _sum_in_order(wl * trial)
        sum_xl = _sum_in_order(np.multiply(wl, x, out=buf))
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_low = (sum_l2 * sum_x - sum_l * sum_xl) / det
        positive = this_low > 0  # a min above zero: fit the scale alone
        this_low = np.where(positive, f(0), this_low)
        this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
        error = _weighted_error(x, w, trial, this_scale, this_low, buf)
        better = (det > 0) & (error < best) & ~flat
        best = np.where(better, error, best)
        scale = np.where(better, this_scale, scale)
        kept_iscale = np.where(better, iscale, kept_iscale)
        kept_low = np.where(better, low, kept_low)
        low = np.where(better, this_low, low)
    q = np.clip(_nearest_int(kept_iscale * (x - kept_low)), 0, 15)
    q[:, flat] = 0
    return np.where(flat, f(0), scale), -low, q.astype(np.float32)


def _six_bits(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A super-block's 8 scales (or mins) ``(n, 8)`` as 6-bit integers ``(n,
    8)`` and the f16 step they count ``(n, 1)``: the largest is 63 steps."""
    f = np.float32
    top = np.where(values > 0, values, f(0)).max(axis=1, keepdims=True)
    inverse = np.where(top > 0, f(63) / top, f(0))
    # the C stores the int in a uint8 (mod 256), then caps it at 63
    six = np.minimum(_nearest_int(inverse * values).astype(np.uint8), np.uint8(63))
    return six, (top / f(63)).astype(np.float16)


def _quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """Super-blocks ``(n, 256)`` float32 as Q4_K blocks ``(n, 144)`` uint8."""
    n = blocks.shape[0]
    x = np.ascontiguousarray(blocks.reshape(n * 8, 32).T)  # (32, 8n)
    # the C computes on through zero spans, infinities and NaNs: so do we
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return _q4_k_blocks(n, x)


def _q4_k_blocks(n: int, x: np.ndarray) -> np.ndarray:
    scale, low, q = _make_qkx2(x)
    ls, d = _six_bits(scale.reshape(n, 8))
    lm, dmin = _six_bits(low.reshape(n, 8))
    # the quants again, against the scale and min the block holds
    sub_d = (d.astype(np.float32) * ls.astype(np.float32)).reshape(1, n * 8)
    sub_m = (dmin.astype(np.float32) * lm.astype(np.float32)).reshape(1, n * 8)
    again = np.clip(_nearest_int((x + sub_m) / sub_d), 0, 15)
    q = np.where(sub_d == 0, q, again).astype(np.uint8)  # d 0: make_qkx2's kept
    q = q.T.reshape(n, 4, 2, 32)  # sub-blocks 2c, 2c + 1: one nibble each
    packed = q[:, :, 0] | (q[:, :, 1] << np.uint8(4))
    hi_s, hi_m = ls[:, 4:] >> np.uint8(4), lm[:, 4:] >> np.uint8(4)
    scales = np.concatenate(
        [
            ls[:, :4] | (hi_s << np.uint8(6)),
            lm[:, :4] | (hi_m << np.uint8(6)),
            (ls[:, 4:] & np.uint8(0x0F))
            | ((lm[:, 4:] & np.uint8(0x0F)) << np.uint8(4)),
        ],
        axis=1,
    )
    return np.concatenate(
        [d.view(np.uint8), dmin.view(np.uint8), scales, packed.reshape(n, 128)],
        axis=1,
    )


# Q6_K is llama.cpp's ``quantize_row_q6_K_ref``: each 16-value sub-block gets
# a symmetric scale from ``make_qx_quants(16, 32, x, L, 1, NULL)`` (the
# scale of the largest magnitude, then 18 trial scales around it, each the
# x^2-weighted least-squares fit of its quants, the best fit kept), the
# super-block's 16 scales are quantized to int8 against its f16 ``d`` (the
# largest magnitude -128 steps), and the values are quantized again to
# -32..31 against what the block will hold. Arrays are ``(16, m)``, value i
# of sub-block s at ``[i, s]``, as Q4_K's: each float32 sum adds in the C's
# order.

#: below this largest magnitude a sub-block (or super-block) is all zeros
_GROUP_MAX_EPS = np.float32(1e-15)


def _largest(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """The first value of largest magnitude along ``axis`` and its magnitude,
    as the C's ``if (fabsf(v) > amax)`` scan finds them (a NaN never)."""
    magnitude = np.abs(x)
    magnitude[np.isnan(magnitude)] = 0
    at = np.expand_dims(magnitude.argmax(axis=axis), axis)
    value = np.take_along_axis(x, at, axis=axis)
    return value.squeeze(axis), np.take_along_axis(magnitude, at, axis).squeeze(axis)


def _qx_fit(
    x: np.ndarray, wx: np.ndarray, w: np.ndarray, iscale: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """One trial of ``make_qx_quants``: the quants of ``iscale`` (-32..31;
    ``np.rint`` is the C's ``nearest_int`` at these magnitudes) and their
    sums ``sum((w x) l)``, ``sum((w l) l)`` per column, the C's way round."""
    q = np.rint(x * iscale)
    np.clip(q, -32, 31, out=q)
    sum_lx = _sum_in_order(wx * q)
    return sum_lx, _sum_in_order(w * q * q)


def _make_qx(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``make_qx_quants(16, 32, x, L, 1, NULL)`` for every column of ``x``
    ``(16, m)``: ``(scale (m,), the iscale of the quants kept (m,), the
    all-zero columns (m,))``."""
    f = np.float32
    top, magnitude = _largest(x, axis=0)
    zero = magnitude < _GROUP_MAX_EPS
    w = x * x
    wx = w * x
    kept = f(-32) / top
    sum_lx, sum_l2 = _qx_fit(x, wx, w, kept)
    scale = np.where(sum_l2 != 0, sum_lx / sum_l2, f(0))
    best = scale * sum_lx
    for step in (*range(-9, 0), *range(1, 10)):
        iscale = -(f(32) + f(0.1) * f(step)) / top
        sum_lx, sum_l2 = _qx_fit(x, wx, w, iscale)
        better = (sum_l2 > 0) & (sum_lx * sum_lx > best * sum_l2)
        scale = np.where(better, sum_lx / sum_l2, scale)
        best = np.where(better, scale * sum_lx, best)
        kept = np.where(better, iscale, kept)
    return np.where(zero, f(0), scale), kept, zero


def _quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Super-blocks ``(n, 256)`` float32 as Q6_K blocks ``(n, 210)`` uint8:
    128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, f16 d."""
    n = blocks.shape[0]
    x = np.ascontiguousarray(blocks.reshape(n * 16, 16).T)  # (16, 16n)
    # the C computes on through zero spans, infinities and NaNs: so do we
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return _q6_k_blocks(n, x)


def _q6_k_blocks(n: int, x: np.ndarray) -> np.ndarray:
    f = np.float32
    scale, kept, zero = _make_qx(x)
    # make_qx_quants' quants: where a scale rounds to 0 the block keeps them
    fitted = np.clip(_nearest_int(kept * x), -32, 31) + 32
    fitted[:, zero] = 0
    top, magnitude = _largest(scale.reshape(n, 16), axis=1)
    empty = magnitude < _GROUP_MAX_EPS  # (n,): every byte 0
    iscale = (f(-128) / top)[:, None]  # (n, 1)
    d = (f(1) / iscale).astype(np.float16)
    scales = np.minimum(_nearest_int(iscale * scale.reshape(n, 16)), 127)
    scales = scales.astype(np.int8)  # the C stores the int in an int8
    sub_d = (d.astype(f) * scales.astype(f)).reshape(1, n * 16)
    again = np.clip(_nearest_int(x / sub_d), -32, 31) + 32
    q = np.where(sub_d == 0, fitted, again).astype(np.uint8)  # (16, 16n)
    # value 128h + 32j + l at q[n, h, j, l]: bytes l of half h hold j = 0, 2
    # (low, high nibble) and 1, 3; its 2-bit highs are bits 2j of qh[l]
    q = q.T.reshape(n, 2, 4, 32)
    low = q & np.uint8(15)
    ql = np.concatenate(
        [low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)],
        axis=2,
    )  # (n, 2, 64)
    high = q >> np.uint8(4)
    qh = high[:, :, 0] | high[:, :, 1] << 2 | high[:, :, 2] << 4 | high[:, :, 3] << 6
    raw = np.concatenate(
        [
            ql.reshape(n, 128),
            qh.reshape(n, 64),
            scales.view(np.uint8),
            d.view(np.uint8),
        ],
        axis=1,
    )
    raw[empty] = 0
    return raw


def quantize(w: np.ndarray, qtype: int) -> np.ndarray:
    """A float32 weight ``(out, in)`` as raw rows of GGML type ``qtype``
    (one of :data:`QUANTIZE_TYPES`): ``np.uint8 (out, row_bytes)``, the
    bytes llama.cpp's ``quantize_row_*_ref`` writes (and gguf-py's
    ``gguf.quants.quantize``, which has no Q4_K or Q6_K: those are checked
    against transcriptions of the C, and equal libggml's own bytes). Q4_K
    runs at ~40 MB of float32 a second on one core (its 21-trial search per
    32 values), Q6_K at about twice that (19 trials per 16 values, one
    scale each); the others at hundreds."""
    try:
        kind = GGMLType(qtype)
    except ValueError:
        raise ValueError(f"qtype {qtype!r} is not a GGML type") from None
    if kind not in QUANTIZE_TYPES:
        raise ValueError(f"qtype {kind.name} has no quantizer here")
    if not isinstance(w, np.ndarray) or w.ndim != 2 or w.dtype != np.float32:
        raise ValueError(f"w must be a 2-D float32 array, not {_describe(w)}")
    rows, n = w.shape
    size = row_bytes(kind, n)
    if kind in (GGMLType.Q4_K, GGMLType.Q6_K):
        supers = np.ascontiguousarray(w).reshape(-1, 256)
        raw = np.empty((supers.shape[0], size * 256 // n), np.uint8)
        blocks_of = _quantize_q4_k if kind == GGMLType.Q4_K else _quantize_q6_k
        for at in range(0, supers.shape[0], _Q4_K_CHUNK):
            raw[at : at + _Q4_K_CHUNK] = blocks_of(supers[at : at + _Q4_K_CHUNK])
        return raw.reshape(rows, size)
    blocks = np.ascontiguousarray(w).reshape(-1, 32)
    if kind == GGMLType.Q8_0:
        d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
        q = _round_away(blocks * _inverse(d)).astype(np.int8).view(np.uint8)
        raw = np.concatenate([_halves(d), q], axis=1)
    elif kind == GGMLType.Q4_0:
        at = np.abs(blocks).argmax(axis=1)[:, None]  # the first of the largest
        d = np.take_along_axis(blocks, at, axis=1) / np.float32(-8)
        q = np.trunc(blocks * _inverse(d) + np.float32(8.5))
        raw = np.concatenate([_halves(d), _nibbles(np.minimum(q, 15))], axis=1)
    elif kind == GGMLType.Q5_0:
        at = np.abs(blocks).argmax(axis=1)[:, None]
        d = np.take_along_axis(blocks, at, axis=1) / np.float32(-16)
        q = np.minimum(np.trunc(blocks * _inverse(d) + np.float32(16.5)), 31)
        q = q.astype(np.uint8)  # value j's fifth bit: bit j of the 32-bit qh
        high = np.packbits(q >> np.uint8(4), axis=1, bitorder="little")
        raw = np.concatenate([_halves(d), high, _nibbles(q & np.uint8(15))], axis=1)
    else:  # Q4_1
        lo = blocks.min(axis=1, keepdims=True)
        d = (blocks.max(axis=1, keepdims=True) - lo) / np.float32(15)
        q = np.trunc((blocks - lo) * _inverse(d) + np.float32(0.5))
        raw = np.concatenate(
            [_halves(d), _halves(lo), _nibbles(np.minimum(q, 15))], axis=1
        )
    return raw.reshape(rows, size)


def _float32(x: Any) -> np.ndarray:
    """A float32 numpy copy of a Paddle tensor or array (any float dtype)."""
    if isinstance(x, paddle.Tensor):
        x = x.astype("float32").numpy()
    return np.ascontiguousarray(x, dtype=np.float32)


def _describe(a: object) -> str:
    if isinstance(a, np.ndarray):
        return f"{a.dtype} {a.shape}"
    return type(a).__name__
