"""The decoder's dense work through Paddle Inference with oneDNN (CPU float32).

Paddle's eager CPU matmul goes through MKL, which on the AMD cores of the
machines this project runs on reaches about 20 GFLOP/s a core; the same
matmul inside a Paddle Inference predictor with oneDNN reaches 40-55, and a
whole MLP block runs 2.6x (16 tokens) to 3.5x (256 tokens) faster
(docs/benchmarks.md). So the decoder is cut at the paged attention:

    attention_inputs (norm, q/k/v projection, Qwen3 q/k norm, RoPE)
        -> PortableAttention over the paged KV cache (eager, unchanged)
        -> layer_output (o projection, MLP block, residuals)

and four programs cover the dense stretches: the first input half, the
work between two attentions (layer i's output half and layer i+1's input
half), the last output half, and the final norm with the LM head. Weights
are *inputs* of the programs, fed from the eager model's own tensors (each
:class:`~structllm.model.linear.DenseLinear`'s weight and bias; other kinds
of Linear are refused when the model is built) without a copy
(``share_external_data``): one copy of the weights, four traced
programs whatever the depth, L + 2 predictors and calls a step. Each use
site has its own predictor and is always fed the same weights: oneDNN keeps
what it derives from the weights of its first run (shared across layers, a
bias add read the first layer's weights). The programs run the very functions
the eager model runs (``attention_inputs``, ``layer_output`` in llama.py),
traced once per shape by ``paddle.jit.to_static``, and are checked against
them on the model's first layers when built.

A predictor call has a fixed cost (0.3 ms on a quiet machine, more on a
busy one), so a step of fewer than :data:`SMALL_STEP` tokens (a batch-1
decode) runs eager, where that cost does not exist.

Rows are padded to :func:`step_bucket` sizes (48 of them up to 2,048
tokens). oneDNN builds and caches its primitives per input shape (~1 MiB
a bucket whatever the model's width), and a server's steps come in every
size: unpadded, the cache was rebuilt on most steps and the allocator's
heap grew with the churn (docs/operations.md). Padded, the cache holds every
bucket (:data:`_ONEDNN_CACHE`) and never misses once a bucket has been seen.
Every program is row-wise (norms, projections, RoPE, the MLP), so padded rows
change no real row; they never reach the attention, which gets the real rows
only, and so never touch the KV cache.
"""

from __future__ import annotations

import atexit
import bisect
import math
import shutil
import tempfile
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from structllm.errors import ModelLoadError
from structllm.model._paddle import host_tensor, paddle
from structllm.model.attention import AttentionMetadata
from structllm.model.config import ModelConfig
from structllm.model.linear import Backend, DenseLinear, check_backend
from structllm.model.llama import (
    DecoderLayerWeights,
    LlamaForCausalLM,
    ModelWeights,
    attention_inputs,
    layer_output,
    rms_norm,
)

__all__ = [
    "BUCKETS",
    "SMALL_STEP",
    "CompiledLlamaForCausalLM",
    "inference_available",
    "step_bucket",
]

#: steps (and logits batches) with fewer tokens than this run eager
SMALL_STEP = 8


def _buckets(limit: int) -> tuple[int, ...]:
    """Even sizes to 32, multiples of 4 to 64, then steps of 2^(1/6) rounded
    up to 8, to ``limit``."""
    out = [*range(SMALL_STEP, 33, 2), *range(36, 65, 4)]
    while out[-1] < limit:
        out.append(max(out[-1] + 8, math.ceil(out[-1] * 2 ** (1 / 6) / 8) * 8))
    return tuple(out)


#: the row counts the predictors are run with: a step (or a logits batch) is
#: padded up to the next. 42 buckets up to 1,024 rows, 48 to 2,048, 60 to
#: 8,192. A decode batch gains at most 1 row up to 32 and 3 up to 64: on the
#: development machine oneDNN's projections cost by the row even then (9, 12
#: and 16 rows of a 1,024-wide model: 47, 50, 55 ms a step). A prefill step
#: gains at most 21% (73 -> 88 rows), 13.1% from 512 rows on (~6% on average
#: over sizes). Each bucket costs ~1 MiB of oneDNN primitives (~60 KiB more
#: per layer), cached once.
BUCKETS = _buckets(1 << 17)
#: oneDNN input shapes cached, over all the predictors of a thread (Paddle keys
#: its cache by the shapes of every input, weights included: first, mid, last
#: and head programs differ): enough for every bucket of each, so none is
#: evicted and rebuilt
_ONEDNN_CACHE = 4 * len(BUCKETS)


def step_bucket(rows: int) -> int:
    """The rows a predictor runs for ``rows`` (at least :data:`SMALL_STEP`)."""
    if rows > BUCKETS[-1]:
        return rows
    return BUCKETS[bisect.bisect_left(BUCKETS, rows)]


#: a layer's weights as program inputs: its tensors, and each projection's
#: weight (``qkv``, (in, out)) and bias (``qkv_bias``)
_NORMS = ("input_norm", "post_attention_norm", "q_norm", "k_norm")
_PROJECTIONS = ("qkv", "o", "gate_up", "down")
_LAYER_FIELDS = (*_NORMS, *_PROJECTIONS, *(p + "_bias" for p in _PROJECTIONS))

#: the weights each half of a layer reads (a program may take no unused input)
_IN_FIELDS = ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm")
_OUT_FIELDS = tuple(n for n in _LAYER_FIELDS if n not in _IN_FIELDS)

Feeds = Mapping[str, paddle.Tensor]


def _only(
    feeds: Feeds, *groups: tuple[str, tuple[str, ...]]
) -> dict[str, paddle.Tensor]:
    """The entries of ``feeds`` named ``prefix + field`` for the given groups."""
    names = {p + n for p, fields in groups for n in fields}
    return {n: t for n, t in feeds.items() if n in names}


def inference_available() -> bool:
    """Paddle Inference with oneDNN exists in this Paddle build (CPU)."""
    try:
        import paddle.inference
    except ImportError:  # pragma: no cover - every paddlepaddle wheel has it
        return False
    return bool(paddle.base.core.is_compiled_with_mkldnn())


class _Predictor:
    """One saved program's predictor; fed by input name."""

    def __init__(self, model_file: Path, num_threads: int) -> None:
        import paddle.inference as pi

        cfg = pi.Config(str(model_file), "")
        cfg.disable_gpu()
        cfg.enable_mkldnn()
        cfg.set_mkldnn_cache_capacity(_ONEDNN_CACHE)
        cfg.set_cpu_math_library_num_threads(num_threads)
        cfg.disable_glog_info()
        self._predictor = pi.create_predictor(cfg)
        #: inputs the program kept (unused weights are pruned by the tracer)
        self._inputs = {
            n: self._predictor.get_input_handle(n)
            for n in self._predictor.get_input_names()
        }
        self._outputs = [
            self._predictor.get_output_handle(n)
            for n in self._predictor.get_output_names()
        ]
        #: output i of the traced function is predictor output _order[i]
        self._order = list(range(len(self._outputs)))

    def run(self, feeds: Feeds) -> list[np.ndarray]:
        """The outputs, as the traced function orders them (fresh arrays)."""
        for name, handle in self._inputs.items():
            # zero-copy: the predictor reads the tensor's memory as laid out
            handle.share_external_data(feeds[name].contiguous())
        self._predictor.run()
        return [self._outputs[i].copy_to_cpu() for i in self._order]

    def __call__(self, feeds: Feeds) -> list[paddle.Tensor]:
        """The outputs, in memory Paddle allocated.

        Not zero-copy views of the arrays (``host_tensor``): the attention
        hands q back to Paddle as ``host_tensor(np.from_dlpack(q))``, and
        Paddle 3.3.1 never frees an array imported twice that way: one q was
        kept per layer and step, the engine's unbounded growth in
        docs/operations.md. The copy costs a fraction of the program's
        matmuls.
        """
        outs = []
        for array in self.run(feeds):
            out = paddle.empty(list(array.shape), "float32")
            np.from_dlpack(out)[...] = array
            outs.append(out)
        return outs

    def match(self, feeds: Feeds, expected: Sequence[np.ndarray]) -> float:
        """Order the outputs like ``expected`` (eager results); the worst difference."""
        self._order = list(range(len(self._outputs)))
        raw = self.run(feeds)
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


# traced and saved programs, by what they compute and the shapes they take
_SAVED: dict[tuple[Any, ...], Path] = {}
_LOCK = threading.Lock()
_DIR: Path | None = None


def _program_dir() -> Path:
    global _DIR
    if _DIR is None:
        _DIR = Path(tempfile.mkdtemp(prefix="structllm-programs-"))
        atexit.register(shutil.rmtree, _DIR, ignore_errors=True)
    return _DIR


def _layer_feeds(layer: DecoderLayerWeights, prefix: str) -> dict[str, paddle.Tensor]:
    """The layer's weights by input name (its Linears dense: checked)."""
    feeds = {prefix + n: getattr(layer, n) for n in _NORMS}
    for n in _PROJECTIONS:
        linear = getattr(layer, n)
        assert isinstance(linear, DenseLinear)
        feeds[prefix + n] = linear.in_out_weight()
        feeds[prefix + n + "_bias"] = linear.bias
    return {n: t.contiguous() for n, t in feeds.items() if t is not None}


def _as_layer(w: Mapping[str, paddle.Tensor], prefix: str) -> DecoderLayerWeights:
    """A layer over a program's weight inputs (a half-layer program has only
    its half's: the others are None, and never read)."""
    fields: dict[str, Any] = {n: w.get(prefix + n) for n in _NORMS}
    for n in _PROJECTIONS:
        weight = w.get(prefix + n)
        bias = w.get(prefix + n + "_bias")
        fields[n] = None if weight is None else DenseLinear(weight, bias)
    return DecoderLayerWeights(**fields)


class CompiledLlamaForCausalLM(LlamaForCausalLM):
    """:class:`LlamaForCausalLM` with its dense work in oneDNN predictors.

    ``forward`` returns the residual stream before the final norm;
    ``compute_logits`` applies the norm and the head (both row-wise, so the
    rows to sample may be picked in between).
    """

    backend: ClassVar[Backend] = "inference"

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
        check_backend(weights.linears(), "inference")
        super().__init__(
            config, weights, block_size=block_size, max_model_len=max_model_len
        )
        c = config
        self._layer_feeds = [_layer_feeds(layer, "") for layer in weights.layers]
        self._mid_feeds = [
            {**_layer_feeds(a, "a_"), **_layer_feeds(b, "b_")}
            for a, b in zip(weights.layers, weights.layers[1:], strict=False)
        ]
        assert isinstance(weights.lm_head, DenseLinear)
        head = weights.lm_head.in_out_weight()  # (H, V)
        self._head_feeds = {"norm": weights.norm, "head": head}

        def first(acts: list[Any], w: Feeds) -> Any:
            x, cos, sin = acts
            return attention_inputs(c, _as_layer(w, ""), x, cos, sin)

        def mid(acts: list[Any], w: Feeds) -> Any:
            x, attn, cos, sin = acts
            x = layer_output(c, _as_layer(w, "a_"), x, attn)
            return (x, *attention_inputs(c, _as_layer(w, "b_"), x, cos, sin))

        def last(acts: list[Any], w: Feeds) -> Any:
            x, attn = acts
            return layer_output(c, _as_layer(w, ""), x, attn)

        def head_fn(acts: list[Any], w: Feeds) -> Any:
            return paddle.matmul(
                rms_norm(acts[0], w["norm"], c.rms_norm_eps), w["head"]
            )

        # a probe through the model's first layers checks every program
        rng = np.random.default_rng(0)
        x = paddle.to_tensor(
            rng.standard_normal((SMALL_STEP, c.hidden_size)), "float32"
        )
        attn = paddle.to_tensor(rng.standard_normal((SMALL_STEP, c.q_size)), "float32")
        cos, sin = self.rope_tables(paddle.arange(SMALL_STEP))
        acts = {"x": x, "attn": attn, "cos": cos.contiguous(), "sin": sin.contiguous()}
        h = [None, c.hidden_size]
        d = [None, c.num_attention_heads + c.num_key_value_heads, c.head_dim]
        shapes = {"x": h, "attn": [None, c.q_size], "cos": d, "sin": d}
        build = self._build
        with _LOCK:
            self._first = build(
                "first",
                c,
                first,
                ("x", "cos", "sin"),
                shapes,
                acts,
                _only(self._layer_feeds[0], ("", _IN_FIELDS)),
                num_threads,
            )
            # one predictor per pair of layers, all from one traced program:
            # oneDNN keeps what it derived from the first weights it was fed
            # (a bias add read stale weights when one predictor served all)
            self._mid = [
                build(
                    "mid",
                    c,
                    mid,
                    ("x", "attn", "cos", "sin"),
                    shapes,
                    acts,
                    _only(feeds, ("a_", _OUT_FIELDS), ("b_", _IN_FIELDS)),
                    num_threads,
                )
                for feeds in self._mid_feeds
            ]
            self._last = build(
                "last",
                c,
                last,
                ("x", "attn"),
                shapes,
                acts,
                _only(self._layer_feeds[-1], ("", _OUT_FIELDS)),
                num_threads,
            )
            self._head = build(
                "head", c, head_fn, ("x",), shapes, acts, self._head_feeds, num_threads
            )
        self._num_layers = len(weights.layers)

    @staticmethod
    def _build(
        kind: str,
        config: ModelConfig,
        fn: Callable[[list[Any], Feeds], Any],
        act_names: tuple[str, ...],
        shapes: Mapping[str, list[int | None]],
        acts: Mapping[str, paddle.Tensor],
        weights: Mapping[str, paddle.Tensor],
        num_threads: int,
    ) -> _Predictor:
        spec = paddle.static.InputSpec
        key = (
            kind,
            config,
            tuple(sorted((n, tuple(t.shape)) for n, t in weights.items())),
        )
        path = _SAVED.get(key)
        if path is None:
            act_spec = [spec(shapes[n], "float32", name=n) for n in act_names]
            w_spec = {
                n: spec(list(t.shape), "float32", name=n) for n, t in weights.items()
            }
            traced = paddle.jit.to_static(
                fn, input_spec=[act_spec, w_spec], full_graph=True
            )
            path = _program_dir() / f"{kind}{len(_SAVED)}"
            with warnings.catch_warnings():
                # "what you save is a function": yes, on purpose
                warnings.simplefilter("ignore", UserWarning)
                paddle.jit.save(traced, str(path))
            _SAVED[key] = path
        predictor = _Predictor(path.with_suffix(".json"), num_threads)
        expected = fn([acts[n] for n in act_names], weights)
        expected = expected if isinstance(expected, tuple) else (expected,)
        worst = predictor.match({**acts, **weights}, [e.numpy() for e in expected])
        if not worst < 1e-3:
            raise ModelLoadError(
                f"the oneDNN program {kind} differs from the eager model by {worst:.2e}"
            )
        return predictor

    def forward(
        self,
        input_ids: paddle.Tensor,  # (T,) int64
        positions: paddle.Tensor,  # (T,) int64
        kv_caches: Sequence[tuple[paddle.Tensor, paddle.Tensor]],
        meta: AttentionMetadata,
    ) -> paddle.Tensor:  # (T, H), before the final norm
        t = input_ids.shape[0]
        if t < SMALL_STEP:
            return self.residual_stream(input_ids, positions, kv_caches, meta)
        self.checked_positions(positions)
        # the programs run on b rows: the step's, then token 0 at position 0
        b = step_bucket(t)
        cos, sin = self.rope_tables(_padded(positions, b))
        acts = {"cos": cos.contiguous(), "sin": sin.contiguous()}
        acts["x"] = paddle.nn.functional.embedding(
            _padded(input_ids, b), self.weights.embed
        )  # (b, H)
        q, k, v = self._first({**acts, **self._layer_feeds[0]})
        for i in range(self._num_layers):
            k_cache, v_cache = kv_caches[i]
            # the real rows only: padded ones write no KV slot
            attn = self.attention.forward(
                q[:t], k[:t], v[:t], k_cache, v_cache, meta, self._windows[i]
            )  # (T, nh * d)
            acts["attn"] = _padded(attn, b)
            if i + 1 < self._num_layers:
                acts["x"], q, k, v = self._mid[i]({**acts, **self._mid_feeds[i]})
            else:
                (acts["x"],) = self._last({**acts, **self._layer_feeds[i]})
        return acts["x"][:t]

    def compute_logits(self, hidden: paddle.Tensor) -> paddle.Tensor:  # (N, V)
        n = hidden.shape[0]
        if n < SMALL_STEP:
            normed = rms_norm(hidden, self.weights.norm, self.config.rms_norm_eps)
            return super().compute_logits(normed)
        feeds = {"x": _padded(hidden, step_bucket(n)), **self._head_feeds}
        # read as numpy (never imported again): a view of the real rows
        return host_tensor(self._head.run(feeds)[0][:n])

    def warm_up(self, max_rows: int) -> int:
        """Run every program once on each bucket up to ``max_rows`` rows (the
        engine's ``max_num_batched_tokens``), so that no step builds oneDNN
        primitives; returns how many buckets. Costs about 9x the dense work
        of one ``max_rows`` step (the buckets grow geometrically), and ~1 MiB
        a bucket (docs/operations.md)."""
        c = self.config
        sizes = [b for b in BUCKETS if b < max_rows]
        sizes.append(step_bucket(max(max_rows, SMALL_STEP)))
        for b in sizes:
            x = paddle.zeros([b, c.hidden_size], "float32")
            cos, sin = self.rope_tables(paddle.zeros([b], "int64"))
            acts = {
                "x": x,
                "attn": paddle.zeros([b, c.q_size], "float32"),
                "cos": cos.contiguous(),
                "sin": sin.contiguous(),
            }
            self._first({**acts, **self._layer_feeds[0]})
            for i, feeds in enumerate(self._mid_feeds):
                self._mid[i]({**acts, **feeds})
            self._last({**acts, **self._layer_feeds[-1]})
            self._head.run({"x": x, **self._head_feeds})
        return len(sizes)


def _padded(t: paddle.Tensor, rows: int) -> paddle.Tensor:
    """``t`` with zero rows appended up to ``rows`` (itself if it has them)."""
    n = t.shape[0]
    if n == rows:
        return t
    pad = paddle.zeros([rows - n, *t.shape[1:]], t.dtype)
    return paddle.concat([t, pad], axis=0)
