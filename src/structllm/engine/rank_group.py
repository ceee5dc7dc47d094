"""The follower ranks of a tensor-parallel core, and their entry point.

With ``tensor_parallel_size = N > 1`` the core process is rank 0 of a
``paddle.distributed`` group: it schedules, samples and talks to the front
end, as with one rank. :meth:`RankGroup.start` starts ranks 1..N-1 as fresh
interpreters (``python -m structllm.engine.rank_group --fd K``, never a
fork: Paddle is initialised by then), each on a socketpair to rank 0, and
joins them in one process group (gloo on CPU, NCCL on GPUs). Each rank
loads only its shard (:func:`~structllm.model.parallel.load_model_shard`).
Every step, rank 0 sends the step's :class:`~structllm.core.runner.ModelInput`
down the sockets and runs its forward; the followers run the same forward,
and the two all-reduces a layer meet. Nothing comes back on success: every
rank computes the full logits, and only rank 0 samples.

So the group is one unit to the front end's supervisor, which sees only
rank 0:

- a follower dies with rank 0: each watches rank 0 through a pidfd (as the
  core process watches the front end) and reads EOF when rank 0 closes;
- rank 0 dies with any follower: a watch thread in rank 0 reads each
  follower's socket; a follower that raised sends :class:`RankFailed`
  first, one that died just closes it. Either way ``on_lost`` runs (the core
  process sends Fatal and exits), which the supervisor turns into
  EngineDeadError for live requests and a restart of the whole group. A
  collective whose peer died also raises in rank 0 (gloo: "Connection reset
  by peer"), which fails the step the same way;
- a follower that hangs leaves rank 0 blocked in a collective, silent: the
  supervisor's heartbeat timeout kills rank 0, and the follower follows it.

Aborts, new requests and the prefix cache touch rank 0's scheduler only.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable

import attrs
import msgspec

from structllm.config import EngineConfig
from structllm.core.runner import ModelInput

__all__ = [
    "AllocateKV",
    "RankFailed",
    "RankGroup",
    "RankSetup",
    "Step",
    "main",
]

_HEADER = struct.Struct(">I")
#: seconds a follower gets to exit after its socket closes, before SIGKILL
EXIT_TIMEOUT = 5.0


class RankSetup(msgspec.Struct, tag=True):
    """First message to a follower: what to load (its rank is in its env)."""

    config: EngineConfig
    #: test hook, as core_process's: "raise_at_step:N", "hang_at_step:N"
    fault: str | None = None


class AllocateKV(msgspec.Struct, tag=True):
    """Rank 0 has sized the KV cache: allocate the same number of blocks."""

    num_blocks: int


class Step(msgspec.Struct, tag=True):
    """Run this forward (rank 0 runs it too)."""

    input: ModelInput


class RankFailed(msgspec.Struct, tag=True):
    """A follower raised; it exits after sending this."""

    rank: int
    kind: str
    message: str
    traceback: str


_Message = RankSetup | AllocateKV | Step | RankFailed
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Message)


def _frame(msg: _Message) -> bytes:
    body = _encoder.encode(msg)
    return _HEADER.pack(len(body)) + body


def _receive(sock: socket.socket) -> _Message | None:
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


@attrs.define(eq=False)
class _Follower:
    rank: int
    process: subprocess.Popen[bytes]
    sock: socket.socket


@attrs.define(eq=False)
class RankGroup:
    """Rank 0's handle on ranks 1..size-1 (see the module docstring).

    ``on_lost(reason)`` runs in the watch thread when a follower raises or
    dies; it must not return normally into a working engine (the core
    process sends Fatal and exits).
    """

    size: int
    _followers: list[_Follower]
    _on_lost: Callable[[str], None]
    _wake_r: int
    _wake_w: int
    _closing: bool = False
    _watch: threading.Thread | None = None
    _lost: str | None = None
    _lost_event: threading.Event = attrs.Factory(threading.Event)

    @classmethod
    def start(
        cls,
        config: EngineConfig,
        *,
        on_lost: Callable[[str], None],
        fault: str | None = None,
    ) -> RankGroup:
        """Start the followers, then join the process group as rank 0.

        Returns once the group is up; the followers are then loading their
        shards (rank 0 loads its own meanwhile). ``fault`` is a test hook
        for rank 1.
        """
        size = config.tensor_parallel_size
        endpoints = [f"127.0.0.1:{port}" for port in _free_ports(size)]
        backend = _backend(size)
        followers: list[_Follower] = []
        wake_r, wake_w = os.pipe()
        group = cls(size, followers, on_lost, wake_r, wake_w)
        try:
            for rank in range(1, size):
                ours, theirs = socket.socketpair()
                try:
                    process = subprocess.Popen(
                        _command(theirs.fileno()),
                        pass_fds=[theirs.fileno()],
                        stdin=subprocess.DEVNULL,
                        env={**os.environ, **_rank_env(rank, endpoints, backend)},
                    )
                except BaseException:
                    ours.close()
                    raise
                finally:
                    theirs.close()
                followers.append(_Follower(rank, process, ours))
                ours.sendall(_frame(RankSetup(config, fault if rank == 1 else None)))
            group._watch = threading.Thread(
                target=group._watch_followers, name="rank-watch", daemon=True
            )
            group._watch.start()
            os.environ.update(_rank_env(0, endpoints, backend))
            import paddle.distributed

            paddle.distributed.init_parallel_env()
        except BaseException:
            group.close()
            raise
        return group

    def allocate(self, num_blocks: int) -> None:
        self._send_all(_frame(AllocateKV(num_blocks)))

    def broadcast(self, step: ModelInput) -> None:
        self._send_all(_frame(Step(step)))

    def _send_all(self, frame: bytes) -> None:
        for f in self._followers:
            try:
                f.sock.sendall(frame)
            except OSError as exc:
                raise RuntimeError(
                    f"tensor-parallel rank {f.rank} (pid {f.process.pid}) is gone: "
                    f"{exc}"
                ) from exc

    def wait_lost(self, timeout: float) -> str | None:
        """Why a follower was lost, once the watch has seen it (None: not
        within ``timeout`` seconds)."""
        self._lost_event.wait(timeout)
        return self._lost

    def close(self) -> None:
        """Stop the followers (EOF, then SIGKILL after a while) and reap them."""
        if self._closing:
            return
        self._closing = True
        os.write(self._wake_w, b"x")
        if self._watch is not None and self._watch is not threading.current_thread():
            self._watch.join()
        for f in self._followers:
            f.sock.close()
        deadline = time.monotonic() + EXIT_TIMEOUT
        for f in self._followers:
            try:
                f.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                f.process.kill()
                f.process.wait()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def kill(self) -> None:
        """SIGKILL every follower and reap it (rank 0 is about to exit)."""
        for f in self._followers:
            with contextlib.suppress(ProcessLookupError):
                f.process.kill()
            f.process.wait()

    def _watch_followers(self) -> None:
        by_fd = {f.sock.fileno(): f for f in self._followers}
        ready, _, _ = select.select([self._wake_r, *by_fd], [], [])
        if self._closing or self._wake_r in ready:
            return
        f = by_fd[ready[0]]
        try:
            msg = _receive(f.sock)
        except (OSError, msgspec.DecodeError):
            msg = None
        if isinstance(msg, RankFailed):
            reason = (
                f"tensor-parallel rank {msg.rank} raised {msg.kind}: {msg.message}\n"
                f"{msg.traceback}"
            )
        else:
            with contextlib.suppress(subprocess.TimeoutExpired):
                f.process.wait(1.0)
            code = f.process.returncode
            how = (
                "is unresponsive"
                if code is None
                else f"was killed by signal {-code}"
                if code < 0
                else f"exited with code {code}"
            )
            reason = f"tensor-parallel rank {f.rank} (pid {f.process.pid}) {how}"
        if not self._closing:
            self._lost = reason
            self._lost_event.set()
            self._on_lost(reason)


def _command(fd: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "structllm.engine.rank_group",
        "--fd",
        str(fd),
        "--parent-pid",
        str(os.getpid()),
    ]


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _backend(size: int) -> str:
    """NCCL when this Paddle has CUDA and a GPU for every rank, else gloo."""
    import paddle

    if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() >= size:
        return "nccl"
    return "gloo"


def _rank_env(rank: int, endpoints: list[str], backend: str) -> dict[str, str]:
    """``paddle.distributed.init_parallel_env``'s variables for ``rank``
    (those ``paddle.distributed.spawn`` sets; rank 0's endpoint is the store)."""
    env = {
        "PADDLE_TRAINER_ID": str(rank),
        "PADDLE_TRAINERS_NUM": str(len(endpoints)),
        "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints),
        "PADDLE_CURRENT_ENDPOINT": endpoints[rank],
        "PADDLE_DISTRI_BACKEND": backend,
    }
    if backend == "nccl":
        env["FLAGS_selected_gpus"] = str(rank)
    return env


# ------------------------------------------------------------- a follower


def _follow(sock: socket.socket) -> int:
    """Load the shard, then run each step's forward until EOF."""
    from structllm.core.engine_core import load_engine_model
    from structllm.core.runner import run_forward
    from structllm.engine.core_process import _inject
    from structllm.model._paddle import (
        paddle,
        set_num_threads,
    )

    setup = _receive(sock)
    if not isinstance(setup, RankSetup):
        return 0  # rank 0 went away before saying what to load
    config = setup.config
    set_num_threads(config.cpu_threads())
    paddle.distributed.init_parallel_env()
    rank = paddle.distributed.get_rank()
    model = load_engine_model(config, rank).model
    fault_kind, _, fault_step = (setup.fault or "").partition(":")
    kv_caches = None
    steps = 0
    while (msg := _receive(sock)) is not None:
        if isinstance(msg, AllocateKV):
            kv_caches = model.allocate_kv_cache(msg.num_blocks)
        elif isinstance(msg, Step):
            if kv_caches is None:
                raise RuntimeError("a step before the KV cache was allocated")
            if fault_kind and steps == int(fault_step):
                _inject(fault_kind, steps)
            run_forward(model, kv_caches, msg.input)
            steps += 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m structllm.engine.rank_group")
    parser.add_argument("--fd", type=int, required=True, help="socket to rank 0")
    parser.add_argument("--parent-pid", type=int, required=True)
    ns = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from structllm.engine.core_process import _exit_with_parent

    _exit_with_parent(ns.parent_pid)
    if os.getppid() != ns.parent_pid:
        return 0  # rank 0 died before the watch began
    sock = socket.socket(fileno=ns.fd)
    try:
        return _follow(sock)
    except Exception as exc:
        rank = int(os.environ.get("PADDLE_TRAINER_ID", "-1"))
        with contextlib.suppress(OSError):
            sock.sendall(
                _frame(
                    RankFailed(
                        rank, type(exc).__name__, str(exc), traceback.format_exc()
                    )
                )
            )
        return 1
    finally:
        sock.close()


if __name__ == "__main__":
    sys.exit(main())
