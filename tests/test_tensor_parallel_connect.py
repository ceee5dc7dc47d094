"""Tensor parallelism across machines, as two local processes.

Rank 0 listens (``tensor_parallel_listen``) and a follower started on its
own with ``python -m structllm.engine.rank_group --connect HOST:PORT``
joins it: TP=2 so formed gives the greedy tokens of TP=1, and survives
idle stretches longer than the heartbeat timeout (rank 0 pings); the
follower exits when the engine closes. ``paddle.distributed.launch``
starts followers as the docs show it (TP=4). A follower killed mid-stream fails
the stream with EngineDeadError naming it, and the restarted rank 0 takes
a new follower; a follower that never comes fails ``open`` loudly; a
follower whose rank 0 falls silent ends itself; no process is left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from structllm import ModelLoadError, SamplingParams
from structllm.cli import build_parser
from structllm.config import EngineConfig, FrontendConfig, from_arguments
from structllm.engine.child import SLOW_STEP_S
from structllm.engine.frontend.async_llm import AsyncLLM
from structllm.engine.rank_group.env import connect_env, free_ports
from structllm.engine.rank_group.protocol import Hello, RankSetup, frame, receive
from structllm.errors import EngineConfigError, EngineCoreError
from structllm.llm import LLM
from structllm.model._paddle import paddle
from structllm.model.checkpoint import write_random_checkpoint
from structllm.testing.faults import inject_fault
from tests.processes import consume_until_dead, wait_gone
from tests.test_tensor_parallel_engine import CONFIGS, ENGINE, FRONT, PROMPTS

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(
        not hasattr(paddle.base.core, "ProcessGroupGloo"),
        reason="this Paddle build has no gloo (CPU) backend",
    ),
]

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
#: rank 0 pings every 0.2 s; a follower silent-timed-out after 2 s
BEAT = {"heartbeat_interval": 0.2, "heartbeat_timeout": 2.0}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"  # each open costs two interpreters; one backend is enough


@pytest.fixture
def address() -> str:
    return f"127.0.0.1:{free_ports(1)[0]}"


@contextlib.contextmanager
def _follower(
    address: str, tmp_path: Path, *args: str
) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """``python -m structllm.engine.rank_group --connect address``, started on
    its own (as on another machine); the file its stderr goes to. Killed on
    the way out only if a test failed before it ended."""
    path = tmp_path / f"follower-{time.monotonic_ns()}.err"
    with path.open("wb") as err:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "structllm.engine.rank_group",
                "--connect",
                address,
                *args,
            ],
            stdin=subprocess.DEVNULL,
            stderr=err,
        )
        try:
            yield process, path
        finally:
            if process.poll() is None:
                process.kill()
            process.wait()


@contextlib.contextmanager
def _launch(
    address: str, log_dir: Path, *, nproc: int
) -> Iterator[subprocess.Popen[bytes]]:
    """``paddle.distributed.launch`` starting ``nproc`` followers on this
    "node", as docs/parallel.md shows it; killed on the way out only if a
    test failed before it ended."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "paddle.distributed.launch",
            "--nnodes",
            "1",
            "--nproc_per_node",
            str(nproc),
            "--log_dir",
            str(log_dir),
            sys.executable,  # launch runs a script or a program, not -m
            "-m",
            "structllm.engine.rank_group",
            "--connect",
            address,
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def _stderr(path: Path) -> str:
    return path.read_text(errors="replace")


async def test_a_connected_follower_gives_the_greedy_tokens_of_one(
    tmp_path: Path, address: str
) -> None:
    model = tmp_path / "model"
    write_random_checkpoint(model, CONFIGS["llama"], seed=3)
    one = LLM(str(model), tokenizer="tiny-random", show_progress=False, **ENGINE)
    outputs = one.generate(PROMPTS, GREEDY, use_tqdm=False)
    expected = [o.outputs[0].token_ids for o in outputs]
    assert len({t for ids in expected for t in ids}) > 3  # not a degenerate model
    got: dict[int, tuple[int, ...]] = {}
    # the follower starts first and waits for rank 0 to listen
    with _follower(address, tmp_path) as (follower, err):
        async with AsyncLLM.open(
            str(model),
            tensor_parallel_size=2,
            tensor_parallel_listen=address,
            **ENGINE,
            **FRONT,
            **BEAT,
        ) as llm:
            rank0 = llm.statistics().core_pid
            assert rank0 is not None

            async def run(i: int) -> None:
                got[i] = (await llm.complete(PROMPTS[i], GREEDY)).token_ids

            async with anyio.create_task_group() as tg:
                for i in range(len(PROMPTS)):
                    tg.start_soon(run, i)
            assert [got[i] for i in range(len(PROMPTS))] == expected
            # idle for longer than the follower's silence timeout (and its
            # SIGALRM backstop): rank 0's pings keep it
            await anyio.sleep(2 * BEAT["heartbeat_timeout"])
            assert follower.poll() is None
            again = await llm.complete(PROMPTS[1], GREEDY)
            assert again.token_ids == expected[1]
            assert llm.statistics().restarts == 0
        # rank 0 closed the connection: the follower exits, and says nothing
        assert follower.wait(10) == 0, _stderr(err)
    wait_gone(rank0)


async def test_a_step_longer_than_the_heartbeat_timeout_keeps_the_follower(
    tmp_path: Path, address: str
) -> None:
    """Rank 1's step 6 holds the GIL for 3 s (as a kernel compiling on a
    machine with a cold cache does), three times the heartbeat timeout: no
    thread of the follower reads rank 0's pings meanwhile, but a follower
    mid-step waits ``step_timeout + heartbeat_timeout`` for rank 0, as rank
    0's front end waits for rank 0; the request completes, nothing restarts."""
    beat = {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.0}
    with (
        inject_fault("rank1:stall_at_step:6"),
        _follower(address, tmp_path) as (follower, err),
    ):
        async with AsyncLLM.open(
            "tiny-random",
            tensor_parallel_size=2,
            tensor_parallel_listen=address,
            **ENGINE,
            **FRONT,
            **beat,
        ) as llm:
            start = time.monotonic()
            out = await llm.complete("Hello", GREEDY)
            assert time.monotonic() - start >= SLOW_STEP_S  # the stall was here
            assert len(out.token_ids) == GREEDY.max_tokens
            assert follower.poll() is None, _stderr(err)
            assert llm.statistics().restarts == 0
        assert follower.wait(10) == 0, _stderr(err)


async def test_paddle_launch_starts_the_followers(tmp_path: Path, address: str) -> None:
    """The documented command: ``paddle.distributed.launch`` on a follower
    "node" (here, this machine) starts three followers for TP=4; whatever
    ranks launch numbers them (0..2: it does not know of rank 0), rank 0
    gives them 1..3; the tokens are TP=1's, and launch exits 0 with them."""
    model = tmp_path / "model"
    write_random_checkpoint(model, CONFIGS["llama"], seed=3)
    one = LLM(str(model), tokenizer="tiny-random", show_progress=False, **ENGINE)
    [expected] = one.generate(PROMPTS[1], GREEDY, use_tqdm=False)
    with _launch(address, tmp_path / "launch", nproc=3) as launch:
        async with AsyncLLM.open(
            str(model),
            tensor_parallel_size=4,
            tensor_parallel_listen=address,
            **ENGINE,
            **FRONT,
        ) as llm:
            rank0 = llm.statistics().core_pid
            out = await llm.complete(PROMPTS[1], GREEDY)
        assert out.token_ids == expected.outputs[0].token_ids
        assert launch.wait(30) == 0
    launched = (tmp_path / "launch").glob("envlog.*")
    ids = sorted(
        line
        for log in launched
        for line in log.read_text().splitlines()
        if line.startswith("PADDLE_TRAINER_ID=")
    )
    assert ids == [f"PADDLE_TRAINER_ID={i}" for i in range(3)]
    assert rank0 is not None
    wait_gone(rank0)


async def test_a_killed_connected_follower_fails_the_stream_loudly(
    tmp_path: Path, address: str
) -> None:
    """SIGKILL of the follower mid-stream: EngineDeadError naming it; the
    supervisor restarts rank 0, which listens again, and a new follower
    makes the group whole."""
    with contextlib.ExitStack() as followers:
        first, _ = followers.enter_context(_follower(address, tmp_path))
        async with AsyncLLM.open(
            "tiny-random",
            tensor_parallel_size=2,
            tensor_parallel_listen=address,
            max_restarts=1,
            restart_backoff=0.05,
            **ENGINE,
            **FRONT,
            **BEAT,
        ) as llm:
            rank0 = llm.statistics().core_pid
            assert rank0 is not None

            async def killer() -> None:
                await llm.wait_statistics(lambda s: s.running > 0)
                os.kill(first.pid, signal.SIGKILL)

            async with anyio.create_task_group() as tg:
                tg.start_soon(killer)
                err, _ = await consume_until_dead(llm)
            cause = err.__cause__
            assert isinstance(cause, EngineCoreError), cause
            assert f"tensor-parallel rank 1 (pid {first.pid} on " in str(cause)
            assert "closed its connection" in str(cause)
            wait_gone(rank0)  # rank 0 exits with its group
            assert first.wait(10) == -signal.SIGKILL
            # the restarted rank 0 waits for a follower; a new one joins
            second, err2 = followers.enter_context(_follower(address, tmp_path))
            with anyio.fail_after(60):
                stats = await llm.wait_statistics(lambda s: s.ready)
            new0 = stats.core_pid
            assert new0 not in (None, rank0) and stats.restarts == 1
            out = await llm.complete("Hello", GREEDY)
            assert len(out.token_ids) == GREEDY.max_tokens
        # the engine closed: rank 0 is gone, and the follower followed it
        assert second.wait(10) == 0, _stderr(err2)
    assert new0 is not None
    wait_gone(rank0, new0)


async def test_rank_0_fails_open_when_a_follower_never_connects(
    address: str,
) -> None:
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match="did not connect") as info:
        async with AsyncLLM.open(
            "tiny-random",
            tensor_parallel_size=2,
            tensor_parallel_listen=address,
            tensor_parallel_connect_timeout=0.5,
            **ENGINE,
            **FRONT,
        ):
            pytest.fail("open() should have failed")  # pragma: no cover
    message = str(info.value)
    assert f"rank(s) 1 of 2 did not connect to {address} within 0.5s" in message
    assert f"--connect {address}" in message
    assert time.monotonic() - start < 30


async def test_rank_0_cannot_listen_on_a_busy_address_naming_the_field() -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        address = f"127.0.0.1:{busy.getsockname()[1]}"
        with pytest.raises(EngineConfigError, match="cannot listen on") as info:
            async with AsyncLLM.open(
                "tiny-random",
                tensor_parallel_size=2,
                tensor_parallel_listen=address,
                **ENGINE,
                **FRONT,
            ):
                pytest.fail("open() should have failed")  # pragma: no cover
    assert info.value.field == "tensor_parallel_listen"


def test_a_follower_ends_itself_when_rank_0_falls_silent(tmp_path: Path) -> None:
    """A rank 0 (this test) that sets the follower up, then says nothing and
    keeps the connection open, as a machine that froze or dropped off the
    network would: the follower, blocked in ``init_parallel_env`` on a store
    that never answers (Paddle holds the GIL there), ends within its silence
    timeout and the SIGALRM grace."""
    with (
        socket.create_server(("127.0.0.1", 0)) as listener,
        socket.create_server(("127.0.0.1", 0)) as store,  # accepts, says nothing
    ):
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        store_at = ("127.0.0.1", store.getsockname()[1])
        with _follower(address, tmp_path) as (follower, err):
            listener.settimeout(60)
            conn, _ = listener.accept()
            with conn:
                assert isinstance(receive(conn), Hello)
                env = connect_env(
                    1, [f"127.0.0.1:{store_at[1]}", "x:0"], "gloo", store_at
                )
                config = EngineConfig(model="tiny-random", tensor_parallel_size=2)
                setup = RankSetup(config, env=env, silence_timeout=1.0)
                conn.sendall(frame(setup))
                set_up = time.monotonic()
                code = follower.wait(30)
                took = time.monotonic() - set_up
    assert code in (1, -signal.SIGALRM), _stderr(err)
    assert 1.0 <= took < 1.0 + 10.0
    if code == 1:
        assert "no word from rank 0 for 1s" in _stderr(err)


def test_a_follower_gives_up_on_a_rank_0_that_never_listens(
    tmp_path: Path, address: str
) -> None:
    with _follower(address, tmp_path, "--connect-timeout", "0.3") as (follower, err):
        assert follower.wait(60) == 2
    assert f"rank 0 at {address} did not answer within 0.3s" in _stderr(err)


def test_the_follower_command_line_refuses_bad_arguments() -> None:
    for args, message in [
        (["--connect", "nohost"], "--connect must be HOST:PORT"),
        ([], "give --connect HOST:PORT"),
        (["--connect", "h:1", "--fd", "3"], "--connect takes no --fd"),
    ]:
        done = subprocess.run(
            [sys.executable, "-m", "structllm.engine.rank_group", *args],
            capture_output=True,
            timeout=60,
        )
        assert done.returncode == 2 and message in done.stderr.decode(), args


# ------------------------------------------------------------------- config


def test_listen_needs_more_than_one_rank() -> None:
    with pytest.raises(EngineConfigError, match="tensor_parallel_size > 1") as info:
        EngineConfig(model="tiny-random", tensor_parallel_listen="127.0.0.1:5000")
    assert info.value.field == "tensor_parallel_listen"


@pytest.mark.parametrize("value", ["5000", ":5000", "h:0", "h:65536", "h:x"])
def test_listen_is_host_and_port(value: str) -> None:
    with pytest.raises(EngineConfigError, match="HOST:PORT") as info:
        EngineConfig(
            model="tiny-random", tensor_parallel_size=2, tensor_parallel_listen=value
        )
    assert info.value.field == "tensor_parallel_listen"


def test_listen_serves_one_replica() -> None:
    from structllm.engine.frontend.replicas import ReplicaSet

    engine = EngineConfig(
        model="tiny-random", tensor_parallel_size=2, tensor_parallel_listen="h:1"
    )
    front: Any = None
    with pytest.raises(EngineConfigError, match="data_parallel_size=2") as info:
        ReplicaSet(engine, FrontendConfig(data_parallel_size=2), front)
    assert info.value.field == "tensor_parallel_listen"


def test_serve_takes_the_flags() -> None:
    ns = build_parser().parse_args(
        [
            "serve",
            "tiny-random",
            "--tensor-parallel-size",
            "2",
            "--tensor-parallel-listen",
            "0.0.0.0:29500",
            "--tensor-parallel-connect-timeout",
            "30",
        ]
    )
    engine = from_arguments(EngineConfig, ns, model="tiny-random")
    assert engine.tensor_parallel_listen == "0.0.0.0:29500"
    assert engine.tensor_parallel_connect_timeout == 30.0
