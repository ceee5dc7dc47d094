"""Tensor parallelism: the sharding plan, shard loading, and a real TP=2 group.

The group test spawns two gloo ranks (fresh interpreters) that each load
their shard of five random checkpoints and run the same steps as the TP=1
model in this process; the logits must agree.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from pathlib import Path

import attrs
import numpy as np
import pytest

from structllm.errors import EngineConfigError
from structllm.model._paddle import paddle
from structllm.model.attention import SequenceSlice
from structllm.model.checkpoint import write_random_checkpoint
from structllm.model.config import ModelConfig
from structllm.model.linear import Linear
from structllm.model.llama import LlamaForCausalLM
from structllm.model.loader import load_model
from structllm.model.packed import PackedLinear
from structllm.model.panel_kernels import unpack
from structllm.model.parallel import ShardPlan, load_shard, plan_shards

_BASE = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)

#: one checkpoint per family trait the split must respect
CONFIGS = {
    "llama": _BASE,
    # kv heads < ranks (replicated), and o/down biases added after the sum
    "llama-kv1-bias": attrs.evolve(
        _BASE, num_key_value_heads=1, o_bias=True, mlp_bias=True, qkv_bias=True
    ),
    "qwen2": attrs.evolve(
        _BASE, architecture="Qwen2ForCausalLM", qkv_bias=True, tie_word_embeddings=True
    ),
    "qwen3": attrs.evolve(
        _BASE, architecture="Qwen3ForCausalLM", qk_norm=True, tie_word_embeddings=True
    ),
    "mistral": attrs.evolve(_BASE, architecture="MistralForCausalLM", sliding_window=4),
}


def _shapes(plan: ShardPlan, *names: str) -> list[tuple[int, ...]]:
    shapes = plan.shard_shapes()
    return [shapes[f"model.layers.0.{n}"] for n in names]


def test_plan_llama_gqa_splits_heads_and_mlp() -> None:
    c = attrs.evolve(_BASE, num_attention_heads=8, num_key_value_heads=4, head_dim=8)
    for rank in range(2):
        plan = plan_shards(c, 2, rank)
        assert plan.q_heads == range(4 * rank, 4 * rank + 4)
        assert plan.kv_heads == range(2 * rank, 2 * rank + 2)
        assert not plan.kv_replicated
        assert _shapes(
            plan,
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        ) == [(32, 64), (16, 64), (16, 64), (64, 32), (64, 64), (64, 64), (64, 64)]
        assert plan.slices()["model.layers.1.self_attn.q_proj.weight"] == (
            slice(32 * rank, 32 * rank + 32),
            slice(None),
        )
        assert plan.slices()["model.layers.1.mlp.down_proj.weight"] == (
            slice(None),
            slice(64 * rank, 64 * rank + 64),
        )
        shapes = plan.shard_shapes()
        assert shapes["model.embed_tokens.weight"] == (96, 64)
        assert shapes["lm_head.weight"] == (96, 64)
        assert shapes["model.norm.weight"] == (64,)
        assert shapes["model.layers.0.input_layernorm.weight"] == (64,)
        local = plan.local
        assert (local.num_attention_heads, local.num_key_value_heads) == (4, 2)
        assert local.intermediate_size == 64 and local.hidden_size == 64


def test_plan_qwen2_biases_follow_their_weights() -> None:
    c = attrs.evolve(CONFIGS["qwen2"], o_bias=True, mlp_bias=True)
    plan = plan_shards(c, 2, 1)
    assert _shapes(
        plan,
        "self_attn.q_proj.bias",
        "self_attn.k_proj.bias",
        "self_attn.v_proj.bias",
        "self_attn.o_proj.bias",
        "mlp.gate_proj.bias",
        "mlp.up_proj.bias",
        "mlp.down_proj.bias",
    ) == [(32,), (16,), (16,), (64,), (64,), (64,), (64,)]
    slices = plan.slices()
    assert slices["model.layers.0.self_attn.k_proj.bias"] == (slice(16, 32),)
    # row-parallel biases whole: added once, after the all-reduce
    assert slices["model.layers.0.self_attn.o_proj.bias"] == (slice(None),)
    assert "lm_head.weight" not in slices  # tied


def test_plan_replicates_kv_heads_when_fewer_than_ranks() -> None:
    c = attrs.evolve(_BASE, num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    plans = [plan_shards(c, 4, r) for r in range(4)]
    assert [p.kv_heads for p in plans] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    assert all(p.kv_replicated and p.local.num_key_value_heads == 1 for p in plans)
    for p in plans:  # each rank's q heads all use the kv head it keeps
        group = c.num_attention_heads // c.num_key_value_heads
        assert {h // group for h in p.q_heads} == {p.kv_heads.start}
        assert p.slices()["model.layers.0.self_attn.v_proj.weight"][0] == slice(
            8 * p.kv_heads.start, 8 * p.kv_heads.stop
        )


@pytest.mark.parametrize(
    ("changes", "tp", "field"),
    [
        (
            {"num_attention_heads": 6, "num_key_value_heads": 6},
            4,
            "num_attention_heads",
        ),
        ({"intermediate_size": 102}, 4, "intermediate_size"),
        (
            {"num_attention_heads": 12, "num_key_value_heads": 6},
            4,
            "num_key_value_heads",
        ),
        ({"num_attention_heads": 12, "num_key_value_heads": 3}, 4, "ranks must be"),
        ({}, 0, ">= 1"),
    ],
)
def test_plan_refuses_what_does_not_divide(
    changes: dict[str, int], tp: int, field: str
) -> None:
    with pytest.raises(EngineConfigError, match=field) as info:
        plan_shards(attrs.evolve(_BASE, **changes), tp, 0)
    assert info.value.field == "tensor_parallel_size"


def test_group_of_one_is_the_whole_model(tmp_path: Path) -> None:
    write_random_checkpoint(tmp_path, CONFIGS["qwen2"], seed=1)
    whole = load_model(tmp_path, backend="eager", block_size=4).model
    alone = load_shard(tmp_path, plan_shards(CONFIGS["qwen2"], 1, 0), block_size=4)
    np.testing.assert_array_equal(_steps(alone), _steps(whole))


@pytest.mark.parametrize(("dtype", "shards"), [("float32", 1), ("bfloat16", 2)])
def test_shard_loads_its_slices_into_a_narrow_model(
    tmp_path: Path, dtype: str, shards: int
) -> None:
    c = CONFIGS["llama-kv1-bias"]
    write_random_checkpoint(tmp_path, c, seed=1, dtype=dtype, shards=shards)
    plan = plan_shards(c, 2, 1)
    model = load_shard(tmp_path, plan, block_size=4, all_reduce=lambda x: x)
    layer = model.weights.layers[0]
    qkv, o, gate_up, down = (
        _in_out(layer.qkv),
        _in_out(layer.o),
        _in_out(layer.gate_up),
        _in_out(layer.down),
    )
    assert tuple(qkv.shape) == (64, 32 + 16 + 16)  # 2 q heads, 1 kv, 1 kv
    assert tuple(o.shape) == (32, 64) and tuple(down.shape) == (64, 64)
    assert layer.o.bias is not None and tuple(layer.o.bias.shape) == (64,)
    k_cache, _ = model.allocate_kv_cache(3)[0]
    assert tuple(k_cache.shape) == (1, 12, 16)  # the rank's one kv head
    whole = load_model(tmp_path, backend="eager").model.weights.layers[0]
    np.testing.assert_array_equal(  # q heads 2-3: columns 32-63 of the fused qkv
        qkv[:, :32], _in_out(whole.qkv)[:, 32:64]
    )
    np.testing.assert_array_equal(o, _in_out(whole.o)[32:])
    whole_gate_up = _in_out(whole.gate_up)
    np.testing.assert_array_equal(  # gate columns 64-127 of 128, then up's
        gate_up,
        np.concatenate([whole_gate_up[:, 64:128], whole_gate_up[:, 192:]], axis=1),
    )
    np.testing.assert_array_equal(down, _in_out(whole.down)[64:])
    assert qkv.dtype == np.float32  # half checkpoints: float32 on CPU


def _in_out(linear: Linear) -> np.ndarray:
    """A served projection's weight ``(in, out)``: packed on the CPU."""
    assert isinstance(linear, PackedLinear)
    return unpack(linear.panels, linear.out_features).T


def test_inference_backend_refuses_tensor_parallel(tmp_path: Path) -> None:
    write_random_checkpoint(tmp_path, _BASE)
    with pytest.raises(EngineConfigError, match="eager") as info:
        load_shard(tmp_path, plan_shards(_BASE, 2, 0), backend="inference")
    assert info.value.field == "model_backend"


class _ThreadGroup:
    """An all-reduce over threads, one a rank: ranks of one process, no gloo."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=60)
        self.parts: list[np.ndarray] = [np.zeros(0)] * size

    def reduce(self, rank: int, x: paddle.Tensor) -> paddle.Tensor:
        self.parts[rank] = x.numpy()
        self.barrier.wait()
        total = np.sum(self.parts, axis=0)
        self.barrier.wait()  # everyone has summed before the next overwrite
        return paddle.to_tensor(total)


@pytest.mark.parametrize(
    "config",
    [
        # kv heads 2 < 4 ranks: each kv head on two ranks; every bias
        attrs.evolve(
            CONFIGS["llama-kv1-bias"], num_attention_heads=8, num_key_value_heads=2
        ),
        attrs.evolve(  # per-head q/k norm and attention bias, replicated kv
            CONFIGS["qwen3"], num_attention_heads=8, qkv_bias=True, o_bias=True
        ),
    ],
    ids=["llama-bias", "qwen3"],
)
def test_four_ranks_with_replicated_kv_heads_compute_the_whole_model(
    tmp_path: Path, config: ModelConfig
) -> None:
    config = attrs.evolve(config, head_dim=8)
    write_random_checkpoint(tmp_path, config, seed=2)
    group = _ThreadGroup(4)
    ranks = [
        load_shard(
            tmp_path,
            plan_shards(config, 4, r),
            block_size=4,
            all_reduce=lambda x, r=r: group.reduce(r, x),
        )
        for r in range(4)
    ]
    got: list[np.ndarray | BaseException] = [np.zeros(0)] * 4

    def run(rank: int) -> None:
        try:
            got[rank] = _steps(ranks[rank])
        except BaseException as exc:
            got[rank] = exc
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    whole = _steps(load_model(tmp_path, backend="eager", block_size=4).model)
    for out in got:
        if isinstance(out, BaseException):
            raise out
        np.testing.assert_allclose(out, whole, atol=1e-4, rtol=0)


def _steps(model: LlamaForCausalLM) -> np.ndarray:
    """A prefill, a mixed step (a decode and a second prefill), two decodes.

    Returns every step's logits, stacked ``(tokens, V)``.
    """
    caches = model.allocate_kv_cache(8)
    a = [3, 17, 42, 5, 8, 91, 60]
    b = [11, 12, 13, 77, 2]
    tables = [[0, 1, 2], [4, 5, 6]]
    steps = [
        ([SequenceSlice(0, 7, tables[0])], a, list(range(7))),
        (
            [SequenceSlice(7, 1, tables[0]), SequenceSlice(0, 5, tables[1])],
            [9, *b],
            [7, *range(5)],
        ),
        (
            [SequenceSlice(8, 1, tables[0]), SequenceSlice(5, 1, tables[1])],
            [1, 4],
            [8, 5],
        ),
        (
            [SequenceSlice(9, 1, tables[0]), SequenceSlice(6, 1, tables[1])],
            [0, 7],
            [9, 6],
        ),
    ]
    out = []
    for seqs, ids, pos in steps:
        meta = model.attention.build_metadata(seqs)
        hidden = model.forward(
            paddle.to_tensor(np.asarray(ids, np.int64)),
            paddle.to_tensor(np.asarray(pos, np.int64)),
            caches,
            meta,
        )
        out.append(model.compute_logits(hidden).numpy())
    return np.concatenate(out)


def _rank_main(root: Path) -> None:
    """One rank of the group: its shard of each checkpoint, the same steps."""
    paddle.distributed.init_parallel_env()
    rank = paddle.distributed.get_rank()
    for name in CONFIGS:
        plan = plan_shards(ModelConfig.from_directory(root / name), 2, rank)
        model = load_shard(root / name, plan, block_size=4)
        np.save(root / f"{name}-rank{rank}.npy", _steps(model))


_GLOO = hasattr(paddle.base.core, "ProcessGroupGloo")


@pytest.mark.skipif(not _GLOO, reason="this Paddle build has no gloo (CPU) backend")
@pytest.mark.filterwarnings("ignore:Your model will be trained under CPUONLY mode")
def test_two_gloo_ranks_compute_the_whole_models_logits(tmp_path: Path) -> None:
    for n, (name, config) in enumerate(CONFIGS.items()):
        write_random_checkpoint(tmp_path / name, config, seed=n)
    context = paddle.distributed.spawn(
        _rank_main, args=(tmp_path,), nprocs=2, backend="gloo"
    )
    for process in context.processes:  # joined, reaped: nothing left behind
        assert process.exitcode == 0
        with pytest.raises(ProcessLookupError):
            os.kill(process.pid, 0)
    assert multiprocessing.active_children() == []
    for name in CONFIGS:
        whole = _steps(load_model(tmp_path / name, backend="eager", block_size=4).model)
        for rank in range(2):
            got = np.load(tmp_path / f"{name}-rank{rank}.npy")
            np.testing.assert_allclose(got, whole, atol=1e-4, rtol=0, err_msg=name)
