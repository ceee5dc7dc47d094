"""Tensor parallelism for the Llama-family decoder (Megatron-style).

A rank of a ``tp_size`` group holds a slice of every layer:

- q/k/v projections are column-parallel, split by head: rank ``r`` keeps q
  heads ``[r * nh/tp, (r+1) * nh/tp)``. KV heads are split the same way when
  ``kv_heads % tp == 0``; when ``kv_heads < tp`` (and ``tp % kv_heads == 0``)
  each rank keeps the one kv head its q heads use, so kv heads are
  replicated ``tp / kv_heads`` times. q/k/v biases follow their rows.
- gate/up are column-parallel (intermediate columns), o_proj and down_proj
  row-parallel (their input rows): each rank's matmul gives a partial sum of
  the full output, summed by one all-reduce after o_proj and one after
  down_proj. Their biases are kept whole and added once, after the reduction.
- norms (also Qwen3's per-head q/k norm), the embedding and the LM head are
  replicated; every rank computes the full logits. A vocab-parallel
  embedding and head (a split of ``V`` with an all-gather of the logits) is
  a later option.

So a rank's shard is exactly the checkpoint of a narrower model
(:attr:`ShardPlan.local`: ``nh/tp`` heads, its kv heads, ``I/tp``
intermediate), which :class:`~structllm.model.llama.LlamaForCausalLM` runs
unchanged, with an ``all_reduce`` hook, over a KV cache of its own kv heads.
Each rank reads only its slices from safetensors (``get_slice``); which
slices is said by each projection's loader
(:class:`~structllm.model.linear.ColumnParallelLoader`,
:class:`~structllm.model.linear.RowParallelLoader`), given the rank's heads
and intermediate columns.

LoRA adapters split the same way (:func:`lora_reader`): each rank reads
its share of every pair into its shard's slots: column-parallel q/k/v and
gate/up keep their output rows of B (A whole), row-parallel o and down
their input columns of A (B whole), so the all-reduce after o and down
sums the low-rank products with the base's partial sums.

Collectives are ``paddle.distributed.all_reduce`` on the default group: the
caller starts the ranks and calls ``paddle.distributed.init_parallel_env()``
(gloo on CPU) before :func:`load_shard`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import numpy as np

from structllm.errors import EngineConfigError, ModelLoadError
from structllm.model._paddle import paddle
from structllm.model.config import ModelConfig
from structllm.model.linear import Index, LinearLoader
from structllm.model.llama import LlamaForCausalLM
from structllm.model.loader import (
    LoadedModel,
    LoadFormat,
    LoadProgress,
    build_model,
    fuse_weights,
    hf_tensor_shapes,
    projection_loaders,
    random_hf_tensors,
    read_safetensors,
    resolve_backend,
    resolve_dtype,
)
from structllm.model.packed import pack_linears
from structllm.model.protocol import CausalLM
from structllm.models import resolve_model

if TYPE_CHECKING:
    from structllm.model.lora_peft import LoRAAdapter

__all__ = [
    "ShardPlan",
    "all_reduce_sum",
    "build_shard",
    "check_tensor_parallel",
    "load_model_shard",
    "load_shard",
    "lora_reader",
    "plan_shards",
]


@attrs.frozen
class ShardPlan:
    """What rank ``rank`` of ``tp_size`` holds of ``config``'s checkpoint."""

    config: ModelConfig  # the whole model
    tp_size: int
    rank: int
    #: the rank's shard as a model of its own (heads, kv heads, intermediate)
    local: ModelConfig
    q_heads: range  # global indices of the rank's q heads
    kv_heads: range  # global indices of the kv heads it keeps
    intermediate: range  # its gate/up columns, down rows

    @property
    def kv_replicated(self) -> bool:
        """Whether other ranks hold the same kv heads (``kv_heads < tp``)."""
        return self.config.num_key_value_heads < self.tp_size

    def slices(self) -> dict[str, Index]:
        """HF tensor name -> the rank's slice of it: the projections' as their
        loaders cut them; the rest (norms, embedding) whole."""
        out = {
            name: tuple(slice(None) for _ in shape)
            for name, shape in hf_tensor_shapes(self.config).items()
        }
        for loader in self.loaders().values():
            out.update(loader.slices())
        return out

    def loaders(self) -> dict[str, LinearLoader]:
        """The projections' loaders, cutting the rank's part of each."""
        return projection_loaders(
            self.config,
            q_heads=self.q_heads,
            kv_heads=self.kv_heads,
            intermediate=self.intermediate,
        )

    def shard_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF tensor name -> the shape of the rank's slice."""
        full = hf_tensor_shapes(self.config)
        return {
            name: tuple(len(range(n)[s]) for n, s in zip(full[name], idx, strict=True))
            for name, idx in self.slices().items()
        }


def plan_shards(config: ModelConfig, tp_size: int, rank: int) -> ShardPlan:
    """The shard of ``rank``; refuses, naming the field, what does not divide."""
    if tp_size < 1:
        raise EngineConfigError(
            f"tensor_parallel_size must be >= 1, got {tp_size}",
            field="tensor_parallel_size",
        )
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} is outside a group of {tp_size}")
    nh, kvh = config.num_attention_heads, config.num_key_value_heads
    for field, value in (
        ("num_attention_heads", nh),
        ("intermediate_size", config.intermediate_size),
    ):
        if value % tp_size:
            raise _indivisible(field, value, tp_size)
    if kvh >= tp_size and kvh % tp_size:
        raise _indivisible("num_key_value_heads", kvh, tp_size)
    if kvh < tp_size and tp_size % kvh:
        raise EngineConfigError(
            f"tensor_parallel_size {tp_size} does not fit num_key_value_heads "
            f"({kvh}): with fewer kv heads than ranks, the ranks must be a "
            "multiple of the kv heads (each rank keeps one)",
            field="tensor_parallel_size",
        )
    q_per, i_per = nh // tp_size, config.intermediate_size // tp_size
    if kvh >= tp_size:
        kv_per = kvh // tp_size
        kv_heads = range(rank * kv_per, (rank + 1) * kv_per)
    else:  # replicated: the kv head of the rank's q heads
        kv = rank * kvh // tp_size
        kv_heads = range(kv, kv + 1)
    local = attrs.evolve(
        config,
        num_attention_heads=q_per,
        num_key_value_heads=len(kv_heads),
        intermediate_size=i_per,
    )
    return ShardPlan(
        config=config,
        tp_size=tp_size,
        rank=rank,
        local=local,
        q_heads=range(rank * q_per, (rank + 1) * q_per),
        kv_heads=kv_heads,
        intermediate=range(rank * i_per, (rank + 1) * i_per),
    )


def _indivisible(field: str, value: int, tp_size: int) -> EngineConfigError:
    return EngineConfigError(
        f"tensor_parallel_size {tp_size} does not divide the model's {field} ({value})",
        field="tensor_parallel_size",
    )


def all_reduce_sum(x: paddle.Tensor) -> paddle.Tensor:
    """Sum ``x`` over the default group, in place; returns ``x``."""
    paddle.distributed.all_reduce(x, op=paddle.distributed.ReduceOp.SUM)
    return x


def load_shard(
    path: Path,
    plan: ShardPlan,
    *,
    dtype: str = "auto",
    block_size: int = 16,
    max_model_len: int | None = None,
    backend: str = "eager",
    all_reduce: Callable[[paddle.Tensor], paddle.Tensor] | None = None,
) -> CausalLM:
    """The rank's shard of the checkpoint in ``path``, ready to run.

    Reads only the rank's slices (of a GGUF file, each tensor is
    dequantized and the rank's slice kept). A group of one gets :func:`build_model`'s
    whole model (any backend; ``all_reduce`` unused). A rank of a larger
    group runs eager (``"auto"`` means eager there; the oneDNN
    ``"inference"`` backend is refused), with ``model.config`` the rank's
    :attr:`ShardPlan.local` and ``all_reduce`` defaulting to
    :func:`all_reduce_sum` (the process group must be initialised). An
    eager float32 model's projections are packed for the CPU kernels
    (:func:`~structllm.model.packed.pack_linears`).
    """
    _check_backend(plan, backend)
    compute_dtype = resolve_dtype(dtype, plan.config)
    slices = plan.slices()
    shapes = hf_tensor_shapes(plan.config)
    if path.is_file():
        # a GGUF file: each tensor dequantized whole, the rank keeps its slice
        from structllm.formats.gguf import GGUFFile
        from structllm.model.gguf_loader import read_gguf_tensors

        with GGUFFile.open(path) as f:
            tensors = {
                name: paddle.to_tensor(np.ascontiguousarray(array[slices[name]]))
                for name, array in read_gguf_tensors(f, plan.config, shapes)
            }
    else:
        tensors = dict(read_safetensors(path, shapes, slices))
    model: CausalLM
    if plan.tp_size == 1:  # the whole model: every backend
        model = build_model(
            plan.config,
            tensors,
            dtype=compute_dtype,
            block_size=block_size,
            max_model_len=max_model_len,
            backend=backend,
        )
    else:
        model = build_shard(
            plan,
            tensors,
            dtype=compute_dtype,
            block_size=block_size,
            max_model_len=max_model_len,
            all_reduce=all_reduce,
        )
    pack_linears(model)
    return model


def _check_backend(plan: ShardPlan, backend: str) -> None:
    resolve_backend(backend, "float32", plan.config)  # refuses unknown names
    if plan.tp_size > 1 and backend == "inference":
        raise EngineConfigError(
            "model_backend='inference' (oneDNN) does not run tensor parallel "
            f"yet (tensor_parallel_size={plan.tp_size}); use 'eager' or 'auto'",
            field="model_backend",
        )


def build_shard(
    plan: ShardPlan,
    tensors: Mapping[str, paddle.Tensor],
    *,
    dtype: str = "float32",
    block_size: int = 16,
    max_model_len: int | None = None,
    all_reduce: Callable[[paddle.Tensor], paddle.Tensor] | None = None,
) -> CausalLM:
    """A rank's model from its HF-named slices (as :meth:`ShardPlan.slices`
    cuts them; consumed), checked against :meth:`ShardPlan.shard_shapes`."""
    expected = plan.shard_shapes()
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != expected.get(name):
            raise ModelLoadError(
                f"shard tensor {name} has shape {tuple(tensor.shape)}, rank "
                f"{plan.rank} of {plan.tp_size} expects {expected.get(name)}"
            )
    weights = fuse_weights(plan.local, dict(tensors), dtype)
    if all_reduce is None and plan.tp_size > 1:
        all_reduce = all_reduce_sum
    limit = plan.config.max_context_len
    return LlamaForCausalLM(
        plan.local,
        weights,
        block_size=block_size,
        max_model_len=min(max_model_len or limit, limit),
        all_reduce=all_reduce,
    )


def _model_config(model: str | Path) -> tuple[ModelConfig, Path | None]:
    path = resolve_model(model)
    return ModelConfig.from_path(path), path


def check_tensor_parallel(model: str | Path, tp_size: int) -> None:
    """Refuse (EngineConfigError on ``tensor_parallel_size``) a model that
    ``tp_size`` ranks cannot split, before any rank is started."""
    plan_shards(_model_config(model)[0], tp_size, 0)


def lora_reader(
    model: str | Path, tp_size: int, rank: int, *, max_rank: int
) -> Callable[[str], LoRAAdapter]:
    """How rank ``rank`` of ``tp_size`` reads a PEFT adapter directory: its
    share of each pair (see the module docstring), fitting the LoRA slots
    of its shard of ``model``; the whole adapter for a group of one."""
    from structllm.model.lora_peft import read_peft_adapter

    plan = plan_shards(_model_config(model)[0], tp_size, rank)
    return functools.partial(
        read_peft_adapter, config=plan.config, max_rank=max_rank, loaders=plan.loaders()
    )


def load_model_shard(
    model: str | Path,
    tp_size: int,
    rank: int,
    *,
    dtype: str = "auto",
    load_format: LoadFormat = "auto",
    block_size: int = 16,
    max_model_len: int | None = None,
    seed: int = 0,
    backend: str = "auto",
    on_progress: Callable[[LoadProgress], None] | None = None,
    quantization: str = "auto",
    quantized_activations: str = "float",
) -> LoadedModel:
    """Rank ``rank``'s shard of ``model`` (a directory or a built-in name),
    as :func:`~structllm.model.loader.load_model` takes its arguments.

    Shards are float32: a GGUF file's quantized weights are dequantized and
    each rank keeps its slice (``quantization`` auto or none); quantizing a
    shard at load (q8_0...) is refused by name, as are q8 activations
    (``quantized_activations``: float shards take float activations) and
    any quantized format the ranks cannot split.

    ``load_format="dummy"`` (and ``"tiny-random"``) draws the whole model's
    random weights from ``seed`` and keeps the rank's slices, so every rank
    holds a slice of the same model; that costs the whole model's memory
    for a moment and is meant for tests. Checkpoints are read by
    :func:`load_shard` (only the rank's slices). ``LoadedModel.config`` is
    the whole model's; ``LoadedModel.model.config`` the shard's.
    """
    if quantization not in ("auto", "none"):
        raise EngineConfigError(
            f"quantization={quantization} with tensor_parallel_size {tp_size}: "
            "tensor-parallel ranks hold float32 shards",
            field="quantization",
        )
    if quantized_activations != "float":
        raise EngineConfigError(
            f"quantized_activations={quantized_activations!r} with "
            f"tensor_parallel_size {tp_size}: tensor-parallel ranks hold float32 "
            "shards, which take float activations",
            field="quantized_activations",
        )
    config, path = _model_config(model)
    if path is None:
        load_format = "dummy"
    if load_format not in ("auto", "safetensors", "gguf", "dummy"):
        raise ModelLoadError(
            f"load_format must be auto, safetensors, gguf or dummy, got {load_format!r}"
        )
    plan = plan_shards(config, tp_size, rank)
    if on_progress is not None:
        on_progress(LoadProgress("weights", 0, 1))
    if load_format != "dummy":
        assert path is not None
        shard = load_shard(
            path,
            plan,
            dtype=dtype,
            block_size=block_size,
            max_model_len=max_model_len,
            backend=backend,
        )
    else:
        _check_backend(plan, backend)
        slices = plan.slices()
        shard = build_shard(
            plan,
            {
                name: paddle.to_tensor(array[slices[name]])
                for name, array in random_hf_tensors(config, seed)
            },
            dtype=resolve_dtype(dtype, config),
            block_size=block_size,
            max_model_len=max_model_len,
        )
        pack_linears(shard)
    if on_progress is not None:
        on_progress(LoadProgress("weights", 1, 1))
    return LoadedModel(config=config, model=shard, path=path)
