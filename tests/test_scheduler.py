"""The scheduler batches, chunks, preempts, aborts and shares cached prefix
blocks without losing a block or changing a single generated token.

The "model" is a pure function of (request id, position), so every request's
completion is known in advance; a fake runner keeps a simulated KV cache in
the blocks the scheduler hands out and checks, before each sample, that the
request's blocks hold exactly the KV of its own tokens: at each position, a
digest of the cache salt and every token up to it (what real KV depends
on), so a block shared by two requests passes only when their prefixes and
salts are equal. It also refuses any write into a block that is shared or
registered in the prefix cache.

With speculation on, a fake proposer guesses each request's next tokens,
some right and some wrong: the completions must not change by a token, and
rejected positions must leave no block behind.
"""

from __future__ import annotations

import itertools
import zlib
from collections import Counter
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, currently_in_test_context, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from structllm.core.block_pool import BlockPool
from structllm.core.request import Request, RequestStatus
from structllm.core.scheduler import (
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from structllm.params import SamplingParams
from tests.strategies import (
    EOS_TOKEN_ID,
    VOCAB_SIZE,
    RequestSpec,
    SchedulerSetup,
    request_specs,
    scheduler_setups,
)

# -- the fake model ----------------------------------------------------------


def fake_token(request_id: str, position: int) -> int:
    """The token the fake model samples for position ``position``."""
    return zlib.crc32(f"{request_id}/{position}".encode()) % VOCAB_SIZE


#: prompts of different variants share this many leading tokens
SHARED_PREFIX = 6


def prompt_tokens(prompt_len: int, variant: int = 0) -> tuple[int, ...]:
    return tuple(
        (3 * i + 1 + (variant if i >= SHARED_PREFIX else 0)) % VOCAB_SIZE
        for i in range(prompt_len)
    )


@attrs.frozen
class FakeProposer:
    """Proposes up to ``k`` tokens, a pure function of the request's state:
    often the fake model's own (accepted), sometimes a wrong one (the
    rest of the run rejected), sometimes fewer than ``k`` or none."""

    def propose(self, request: Request, k: int) -> list[int]:
        pos = request.num_tokens
        h = zlib.crc32(f"propose/{request.request_id}/{pos}".encode())
        out = []
        for j in range(h % (k + 2)):
            token = fake_token(request.request_id, pos + j)
            if (h >> (8 + j)) % 5 == 0:
                token = (token + 1) % VOCAB_SIZE  # a wrong guess
            out.append(token)
        return out


def kv_digests(salt: str | None, tokens: Sequence[int]) -> list[int]:
    """What the fake KV cache holds at each position of ``tokens``."""
    out = []
    h = hash(("salt", salt))
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out


@attrs.frozen
class Completion:
    token_ids: tuple[int, ...]
    finish_reason: str
    stop_reason: int | None


def expected_completion(req: Request) -> Completion:
    """What ``req`` must finish with, read off the fake model directly."""
    params = req.params
    out: list[int] = []
    while True:
        token = fake_token(req.request_id, len(req.prompt_token_ids) + len(out))
        out.append(token)
        if len(out) >= params.min_tokens:
            if token in params.stop_token_ids:
                return Completion(tuple(out), "stop", token)
            if token in req.eos_token_ids and not params.ignore_eos:
                return Completion(tuple(out), "stop", None)
        if len(out) >= req.max_new_tokens:
            return Completion(tuple(out), "length", None)


@attrs.define(eq=False)
class FakeRunner:
    """Runs chunks against a simulated KV cache; samples from ``fake_token``.

    Each cache slot holds the digest of (salt, tokens up to its position); a
    block that goes back to the pool uncached loses its contents.
    """

    pool: BlockPool
    slots: dict[int, int] = attrs.Factory(dict)
    #: tokens run through the fake model, ever
    computed_tokens: int = 0

    def _slot(self, req: Request, position: int) -> int:
        bs = self.pool.block_size
        return req.block_ids[position // bs] * bs + position % bs

    def execute(self, output: SchedulerOutput) -> dict[str, tuple[int, ...]]:
        bs, pool = self.pool.block_size, self.pool
        for slot in [
            s
            for s in self.slots
            if pool.ref_count(s // bs) == 0 and pool.block_hash(s // bs) is None
        ]:
            del self.slots[slot]
        sampled: dict[str, tuple[int, ...]] = {}
        for chunk in output.chunks:
            req = chunk.request
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted after the schedule: nothing of it runs
            drafts = chunk.draft_token_ids
            start, stop = chunk.context_len, chunk.context_len + chunk.num_tokens
            own = stop - len(drafts)  # the request's own tokens end here
            assert start == req.num_computed_tokens
            assert 1 <= own - start <= req.num_pending_tokens
            assert chunk.samples == (own == req.num_tokens)
            if drafts:
                assert chunk.samples and own - start == 1
                room = req.max_new_tokens - len(req.output_token_ids)
                assert len(drafts) < room  # the tokens after them fit too
            assert len(req.block_ids) == self.pool.blocks_for(stop)
            assert len(req.token_slice(start, own)) == own - start
            kv = kv_digests(req.cache_salt, [*req.token_slice(0, own), *drafts])
            for pos in range(start, stop):
                block = req.block_ids[pos // bs]
                assert pool.ref_count(block) == 1, f"write into shared block {block}"
                assert pool.block_hash(block) is None, f"write into cached {block}"
                self.slots[self._slot(req, pos)] = kv[pos]
            self.computed_tokens += chunk.num_tokens
            if chunk.samples:
                for pos in range(own):
                    assert self.slots.get(self._slot(req, pos)) == kv[pos], (
                        f"KV cache of {req.request_id!r} is wrong at position {pos}"
                    )
                # verify: the model's token at each position, up to the
                # first that differs from the proposal
                tokens = []
                for j in range(len(drafts) + 1):
                    tokens.append(fake_token(req.request_id, own + j))
                    if j == len(drafts) or drafts[j] != tokens[-1]:
                        break
                sampled[req.request_id] = tuple(tokens)
                note_event(f"accepted {len(tokens) - 1} of {len(drafts)}")
        return sampled


# -- a scheduler with its pool, runner and bookkeeping ------------------------


@attrs.define(eq=False)
class Harness:
    scheduler: Scheduler
    runner: FakeRunner
    _sequence: itertools.count[int] = attrs.Factory(itertools.count)
    #: every request that finished with stop/length, in order
    finished: list[Request] = attrs.Factory(list)
    aborted: list[Request] = attrs.Factory(list)
    #: every request ever added (to know what each block hash stands for)
    added: list[Request] = attrs.Factory(list)
    _evictions: int = 0

    @classmethod
    def build(
        cls,
        *,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 1024,
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = True,
        num_speculative_tokens: int = 0,
        disable_by_batch_size: int | None = None,
    ) -> Harness:
        assert num_blocks * block_size >= max_model_len  # as EngineCore checks
        pool = BlockPool(num_blocks, block_size)
        config = SchedulerConfig(
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
            enable_prefix_caching=enable_prefix_caching,
            num_speculative_tokens=num_speculative_tokens,
            disable_by_batch_size=disable_by_batch_size,
        )
        proposer = FakeProposer() if num_speculative_tokens else None
        return cls(Scheduler(config, pool, proposer=proposer), FakeRunner(pool))

    @classmethod
    def from_setup(
        cls,
        setup: SchedulerSetup,
        *,
        caching: bool = True,
        speculative: int = 0,
        disable_by_batch_size: int | None = None,
    ) -> Harness:
        return cls.build(
            **attrs.asdict(setup),
            enable_prefix_caching=caching,
            num_speculative_tokens=speculative,
            disable_by_batch_size=disable_by_batch_size,
        )

    @property
    def pool(self) -> BlockPool:
        return self.scheduler.pool

    def make_request(self, request_id: str, spec: RequestSpec) -> Request:
        """Build a Request the way ``EngineCore._admit`` does."""
        max_model_len = self.scheduler.config.max_model_len
        assert 1 <= spec.prompt_len < max_model_len
        room = max_model_len - spec.prompt_len
        params = SamplingParams(
            max_tokens=spec.max_tokens,
            min_tokens=spec.min_tokens,
            stop_token_ids=spec.stop_token_ids,
            ignore_eos=spec.ignore_eos,
        )
        seq = next(self._sequence)
        return Request(
            request_id=request_id,
            prompt_token_ids=prompt_tokens(spec.prompt_len, spec.prompt_variant),
            params=params,
            eos_token_ids=frozenset({EOS_TOKEN_ID}),
            priority=spec.priority,
            arrival_time=float(seq),
            sequence_number=seq,
            max_new_tokens=min(spec.max_tokens or room, room),
            generator=np.random.default_rng(seq),
            cache_salt=spec.cache_salt,
        )

    def add_request(self, req: Request) -> None:
        self.scheduler.add_request(req)
        self.added.append(req)

    def add(self, request_id: str, prompt_len: int, **spec: Any) -> Request:
        req = self.make_request(request_id, RequestSpec(prompt_len=prompt_len, **spec))
        self.add_request(req)
        return req

    def abort(self, request_id: str) -> list[Request]:
        aborted = self.scheduler.abort_requests([request_id])
        self.aborted += aborted
        return aborted

    def step(
        self, abort_after_schedule: str | None = None
    ) -> tuple[SchedulerOutput, list[Request]]:
        """Schedule, run and update once, checking the step as it goes.

        ``abort_after_schedule``: abort that request between the schedule
        and the update (while its proposals are being verified, say)."""
        sched = self.scheduler
        running_before = list(sched.running)
        waiting_before = list(sched.waiting)
        out = sched.schedule()

        limit = sched.config.disable_by_batch_size
        if out.num_draft_tokens:
            note_event("speculated")
            assert limit is None or len(sched.running) <= limit
        for chunk in out.chunks:
            assert len(chunk.draft_token_ids) <= sched.config.num_speculative_tokens
        budget = sched.config.max_num_batched_tokens
        assert out.num_batched_tokens <= budget
        assert len(sched.running) <= sched.config.max_num_seqs
        scheduled = [c.request for c in out.chunks]
        assert len(set(map(id, scheduled))) == len(scheduled)
        for req in scheduled:
            assert sched.requests.get(req.request_id) is req
            assert all(req is not r for r in self.aborted)
            assert req.status is RequestStatus.RUNNING
        # victims go back to waiting, hold nothing, and are not run this step
        # (the least urgent running requests, taken from the back)
        victims = [r for r in running_before if r.request_id in out.preempted]
        assert [r.request_id for r in reversed(victims)] == list(out.preempted)
        assert victims == running_before[len(running_before) - len(victims) :]
        for req in victims:
            assert req.status is RequestStatus.PREEMPTED
            assert req in sched.waiting
            assert (req.block_ids, req.num_computed_tokens) == ([], 0)
            assert all(req is not r for r in scheduled)
        # running requests first, in order, then a prefix of the waiting queue
        survivors = [r for r in running_before if r not in victims]
        n_old = sum(any(r is s for s in running_before) for r in scheduled)
        assert scheduled[:n_old] == survivors[:n_old]
        admitted = scheduled[n_old:]
        assert admitted == waiting_before[: len(admitted)]
        if out.preempted:
            assert not admitted
        bs = self.pool.block_size
        for chunk in out.chunks[n_old:]:
            req = chunk.request
            # an admitted request takes exactly the longest cached chain that
            # leaves it a token to compute, and those blocks come first
            usable = (req.num_tokens - 1) // bs
            hit = self.pool.lookup(req.block_hashes[:usable])
            if not sched.config.enable_prefix_caching:
                assert hit == [] and req.block_hashes == []
            assert chunk.context_len == len(hit) * bs < req.num_tokens
            assert req.block_ids[: len(hit)] == hit
            if hit:
                note_event("prefix cache hit")
        if n_old < len(survivors):  # a running request was left out...
            assert out.num_batched_tokens == budget  # ...only for want of budget

        if out.preempted:
            note_event("preempted")
        if any(not c.samples for c in out.chunks):
            note_event("chunked prefill")
        if any(self.pool.ref_count(b) > 1 for b in range(self.pool.num_blocks)):
            note_event("block shared by running requests")
        evictions = self.pool.statistics().total_evictions
        if abort_after_schedule is not None:
            if any(c.draft_token_ids for c in out.chunks):
                note_event("abort during a verification step")
            self.abort(abort_after_schedule)
        sampled = self.runner.execute(out)
        finished = sched.update_from_output(out, sampled)
        assert {r.request_id for r in finished} <= set(sampled)
        for req in finished:
            completion = expected_completion(req)
            assert req.status is RequestStatus.FINISHED
            assert req.request_id not in sched.requests
            assert req.block_ids == []
            assert (
                tuple(req.output_token_ids),
                req.finish_reason,
                req.stop_reason,
            ) == attrs.astuple(completion)
            if req.finish_reason == "length":
                assert len(req.output_token_ids) == req.max_new_tokens
            else:
                assert len(req.output_token_ids) >= req.params.min_tokens
            note_event(f"finished: {req.finish_reason}")
            if req.num_preemptions:
                note_event("finished after preemption")
        self.finished += finished
        if evictions > self._evictions:
            note_event("cached block evicted")
        self._evictions = evictions
        return out, finished

    def run_until_done(self, max_steps: int = 10_000) -> list[SchedulerOutput]:
        outs: list[SchedulerOutput] = []
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return outs
            outs.append(self.step()[0])
            check_invariants(self)
        raise AssertionError(f"requests still live after {max_steps} steps")


def note_event(name: str) -> None:
    """Count ``name`` in Hypothesis' statistics when under Hypothesis."""
    if currently_in_test_context():
        event(name)


def check_invariants(h: Harness) -> None:
    sched, pool = h.scheduler, h.pool
    bs = pool.block_size
    assert pool.num_free + pool.num_used == pool.num_blocks
    # each block free-uncached, free-cached or referenced: the pool's books
    pool.audit()
    assert pool.num_cached == sum(
        pool.ref_count(b) == 0 and pool.block_hash(b) is not None
        for b in range(pool.num_blocks)
    )
    # every block registered in the cache holds the KV its hash names
    known: dict[bytes, list[int]] = {}
    for req in h.added:
        kv = kv_digests(req.cache_salt, req.token_slice(0, len(req.block_hashes) * bs))
        for i, block_hash in enumerate(req.block_hashes):
            assert (
                known.setdefault(block_hash, kv[i * bs : (i + 1) * bs])
                == (kv[i * bs : (i + 1) * bs])
            ), "two different prefixes hashed alike"
    for b in range(pool.num_blocks):
        block_hash = pool.block_hash(b)
        if block_hash is not None:
            assert [h.runner.slots.get(b * bs + j) for j in range(bs)] == known[
                block_hash
            ], f"cached block {b} does not hold the KV of its hash"
    if not sched.config.enable_prefix_caching:
        assert pool.num_cached == 0
        assert all(pool.block_hash(b) is None for b in range(pool.num_blocks))
    assert len(sched.running) <= sched.config.max_num_seqs

    # every live request is in exactly one queue, and nothing else is queued
    queued = Counter(map(id, sched.waiting + sched.running))
    assert set(queued.values()) <= {1}
    assert set(queued) == set(map(id, sched.requests.values()))
    for rid, req in sched.requests.items():
        assert req.request_id == rid
    assert sched.waiting == sorted(sched.waiting, key=lambda r: r.sort_key)
    assert sched.running == sorted(sched.running, key=lambda r: r.sort_key)

    for req in sched.waiting:
        assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert (req.block_ids, req.num_computed_tokens) == ([], 0)
    for req in sched.running:
        assert req.status is RequestStatus.RUNNING
        assert 1 <= req.num_computed_tokens <= req.num_tokens
        assert len(req.block_ids) == pool.blocks_for(req.num_computed_tokens)
        if sched.config.enable_prefix_caching:
            # every full computed block has been offered to the cache
            assert req.num_cached_blocks == req.num_computed_tokens // bs
            assert len(req.block_hashes) == req.num_tokens // bs

    # the pool's reference counts are exactly the running requests' blocks
    held = Counter(b for r in sched.running for b in r.block_ids)
    assert [pool.ref_count(b) for b in range(pool.num_blocks)] == [
        held[b] for b in range(pool.num_blocks)
    ]
    assert pool.num_used == len(held)

    # live requests have generated a prefix of what they must finish with
    for req in sched.requests.values():
        expected = expected_completion(req).token_ids
        assert len(req.output_token_ids) < len(expected)
        assert tuple(req.output_token_ids) == expected[: len(req.output_token_ids)]

    if not sched.has_unfinished_requests():
        assert pool.num_free == pool.num_blocks
        assert all(pool.ref_count(b) == 0 for b in range(pool.num_blocks))

    stats = sched.statistics()
    assert (stats.num_running, stats.num_waiting) == (
        len(sched.running),
        len(sched.waiting),
    )
    assert stats.num_preempted == sum(
        r.status is RequestStatus.PREEMPTED for r in sched.waiting
    )
    assert stats.blocks == pool.statistics()


def drain_bound(h: Harness) -> int:
    """Steps within which every live request must finish.

    Between two completions the head of ``running`` makes progress every
    step and can only be displaced by a request that sorts before it, so at
    most n heads each do at most prompt + output tokens of work.
    """
    n = len(h.scheduler.requests)
    return n * (n + 1) * 2 * h.scheduler.config.max_model_len + n + 1


# -- the state machine --------------------------------------------------------

IDS = [f"r{i}" for i in range(8)]


class SchedulerMachine(RuleBasedStateMachine):
    h: Harness
    used_ids: set[str]

    @initialize(
        setup=scheduler_setups(),
        caching=st.booleans(),
        speculative=st.sampled_from([0, 0, 1, 3, 5]),
        disable_by_batch_size=st.sampled_from([None, 1, 3]),
    )
    def build(
        self,
        setup: SchedulerSetup,
        caching: bool,
        speculative: int,
        disable_by_batch_size: int | None,
    ) -> None:
        self.h = Harness.from_setup(
            setup,
            caching=caching,
            speculative=speculative,
            disable_by_batch_size=disable_by_batch_size,
        )
        self.used_ids = set()
        self.added: list[Request] = []
        self.steps = 0

    @property
    def live(self) -> dict[str, Request]:
        return self.h.scheduler.requests

    def _free_ids(self) -> list[str]:
        return [i for i in IDS if i not in self.live]

    def _add(self, rid: str, spec: RequestSpec) -> None:
        req = self.h.make_request(rid, spec)
        self.h.add_request(req)
        assert req.status is RequestStatus.WAITING
        self.used_ids.add(rid)
        self.added.append(req)

    @precondition(lambda self: len(self.live) < len(IDS))
    @rule(data=st.data())
    def add_request(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self._free_ids()), label="id")
        max_model_len = self.h.scheduler.config.max_model_len
        self._add(rid, data.draw(request_specs(max_model_len), label="spec"))

    @precondition(lambda self: len(self.live) < len(IDS) - 1)
    @rule(data=st.data())
    def pressure(self, data: st.DataObject) -> None:
        """Several long requests at once, to force preemption."""
        free = self._free_ids()
        k = data.draw(st.integers(2, min(4, len(free))), label="k")
        max_model_len = self.h.scheduler.config.max_model_len
        for rid in free[:k]:
            self._add(rid, data.draw(request_specs(max_model_len, long=True)))

    @precondition(lambda self: len(self.live) < len(IDS) - 1)
    @rule(data=st.data())
    def siblings(self, data: st.DataObject) -> None:
        """n > 1: several requests with one prompt, submitted together."""
        free = self._free_ids()
        k = data.draw(st.integers(2, min(3, len(free))), label="n")
        max_model_len = self.h.scheduler.config.max_model_len
        spec = data.draw(request_specs(max_model_len), label="spec")
        for rid in free[:k]:
            self._add(rid, spec)

    @rule()
    def reset_prefix_cache(self) -> None:
        dropped = self.h.scheduler.reset_prefix_cache()
        assert dropped >= 0
        assert self.h.pool.num_cached == 0
        assert all(
            self.h.pool.block_hash(b) is None for b in range(self.h.pool.num_blocks)
        )

    @rule(data=st.data())
    def add_duplicate_is_rejected(self, data: st.DataObject) -> None:
        if not self.live:  # (a precondition here makes Hypothesis give up often)
            return
        rid = data.draw(st.sampled_from(sorted(self.live)), label="id")
        before = self.live[rid]
        dup = self.h.make_request(rid, RequestSpec(prompt_len=1, max_tokens=1))
        with pytest.raises(ValueError, match="already live"):
            self.h.scheduler.add_request(dup)
        assert self.live[rid] is before
        assert all(r is not dup for r in self.h.scheduler.waiting)

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(
            st.sampled_from([*sorted(self.live), *sorted(self.used_ids), "unknown"]),
            label="id",
        )
        req = self.live.get(rid)
        aborted = self.h.abort(rid)
        if req is None:
            assert aborted == []
        else:
            assert aborted == [req]
            assert req.status is RequestStatus.FINISHED
            assert (req.finish_reason, req.block_ids) == ("abort", [])
        assert rid not in self.live
        assert self.h.scheduler.abort_requests([rid]) == []  # idempotent

    @rule(data=st.data())
    def abort_mid_step(self, data: st.DataObject) -> None:
        """Abort a request between a step's schedule and its update."""
        if not self.live:
            return
        rid = data.draw(st.sampled_from(sorted(self.live)), label="id")
        req = self.live[rid]
        self.h.step(abort_after_schedule=rid)
        assert (req.status, req.block_ids) == (RequestStatus.FINISHED, [])
        assert rid not in self.live

    @rule(n=st.integers(1, 8))
    def step(self, n: int) -> None:
        for _ in range(n):
            self.h.step()
            check_invariants(self.h)

    @rule()
    def drain(self) -> None:
        self.h.run_until_done(drain_bound(self.h))

    @invariant()
    def hold_invariants(self) -> None:
        check_invariants(self.h)

    def teardown(self) -> None:
        if not hasattr(self, "h"):
            return
        self.drain()
        assert self.h.pool.num_free == self.h.pool.num_blocks
        # every request ended exactly once, as finished or aborted
        ended = [*self.h.finished, *self.h.aborted]
        assert len(set(map(id, ended))) == len(ended)
        assert set(map(id, ended)) == set(map(id, self.added))


SchedulerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestScheduler = SchedulerMachine.TestCase


# -- examples -----------------------------------------------------------------


def test_running_decodes_go_before_new_prefills() -> None:
    h = Harness.build(
        num_blocks=8, block_size=4, max_model_len=16, max_num_batched_tokens=4
    )
    a = h.add("a", 3, max_tokens=5, ignore_eos=True)
    out, _ = h.step()
    assert [
        (c.request, c.context_len, c.num_tokens, c.samples) for c in out.chunks
    ] == [(a, 0, 3, True)]
    b = h.add("b", 10, max_tokens=1)
    out, _ = h.step()
    # a's decode first, then b's prefill gets what is left of the budget
    assert [
        (c.request, c.context_len, c.num_tokens, c.samples) for c in out.chunks
    ] == [
        (a, 3, 1, True),
        (b, 0, 3, False),
    ]
    check_invariants(h)


def test_chunked_prefill_respects_budget_and_samples_only_at_the_end() -> None:
    h = Harness.build(
        num_blocks=8,
        block_size=2,
        max_model_len=16,
        max_num_batched_tokens=4,
        enable_prefix_caching=False,  # b's prompt is a's prefix
    )
    a = h.add("a", 10, max_tokens=2, ignore_eos=True)
    b = h.add("b", 3, max_tokens=1, ignore_eos=True)
    outs = []
    for _ in range(3):
        out, _ = h.step()
        check_invariants(h)
        outs.append(
            [(c.request, c.context_len, c.num_tokens, c.samples) for c in out.chunks]
        )
        assert out.num_batched_tokens <= 4
    assert outs == [
        [(a, 0, 4, False)],  # b waits: the budget is spent
        [(a, 4, 4, False)],
        [(a, 8, 2, True), (b, 0, 2, False)],
    ]
    assert a.output_token_ids == [fake_token("a", 10)]
    assert b.output_token_ids == []
    assert len(b.block_ids) == 1
    h.run_until_done()
    assert [r.request_id for r in h.finished] == ["a", "b"]


def test_waiting_queue_is_priority_then_arrival() -> None:
    h = Harness.build(num_blocks=4, block_size=4, max_model_len=8, max_num_seqs=1)
    for rid, priority in [("a", 1), ("b", 0), ("c", 1), ("d", 0), ("e", 2)]:
        h.add(rid, 2, max_tokens=1, priority=priority)
    h.run_until_done()
    assert [r.request_id for r in h.finished] == ["b", "d", "a", "c", "e"]


def test_a_large_head_blocks_the_queue() -> None:
    h = Harness.build(
        num_blocks=4, block_size=1, max_model_len=4, enable_prefix_caching=False
    )
    h.add("a", 2, max_tokens=2, ignore_eos=True)
    h.step()
    h.add("big", 3, max_tokens=1)  # needs 3 blocks, 1 free
    h.add("small", 1, max_tokens=1)  # would fit, but must not overtake
    out, _ = h.step()
    assert [c.request.request_id for c in out.chunks] == ["a"]
    h.run_until_done()
    assert [r.request_id for r in h.finished] == ["a", "big", "small"]


def test_without_chunked_prefill_prompts_run_whole() -> None:
    h = Harness.build(
        num_blocks=8,
        block_size=2,
        max_model_len=8,
        max_num_batched_tokens=8,
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
    )
    a = h.add("a", 3, max_tokens=4, ignore_eos=True)
    b = h.add("b", 7, max_tokens=1)
    out, _ = h.step()
    assert [(c.request, c.num_tokens) for c in out.chunks] == [(a, 3)]  # b: 3+7 > 8
    out, _ = h.step()
    assert [(c.request, c.num_tokens, c.samples) for c in out.chunks] == [
        (a, 1, True),
        (b, 7, True),
    ]
    h.run_until_done()


def test_config_without_chunked_prefill_needs_budget_for_a_whole_sequence() -> None:
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(4\) must be >="):
        SchedulerConfig(
            max_model_len=8, max_num_batched_tokens=4, enable_chunked_prefill=False
        )
    SchedulerConfig(max_model_len=8, max_num_batched_tokens=4)  # chunked: fine


def preemption_scenario(*, caching: bool = False) -> Harness:
    """Three requests that fill a 6-block pool; c is oldest but least urgent.

    With ``caching`` their prompts are salted apart, so nothing is shared at
    first, but a victim's blocks stay cached for its return.
    """
    h = Harness.build(
        num_blocks=6, block_size=1, max_model_len=6, enable_prefix_caching=caching
    )
    for rid, priority in [("c", 1), ("a", 0), ("b", 0)]:
        h.add(
            rid,
            2,
            max_tokens=3,
            priority=priority,
            ignore_eos=True,
            cache_salt=rid if caching else None,
        )
    out, _ = h.step()
    assert [c.request.request_id for c in out.chunks] == ["a", "b", "c"]
    assert h.pool.num_free == 0
    return h


def test_preemption_takes_lowest_priority_then_newest() -> None:
    h = preemption_scenario()
    a, b, c = (h.scheduler.requests[x] for x in "abc")

    out, _ = h.step()
    assert out.preempted == ("c",)  # lowest priority, though oldest
    assert [ch.request for ch in out.chunks] == [a, b]
    assert c.status is RequestStatus.PREEMPTED
    assert c in h.scheduler.waiting
    assert (c.block_ids, c.num_computed_tokens, len(c.output_token_ids)) == ([], 0, 1)
    assert h.scheduler.statistics().num_preempted == 1
    check_invariants(h)

    out, _ = h.step()
    assert out.preempted == ("b",)  # same priority as a, but newer
    check_invariants(h)

    h.run_until_done()
    assert [r.request_id for r in h.finished] == ["a", "b", "c"]
    assert (a.num_preemptions, b.num_preemptions, c.num_preemptions) == (0, 1, 1)
    assert h.scheduler.total_preemptions == 2
    for req in (a, b, c):  # recompute is invisible
        assert tuple(req.output_token_ids) == expected_completion(req).token_ids


def test_preempted_request_recomputes_its_outputs() -> None:
    h = preemption_scenario()
    c = h.scheduler.requests["c"]
    h.step()
    assert c.status is RequestStatus.PREEMPTED
    outs = h.run_until_done()
    # when c comes back it runs prompt + generated tokens in one chunk
    rerun = next(ch for o in outs for ch in o.chunks if ch.request is c)
    assert (rerun.context_len, rerun.num_tokens, rerun.samples) == (0, 3, True)


def reach(state: str, caching: bool = False) -> tuple[Harness, str]:
    """A harness with a request id in ``state``, plus other live requests.

    With ``caching``, x's prompt starts with other's, so a running x shares
    other's first block (x first waits a step for other to compute it).
    """
    if state == "preempted":
        h = preemption_scenario(caching=caching)
        h.step()
        assert h.scheduler.requests["c"].status is RequestStatus.PREEMPTED
        return h, "c"
    h = Harness.build(
        num_blocks=8,
        block_size=2,
        max_model_len=16,
        max_num_seqs=2,
        max_num_batched_tokens=4,
        enable_prefix_caching=caching,
    )
    h.add("other", 2, max_tokens=4, ignore_eos=True)
    if state == "waiting":
        h.add("x", 2, max_tokens=4)
        h.add("y", 2, max_tokens=4)
        h.step()
        assert h.scheduler.requests["y"].status is RequestStatus.WAITING
        return h, "y"
    if state == "prefilling":
        h.add("x", 8, max_tokens=4)
        h.step()
        if caching:
            assert h.scheduler.requests["x"].status is RequestStatus.WAITING
            h.step()
        x = h.scheduler.requests["x"]
        assert (x.block_ids[0] == h.scheduler.requests["other"].block_ids[0]) is (
            caching
        )
        assert x.status is RequestStatus.RUNNING
        assert 0 < x.num_computed_tokens < 8
        return h, "x"
    if state == "decoding":
        h.add("x", 1, max_tokens=6, ignore_eos=True)
        h.step()
        h.step()
        x = h.scheduler.requests["x"]
        assert x.status is RequestStatus.RUNNING
        assert len(x.output_token_ids) == 2
        return h, "x"
    if state == "finished":
        h.add("x", 1, max_tokens=1)
        h.step()
        assert [r.request_id for r in h.finished] == ["x"]
        return h, "x"
    assert state == "unknown"
    h.step()
    return h, "x"


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize(
    "state",
    ["waiting", "prefilling", "decoding", "preempted", "finished", "unknown"],
)
def test_abort_frees_everything_in_every_state(state: str, caching: bool) -> None:
    h, rid = reach(state, caching)
    target = h.scheduler.requests.get(rid)
    others = [r for r in h.scheduler.requests.values() if r is not target]
    assert others
    aborted = h.abort(rid)
    if target is None:
        assert aborted == []
    else:
        assert aborted == [target]
        assert (target.status, target.finish_reason) == (
            RequestStatus.FINISHED,
            "abort",
        )
        assert target.block_ids == []
    assert rid not in h.scheduler.requests
    check_invariants(h)
    assert h.abort(rid) == []  # idempotent
    check_invariants(h)

    # the others are unaffected; the aborted one never runs again
    outs = h.run_until_done()
    assert all(ch.request.request_id != rid for o in outs for ch in o.chunks)
    assert h.pool.num_free == h.pool.num_blocks
    assert all(any(r is f for f in h.finished) for r in others)


def test_abort_of_many_ids_ignores_unknown_and_duplicates() -> None:
    h = Harness.build(num_blocks=4, block_size=4, max_model_len=8)
    a = h.add("a", 2)
    b = h.add("b", 2)
    h.step()
    assert h.scheduler.abort_requests(["a", "nope", "a", "b"]) == [a, b]
    assert not h.scheduler.has_unfinished_requests()
    check_invariants(h)


def test_request_ids_are_reusable_after_finish_and_abort() -> None:
    h = Harness.build(num_blocks=4, block_size=4, max_model_len=8)
    first = h.add("a", 2, max_tokens=1)
    with pytest.raises(ValueError, match="already live"):
        h.add("a", 3)
    h.run_until_done()
    second = h.add("a", 3, max_tokens=2, ignore_eos=True)
    h.step()
    assert h.abort("a") == [second]
    third = h.add("a", 1, max_tokens=3, ignore_eos=True)
    h.run_until_done()
    assert h.finished == [first, third]
    assert tuple(third.output_token_ids) == expected_completion(third).token_ids
    check_invariants(h)


@pytest.mark.parametrize(("max_tokens", "expected"), [(3, 3), (None, 5), (9, 5)])
def test_length_is_max_tokens_capped_by_context(
    max_tokens: int | None, expected: int
) -> None:
    h = Harness.build(num_blocks=4, block_size=4, max_model_len=8)
    req = h.add("a", 3, max_tokens=max_tokens, ignore_eos=True)
    h.run_until_done()
    assert req.finish_reason == "length"
    assert len(req.output_token_ids) == expected


def test_stop_token_and_min_tokens() -> None:
    # find an id whose first generated token is EOS, then check min_tokens
    rid = next(
        f"s{i}" for i in itertools.count() if fake_token(f"s{i}", 2) == EOS_TOKEN_ID
    )
    h = Harness.build(num_blocks=4, block_size=4, max_model_len=16)
    stopped = h.add(rid, 2, max_tokens=8)
    h.run_until_done()
    assert (stopped.output_token_ids, stopped.finish_reason) == ([EOS_TOKEN_ID], "stop")
    assert stopped.stop_reason is None

    h2 = Harness.build(num_blocks=4, block_size=4, max_model_len=16)
    held = h2.add(rid, 2, max_tokens=8, min_tokens=2)
    h2.run_until_done()
    assert held.output_token_ids[0] == EOS_TOKEN_ID
    assert len(held.output_token_ids) >= 2

    first = fake_token("t", 2)
    h3 = Harness.build(num_blocks=4, block_size=4, max_model_len=16)
    by_id = h3.add("t", 2, max_tokens=8, stop_token_ids=(first,), ignore_eos=True)
    h3.run_until_done()
    assert (by_id.output_token_ids, by_id.finish_reason, by_id.stop_reason) == (
        [first],
        "stop",
        first,
    )


@attrs.frozen
class OracleProposer:
    """Proposes exactly what the fake model will sample: all accepted."""

    def propose(self, request: Request, k: int) -> list[int]:
        pos = request.num_tokens
        return [fake_token(request.request_id, pos + j) for j in range(k)]


def test_a_stop_inside_an_accepted_run_cuts_it_and_frees_the_rest() -> None:
    h = Harness.build(
        num_blocks=8,
        block_size=4,
        max_model_len=32,
        num_speculative_tokens=6,
        enable_prefix_caching=False,
    )
    h.scheduler.proposer = OracleProposer()
    rid = "r0"
    # the fake model's 4th output token (after the prompt of 3) stops it
    stop = fake_token(rid, 3 + 3)
    req = h.add(rid, 3, max_tokens=20, stop_token_ids=(stop,), ignore_eos=True)
    h.step()  # the prompt, and the first token
    assert len(req.output_token_ids) == 1
    out, finished = h.step()  # 6 proposals, all accepted, cut after the 3rd
    assert out.chunks[0].draft_token_ids == tuple(
        fake_token(rid, 4 + j) for j in range(6)
    )
    assert finished == [req] and req.finish_reason == "stop"
    assert req.output_token_ids == [fake_token(rid, 3 + j) for j in range(4)]
    assert h.pool.num_free == h.pool.num_blocks
    assert h.scheduler.statistics().num_accepted_tokens == 6


def test_proposals_stop_short_of_max_tokens_and_the_budget() -> None:
    h = Harness.build(
        num_blocks=16,
        block_size=4,
        max_model_len=64,
        max_num_batched_tokens=4,
        num_speculative_tokens=8,
    )
    h.scheduler.proposer = OracleProposer()
    req = h.add("r0", 2, max_tokens=7, ignore_eos=True)
    h.step()
    lengths = []
    while h.scheduler.has_unfinished_requests():
        out, _ = h.step()
        lengths.append(len(out.chunks[0].draft_token_ids))
        check_invariants(h)
    # budget 4: 3 proposals; then max_tokens leaves room for 2 (1 + 2 = 3)
    assert lengths == [3, 1]
    assert len(req.output_token_ids) == 7
    stats = h.scheduler.statistics()
    assert (stats.num_drafts, stats.num_draft_tokens) == (2, 4)
    assert stats.acceptance_rate == 1.0


@attrs.frozen
class WrongProposer:
    """Always proposes ``k`` tokens the fake model never samples first."""

    def propose(self, request: Request, k: int) -> list[int]:
        token = fake_token(request.request_id, request.num_tokens)
        return [(token + 1) % VOCAB_SIZE] * k


def test_proposals_that_keep_failing_back_off() -> None:
    h = Harness.build(
        num_blocks=32, block_size=4, max_model_len=128, num_speculative_tokens=4
    )
    h.scheduler.proposer = WrongProposer()
    h.add("r0", 2, max_tokens=60, ignore_eos=True)
    proposed = [len(h.step()[0].chunks[0].draft_token_ids) for _ in range(40)]
    # a miss, then 1, 2, 4, 8 decode steps without proposals, each window
    # half the last; outputs unchanged (the harness checks every token)
    assert (
        proposed[:24] == [0, 4, 0, 2, 0, 0, 1, 0, 0, 0, 0, 1] + [0] * 8 + [1] + [0] * 3
    )
    stats = h.scheduler.statistics()
    assert stats.num_accepted_tokens == 0 and stats.acceptance_rate == 0.0
    # a right guess resets the back-off and grows the window again
    h.scheduler.proposer = OracleProposer()
    while h.scheduler.has_unfinished_requests():
        h.step()
    assert h.scheduler.statistics().num_accepted_tokens > 0
