"""A fixed pool of KV-cache blocks with reference counts.

Invariant, at every instant: ``num_free + num_used == num_blocks``, and a
block is free exactly when its reference count is zero.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import attrs

__all__ = ["BlockPool", "BlockPoolStatistics", "NoFreeBlocksError"]


class NoFreeBlocksError(RuntimeError):
    """``allocate`` was asked for more blocks than are free."""


@attrs.frozen
class BlockPoolStatistics:
    num_blocks: int
    block_size: int
    num_free: int
    num_used: int

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 to 1.0."""
        return self.num_used / self.num_blocks if self.num_blocks else 0.0


@attrs.define(eq=False)
class BlockPool:
    num_blocks: int = attrs.field(validator=attrs.validators.ge(1))
    block_size: int = attrs.field(validator=attrs.validators.ge(1))
    _free: deque[int] = attrs.field(init=False)
    _ref_counts: list[int] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._free = deque(range(self.num_blocks))
        self._ref_counts = [0] * self.num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (reference count 1 each), all or none."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def incref(self, blocks: Iterable[int]) -> None:
        """Share ``blocks`` with one more owner (all or none)."""
        blocks = list(blocks)
        for b in blocks:
            self._check_id(b)
            if self._ref_counts[b] <= 0:
                raise ValueError(f"block {b} is free; cannot share it")
        for b in blocks:
            self._ref_counts[b] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; blocks reaching zero become free.

        All or none: an invalid list (a free block, a duplicate beyond its
        reference count, an id out of range) raises and changes nothing.
        """
        blocks = list(blocks)
        drops: dict[int, int] = {}
        for b in blocks:
            self._check_id(b)
            drops[b] = drops.get(b, 0) + 1
            if drops[b] > self._ref_counts[b]:
                raise ValueError(f"block {b} freed twice")
        for b in blocks:
            count = self._ref_counts[b]
            self._ref_counts[b] = count - 1
            if count == 1:
                self._free.append(b)

    def ref_count(self, block: int) -> int:
        self._check_id(block)
        return self._ref_counts[block]

    def _check_id(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block {block} is not in [0, {self.num_blocks})")

    def statistics(self) -> BlockPoolStatistics:
        return BlockPoolStatistics(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_free=self.num_free,
            num_used=self.num_used,
        )
