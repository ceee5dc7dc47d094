"""The responses kept for ``previous_response_id``: in memory, bounded.

A response is kept only when its request says ``store: true``: the
response as it was sent (for ``GET /v1/responses/{id}``) and the
conversation it ends (its input and its output as chat messages, without
its ``instructions``, which OpenAI does not carry over), so that a later
request continues it. The least recently used go first once more than
``capacity`` responses, or more than ``max_chars`` characters of them
(their JSON), are kept; one larger than that alone is not kept. The store
is this server's alone: a restart, or another replica, does not know them.
"""

from __future__ import annotations

import collections
import json
from typing import Any

import attrs

from structllm.errors import InvalidRequestError

__all__ = ["ResponseStore", "StoredResponse"]


@attrs.frozen
class StoredResponse:
    #: the response body as it was sent
    response: dict[str, Any]
    #: the chat messages of the conversation it ends
    messages: tuple[dict[str, Any], ...]
    chars: int


@attrs.define(eq=False)
class ResponseStore:
    capacity: int = 1024
    max_chars: int = 64 << 20
    _kept: collections.OrderedDict[str, StoredResponse] = attrs.field(
        init=False, factory=collections.OrderedDict
    )
    _chars: int = attrs.field(init=False, default=0)

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> bool:
        """Keep ``response`` (by its ``id``); False if it is too large to."""
        chars = len(json.dumps(response)) + len(json.dumps(messages))
        if chars > self.max_chars:
            return False
        self.delete(response["id"])
        self._kept[response["id"]] = StoredResponse(response, tuple(messages), chars)
        self._chars += chars
        while len(self._kept) > self.capacity or self._chars > self.max_chars:
            _, old = self._kept.popitem(last=False)
            self._chars -= old.chars
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        kept = self._kept.get(response_id)
        if kept is not None:
            self._kept.move_to_end(response_id)
        return kept

    def delete(self, response_id: str) -> bool:
        kept = self._kept.pop(response_id, None)
        if kept is not None:
            self._chars -= kept.chars
        return kept is not None

    def conversation(self, response_id: str | None) -> list[dict[str, Any]]:
        """The messages that ``response_id`` ended ([] for None)."""
        if response_id is None:
            return []
        kept = self.get(response_id)
        if kept is None:
            raise InvalidRequestError(
                f"previous_response_id: no stored response {response_id!r} (only "
                f"responses created with store: true on this server are kept, "
                f"the latest {self.capacity} at most)",
                field="previous_response_id",
            )
        return [dict(m) for m in kept.messages]
