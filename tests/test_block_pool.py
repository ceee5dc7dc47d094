"""The block pool hands out blocks all-or-nothing and counts their owners."""

from __future__ import annotations

from collections import Counter

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from structllm.core.block_pool import BlockPool, BlockPoolStatistics, NoFreeBlocksError


def snapshot(pool: BlockPool) -> tuple[BlockPoolStatistics, list[int]]:
    return pool.statistics(), [pool.ref_count(b) for b in range(pool.num_blocks)]


def test_new_pool_is_all_free() -> None:
    pool = BlockPool(4, 16)
    assert (pool.num_free, pool.num_used) == (4, 0)
    assert all(pool.ref_count(b) == 0 for b in range(4))


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 16), (4, 0), (-1, 1)])
def test_rejects_empty_geometry(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError):
        BlockPool(num_blocks, block_size)


@pytest.mark.parametrize(
    ("num_tokens", "blocks"), [(0, 0), (1, 1), (15, 1), (16, 1), (17, 2), (32, 2)]
)
def test_blocks_for_rounds_up(num_tokens: int, blocks: int) -> None:
    assert BlockPool(8, 16).blocks_for(num_tokens) == blocks


def test_allocate_gives_distinct_blocks_with_one_reference() -> None:
    pool = BlockPool(5, 2)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert sorted(a + b) == [0, 1, 2, 3, 4]
    assert all(pool.ref_count(x) == 1 for x in a + b)
    assert (pool.num_free, pool.num_used) == (0, 5)


def test_allocate_zero_is_a_no_op() -> None:
    pool = BlockPool(2, 1)
    assert pool.allocate(0) == []
    assert pool.num_free == 2


def test_allocate_is_all_or_nothing() -> None:
    pool = BlockPool(4, 1)
    held = pool.allocate(3)
    before = snapshot(pool)
    with pytest.raises(NoFreeBlocksError, match="asked for 2 blocks, 1 free"):
        pool.allocate(2)
    assert snapshot(pool) == before
    # the one free block is still there to take
    [last] = pool.allocate(1)
    assert last not in held


def test_no_free_blocks_error_is_a_runtime_error() -> None:
    assert issubclass(NoFreeBlocksError, RuntimeError)


def test_free_returns_blocks_for_reuse() -> None:
    pool = BlockPool(2, 1)
    blocks = pool.allocate(2)
    pool.free(blocks)
    assert (pool.num_free, pool.num_used) == (2, 0)
    assert sorted(pool.allocate(2)) == sorted(blocks)


def test_double_free_raises() -> None:
    pool = BlockPool(3, 1)
    [b] = pool.allocate(1)
    pool.free([b])
    before = snapshot(pool)
    with pytest.raises(ValueError, match=f"block {b} freed twice"):
        pool.free([b])
    assert snapshot(pool) == before


def test_free_of_never_allocated_block_raises() -> None:
    pool = BlockPool(3, 1)
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([2])
    assert pool.num_free == 3


def test_incref_shares_until_the_last_owner_frees() -> None:
    pool = BlockPool(2, 1)
    blocks = pool.allocate(2)
    pool.incref(blocks)
    pool.incref(blocks[:1])
    assert [pool.ref_count(b) for b in blocks] == [3, 2]
    pool.free(blocks)
    assert pool.num_used == 2
    pool.free(blocks)
    assert (pool.num_used, pool.ref_count(blocks[0])) == (1, 1)
    pool.free(blocks[:1])
    assert (pool.num_free, pool.num_used) == (2, 0)


def test_incref_of_free_block_raises() -> None:
    pool = BlockPool(2, 1)
    with pytest.raises(ValueError, match="block 1 is free; cannot share it"):
        pool.incref([1])
    assert pool.ref_count(1) == 0
    assert pool.num_free == 2


def test_statistics_is_a_frozen_snapshot() -> None:
    pool = BlockPool(4, 8)
    held = pool.allocate(3)
    stats = pool.statistics()
    assert stats == BlockPoolStatistics(
        num_blocks=4, block_size=8, num_free=1, num_used=3
    )
    assert stats.usage == 0.75
    pool.free(held)
    assert stats.num_used == 3  # unchanged: a snapshot, not a view
    assert pool.statistics().usage == 0.0
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        stats.num_used = 0  # type: ignore[misc]


def test_usage_of_an_empty_statistics_is_zero() -> None:
    assert BlockPoolStatistics(0, 1, 0, 0).usage == 0.0


def test_allocate_negative_raises() -> None:
    with pytest.raises(ValueError):
        BlockPool(2, 1).allocate(-1)


def test_free_rejects_negative_block_id() -> None:
    pool = BlockPool(2, 1)
    pool.allocate(2)
    with pytest.raises(ValueError):
        pool.free([-1])
    assert pool.num_used == 2


def test_free_is_all_or_nothing() -> None:
    pool = BlockPool(3, 1)
    a, b, _ = pool.allocate(3)
    pool.free([b])
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([a, b])
    assert pool.ref_count(a) == 1 and pool.num_free == 1


# -- property: the books always balance ------------------------------------

ops = st.lists(
    st.one_of(
        st.tuples(st.just("allocate"), st.integers(0, 6)),
        st.tuples(st.just("free"), st.integers(0, 50)),
        st.tuples(st.just("incref"), st.integers(0, 50)),
        st.tuples(st.just("double_free"), st.integers(0, 50)),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 8), ops=ops)
def test_free_plus_used_is_total(num_blocks: int, ops: list[tuple[str, int]]) -> None:
    pool = BlockPool(num_blocks, 4)
    # the model: each owner holds a list of block references
    owners: list[list[int]] = []
    for op, arg in ops:
        before = snapshot(pool)
        if op == "allocate":
            if arg > pool.num_free:
                with pytest.raises(NoFreeBlocksError):
                    pool.allocate(arg)
                assert snapshot(pool) == before
            else:
                blocks = pool.allocate(arg)
                assert len(set(blocks)) == arg
                assert all(before[1][b] == 0 for b in blocks)
                owners.append(blocks)
        elif op == "free" and owners:
            pool.free(owners.pop(arg % len(owners)))
        elif op == "incref" and owners:
            shared = list(owners[arg % len(owners)])
            pool.incref(shared)
            owners.append(shared)
        elif op == "double_free":
            free_blocks = [b for b in range(num_blocks) if pool.ref_count(b) == 0]
            if free_blocks:
                with pytest.raises(ValueError):
                    pool.free([free_blocks[arg % len(free_blocks)]])
                assert snapshot(pool) == before

        assert pool.num_free + pool.num_used == num_blocks
        counts = Counter(b for blocks in owners for b in blocks)
        assert [pool.ref_count(b) for b in range(num_blocks)] == [
            counts[b] for b in range(num_blocks)
        ]
        assert pool.num_used == len(counts)
