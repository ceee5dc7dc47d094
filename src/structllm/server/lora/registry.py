"""The server's LoRA adapters by name: what a request's ``model`` picks.

:class:`LoRARegistry`: the served model's name is the base model, an
adapter's name that adapter (``--lora-modules NAME=PATH`` at start,
``POST /v1/load_lora_adapter`` later). It hands out the ids (1, 2, ...: an
id is never reused, so the engine's "one id, one adapter" rule holds across
unloads) and asks the engine to read each adapter before the name answers,
so a corrupt or mismatched adapter is a 400 naming the file and tensor and
nothing changes.

Unloading takes the name away at once; requests already running with the
adapter finish with it (see docs/cancellation.md). Changes are serialised
by a lock, and the engine's part of one is shielded from cancellation: a
client that disconnects mid-load leaves the registry and the engine
agreeing (the adapter loaded and named, or neither).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Protocol

import anyio
import attrs

from structllm.errors import InvalidRequestError, ModelLoadError
from structllm.lora_request import LoRARequest
from structllm.server.models.protocol import ModelCard

__all__ = [
    "AdapterNotFoundError",
    "LoRAEngine",
    "LoRARegistry",
    "parse_lora_modules",
]


class LoRAEngine(Protocol):
    """What the registry needs of the engine (``AsyncLLM``)."""

    async def add_lora(self, lora_request: LoRARequest) -> bool: ...

    async def remove_lora(self, lora_id: int) -> bool: ...


class AdapterNotFoundError(Exception):
    """An unload names no loaded adapter (404, ``param: lora_name``)."""


def parse_lora_modules(modules: Iterable[str]) -> list[tuple[str, str]]:
    """``--lora-modules``' ``NAME=PATH`` items as pairs (the path may hold
    ``=``; ``ServerConfig`` checked their form)."""
    pairs = []
    for item in modules:
        name, _, path = item.partition("=")
        pairs.append((name, path))
    return pairs


@attrs.define(eq=False)
class LoRARegistry:
    """The adapters a server answers to, by name, over ``base_model``."""

    #: the served model's name: never an adapter's
    base_model: str
    _adapters: dict[str, LoRARequest] = attrs.field(init=False, factory=dict)
    _ids: Iterator[int] = attrs.field(init=False, factory=lambda: itertools.count(1))
    _lock: anyio.Lock = attrs.field(init=False, factory=anyio.Lock)

    def lookup(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names; None for the base model,
        no model, or a name that is not an adapter's (``check_model``
        refuses those)."""
        return None if model is None else self._adapters.get(model)

    def adapters(self) -> list[LoRARequest]:
        """The loaded adapters, in the order they were loaded."""
        return list(self._adapters.values())

    def cards(self, created: int, max_model_len: int) -> list[ModelCard]:
        """``/v1/models``' cards of the adapters: each names the base model
        as its ``parent`` and its directory as its ``root`` (vLLM's)."""
        return [
            ModelCard(
                id=r.lora_name,
                created=created,
                root=r.lora_path,
                parent=self.base_model,
                max_model_len=max_model_len,
            )
            for r in self._adapters.values()
        ]

    async def load(
        self, engine: LoRAEngine, name: str, path: str, *, replace: bool = False
    ) -> LoRARequest:
        """Load the adapter in ``path`` as ``name`` (``replace``: in place
        of the one of that name, which is unloaded once the new one has
        loaded). Refuses the base model's name, a name taken (without
        ``replace``), and, as :class:`InvalidRequestError` naming
        ``lora_path``, an adapter the engine cannot read or fit."""
        if name == self.base_model:
            raise InvalidRequestError(
                f"{name!r} is the base model's name; an adapter needs its own",
                field="lora_name",
            )
        async with self._lock:
            old = self._adapters.get(name)
            if old is not None and not replace:
                raise InvalidRequestError(
                    f"the LoRA adapter {name!r} is already loaded (from "
                    f"{old.lora_path!r}); unload it first, or load_inplace",
                    field="lora_name",
                )
            request = LoRARequest(name, next(self._ids), path)
            with anyio.CancelScope(shield=True):
                try:
                    await engine.add_lora(request)
                except ModelLoadError as exc:
                    raise InvalidRequestError(str(exc), field="lora_path") from exc
                self._adapters[name] = request
                if old is not None:
                    await engine.remove_lora(old.lora_int_id)
            return request

    async def unload(
        self, engine: LoRAEngine, name: str, lora_id: int | None = None
    ) -> LoRARequest:
        """Unload adapter ``name`` (whose id must be ``lora_id`` if given)."""
        async with self._lock:
            request = self._adapters.get(name)
            if request is None or lora_id not in (None, request.lora_int_id):
                raise AdapterNotFoundError(
                    f"the LoRA adapter {name!r}"
                    + ("" if lora_id is None else f" with id {lora_id}")
                    + " is not loaded"
                )
            with anyio.CancelScope(shield=True):
                del self._adapters[name]
                await engine.remove_lora(request.lora_int_id)
            return request

    async def load_modules(
        self, engine: LoRAEngine, modules: Iterable[str]
    ) -> list[LoRARequest]:
        """Load ``--lora-modules``' ``NAME=PATH`` items, in order (the first
        that fails stops the server's start)."""
        return [
            await self.load(engine, name, path)
            for name, path in parse_lora_modules(modules)
        ]
