"""Messages between the front end and the engine-core worker, and their framing.

Frames are a 4-byte big-endian length followed by a msgpack-encoded message
(msgspec tagged union). The worker talks over a socket (never stdout), so
whatever the model or Paddle print cannot corrupt the stream.

    front -> worker: Start (first), AddRequest, AbortRequests, Shutdown
    worker -> front: LoadProgressMsg*, Ready | Fatal (first answers),
                     StepResult, AddFailed, Heartbeat, Fatal
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

__all__ = [
    "AbortRequests",
    "AddFailed",
    "AddRequest",
    "Fatal",
    "FrameReader",
    "Heartbeat",
    "LoadProgressMsg",
    "Message",
    "Ready",
    "Shutdown",
    "Start",
    "StepResult",
    "WireOutput",
    "decode",
    "encode",
]

_HEADER = struct.Struct(">I")
MAX_FRAME = 1 << 30


class Start(msgspec.Struct, tag=True):
    """Build an engine core from these EngineConfig fields."""

    config: dict[str, Any]
    heartbeat_interval: float
    #: test hook: "raise_at_step:N", "hang_at_step:N", "exit_at_step:N"
    fault: str | None = None


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]
    eos_token_ids: list[int]
    priority: int = 0


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


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


class WireOutput(msgspec.Struct, array_like=True):
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    #: per new token: [sampled_logprob, sampled_rank, top_ids, top_logprobs]
    logprobs: list[tuple[float, int, list[int], list[float]]] | None = None
    queue_s: float | None = None
    #: on a request's first output: prompt tokens found in the prefix cache
    num_cached_tokens: int | None = None


class StepResult(msgspec.Struct, tag=True):
    outputs: list[WireOutput]
    #: scheduler snapshot after the step
    num_running: int
    num_waiting: int
    blocks_used: int
    total_preemptions: int
    step_s: float
    num_batched_tokens: int


class AddFailed(msgspec.Struct, tag=True):
    request_id: str
    message: str
    field: str | None = None


class Heartbeat(msgspec.Struct, tag=True):
    num_running: int = 0
    num_waiting: int = 0
    blocks_used: int = 0


class Fatal(msgspec.Struct, tag=True):
    """The worker cannot go on; it exits after sending this."""

    kind: str  # exception type name
    message: str
    traceback: str
    #: the failure happened while loading the model (a ModelLoadError)
    during_load: bool = False


Message = (
    Start
    | AddRequest
    | AbortRequests
    | Shutdown
    | LoadProgressMsg
    | Ready
    | StepResult
    | AddFailed
    | Heartbeat
    | Fatal
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    body = _encoder.encode(msg)
    return _HEADER.pack(len(body)) + body


def decode(body: bytes) -> Message:
    return _decoder.decode(body)


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
                raise ValueError(f"frame of {n} bytes exceeds the limit")
            if len(self._buf) < _HEADER.size + n:
                break
            body = bytes(self._buf[_HEADER.size : _HEADER.size + n])
            del self._buf[: _HEADER.size + n]
            out.append(decode(body))
        return out
