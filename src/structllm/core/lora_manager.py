"""The engine core's LoRA adapters: those it knows, those in the model's
slots, and the requests that use them.

An adapter is, in turn:

**known**
    read from its PEFT directory (:meth:`LoRAManager.add`, through
    ``model/lora_peft.py``'s refusals) and checked against the model's
    slots, so that putting it in a slot later cannot fail; kept on the host
    under its id (``LoRARequest.lora_int_id``) and its name;
**resident**
    in one of the model's ``max_loras`` slots (``model/lora.py``), where a
    step's rows can use it;
**used**
    by live requests (waiting, running or preempted): :meth:`acquire` at
    admission, :meth:`release` however the request ends;
**busy**
    used by a *running* request: its rows are in the batch, so its slot is
    never taken from it.

Slots are filled on demand (:meth:`slot_for`, as the scheduler admits a
request): a free slot, else the least recently used idle adapter's (its
host copy stays); when every slot is busy the request waits (None). Each
step's adapters count as used (:meth:`rows`), which orders the eviction.

The host keeps at most ``max_cpu_loras`` adapters (vLLM's; None: no
bound): past it, the least recently named (added, acquired, released) that
no live request uses is forgotten as if unloaded, and read again by the
next request carrying its :class:`LoRARequest`. One in use is never: while
more are in use the host holds them all, the excess going with their last
users (refusing requests for it would fail work that fits steps later).

**Unloading** (:meth:`remove`) is graceful: the adapter's id is taken
away at once (a new request with it is refused, unless it carries the same
name and path, which loads it again), but the requests already admitted
with it finish with it, their tokens unchanged; its slot and host copy go
when the last of them ends, or at once when none uses it. Names are labels
here: the server's registry (``server/lora``) maps them to ids.

The prefix cache keys an adapter's blocks by :meth:`cache_key`, a
``digest`` of the matrices it runs (``block_pool.root_hash``): the same
prompt under another adapter, the base model, or an id reused for other
weights after an unload, never hits them.

With ``record_changes``, every change of a slot is also recorded
(:meth:`take_changes`) for the ranks of a tensor-parallel group, which
read their own share of the adapter (``model.parallel.lora_reader``) from
its path into the same slot: rank 0's manager runs over
:class:`FollowedSlots`, which sends those changes and the step's rows
when the runner sets the rows (after the step's input, before the
forward). Rank 0 checks and keeps its share; the key digests the whole.

Synchronous and pure apart from reading adapter files (in :meth:`add`);
Paddle is reached only through the ``slots`` object.
"""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

import attrs
import numpy as np

from structllm.config import EngineConfig
from structllm.errors import EngineConfigError, InvalidRequestError
from structllm.lora_request import LoRARequest

if TYPE_CHECKING:
    from structllm.model.lora_peft import LoRAAdapter
    from structllm.model.protocol import CausalLM

__all__ = [
    "NO_LORA",
    "AdapterSlots",
    "FollowedSlots",
    "LoRAFollowers",
    "LoRAInfo",
    "LoRAManager",
    "SlotChange",
    "adapter_digest",
    "enable_model_lora",
]

#: the "adapter" id of a request without one (vLLM's 0)
NO_LORA = 0

_FIELD = "lora_request"


class AdapterSlots(Protocol):
    """What the manager needs of a model's slots (``model.lora.LoRASlots``)."""

    @property
    def max_loras(self) -> int: ...

    def check_adapter(self, adapter: LoRAAdapter) -> None: ...

    def load_adapter(self, slot: int, adapter: LoRAAdapter) -> None: ...

    def clear_slot(self, slot: int) -> None: ...

    def set_rows(self, rows: Sequence[int] | np.ndarray | None) -> None: ...


@attrs.frozen
class SlotChange:
    """Slot ``slot`` now holds adapter ``lora_id`` read from ``path``, or
    (``path`` None) nothing."""

    slot: int
    lora_id: int
    path: str | None


class LoRAFollowers(Protocol):
    """A tensor-parallel group's other ranks (``engine.rank_group.RankGroup``)."""

    def send_lora(
        self, changes: Sequence[SlotChange], rows: np.ndarray | None
    ) -> None: ...


@attrs.define(eq=False)
class FollowedSlots:
    """Rank 0's slots in a tensor-parallel group: its shard's, and with
    each step's rows the slot changes since the last (``changes``: the
    manager's :meth:`LoRAManager.take_changes`) sent to the followers."""

    local: AdapterSlots
    followers: LoRAFollowers
    changes: Callable[[], list[SlotChange]] = list

    @property
    def max_loras(self) -> int:
        return self.local.max_loras

    def check_adapter(self, adapter: LoRAAdapter) -> None:
        self.local.check_adapter(adapter)

    def load_adapter(self, slot: int, adapter: LoRAAdapter) -> None:
        self.local.load_adapter(slot, adapter)

    def clear_slot(self, slot: int) -> None:
        self.local.clear_slot(slot)

    def set_rows(self, rows: Sequence[int] | np.ndarray | None) -> None:
        self.local.set_rows(rows)
        r = None if rows is None else np.asarray(rows, np.int64)
        self.followers.send_lora(self.changes(), r)


@attrs.frozen
class LoRAInfo:
    """One known adapter, as :meth:`LoRAManager.adapters` lists it."""

    request: LoRARequest
    #: its slot, or None when not resident
    slot: int | None
    #: live requests that use it
    users: int
    #: removed while in use: it goes when ``users`` reaches 0
    unloading: bool


@attrs.define(eq=False)
class _Known:
    request: LoRARequest
    adapter: LoRAAdapter
    cache_key: bytes
    users: set[str] = attrs.Factory(set)
    unloading: bool = False


def adapter_digest(adapter: LoRAAdapter) -> bytes:
    """16 bytes naming what ``adapter`` computes: its matrices, in order."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(adapter.projections):
        p = adapter.projections[name]
        h.update(name.encode() + b"\0")
        for array in (p.a, p.b, p.spans):
            h.update(str(array.shape).encode())
            h.update(np.ascontiguousarray(array).tobytes())
    return h.digest()


@attrs.define(eq=False)
class LoRAManager:
    """The core's adapters over a model's ``slots``; ``read`` turns an
    adapter directory into a :class:`LoRAAdapter` for this model (raising
    :class:`~structllm.errors.ModelLoadError` naming the file and tensor)."""

    slots: AdapterSlots
    read: Callable[[str], LoRAAdapter]
    #: keep the slot changes for :meth:`take_changes`
    record_changes: bool = False
    #: the most adapters kept on the host (None: no bound); at least the slots
    max_cpu_loras: int | None = attrs.field(default=None, kw_only=True)
    #: an adapter's cache key from what ``read`` returned
    digest: Callable[[LoRAAdapter], bytes] = attrs.field(
        default=adapter_digest, kw_only=True
    )
    #: known ids, least recently named first
    _known: OrderedDict[int, _Known] = attrs.field(init=False, factory=OrderedDict)
    #: resident ids -> their slots, least recently used first
    _resident: OrderedDict[int, int] = attrs.field(init=False, factory=OrderedDict)
    _free_slots: list[int] = attrs.field(init=False)
    #: live request id -> its adapter's id
    _request_lora: dict[str, int] = attrs.field(init=False, factory=dict)
    _changes: list[SlotChange] = attrs.field(init=False, factory=list)

    def __attrs_post_init__(self) -> None:
        self._free_slots = list(range(self.slots.max_loras - 1, -1, -1))
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras={self.max_cpu_loras} is under the "
                f"{self.max_loras} slots"
            )

    @property
    def max_loras(self) -> int:
        return self.slots.max_loras

    # -- known adapters ---------------------------------------------------------

    def add(self, request: LoRARequest) -> bool:
        """Know the adapter of ``request``; True when it was read now, False
        when it was known already (the same name, id and path).

        Refuses (:class:`InvalidRequestError`, field ``lora_request``) an id
        known with another name or path, and
        (:class:`~structllm.errors.ModelLoadError`) an adapter that cannot be
        read or does not fit the model; nothing changes then.
        """
        lora_id = request.lora_int_id
        known = self._known.get(lora_id)
        if known is not None and known.request != request:
            raise InvalidRequestError(
                f"LoRA adapter id {lora_id} is {_describe(known.request)}"
                f"{' (being unloaded)' if known.unloading else ''}, not "
                f"{_describe(request)}; one id names one adapter",
                field=_FIELD,
            )
        if known is not None:
            known.unloading = False  # loaded again before its last user ended
            self._known.move_to_end(lora_id)
            return False
        adapter = self.read(request.lora_path)
        self.slots.check_adapter(adapter)
        self._known[lora_id] = _Known(request, adapter, self.digest(adapter))
        self._shrink(keep=lora_id)  # its request acquires it next
        return True

    def remove(self, lora_id: int) -> bool:
        """Unload adapter ``lora_id`` (see the module docstring); False when
        no adapter has that id, or it is being unloaded already."""
        known = self._known.get(lora_id)
        if known is None or known.unloading:
            return False
        if known.users:
            known.unloading = True
        else:
            self._forget(lora_id)
        return True

    def adapters(self) -> tuple[LoRAInfo, ...]:
        """Every known adapter, by id."""
        return tuple(
            LoRAInfo(k.request, self._resident.get(i), len(k.users), k.unloading)
            for i, k in sorted(self._known.items())
        )

    def cache_key(self, lora_id: int) -> bytes | None:
        """What the prefix cache keys adapter ``lora_id``'s blocks by (None:
        the base model, ``NO_LORA``)."""
        if lora_id == NO_LORA:
            return None
        return self._known[lora_id].cache_key

    # -- requests ---------------------------------------------------------------

    def acquire(self, request_id: str, lora_id: int) -> None:
        """Request ``request_id`` uses adapter ``lora_id`` until
        :meth:`release`. Refuses an id not known or being unloaded."""
        if request_id in self._request_lora:
            raise ValueError(f"request {request_id!r} holds an adapter already")
        known = self._known.get(lora_id)
        if known is None or known.unloading:
            raise InvalidRequestError(
                f"LoRA adapter id {lora_id} is not loaded"
                + (" (it is being unloaded)" if known is not None else ""),
                field=_FIELD,
            )
        known.users.add(request_id)
        self._request_lora[request_id] = lora_id
        self._known.move_to_end(lora_id)

    def release(self, request_ids: Iterable[str]) -> None:
        """These requests ended (finished, aborted, expired, refused);
        requests without an adapter, or unknown, are ignored. An adapter
        being unloaded goes with its last user."""
        for rid in request_ids:
            lora_id = self._request_lora.pop(rid, None)
            if lora_id is None:
                continue
            known = self._known[lora_id]
            known.users.discard(rid)
            if known.unloading and not known.users:
                self._forget(lora_id)
            else:
                self._known.move_to_end(lora_id)
        self._shrink()

    def lora_of(self, request_id: str) -> int:
        """The adapter id request ``request_id`` uses (``NO_LORA``: none)."""
        return self._request_lora.get(request_id, NO_LORA)

    # -- slots --------------------------------------------------------------------

    def slot_for(self, lora_id: int, busy: Iterable[int] = ()) -> int | None:
        """Adapter ``lora_id``'s slot, loading it there if it is not
        resident: into a free slot, else the least recently used resident
        adapter's not in ``busy`` (the ids running requests use); None when
        every slot is busy. ``NO_LORA`` needs no slot: -1."""
        if lora_id == NO_LORA:
            return -1
        known = self._known[lora_id]  # admitted requests' adapters are known
        slot = self._resident.get(lora_id)
        if slot is not None:
            self._resident.move_to_end(lora_id)
            return slot
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            held = set(busy)
            victim = next((i for i in self._resident if i not in held), None)
            if victim is None:
                return None
            slot = self._resident.pop(victim)
        self.slots.load_adapter(slot, known.adapter)
        self._resident[lora_id] = slot
        if self.record_changes:
            self._changes.append(SlotChange(slot, lora_id, known.request.lora_path))
        return slot

    def rows(self, lora_ids: Sequence[int]) -> list[int] | None:
        """Each sequence's slot (-1: none) for a step whose sequences use
        adapters ``lora_ids``, which count as used now; None when none does
        (the model skips LoRA altogether). Every adapter must be resident
        (:meth:`slot_for` admitted them)."""
        if all(i == NO_LORA for i in lora_ids):
            return None
        out = []
        for i in lora_ids:
            if i == NO_LORA:
                out.append(-1)
                continue
            slot = self._resident.get(i)
            if slot is None:
                raise ValueError(f"LoRA adapter {i} is not in a slot")
            self._resident.move_to_end(i)
            out.append(slot)
        return out

    def take_changes(self) -> list[SlotChange]:
        """The slot changes since the last call, in order."""
        changes, self._changes = self._changes, []
        return changes

    def audit(self) -> None:
        """Check the books (tests call it): every slot free or resident once,
        resident and used adapters known, users and requests agree."""
        slots = [*self._free_slots, *self._resident.values()]
        assert sorted(slots) == list(range(self.max_loras)), slots
        assert set(self._resident) <= set(self._known)
        for rid, lora_id in self._request_lora.items():
            assert rid in self._known[lora_id].users, (rid, lora_id)
        for lora_id, known in self._known.items():
            assert known.users <= set(self._request_lora), lora_id
            assert not known.unloading or known.users, lora_id
        if self.max_cpu_loras is not None and len(self._known) > self.max_cpu_loras:
            idle = [i for i, k in self._known.items() if not k.users]
            assert idle in ([], list(self._known)[-1:]), idle  # newest: to acquire

    def _shrink(self, keep: int = NO_LORA) -> None:
        """Forget the least recently named idle adapters (but ``keep``)
        while the host holds more than ``max_cpu_loras``."""
        bound = self.max_cpu_loras
        if bound is None or len(self._known) <= bound:
            return
        idle = [i for i, k in self._known.items() if not k.users and i != keep]
        for lora_id in idle[: len(self._known) - bound]:
            self._forget(lora_id)

    def _forget(self, lora_id: int) -> None:
        known = self._known.pop(lora_id)
        assert not known.users
        slot = self._resident.pop(lora_id, None)
        if slot is not None:
            self.slots.clear_slot(slot)
            self._free_slots.append(slot)
            if self.record_changes:
                self._changes.append(SlotChange(slot, lora_id, None))


def enable_model_lora(
    model: CausalLM, config: EngineConfig, followers: LoRAFollowers | None = None
) -> LoRAManager:
    """Give ``model`` ``config.max_loras`` adapter slots and return their
    manager, reading adapters for it. Under tensor parallelism ``model`` is
    rank 0's shard and ``followers`` the group's other ranks, which change
    their slots as rank 0's change (see the module docstring)."""
    from structllm.model.llama import LlamaForCausalLM
    from structllm.model.lora import enable_lora, read_peft_adapter
    from structllm.model.parallel import lora_reader

    tp = config.tensor_parallel_size
    if tp > 1 and followers is None:
        raise EngineConfigError(
            f"enable_lora with tensor_parallel_size={tp} runs in the engine's "
            "core process, which starts the other ranks",
            field="enable_lora",
        )
    if not isinstance(model, LlamaForCausalLM):
        why = f"enable_lora: {type(model).__name__} has no LoRA slots"
        raise EngineConfigError(why, field="enable_lora")
    max_cpu, rank = config.max_cpu_loras or config.max_loras, config.max_lora_rank
    slots = enable_lora(model, max_loras=config.max_loras, max_lora_rank=rank)
    if followers is None:
        read = functools.partial(read_peft_adapter, config=model.config, max_rank=rank)
        return LoRAManager(slots, read, max_cpu_loras=max_cpu)
    full = lora_reader(config.model, 1, 0, max_rank=rank)
    followed = FollowedSlots(slots, followers)
    manager = LoRAManager(
        followed,
        lora_reader(config.model, tp, 0, max_rank=rank),
        record_changes=True,
        max_cpu_loras=max_cpu,
        digest=lambda a: adapter_digest(full(a.source)),  # the whole adapter's
    )
    followed.changes = manager.take_changes
    return manager


def _describe(request: LoRARequest) -> str:
    return f"{request.lora_name!r} from {request.lora_path!r}"
