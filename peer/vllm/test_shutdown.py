# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Adapted for structllm from vllm-project/vllm
# tests/entrypoints/openai/completion/test_shutdown.py
# (commit 2a48a98329816fec103959bf34b79d022dfebe98). What changed and why:
# peer/vllm/NOTES.md; every change is marked "structllm:" below.
"""Integration tests for shutdown behavior, timeout, and signal handling."""

import asyncio
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field

import httpx
import openai
import pytest

from peer.conftest import StructllmServer

# structllm: each test starts its own ``structllm serve tiny`` (upstream:
# RemoteOpenAIServer("hmellor/tiny-random-LlamaForCausalLM", ...)). vLLM's
# --shutdown-timeout N (how long in-flight requests get after SIGTERM, 0 =
# abort them) -> --graceful-timeout N (the same for the HTTP requests) and
# --shutdown-grace N (the engine's own drain after them); --dtype,
# --enforce-eager, --gpu-memory-utilization go. ROCm's pipe workaround goes.
# pytest.mark.asyncio -> pytest.mark.anyio.
# structllm: test_multi_api_server_shutdown is not applicable (vLLM's
# --api-server-count; structllm serves from one process).
pytestmark = pytest.mark.anyio

MODEL_NAME = "tiny"

_PROCESS_EXIT_TIMEOUT = 15
_SHUTDOWN_DETECTION_TIMEOUT = 10
_CHILD_CLEANUP_TIMEOUT = 10
_INFLIGHT_REQUEST_START_TIMEOUT = 5
_INFLIGHT_REQUEST_POLL_INTERVAL = 0.1
_ABORT_CLIENT_TIMEOUT = 3


def _server_args(shutdown_timeout: float) -> list[str]:
    # structllm: see the note at the top
    return [
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "4",
        "--graceful-timeout",
        str(shutdown_timeout),
        "--shutdown-grace",
        str(shutdown_timeout),
    ]


# structllm: psutil (not a dependency here) -> /proc, on Linux
def _ppid_and_state(pid: int) -> tuple[int, str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[1]), fields[0]


def _get_child_pids(parent_pid: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (info := _ppid_and_state(int(name))) is not None:
            parents.setdefault(info[0], []).append(int(name))
    children, todo = [], [parent_pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            children.append(child)
            todo.append(child)
    return children


async def _assert_children_cleaned_up(
    child_pids: list[int],
    timeout: float = _CHILD_CLEANUP_TIMEOUT,  # noqa: ASYNC109 (structllm: as upstream)
):
    """Wait for child processes to exit and fail if any remain."""
    if not child_pids:
        return

    deadline = time.time() + timeout
    while time.time() < deadline:
        still_alive = []
        for pid in child_pids:
            # structllm: psutil's is_running() / STATUS_ZOMBIE -> /proc state
            info = _ppid_and_state(pid)
            if info is not None and info[1] != "Z":
                still_alive.append(pid)
        if not still_alive:
            return
        await asyncio.sleep(0.5)

    pytest.fail(
        f"Child processes {still_alive} still alive after {timeout}s. "
        f"Process cleanup may not be working correctly."
    )


@dataclass
class ShutdownState:
    got_503: bool = False
    got_500: bool = False
    requests_after_sigterm: int = 0
    aborted_requests: int = 0
    connection_errors: int = 0
    inflight_requests: int = 0
    stop_requesting: bool = False
    errors: list[str] = field(default_factory=list)


async def _concurrent_request_loop(
    client: openai.AsyncOpenAI,
    state: ShutdownState,
    sigterm_sent: asyncio.Event | None = None,
    concurrency: int = 10,
):
    """Run multiple concurrent requests to keep the server busy."""

    async def single_request():
        while not state.stop_requesting:
            try:
                state.inflight_requests += 1
                response = await client.completions.create(
                    model=MODEL_NAME,
                    prompt="Write a story: ",
                    max_tokens=200,
                )
                if sigterm_sent is not None and sigterm_sent.is_set():
                    state.requests_after_sigterm += 1
                # Check if any choice has finish_reason='abort'
                if any(choice.finish_reason == "abort" for choice in response.choices):
                    state.aborted_requests += 1
            except openai.APIStatusError as e:
                if e.status_code == 503:
                    state.got_503 = True
                elif e.status_code == 500:
                    state.got_500 = True
                else:
                    state.errors.append(f"API error: {e}")
            except (openai.APIConnectionError, httpx.RemoteProtocolError):
                state.connection_errors += 1
                if sigterm_sent is not None and sigterm_sent.is_set():
                    break
            except Exception as e:
                state.errors.append(f"Unexpected error: {e}")
                break
            finally:
                state.inflight_requests -= 1
            await asyncio.sleep(0.01)

    tasks = [asyncio.create_task(single_request()) for _ in range(concurrency)]
    try:
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()


async def test_shutdown_on_engine_failure():
    """Verify that API returns connection error when server process is killed.

    Starts a vLLM server, kills it to simulate a crash, then verifies that
    subsequent API calls fail appropriately.
    """
    # structllm: upstream runs vllm.entrypoints.openai.api_server on a free
    # port with SIGINT ignored and polls a completion until it answers;
    # StructllmServer starts structllm serve and waits for /health, and the
    # first completion below plays upstream's readiness poll.
    with StructllmServer(MODEL_NAME, _server_args(5)) as remote_server:
        proc = remote_server.proc
        async with remote_server.get_async_client(timeout=10) as client:
            await client.completions.create(
                model=MODEL_NAME, prompt="Hello", max_tokens=1
            )

            # Kill server to simulate crash
            proc.terminate()
            # structllm: upstream sleeps 1 s; waiting for the exit is what
            # that sleep stands for
            proc.wait(timeout=_PROCESS_EXIT_TIMEOUT)

            # Verify API calls now fail
            with pytest.raises((openai.APIConnectionError, openai.APIStatusError)):
                await client.completions.create(
                    model=MODEL_NAME, prompt="This should fail", max_tokens=1
                )

        return_code = proc.wait(timeout=_PROCESS_EXIT_TIMEOUT)
        assert return_code is not None


async def test_wait_timeout_completes_requests():
    """Verify wait timeout: new requests rejected, in-flight requests complete."""
    with StructllmServer(MODEL_NAME, _server_args(30)) as remote_server:
        proc = remote_server.proc
        child_pids = _get_child_pids(proc.pid)

        state = ShutdownState()
        sigterm_sent = asyncio.Event()

        # structllm: the client is closed (async with); see NOTES.md
        async with remote_server.get_async_client() as client:
            request_task = asyncio.create_task(
                _concurrent_request_loop(client, state, sigterm_sent, concurrency=10)
            )

            await asyncio.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            sigterm_sent.set()

            try:
                await asyncio.wait_for(
                    request_task, timeout=_SHUTDOWN_DETECTION_TIMEOUT
                )
            except TimeoutError:  # structllm: asyncio.TimeoutError (ruff UP041)
                pass
            finally:
                state.stop_requesting = True
                if not request_task.done():
                    request_task.cancel()
                await asyncio.gather(request_task, return_exceptions=True)

        # wait timeout should complete in-flight requests
        assert state.requests_after_sigterm > 0, (
            f"Wait timeout should complete in-flight requests. "
            f"503: {state.got_503}, 500: {state.got_500}, "
            f"conn_errors: {state.connection_errors}, errors: {state.errors}"
        )
        # server must stop accepting new requests (503, 500, or connection close)
        assert state.got_503 or state.got_500 or state.connection_errors > 0, (
            f"Server should stop accepting requests. "
            f"completed: {state.requests_after_sigterm}, errors: {state.errors}"
        )

        await _assert_children_cleaned_up(child_pids)


@pytest.mark.parametrize("wait_for_engine_idle", [0.0, 2.0])
async def test_abort_timeout_exits_quickly(wait_for_engine_idle: float):
    with StructllmServer(MODEL_NAME, _server_args(0)) as remote_server:
        proc = remote_server.proc
        child_pids = _get_child_pids(proc.pid)

        if wait_for_engine_idle > 0:
            # structllm: the client is closed (async with)
            async with remote_server.get_async_client() as client:
                # Send requests to ensure engine is fully initialized
                for _ in range(2):
                    await client.completions.create(
                        model=MODEL_NAME,
                        prompt="Test request: ",
                        max_tokens=10,
                    )
            # Wait for engine to become idle
            await asyncio.sleep(wait_for_engine_idle)

        start_time = time.time()
        proc.send_signal(signal.SIGTERM)

        # abort timeout (0) should stop the server promptly.
        try:
            proc.wait(timeout=4.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
            pytest.fail("Process did not exit after SIGTERM with abort timeout")

        exit_time = time.time() - start_time
        assert exit_time < 4.1, f"Default shutdown took too long: {exit_time:.1f}s"
        assert proc.returncode in (0, -15, None), f"Unexpected: {proc.returncode}"

        await _assert_children_cleaned_up(child_pids)


async def test_wait_timeout_with_short_duration():
    """Verify server exits cleanly with a short wait timeout."""
    wait_timeout = 3
    with StructllmServer(MODEL_NAME, _server_args(wait_timeout)) as remote_server:
        proc = remote_server.proc
        child_pids = _get_child_pids(proc.pid)

        state = ShutdownState()
        # structllm: the client is closed (async with)
        async with remote_server.get_async_client() as client:
            request_task = asyncio.create_task(
                _concurrent_request_loop(client, state, concurrency=3)
            )

            await asyncio.sleep(0.5)

            start_time = time.time()
            proc.send_signal(signal.SIGTERM)

            # server should exit within wait_timeout + buffer
            max_wait = wait_timeout + 15
            for _ in range(int(max_wait * 10)):
                if proc.poll() is not None:
                    break
                # structllm: upstream's time.sleep blocks the event loop, so
                # the requests it means to keep running could not run
                await asyncio.sleep(0.1)

            exit_time = time.time() - start_time

            state.stop_requesting = True
            if not request_task.done():
                request_task.cancel()
            await asyncio.gather(request_task, return_exceptions=True)

        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
            pytest.fail(f"Process did not exit within {max_wait}s after SIGTERM")

        assert exit_time < wait_timeout + 10, (
            f"Took too long to exit ({exit_time:.1f}s), expected <{wait_timeout + 10}s"
        )
        assert proc.returncode in (0, -15, None), f"Unexpected: {proc.returncode}"

        await _assert_children_cleaned_up(child_pids)


async def test_abort_timeout_fails_inflight_requests():
    """Verify abort timeout (0) immediately aborts in-flight requests."""
    with StructllmServer(MODEL_NAME, _server_args(0)) as remote_server:
        proc = remote_server.proc
        child_pids = _get_child_pids(proc.pid)

        state = ShutdownState()
        sigterm_sent = asyncio.Event()

        # structllm: the client is closed (async with)
        async with remote_server.get_async_client(
            timeout=_ABORT_CLIENT_TIMEOUT
        ) as client:
            request_task = asyncio.create_task(
                _concurrent_request_loop(client, state, sigterm_sent, concurrency=10)
            )

            deadline = time.time() + _INFLIGHT_REQUEST_START_TIMEOUT
            # structllm: noqa, upstream's polling loop kept
            while state.inflight_requests == 0 and time.time() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(_INFLIGHT_REQUEST_POLL_INTERVAL)
            assert state.inflight_requests > 0

            proc.send_signal(signal.SIGTERM)
            sigterm_sent.set()

            try:
                await asyncio.wait_for(request_task, timeout=5)
            except TimeoutError:  # structllm: asyncio.TimeoutError (ruff UP041)
                pass
            finally:
                state.stop_requesting = True
                if not request_task.done():
                    request_task.cancel()
                await asyncio.gather(request_task, return_exceptions=True)

        # With abort timeout (0), requests should be aborted (finish_reason='abort')
        # or rejected (connection errors or API errors)
        assert (
            state.aborted_requests > 0
            or state.connection_errors > 0
            or state.got_500
            or state.got_503
        ), (
            f"Abort timeout should cause request aborts or failures. "
            f"aborted: {state.aborted_requests}, "
            f"503: {state.got_503}, 500: {state.got_500}, "
            f"conn_errors: {state.connection_errors}, "
            f"completed: {state.requests_after_sigterm}"
        )

        # Verify fast shutdown
        start_time = time.time()
        for _ in range(100):
            if proc.poll() is not None:
                break
            await asyncio.sleep(0.1)  # structllm: time.sleep (ruff ASYNC251)

        exit_time = time.time() - start_time
        assert exit_time < 10, f"Abort timeout shutdown took too long: {exit_time:.1f}s"

        await _assert_children_cleaned_up(child_pids)


async def test_request_rejection_during_shutdown():
    """Verify new requests are rejected with error during shutdown."""
    with StructllmServer(MODEL_NAME, _server_args(30)) as remote_server:
        proc = remote_server.proc
        child_pids = _get_child_pids(proc.pid)

        proc.send_signal(signal.SIGTERM)

        await asyncio.sleep(1.0)

        # Try to send new requests - they should be rejected
        rejected_count = 0
        # structllm: the client is closed (async with)
        async with remote_server.get_async_client() as client:
            for _ in range(10):
                try:
                    await client.completions.create(
                        model=MODEL_NAME, prompt="Hello", max_tokens=10
                    )
                except (
                    openai.APIStatusError,
                    openai.APIConnectionError,
                    httpx.RemoteProtocolError,
                ):
                    rejected_count += 1
                await asyncio.sleep(0.1)

        assert rejected_count > 0, (
            f"Expected requests to be rejected during shutdown, "
            f"but {rejected_count} were rejected out of 10"
        )

        await _assert_children_cleaned_up(child_pids)
