"""A fixed pool of KV-cache blocks with reference counts and a prefix cache.

Every block is in exactly one of three states, at every instant:

- **referenced**: reference count >= 1 (held by running requests; it may
  also carry a hash, and then other requests may share it);
- **free-cached**: count 0, but it still holds the KV of a full block
  whose hash is registered, so a later request with the same prefix can
  take it back instead of recomputing it;
- **free-uncached**: count 0 and no hash.

``num_free`` counts both free states (a free-cached block is as available as
an uncached one: allocation evicts it), so ``num_free + num_used ==
num_blocks`` and, when no request is live, ``num_used == 0``.

Allocation takes free-uncached blocks first, then evicts free-cached ones
least recently freed first. A referenced block is never evicted.

Blocks never handed out yet (*fresh*) are handed out in id order, after the
free-uncached blocks that were used before: the KV cache's memory is
committed page by page as blocks are first written (``lazy_zeros`` in
model/attention.py), so what is resident is the blocks ever handed out
(:attr:`BlockPool.num_touched`). Fresh blocks come before evicting a cached
one only while fewer than ``touch_limit`` blocks have been handed out;
past it the prefix cache evicts instead of growing, and a fresh block is
taken only when no free block is left otherwise.

A **pin** (:meth:`BlockPool.pin`) is a named reference to the cached blocks
of a prefix: they stay referenced, so never evicted, and keep their hashes
through :meth:`~BlockPool.reset_prefix_cache`, until :meth:`~BlockPool.unpin`.

A block's hash names its contents: the hash of its tokens chained to the
hash of the block before it (:func:`hash_block_tokens`), so equal hashes
mean an equal prefix of the whole sequence, not just equal blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import attrs

from structllm.errors import NoFreeBlocksError

__all__ = [
    "ROOT_HASH",
    "BlockHash",
    "BlockPool",
    "BlockPoolStatistics",
    "NoFreeBlocksError",
    "hash_block_tokens",
    "root_hash",
]

#: digest of a full block: its tokens and everything before them
BlockHash = bytes

_DIGEST_SIZE = 16
#: the parent of a sequence's first block when it has no cache salt
ROOT_HASH: BlockHash = bytes(_DIGEST_SIZE)


def root_hash(cache_salt: str | None, adapter: bytes | None = None) -> BlockHash:
    """The parent hash of a sequence's first block.

    A salt puts the sequence in its own hash space: requests with different
    salts (tenants) never share a block, however equal their tokens. So
    does a LoRA adapter (``adapter``: its key, ``LoRAManager.cache_key``):
    its keys and values differ from the base model's and every other
    adapter's for the same tokens.
    """
    if cache_salt is None and adapter is None:
        return ROOT_HASH
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    if cache_salt is not None:
        h.update(b"salt\0" + cache_salt.encode())
    if adapter is not None:  # after the salt's, printable (check_cache_salt): no NUL
        h.update(b"\0lora\0" + adapter)
    return h.digest()


def hash_block_tokens(parent: BlockHash, tokens: Sequence[int]) -> BlockHash:
    """Hash of a full block of ``tokens`` following the block hashed ``parent``."""
    h = hashlib.blake2b(parent, digest_size=_DIGEST_SIZE)
    h.update(array("q", tokens).tobytes())
    return h.digest()


@attrs.frozen
class BlockPoolStatistics:
    num_blocks: int
    block_size: int
    #: blocks with no owner (free-uncached plus free-cached)
    num_free: int
    #: blocks with at least one owner
    num_used: int
    #: free blocks that still hold a registered prefix (a subset of num_free)
    num_cached: int = 0
    #: cached blocks whose hash was dropped to reuse the block, ever
    total_evictions: int = 0
    #: pins held, and the blocks they hold (a subset of num_used)
    num_pins: int = 0
    num_pinned: int = 0

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 to 1.0."""
        return self.num_used / self.num_blocks if self.num_blocks else 0.0


@attrs.define(eq=False)
class BlockPool:
    num_blocks: int = attrs.field(validator=attrs.validators.ge(1))
    block_size: int = attrs.field(validator=attrs.validators.ge(1))
    #: blocks handed out at least once past which a cached block is evicted
    #: rather than a fresh one touched; None: never (the prefix cache may
    #: grow over the whole pool)
    touch_limit: int | None = attrs.field(
        default=None,
        kw_only=True,
        validator=attrs.validators.optional(attrs.validators.ge(0)),
    )
    #: used blocks with count 0; allocation takes from the front: uncached
    #: blocks are kept in front, cached ones behind them in the order they
    #: were freed (fresh blocks are not in it)
    _free: OrderedDict[int, None] = attrs.field(init=False, factory=OrderedDict)
    #: the first fresh block: blocks from it on were never handed out
    _fresh: int = attrs.field(init=False, default=0)
    _ref_counts: list[int] = attrs.field(init=False)
    _hashes: list[BlockHash | None] = attrs.field(init=False)
    _cached: dict[BlockHash, int] = attrs.field(init=False, factory=dict)
    _num_free_cached: int = attrs.field(init=False, default=0)
    _total_evictions: int = attrs.field(init=False, default=0)
    #: pin name -> the blocks it holds a reference to
    _pins: dict[str, list[int]] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        self._ref_counts = [0] * self.num_blocks
        self._hashes = [None] * self.num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free) + self.num_blocks - self._fresh

    @property
    def num_used(self) -> int:
        return self._fresh - len(self._free)

    @property
    def num_touched(self) -> int:
        """Blocks handed out at least once (the cache's committed memory)."""
        return self._fresh

    @property
    def num_cached(self) -> int:
        """Free blocks that still hold a cached prefix."""
        return self._num_free_cached

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (reference count 1 each), all or none.

        Uncached blocks go first (used ones, then fresh ones below
        ``touch_limit``); then cached ones are evicted, least recently freed
        first, and forget their hash; then fresh ones beyond the limit.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            raise NoFreeBlocksError(f"asked for {n} blocks, {self.num_free} free")
        blocks = [self._take() for _ in range(n)]
        for b in blocks:
            h = self._hashes[b]
            if h is not None:
                del self._cached[h]
                self._hashes[b] = None
                self._num_free_cached -= 1
                self._total_evictions += 1
            self._ref_counts[b] = 1
        return blocks

    def _take(self) -> int:
        """The next free block to hand out (there is one)."""
        first = next(iter(self._free), None)
        if first is not None and self._hashes[first] is None:
            return self._free.popitem(last=False)[0]
        limit = self.num_blocks if self.touch_limit is None else self.touch_limit
        if self._fresh < self.num_blocks and (first is None or self._fresh < limit):
            self._fresh += 1
            return self._fresh - 1
        return self._free.popitem(last=False)[0]

    def incref(self, blocks: Iterable[int]) -> None:
        """Share ``blocks`` with one more owner (all or none).

        A block must be referenced or free-cached (a prefix-cache hit takes
        it back from the free list); a free-uncached block holds nothing to
        share and is refused.
        """
        blocks = list(blocks)
        for b in blocks:
            self._check_id(b)
            if self._ref_counts[b] <= 0 and self._hashes[b] is None:
                raise ValueError(f"block {b} is free; cannot share it")
        for b in blocks:
            if self._ref_counts[b] == 0:
                del self._free[b]
                self._num_free_cached -= 1
            self._ref_counts[b] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; blocks reaching zero become free.

        A freed block with a hash stays cached, as the most recently freed
        (so free a sequence's blocks tail first: its tail is then evicted
        before its head, which more requests share). All or none: an
        invalid list (a free block, a duplicate beyond its reference count,
        an id out of range) raises and changes nothing.
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
                self._free[b] = None
                if self._hashes[b] is None:
                    self._free.move_to_end(b, last=False)
                else:
                    self._num_free_cached += 1

    def ref_count(self, block: int) -> int:
        self._check_id(block)
        return self._ref_counts[block]

    # -- the prefix cache ---------------------------------------------------

    def lookup(self, hashes: Iterable[BlockHash]) -> list[int]:
        """The blocks of the longest cached prefix of ``hashes``; no change."""
        hit = []
        for h in hashes:
            b = self._cached.get(h)
            if b is None:
                break
            hit.append(b)
        return hit

    def cache_block(self, block: int, block_hash: BlockHash) -> bool:
        """Register a referenced, full, computed ``block`` under ``block_hash``.

        Returns False, changing nothing, when another block already holds
        that hash (two requests computed the same prefix at once) or this
        block already has a hash; the block then stays private to its
        owners and is uncached when they free it.
        """
        self._check_id(block)
        if self._ref_counts[block] <= 0:
            raise ValueError(f"block {block} is free; only a held block is cached")
        if self._hashes[block] is not None or block_hash in self._cached:
            return False
        self._hashes[block] = block_hash
        self._cached[block_hash] = block
        return True

    def block_hash(self, block: int) -> BlockHash | None:
        """The hash ``block`` is cached under, if any."""
        self._check_id(block)
        return self._hashes[block]

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash but the pinned blocks'; return how many
        were dropped.

        Free-cached blocks become free-uncached; held blocks stay with their
        owners, unshareable from now on. Never fails, whatever is running.
        """
        keep = self.pinned_blocks()
        dropped = 0
        for h, b in list(self._cached.items()):
            if b in keep:
                continue
            dropped += 1
            del self._cached[h]
            self._hashes[b] = None
            if self._ref_counts[b] == 0:
                self._free.move_to_end(b, last=False)
        self._num_free_cached = 0
        return dropped

    # -- pins -----------------------------------------------------------------

    def pin(self, name: str, hashes: Sequence[BlockHash]) -> list[int]:
        """Hold the cached blocks of the longest cached prefix of ``hashes``
        under ``name``; return them. A name already pinned is refused."""
        if name in self._pins:
            raise ValueError(f"{name!r} is pinned already")
        blocks = self.lookup(hashes)
        self.incref(blocks)
        self._pins[name] = blocks
        return blocks

    def unpin(self, name: str) -> bool:
        """Drop the pin ``name`` (its blocks' reference); False if none."""
        blocks = self._pins.pop(name, None)
        if blocks is None:
            return False
        self.free(reversed(blocks))
        return True

    def is_pinned(self, name: str) -> bool:
        return name in self._pins

    def pinned_names(self) -> list[str]:
        return list(self._pins)

    def pinned_blocks(self) -> set[int]:
        """The blocks the pins hold (one that two pins share, once)."""
        return {b for blocks in self._pins.values() for b in blocks}

    def audit(self) -> None:
        """Raise AssertionError unless the books balance (for tests)."""
        free = set(self._free)
        assert len(free) == len(self._free)
        assert all(b < self._fresh for b in free), "a fresh block in the free list"
        for b in range(self.num_blocks):
            count, h = self._ref_counts[b], self._hashes[b]
            assert count >= 0, f"block {b} has count {count}"
            if b >= self._fresh:
                assert count == 0 and h is None, f"fresh block {b} was used"
                continue
            assert (count == 0) == (b in free), f"block {b}: count {count} vs free"
            if h is not None:
                assert self._cached.get(h) == b, f"block {b}: hash not registered"
        assert len(self._cached) == sum(h is not None for h in self._hashes)
        assert self._num_free_cached == sum(self._hashes[b] is not None for b in free)
        for name, blocks in self._pins.items():
            for b in blocks:
                assert self._ref_counts[b] >= 1, f"pin {name!r}: block {b} is free"
                assert self._hashes[b] is not None, f"pin {name!r}: {b} uncached"
        # uncached free blocks are all in front of the cached ones
        states = [self._hashes[b] is not None for b in self._free]
        assert states == sorted(states), "a cached block is ahead of an uncached one"

    def _check_id(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block {block} is not in [0, {self.num_blocks})")

    def statistics(self) -> BlockPoolStatistics:
        return BlockPoolStatistics(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_free=self.num_free,
            num_used=self.num_used,
            num_cached=self._num_free_cached,
            total_evictions=self._total_evictions,
            num_pins=len(self._pins),
            num_pinned=len(self.pinned_blocks()),
        )
