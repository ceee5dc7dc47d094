"""Data parallelism: engine replicas behind one ``AsyncLLM``.

Two replicas give the greedy tokens of one engine for concurrent streams,
and both serve; a request goes to the replica most recently sent the
longest prefix of its prompt, within a load bound, else to the ready
replica with the fewest live requests, so a conversation's next turn meets
its cached prefix; an abort frees the blocks of the replica the request lived on;
a replica killed mid-stream fails only its own requests, restarts and
serves again, while the other's streams finish; no core process outlives
the engine.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import attrs
import httpx
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream
from hypothesis import given, settings
from hypothesis import strategies as st

from structllm import EngineDeadError, ModelLoadError, SamplingParams
from structllm.cli import build_parser
from structllm.config import EngineConfig, FrontendConfig, from_arguments
from structllm.core.block_pool import hash_block_tokens, root_hash
from structllm.core.request import CoreRequest, RequestStepOutput, StepOutput
from structllm.engine.frontend.async_llm import AsyncLLM
from structllm.engine.frontend.core_client import CoreClient
from structllm.engine.frontend.output_processor import (
    OutputProcessor,
    ProcessedOutputs,
)
from structllm.engine.frontend.replicas import ReplicaSet, replica_config
from structllm.engine.frontend.routing import (
    AFFINITY_CAPACITY,
    PrefixRouter,
    affinity_slack,
)
from structllm.engine.protocol import AbortRequests, Heartbeat, decode, encode
from structllm.errors import EngineConfigError, EngineOverloadedError
from structllm.llm import LLM
from structllm.model._paddle import paddle
from structllm.model.checkpoint import write_random_checkpoint
from structllm.model.config import tiny_random_config
from structllm.server.app import build_app
from structllm.server.serving import EngineSlot, ServerConfig
from tests.core_record import user_ids
from tests.processes import wait_gone
from tests.test_tensor_parallel_engine import _BASE as TP_MODEL

pytestmark = pytest.mark.anyio

ENGINE: dict[str, Any] = {
    "max_model_len": 1024,
    "num_blocks": 256,
    "block_size": 8,
    "model_backend": "eager",
}
FRONT = {"show_progress": False}
TOKENIZER = {"tokenizer": "tiny-random"}  # the byte tokenizer
#: tensor parallel's test model (the byte tokenizer's ids fit), longer
MODEL = attrs.evolve(TP_MODEL, max_position_embeddings=1024)
PROMPTS = ["Hello", "The quick brown fox", "data parallel", "a", "bc", "Hello!"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
ENDLESS = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)

#: the expensive tests run on one backend: each open starts two processes
asyncio_only = pytest.mark.parametrize("anyio_backend", ["asyncio"])


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An untied random Llama (tiny-random's tied head mostly echoes its input,
    too weak a check of the tokens)."""
    directory = tmp_path_factory.mktemp("model")
    write_random_checkpoint(directory, MODEL, seed=3)
    return str(directory)


@pytest.fixture(scope="module")
def expected(model: str) -> dict[str, tuple[int, ...]]:
    """Each prompt's greedy tokens from one engine (the offline LLM)."""
    one = LLM(model, show_progress=False, **ENGINE, **TOKENIZER)
    outs = one.generate(PROMPTS, GREEDY, use_tqdm=False)
    tokens = {p: o.outputs[0].token_ids for p, o in zip(PROMPTS, outs, strict=True)}
    assert len({t for ids in tokens.values() for t in ids}) > 6  # not degenerate
    return tokens


async def test_two_replicas_give_the_greedy_tokens_of_one(
    model: str, expected: dict[str, tuple[int, ...]]
) -> None:
    got: dict[str, list[int]] = {}
    async with AsyncLLM.open(
        model, data_parallel_size=2, **ENGINE, **FRONT, **TOKENIZER
    ) as llm:

        async def run(prompt: str) -> None:
            got[prompt] = []
            async with llm.stream(prompt, GREEDY) as s:
                async for out in s:
                    got[prompt] = list(out.outputs[0].token_ids)  # cumulative

        async with anyio.create_task_group() as tg:
            for prompt in PROMPTS:
                tg.start_soon(run, prompt)
        stats = llm.statistics()
        pids = stats.core_pids
    assert {p: tuple(t) for p, t in got.items()} == expected
    assert len(stats.replicas) == 2 and len(set(pids)) == 2
    # both replicas got requests, and none is still placed anywhere
    assert all(r.prefix_cache_queries > 0 for r in stats.replicas)
    assert [r.live_requests for r in stats.replicas] == [0, 0]
    assert stats.prefix_cache_queries == sum(
        r.prefix_cache_queries for r in stats.replicas
    )
    assert stats.num_blocks == 2 * ENGINE["num_blocks"]
    wait_gone(*[pid for pid in pids if pid is not None])


@asyncio_only
async def test_a_conversations_next_turn_meets_its_cached_prefix(model: str) -> None:
    """A second turn that extends the first turn's prompt goes to the first
    turn's replica, though the other is less loaded, and finds its prefix
    there; unrelated requests still spread over both replicas."""
    turn1 = list(b"You are a careful assistant. Tell me about the sea.")  # 6 blocks
    unrelated = [list(b"Unrelated prompt number one, long"), list(b"zz other")]
    async with AsyncLLM.open(
        model, data_parallel_size=2, **ENGINE, **FRONT, **TOKENIZER
    ) as llm:
        first = await llm.complete({"prompt_token_ids": turn1}, GREEDY)
        before = llm.statistics().replicas
        assert [r.prefix_cache_queries > 0 for r in before] == [True, False]
        turn2 = [*turn1, *first.token_ids, *b" And the sky?"]
        async with llm.stream({"prompt_token_ids": unrelated[0]}, ENDLESS) as u1:
            await anext(aiter(u1))  # replica 0: both idle
            async with llm.stream({"prompt_token_ids": turn2}, GREEDY) as second:
                # least loaded would be replica 1; the prefix is on replica 0
                assert [r.live_requests for r in llm.statistics().replicas] == [
                    2,
                    0,
                ]
                async with llm.stream({"prompt_token_ids": unrelated[1]}, GREEDY) as u2:
                    assert [r.live_requests for r in llm.statistics().replicas] == [
                        2,
                        1,
                    ]
                    assert len((await _last(u2)).token_ids) == GREEDY.max_tokens
                assert len((await _last(second)).token_ids) == GREEDY.max_tokens
        after = llm.statistics().replicas
    # turn 2 found turn 1's prompt and answer, all but the last partial block
    shared = (len(turn1) + len(first.token_ids)) // ENGINE["block_size"]
    hits = after[0].prefix_cache_hits - before[0].prefix_cache_hits
    assert hits >= shared * ENGINE["block_size"]
    assert after[1].prefix_cache_hits == 0 and after[1].prefix_cache_queries > 0


@asyncio_only
@pytest.mark.skipif(
    not hasattr(paddle.base.core, "ProcessGroupGloo"),
    reason="this Paddle build has no gloo (CPU) backend",
)
async def test_replicas_of_two_tensor_parallel_ranks(
    model: str, expected: dict[str, tuple[int, ...]]
) -> None:
    """DP=2 x TP=2: four processes, two gloo groups side by side."""
    got: dict[str, tuple[int, ...]] = {}
    async with AsyncLLM.open(
        model,
        data_parallel_size=2,
        tensor_parallel_size=2,
        **ENGINE,
        **FRONT,
        **TOKENIZER,
    ) as llm:

        async def run(prompt: str) -> None:
            got[prompt] = (await llm.complete(prompt, GREEDY)).token_ids

        async with anyio.create_task_group() as tg:
            for prompt in PROMPTS:
                tg.start_soon(run, prompt)
        stats = llm.statistics()
    assert got == expected
    assert all(r.prefix_cache_queries > 0 for r in stats.replicas)


@asyncio_only
async def test_abort_frees_the_blocks_of_its_own_replica() -> None:
    # one sequence a replica and no queue: the engine takes two at once
    async with AsyncLLM.open(
        "tiny-random",
        data_parallel_size=2,
        max_queued_requests=0,
        **{**ENGINE, "max_num_seqs": 1},
        **FRONT,
    ) as llm:
        async with llm.stream("Hello", ENDLESS) as kept:  # replica 0: both idle
            await anext(aiter(kept))
            async with llm.stream("Hello", ENDLESS) as dropped:  # replica 1
                await anext(aiter(dropped))
                mid = llm.statistics()
                assert [r.live_requests for r in mid.replicas] == [1, 1]
                assert all(r.blocks_used > 0 for r in mid.replicas)
                with pytest.raises(EngineOverloadedError):
                    llm.check_admission([1, 2, 3])
            # leaving the inner block aborted the request on replica 1 only:
            # asked at once, its core holds nothing, replica 0's the kept one
            on0, on1 = await llm.inspect_cores()
            assert on0 is not None and on1 is not None
            assert user_ids(on0) == {kept.request_id} and on0.blocks_used > 0
            assert on1.request_ids == [] and on1.blocks_used == 0
            with anyio.fail_after(10):
                stats = await llm.wait_statistics(
                    lambda s: (
                        s.replicas[1].blocks_used == 0 and s.replicas[1].running == 0
                    )
                )
            r0, r1 = stats.replicas
            assert r1.live_requests == 0
            assert r0.live_requests == 1 and r0.blocks_used > 0
        with anyio.fail_after(10):
            stats = await llm.wait_statistics(
                lambda s: s.blocks_used == 0 and s.running == 0
            )
        assert stats.live_requests == 0 and stats.restarts == 0
        out = await llm.complete("Hello", GREEDY)
        assert len(out.token_ids) == GREEDY.max_tokens


@asyncio_only
async def test_sigkill_of_one_replica_fails_only_its_requests() -> None:
    async with AsyncLLM.open(
        "tiny-random",
        data_parallel_size=2,
        max_restarts=2,
        restart_backoff=0.05,
        **ENGINE,
        **FRONT,
    ) as llm:
        old0, old1 = llm.statistics().core_pids
        assert old0 is not None and old1 is not None
        results: dict[int, tuple[int, ...] | EngineDeadError] = {}
        entered = [anyio.Event() for _ in range(4)]

        async def run(i: int) -> None:
            if i:  # enter in order: replicas 0, 1, 0, 1
                await entered[i - 1].wait()
            try:
                async with llm.stream("Hello", LONG) as s:
                    entered[i].set()
                    tokens: list[int] = []
                    async for out in s:
                        tokens = list(out.outputs[0].token_ids)
                results[i] = tuple(tokens)
            except EngineDeadError as exc:
                results[i] = exc

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(run, i)
            await entered[3].wait()
            assert [r.live_requests for r in llm.statistics().replicas] == [2, 2]
            await llm.wait_statistics(lambda s: s.replicas[1].running > 0)
            os.kill(old1, signal.SIGKILL)
        for i in (1, 3):
            err = results[i]
            assert isinstance(err, EngineDeadError), err
            assert "replica 1 died" in str(err) and err.__cause__ is not None
        for i in (0, 2):
            assert results[i] == results[0] and len(results[0]) == 200  # type: ignore[arg-type]
        # replica 1 restarts; replica 0 never stopped
        with anyio.fail_after(60):
            stats = await llm.wait_statistics(lambda s: s.replicas[1].ready)
        new0, new1 = stats.core_pids
        assert new0 == old0 and new1 not in (None, old1)
        assert [r.restarts for r in stats.replicas] == [0, 1]
        assert not stats.dead and stats.live_requests == 0
        # and serves again: two requests at once go one to each replica
        before = stats.replicas[1].prefix_cache_queries
        async with llm.stream("Hello", GREEDY) as a, llm.stream("Hi", GREEDY) as b:
            assert [r.live_requests for r in llm.statistics().replicas] == [1, 1]
            n = [len((await _last(s)).token_ids) for s in (a, b)]
        assert n == [GREEDY.max_tokens] * 2
        assert llm.statistics().replicas[1].prefix_cache_queries > before
    assert new1 is not None
    wait_gone(old0, old1, new1)


@asyncio_only
async def test_a_bad_checkpoint_fails_open_unwrapped(tmp_path: Path) -> None:
    write_random_checkpoint(tmp_path, tiny_random_config())
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(ModelLoadError, match="safetensors"):
        async with AsyncLLM.open(
            str(tmp_path), tokenizer="tiny-random", data_parallel_size=2, **FRONT
        ):
            pytest.fail("open() should have failed")  # pragma: no cover


async def test_the_server_serves_and_reports_two_replicas() -> None:
    """``structllm serve --data-parallel-size 2``'s app: /health, a completion,
    and /metrics summing the replicas."""
    slot = EngineSlot()
    app = build_app(slot, ServerConfig(model_name="tiny-random"))
    transport = httpx.ASGITransport(app=app)
    async with (
        httpx.AsyncClient(transport=transport, base_url="http://t") as http,
        AsyncLLM.open("tiny-random", data_parallel_size=2, **ENGINE, **FRONT) as llm,
    ):
        slot.llm = llm
        assert (await http.get("/health")).status_code == 200
        body = {"prompt": "x", "max_tokens": 3, "ignore_eos": True}
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        metrics = (await http.get("/metrics")).text
        assert "structllm_engine_healthy 1.0" in metrics
        assert "structllm_generation_tokens_total 3.0" in metrics
        slot.llm = None


# ------------------------------------------------ routing, without processes


class _Front(OutputProcessor):
    """The live requests (none here): records what the set tells it."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[list[RequestStepOutput]] = []
        self.lost: list[list[str]] = []

    def process_outputs(
        self, step_outputs: Iterable[RequestStepOutput]
    ) -> ProcessedOutputs:
        self.steps.append(list(step_outputs))
        return ProcessedOutputs([], [], [], [])

    def fail(
        self, core_ids: Iterable[str], make_error: Callable[[], BaseException]
    ) -> None:
        self.lost.append(list(core_ids))
        assert "replica" in str(make_error())


def _request(
    rid: str, prompt: Sequence[int] = (1,), salt: str | None = None
) -> CoreRequest:
    return CoreRequest(
        request_id=rid,
        prompt_token_ids=tuple(prompt),
        params=SamplingParams(),
        eos_token_ids=frozenset(),
        cache_salt=salt,
    )


@contextlib.contextmanager
def _replicas(
    n: int, engine: EngineConfig | None = None
) -> Iterator[tuple[ReplicaSet, _Front, list[MemoryObjectReceiveStream[bytes]]]]:
    """A set of ``n`` clients made ready by hand; what each core was sent."""
    front = _Front()
    replicas = ReplicaSet(
        engine or EngineConfig(model="tiny-random"),
        FrontendConfig(data_parallel_size=n),
        front,
    )
    with contextlib.ExitStack() as streams:
        cores = []
        for client in replicas.clients:
            send, receive = anyio.create_memory_object_stream[bytes](100)
            streams.enter_context(send)
            streams.enter_context(receive)
            client._outgoing, client.ready = send, True
            cores.append(receive)
        yield replicas, front, cores


def _sent(core: MemoryObjectReceiveStream[bytes]) -> list[bytes]:
    out = []
    while True:
        try:
            out.append(core.receive_nowait())
        except anyio.WouldBlock:
            return out


def _sent_ids(core: MemoryObjectReceiveStream[bytes]) -> list[str]:
    """The ids of the requests in what ``core`` was sent."""
    out = []
    for frame in _sent(core):
        msg = decode(frame[4:])
        assert isinstance(msg, CoreRequest)
        out.append(msg.request_id)
    return out


def _finished(*core_ids: str) -> StepOutput:
    return StepOutput(
        outputs=tuple(
            RequestStepOutput(rid, (1,), finish_reason="length") for rid in core_ids
        ),
        num_batched_tokens=len(core_ids),
        num_seqs=len(core_ids),
    )


def test_a_request_goes_to_the_ready_replica_with_fewest_live_requests() -> None:
    with _replicas(3) as (replicas, front, cores):
        for rid in "abcd":
            replicas.submit_nowait(_request(rid))
        assert replicas.placement == {"a": 0, "b": 1, "c": 2, "d": 0}
        assert [_sent_ids(c) for c in cores] == [["a", "d"], ["b"], ["c"]]
        replicas.clients[1].ready = False  # restarting: skipped though least loaded
        replicas.submit_nowait(_request("e"))
        assert replicas.placement["e"] == 2
        # a request the core finishes is no longer live on its replica
        replicas.on_step(0, _finished("a", "d"))
        assert front.steps and replicas.load == [0, 1, 2]
        replicas.submit_nowait(_request("f"))
        assert replicas.placement["f"] == 0
        # a replica that died a moment ago (teardown not run yet) passes it on
        cores[0].close()
        replicas.submit_nowait(_request("g"))
        assert replicas.placement["g"] == 2
        for client in replicas.clients:
            client.ready = False
        with pytest.raises(EngineDeadError, match="restarting"):
            replicas.submit_nowait(_request("h"))
        assert "h" not in replicas.placement


def test_a_prompt_goes_where_its_longest_prefix_went_within_the_slack() -> None:
    """Blocks of 8 byte tokens, max_num_seqs 8: a slack of 2 live requests."""
    engine = EngineConfig(model="tiny-random", block_size=8, max_num_seqs=8)
    turn1 = list(range(20))  # two full blocks
    turn2 = [*turn1, 20, 21, 22, 23]  # turn 1 and its answer: three
    other = list(range(100, 120))
    with _replicas(2, engine) as (replicas, _, _):
        replicas.submit_nowait(_request("a", turn1))
        assert replicas.placement["a"] == 0  # nothing known: least loaded
        replicas.submit_nowait(_request("u", other))
        assert replicas.placement["u"] == 1  # unrelated: least loaded
        replicas.submit_nowait(_request("v", other[:8]))
        assert replicas.placement["v"] == 1  # one block of "u": its replica
        assert replicas.load == [1, 2]
        replicas.submit_nowait(_request("b", turn2))
        assert replicas.placement["b"] == 0  # follows turn 1
        # a salt is its own hash space: "u"'s blocks salted are unknown
        replicas.submit_nowait(_request("s", other, "tenant"))
        assert replicas.placement["s"] == 0  # tied at two: the lowest index
        # replica 0 two requests above the idlest still takes its prefixes
        replicas.on_step(0, _finished("s"))
        replicas.on_step(1, _finished("u", "v"))
        replicas.submit_nowait(_request("c", turn2))
        assert replicas.load == [3, 0] and replicas.placement["c"] == 0
        # three above it does not: the idlest takes it, and is now its holder
        replicas.submit_nowait(_request("d", turn2))
        assert replicas.placement["d"] == 1
        assert replicas.router.affine(replicas.router.prefix_hashes(turn1)) == 1
        # a replica that restarts lost its cache: the prefixes it held last
        # are unknown again (the router keeps one holder a block)
        replicas.on_core_lost(1, RuntimeError("killed"))
        assert replicas.router.affine(replicas.router.prefix_hashes(turn1)) is None
        assert replicas.router.affine(replicas.router.prefix_hashes(other)) is None
        salted = replicas.router.prefix_hashes(other, "tenant")
        assert replicas.router.affine(salted) == 0 and replicas.router.num_hashes == 2


def test_one_replica_or_no_prefix_cache_hashes_nothing() -> None:
    off = EngineConfig(model="tiny-random", block_size=8, enable_prefix_caching=False)
    for n, engine in ((1, EngineConfig(model="tiny-random", block_size=8)), (2, off)):
        with _replicas(n, engine) as (replicas, _, _):
            replicas.submit_nowait(_request("a", list(range(40))))
            replicas.submit_nowait(_request("b", list(range(40))))
            assert replicas.router.num_hashes == 0
            assert replicas.placement == {"a": 0, "b": n - 1}


async def test_reset_prefix_cache_forgets_every_prefix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def reset(client: CoreClient) -> int:
        return 1

    monkeypatch.setattr(CoreClient, "reset_prefix_cache", reset)
    engine = EngineConfig(model="tiny-random", block_size=8)
    with _replicas(2, engine) as (replicas, _, _):
        replicas.submit_nowait(_request("a", list(range(16))))
        assert replicas.router.num_hashes == 2
        assert await replicas.reset_prefix_cache() == 2
        assert replicas.router.num_hashes == 0


def test_the_router_hashes_blocks_as_the_prefix_cache_does() -> None:
    router = PrefixRouter(block_size=4, slack=1)
    tokens = list(range(11))
    first = hash_block_tokens(root_hash("s"), tokens[:4])
    assert router.prefix_hashes(tokens, "s") == [
        first,
        hash_block_tokens(first, tokens[4:8]),
    ]
    assert router.prefix_hashes(tokens[:3]) == []


def test_the_router_forgets_a_prompts_tail_before_its_head() -> None:
    router = PrefixRouter(block_size=1, slack=1, capacity=3)
    router.record(router.prefix_hashes([1, 2, 3, 4, 5]), 1)
    assert router.num_hashes == 3
    assert router.affine(router.prefix_hashes([1, 2, 3])) == 1
    assert router.affine(router.prefix_hashes([1, 2, 3, 4])) == 1  # via [1, 2, 3]
    assert router.prefix_hashes([1, 2, 3, 4])[-1] not in router._owners


def test_the_slack_is_a_quarter_batch() -> None:
    assert [affinity_slack(n) for n in (1, 4, 8, 64)] == [1, 1, 2, 16]
    assert AFFINITY_CAPACITY == 65536


@attrs.frozen
class _Route:
    """Submit ``tokens`` (salted or not) with these loads and readiness."""

    tokens: tuple[int, ...]
    salt: str | None
    load: tuple[int, ...]
    ready: tuple[bool, ...]


@attrs.frozen
class _Lose:
    replica: int


_REPLICAS = 3
_routes = st.builds(
    _Route,
    # a small alphabet and short prompts: shared prefixes are common
    tokens=st.lists(st.integers(0, 2), min_size=0, max_size=9).map(tuple),
    salt=st.sampled_from([None, None, "t"]),
    load=st.lists(st.integers(0, 6), min_size=_REPLICAS, max_size=_REPLICAS).map(tuple),
    ready=st.lists(st.booleans(), min_size=_REPLICAS, max_size=_REPLICAS).map(tuple),
)
_ops = st.lists(
    st.one_of(_routes, _routes, _routes, st.builds(_Lose, st.integers(0, 2))),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(ops=_ops, block_size=st.integers(1, 3), slack=st.integers(0, 3))
def test_the_router_matches_a_model_of_every_prompt_routed(
    ops: list[_Route | _Lose], block_size: int, slack: int
) -> None:
    """The router against a list of every prompt it routed: the replica it
    prefers holds the longest prefix known, the one most recently sent a
    prompt with it unless that replica was lost since (one holder a block);
    the replica it picks is ready and within the slack of the least loaded;
    its memory stays within capacity."""
    router = PrefixRouter(block_size=block_size, slack=slack, capacity=1000)
    small = PrefixRouter(block_size=block_size, slack=slack, capacity=4)
    routed: list[tuple[tuple[int, ...], str | None, int]] = []  # oldest first
    lost: list[tuple[int, int]] = []  # (replica, len(routed) when lost)
    for op in ops:
        if isinstance(op, _Lose):
            router.forget_replica(op.replica)
            small.forget_replica(op.replica)
            lost.append((op.replica, len(routed)))
            continue
        blocks = len(op.tokens) // block_size
        holder = None
        for depth in range(blocks, 0, -1):
            n = depth * block_size
            sent = [
                (when, k)
                for when, (tokens, salt, k) in enumerate(routed)
                if salt == op.salt and tokens[:n] == op.tokens[:n]
            ]
            if not sent:
                continue
            when, k = sent[-1]
            if not any(r == k and at > when for r, at in lost):
                holder = k
                break
        hashes = router.prefix_hashes(op.tokens, op.salt)
        assert router.affine(hashes) == holder
        order = router.order(hashes, op.load, op.ready)
        up = [k for k in range(_REPLICAS) if op.ready[k]]
        assert sorted(order) == up
        if not up:
            continue
        least = min(op.load[k] for k in up)
        chosen = order[0]
        assert op.load[chosen] - least <= slack
        if holder is not None and op.ready[holder] and op.load[holder] - least <= slack:
            assert chosen == holder
        else:
            assert (op.load[chosen], chosen) == min((op.load[k], k) for k in up)
        assert order[1:] == sorted(order[1:], key=lambda k: (op.load[k], k))
        router.record(hashes, chosen)
        small.record(hashes, chosen)
        assert small.num_hashes <= 4
        routed.append((op.tokens, op.salt, chosen))


def test_aborts_go_to_the_replica_of_each_request() -> None:
    with _replicas(2) as (replicas, _, cores):
        for rid in "abc":
            replicas.submit_nowait(_request(rid))
        _ = [_sent(c) for c in cores]
        # "x" is no longer placed (already aborted): every replica hears of it
        replicas.send_nowait(AbortRequests(["b", "a", "x"]))
        assert _sent(cores[0]) == [encode(AbortRequests(["a", "x"]))]
        assert _sent(cores[1]) == [encode(AbortRequests(["b", "x"]))]
        assert replicas.placement == {"c": 0} and replicas.load == [1, 0]


def test_a_lost_replica_fails_only_the_requests_placed_on_it() -> None:
    with _replicas(2) as (replicas, front, _):
        for rid in "abc":
            replicas.submit_nowait(_request(rid))
        replicas.on_core_lost(0, RuntimeError("killed"))
        assert front.lost == [["a", "c"]]
        assert replicas.placement == {"b": 1} and replicas.load == [0, 1]


def test_statistics_sum_the_replicas() -> None:
    with _replicas(2) as (replicas, _, _):
        replicas.submit_nowait(_request("a"))
        replicas.clients[0].counts = Heartbeat(2, 1, 5)
        replicas.clients[1].counts = Heartbeat(1, 0, 3)
        replicas.clients[1].ready = False
        stats = replicas.statistics(live_requests=1)
        assert (stats.running, stats.waiting, stats.blocks_used) == (3, 1, 8)
        assert stats.ready and not stats.dead and stats.live_requests == 1
        assert [r.live_requests for r in stats.replicas] == [1, 0]
        assert [r.ready for r in stats.replicas] == [True, False]


@pytest.mark.parametrize("after_start", [False, True])
async def test_a_supervisor_failure_comes_out_unwrapped(
    monkeypatch: pytest.MonkeyPatch, after_start: bool
) -> None:
    """As from one client: a startup failure (or, later, a supervisor's own
    bug) raises as itself, and the other replicas are stopped."""
    stopped = anyio.Event()

    async def run(
        client: CoreClient, *, task_status: anyio.abc.TaskStatus[None]
    ) -> None:
        if client is replicas.clients[0]:
            task_status.started()
            try:
                await anyio.sleep_forever()
            finally:
                stopped.set()
        if after_start:
            task_status.started()
            await anyio.lowlevel.checkpoint()
        raise ModelLoadError("no weights")

    monkeypatch.setattr(CoreClient, "run", run)
    # in a task group, as AsyncLLM runs it: one plain error, no nested group
    with (
        _replicas(2) as (replicas, _, _),
        pytest.RaisesGroup(pytest.RaisesExc(ModelLoadError, match="no weights")),
    ):
        async with anyio.create_task_group() as tg:
            await tg.start(replicas.run)
            await anyio.sleep_forever()
    assert stopped.is_set()


def test_each_replica_gets_its_share_of_the_cores() -> None:
    cores = len(os.sched_getaffinity(0))
    engine = EngineConfig(model="tiny-random")
    assert replica_config(engine, 1) is engine
    assert replica_config(engine, 2).num_threads == max(1, cores // 2)
    tp = EngineConfig(model="tiny-random", tensor_parallel_size=2)
    assert replica_config(tp, 2).num_threads == max(1, cores // 4)
    mine = EngineConfig(model="tiny-random", num_threads=3)
    assert replica_config(mine, 2).num_threads == 3


# ------------------------------------------------------------------- config


def test_data_parallel_size_must_be_positive() -> None:
    with pytest.raises(EngineConfigError) as info:
        FrontendConfig(data_parallel_size=0)
    assert info.value.field == "data_parallel_size"


def test_the_inline_executor_refuses_data_parallel() -> None:
    with pytest.raises(EngineConfigError, match="executor='process'") as info:
        FrontendConfig(data_parallel_size=2, executor="inline")
    assert info.value.field == "data_parallel_size"


def test_offline_llm_refuses_data_parallel_naming_the_field() -> None:
    with pytest.raises(EngineConfigError, match="AsyncLLM") as info:
        LLM("tiny-random", data_parallel_size=2, show_progress=False)
    assert info.value.field == "data_parallel_size"


def test_serve_takes_the_flag() -> None:
    ns = build_parser().parse_args(
        ["serve", "tiny-random", "--data-parallel-size", "2"]
    )
    assert from_arguments(FrontendConfig, ns).data_parallel_size == 2


# ------------------------------------------------------------------ helpers


async def _last(stream: Any) -> Any:
    """A stream's last output (its completion)."""
    last = None
    async for out in stream:
        last = out
    assert last is not None
    return last.outputs[0]
