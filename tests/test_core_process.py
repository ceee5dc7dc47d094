"""The core process's loop, driven in process over a socketpair.

``serve()`` is what ``python -m structllm.engine.core_process`` runs; here it
runs in a thread, and the test speaks the protocol on the other end.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import anyio
import anyio.abc
import pytest
from anyio.lowlevel import checkpoint

from structllm.config import EngineConfig
from structllm.core.engine_core import StepOutput
from structllm.core.request import CoreRequest
from structllm.engine.core_process.loop import serve
from structllm.engine.frontend.core_connection import CoreConnection
from structllm.engine.protocol import (
    AbortRequests,
    AddFailed,
    Fatal,
    FrameReader,
    Heartbeat,
    LoadProgressMsg,
    Message,
    Ready,
    Shutdown,
    Start,
    encode,
)
from structllm.params import SamplingParams

CONFIG = EngineConfig(model="tiny-random", max_model_len=128, num_blocks=16)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


class Peer:
    """The front end's side of the socket, synchronous."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = FrameReader()
        self.backlog: list[Message] = []

    def send(self, msg: Message) -> None:
        self.sock.sendall(encode(msg))

    def receive(self) -> Message:
        while not self.backlog:
            data = self.sock.recv(1 << 16)
            assert data, "the core closed the socket"
            self.backlog += self.reader.feed(data)
        return self.backlog.pop(0)

    def until(self, predicate: Callable[[Message], bool]) -> list[Message]:
        """Messages up to and including the first that satisfies ``predicate``."""
        got = [self.receive()]
        while not predicate(got[-1]):
            got.append(self.receive())
        return got


@contextmanager
def core_loop(
    config: EngineConfig = CONFIG,
    fault: str | None = None,
    heartbeat_interval: float = 0.05,
) -> Iterator[tuple[Peer, list[int]]]:
    ours, theirs = socket.socketpair()
    ours.settimeout(60)
    codes: list[int] = []

    def run() -> None:
        try:
            codes.append(serve(theirs))
        finally:
            theirs.close()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        peer = Peer(ours)
        peer.send(Start(config, heartbeat_interval=heartbeat_interval, fault=fault))
        yield peer, codes
    finally:
        ours.close()  # EOF: the loop ends by itself
        thread.join(60)
        assert not thread.is_alive()


def outputs_of(messages: list[Message], rid: str) -> list[int]:
    return [
        t
        for m in messages
        if isinstance(m, StepOutput)
        for o in m.outputs
        if o.request_id == rid
        for t in o.new_token_ids
    ]


def finished(rid: str) -> Callable[[Message], bool]:
    return lambda m: (
        isinstance(m, StepOutput)
        and any(o.request_id == rid and o.finish_reason is not None for o in m.outputs)
    )


def test_the_step_that_leaves_the_core_idle_reports_its_memory() -> None:
    """A heartbeat follows the step that leaves the core idle, with the
    process's peak memory (telemetry of the process, not of the core's
    step): current when a burst ends, not a heartbeat interval later."""
    with core_loop(heartbeat_interval=3600) as (peer, _):
        peer.until(lambda m: isinstance(m, Ready))
        peer.send(CoreRequest(request_id="a", prompt_token_ids=(1, 2), params=GREEDY))
        got = peer.until(finished("a"))
        assert not any(isinstance(m, Heartbeat) for m in got)
        assert isinstance(got[-1], StepOutput) and got[-1].blocks_used == 0
        beat = peer.until(lambda m: True)
        assert len(beat) == 1 and isinstance(beat[0], Heartbeat)
        assert beat[0].blocks_used == 0 and beat[0].peak_rss_bytes > 100 * 2**20


def test_start_serve_refuse_abort_and_shut_down() -> None:
    with core_loop() as (peer, codes):
        startup = peer.until(lambda m: isinstance(m, Ready))
        assert all(isinstance(m, LoadProgressMsg) for m in startup[:-1])
        assert any(m.stage == "warmup" for m in startup[:-1])  # type: ignore[union-attr]
        ready = startup[-1]
        assert isinstance(ready, Ready) and ready.num_blocks == 16

        # one request runs to its length
        peer.send(CoreRequest(request_id="a", prompt_token_ids=(1, 2), params=GREEDY))
        got = peer.until(finished("a"))
        assert len(outputs_of(got, "a")) == 4
        last = got[-1]
        assert (
            isinstance(last, StepOutput) and last.outputs[-1].finish_reason == "length"
        )

        # a request the core refuses names its field; the loop serves on
        peer.send(CoreRequest(request_id="bad", prompt_token_ids=(), params=GREEDY))
        refused = peer.until(lambda m: isinstance(m, AddFailed))[-1]
        assert isinstance(refused, AddFailed)
        assert refused.request_id == "bad" and refused.field == "prompt"

        # an abort mid-flight frees the blocks at once
        long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        peer.send(CoreRequest(request_id="b", prompt_token_ids=(3,), params=long))
        peer.until(lambda m: isinstance(m, StepOutput) and bool(m.outputs))
        peer.send(AbortRequests(["b"]))
        rest = peer.until(lambda m: isinstance(m, Heartbeat) and m.blocks_used == 0)
        assert len(outputs_of(rest, "b")) < 100

        # idle: heartbeats keep coming
        beat = peer.until(lambda m: isinstance(m, Heartbeat))[-1]
        assert isinstance(beat, Heartbeat)
        assert (beat.num_running, beat.num_waiting, beat.blocks_used) == (0, 0, 0)
        # the process's own peak memory: Paddle and the model at least
        assert beat.peak_rss_bytes >= ready.peak_rss_bytes > 100 * 2**20
        assert ready.kv_cache_bytes > 0

        peer.send(Shutdown())
        with pytest.raises(AssertionError, match="closed"):
            peer.until(lambda m: False)
    assert codes == [0]


def test_the_loop_ends_on_eof() -> None:
    with core_loop() as (peer, codes):
        peer.until(lambda m: isinstance(m, Ready))
        peer.send(CoreRequest(request_id="a", prompt_token_ids=(1,), params=GREEDY))
    assert codes == [0]


def test_a_setting_that_cannot_work_is_a_fatal_config_error() -> None:
    small = EngineConfig(model="tiny-random", max_model_len=256, num_blocks=4)
    with core_loop(small) as (peer, codes):
        fatal = peer.until(lambda m: isinstance(m, Fatal))[-1]
    assert isinstance(fatal, Fatal) and fatal.during_load
    assert fatal.kind == "EngineConfigError" and fatal.field == "num_blocks"
    assert codes == [1]


def test_a_failing_step_is_fatal() -> None:
    with core_loop(fault="raise_at_step:1") as (peer, codes):
        peer.until(lambda m: isinstance(m, Ready))
        peer.send(CoreRequest(request_id="a", prompt_token_ids=(1,), params=GREEDY))
        fatal = peer.until(lambda m: isinstance(m, Fatal))[-1]
        assert isinstance(fatal, Fatal) and not fatal.during_load
        assert "injected fault at step 1" in fatal.message
        assert "Traceback" in fatal.traceback
    assert codes == [1]


@pytest.mark.anyio
async def test_a_read_cancelled_as_its_data_arrives_leaves_no_error() -> None:
    """The socket turns readable in the loop iteration that cancels the read.

    anyio 4.16's asyncio UNIX stream then set a cancelled future from its
    reader callback: ``InvalidStateError`` in the event loop, which the test
    runner raises at the end of the test.
    """
    ours, theirs = socket.socketpair()
    stream = await anyio.abc.UNIXSocketStream.from_socket(ours)
    conn = CoreConnection(stream)
    with theirs:
        async with stream:
            async with anyio.create_task_group() as tg:
                tg.start_soon(conn.receive)
                await anyio.wait_all_tasks_blocked()  # the read waits on the socket
                theirs.sendall(encode(Heartbeat()))
                # the next iteration runs this task, then the readable
                # socket's callback: cancel the read in between
                await checkpoint()
                tg.cancel_scope.cancel()
            # the connection still works (the first heartbeat may have been
            # read by the cancelled task, as its wake-up raced the cancel)
            theirs.sendall(encode(Heartbeat(num_running=7)))
            with anyio.fail_after(5):
                while (msg := await conn.receive()) != Heartbeat(num_running=7):
                    assert msg == Heartbeat()
