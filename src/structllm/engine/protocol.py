"""Messages between the front end and the core process, and their framing.

Frames are a 4-byte big-endian length followed by a msgpack-encoded message
(a msgspec tagged union). The core process talks over a socket (never
stdout), so whatever the model or Paddle print cannot corrupt the stream.

    front -> core: Start (first), CoreRequest, AbortRequests,
                   ResetPrefixCache, InspectCore, AddLoRA, RemoveLoRA, Shutdown
    core -> front: LoadProgressMsg*, Ready | Fatal (first answers),
                   StepOutput, AddFailed, Heartbeat, PrefixCacheReset,
                   CoreState, LoRAAdded, LoRARemoved, Fatal

The core reads the front end's messages in the order they were sent and
handles every message it has read before its next step; a question
(ResetPrefixCache, InspectCore, AddLoRA, RemoveLoRA) is answered there, so its answer reflects
every message sent before it.

A request and a step's outputs cross the wire as the core's own structs
(:class:`~structllm.core.request.CoreRequest`,
:class:`~structllm.core.engine_core.StepOutput`), defined once in the core
and used unchanged in process by the offline ``LLM``: there is no wire-only
twin to convert to. Sampling params and the engine config are attrs classes
that msgspec encodes from their fields and decodes through their checks.
"""

from __future__ import annotations

import struct

import msgspec

from structllm.config import EngineConfig
from structllm.core.request import CoreRequest, StepOutput
from structllm.errors import InvalidRequestError, ModelLoadError
from structllm.lora_request import LoRARequest

__all__ = [
    "ANSWERS",
    "MAX_FRAME",
    "AbortRequests",
    "AddFailed",
    "AddLoRA",
    "CoreRequest",
    "CoreState",
    "Fatal",
    "FrameError",
    "FrameReader",
    "Heartbeat",
    "InspectCore",
    "LoRAAdded",
    "LoRARemoved",
    "LoadProgressMsg",
    "Message",
    "PrefixCacheReset",
    "Ready",
    "RemoveLoRA",
    "ResetPrefixCache",
    "Shutdown",
    "Start",
    "StepOutput",
    "decode",
    "encode",
]

_HEADER = struct.Struct(">I")
#: the largest frame body either side accepts
MAX_FRAME = 1 << 30


class Start(msgspec.Struct, tag=True):
    """Build an engine core from ``config``."""

    config: EngineConfig
    heartbeat_interval: float
    #: test hook: "raise_at_step:N", "hang_at_step:N", "exit_at_step:N",
    #: "slow_at_step:N", "stall_at_step:N" (see :mod:`structllm.testing.faults`)
    fault: str | None = None
    #: the tokenizer structured-output grammars use (None: the model's)
    tokenizer: str | None = None
    #: the front end's silence limit; with ``tensor_parallel_listen``, rank 0
    #: pings its followers every ``heartbeat_interval`` and a follower that
    #: hears nothing for this long exits
    heartbeat_timeout: float = 10.0
    #: how long one step may run while the core keeps sending heartbeats
    step_timeout: float = 300.0


class AbortRequests(msgspec.Struct, tag=True):
    """End these requests (and release the pins of these ids) and every
    member of these groups (a race's samples), before the next step."""

    request_ids: list[str]
    groups: list[str] = msgspec.field(default_factory=list)


class ResetPrefixCache(msgspec.Struct, tag=True):
    """Forget every cached prefix block; answered by PrefixCacheReset."""


class PrefixCacheReset(msgspec.Struct, tag=True):
    """The answer to ResetPrefixCache: how many cached blocks were dropped."""

    num_blocks: int


class InspectCore(msgspec.Struct, tag=True):
    """Ask for the core's own record of its requests and blocks; answered by
    CoreState. Cheap (no step waits for it); tests use it to check that an
    abort sent before it has taken effect in the core."""


class CoreState(msgspec.Struct, tag=True):
    """The answer to InspectCore: the core's record when it read the question,
    after every message sent before it and before its next step."""

    #: steps that ran a batch since this core started (its warm-up included)
    steps: int
    #: the ids (the core's) of every request it holds: waiting, running, or
    #: waiting for its grammar
    request_ids: list[str]
    #: KV blocks held by requests (free prefix-cache blocks are not held)
    blocks_used: int
    num_blocks: int
    #: structured-output grammars compiling or queued
    grammars_compiling: int = 0
    #: the ids of the pins it holds, and the blocks they hold (in blocks_used)
    pins: list[str] = msgspec.field(default_factory=list)
    blocks_pinned: int = 0
    #: KV blocks a draft model's cache holds for requests (speculative
    #: decoding's "draft_model"; 0 without one)
    draft_blocks_used: int = 0


class AddLoRA(msgspec.Struct, tag=True):
    """Read a LoRA adapter ahead of its requests; answered by LoRAAdded."""

    lora_request: LoRARequest


class LoRAAdded(msgspec.Struct, tag=True):
    """The answer to AddLoRA: read now (or known), or refused: the error's
    type name (ModelLoadError, InvalidRequestError), message and field."""

    added: bool
    error_kind: str | None = None
    message: str = ""
    field: str | None = None

    def result(self) -> bool:
        """``added``, or the core's refusal raised as its type."""
        if self.error_kind == "InvalidRequestError":
            raise InvalidRequestError(self.message, field=self.field)
        if self.error_kind is not None:
            raise ModelLoadError(self.message)
        return self.added


class RemoveLoRA(msgspec.Struct, tag=True):
    """Unload an adapter (its running requests finish with it); answered by
    LoRARemoved."""

    lora_id: int


class LoRARemoved(msgspec.Struct, tag=True):
    #: False: no such adapter was loaded
    removed: bool


class Shutdown(msgspec.Struct, tag=True):
    pass


class LoadProgressMsg(msgspec.Struct, tag=True):
    stage: str
    done: int
    total: int


class Ready(msgspec.Struct, tag=True):
    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int
    eos_token_ids: list[int]
    pid: int
    #: the KV cache's size in bytes, every layer and rank
    kv_cache_bytes: int = 0
    #: the core process's peak resident memory so far (model and cache loaded)
    peak_rss_bytes: int = 0


class AddFailed(msgspec.Struct, tag=True):
    """The core refused a request (its id is the one the core was given)."""

    request_id: str
    message: str
    field: str | None = None


class Heartbeat(msgspec.Struct, tag=True):
    num_running: int = 0
    num_waiting: int = 0
    blocks_used: int = 0
    #: the core process's peak resident memory so far (0: unknown)
    peak_rss_bytes: int = 0


class Fatal(msgspec.Struct, tag=True):
    """The core process cannot go on; it exits after sending this."""

    kind: str  # exception type name
    message: str
    traceback: str
    #: the failure happened while building the core (loading the model)
    during_load: bool = False
    #: the offending setting, for an EngineConfigError
    field: str | None = None


Message = (
    Start
    | CoreRequest
    | AbortRequests
    | ResetPrefixCache
    | PrefixCacheReset
    | InspectCore
    | CoreState
    | AddLoRA
    | LoRAAdded
    | RemoveLoRA
    | LoRARemoved
    | Shutdown
    | LoadProgressMsg
    | Ready
    | StepOutput
    | AddFailed
    | Heartbeat
    | Fatal
)

#: the core's answers to questions, each in the order it was asked
ANSWERS = (PrefixCacheReset, CoreState, LoRAAdded, LoRARemoved)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class FrameError(ValueError):
    """A frame that is too long or does not decode to a message."""


def encode(msg: Message) -> bytes:
    """One frame: length header and body."""
    body = _encoder.encode(msg)
    return _HEADER.pack(len(body)) + body


def decode(body: bytes) -> Message:
    """The message in one frame body; raises FrameError if there is none."""
    try:
        return _decoder.decode(body)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise FrameError(f"bad frame: {exc}") from exc


class FrameReader:
    """Splits a byte stream into frames; feed bytes, take whole messages."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Message]:
        self._buf += data
        out: list[Message] = []
        while len(self._buf) >= _HEADER.size:
            (n,) = _HEADER.unpack_from(self._buf)
            if n > MAX_FRAME:
                raise FrameError(f"frame of {n} bytes exceeds the limit")
            if len(self._buf) < _HEADER.size + n:
                break
            body = bytes(self._buf[_HEADER.size : _HEADER.size + n])
            del self._buf[: _HEADER.size + n]
            out.append(decode(body))
        return out
