"""Data parallelism's routing rule: which replica a new request goes to.

A new request goes to the ready replica that was most recently sent the
longest prefix of its prompt (full KV blocks, hashed as the cores' prefix
caches hash them), unless that replica's live requests exceed the
least-loaded ready replica's by more than :func:`affinity_slack`; a prompt
with no such prefix goes to the ready replica with the fewest live requests
(ties: the lowest index). So the turns of a conversation, and the samples
of one prompt, meet their cached prefix. A pinned prefix
(``AsyncLLM.pin``) outranks both: a prompt that starts with one goes to
the replica holding it, whatever the load, while the pin lasts. :class:`PrefixRouter` is that
rule, pure and synchronous; :class:`~structllm.engine.frontend.replicas.ReplicaSet`
asks it and sends. Live requests are the front end's own count of what it
placed on each replica and has not seen end, not the core's waiting +
running: those arrive a step late, so a burst submitted within one step
would all land on the replica that looked idle.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import attrs

from structllm.core.block_pool import BlockHash, hash_block_tokens, root_hash

__all__ = [
    "AFFINITY_CAPACITY",
    "PrefixRouter",
    "affinity_slack",
]

#: prefix hashes the router remembers, least recently routed dropped first:
#: 65,536 full blocks (a million prompt tokens at the default block size),
#: more than the replicas' caches hold at the default KV memory for all but
#: the smallest models, in about 10 MB. A hash the cores have since evicted
#: costs only a routing choice no better than least-loaded.
AFFINITY_CAPACITY = 1 << 16


def affinity_slack(max_num_seqs: int) -> int:
    """How many more live requests than the least-loaded ready replica the
    replica holding a prompt's prefix may have and still take it: a quarter
    of a replica's batch (``max_num_seqs // 4``), at least 1.

    A hit saves the prefill of the whole shared prefix (a conversation's
    history: most of the prompt), while a few more sequences in a batch
    cost a step little; but a prefix every request shares (a system prompt)
    would pile every request on one replica with no bound. Within a quarter
    batch, a hit's replica has room for the request in its next steps; past
    it, the request goes to the least-loaded replica, which then becomes the
    prefix's most recent holder, so a shared prefix spreads over the
    replicas while their loads stay within the slack. A function of
    ``max_num_seqs`` rather than a setting: the one number a user would tune
    it by is already there.
    """
    return max(1, max_num_seqs // 4)


@attrs.define(eq=False)
class PrefixRouter:
    """Where a new request goes: the rule of the module docstring.

    Pure and synchronous, no I/O: :meth:`prefix_hashes` hashes a prompt's
    full blocks, :meth:`order` ranks the replicas for it, :meth:`record`
    notes the one that took it. Memory is bounded by ``capacity`` hashes.
    """

    block_size: int = attrs.field(validator=attrs.validators.ge(1))
    #: see :func:`affinity_slack`
    slack: int = attrs.field(validator=attrs.validators.ge(0))
    capacity: int = attrs.field(
        default=AFFINITY_CAPACITY, validator=attrs.validators.ge(1)
    )
    #: full-block hash -> the replica most recently sent a prompt with that
    #: prefix; least recently routed first
    _owners: OrderedDict[BlockHash, int] = attrs.field(init=False, factory=OrderedDict)
    #: pin name -> (its prefix's block hashes, its replica)
    _pins: dict[str, tuple[tuple[BlockHash, ...], int]] = attrs.field(
        init=False, factory=dict
    )
    #: the last block hash of each pinned prefix -> its replica
    _pinned: dict[BlockHash, int] = attrs.field(init=False, factory=dict)

    def prefix_hashes(
        self, token_ids: Sequence[int], cache_salt: str | None = None, lora_id: int = 0
    ) -> list[BlockHash]:
        """The chained hash of each full block of a prompt, as the core's
        prefix cache keys them (a salt puts them in their own space, and so
        does a LoRA adapter: here by its id, which names one adapter while
        the engine runs; the core keys by its weights)."""
        bs = self.block_size
        parent = root_hash(cache_salt, f"lora {lora_id}".encode() if lora_id else None)
        hashes = []
        for i in range(len(token_ids) // bs):
            parent = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs])
            hashes.append(parent)
        return hashes

    def affine(self, hashes: Sequence[BlockHash]) -> int | None:
        """The replica most recently sent the longest of these prefixes."""
        for h in reversed(hashes):
            k = self._owners.get(h)
            if k is not None:
                return k
        return None

    def pin(self, name: str, hashes: Sequence[BlockHash], replica: int) -> None:
        """``replica`` holds the pin ``name`` of the prefix ``hashes``."""
        if hashes:
            self._pins[name] = (tuple(hashes), replica)
            self._pinned[hashes[-1]] = replica

    def unpin(self, name: str) -> None:
        pinned = self._pins.pop(name, None)
        if pinned is not None:
            del self._pinned[pinned[0][-1]]
            for other, k in self._pins.values():  # another pin of the same
                self._pinned[other[-1]] = k

    def pinned(self, hashes: Sequence[BlockHash]) -> int | None:
        """The replica pinning the longest of these prefixes, if any."""
        for h in reversed(hashes):
            k = self._pinned.get(h)
            if k is not None:
                return k
        return None

    def order(
        self, hashes: Sequence[BlockHash], load: Sequence[int], ready: Sequence[bool]
    ) -> list[int]:
        """The ready replicas, best first: one pinning a prefix of the
        prompt, else the affine one when its load is within the slack of
        the least, then by load and index."""
        order = sorted(
            (k for k, up in enumerate(ready) if up), key=lambda k: (load[k], k)
        )
        k = self.pinned(hashes)
        if k is not None and ready[k]:
            order.remove(k)
            return [k, *order]
        k = self.affine(hashes)
        if (
            k is not None
            and ready[k]
            and load[k] - load[order[0]] <= self.slack  # order: k is in it
        ):
            order.remove(k)
            order.insert(0, k)
        return order

    def record(self, hashes: Sequence[BlockHash], replica: int) -> None:
        """``replica`` took a prompt with these prefixes.

        The last block is noted first, so that when memory runs out a
        prompt's tail is forgotten before its head, as the pool evicts.
        """
        owners = self._owners
        for h in reversed(hashes):
            owners[h] = replica
            owners.move_to_end(h)
        while len(owners) > self.capacity:
            owners.popitem(last=False)

    def forget_replica(self, replica: int) -> None:
        """``replica``'s cache is gone (its core died): drop its prefixes."""
        for h in [h for h, k in self._owners.items() if k == replica]:
            del self._owners[h]
        for name in [p for p, (_, k) in self._pins.items() if k == replica]:
            self.unpin(name)

    def clear(self) -> None:
        """Every cache was reset."""
        self._owners.clear()

    @property
    def num_hashes(self) -> int:
        """Block hashes remembered (at most ``capacity``)."""
        return len(self._owners)
