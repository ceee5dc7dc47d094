"""The responses kept for ``previous_response_id``: in memory, bounded.

A response is kept only when its request says ``store: true``; what is
kept is the conversation it ends (its input and its output as chat
messages, without its ``instructions``, which OpenAI does not carry over),
so a later request continues it. The oldest go first once ``capacity``
responses are kept; the store is this server's alone (a restart, or another
replica, does not know them).
"""

from __future__ import annotations

import collections
from typing import Any

import attrs

from structllm.errors import InvalidRequestError

__all__ = ["ResponseStore"]


@attrs.define(eq=False)
class ResponseStore:
    capacity: int = 1024
    _kept: collections.OrderedDict[str, tuple[dict[str, Any], ...]] = attrs.field(
        init=False, factory=collections.OrderedDict
    )

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        self._kept[response_id] = tuple(messages)
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def conversation(self, response_id: str | None) -> list[dict[str, Any]]:
        """The messages that ``response_id`` ended ([] for None)."""
        if response_id is None:
            return []
        kept = self._kept.get(response_id)
        if kept is None:
            raise InvalidRequestError(
                f"previous_response_id: no stored response {response_id!r} (only "
                f"responses created with store: true on this server are kept, "
                f"the latest {self.capacity})",
                field="previous_response_id",
            )
        self._kept.move_to_end(response_id)
        return [dict(m) for m in kept]
