"""Speculative decoding with tensor parallelism: a core of two gloo ranks.

Rank 0 holds the scheduler, the proposer (prompt lookup, or a draft model
that runs unsharded in rank 0's process) and the sampler that verifies;
the followers run whatever step rank 0 broadcasts, proposals included, so
greedy outputs equal the TP=1 run without speculation, token for token.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from structllm import SamplingParams
from structllm.engine.frontend.async_llm import AsyncLLM
from structllm.llm import LLM
from structllm.model._paddle import paddle

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(
        not hasattr(paddle.base.core, "ProcessGroupGloo"),
        reason="this Paddle build has no gloo (CPU) backend",
    ),
]

ENGINE = {
    "max_model_len": 256,
    "num_blocks": 64,
    "block_size": 8,
    "max_num_batched_tokens": 24,  # the longest prompt prefills in chunks
    "model_backend": "eager",
    "show_progress": False,
}
PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog, and keeps running!",
    "tensor parallel",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

#: every method, speculating at any batch size (the prompts run as one batch)
SPECS: dict[str, dict[str, Any]] = {
    # from a match of one token: a random model's output repeats little
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    # the target drafting for itself: every proposal right
    "draft_model": {
        "method": "draft_model",
        "model": "tiny-random",
        "num_speculative_tokens": 3,
    },
}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"  # each open costs two interpreters; one backend is enough


@pytest.fixture(scope="module")
def expected() -> list[tuple[int, ...]]:
    """TP=1's greedy tokens, without speculation."""
    one = LLM("tiny-random", **ENGINE)
    outputs = one.generate(PROMPTS, GREEDY, use_tqdm=False)
    tokens = [tuple(o.outputs[0].token_ids) for o in outputs]
    assert len({t for ids in tokens for t in ids}) > 3  # not a degenerate model
    return tokens


@pytest.mark.parametrize("method", list(SPECS))
async def test_two_ranks_speculating_give_the_greedy_tokens_of_one(
    method: str, expected: list[tuple[int, ...]]
) -> None:
    spec = {**SPECS[method], "disable_by_batch_size": None}
    got: dict[int, tuple[int, ...]] = {}
    async with AsyncLLM.open(
        "tiny-random", tensor_parallel_size=2, speculative_config=spec, **ENGINE
    ) as llm:

        async def run(i: int) -> None:
            got[i] = tuple((await llm.complete(PROMPTS[i], GREEDY)).token_ids)

        async with anyio.create_task_group() as tg:  # one batch
            for i in range(len(PROMPTS)):
                tg.start_soon(run, i)
        stats = llm.statistics()
    assert [got[i] for i in range(len(PROMPTS))] == expected
    proposed, accepted = (
        stats.spec_decode_num_draft_tokens,
        stats.spec_decode_num_accepted_tokens,
    )
    assert proposed > 0 and 0 <= accepted <= proposed
    if method == "draft_model":
        assert accepted == proposed  # the target's own guesses
