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
  heartbeat interval, and a follower exits at once when its connection
  closes or it has heard nothing for the heartbeat timeout, even mid-step.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
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
from typing import NoReturn

import attrs
import msgspec

from structllm.config import EngineConfig, parse_address
from structllm.core.runner import ModelInput
from structllm.errors import EngineConfigError

__all__ = [
    "CONNECT_TIMEOUT",
    "AllocateKV",
    "Hello",
    "Ping",
    "RankFailed",
    "RankGroup",
    "RankSetup",
    "Step",
    "main",
]

_HEADER = struct.Struct(">I")
#: seconds a follower gets to exit after its socket closes, before SIGKILL
EXIT_TIMEOUT = 5.0
#: default seconds a ``--connect`` follower keeps trying to reach rank 0
CONNECT_TIMEOUT = 600.0
#: seconds rank 0 gives a new connection to say Hello (a stray client is
#: dropped, and rank 0 waits on for real followers)
_HELLO_TIMEOUT = 10.0
#: seconds past a ``--connect`` follower's silence timeout that its SIGALRM
#: ends it, if its reader thread could not (Paddle held the GIL)
_ALARM_GRACE = 1.0


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


class Ping(msgspec.Struct, tag=True):
    """Rank 0 is alive (sent to ``--connect`` followers when otherwise idle)."""


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


_Message = Hello | RankSetup | Ping | AllocateKV | Step | RankFailed
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
    ) -> RankGroup:
        """Start the followers (or, with ``config.tensor_parallel_listen``,
        wait for them to connect), then join the process group as rank 0.

        Returns once the group is up; the followers are then loading their
        shards (rank 0 loads its own meanwhile). ``fault`` is a test hook
        for rank 1. ``heartbeat``: (interval, timeout) of rank 0's pings to
        connected followers.
        """
        wake_r, wake_w = os.pipe()
        group = cls(config.tensor_parallel_size, [], on_lost, wake_r, wake_w)
        try:
            if config.tensor_parallel_listen is None:
                env = group._spawn(config, fault)
            else:
                env = group._accept(config, fault, heartbeat)
            group._watch = threading.Thread(
                target=group._watch_followers, name="rank-watch", daemon=True
            )
            group._watch.start()
            _apply_env(env)
            import paddle.distributed

            paddle.distributed.init_parallel_env()
        except BaseException:
            group.close()
            raise
        return group

    def _spawn(self, config: EngineConfig, fault: str | None) -> dict[str, str]:
        """Start ranks 1..size-1 here; rank 0's variables."""
        size = self.size
        endpoints = [f"127.0.0.1:{port}" for port in _free_ports(size)]
        backend = _backend(size)
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
            self._followers.append(_Follower(rank, process, ours, f"pid {process.pid}"))
            ours.sendall(_frame(RankSetup(config, fault if rank == 1 else None)))
        return _rank_env(0, endpoints, backend)

    def _accept(
        self,
        config: EngineConfig,
        fault: str | None,
        heartbeat: tuple[float, float],
    ) -> dict[str, str]:
        """Wait for ranks 1..size-1 to connect; rank 0's variables."""
        field = "tensor_parallel_listen"
        address = config.tensor_parallel_listen
        assert address is not None
        host, port = parse_address(address, field)
        try:
            listener = socket.create_server(
                (host, port), family=_family(host), backlog=self.size
            )
        except OSError as exc:
            raise EngineConfigError(
                f"{field}: cannot listen on {address}: {exc}", field=field
            ) from exc
        with listener:
            self._accept_followers(listener, config)
        # the store (rank 0) is where the first follower found rank 0
        master = self._followers[0].sock.getsockname()[0]
        store = (master, _free_ports(1, master)[0])
        endpoints = [_endpoint(*store)]
        endpoints += [_endpoint(f.sock.getpeername()[0], 0) for f in self._followers]
        backend = _backend(1)
        interval, timeout = heartbeat
        for f in self._followers:
            env = _connect_env(f.rank, endpoints, backend, store)
            setup = RankSetup(
                config, fault if f.rank == 1 else None, env, silence_timeout=timeout
            )
            f.sock.sendall(_frame(setup))
        self._pinger = threading.Thread(
            target=self._ping, args=(interval,), name="rank-ping", daemon=True
        )
        self._pinger.start()
        return _connect_env(0, endpoints, backend, store)

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
            conn.settimeout(min(left, _HELLO_TIMEOUT))
            try:
                hello = _receive(conn)
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
        frame = _frame(Ping())
        while not self._stop_pinging.wait(interval):
            if time.monotonic() - self._last_sent < interval:
                continue
            with contextlib.suppress(RuntimeError):  # the watch thread reports it
                self._send_all(frame)

    def allocate(self, num_blocks: int) -> None:
        self._send_all(_frame(AllocateKV(num_blocks)))

    def broadcast(self, step: ModelInput) -> None:
        self._send_all(_frame(Step(step)))

    def _send_all(self, frame: bytes) -> None:
        with self._send_lock:
            for f in self._followers:
                try:
                    f.sock.sendall(frame)
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
            msg = _receive(f.sock)
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


def _free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    socks = [socket.socket(_family(host)) for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
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


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _connect_env(
    rank: int, endpoints: list[str], backend: str, store: tuple[str, int]
) -> dict[str, str]:
    """A connected group's variables for ``rank``: as :func:`_rank_env`, with
    the store named outright (``MASTER_ADDR`` / ``MASTER_PORT`` win over a
    ``PADDLE_MASTER`` that ``paddle.distributed.launch`` set). No GPU
    choice: each machine numbers its own (:func:`_apply_env`)."""
    env = _rank_env(rank, endpoints, backend)
    env.pop("FLAGS_selected_gpus", None)
    env["MASTER_ADDR"], env["MASTER_PORT"] = store[0], str(store[1])
    return env


def _apply_env(env: dict[str, str]) -> None:
    """Run this process as the rank ``env`` describes.

    A connected rank drops ``launch``'s own store address and, on GPUs,
    keeps the GPU its machine chose (``FLAGS_selected_gpus``, else its
    ``PADDLE_LOCAL_RANK``, else 0).
    """
    os.environ.update(env)
    if "MASTER_ADDR" not in env:
        return  # spawned: the variables are the whole story
    os.environ.pop("PADDLE_MASTER", None)
    if env["PADDLE_DISTRI_BACKEND"] == "nccl":
        os.environ.setdefault(
            "FLAGS_selected_gpus", os.environ.get("PADDLE_LOCAL_RANK", "0")
        )


# ------------------------------------------------------------- a follower


def _follow(sock: socket.socket) -> int:
    """A spawned follower: its setup, then each step until EOF."""
    setup = _receive(sock)
    if not isinstance(setup, RankSetup):
        return 0  # rank 0 went away before saying what to load
    return _run_steps(setup, lambda: _receive(sock))


def _follow_connected(sock: socket.socket, setup_timeout: float) -> int:
    """A ``--connect`` follower: say Hello, take the setup, then steps.

    A reader thread takes every message off the socket and ends the process
    at once (even mid-step, blocked in a collective) when rank 0 closes the
    connection or has been silent for ``silence_timeout``: no pidfd crosses
    machines, and a collective whose peer vanished may never return. A
    thread needs the GIL, which Paddle holds through some blocking calls
    (``init_parallel_env`` waiting for the store holds it), so the kernel
    backs it up: each message re-arms a SIGALRM (default action: the
    process ends) due ``_ALARM_GRACE`` seconds after the silence timeout.
    """
    sock.sendall(_frame(Hello(os.getpid(), socket.gethostname())))
    sock.settimeout(setup_timeout)  # rank 0 answers once every rank is in
    try:
        setup = _receive(sock)
    except TimeoutError:
        _exit_now(f"rank 0 sent no setup within {setup_timeout:g}s", 1)
    if not isinstance(setup, RankSetup) or setup.silence_timeout is None:
        return 0  # rank 0 went away (or gave up waiting for the others)
    _apply_env(setup.env)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    _rearm(setup.silence_timeout)
    inbox: queue.SimpleQueue[_Message] = queue.SimpleQueue()
    threading.Thread(
        target=_read_rank0,
        args=(sock, inbox, setup.silence_timeout),
        name="rank0-reader",
        daemon=True,
    ).start()
    return _run_steps(setup, inbox.get)


def _read_rank0(
    sock: socket.socket, inbox: queue.SimpleQueue[_Message], silence: float
) -> None:
    sock.settimeout(silence)
    while True:
        try:
            msg = _receive(sock)
        except TimeoutError:
            _exit_now(f"no word from rank 0 for {silence:g}s (heartbeat timeout)", 1)
        except (OSError, msgspec.DecodeError):
            msg = None
        if msg is None:
            _exit_now(None, 0)  # rank 0 closed the group
        _rearm(silence)
        if not isinstance(msg, Ping):
            inbox.put(msg)


def _rearm(silence: float) -> None:
    """Have the kernel end this process unless rank 0 is heard from again
    within ``silence`` seconds (and a grace, for the reader to say why)."""
    signal.setitimer(signal.ITIMER_REAL, silence + _ALARM_GRACE)


def _exit_now(why: str | None, code: int) -> NoReturn:
    """End the process from any thread, whatever the others are doing."""
    if why is not None:
        rank = os.environ.get("PADDLE_TRAINER_ID", "?")
        with contextlib.suppress(OSError):
            os.write(2, f"structllm rank {rank}: {why}; exiting\n".encode())
    os._exit(code)


def _run_steps(setup: RankSetup, next_message: Callable[[], _Message | None]) -> int:
    """Load the shard, then run each step's forward until no message is left."""
    from structllm.core.engine_core import load_engine_model
    from structllm.core.runner import run_forward
    from structllm.engine.core_process import _inject
    from structllm.model._paddle import (
        paddle,
        set_num_threads,
    )

    config = setup.config
    set_num_threads(config.cpu_threads())
    paddle.distributed.init_parallel_env()
    rank = paddle.distributed.get_rank()
    model = load_engine_model(config, rank).model
    fault_kind, _, fault_step = (setup.fault or "").partition(":")
    kv_caches = None
    steps = 0
    while (msg := next_message()) is not None:
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


def _connect(address: str, timeout: float) -> socket.socket:
    """A connection to rank 0, retried until it listens or ``timeout`` passes."""
    host, port = parse_address(address, "--connect")
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=_HELLO_TIMEOUT)
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise ConnectionError(
                    f"rank 0 at {address} did not answer within {timeout:g}s: {exc}"
                ) from exc
            time.sleep(0.5)  # not listening yet (it starts later, or restarts)
            continue
        sock.settimeout(None)
        return sock


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m structllm.engine.rank_group",
        description="A follower rank of a tensor-parallel engine. Started by "
        "rank 0 itself (--fd, --parent-pid), or on another machine with "
        "--connect to the address rank 0 listens on (structllm serve "
        "--tensor-parallel-listen); see docs/parallel.md.",
    )
    parser.add_argument("--fd", type=int, help="socket to rank 0 (spawned)")
    parser.add_argument("--parent-pid", type=int, help="rank 0's pid (spawned)")
    parser.add_argument(
        "--connect", metavar="HOST:PORT", help="rank 0's --tensor-parallel-listen"
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=CONNECT_TIMEOUT,
        metavar="SECONDS",
        help="how long to keep trying to reach rank 0, and then to wait for "
        "the group to form (default: %(default)g)",
    )
    ns = parser.parse_args(argv)
    if ns.connect is not None:
        if ns.fd is not None or ns.parent_pid is not None:
            parser.error("--connect takes no --fd or --parent-pid")
        try:
            sock = _connect(ns.connect, ns.connect_timeout)
        except (ConnectionError, EngineConfigError) as exc:
            parser.exit(2, f"{parser.prog}: {exc}\n")
        return _run_follower(sock, lambda: _follow_connected(sock, ns.connect_timeout))
    if ns.fd is None or ns.parent_pid is None:
        parser.error("give --connect HOST:PORT (or --fd and --parent-pid)")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from structllm.engine.core_process import _exit_with_parent

    _exit_with_parent(ns.parent_pid)
    if os.getppid() != ns.parent_pid:
        return 0  # rank 0 died before the watch began
    sock = socket.socket(fileno=ns.fd)
    return _run_follower(sock, lambda: _follow(sock))


def _run_follower(sock: socket.socket, follow: Callable[[], int]) -> int:
    """``follow()``; if it raises, tell rank 0 (RankFailed) and exit 1."""
    try:
        return follow()
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
