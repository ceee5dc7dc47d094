"""Prefix caching seen from outside: statistics, reset, Prometheus, usage."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from structllm import (
    LLM,
    AsyncLLM,
    EngineDeadError,
    InvalidRequestError,
    SamplingParams,
)
from structllm.testing.faults import inject_fault
from tests.test_server_app import open_server

pytestmark = pytest.mark.anyio

ENGINE: dict[str, Any] = {
    "show_progress": False,
    "max_model_len": 256,
    "num_blocks": 64,
    "block_size": 4,
}
#: 41 byte tokens (BOS + 40): ten full blocks of 4 can be shared
PROMPT = "the same long system prompt, said again."
GREEDY = SamplingParams(temperature=0, max_tokens=4)


@pytest.mark.parametrize("executor", ["inline", "process"])
async def test_hit_rate_and_reset(executor: str) -> None:
    async with AsyncLLM.open("tiny-random", executor=executor, **ENGINE) as llm:
        first = await llm.complete(PROMPT, GREEDY)
        second = await llm.complete(PROMPT, GREEDY)
        assert first.num_cached_tokens == 0
        assert second.num_cached_tokens == 40
        assert second.text == first.text
        stats = llm.statistics()
        assert stats.prefix_cache_queries == 2 * len(first.prompt_token_ids)
        assert stats.prefix_cache_hits == 40
        assert stats.prefix_cache_hit_rate == pytest.approx(40 / (2 * 41))

        dropped = await llm.reset_prefix_cache()
        assert dropped >= 10  # the prompt's blocks, and its output's
        again = await llm.complete(PROMPT, GREEDY)
        assert again.num_cached_tokens == 0  # forgotten
        assert again.text == first.text
        assert await llm.reset_prefix_cache() >= 10
        assert await llm.reset_prefix_cache() == 0


async def test_counts_survive_a_core_restart() -> None:
    engine = {**ENGINE, "restart_backoff": 0.01}
    one = SamplingParams(temperature=0, max_tokens=1)  # one step per request
    with inject_fault("exit_at_step:1"):
        async with AsyncLLM.open("tiny-random", executor="process", **engine) as llm:
            await llm.complete(PROMPT, one)  # step 0
            before = llm.statistics()
            assert before.prefix_cache_queries == 41
            with pytest.raises(EngineDeadError):
                await llm.complete(PROMPT, one)  # the core exits at step 1
            with anyio.fail_after(30):
                await llm.wait_statistics(lambda s: s.ready and s.restarts == 1)
            out = await llm.complete(PROMPT, GREEDY)
            assert out.num_cached_tokens == 0  # a new core has an empty cache
            stats = llm.statistics()
            assert stats.prefix_cache_queries >= before.prefix_cache_queries + 41
            assert stats.prefix_cache_hits >= before.prefix_cache_hits


async def test_reset_fails_cleanly_when_the_engine_is_closing() -> None:
    async with AsyncLLM.open("tiny-random", executor="inline", **ENGINE) as llm:
        pass
    with pytest.raises(EngineDeadError):
        await llm.reset_prefix_cache()


async def test_prometheus_counters_and_cached_tokens_in_usage() -> None:
    async with open_server(engine={"block_size": 4}) as server:
        body = {"model": "tiny-random", "prompt": PROMPT, "max_tokens": 2}
        for _ in range(2):
            resp = await server.http.post("/v1/completions", json=body)
            assert resp.status_code == 200
        usage = resp.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 40
        text = (await server.http.get("/metrics")).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        queries = families["structllm_prefix_cache_queries"]
        hits = families["structllm_prefix_cache_hits"]
        assert queries.type == hits.type == "counter"
        assert queries.samples[0].value == 2 * usage["prompt_tokens"]
        assert hits.samples[0].value == 40


async def test_n_choices_compute_the_prompt_once() -> None:
    async with open_server(engine={"block_size": 4}) as server:
        body = {"model": "tiny-random", "prompt": PROMPT, "max_tokens": 2, "n": 3}
        resp = await server.http.post("/v1/completions", json=body)
        assert resp.status_code == 200
        assert len(resp.json()["choices"]) == 3
        stats = server.llm.statistics()
        # the first choice computes the ten full blocks, the other two read them
        assert stats.prefix_cache_queries == 3 * 41
        assert stats.prefix_cache_hits == 2 * 40


async def test_cache_salt_separates_and_is_validated() -> None:
    async with AsyncLLM.open("tiny-random", executor="inline", **ENGINE) as llm:

        def salted(salt: str | None) -> dict[str, Any]:
            return {"prompt": PROMPT, "cache_salt": salt}

        assert (await llm.complete(salted("alice"), GREEDY)).num_cached_tokens == 0
        assert (await llm.complete(salted("bob"), GREEDY)).num_cached_tokens == 0
        assert (await llm.complete(salted(None), GREEDY)).num_cached_tokens == 0
        again = await llm.complete(salted("alice"), GREEDY)
        assert again.num_cached_tokens == 40
        for bad in ("", 7, "x" * 1025, "tab\there"):
            with pytest.raises(InvalidRequestError) as info:
                await llm.complete({"prompt": PROMPT, "cache_salt": bad}, GREEDY)
            assert info.value.field == "cache_salt"
        with pytest.raises(InvalidRequestError, match="multi_modal_data") as info:
            await llm.complete({"prompt": PROMPT, "multi_modal_data": {}}, GREEDY)
        assert info.value.field == "prompt"


def test_offline_llm_takes_a_cache_salt() -> None:
    llm = LLM("tiny-random", **ENGINE)
    first, salted, plain = llm.generate(
        [
            {"prompt": PROMPT},
            {"prompt": PROMPT, "cache_salt": "s"},
            {"prompt": PROMPT},
        ],
        GREEDY,
        use_tqdm=False,
    )
    assert salted.num_cached_tokens == 0 and plain.num_cached_tokens == 40
    assert salted.outputs[0].token_ids == first.outputs[0].token_ids


async def test_server_cache_salt() -> None:
    async with open_server(engine={"block_size": 4}) as server:
        url = "/v1/completions"

        async def cached(**extra: Any) -> int:
            body = {"model": "tiny-random", "prompt": PROMPT, "max_tokens": 2, **extra}
            resp = await server.http.post(url, json=body)
            assert resp.status_code == 200, resp.text
            return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

        assert await cached(cache_salt="tenant-a") == 0
        assert await cached(cache_salt="tenant-b") == 0
        assert await cached(cache_salt="tenant-a") == 40
        chat = {
            "model": "tiny-random",
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 1,
            "cache_salt": "",
        }
        resp = await server.http.post("/v1/chat/completions", json=chat)
        assert resp.status_code == 400
        assert resp.json()["error"]["param"] == "cache_salt"
