"""Prefix caching: the pool keeps freed full blocks under their chained hash,
the scheduler reuses them, and nothing a request produces changes.

Pool and scheduler examples here; the scheduler's state machine with
caching is ``tests/test_scheduler.py::TestScheduler``; the real model's
outputs with caching on and off are at the end of this file.
"""

from __future__ import annotations

from collections import Counter

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    rule,
)

from structllm.config import EngineConfig
from structllm.core.block_pool import (
    ROOT_HASH,
    BlockPool,
    NoFreeBlocksError,
    hash_block_tokens,
    root_hash,
)
from structllm.core.engine_core import EngineCore
from structllm.core.request import CoreRequest
from structllm.errors import InvalidRequestError
from structllm.params import SamplingParams
from tests.strategies import RequestSpec
from tests.test_scheduler import (
    Harness,
    check_invariants,
    expected_completion,
)

# -- hashes --------------------------------------------------------------------


def test_block_hash_is_chained_to_its_parent() -> None:
    a = hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])
    assert hash_block_tokens(ROOT_HASH, [1, 2, 3, 4]) == a
    assert hash_block_tokens(ROOT_HASH, [1, 2, 3, 5]) != a
    # the same tokens after a different prefix are a different block
    assert hash_block_tokens(a, [1, 2, 3, 4]) != hash_block_tokens(
        hash_block_tokens(ROOT_HASH, [9, 9, 9, 9]), [1, 2, 3, 4]
    )


def test_salts_separate_hash_spaces() -> None:
    assert root_hash(None) == ROOT_HASH
    assert len({root_hash(None), root_hash("a"), root_hash("b")}) == 3
    assert root_hash("a") == root_hash("a")
    assert hash_block_tokens(root_hash("a"), [1]) != hash_block_tokens(
        root_hash("b"), [1]
    )


# -- the pool's cache ----------------------------------------------------------

H = [hash_block_tokens(ROOT_HASH, [i]) for i in range(8)]


def test_a_freed_cached_block_is_free_and_found_again() -> None:
    pool = BlockPool(3, 4)
    [b] = pool.allocate(1)
    assert pool.cache_block(b, H[0])
    pool.free([b])
    stats = pool.statistics()
    assert (stats.num_free, stats.num_used, stats.num_cached) == (3, 0, 1)
    assert pool.lookup([H[0], H[1]]) == [b]
    pool.incref([b])  # a hit takes it back
    assert (pool.ref_count(b), pool.num_free, pool.num_cached) == (1, 2, 0)
    pool.audit()


def test_allocation_evicts_cached_blocks_last_and_least_recent_first() -> None:
    pool = BlockPool(4, 1)
    blocks = pool.allocate(3)
    for b, h in zip(blocks, H, strict=False):
        pool.cache_block(b, h)
    pool.free(reversed(blocks))  # tail first, as the scheduler frees
    # the one uncached block goes first, then the tail, the middle, the head
    order = [pool.allocate(1)[0] for _ in range(4)]
    assert order[1:] == [blocks[2], blocks[1], blocks[0]]
    assert pool.lookup(H[:3]) == []
    assert pool.statistics().total_evictions == 3
    pool.audit()


def test_a_referenced_block_is_never_evicted() -> None:
    pool = BlockPool(2, 1)
    a, b = pool.allocate(2)
    pool.cache_block(a, H[0])
    pool.free([b])
    pool.allocate(1)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    assert pool.lookup([H[0]]) == [a]


def test_a_hash_is_registered_once() -> None:
    pool = BlockPool(3, 1)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, H[0])
    assert not pool.cache_block(b, H[0])  # computed twice: b stays private
    assert not pool.cache_block(a, H[1])  # a already has its hash
    assert (pool.block_hash(a), pool.block_hash(b)) == (H[0], None)
    pool.free([a, b])
    assert pool.num_cached == 1
    pool.audit()


def test_only_a_held_block_can_be_cached_and_a_free_uncached_one_not_shared() -> None:
    pool = BlockPool(2, 1)
    with pytest.raises(ValueError, match="only a held block"):
        pool.cache_block(0, H[0])
    with pytest.raises(ValueError, match="free; cannot share"):
        pool.incref([1])
    pool.audit()


def test_reset_forgets_every_hash_and_keeps_owners() -> None:
    pool = BlockPool(3, 1)
    a, b = pool.allocate(2)
    pool.cache_block(a, H[0])
    pool.cache_block(b, H[1])
    pool.free([b])
    assert pool.reset_prefix_cache() == 2
    assert pool.lookup([H[0]]) == [] and pool.lookup([H[1]]) == []
    assert (pool.ref_count(a), pool.num_cached, pool.num_free) == (1, 0, 2)
    pool.audit()
    pool.free([a])
    assert pool.num_free == 3


class PoolMachine(RuleBasedStateMachine):
    """Owners allocate, cache, share (by hit), free; the pool's books balance.

    The model: each owner holds a list of blocks; ``contents`` says which
    hash each cached block was registered under. After every rule each
    block is exactly one of referenced / free-cached / free-uncached.
    """

    owners = Bundle("owners")

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(6, 2)
        self.held: list[list[int]] = []
        self.contents: dict[int, bytes] = {}

    @rule(target=owners, n=st.integers(0, 4))
    def allocate(self, n: int) -> list[int]:
        if n > self.pool.num_free:
            with pytest.raises(NoFreeBlocksError):
                self.pool.allocate(n)
            return []
        blocks = self.pool.allocate(n)
        for b in blocks:
            assert self.pool.block_hash(b) is None
            self.contents.pop(b, None)  # evicted, if it was cached
        self.held.append(blocks)
        return blocks

    @rule(owner=owners, h=st.sampled_from(H))
    def cache(self, owner: list[int], h: bytes) -> None:
        live = [b for b in owner if self.pool.ref_count(b) > 0]
        if owner not in self.held or not live:
            return
        b = live[0]
        fresh = self.pool.block_hash(b) is None and h not in self.contents.values()
        assert self.pool.cache_block(b, h) is fresh
        if fresh:
            self.contents[b] = h

    @rule(target=owners, hs=st.lists(st.sampled_from(H), max_size=3))
    def hit(self, hs: list[bytes]) -> list[int]:
        blocks = self.pool.lookup(hs)
        by_hash = {h: b for b, h in self.contents.items()}
        expected = []
        for h in hs:
            if h not in by_hash:
                break
            expected.append(by_hash[h])
        assert blocks == expected
        self.pool.incref(blocks)
        self.held.append(blocks)
        return blocks

    @rule(owner=consumes(owners))
    def free(self, owner: list[int]) -> None:
        if owner in self.held:
            self.held.remove(owner)
            self.pool.free(reversed(owner))

    @rule()
    def reset(self) -> None:
        assert self.pool.reset_prefix_cache() == len(self.contents)
        self.contents.clear()

    @invariant()
    def books_balance(self) -> None:
        pool = self.pool
        pool.audit()
        refs = Counter(b for blocks in self.held for b in blocks)
        states = Counter()
        for b in range(pool.num_blocks):
            assert pool.ref_count(b) == refs[b]
            assert pool.block_hash(b) == self.contents.get(b)
            if refs[b]:
                states["referenced"] += 1
            elif b in self.contents:
                states["free-cached"] += 1
            else:
                states["free-uncached"] += 1
        assert sum(states.values()) == pool.num_blocks
        assert pool.num_used == states["referenced"]
        assert pool.num_cached == states["free-cached"]
        assert pool.num_free == states["free-cached"] + states["free-uncached"]


PoolMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPoolWithCache = PoolMachine.TestCase


# -- the scheduler ---------------------------------------------------------------


def test_siblings_share_the_prompt_and_compute_it_once() -> None:
    """n > 1: the same prompt submitted n times is prefilled once."""
    h = Harness.build(num_blocks=16, block_size=4, max_model_len=32)
    sibs = [h.add(f"s{i}", 18, max_tokens=4, ignore_eos=True) for i in range(3)]
    out, _ = h.step()
    # the siblings wait for s0's blocks instead of computing them again
    assert [c.request for c in out.chunks] == [sibs[0]]
    out, _ = h.step()
    assert [(c.request, c.context_len, c.num_tokens) for c in out.chunks] == [
        (sibs[0], 18, 1),
        (sibs[1], 16, 2),
        (sibs[2], 16, 2),
    ]
    shared = sibs[0].block_ids[:4]
    assert all(s.block_ids[:4] == shared for s in sibs)
    assert [h.pool.ref_count(b) for b in shared] == [3, 3, 3, 3]
    assert h.runner.computed_tokens == 18 + 1 + 2 + 2
    assert [s.num_cached_tokens for s in sibs] == [0, 16, 16]
    check_invariants(h)
    h.run_until_done()
    for s in sibs:
        assert tuple(s.output_token_ids) == expected_completion(s).token_ids
    stats = h.scheduler.statistics()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (54, 32)
    assert stats.prefix_cache_hit_rate == pytest.approx(32 / 54)
    assert stats.blocks.num_cached > 0 and stats.blocks.num_used == 0


def test_without_caching_siblings_compute_everything() -> None:
    h = Harness.build(
        num_blocks=16, block_size=4, max_model_len=32, enable_prefix_caching=False
    )
    sibs = [h.add(f"s{i}", 18, max_tokens=4, ignore_eos=True) for i in range(3)]
    h.step()
    assert h.runner.computed_tokens == 54
    h.run_until_done()
    assert [s.num_cached_tokens for s in sibs] == [0, 0, 0]
    stats = h.scheduler.statistics()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)
    assert stats.blocks.num_cached == 0


def test_a_later_request_reuses_a_finished_ones_prompt_and_output() -> None:
    h = Harness.build(num_blocks=16, block_size=4, max_model_len=32)
    first = h.add("a", 10, max_tokens=6, ignore_eos=True)
    h.run_until_done()
    assert h.pool.num_used == 0 and h.pool.num_cached == 3  # 15 computed tokens
    # the next turn of the conversation: prompt + answer + a new message
    turn = (*first.prompt_token_ids, *first.output_token_ids, 5, 5, 5)
    req = h.make_request(
        "b", RequestSpec(prompt_len=len(turn), max_tokens=2, ignore_eos=True)
    )
    req.prompt_token_ids = turn
    h.add_request(req)
    out, _ = h.step()
    [chunk] = out.chunks
    assert (chunk.context_len, chunk.num_tokens) == (12, 7)
    h.run_until_done()


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    h = Harness.build(num_blocks=8, block_size=4, max_model_len=16)
    h.add("a", 8, max_tokens=1)
    h.run_until_done()
    b = h.add("b", 8, max_tokens=1)
    out, _ = h.step()
    # both blocks are cached, but the second is recomputed for the logits
    assert [(c.context_len, c.num_tokens, c.samples) for c in out.chunks] == [
        (4, 4, True)
    ]
    assert b.num_cached_tokens == 4
    check_invariants(h)


def test_partially_shared_prefixes_share_only_their_common_blocks() -> None:
    # variants 0 and 1 share their first 6 tokens: one block of 4
    h = Harness.build(num_blocks=16, block_size=4, max_model_len=32)
    a = h.add("a", 12, max_tokens=4, ignore_eos=True)
    h.step()
    b = h.add("b", 12, max_tokens=2, ignore_eos=True, prompt_variant=1)
    out, _ = h.step()
    assert [(c.request, c.context_len) for c in out.chunks] == [(a, 12), (b, 4)]
    assert a.block_ids[0] == b.block_ids[0]
    assert set(a.block_ids[1:]).isdisjoint(b.block_ids[1:])
    h.run_until_done()


def test_salted_requests_never_hit_each_others_blocks() -> None:
    h = Harness.build(num_blocks=16, block_size=2, max_model_len=16)
    a = h.add("a", 9, max_tokens=2, ignore_eos=True, cache_salt="tenant-a")
    h.run_until_done()
    b = h.add("b", 9, max_tokens=2, ignore_eos=True, cache_salt="tenant-b")
    c = h.add("c", 9, max_tokens=2, ignore_eos=True)
    out, _ = h.step()
    assert [(ch.request, ch.context_len) for ch in out.chunks] == [(b, 0), (c, 0)]
    d = h.add("d", 9, max_tokens=2, ignore_eos=True, cache_salt="tenant-a")
    out, _ = h.step()
    assert [(ch.request, ch.context_len) for ch in out.chunks if ch.request is d] == [
        (d, 8)
    ]
    assert not set(b.block_ids) & set(d.block_ids)
    assert not set(c.block_ids) & set(d.block_ids)
    assert a.num_cached_tokens == 0 and d.num_cached_tokens == 8
    h.run_until_done()


def test_a_preempted_request_comes_back_to_its_cached_blocks() -> None:
    h = Harness.build(num_blocks=6, block_size=2, max_model_len=12)
    # salted apart: only c's own blocks can serve c
    a = h.add("a", 6, max_tokens=2, ignore_eos=True, cache_salt="a")
    c = h.add("c", 4, max_tokens=3, ignore_eos=True, priority=1, cache_salt="c")
    h.step()  # a: 3 blocks, c: 2 blocks, 1 free
    out, _ = h.step()
    assert out.preempted == ("c",) and a.finish_reason == "length"
    assert h.pool.num_cached >= 2
    out, _ = h.step()
    # back with its 2 computed prompt blocks cached: only the new token runs
    assert [(ch.request, ch.context_len, ch.num_tokens) for ch in out.chunks] == [
        (c, 4, 1)
    ]
    assert c.num_cached_tokens == 0  # what it found when first scheduled
    h.run_until_done()
    assert tuple(c.output_token_ids) == expected_completion(c).token_ids
    assert h.scheduler.statistics().prefix_cache_hits == 4


def test_abort_mid_prefill_of_a_sharing_request_keeps_the_others_blocks() -> None:
    h = Harness.build(
        num_blocks=16, block_size=2, max_model_len=32, max_num_batched_tokens=6
    )
    a = h.add("a", 4, max_tokens=8, ignore_eos=True)
    h.step()
    x = h.add("x", 20, max_tokens=2)
    h.step()
    assert 4 <= x.num_computed_tokens < 20 and x.block_ids[:2] == a.block_ids[:2]
    shared = a.block_ids[:2]
    assert [h.pool.ref_count(b) for b in shared] == [2, 2]
    h.abort("x")
    assert [h.pool.ref_count(b) for b in shared] == [1, 1]
    check_invariants(h)
    h.run_until_done()
    assert tuple(a.output_token_ids) == expected_completion(a).token_ids
    assert h.pool.num_used == 0


# -- the real model: caching changes no output ---------------------------------

SYSTEM = tuple(np.random.default_rng(7).integers(0, 256, size=70).tolist())


def _conversation_prompts() -> list[tuple[int, ...]]:
    """Shared and partially shared prefixes, an exact repeat, a lone prompt."""
    rng = np.random.default_rng(3)
    prompts = []
    for n in (5, 21, 40, 3, 33, 16):
        prompts.append(SYSTEM + tuple(rng.integers(0, 256, size=n).tolist()))
    prompts.append(prompts[1])  # an exact repeat
    prompts.append((*SYSTEM[:37], 1, 2, 3))  # diverges inside a block
    prompts.append(tuple(rng.integers(0, 256, size=50).tolist()))  # no sharing
    return prompts


def _core(caching: bool, **kw: int) -> EngineCore:
    config = {"max_model_len": 256, "num_blocks": 64, "block_size": 16, **kw}
    return EngineCore(
        EngineConfig(model="tiny-random", enable_prefix_caching=caching, **config)
    )


def _run(
    core: EngineCore,
    prompts: list[tuple[int, ...]],
    params: list[SamplingParams],
    *,
    waves: int = 1,
    abort_after: dict[str, int] | None = None,
) -> dict[str, tuple[list[int], list[float]]]:
    """Run ``prompts`` in ``waves`` (each wave after the last finishes)."""
    results: dict[str, tuple[list[int], list[float]]] = {}
    per_wave = -(-len(prompts) // waves)
    for w in range(waves):
        ids = range(w * per_wave, min(len(prompts), (w + 1) * per_wave))
        for i in ids:
            core.add_request(
                CoreRequest(
                    request_id=f"r{i}", prompt_token_ids=prompts[i], params=params[i]
                )
            )
            results[f"r{i}"] = ([], [])
        steps = 0
        while core.has_unfinished_requests():
            steps += 1
            for out in core.step().outputs:
                tokens, logprobs = results[out.request_id]
                tokens += out.new_token_ids
                if out.logprobs is not None:
                    logprobs += [lp.sampled_logprob for lp in out.logprobs]
            for rid, at in (abort_after or {}).items():
                if at == steps:
                    core.abort_requests([rid])
    stats = core.statistics().scheduler.blocks
    assert stats.num_used == 0 and stats.num_free == stats.num_blocks
    return results


def _assert_same(
    on: dict[str, tuple[list[int], list[float]]],
    off: dict[str, tuple[list[int], list[float]]],
) -> None:
    assert on.keys() == off.keys()
    for rid in on:
        assert on[rid][0] == off[rid][0], rid
        np.testing.assert_allclose(on[rid][1], off[rid][1], rtol=0, atol=1e-4)


GREEDY_LP = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize("waves", [1, 3])
def test_greedy_with_logprobs_is_the_same_with_caching_on_and_off(waves: int) -> None:
    prompts = _conversation_prompts()
    params = [GREEDY_LP] * len(prompts)
    on_core = _core(True)
    on = _run(on_core, prompts, params, waves=waves)
    _assert_same(on, _run(_core(False), prompts, params, waves=waves))
    stats = on_core.statistics().scheduler
    assert stats.prefix_cache_hits > 0
    assert 0 < stats.prefix_cache_hit_rate < 1


def test_seeded_sampling_is_the_same_with_caching_on_and_off() -> None:
    prompts = _conversation_prompts()
    params = [
        SamplingParams(
            temperature=1.0, top_p=0.9, seed=i, max_tokens=10, ignore_eos=True
        )
        for i in range(len(prompts))
    ]
    _assert_same(
        _run(_core(True), prompts, params, waves=2),
        _run(_core(False), prompts, params, waves=2),
    )


def test_same_under_forced_preemption() -> None:
    prompts = _conversation_prompts()
    params = [GREEDY_LP] * len(prompts)
    on_core = _core(True, num_blocks=16, max_num_batched_tokens=64)
    on = _run(on_core, prompts, params)
    assert on_core.statistics().scheduler.total_preemptions > 0
    _assert_same(on, _run(_core(False, num_blocks=16), prompts, params))


def test_same_with_an_abort_mid_prefill_of_a_sharing_request() -> None:
    prompts = _conversation_prompts()
    params = [GREEDY_LP] * len(prompts)
    # a small token budget keeps r2 (110 tokens, sharing SYSTEM) in prefill
    core = _core(True, max_num_batched_tokens=48)
    on = _run(core, prompts, params, abort_after={"r2": 2})
    off = _run(_core(False), prompts, params)
    assert len(on.pop("r2")[0]) < len(off.pop("r2")[0])
    _assert_same(on, off)


def test_first_output_reports_cached_prompt_tokens() -> None:
    core = _core(True)
    prompt = (*SYSTEM, 1, 2, 3)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    firsts = []
    for rid in ("a", "b"):
        core.add_request(
            CoreRequest(request_id=rid, prompt_token_ids=prompt, params=params)
        )
        seen = []
        while core.has_unfinished_requests():
            seen += [o.num_cached_tokens for o in core.step().outputs]
        firsts.append(seen)
    # only on the first output; b found SYSTEM's four full blocks
    assert firsts == [[0, None, None], [64, None, None]]
    assert core.reset_prefix_cache() > 0
    core.add_request(
        CoreRequest(request_id="c", prompt_token_ids=prompt, params=params)
    )
    assert core.step().outputs[0].num_cached_tokens == 0


def test_cache_salt_is_validated_and_isolates() -> None:
    core = _core(True)
    with pytest.raises(InvalidRequestError, match="cache_salt") as e:
        core.add_request(
            CoreRequest(
                request_id="x",
                prompt_token_ids=(1, 2),
                params=GREEDY_LP,
                cache_salt="",
            )
        )
    assert e.value.field == "cache_salt"
    prompt = SYSTEM
    cached = {}
    for rid, salt in [("a", "t1"), ("b", "t2"), ("c", "t1")]:
        core.add_request(
            CoreRequest(
                request_id=rid,
                prompt_token_ids=prompt,
                params=SamplingParams(max_tokens=1),
                cache_salt=salt,
            )
        )
        while core.has_unfinished_requests():
            for o in core.step().outputs:
                cached[o.request_id] = o.num_cached_tokens
    assert cached == {"a": 0, "b": 0, "c": 64}


def test_llm_shares_a_repeated_prompt_and_matches_uncached_outputs() -> None:
    """n > 1 through the offline API: one prompt, n seeds, prefilled once."""
    from structllm.llm import LLM

    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=8, ignore_eos=True)
        for i in range(4)
    ]
    prompts = [{"prompt_token_ids": list(SYSTEM)}] * 4
    outs = {}
    for caching in (True, False):
        llm = LLM(
            "tiny-random",
            show_progress=False,
            max_model_len=256,
            num_blocks=64,
            enable_prefix_caching=caching,
        )
        outs[caching] = [
            o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)
        ]
        stats = llm.core.statistics().scheduler
        # the three siblings find SYSTEM's 4 full blocks of 16
        assert stats.prefix_cache_hits == (3 * 64 if caching else 0)
        assert (llm.reset_prefix_cache() > 0) is caching
        assert llm.core.statistics().scheduler.blocks.num_cached == 0
    assert outs[True] == outs[False]
    assert len(set(outs[True])) > 1  # the seeds differ, and so do the samples


def test_a_failed_step_leaves_nothing_uncomputed_in_the_cache() -> None:
    core = _core(True)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = SYSTEM

    def boom(step: object) -> object:
        raise RuntimeError("forward failed")

    core.add_request(
        CoreRequest(request_id="a", prompt_token_ids=prompt, params=params)
    )
    real, core.runner.execute = core.runner.execute, boom  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="forward failed"):
        core.step()
    core.runner.execute = real  # type: ignore[method-assign]
    # the front ends abort a failed step's requests; nothing was registered
    assert core.abort_requests(["a"]) == ["a"]
    blocks = core.statistics().scheduler.blocks
    assert (blocks.num_used, blocks.num_cached) == (0, 0)
    core.pool.audit()
    tokens = _run(core, [prompt], [params])["r0"][0]
    assert tokens == _run(_core(False), [prompt], [params])["r0"][0]


def test_n_samples_are_the_seeded_requests_and_compute_the_prompt_once() -> None:
    from structllm.llm import LLM

    llm = LLM("tiny-random", show_progress=False, max_model_len=256, num_blocks=64)
    one = SamplingParams(temperature=0.8, seed=0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": list(SYSTEM)}
    (out,) = llm.generate(prompt, attrs.evolve(one, n=4), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert out.num_generated_tokens == 32
    # the three siblings find SYSTEM's 4 full blocks of 16
    assert llm.core.statistics().scheduler.prefix_cache_hits == 3 * 64
    llm.reset_prefix_cache()
    alone = [
        llm.generate(prompt, one.for_choice(i), use_tqdm=False)[0].token_ids
        for i in range(4)
    ]
    assert [c.token_ids for c in out.outputs] == alone
    assert len(set(alone)) > 1  # the samples differ
    with pytest.raises(InvalidRequestError) as info:  # a stream is one sample
        next(llm.stream(prompt, attrs.evolve(one, n=2)))
    assert info.value.field == "n"
