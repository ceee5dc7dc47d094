"""Incremental detokenization with stop strings.

Decoding the whole sequence after every token costs O(n) per step and
O(n²) per request. :class:`IncrementalDetokenizer` keeps the window that
vLLM and TGI keep instead: ``ids[prefix_offset:read_offset]`` is text already
released, ``ids[read_offset:]`` is new. Each token decodes only the window,
and the text the new tokens add is ``decode(ids[prefix_offset:])`` minus
``decode(ids[prefix_offset:read_offset])``. While that ends in U+FFFD, a
UTF-8 character is still incomplete and nothing is released. The window
starts on the last prompt tokens so that decoders which drop a leading space
(SentencePiece's Metaspace) see the first generated token mid-sequence.

Stop strings are searched only in text that is new or held back, and the
longest tail that could still grow into a stop string is held back, so a
partial stop string is never released.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from structllm.text.tokenizer import Tokenizer

__all__ = ["DetokenizerUpdate", "IncrementalDetokenizer"]

#: How many prompt tokens start the window.
_CONTEXT_TOKENS = 5


@attrs.frozen
class DetokenizerUpdate:
    """What one call released: new text and, when it ended the text, the stop."""

    #: text released by this call (may be empty)
    text: str
    #: the stop string that was found; the detokenizer takes no more tokens
    stop_str: str | None = None
    #: how many of the ids given were taken: all, unless a stop string ended
    #: the text at one of them (the rest are past the end)
    num_taken: int = 0

    @property
    def stopped(self) -> bool:
        return self.stop_str is not None


def _to_stops(stop: str | Iterable[str]) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if any(not isinstance(s, str) or not s for s in stops):
        raise ValueError(f"stop strings must be non-empty strings, got {stops!r}")
    return stops


@attrs.define(eq=False)
class IncrementalDetokenizer:
    """Turns one request's generated tokens into text, one step at a time.

    Feed tokens with :meth:`add_tokens`; when the request ends for any reason
    other than a stop string, call :meth:`finish` to release held-back text.
    The concatenated updates equal ``tokenizer.decode(token_ids)`` cut at the
    first stop string to complete (it is kept if
    *include_stop_str_in_output*).
    """

    tokenizer: Tokenizer
    prompt_token_ids: Sequence[int] = attrs.field(default=(), repr=False)
    skip_special_tokens: bool = attrs.field(default=True, kw_only=True)
    stop: tuple[str, ...] = attrs.field(default=(), kw_only=True, converter=_to_stops)
    include_stop_str_in_output: bool = attrs.field(default=False, kw_only=True)

    #: context tokens then generated tokens; the window is a slice of these
    _ids: list[int] = attrs.field(init=False, repr=False)
    _num_context: int = attrs.field(init=False, repr=False)
    _prefix_offset: int = attrs.field(init=False, repr=False)
    _read_offset: int = attrs.field(init=False, repr=False)
    _max_stop_len: int = attrs.field(init=False, repr=False)
    #: released text, in pieces joined on demand
    _chunks: list[str] = attrs.field(init=False, factory=list, repr=False)
    #: decoded but held back because it may start a stop string
    _pending: str = attrs.field(init=False, default="", repr=False)
    _stop_str: str | None = attrs.field(init=False, default=None)
    _finished: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        context = list(self.prompt_token_ids[-_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith("\ufffd"):
            # The prompt ends inside a character; it can't serve as context.
            context = []
        self._ids = context
        self._num_context = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._max_stop_len = max(map(len, self.stop), default=0)

    @property
    def token_ids(self) -> list[int]:
        """The generated tokens taken so far; tokens after a stop string are not."""
        return self._ids[self._num_context :]

    @property
    def text(self) -> str:
        """All text released so far."""
        if len(self._chunks) > 1:
            self._chunks[:] = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def stop_str(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self._stop_str

    @property
    def finished(self) -> bool:
        """True after a stop string or :meth:`finish`."""
        return self._finished

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, new_ids: Iterable[int]) -> DetokenizerUpdate:
        """Take newly generated tokens; return the text they release.

        Once finished (a stop string was found or :meth:`finish` was called)
        further tokens are ignored and the update is empty.
        """
        if self._finished:
            return DetokenizerUpdate("")
        released: list[str] = []
        taken = 0
        for token_id in new_ids:
            if self._finished:
                break  # a stop string: the remaining tokens are not taken
            self._ids.append(token_id)
            taken += 1
            prefix_text = self._decode(
                self._ids[self._prefix_offset : self._read_offset]
            )
            new_text = self._decode(self._ids[self._prefix_offset :])
            if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
                continue  # nothing yet, or an incomplete UTF-8 character
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            released.append(self._take(new_text[len(prefix_text) :]))
        return self._update("".join(released), taken)

    def finish(self) -> DetokenizerUpdate:
        """Release everything held back (incomplete characters as U+FFFD).

        Call it when the request ends for a reason other than a stop string.
        Idempotent: later calls return an empty update.
        """
        if self._finished:
            return DetokenizerUpdate("")
        text = ""
        if self._read_offset < len(self._ids):
            prefix_text = self._decode(
                self._ids[self._prefix_offset : self._read_offset]
            )
            new_text = self._decode(self._ids[self._prefix_offset :])
            self._read_offset = len(self._ids)
            text = self._take(new_text[len(prefix_text) :])
        if not self._finished:
            text += self._pending
            self._pending = ""
            self._finished = True
        return self._update(text)

    def _update(self, text: str, taken: int = 0) -> DetokenizerUpdate:
        if text:
            self._chunks.append(text)
        stop = self._stop_str if self._finished else None
        return DetokenizerUpdate(text, stop, taken)

    def _take(self, delta: str) -> str:
        """Add decoded text; return the part that may be released now."""
        if not self.stop:
            return delta
        buf = self._pending + delta
        # The match that completes first wins (the longest, if several do).
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            start = buf.find(s)
            if start >= 0:
                candidate = (start + len(s), start, s)
                best = candidate if best is None else min(best, candidate)
        if best is not None:
            end, start, s = best
            self._pending = ""
            self._stop_str = s
            self._finished = True
            return buf[: end if self.include_stop_str_in_output else start]
        # Hold back the longest tail that a stop string starts with.
        hold = 0
        for k in range(min(len(buf), self._max_stop_len - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stop):
                hold = k
                break
        self._pending = buf[len(buf) - hold :]
        return buf[: len(buf) - hold]
