"""The messages between a tensor-parallel group's rank 0 and its followers.

Both sides speak this (:mod:`structllm.engine.rank_group`, rank 0's;
:mod:`structllm.engine.rank_group.follower`, a follower's), on a socketpair to a
spawned follower or a TCP connection to a ``--connect`` one: tagged msgspec
structs in msgpack, each framed by a 4-byte big-endian length. In order:

- a ``--connect`` follower first says :class:`Hello`;
- rank 0 sends :class:`RankSetup` (what to load; to a connected follower
  also its ``paddle.distributed`` variables and its silence timeout), then
  :class:`AllocateKV` once the KV cache is sized, then one :class:`Step`
  each step (with LoRA enabled, followed by its :class:`StepLoRA`), and
  :class:`Ping` to connected followers when otherwise idle;
- a follower that raised sends :class:`RankFailed` and exits. Nothing else
  comes back: every rank computes the full logits, and only rank 0 samples.
"""

from __future__ import annotations

import socket
import struct

import msgspec

from structllm.config import EngineConfig
from structllm.core.runner import ModelInput

__all__ = [
    "HELLO_TIMEOUT",
    "AllocateKV",
    "Hello",
    "Ping",
    "RankFailed",
    "RankMessage",
    "RankSetup",
    "Step",
    "StepLoRA",
    "frame",
    "receive",
]

_HEADER = struct.Struct(">I")
#: seconds rank 0 gives a new connection to say Hello (a stray client is
#: dropped, and rank 0 waits on for real followers), and a follower gives
#: each attempt to connect
HELLO_TIMEOUT = 10.0


class Hello(msgspec.Struct, tag=True):
    """A ``--connect`` follower's first message: who it is, for messages."""

    pid: int
    host: str


class RankSetup(msgspec.Struct, tag=True):
    """First message to a follower: what to load (its rank is in its env)."""

    config: EngineConfig
    #: test hook, as core_process's: "raise_at_step:N", "hang_at_step:N"
    fault: str | None = None
    #: ``--connect`` followers: the ``paddle.distributed`` variables to run
    #: with (a spawned follower inherits them)
    env: dict[str, str] = {}
    #: ``--connect`` followers: exit after this many seconds without a word
    #: from rank 0 (None: a spawned follower watches rank 0's pid instead)
    silence_timeout: float | None = None
    #: ``--connect`` followers: mid-step, wait this much longer for rank 0
    #: (its ``step_timeout``: its front end lets its steps run as long)
    step_timeout: float | None = None


class Ping(msgspec.Struct, tag=True):
    """Rank 0 is alive (sent to ``--connect`` followers when otherwise idle)."""


class AllocateKV(msgspec.Struct, tag=True):
    """Rank 0 has sized the KV cache: allocate the same number of blocks."""

    num_blocks: int


class Step(msgspec.Struct, tag=True):
    """Run this forward (rank 0 runs it too)."""

    input: ModelInput


class StepLoRA(msgspec.Struct, tag=True):
    """With ``enable_lora``, what the last :class:`Step`'s forward needs of
    the adapters (rank 0 sends it once it has set its own rows, before its
    forward): the slot changes since the previous one, in order, each
    ``(slot, adapter directory)`` (None: the slot is emptied), which every
    rank reads its share of; and each row's slot, ``(T,)`` int64 bytes,
    native byte order (None: no row uses an adapter)."""

    changes: tuple[tuple[int, str | None], ...]
    rows: bytes | None


class RankFailed(msgspec.Struct, tag=True):
    """A follower raised; it exits after sending this."""

    rank: int
    kind: str
    message: str
    traceback: str


RankMessage = Hello | RankSetup | Ping | AllocateKV | Step | StepLoRA | RankFailed
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(RankMessage)


def frame(msg: RankMessage) -> bytes:
    body = _encoder.encode(msg)
    return _HEADER.pack(len(body)) + body


def receive(sock: socket.socket) -> RankMessage | None:
    """The next message (blocking); None at EOF."""
    header = _read_exactly(sock, _HEADER.size)
    if header is None:
        return None
    (n,) = _HEADER.unpack(header)
    body = _read_exactly(sock, n)
    if body is None:
        return None
    return _decoder.decode(body)


def _read_exactly(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        data = sock.recv(n - len(buf))
        if not data:
            return None
        buf += data
    return bytes(buf)
