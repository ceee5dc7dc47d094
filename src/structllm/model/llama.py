"""Llama-family decoder (Llama, Qwen2, Qwen3, Mistral) in plain Paddle ops.

Every projection is a :class:`~structllm.model.linear.Linear` (dense: one
``paddle.matmul``; an ``nn.Linear`` call costs several times more on CPU),
fused: ``qkv`` is ``[q | k | v]`` and ``gate_up`` is ``[gate | up]``. Their
biases are added here, where each path puts them. The forward takes a step's flattened tokens from
many sequences and attends through the paged KV cache; it has no Python
control flow per token.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import numpy as np

from structllm.errors import EngineConfigError
from structllm.model import kernels
from structllm.model._paddle import host_tensor, paddle
from structllm.model.attention import AttentionMetadata, PortableAttention, RopeTables
from structllm.model.config import ModelConfig, RopeScaling
from structllm.model.decode_plan import DecodePlan, DecodePlans, host_buffer
from structllm.model.linear import Backend, HostLinear, Linear

if TYPE_CHECKING:
    from structllm.model.lora import LoRASlots
    from structllm.model.packed import PackedEmbedding
    from structllm.model.quantized import QuantizedEmbedding

__all__ = [
    "KEPT_LOGITS_ROWS",
    "KV_CACHE_DTYPES",
    "LAYER_PROJECTIONS",
    "DecoderLayerWeights",
    "LlamaForCausalLM",
    "ModelWeights",
    "embed_tokens",
    "rms_norm",
    "rope_attention_factor",
    "rope_inv_freq",
]

#: how a KV cache may store keys and values (``set_kv_cache_dtype``)
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")

#: compute_logits keeps the memory of at most this many rows of logits (a
#: decode batch's; a prompt's logprobs take fresh memory)
KEPT_LOGITS_ROWS = 64

_fused_rms_norm = paddle.incubate.nn.functional.fused_rms_norm
#: Paddle's CPU fused_rms_norm kernel is AVX-512 code: SIGILL on AVX2-only CPUs
_FUSED_RMS_NORM = paddle.is_compiled_with_cuda() or paddle.base.core.supports_avx512f()
_swiglu = paddle.nn.functional.swiglu


#: a layer's projections: field of :class:`DecoderLayerWeights` -> module
#: name under ``model.layers.N.`` (HF's, fused as vLLM names them)
LAYER_PROJECTIONS = {
    "qkv": "self_attn.qkv_proj",
    "o": "self_attn.o_proj",
    "gate_up": "mlp.gate_up_proj",
    "down": "mlp.down_proj",
}


@attrs.define(eq=False)
class DecoderLayerWeights:
    input_norm: paddle.Tensor  # (H,)
    qkv: Linear  # H -> q_size + 2 * kv_size; its bias added with RoPE
    o: Linear  # q_size -> H; its bias after the all-reduce
    post_attention_norm: paddle.Tensor  # (H,)
    gate_up: Linear  # H -> 2 * I
    down: Linear  # I -> H; its bias after the all-reduce
    q_norm: paddle.Tensor | None = None  # (head_dim,) Qwen3
    k_norm: paddle.Tensor | None = None  # (head_dim,)


@attrs.define(eq=False)
class ModelWeights:
    #: (V, H); a quantized model's stays in its blocks (the lookups
    #: dequantize); a served float32 model's tied table is its packed head's
    embed: paddle.Tensor | QuantizedEmbedding | PackedEmbedding
    layers: list[DecoderLayerWeights]
    norm: paddle.Tensor  # (H,)
    #: H -> V; a tied head reads ``embed`` (``DenseLinear(embed, transposed=True)``)
    lm_head: Linear

    def linears(self) -> Iterator[tuple[str, Linear]]:
        """Every projection with its module name (``model.layers.0.self_attn.qkv_proj``,
        ``lm_head``)."""
        for n, layer in enumerate(self.layers):
            for field, module in LAYER_PROJECTIONS.items():
                yield f"model.layers.{n}.{module}", getattr(layer, field)
        yield "lm_head", self.lm_head


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies (head_dim/2,) as transformers computes them.

    ``dynamic`` is the default inside ``max_position_embeddings``, which is
    where structllm runs it (past it transformers' frequencies depend on how
    the sequence was fed).
    """
    d = config.head_dim
    base = config.rope_theta
    inv = 1.0 / (base ** (np.arange(0, d, 2, dtype=np.float64) / d))
    sc = config.rope_scaling
    if sc is None or sc.rope_type == "dynamic":
        return inv
    if sc.rope_type == "linear":
        return inv / sc.factor
    orig = sc.original_max_position_embeddings or config.max_position_embeddings
    if sc.rope_type == "yarn":
        return _yarn_inv_freq(inv, sc, d, base, orig)
    # llama3: long wavelengths slowed by `factor`, short ones kept, blend between
    low_wavelen = orig / sc.low_freq_factor
    high_wavelen = orig / sc.high_freq_factor
    wavelen = 2 * np.pi / inv
    smooth = (orig / wavelen - sc.low_freq_factor) / (
        sc.high_freq_factor - sc.low_freq_factor
    )
    blended = (1 - smooth) * inv / sc.factor + smooth * inv
    return np.where(
        wavelen > low_wavelen,
        inv / sc.factor,
        np.where(wavelen < high_wavelen, inv, blended),
    )


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor cos and sin are scaled by (yarn's mscale; 1 otherwise)."""
    sc = config.rope_scaling
    return sc.yarn_attention_factor() if sc and sc.rope_type == "yarn" else 1.0


def _yarn_inv_freq(
    inv: np.ndarray, sc: RopeScaling, d: int, base: float, orig: int
) -> np.ndarray:
    """YaRN's NTK-by-parts blend of extrapolated and interpolated frequencies."""

    def correction_dim(rotations: float) -> float:
        return (d * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(sc.beta_fast), correction_dim(sc.beta_slow)
    if sc.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp
    return (inv / sc.factor) * (1 - extrapolate) + inv * extrapolate


class LlamaForCausalLM:
    """The decoder plus its LM head; one call computes a whole step."""

    #: where its Linears run (``linear.check_backend``): what a wrapper
    #: added after the build (``lora.enable_lora``) is checked against
    backend: ClassVar[Backend] = "eager"

    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        *,
        block_size: int,
        max_model_len: int,
        all_reduce: Callable[[paddle.Tensor], paddle.Tensor] | None = None,
    ) -> None:
        self.config = config
        self.weights = weights
        #: see set_kv_cache_dtype
        self.kv_cache_dtype = "auto"
        #: a tensor-parallel rank's sum of the o and down projections' partial
        #: outputs over its group (``model/parallel.py``); None: whole model
        self.all_reduce = all_reduce
        self.dtype = weights.embed.dtype
        #: the LoRA adapters' slots and each row's slot, once
        #: ``lora.enable_lora`` wrapped the projections; None: no LoRA
        self.lora: LoRASlots | None = None
        self.attention = PortableAttention(
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            block_size,
            windows={config.layer_window(i) for i in range(config.num_hidden_layers)},
            # the compiled kernels run a float32 model in host memory
            use_kernels=self.dtype == paddle.float32 and paddle.get_device() == "cpu",
        )
        self._windows = [
            config.layer_window(i) for i in range(config.num_hidden_layers)
        ]
        from structllm.model.quantized import quantized_linears

        #: projections kept in GGML blocks (a GGUF file, quantization= at
        #: load): ``auto`` then caches keys and values as float16
        self.quantized = bool(quantized_linears(weights.linears()))
        #: no bias after the q/k/v projection (see _decode_layers)
        self._unbiased = all(
            layer.o.bias is None
            and layer.gate_up.bias is None
            and layer.down.bias is None
            for layer in weights.layers
        )
        # cos/sin for every position, float32: (max_model_len, head_dim / 2)
        freqs = np.outer(
            np.arange(max_model_len, dtype=np.float64), rope_inv_freq(config)
        )
        # full-width tables, sin signed for the rotated half: (max_len, head_dim)
        scale = rope_attention_factor(config)
        cos, sin = np.cos(freqs) * scale, np.sin(freqs) * scale
        self._rope = RopeTables(
            cos=np.concatenate([cos, cos], -1).astype(np.float32),
            sin=np.concatenate([-sin, sin], -1).astype(np.float32),
        )
        self._cos = paddle.to_tensor(self._rope.cos)
        #: the logits compute_logits writes a quantized head's into
        self._logits = np.empty(0, np.float32)
        #: the decode steps' bound kernel calls, by batch size and threading
        self._plans = DecodePlans()
        self._sin = paddle.to_tensor(self._rope.sin)

    def set_lora_rows(self, rows: Sequence[int] | np.ndarray | None) -> None:
        """Each row's LoRA slot for the next forwards (``(T,)`` ints, -1 for
        none; None: no row uses an adapter), as ``LoRASlots.set_rows``;
        needs ``lora.enable_lora``."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled on this model (enable_lora)")
        self.lora.set_rows(rows)

    def set_kv_cache_dtype(self, kv_cache_dtype: str) -> None:
        """How caches allocated from now on store keys and values: ``auto``
        (:meth:`resolved_kv_cache_dtype`), ``float32`` (a float32 model's
        own), ``float16`` or ``bfloat16`` (read and written by the CPU
        kernels, which see their bits as ``kernels.CACHE_BITS``)."""
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise EngineConfigError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not "
                f"{kv_cache_dtype!r}",
                field="kv_cache_dtype",
            )
        if kv_cache_dtype == "float32" and self.dtype != paddle.float32:
            raise EngineConfigError(
                f"kv_cache_dtype float32 needs a float32 model, not {self.dtype}",
                field="kv_cache_dtype",
            )
        if kv_cache_dtype in ("float16", "bfloat16") and not self._kernel_caches():
            raise EngineConfigError(
                f"kv_cache_dtype {kv_cache_dtype} needs the CPU attention kernels "
                "(numba, a float32 model on the CPU)",
                field="kv_cache_dtype",
            )
        self.kv_cache_dtype = kv_cache_dtype

    def _kernel_caches(self) -> bool:
        """Whether the kernels read and write the caches (any kind of them)."""
        return self.attention.use_kernels and self.dtype == paddle.float32

    def resolved_kv_cache_dtype(self) -> str:
        """What the caches hold: ``kv_cache_dtype``, where ``auto`` is float16
        for quantized projections the kernels run (what llama.cpp caches on
        the same files: its error is far below the weights'), else the
        model's dtype."""
        if self.kv_cache_dtype != "auto":
            return self.kv_cache_dtype
        if self.quantized and self._kernel_caches():
            return "float16"
        return str(self.dtype).removeprefix("paddle.")

    def allocate_kv_cache(
        self, num_blocks: int
    ) -> list[tuple[paddle.Tensor, paddle.Tensor]]:
        """Per layer K and V, ``(kv_heads, num_blocks * block_size, head_dim)``."""
        a = self.attention
        dtype = self.resolved_kv_cache_dtype()
        return [
            (a.allocate(num_blocks, dtype), a.allocate(num_blocks, dtype))
            for _ in range(self.config.num_hidden_layers)
        ]

    def kv_cache_bytes_per_block(self) -> int:
        c = self.config
        elem = 4 if self.resolved_kv_cache_dtype() == "float32" else 2
        return 2 * c.num_hidden_layers * self.attention.block_size * c.kv_size * elem

    def checked_positions(self, positions: paddle.Tensor) -> np.ndarray:
        """``positions`` on the host, each inside the RoPE tables (once a
        step: neither Paddle's indexing of the tables on CPU nor the kernels
        check it; past the tables they would read other memory)."""
        host: np.ndarray = positions.numpy()
        if host.size and not (host.min() >= 0 and host.max() < len(self._rope.cos)):
            raise IndexError(
                f"position out of range for a RoPE table of {len(self._rope.cos)}"
            )
        return host

    def rope_tables(
        self, positions: paddle.Tensor
    ) -> tuple[paddle.Tensor, paddle.Tensor]:
        """cos and sin rows for ``positions``: ``(T, q_heads + kv_heads, head_dim)``.

        Spelled out over the heads once a step, for every layer's RoPE: Paddle
        multiplies a ``(T, heads, d)`` tensor by a ``(T, 1, d)`` one 7x slower
        on CPU than by one of its own shape (docs/benchmarks.md).
        """
        c = self.config
        shape = [-1, c.num_attention_heads + c.num_key_value_heads, c.head_dim]
        return (
            paddle.expand(self._cos[positions].unsqueeze(1), shape),
            paddle.expand(self._sin[positions].unsqueeze(1), shape),
        )

    def forward(
        self,
        input_ids: paddle.Tensor,  # (T,) int64
        positions: paddle.Tensor,  # (T,) int64
        kv_caches: Sequence[tuple[paddle.Tensor, paddle.Tensor]],
        meta: AttentionMetadata,
    ) -> paddle.Tensor:  # (T, H)
        return self.residual_stream(input_ids, positions, kv_caches, meta, final=True)

    def residual_stream(
        self,
        input_ids: paddle.Tensor,  # (T,) int64
        positions: paddle.Tensor,  # (T,) int64
        kv_caches: Sequence[tuple[paddle.Tensor, paddle.Tensor]],
        meta: AttentionMetadata,
        *,
        final: bool = False,
    ) -> paddle.Tensor:  # (T, H), before the final norm (after it: final)
        c = self.config
        w = self.weights
        if (
            meta.use_kernels
            and meta.num_decodes == meta.num_tokens
            and self._unbiased
            and self.all_reduce is None
        ):
            host_positions = self.checked_positions(positions)
            return self._decode_layers(
                input_ids, host_positions, kv_caches, meta, final
            )
        x = embed_tokens(w.embed, input_ids)  # (T, H)
        if meta.use_kernels:
            x = self._residual_stream_kernels(x, positions, kv_caches, meta)
        else:
            self.checked_positions(positions)
            cos, sin = self.rope_tables(positions)
            for i, layer in enumerate(w.layers):
                q, k, v = attention_inputs(c, layer, x, cos, sin)
                k_cache, v_cache = kv_caches[i]
                attn = self.attention.forward(
                    q, k, v, k_cache, v_cache, meta, self._windows[i]
                )  # (T, nh * d)
                x = layer_output(c, layer, x, attn, self.all_reduce)
        return rms_norm(x, w.norm, c.rms_norm_eps) if final else x

    def _residual_stream_kernels(
        self,
        x: paddle.Tensor,  # (T, H) the embeddings
        positions: paddle.Tensor,  # (T,) int64
        kv_caches: Sequence[tuple[paddle.Tensor, paddle.Tensor]],
        meta: AttentionMetadata,
    ) -> paddle.Tensor:  # (T, H)
        """The layers with RoPE, the cache writes and the attention in the
        compiled kernels (``attention.forward_qkv``), and each residual add
        fused into the norm after it, and SwiGLU, as kernels too: the fewest
        ops a layer, since at batch 1 every op costs 10-20 us in the middle
        of a step, and the kernels' SwiGLU and norm take 0.2x and 0.6x
        Paddle's time on a prefill's rows (1024 x 1536: 0.8 vs 4.0 ms, 1024
        x 576: 0.3 vs 0.5 ms; Paddle's SwiGLU is single-threaded scalar
        code). The residual stream is this step's own host buffer, updated
        in place."""
        c = self.config
        layers = self.weights.layers
        host_positions = self.checked_positions(positions)
        views = self.attention.host_view
        eps = c.rms_norm_eps
        x_t = paddle.empty(x.shape, "float32")
        x_h: np.ndarray = np.from_dlpack(x_t)
        x_h[...] = np.from_dlpack(x)
        h = paddle.empty(x.shape, "float32")  # each norm's, reused
        h_h = np.from_dlpack(h)
        kernels.add_rms_norm(x_h, views(layers[0].input_norm), eps, h_h)
        buffer = self.attention.qkv_buffer(meta, layers[0].qkv.out_features)
        for i, layer in enumerate(layers):
            # (T, q_size + 2 kv_size) on the host, the bias not yet added
            if buffer is not None:
                layer.qkv(h, out=buffer[0])
                qkv = buffer[1]
            else:
                qkv = np.from_dlpack(layer.qkv(h))
            attn = self._attention(i, qkv, kv_caches, meta, host_positions)
            out = _o_projection(layer, attn, self.all_reduce)
            norm = views(layer.post_attention_norm)
            kernels.add_rms_norm(x_h, norm, eps, h_h, delta=np.from_dlpack(out))
            out = _mlp_kernels(layer, h, self.all_reduce)
            if i + 1 < len(layers):
                norm = views(layers[i + 1].input_norm)
                kernels.add_rms_norm(x_h, norm, eps, h_h, delta=np.from_dlpack(out))
            else:
                x_h += np.from_dlpack(out)
        return x_t

    def _attention(
        self,
        i: int,  # the layer
        qkv: np.ndarray,  # (T, q_size + 2 kv_size) on the host, before the bias
        kv_caches: Sequence[tuple[paddle.Tensor, paddle.Tensor]],
        meta: AttentionMetadata,
        positions: np.ndarray,  # (T,) checked
    ) -> paddle.Tensor:  # (T, nh * d)
        """Layer ``i``'s attention from its q/k/v projection, by the kernels."""
        k_cache, v_cache = kv_caches[i]
        return self.attention.forward_qkv(
            qkv, k_cache, v_cache, meta, positions, *self._attention_args(i)
        )

    def _attention_args(self, i: int) -> tuple[Any, ...]:
        """Layer ``i``'s arguments to the kernels' attention after the
        positions: RoPE tables, window, Qwen3's q/k norms, eps, Qwen2's bias."""
        layer = self.weights.layers[i]
        return (
            self._rope,
            self._windows[i],
            layer.q_norm,
            layer.k_norm,
            self.config.rms_norm_eps,
            layer.qkv.bias,
        )

    def _decode_layers(
        self,
        input_ids: paddle.Tensor,  # (B,) int64
        positions: np.ndarray,  # (B,) checked
        kv_caches: Sequence[tuple[paddle.Tensor, paddle.Tensor]],
        meta: AttentionMetadata,
        final: bool,
    ) -> paddle.Tensor:  # (B, H), before the final norm (after it: final)
        """A step of decode rows alone: the kernel calls of this batch size
        bound once (``model/decode_plan.py``), every matmul into a buffer
        of the plan and every other op a compiled kernel on those buffers,
        so a layer makes no tensor and no Python checks. At batch 1 the ops
        between the matmuls were a third of the step; writing them as
        kernels on kept buffers made it 6-8% faster, quantized projections
        on the host views and the attention as one call a further 9% of
        SmolLM2-135M Q4_1's CPU time (``tools/decode_overhead.py``), and
        the plan 15-17% of the step more (docs/benchmarks.md)."""
        rows = int(input_ids.shape[0])
        key = (rows, meta.decode_threaded, kernels.num_threads())
        plan = self._plans.get(
            key,
            kv_caches,
            lambda: self._decode_plan(rows, kv_caches, meta.decode_threaded),
        )
        return plan.run(input_ids.numpy(), positions, meta, final)

    def _decode_plan(
        self,
        rows: int,
        kv_caches: Sequence[tuple[paddle.Tensor, paddle.Tensor]],
        threaded: bool,
    ) -> DecodePlan:
        """The calls of :meth:`_decode_layers` at ``rows`` rows, bound."""
        c = self.config
        layers = self.weights.layers
        attention = self.attention
        views = attention.host_view
        eps = c.rms_norm_eps
        nh, d = c.num_attention_heads, c.head_dim
        inner = layers[0].down.in_features
        blocks = -(-len(self._rope.cos) // attention.block_size)
        num_slots = int(kv_caches[0][0].shape[1])
        plan = DecodePlan.empty(
            kv_caches,
            num_slots,
            rows,
            blocks,
            _embedder(self.weights.embed),
            views(self.weights.norm),
            eps,
        )
        x_h = plan.residual[1]
        normed = host_buffer((rows, c.hidden_size))
        h_h = normed[1]
        out = host_buffer((rows, c.hidden_size))
        out_h = out[1]
        gate_up = host_buffer((rows, 2 * inner))
        act = host_buffer((rows, inner))
        qkv = host_buffer((rows, layers[0].qkv.out_features))
        attn = host_buffer((rows, nh * d))
        rotated = np.empty((rows, nh, d), np.float32)
        calls = plan.calls
        calls.append(
            kernels.add_rms_norm_call(x_h, views(layers[0].input_norm), eps, h_h)
        )
        for i, layer in enumerate(layers):
            calls += _projection_calls(layer.qkv, normed, qkv)
            k_cache, v_cache = kv_caches[i]
            calls.append(
                attention.decode_call(
                    qkv[1],
                    k_cache,
                    v_cache,
                    plan.step,
                    rotated,
                    attn[1].reshape(rows, nh, d),
                    *self._attention_args(i),
                    threaded=threaded,
                )
            )
            calls += _projection_calls(layer.o, attn, out)
            norm = views(layer.post_attention_norm)
            calls.append(kernels.add_rms_norm_call(x_h, norm, eps, h_h, out_h))
            calls += _projection_calls(layer.gate_up, normed, gate_up)
            calls.append(kernels.swiglu_call(gate_up[1], act[1]))
            calls += _projection_calls(layer.down, act, out)
            if i + 1 < len(layers):
                norm = views(layers[i + 1].input_norm)
                calls.append(kernels.add_rms_norm_call(x_h, norm, eps, h_h, out_h))
            else:
                calls.append((np.add, (x_h, out_h, x_h)))
        return plan

    def compute_logits(self, hidden: paddle.Tensor) -> paddle.Tensor:  # (N, V) float32
        """The head's logits. Of a host-kernel head (quantized, packed) and up to
        :data:`KEPT_LOGITS_ROWS` rows on the host, they are written into
        memory this model keeps (valid until the next call: the engine
        copies them to numpy at once). A fresh ``(16, 49152)`` tensor a
        decode step was fresh pages each time: 2 ms of SmolLM2's 12 ms
        head at batch 16."""
        head = self.weights.lm_head
        rows = hidden.shape[0]
        if (
            isinstance(head, HostLinear)
            and rows <= KEPT_LOGITS_ROWS
            and hidden.place.is_cpu_place()
        ):
            size = rows * head.out_features
            if self._logits.size < size:
                self._logits = np.empty(size, np.float32)
            out = self._logits[:size].reshape(rows, head.out_features)
            x = np.from_dlpack(hidden)  # (N, H)
            head.matmul_into(np.ascontiguousarray(x), out)
            return host_tensor(out)
        logits = head(hidden)
        return (
            logits.astype(paddle.float32) if logits.dtype != paddle.float32 else logits
        )


def _projection_calls(
    linear: Linear,
    x: tuple[paddle.Tensor, np.ndarray],  # (T, in) a step buffer, its host view
    out: tuple[paddle.Tensor, np.ndarray],  # (T, out) likewise
) -> list[kernels.Call]:
    """:func:`_project` as bound calls: a host-kernel Linear's own
    (``HostLinear.matmul_calls``), else the call of :func:`_project`."""
    if isinstance(linear, HostLinear):
        return linear.matmul_calls(x[1], out[1])
    return [(_project, (linear, x, out))]


def _project(
    linear: Linear,
    x: tuple[paddle.Tensor, np.ndarray],  # (T, in) a step buffer, its host view
    out: tuple[paddle.Tensor, np.ndarray],  # (T, out) likewise, written
) -> None:
    """``linear(x, out=out)``; a host-kernel Linear (quantized, packed)
    multiplies the buffers' host views instead (no DLPack a call)."""
    if isinstance(linear, HostLinear):
        linear.matmul_into(x[1], out[1])
    else:
        linear(x[0], out=out[0])


def _embedder(
    embed: paddle.Tensor | QuantizedEmbedding | PackedEmbedding,
) -> Callable[[np.ndarray, np.ndarray], object]:
    """:func:`embed_tokens` of ``(T,)`` host ids into a ``(T, H)`` float32
    host array: a quantized table's rows dequantized in place, another's
    copied."""
    from structllm.model.quantized import QuantizedEmbedding

    if isinstance(embed, QuantizedEmbedding):
        return embed.lookup_into

    def copy(ids: np.ndarray, out: np.ndarray) -> None:
        out[...] = np.from_dlpack(embed_tokens(embed, host_tensor(ids)))

    return copy


def embed_tokens(
    embed: paddle.Tensor | QuantizedEmbedding | PackedEmbedding, ids: paddle.Tensor
) -> paddle.Tensor:  # (T,) int64 -> (T, H)
    """The rows of ``ids`` from any kind of table (``ModelWeights.embed``)."""
    if isinstance(embed, paddle.Tensor):
        return paddle.nn.functional.embedding(ids, embed)
    return embed.lookup(ids)


def attention_inputs(
    c: ModelConfig,
    layer: DecoderLayerWeights,
    x: paddle.Tensor,  # (T, H) the residual stream
    cos: paddle.Tensor,  # (T, nh + kvh, d)
    sin: paddle.Tensor,
) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    """Norm, q/k/v projection, Qwen3's q/k norm and RoPE: ``q, k, v``.

    Written for eager and static graphs alike (no Python-side shapes).
    """
    nh, kvh, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    h = rms_norm(x, layer.input_norm, c.rms_norm_eps)
    qkv = layer.qkv(h)  # (T, q_size + 2 kv_size)
    if layer.qkv.bias is not None:
        qkv = qkv + layer.qkv.bias
    qk = qkv[:, : c.q_size + c.kv_size].reshape([-1, nh + kvh, d])
    if layer.q_norm is not None:
        # Qwen3: RMSNorm over each head's head_dim, q and k apart
        q = rms_norm(qk[:, :nh].reshape([-1, d]), layer.q_norm, c.rms_norm_eps)
        k = rms_norm(qk[:, nh:].reshape([-1, d]), layer.k_norm, c.rms_norm_eps)
        qk = paddle.concat([q.reshape([-1, nh, d]), k.reshape([-1, kvh, d])], axis=1)
    qk = _apply_rope(qk, cos, sin)  # (T, nh + kvh, d)
    v = qkv[:, c.q_size + c.kv_size :].reshape([-1, kvh, d])
    return qk[:, :nh], qk[:, nh:], v


def layer_output(
    c: ModelConfig,
    layer: DecoderLayerWeights,
    x: paddle.Tensor,  # (T, H) the residual stream
    attn: paddle.Tensor,  # (T, nh * d) attention output
    all_reduce: Callable[[paddle.Tensor], paddle.Tensor] | None = None,
) -> paddle.Tensor:  # (T, H)
    """o projection and the MLP block, each added to the residual stream.

    On a tensor-parallel rank ``all_reduce`` sums the row-parallel o and down
    projections' partial outputs; their biases are added after it, once.
    """
    x = x + _o_projection(layer, attn, all_reduce)
    h = rms_norm(x, layer.post_attention_norm, c.rms_norm_eps)
    return x + _mlp(layer, h, all_reduce)


def _o_projection(
    layer: DecoderLayerWeights,
    attn: paddle.Tensor,  # (T, nh * d)
    all_reduce: Callable[[paddle.Tensor], paddle.Tensor] | None,
) -> paddle.Tensor:  # (T, H)
    return _row_parallel(layer.o, attn, all_reduce)


def _mlp(
    layer: DecoderLayerWeights,
    h: paddle.Tensor,  # (T, H) normed
    all_reduce: Callable[[paddle.Tensor], paddle.Tensor] | None,
) -> paddle.Tensor:  # (T, H)
    return _row_parallel(layer.down, _swiglu(_gate_up(layer, h)), all_reduce)


def _mlp_kernels(
    layer: DecoderLayerWeights,
    h: paddle.Tensor,  # (T, H) normed, float32 on the host
    all_reduce: Callable[[paddle.Tensor], paddle.Tensor] | None,
) -> paddle.Tensor:  # (T, H)
    """:func:`_mlp` with SwiGLU by ``kernels.swiglu`` (eager only: the
    graph paths trace ``_mlp``)."""
    gate_up = _gate_up(layer, h)
    rows, width = gate_up.shape
    act = paddle.empty([rows, width // 2], "float32")  # (T, I)
    kernels.swiglu(np.from_dlpack(gate_up.contiguous()), np.from_dlpack(act))
    return _row_parallel(layer.down, act, all_reduce)


def _gate_up(
    layer: DecoderLayerWeights,
    h: paddle.Tensor,  # (T, H) normed
) -> paddle.Tensor:  # (T, 2 I)
    gate_up = layer.gate_up(h)
    if layer.gate_up.bias is not None:
        gate_up = gate_up + layer.gate_up.bias
    return gate_up


def _row_parallel(
    linear: Linear,
    x: paddle.Tensor,
    all_reduce: Callable[[paddle.Tensor], paddle.Tensor] | None,
) -> paddle.Tensor:
    """``linear(x)``: on a tensor-parallel rank its partial sums all-reduced
    first, and its bias added after, once."""
    out = linear(x)
    if all_reduce is not None:
        out = all_reduce(out)
    if linear.bias is not None:
        out = out + linear.bias
    return out


def rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    # the fused CPU kernel has no gradient: training takes the composite ops
    fused = _FUSED_RMS_NORM and x.stop_gradient and weight.stop_gradient
    if x.dtype == paddle.float32 and fused:
        # begin_norm_axis=1 for (T, H): normalise over H
        return _fused_rms_norm(x, weight, None, eps, 1)[0]
    xf = x.astype(paddle.float32)
    # sum / n, not mean: oneDNN prints a line to stdout for every reduce_mean
    xf = xf * paddle.rsqrt((xf * xf).sum(axis=-1, keepdim=True) / weight.shape[0] + eps)
    return xf.astype(x.dtype) * weight


def _apply_rope(
    x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor
) -> paddle.Tensor:
    """Rotate halves (HF layout): x = [x1 | x2] -> [x1 c - x2 s | x2 c + x1 s].

    With full-width tables ``cos = [c | c]`` and ``sin = [-s | s]`` that is
    ``x * cos + [x2 | x1] * sin``, and ``[x2 | x1]`` is ``x`` rolled by half
    a head: three elementwise ops and a roll, on tables of ``x``'s own shape
    (6-8x faster on CPU than slicing, concatenating and broadcasting the
    tables over the heads; docs/benchmarks.md).
    """
    if x.dtype != paddle.float32:
        cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    return x * cos + paddle.roll(x, x.shape[-1] // 2, axis=-1) * sin
