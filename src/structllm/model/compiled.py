"""The decoder's dense work through Paddle Inference with oneDNN (CPU float32).

Paddle's eager CPU matmul goes through MKL, which on the AMD cores of the
machines this project runs on reaches about 20 GFLOP/s a core; the same
matmul inside a Paddle Inference predictor with oneDNN reaches 40-55, and a
whole MLP block runs 2.6x (16 tokens) to 3.5x (256 tokens) faster
(docs/benchmarks.md). So each decoder layer is split at the attention:

    attention_inputs (norm, q/k/v projection, Qwen3 q/k norm, RoPE)
        -> PortableAttention over the paged KV cache (eager, unchanged)
        -> layer_output (o projection, MLP block, residuals)

and the dense work between two attentions (layer i's output half and layer
i+1's input half), the first input half, the last output half, and the
final norm and LM head each become a predictor holding those weights:
L + 2 predictor calls a step for L layers (each call costs ~0.3-1 ms of
fixed overhead, so fewer and larger is better). They run the very functions the
eager model runs (``attention_inputs``, ``layer_output`` in llama.py),
traced once by ``paddle.jit.to_static``; every predictor is checked against
the eager function on a random input when it is built.

Tensors cross into a predictor without a copy (``share_external_data``)
and come back as numpy arrays wrapped by DLPack.
"""

from __future__ import annotations

import functools
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from structllm.errors import ModelLoadError
from structllm.model._paddle import paddle
from structllm.model.attention import AttentionMetadata
from structllm.model.config import ModelConfig
from structllm.model.llama import (
    DecoderLayerWeights,
    LlamaForCausalLM,
    ModelWeights,
    _rms_norm,
    attention_inputs,
    layer_output,
)

__all__ = ["CompiledLlamaForCausalLM", "inference_available"]

#: oneDNN primitives cached per predictor, one per input shape seen
_ONEDNN_CACHE = 64
_LAYER_FIELDS = (
    "input_norm",
    "qkv",
    "qkv_bias",
    "o",
    "post_attention_norm",
    "gate_up",
    "down",
    "o_bias",
    "gate_up_bias",
    "down_bias",
    "q_norm",
    "k_norm",
)


def inference_available() -> bool:
    """Paddle Inference with oneDNN exists in this Paddle build (CPU)."""
    try:
        import paddle.inference
    except ImportError:  # pragma: no cover - every paddlepaddle wheel has it
        return False
    return bool(paddle.base.core.is_compiled_with_mkldnn())


class _Program(paddle.nn.Layer):  # type: ignore[misc]
    """Parameters shaped like one layer's weights, and a function over them."""

    def __init__(self, fn: Callable[..., Any], weights: dict[str, paddle.Tensor]):
        super().__init__()
        self._fn = fn
        self._names = sorted(weights)
        for name, value in weights.items():
            param = self.create_parameter(
                list(value.shape),
                dtype="float32",
                default_initializer=paddle.nn.initializer.Constant(0.0),
            )
            self.add_parameter(name, param)

    def load(self, weights: dict[str, paddle.Tensor]) -> None:
        for name in self._names:
            getattr(self, name).set_value(weights[name])

    def forward(
        self, in0: paddle.Tensor, in1: Any = None, in2: Any = None, in3: Any = None
    ) -> Any:
        # explicit arguments: to_static matches them with the input specs
        inputs = [t for t in (in0, in1, in2, in3) if t is not None]
        return self._fn({n: getattr(self, n) for n in self._names}, *inputs)


class _Predictor:
    """One saved program's predictor, with its handles in a fixed order."""

    def __init__(self, directory: Path, name: str, num_threads: int) -> None:
        import paddle.inference as pi

        cfg = pi.Config(
            str(directory / f"{name}.json"), str(directory / f"{name}.pdiparams")
        )
        cfg.disable_gpu()
        cfg.enable_mkldnn()
        cfg.set_mkldnn_cache_capacity(_ONEDNN_CACHE)
        cfg.set_cpu_math_library_num_threads(num_threads)
        cfg.disable_glog_info()
        self._predictor = pi.create_predictor(cfg)
        self._inputs = [
            self._predictor.get_input_handle(n)
            for n in self._predictor.get_input_names()
        ]
        self._outputs = [
            self._predictor.get_output_handle(n)
            for n in self._predictor.get_output_names()
        ]
        #: output i of the traced function is predictor output _order[i]
        self._order = list(range(len(self._outputs)))

    def __call__(self, *inputs: paddle.Tensor) -> list[paddle.Tensor]:
        for handle, tensor in zip(self._inputs, inputs, strict=True):
            handle.share_external_data(tensor.contiguous())
        self._predictor.run()
        return [paddle.from_dlpack(self._outputs[i].copy_to_cpu()) for i in self._order]

    def match(
        self, inputs: Sequence[paddle.Tensor], expected: Sequence[np.ndarray]
    ) -> float:
        """Order the outputs like ``expected`` (eager results); return the worst difference."""
        self._order = list(range(len(self._outputs)))
        raw = [g.numpy() for g in self(*inputs)]
        self._order = []
        worst = 0.0
        free = list(range(len(raw)))
        for want in expected:
            diffs = [
                float(np.abs(raw[j] - want).max())
                if raw[j].shape == want.shape
                else np.inf
                for j in free
            ]
            j = free.pop(int(np.argmin(diffs)))
            self._order.append(j)
            worst = max(worst, min(diffs))
        return worst


# traced programs, reused for every layer and model of the same shapes
_TRACED: dict[tuple[Any, ...], _Program] = {}
_LOCK = threading.Lock()


def _weights(layer: DecoderLayerWeights) -> dict[str, paddle.Tensor]:
    return {
        n: getattr(layer, n) for n in _LAYER_FIELDS if getattr(layer, n) is not None
    }


def _as_layer(w: dict[str, paddle.Tensor]) -> DecoderLayerWeights:
    return DecoderLayerWeights(**{n: w.get(n) for n in _LAYER_FIELDS})


class CompiledLlamaForCausalLM(LlamaForCausalLM):
    """:class:`LlamaForCausalLM` with its dense halves in oneDNN predictors.

    ``forward`` returns the residual stream before the final norm;
    ``compute_logits`` applies the norm and the head (both row-wise, so the
    rows to sample may be picked in between).
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        *,
        block_size: int,
        max_model_len: int,
        num_threads: int = 1,
    ) -> None:
        if weights.embed.dtype != paddle.float32:
            raise ModelLoadError("the inference backend runs float32 only")
        super().__init__(
            config, weights, block_size=block_size, max_model_len=max_model_len
        )
        c = config
        h, d = c.hidden_size, c.head_dim
        rng = np.random.default_rng(0)
        x = paddle.to_tensor(rng.standard_normal((3, h)).astype(np.float32))
        cos = self._cos[:3].unsqueeze(1)
        sin = self._sin[:3].unsqueeze(1)
        attn = paddle.to_tensor(rng.standard_normal((3, c.q_size)).astype(np.float32))

        def inputs_fn(w: dict[str, paddle.Tensor], x: Any, cos: Any, sin: Any) -> Any:
            return attention_inputs(c, _as_layer(w), x, cos, sin)

        def output_fn(w: dict[str, paddle.Tensor], x: Any, attn: Any) -> Any:
            return layer_output(c, _as_layer(w), x, attn)

        head_w = {"norm": weights.norm}
        head_w["head"] = (
            weights.embed.transpose([1, 0]).contiguous()
            if weights.lm_head is None
            else weights.lm_head
        )

        def head_fn(w: dict[str, paddle.Tensor], x: Any) -> Any:
            return paddle.matmul(_rms_norm(x, w["norm"], c.rms_norm_eps), w["head"])

        def mid_fn(
            w: dict[str, paddle.Tensor], x: Any, attn: Any, cos: Any, sin: Any
        ) -> Any:
            # layer i's output half, then layer i+1's input half: one call
            a = {n[2:]: t for n, t in w.items() if n.startswith("a_")}
            b = {n[2:]: t for n, t in w.items() if n.startswith("b_")}
            x = layer_output(c, _as_layer(a), x, attn)
            return (x, *attention_inputs(c, _as_layer(b), x, cos, sin))

        def specs(*shapes: list[int | None]) -> list[Any]:
            # a fresh InputSpec per argument: to_static names them in place
            return [paddle.static.InputSpec(s, "float32") for s in shapes]

        xs, rope, attn_s = [None, h], [None, 1, d], [None, c.q_size]
        layers = [_weights(layer) for layer in weights.layers]
        fields = tuple(sorted(layers[0]))
        with tempfile.TemporaryDirectory(prefix="structllm-") as tmp, _LOCK:
            directory = Path(tmp)
            build = functools.partial(self._build, directory, num_threads=num_threads)
            self._first = build(
                "first",
                ("first", c, fields),
                inputs_fn,
                layers[0],
                specs(xs, rope, rope),
                (x, cos, sin),
            )
            self._mid = [
                build(
                    f"mid{i}",
                    ("mid", c, fields),
                    mid_fn,
                    {
                        **{"a_" + n: t for n, t in layers[i].items()},
                        **{"b_" + n: t for n, t in layers[i + 1].items()},
                    },
                    specs(xs, attn_s, rope, rope),
                    (x, attn, cos, sin),
                )
                for i in range(len(layers) - 1)
            ]
            self._last = build(
                "last",
                ("last", c, fields),
                output_fn,
                layers[-1],
                specs(xs, attn_s),
                (x, attn),
            )
            self._head = build("head", ("head", c), head_fn, head_w, specs(xs), (x,))
        # the predictors hold the layer weights now; keep the embedding only
        self.weights = ModelWeights(
            embed=weights.embed, layers=[], norm=weights.norm, lm_head=None
        )
        self._num_layers = len(layers)

    @staticmethod
    def _build(
        directory: Path,
        name: str,
        key: tuple[Any, ...],
        fn: Callable[..., Any],
        weights: dict[str, paddle.Tensor],
        spec: list[Any],
        probe: tuple[paddle.Tensor, ...],
        *,
        num_threads: int,
    ) -> _Predictor:
        traced = _TRACED.get(key)
        if traced is None:
            program = _Program(fn, weights)
            program.eval()
            traced = paddle.jit.to_static(program, input_spec=spec, full_graph=True)
            _TRACED[key] = traced
        traced.load(weights)
        paddle.jit.save(traced, str(directory / name))
        predictor = _Predictor(directory, name, num_threads)
        expected = fn(weights, *probe)
        expected = expected if isinstance(expected, tuple) else (expected,)
        worst = predictor.match(probe, [e.numpy() for e in expected])
        if not worst < 1e-3:
            raise ModelLoadError(
                f"the oneDNN program {name} differs from the eager model by {worst:.2e}"
            )
        return predictor

    def forward(
        self,
        input_ids: paddle.Tensor,  # (T,) int64
        positions: paddle.Tensor,  # (T,) int64
        kv_caches: Sequence[tuple[paddle.Tensor, paddle.Tensor]],
        meta: AttentionMetadata,
    ) -> paddle.Tensor:  # (T, H), before the final norm
        cos, sin = self.rope_tables(positions)
        x = paddle.nn.functional.embedding(input_ids, self.weights.embed)  # (T, H)
        q, k, v = self._first(x, cos, sin)
        for i in range(self._num_layers):
            k_cache, v_cache = kv_caches[i]
            attn = self.attention.forward(
                q, k, v, k_cache, v_cache, meta, self._windows[i]
            )  # (T, nh * d)
            if i + 1 < self._num_layers:
                x, q, k, v = self._mid[i](x, attn, cos, sin)
            else:
                (x,) = self._last(x, attn)
        return x

    def compute_logits(self, hidden: paddle.Tensor) -> paddle.Tensor:  # (N, V)
        (logits,) = self._head(hidden)
        return logits
