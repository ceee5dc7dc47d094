"""Tensor parallelism through the engine: a core process of two gloo ranks.

TP=2 behind ``AsyncLLM`` gives the greedy tokens of the TP=1 engine (the
offline ``LLM``, same settings) for a batch with a chunked prefill; an
abort touches rank 0's scheduler only and frees its blocks; a follower
killed mid-stream fails the live request with EngineDeadError (no hang),
the supervisor restarts the whole group, and no rank outlives the engine.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest

from structllm import EngineDeadError, SamplingParams
from structllm.config import EngineConfig
from structllm.engine.frontend.async_llm import AsyncLLM
from structllm.engine.statistics import EngineStatistics
from structllm.errors import EngineConfigError, EngineCoreError
from structllm.llm import LLM
from structllm.model._paddle import paddle
from structllm.model.checkpoint import write_random_checkpoint
from structllm.model.config import ModelConfig
from structllm.testing.faults import inject_fault
from tests.processes import LONG, consume_until_dead, wait_gone

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(
        not hasattr(paddle.base.core, "ProcessGroupGloo"),
        reason="this Paddle build has no gloo (CPU) backend",
    ),
]

_BASE = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=320,  # the byte tokenizer's 258 ids fit
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)

#: the families' traits the split must respect (as in test_tensor_parallel)
CONFIGS = {
    "llama": _BASE,
    "llama-kv1-bias": attrs.evolve(
        _BASE, num_key_value_heads=1, o_bias=True, mlp_bias=True, qkv_bias=True
    ),
    # untied: a tied random head echoes its input, too weak a check here
    # (test_tensor_parallel compares the tied models' logits)
    "qwen2": attrs.evolve(_BASE, architecture="Qwen2ForCausalLM", qkv_bias=True),
}

#: a small token budget: the 60-byte prompt prefills over several steps
ENGINE = {
    "max_model_len": 256,
    "num_blocks": 64,
    "block_size": 8,
    "max_num_batched_tokens": 24,
    "model_backend": "eager",
}
FRONT = {"show_progress": False, "tokenizer": "tiny-random"}
PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog, and keeps running!",
    "tensor parallel",
]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"  # each open costs two interpreters; one backend is enough


@pytest.mark.parametrize("name", list(CONFIGS))
async def test_two_ranks_give_the_greedy_tokens_of_one(
    tmp_path: Path, name: str
) -> None:
    await _same_tokens(tmp_path, CONFIGS[name], ENGINE, GREEDY)


async def test_preemption_across_ranks_keeps_the_tokens(tmp_path: Path) -> None:
    """32 blocks of 8 tokens cannot hold three sequences growing by 60
    tokens: rank 0 preempts and recomputes; the followers' caches follow
    its block tables."""
    engine = {**ENGINE, "num_blocks": 32}
    params = attrs.evolve(GREEDY, max_tokens=60)
    stats = await _same_tokens(tmp_path, CONFIGS["llama"], engine, params)
    assert stats.total_preemptions > 0


async def _same_tokens(
    tmp_path: Path,
    config: ModelConfig,
    engine: dict[str, Any],
    params: SamplingParams,
) -> EngineStatistics:
    """TP=2 (AsyncLLM, PROMPTS as one batch) gives TP=1's (LLM) greedy tokens;
    returns the TP=2 engine's last statistics."""
    write_random_checkpoint(tmp_path, config, seed=3)
    one = LLM(str(tmp_path), tokenizer="tiny-random", show_progress=False, **engine)
    outputs = one.generate(PROMPTS, params, use_tqdm=False)
    expected = [o.outputs[0].token_ids for o in outputs]
    assert len({t for ids in expected for t in ids}) > 3  # not a degenerate model
    got: dict[int, tuple[int, ...]] = {}
    async with AsyncLLM.open(
        str(tmp_path), tensor_parallel_size=2, **engine, **FRONT
    ) as llm:

        async def run(i: int) -> None:
            got[i] = (await llm.complete(PROMPTS[i], params)).token_ids

        async with anyio.create_task_group() as tg:  # one batch
            for i in range(len(PROMPTS)):
                tg.start_soon(run, i)
        stats = llm.statistics()
    assert [got[i] for i in range(len(PROMPTS))] == expected
    return stats


async def test_abort_mid_stream_frees_blocks_and_the_group_serves_on() -> None:
    async with AsyncLLM.open(
        "tiny-random", tensor_parallel_size=2, **ENGINE, **FRONT
    ) as llm:
        async with llm.stream(PROMPTS[1], LONG) as s:
            n = 0
            async for _ in s:
                n += 1
                if n == 3:
                    break  # leaving the block aborts the request
        with anyio.fail_after(10):
            stats = await llm.wait_statistics(
                lambda s: s.blocks_used == 0 and s.running == 0 and s.live_requests == 0
            )
        assert not stats.dead and stats.restarts == 0
        out = await llm.complete(PROMPTS[0], GREEDY)
        assert len(out.token_ids) == GREEDY.max_tokens


async def test_sigkill_of_rank_1_mid_stream_restarts_the_group() -> None:
    async with AsyncLLM.open(
        "tiny-random",
        tensor_parallel_size=2,
        max_restarts=2,
        heartbeat_timeout=5.0,
        **ENGINE,
        **FRONT,
    ) as llm:
        rank0 = llm.statistics().core_pid
        assert rank0 is not None
        [rank1] = _children(rank0)
        killed_at = 0.0

        async def killer() -> None:
            nonlocal killed_at
            await llm.wait_statistics(lambda s: s.running > 0)
            killed_at = time.monotonic()
            os.kill(rank1, signal.SIGKILL)

        async with anyio.create_task_group() as tg:
            tg.start_soon(killer)
            err, _ = await consume_until_dead(llm)
        assert time.monotonic() - killed_at < 5.0  # within the heartbeat timeout
        # the step's collective broke, or the watch on rank 1's socket saw
        # it first: either way rank 0 says whose death it was, and exits
        cause = err.__cause__
        assert isinstance(cause, EngineCoreError), cause
        assert f"rank 1 (pid {rank1}) was killed by signal 9" in str(cause)
        with anyio.fail_after(60):
            out = await llm.complete("Hello", GREEDY)
        assert len(out.token_ids) == GREEDY.max_tokens
        stats = llm.statistics()
        assert stats.restarts == 1 and not stats.dead
        new0 = stats.core_pid
        assert new0 is not None and new0 != rank0
        [new1] = _children(new0)
    wait_gone(rank0, rank1, new0, new1)


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        # rank 1 counts warm-up's 2 forwards; rank 0 counts from the loop
        ("rank1:raise_at_step:4", "tensor-parallel rank 1 raised RuntimeError"),
        ("raise_at_step:2", "RuntimeError"),
    ],
    ids=["rank1", "rank0"],
)
async def test_a_rank_that_raises_fails_the_group_loudly(
    fault: str, message: str
) -> None:
    with inject_fault(fault):
        async with AsyncLLM.open(
            "tiny-random", tensor_parallel_size=2, **ENGINE, **FRONT
        ) as llm:
            rank0 = llm.statistics().core_pid
            assert rank0 is not None
            [rank1] = _children(rank0)
            with pytest.raises(EngineDeadError) as info:
                await llm.complete("Hello", LONG)
            cause = str(info.value.__cause__)
            assert message in cause and "injected fault at step" in cause
            with anyio.fail_after(60):
                out = await llm.complete("Hello", GREEDY)
            assert len(out.token_ids) == GREEDY.max_tokens
            new0 = llm.statistics().core_pid
            assert new0 is not None
            [new1] = _children(new0)
    wait_gone(rank0, rank1, new0, new1)


async def test_a_hung_follower_is_caught_by_the_heartbeat() -> None:
    """Rank 0 waits in the step's collective; its heartbeats stop once the
    step has run ``step_timeout``, the supervisor's heartbeat timeout kills
    it, and rank 1 dies with it."""
    with inject_fault("rank1:hang_at_step:4"):
        async with AsyncLLM.open(
            "tiny-random",
            tensor_parallel_size=2,
            heartbeat_timeout=2.0,
            step_timeout=1.0,
            **ENGINE,
            **FRONT,
        ) as llm:
            rank0 = llm.statistics().core_pid
            assert rank0 is not None
            [rank1] = _children(rank0)
            start = time.monotonic()
            with pytest.raises(EngineDeadError) as info:
                await llm.complete("Hello", LONG)
            assert isinstance(info.value.__cause__, TimeoutError)
            # step_timeout + heartbeat_timeout, a few steps
            assert time.monotonic() - start < 1.0 + 2.0 + 2.0
            with anyio.fail_after(60):
                out = await llm.complete("Hello", GREEDY)
            assert len(out.token_ids) == GREEDY.max_tokens
            new0 = llm.statistics().core_pid
            assert new0 is not None
            [new1] = _children(new0)
    wait_gone(rank0, rank1, new0, new1)


def test_offline_llm_refuses_tensor_parallel_naming_the_field() -> None:
    with pytest.raises(EngineConfigError, match="AsyncLLM") as info:
        LLM("tiny-random", tensor_parallel_size=2, show_progress=False, **ENGINE)
    assert info.value.field == "tensor_parallel_size"


async def test_the_inline_executor_refuses_tensor_parallel() -> None:
    with pytest.raises(EngineConfigError, match="executor='process'") as info:
        async with AsyncLLM.open(
            "tiny-random", tensor_parallel_size=2, executor="inline", **ENGINE, **FRONT
        ):
            pytest.fail("open() should have failed")  # pragma: no cover
    assert info.value.field == "tensor_parallel_size"


def test_tensor_parallel_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(model="tiny-random", tensor_parallel_size=0)


async def test_a_model_that_does_not_divide_fails_open_naming_the_field() -> None:
    # tiny-random has 4 attention heads: 3 ranks cannot split them
    with pytest.raises(EngineConfigError, match="num_attention_heads") as info:
        async with AsyncLLM.open(
            "tiny-random", tensor_parallel_size=3, **ENGINE, **FRONT
        ):
            pytest.fail("open() should have failed")  # pragma: no cover
    assert info.value.field == "tensor_parallel_size"


def _children(pid: int) -> list[int]:
    return [
        int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    ]
