"""Fault injection with the real worker process: the engine never hangs.

Every live request gets EngineDeadError (chained from the cause) within 2 s
of the worker dying; the supervisor restarts the worker with backoff, and
after ``max_restarts`` within the window the engine stays dead and every
call fails at once.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import anyio
import pytest

from structllm import EngineDeadError, ModelLoadError, SamplingParams
from structllm.config import EngineConfig
from structllm.engine.frontend.async_llm import AsyncLLM
from structllm.engine.frontend.core_connection import core_process_command
from structllm.engine.protocol import (
    CoreState,
    FrameReader,
    InspectCore,
    Message,
    Ready,
    Start,
    encode,
)
from structllm.errors import EngineCoreError
from structllm.model.checkpoint import write_random_checkpoint
from structllm.model.config import tiny_random_config
from structllm.testing.faults import inject_fault
from tests.processes import alive, consume_until_dead

pytestmark = pytest.mark.anyio

ENGINE = {"max_model_len": 256, "num_blocks": 64, "show_progress": False}
SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


async def test_sigkill_mid_stream_then_restart() -> None:
    async with AsyncLLM.open("tiny-random", max_restarts=2, **ENGINE) as llm:
        pid = llm.statistics().core_pid
        assert pid is not None
        killed_at = 0.0

        async def killer() -> None:
            nonlocal killed_at
            await llm.wait_statistics(lambda s: s.running > 0)
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)

        async with anyio.create_task_group() as tg:
            tg.start_soon(killer)
            err, failed_at = await consume_until_dead(llm)
        assert failed_at - killed_at < 2.0
        assert err.__cause__ is not None
        # the supervisor restarts the worker; new requests wait for it
        with anyio.fail_after(30):
            out = await llm.complete("Hello", SHORT)
        assert out.finish_reason == "length"
        stats = llm.statistics()
        assert stats.restarts == 1 and not stats.dead and stats.core_pid != pid


async def test_forward_raises_at_step() -> None:
    with inject_fault("raise_at_step:5"):
        async with AsyncLLM.open("tiny-random", **ENGINE) as llm:
            err, _ = await consume_until_dead(llm)
            assert isinstance(err.__cause__, EngineCoreError)
            assert "injected fault at step 5" in str(err.__cause__)
            with anyio.fail_after(30):
                assert (await llm.complete("x", SHORT)).finish_reason == "length"


async def test_hung_worker_detected_by_heartbeat() -> None:
    """A wedged step: heartbeats go on for ``step_timeout``, then stop."""
    with inject_fault("hang_at_step:3"):
        async with AsyncLLM.open(
            "tiny-random", heartbeat_timeout=1.0, step_timeout=0.5, **ENGINE
        ) as llm:
            start = time.monotonic()
            err, failed_at = await consume_until_dead(llm)
            assert isinstance(err.__cause__, TimeoutError)
            # step_timeout + heartbeat_timeout, plus a few steps
            assert failed_at - start < 2.5 + 1.0
            with anyio.fail_after(30):
                assert (await llm.complete("x", SHORT)).finish_reason == "length"


async def test_a_step_longer_than_the_heartbeat_timeout_is_not_a_dead_core() -> None:
    """A slow step (3 s, three times ``heartbeat_timeout``) keeps the core
    alive: heartbeats go on through it, and every request finishes."""
    from structllm.engine.child import SLOW_STEP_S

    with inject_fault("slow_at_step:3"):
        async with AsyncLLM.open(
            "tiny-random",
            heartbeat_interval=0.2,
            heartbeat_timeout=SLOW_STEP_S / 3,
            **ENGINE,
        ) as llm:
            start = time.monotonic()
            with anyio.fail_after(30):
                out = await llm.complete(
                    "x", SamplingParams(max_tokens=8, ignore_eos=True)
                )
            assert out.finish_reason == "length"
            assert time.monotonic() - start >= SLOW_STEP_S  # it did run slow
            assert llm.statistics().restarts == 0
            with anyio.fail_after(30):
                assert (await llm.complete("x", SHORT)).finish_reason == "length"


async def test_restart_budget_exhausted() -> None:
    with inject_fault("exit_at_step:0", starts=100):
        async with AsyncLLM.open(
            "tiny-random", max_restarts=1, restart_backoff=0.05, **ENGINE
        ) as llm:
            # wait_dead (the server's watch) returns once it is dead for good
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(llm.wait_dead)
                    for _ in range(2):
                        with pytest.raises(EngineDeadError):
                            await llm.complete("x", SHORT)
                    await llm.wait_statistics(lambda s: s.dead)
            start = time.monotonic()
            with pytest.raises(EngineDeadError, match="not restarting"):
                await llm.complete("x", SHORT)
            with pytest.raises(EngineDeadError):
                await llm.check_health()
            assert time.monotonic() - start < 0.5  # at once, no waiting
            assert llm.statistics().restarts == 1


async def test_bad_checkpoint_fails_open(tmp_path: Path) -> None:
    write_random_checkpoint(tmp_path, tiny_random_config())
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 16)
    # the byte tokenizer stands in: this checkpoint has no tokenizer files
    with pytest.raises(ModelLoadError, match="safetensors"):
        async with AsyncLLM.open(str(tmp_path), tokenizer="tiny-random", **ENGINE):
            pytest.fail("open() should have failed")  # pragma: no cover


def test_worker_exits_when_parent_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, anyio
            from structllm.engine.frontend.async_llm import AsyncLLM

            async def main():
                async with AsyncLLM.open("tiny-random", show_progress=False) as llm:
                    print(llm.statistics().core_pid, flush=True)
                    await anyio.sleep(3600)

            anyio.run(main)
            """
        )
    )
    parent = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        worker = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 5
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(worker)
    finally:
        parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()


def test_worker_outlives_the_thread_that_started_it() -> None:
    """Only the parent *process* dying ends the worker.

    trio starts processes from pooled threads that retire after 10 s idle; a
    worker tied to its spawning thread (PR_SET_PDEATHSIG) died with it.
    """
    ours, theirs = socket.socketpair()
    procs: list[subprocess.Popen[bytes]] = []
    release = threading.Event()

    def spawn() -> None:
        fd = theirs.fileno()
        procs.append(subprocess.Popen(core_process_command(fd), pass_fds=[fd]))
        release.wait()  # stay alive until the worker is fully up

    thread = threading.Thread(target=spawn)
    thread.start()
    try:
        # handshake: once Ready arrives, the worker has set up its parent watch
        ours.sendall(
            encode(
                Start(
                    config=EngineConfig(
                        model="tiny-random", max_model_len=64, num_blocks=8
                    ),
                    heartbeat_interval=1.0,
                )
            )
        )
        reader = FrameReader()
        ready = False
        while not ready:
            data = ours.recv(1 << 16)
            assert data, "the worker exited during start-up"
            ready = any(isinstance(m, Ready) for m in reader.feed(data))
        release.set()
        thread.join()  # the spawning thread is gone now (a death signal tied
        # to it is sent as it exits): a question still gets its answer
        ours.sendall(encode(InspectCore()))
        ours.settimeout(30)
        answers: list[Message] = []
        while not any(isinstance(m, CoreState) for m in answers):
            data = ours.recv(1 << 16)
            assert data, "the worker died with its spawning thread"
            answers += reader.feed(data)
        (worker,) = procs
        assert worker.poll() is None
    finally:
        release.set()
        thread.join()
        theirs.close()
        ours.close()  # EOF: the worker exits by itself
        for worker in procs:
            assert worker.wait(timeout=10) == 0
