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

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Literal

import attrs
import numpy as np

from structllm.errors import ModelLoadError
from structllm.model._paddle import cpu_vendor, paddle
from structllm.model.config import ModelConfig
from structllm.model.llama import DecoderLayerWeights, LlamaForCausalLM, ModelWeights
from structllm.models import resolve_model

__all__ = [
    "LoadProgress",
    "LoadedModel",
    "build_model",
    "hf_tensor_shapes",
    "load_model",
    "random_hf_tensors",
    "resolve_backend",
    "resolve_dtype",
]

#: ``model_backend="auto"`` uses oneDNN predictors from this size up
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
    model: LlamaForCausalLM
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
) -> LoadedModel:
    """Load ``model`` (a directory, or a built-in name) ready to run."""
    path = resolve_model(model)
    if path is None:
        load_format = "dummy"
    config = ModelConfig.from_path(path)
    gguf = path is not None and path.is_file()
    compute_dtype = resolve_dtype(dtype, config)
    shapes = hf_tensor_shapes(config)
    total = len(shapes)

    def report(done: int) -> None:
        if on_progress is not None:
            on_progress(LoadProgress("weights", done, total))

    tensors: dict[str, paddle.Tensor] = {}
    report(0)
    if load_format == "dummy":
        for n, (name, array) in enumerate(random_hf_tensors(config, seed), 1):
            tensors[name] = paddle.to_tensor(array)
            report(n)
    elif gguf and load_format in ("auto", "gguf"):
        assert path is not None
        from structllm.formats.gguf import GGUFFile
        from structllm.model.gguf_loader import read_gguf_tensors

        with GGUFFile.open(path) as f:
            for n, (name, array) in enumerate(read_gguf_tensors(f, config, shapes), 1):
                tensors[name] = paddle.to_tensor(array)
                report(n)
    elif not gguf and load_format in ("auto", "safetensors"):
        assert path is not None
        for n, (name, tensor) in enumerate(_read_safetensors(path, shapes), 1):
            tensors[name] = tensor
            report(n)
    else:
        raise ModelLoadError(
            f"load_format {load_format!r} does not read {path}: auto, "
            "safetensors (a directory), gguf (a .gguf file) or dummy"
        )
    llm = build_model(
        config,
        tensors,
        dtype=compute_dtype,
        block_size=block_size,
        max_model_len=max_model_len,
        backend=backend,
        num_threads=num_threads,
    )
    return LoadedModel(config=config, model=llm, path=path)


def build_model(
    config: ModelConfig,
    tensors: Mapping[str, paddle.Tensor | np.ndarray],
    *,
    dtype: str = "float32",
    block_size: int = 16,
    max_model_len: int | None = None,
    backend: str = "eager",
    num_threads: int | None = None,
) -> LlamaForCausalLM:
    """A model from HF-named tensors (consumed; HF ``(out, in)`` layout)."""
    t = {
        n: x if isinstance(x, paddle.Tensor) else paddle.to_tensor(x)
        for n, x in tensors.items()
    }
    weights = _fuse(config, t, dtype)
    limit = config.max_context_len
    max_len = min(max_model_len or limit, limit)
    if resolve_backend(backend, dtype, config) == "inference":
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
    """``auto``: oneDNN predictors for float32 CPU models of 10M+, if not on Intel.

    Paddle's eager matmul is Intel MKL. On Intel (a Sapphire Rapids Xeon) it
    reaches 100-160 GFLOP/s a core and the eager engine serves 16 concurrent
    requests 1.4x faster than the predictors; on AMD EPYC it reaches ~20 and
    the predictors make 16 concurrent requests ~1.5x and a single stream
    ~1.2x faster (docs/benchmarks.md). Below 10M parameters a step is mostly fixed
    per-call cost and the build (1-2 s) is not worth it. Elsewhere (GPU,
    half precision) eager Paddle.
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


def _read_safetensors(
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


def _fuse(config: ModelConfig, t: dict[str, paddle.Tensor], dtype: str) -> ModelWeights:
    """HF tensors -> fused, ``(in, out)`` tensors in ``dtype``."""

    def cast(x: paddle.Tensor) -> paddle.Tensor:
        return x if x.dtype == getattr(paddle, dtype) else x.astype(dtype)

    def linear(*names: str) -> paddle.Tensor:
        # HF Linear weights are (out, in); concatenate along out, store (in, out)
        w = (
            paddle.concat([t.pop(n) for n in names], axis=0)
            if len(names) > 1
            else t.pop(names[0])
        )
        return cast(w).transpose([1, 0]).contiguous()

    def optional(*names: str) -> paddle.Tensor | None:
        if names[0] not in t:
            return None
        return cast(paddle.concat([t.pop(n) for n in names]))

    layers = []
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        a, m = p + "self_attn.", p + "mlp."
        layers.append(
            DecoderLayerWeights(
                input_norm=cast(t.pop(p + "input_layernorm.weight")),
                qkv=linear(
                    a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"
                ),
                qkv_bias=optional(
                    a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"
                ),
                o=linear(a + "o_proj.weight"),
                post_attention_norm=cast(t.pop(p + "post_attention_layernorm.weight")),
                gate_up=linear(m + "gate_proj.weight", m + "up_proj.weight"),
                down=linear(m + "down_proj.weight"),
                o_bias=optional(a + "o_proj.bias"),
                gate_up_bias=optional(m + "gate_proj.bias", m + "up_proj.bias"),
                down_bias=optional(m + "down_proj.bias"),
                q_norm=optional(a + "q_norm.weight"),
                k_norm=optional(a + "k_norm.weight"),
            )
        )
    return ModelWeights(
        embed=cast(t.pop("model.embed_tokens.weight")),
        layers=layers,
        norm=cast(t.pop("model.norm.weight")),
        lm_head=None if config.tie_word_embeddings else linear("lm_head.weight"),
    )
