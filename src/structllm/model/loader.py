"""Load a Llama-family checkpoint (HF layout) into a :class:`LlamaForCausalLM`.

Sources: a directory with ``config.json`` and ``model.safetensors`` (or shards
listed in ``model.safetensors.index.json``); a GGUF file (llama.cpp's format:
config from its metadata, weights dequantized to float32 by
:mod:`structllm.model.gguf_loader`); ``load_format="dummy"`` for
random weights from the directory's config alone; the built-in names of
:mod:`structllm.models` (``"tiny-random"`` needs no files at all).

Progress is reported as :class:`LoadProgress` events to a callback, one per
tensor read, so callers can draw a bar; nothing is printed here.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import attrs
import numpy as np

from structllm.errors import EngineConfigError, ModelLoadError
from structllm.model import kernels
from structllm.model._paddle import cpu_vendor, paddle
from structllm.model.config import ModelConfig
from structllm.model.linear import (
    ColumnParallelLoader,
    DenseLinear,
    Linear,
    LinearLoader,
    RowParallelLoader,
    unsupported,
)
from structllm.model.llama import (
    LAYER_PROJECTIONS,
    DecoderLayerWeights,
    LlamaForCausalLM,
    ModelWeights,
)
from structllm.model.packed import pack_linears
from structllm.model.protocol import CausalLM
from structllm.model.quantized import QuantizedEmbedding
from structllm.models import resolve_model

if TYPE_CHECKING:
    from structllm.formats.gguf import GGUFFile

__all__ = [
    "LoadProgress",
    "LoadedModel",
    "build_model",
    "fuse_weights",
    "hf_tensor_shapes",
    "load_model",
    "projection_loaders",
    "random_hf_tensors",
    "read_safetensors",
    "resolve_backend",
    "resolve_dtype",
]

#: ``model_backend="auto"`` uses oneDNN predictors from this size up (where
#: the compiled kernels cannot run)
AUTO_INFERENCE_MIN_PARAMETERS = 10_000_000

LoadFormat = Literal["auto", "safetensors", "gguf", "dummy"]


@attrs.frozen
class LoadProgress:
    """``done`` of ``total`` units of ``stage`` finished."""

    stage: str
    done: int
    total: int


@attrs.frozen
class LoadedModel:
    config: ModelConfig
    model: CausalLM
    #: the checkpoint directory; None for the built-in "tiny-random"
    path: Path | None


def hf_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint must hold, HF names and ``(out, in)`` shapes."""
    c = config
    h, i = c.hidden_size, c.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, h)
    }
    for n in range(c.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (c.q_size, h)
        shapes[p + "self_attn.k_proj.weight"] = (c.kv_size, h)
        shapes[p + "self_attn.v_proj.weight"] = (c.kv_size, h)
        if c.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (c.q_size,)
            shapes[p + "self_attn.k_proj.bias"] = (c.kv_size,)
            shapes[p + "self_attn.v_proj.bias"] = (c.kv_size,)
        if c.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (c.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (c.head_dim,)
        shapes[p + "self_attn.o_proj.weight"] = (h, c.q_size)
        if c.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
        if c.mlp_bias:
            shapes[p + "mlp.gate_proj.bias"] = (i,)
            shapes[p + "mlp.up_proj.bias"] = (i,)
            shapes[p + "mlp.down_proj.bias"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    return shapes


def projection_loaders(
    config: ModelConfig,
    *,
    q_heads: range | None = None,
    kv_heads: range | None = None,
    intermediate: range | None = None,
) -> dict[str, LinearLoader]:
    """Every projection's loader, by module name (``build_model``'s
    ``linears`` keys: ``model.layers.N.self_attn.qkv_proj``, ``...o_proj``,
    ``model.layers.N.mlp.gate_up_proj``, ``...down_proj``, and ``lm_head``
    unless the head is tied), for a tensor-parallel rank that keeps
    ``q_heads``, ``kv_heads`` and ``intermediate`` columns (by default all:
    the whole model)."""
    c, d = config, config.head_dim
    q_heads = q_heads or range(c.num_attention_heads)
    kv_heads = kv_heads or range(c.num_key_value_heads)
    i = intermediate or range(c.intermediate_size)
    q = range(q_heads.start * d, q_heads.stop * d)  # rows of q_proj
    kv = range(kv_heads.start * d, kv_heads.stop * d)  # rows of k_proj, v_proj
    out: dict[str, LinearLoader] = {}
    for n in range(c.num_hidden_layers):
        p = f"model.layers.{n}."
        a, m = p + "self_attn.", p + "mlp."
        loaders = {
            "qkv": ColumnParallelLoader(
                (a + "q_proj", a + "k_proj", a + "v_proj"),
                has_bias=c.qkv_bias,
                rows=(q, kv, kv),
            ),
            "o": RowParallelLoader((a + "o_proj",), has_bias=c.o_bias, columns=q),
            "gate_up": ColumnParallelLoader(
                (m + "gate_proj", m + "up_proj"), has_bias=c.mlp_bias, rows=(i, i)
            ),
            "down": RowParallelLoader(
                (m + "down_proj",), has_bias=c.mlp_bias, columns=i
            ),
        }
        for field, module in LAYER_PROJECTIONS.items():
            out[p + module] = loaders[field]
    if not c.tie_word_embeddings:
        out["lm_head"] = LinearLoader(("lm_head",))
    return out


def random_hf_tensors(
    config: ModelConfig, seed: int = 0
) -> Iterator[tuple[str, np.ndarray]]:
    """Random float32 weights in HF layout, deterministic in ``seed``.

    Scaled so that attention and MLP outputs outweigh the token embedding in
    the residual stream (else a tied head just echoes the input token) and
    logits are well separated (near-ties make greedy comparisons fragile).
    """
    rng = np.random.default_rng(seed)
    for name, shape in hf_tensor_shapes(config).items():
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            t = 1.0 + 0.3 * rng.standard_normal(shape)
        elif name.endswith("norm.weight"):
            t = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            t = 0.1 * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight":
            t = rng.standard_normal(shape)
        elif name == "lm_head.weight":
            t = 8.0 * rng.standard_normal(shape) / np.sqrt(shape[-1])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            t = 3.0 * rng.standard_normal(shape) / np.sqrt(shape[-1])
        else:
            t = rng.standard_normal(shape) / np.sqrt(shape[-1])
        yield name, t.astype(np.float32)


def resolve_dtype(dtype: str, config: ModelConfig) -> str:
    """The compute dtype for ``dtype`` ("auto" = float32 on CPU, else the checkpoint's)."""
    on_cpu = not paddle.is_compiled_with_cuda() or paddle.get_device() == "cpu"
    if dtype == "auto":
        return (
            "float32"
            if on_cpu
            else config.checkpoint_dtype.replace("float64", "float32")
        )
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ModelLoadError(
            f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}"
        )
    if on_cpu and dtype != "float32":
        raise ModelLoadError(
            f"dtype {dtype} needs a GPU: Paddle has no CPU {dtype} matmul kernel; "
            "use dtype='float32' (half-precision checkpoints are converted on load)"
        )
    return dtype


def load_model(
    model: str | Path,
    *,
    dtype: str = "auto",
    load_format: LoadFormat = "auto",
    block_size: int = 16,
    max_model_len: int | None = None,
    seed: int = 0,
    on_progress: Callable[[LoadProgress], None] | None = None,
    backend: str = "auto",
    num_threads: int | None = None,
    quantization: str = "auto",
    quantized_activations: str = "float",
) -> LoadedModel:
    """Load ``model`` (any reference ``structllm.models.resolve_model`` takes)
    ready to run.

    ``quantization``: ``auto`` keeps a GGUF file's projections in their
    blocks (:class:`~structllm.model.quantized.QuantizedLinear`) and a
    float checkpoint's in float; ``none`` dequantizes a GGUF file to
    float32; ``q8_0``, ``q4_0``, ``q4_1``, ``q4_k`` quantize a float
    checkpoint's projections at load, as llama.cpp's ``llama-quantize``
    would (``model/quantize.py``; the embedding lookup, norms and biases
    stay float32): ``q4_k`` is its Q4_K_M mix, Q6_K for the head and for
    ``v_proj`` and ``down_proj`` in the first and last eighth of the layers
    and every third between, Q4_K elsewhere, Q5_0 / Q8_0 where a row is not
    whole 256-value super-blocks (``quantize.tensor_type``).
    ``quantized_activations``: how the quantized projections take their
    input, ``float`` (the float product) or ``q8`` (quantized to 8 bits
    first, as llama.cpp does: faster, llama.cpp's results); ``q8`` needs
    quantized weights. The quantized kernels are compiled (or loaded from
    numba's cache) here, before the first step.
    """
    path = resolve_model(model)
    if path is None:
        load_format = "dummy"
    gguf = path is not None and path.is_file()
    # a GGUF file is opened once for its config and its weights
    with _open_gguf(path) as f:
        config = (
            ModelConfig.from_path(path) if f is None else ModelConfig.from_gguf_file(f)
        )
        compute_dtype = resolve_dtype(dtype, config)
        quantize = check_quantization(quantization, gguf=gguf, dtype=compute_dtype)
        shapes = hf_tensor_shapes(config)
        total = len(shapes)

        def report(done: int) -> None:
            if on_progress is not None:
                on_progress(LoadProgress("weights", done, total))

        tensors: dict[str, paddle.Tensor | np.ndarray] = {}
        linears: dict[str, Linear] = {}
        report(0)
        if load_format == "dummy":
            for n, (name, array) in enumerate(random_hf_tensors(config, seed), 1):
                tensors[name] = array
                report(n)
        elif f is not None and load_format in ("auto", "gguf"):
            from structllm.model.gguf_loader import (
                read_gguf_quantized,
                read_gguf_tensors,
            )

            if quantization == "auto":
                tensors, linears = read_gguf_quantized(f, config, shapes)
                report(total)
            else:
                for n, (name, array) in enumerate(
                    read_gguf_tensors(f, config, shapes), 1
                ):
                    tensors[name] = array
                    report(n)
        elif not gguf and load_format in ("auto", "safetensors"):
            assert path is not None
            for n, (name, tensor) in enumerate(read_safetensors(path, shapes), 1):
                tensors[name] = tensor
                report(n)
        else:
            raise ModelLoadError(
                f"load_format {load_format!r} does not read {path}: auto, "
                "safetensors (a directory), gguf (a .gguf file) or dummy"
            )
    if quantize is not None:
        from structllm.model.quantize import quantize_projections

        linears = quantize_projections(config, tensors, quantize)
    llm = build_model(
        config,
        tensors,
        dtype=compute_dtype,
        block_size=block_size,
        max_model_len=max_model_len,
        backend=backend,
        num_threads=num_threads,
        linears=linears,
    )
    pack_linears(llm)
    if linears:
        from structllm.model import quantized

        quantized.set_activations(linears.items(), quantized_activations)
        quantized.warm_up(linears.items())
    elif quantized_activations != "float":
        raise EngineConfigError(
            f"quantized_activations={quantized_activations!r}: a float model "
            "takes float activations (q8 needs quantized weights: a GGUF "
            "file, or quantization=q8_0/q4_0/q4_1/q4_k)",
            field="quantized_activations",
        )
    return LoadedModel(config=config, model=llm, path=path)


def _open_gguf(path: Path | None) -> contextlib.AbstractContextManager[GGUFFile | None]:
    """The GGUF file at ``path``, open; None for a directory or no files."""
    if path is None or not path.is_file():
        return contextlib.nullcontext()
    from structllm.formats.gguf import GGUFFile

    return GGUFFile.open(path)


#: ``quantization`` values that quantize a float checkpoint at load
QUANTIZE_AT_LOAD = ("q8_0", "q4_0", "q4_1", "q4_k")


def check_quantization(quantization: str, *, gguf: bool, dtype: str) -> str | None:
    """The GGML type name to quantize a float checkpoint to, or None; refuses
    (:class:`EngineConfigError` on ``quantization``) what cannot be done."""
    choices = ("auto", "none", *QUANTIZE_AT_LOAD)
    if quantization not in choices:
        raise EngineConfigError(
            f"quantization must be one of {', '.join(choices)}, not {quantization!r}",
            field="quantization",
        )
    if quantization in ("auto", "none"):
        return None
    if gguf:
        raise EngineConfigError(
            f"quantization={quantization} quantizes a float checkpoint at load; a "
            "GGUF file's weights are already quantized (auto keeps them, none "
            "dequantizes them)",
            field="quantization",
        )
    if dtype != "float32":
        raise EngineConfigError(
            f"quantization={quantization} runs on the CPU kernels (float32 "
            f"activations), not with dtype {dtype}",
            field="quantization",
        )
    return quantization.upper()


def build_model(
    config: ModelConfig,
    tensors: Mapping[str, paddle.Tensor | np.ndarray],
    *,
    dtype: str = "float32",
    block_size: int = 16,
    max_model_len: int | None = None,
    backend: str = "eager",
    num_threads: int | None = None,
    linears: Mapping[str, Linear] | None = None,
) -> LlamaForCausalLM:
    """A model from HF-named tensors (consumed; HF ``(out, in)`` layout; numpy
    or Paddle, any float dtype: cast to ``dtype``).

    ``linears`` supplies projections already built (a quantized format's
    :class:`Linear`, with its own bias), by the module names of
    :func:`projection_loaders` (``model.layers.0.self_attn.qkv_proj``:
    q, k and v fused along the output; ``lm_head``, which a tied model may
    supply too); ``tensors`` then lacks that projection's HF pieces. A
    backend that cannot run one refuses it here (``"auto"`` picks one that
    can). Tensors the model does not use are refused.
    """
    t = {
        n: x
        if isinstance(x, (paddle.Tensor, QuantizedEmbedding))
        else paddle.to_tensor(x)
        for n, x in tensors.items()
    }
    weights = fuse_weights(config, t, dtype, linears)
    limit = config.max_context_len
    max_len = min(max_model_len or limit, limit)
    resolved = resolve_backend(backend, dtype, config)
    if backend == "auto" and unsupported(weights.linears(), "inference"):
        resolved = "eager"
    if resolved == "inference":
        from structllm.model.compiled import CompiledLlamaForCausalLM

        return CompiledLlamaForCausalLM(
            config,
            weights,
            block_size=block_size,
            max_model_len=max_len,
            num_threads=num_threads or 1,
        )
    return LlamaForCausalLM(
        config, weights, block_size=block_size, max_model_len=max_len
    )


def resolve_backend(backend: str, dtype: str, config: ModelConfig) -> str:
    """``auto``: eager, but oneDNN predictors for float32 CPU models of 10M+
    on CPUs that are not Intel's where the compiled kernels cannot run.

    An eager float32 model on the CPU multiplies its projections with the
    packed-panel kernels (``model/packed.py``); on AMD EPYC (2 threads, the
    27.8M bench checkpoint) the eager engine serves 16 concurrent requests
    1.74x and one stream 1.45x faster than the predictors
    (docs/benchmarks.md "Packed float32 panels"). Without the kernels
    (numba missing) eager Paddle's matmul is Intel MKL, which reaches
    100-160 GFLOP/s a core on Intel and ~20 on AMD, where the predictors
    make 16 concurrent requests ~1.5x faster. Below 10M parameters a step is
    mostly fixed per-call cost and the build (1-2 s) is not worth it.
    Elsewhere (GPU, half precision) eager Paddle.
    """
    if backend not in ("auto", "eager", "inference"):
        raise ModelLoadError(
            f"model_backend must be auto, eager or inference, got {backend!r}"
        )
    on_cpu = not paddle.is_compiled_with_cuda() or paddle.get_device() == "cpu"
    if backend == "auto":
        from structllm.model.compiled import inference_available

        fast = (
            on_cpu
            and dtype == "float32"
            and config.num_parameters >= AUTO_INFERENCE_MIN_PARAMETERS
            and cpu_vendor() != "GenuineIntel"
            and not kernels.available()
            and inference_available()
        )
        return "inference" if fast else "eager"
    if backend == "inference" and not (on_cpu and dtype == "float32"):
        raise ModelLoadError(
            "model_backend='inference' runs float32 on CPU only; use 'eager'"
        )
    return backend


def _checkpoint_files(path: Path) -> dict[str, Path]:
    """Map tensor name -> file, from the index when the checkpoint is sharded."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map: Mapping[str, str] = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(
                f"{index} is not a valid safetensors index: {exc!r}"
            ) from exc
        files = {name: path / f for name, f in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise ModelLoadError(f"{f} is listed in {index.name} but missing")
        return files
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise ModelLoadError(f"no *.safetensors files in {path}")
    from safetensors import safe_open

    files = {}
    for f in found:
        try:
            with safe_open(str(f), framework="numpy") as st:
                files.update(dict.fromkeys(st.keys(), f))
        except Exception as exc:  # safetensors raises several types
            raise ModelLoadError(
                f"{f} is not a readable safetensors file: {exc}"
            ) from exc
    return files


def read_safetensors(
    path: Path,
    shapes: Mapping[str, tuple[int, ...]],
    slices: Mapping[str, tuple[slice, ...]] | None = None,
) -> Iterator[tuple[str, paddle.Tensor]]:
    """The tensors of ``shapes``, checked; of each, only ``slices[name]`` if given
    (a tensor-parallel rank's shard, read without the rest of the tensor)."""
    from safetensors import safe_open

    files = _checkpoint_files(path)
    missing = [n for n in shapes if n not in files]
    if missing:
        raise ModelLoadError(
            f"checkpoint in {path} lacks {len(missing)} tensors, e.g. {missing[:3]}"
        )
    unexpected = sorted(n for n in files if n not in shapes and not _ignorable(n))
    if unexpected:
        # weights config.json does not account for (a bias, a norm, a second
        # head...): running without them would silently compute another model
        raise ModelLoadError(
            f"checkpoint in {path} holds {len(unexpected)} tensors its config.json "
            f"does not use, e.g. {unexpected[:3]}: config and weights disagree"
        )
    by_file: dict[Path, list[str]] = {}
    for name in shapes:
        by_file.setdefault(files[name], []).append(name)
    for file, names in by_file.items():
        try:
            with safe_open(str(file), framework="paddle") as st:
                for name in names:
                    part = st.get_slice(name)
                    if tuple(part.get_shape()) != shapes[name]:
                        raise ModelLoadError(
                            f"tensor {name} in {file.name} has shape "
                            f"{tuple(part.get_shape())}, config.json implies "
                            f"{shapes[name]}"
                        )
                    if slices is None:
                        yield name, st.get_tensor(name)
                    else:
                        yield name, part[slices[name]]
        except ModelLoadError:
            raise
        except Exception as exc:  # truncated or corrupt file, bad dtype
            raise ModelLoadError(f"{file} could not be read: {exc}") from exc


def _ignorable(name: str) -> bool:
    """Tensors transformers itself skips: RoPE buffers old checkpoints saved,
    and the head of a tied checkpoint (a copy of the embedding)."""
    return name.endswith("rotary_emb.inv_freq") or name == "lm_head.weight"


def fuse_weights(
    config: ModelConfig,
    t: dict[str, paddle.Tensor],
    dtype: str,
    linears: Mapping[str, Linear] | None = None,
) -> ModelWeights:
    """HF tensors (taken out of ``t``) -> the model's weights in ``dtype``:
    a :class:`DenseLinear` for each projection ``linears`` does not supply."""
    supplied = dict(linears or {})
    loaders = projection_loaders(config)
    unknown = sorted(set(supplied) - {*loaders, "lm_head"})
    if unknown:
        raise ModelLoadError(
            f"linears names {unknown[:3]}, not projections of this model: "
            f"those are {list(loaders)[:4]}... and lm_head"
        )

    def cast(x: paddle.Tensor) -> paddle.Tensor:
        return x if x.dtype == getattr(paddle, dtype) else x.astype(dtype)

    def take(name: str) -> paddle.Tensor:
        if name not in t:
            raise ModelLoadError(f"the weights lack {name}")
        return cast(t.pop(name))

    def linear(module: str, in_features: int, out_features: int) -> Linear:
        loader = loaders.get(module)
        if module not in supplied:
            assert loader is not None
            return loader.build(t, dtype)
        given = supplied[module]
        doubled = [n for n in (loader.slices() if loader else ()) if n in t]
        if doubled:
            raise ModelLoadError(
                f"{module} is given as a Linear and as tensors ({doubled[0]})"
            )
        shape = (given.in_features, given.out_features)
        if shape != (in_features, out_features):
            raise ModelLoadError(
                f"the {given.kind} Linear given for {module} maps {shape[0]} "
                f"features to {shape[1]}; the model's maps {in_features} to "
                f"{out_features}"
            )
        return given

    c, h, inner = config, config.hidden_size, config.intermediate_size
    layers = []
    for n in range(c.num_hidden_layers):
        p = f"model.layers.{n}."
        a = p + "self_attn."
        proj = {f: p + module for f, module in LAYER_PROJECTIONS.items()}
        layers.append(
            DecoderLayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=linear(proj["qkv"], h, c.q_size + 2 * c.kv_size),
                o=linear(proj["o"], c.q_size, h),
                post_attention_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=linear(proj["gate_up"], h, 2 * inner),
                down=linear(proj["down"], inner, h),
                q_norm=take(a + "q_norm.weight") if c.qk_norm else None,
                k_norm=take(a + "k_norm.weight") if c.qk_norm else None,
            )
        )
    embed_name = "model.embed_tokens.weight"
    embed = (
        t.pop(embed_name)
        if isinstance(t.get(embed_name), QuantizedEmbedding)
        else take(embed_name)
    )
    if c.tie_word_embeddings and "lm_head" not in supplied:
        if isinstance(embed, QuantizedEmbedding):
            raise ModelLoadError(
                "a quantized embedding's tied head must be given as a Linear "
                "(linears['lm_head'])"
            )
        lm_head: Linear = DenseLinear(embed, transposed=True)  # (V, H)
    else:
        lm_head = linear("lm_head", h, c.vocab_size)
    norm = take("model.norm.weight")
    if t:
        raise ModelLoadError(
            f"{len(t)} tensors are not weights of this model, e.g. {sorted(t)[:3]}"
        )
    return ModelWeights(embed=embed, layers=layers, norm=norm, lm_head=lm_head)
