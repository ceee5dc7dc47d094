"""Rank 0's group: the follower ranks of a tensor-parallel core.

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
With LoRA, rank 0's adapter manager decides which adapter each slot holds;
after each Step, :meth:`RankGroup.send_lora` tells the followers the slot
changes since the last one (each reads its share of the adapter from the
same directory, which must be readable on every rank's machine) and the
step's rows (``core.lora_manager.FollowedSlots``).

**Across machines** (``EngineConfig.tensor_parallel_listen``): rank 0 listens
on that address instead, and the followers are started elsewhere, by hand
or by ``paddle.distributed.launch``, as ``python -m
structllm.engine.rank_group --connect HOST:PORT``. Each connects (retrying
until rank 0 listens), says :class:`Hello`, and gets its rank, in order of
arrival, and the group's ``paddle.distributed`` variables in its
:class:`RankSetup` (rank 0 is the store; whatever ``launch`` set is
overridden: its numbering does not know of a rank 0 it did not start). The
same rules hold, with the connection as the only tie:

- rank 0 fails loudly when a follower's connection closes (its watch
  thread, as above) or when not every follower has connected within
  ``tensor_parallel_connect_timeout`` (the group does not start);
- no pidfd crosses machines: rank 0 :class:`Ping` s each follower every
  heartbeat interval when it has sent nothing else (during steps too), and
  a follower exits at once when its connection closes, or when it has
  heard nothing for the heartbeat timeout, or mid-step for
  ``step_timeout`` plus the heartbeat timeout since its step began (as
  rank 0's front end waits for rank 0's steps: a slow step, or one that
  holds the GIL, is not a dead rank 0).

This module is rank 0's side, :class:`RankGroup`. A follower's side is
:mod:`structllm.engine.rank_group.follower`, whose :func:`main` runs as the
package (``python -m structllm.engine.rank_group``: the command names the
group, as it always has); the messages and their framing are
:mod:`structllm.engine.rank_group.protocol`, each rank's ``paddle.distributed``
variables :mod:`structllm.engine.rank_group.env`.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

import attrs
import msgspec
import numpy as np

from structllm.config import EngineConfig, parse_address
from structllm.core.lora_manager import SlotChange
from structllm.core.runner import ModelInput
from structllm.engine.rank_group.env import (
    apply_env,
    connect_env,
    endpoint,
    family,
    free_ports,
    pick_backend,
    spawn_env,
)
from structllm.engine.rank_group.protocol import (
    HELLO_TIMEOUT,
    AllocateKV,
    Hello,
    Ping,
    RankFailed,
    RankSetup,
    Step,
    StepLoRA,
    frame,
    receive,
)
from structllm.errors import EngineConfigError

__all__ = ["EXIT_TIMEOUT", "RankGroup"]

#: seconds a follower gets to exit after its socket closes, before SIGKILL
EXIT_TIMEOUT = 5.0


@attrs.define(eq=False)
class _Follower:
    rank: int
    #: None for a follower that connected (it runs elsewhere)
    process: subprocess.Popen[bytes] | None
    sock: socket.socket
    #: how messages name it: "pid 123", or "pid 123 on host h (10.0.0.2:4711)"
    who: str = ""


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
    #: one frame at a time on the sockets: the ping thread sends too
    _send_lock: threading.Lock = attrs.Factory(threading.Lock)
    _last_sent: float = 0.0
    _pinger: threading.Thread | None = None
    _stop_pinging: threading.Event = attrs.Factory(threading.Event)

    @classmethod
    def start(
        cls,
        config: EngineConfig,
        *,
        on_lost: Callable[[str], None],
        fault: str | None = None,
        heartbeat: tuple[float, float] = (1.0, 10.0),
        step_timeout: float = 300.0,
    ) -> RankGroup:
        """Start the followers (or, with ``config.tensor_parallel_listen``,
        wait for them to connect), then join the process group as rank 0.

        Returns once the group is up; the followers are then loading their
        shards (rank 0 loads its own meanwhile). ``fault`` is a test hook
        for rank 1. ``heartbeat``: (interval, timeout) of rank 0's pings to
        connected followers; ``step_timeout``: how long past the timeout a
        connected follower waits mid-step (the front end's, for rank 0).
        """
        wake_r, wake_w = os.pipe()
        group = cls(config.tensor_parallel_size, [], on_lost, wake_r, wake_w)
        try:
            if config.tensor_parallel_listen is None:
                env = group._spawn(config, fault)
            else:
                env = group._accept(config, fault, heartbeat, step_timeout)
            group._watch = threading.Thread(
                target=group._watch_followers, name="rank-watch", daemon=True
            )
            group._watch.start()
            apply_env(env)
            import paddle.distributed

            paddle.distributed.init_parallel_env()
        except BaseException:
            group.close()
            raise
        return group

    def _spawn(self, config: EngineConfig, fault: str | None) -> dict[str, str]:
        """Start ranks 1..size-1 here; rank 0's variables."""
        size = self.size
        endpoints = [f"127.0.0.1:{port}" for port in free_ports(size)]
        backend = pick_backend(size)
        for rank in range(1, size):
            ours, theirs = socket.socketpair()
            try:
                process = subprocess.Popen(
                    _command(theirs.fileno()),
                    pass_fds=[theirs.fileno()],
                    stdin=subprocess.DEVNULL,
                    env={**os.environ, **spawn_env(rank, endpoints, backend)},
                )
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()
            self._followers.append(_Follower(rank, process, ours, f"pid {process.pid}"))
            ours.sendall(frame(RankSetup(config, fault if rank == 1 else None)))
        return spawn_env(0, endpoints, backend)

    def _accept(
        self,
        config: EngineConfig,
        fault: str | None,
        heartbeat: tuple[float, float],
        step_timeout: float,
    ) -> dict[str, str]:
        """Wait for ranks 1..size-1 to connect; rank 0's variables."""
        field = "tensor_parallel_listen"
        address = config.tensor_parallel_listen
        assert address is not None
        host, port = parse_address(address, field)
        try:
            listener = socket.create_server(
                (host, port), family=family(host), backlog=self.size
            )
        except OSError as exc:
            raise EngineConfigError(
                f"{field}: cannot listen on {address}: {exc}", field=field
            ) from exc
        with listener:
            self._accept_followers(listener, config)
        # the store (rank 0) is where the first follower found rank 0
        master = self._followers[0].sock.getsockname()[0]
        store = (master, free_ports(1, master)[0])
        endpoints = [endpoint(*store)]
        endpoints += [endpoint(f.sock.getpeername()[0], 0) for f in self._followers]
        backend = pick_backend(1)
        interval, timeout = heartbeat
        for f in self._followers:
            env = connect_env(f.rank, endpoints, backend, store)
            setup = RankSetup(
                config,
                fault if f.rank == 1 else None,
                env,
                silence_timeout=timeout,
                step_timeout=step_timeout,
            )
            f.sock.sendall(frame(setup))
        self._pinger = threading.Thread(
            target=self._ping, args=(interval,), name="rank-ping", daemon=True
        )
        self._pinger.start()
        return connect_env(0, endpoints, backend, store)

    def _accept_followers(self, listener: socket.socket, config: EngineConfig) -> None:
        timeout = config.tensor_parallel_connect_timeout
        deadline = time.monotonic() + timeout
        while len(self._followers) < self.size - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = ", ".join(
                    str(r) for r in range(len(self._followers) + 1, self.size)
                )
                raise TimeoutError(
                    f"tensor-parallel rank(s) {missing} of {self.size} did not "
                    f"connect to {config.tensor_parallel_listen} within "
                    f"{timeout:g}s (tensor_parallel_connect_timeout): start each "
                    "with python -m structllm.engine.rank_group --connect "
                    f"{config.tensor_parallel_listen}"
                )
            listener.settimeout(left)
            try:
                conn, peer = listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(min(left, HELLO_TIMEOUT))
            try:
                hello = receive(conn)
            except (OSError, msgspec.DecodeError):
                hello = None
            if not isinstance(hello, Hello):
                conn.close()  # not a follower (or one that gave up): wait on
                continue
            conn.settimeout(None)
            rank = len(self._followers) + 1
            who = f"pid {hello.pid} on {hello.host} ({peer[0]}:{peer[1]})"
            self._followers.append(_Follower(rank, None, conn, who))

    def _ping(self, interval: float) -> None:
        """Ping every follower when nothing was sent for ``interval`` seconds."""
        ping = frame(Ping())
        while not self._stop_pinging.wait(interval):
            if time.monotonic() - self._last_sent < interval:
                continue
            with contextlib.suppress(RuntimeError):  # the watch thread reports it
                self._send_all(ping)

    def allocate(self, num_blocks: int) -> None:
        self._send_all(frame(AllocateKV(num_blocks)))

    def broadcast(self, step: ModelInput) -> None:
        self._send_all(frame(Step(step)))

    def send_lora(self, changes: Sequence[SlotChange], rows: np.ndarray | None) -> None:
        """The LoRA part of the step just broadcast (see :class:`StepLoRA`)."""
        msg = StepLoRA(
            tuple((c.slot, c.path) for c in changes),
            None if rows is None else np.ascontiguousarray(rows, np.int64).tobytes(),
        )
        self._send_all(frame(msg))

    def _send_all(self, data: bytes) -> None:
        with self._send_lock:
            for f in self._followers:
                try:
                    f.sock.sendall(data)
                except OSError as exc:
                    raise RuntimeError(
                        f"tensor-parallel rank {f.rank} ({f.who}) is gone: {exc}"
                    ) from exc
            self._last_sent = time.monotonic()

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
        self._stop_pinging.set()
        for thread in (self._watch, self._pinger):
            if thread is not None and thread is not threading.current_thread():
                thread.join()
        for f in self._followers:
            f.sock.close()  # a connected follower exits at EOF; it is not ours
        deadline = time.monotonic() + EXIT_TIMEOUT
        for f in self._followers:
            if f.process is None:
                continue
            try:
                f.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                f.process.kill()
                f.process.wait()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def kill(self) -> None:
        """SIGKILL every spawned follower and reap it, and close every
        connected follower's socket (rank 0 is about to exit)."""
        for f in self._followers:
            if f.process is None:
                with contextlib.suppress(OSError):
                    f.sock.shutdown(socket.SHUT_RDWR)
                continue
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
            msg = receive(f.sock)
        except (OSError, msgspec.DecodeError):
            msg = None
        if isinstance(msg, RankFailed):
            reason = (
                f"tensor-parallel rank {msg.rank} raised {msg.kind}: {msg.message}\n"
                f"{msg.traceback}"
            )
        elif f.process is None:
            reason = f"tensor-parallel rank {f.rank} ({f.who}) closed its connection"
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
