"""A follower rank of a tensor-parallel group: the process rank 0 steps.

Run as ``python -m structllm.engine.rank_group`` (:func:`main`; the
group's module keeps the command), either spawned by rank 0 itself
(``--fd K --parent-pid P``) or started elsewhere with ``--connect
HOST:PORT`` (see :mod:`structllm.engine.rank_group` for the group's rules
and :mod:`structllm.engine.rank_group.protocol` for the messages). Either way it
takes its :class:`~structllm.engine.rank_group.protocol.RankSetup`, joins the
process group, loads its shard, and runs each step's forward until rank 0
closes the connection; if it raises, it tells rank 0 (``RankFailed``) and
exits 1. With ``enable_lora`` its shard gets the same LoRA slots as rank
0's, and a step's forward waits for its ``StepLoRA``: the slot changes
(each adapter read again from its directory, this rank's share) and the
rows.

- A spawned follower watches rank 0's pid through a pidfd, as the core
  process watches the front end, and reads EOF when rank 0 closes.
- A connected follower has no pid to watch across machines: it ends
  itself when rank 0 closes the connection or falls silent for the
  heartbeat timeout (between steps) or for ``step_timeout`` plus the
  heartbeat timeout since its step began (mid-step: rank 0's front end
  gives rank 0's steps as long), with a SIGALRM as the kernel's backup
  (:func:`_follow_connected`, :class:`Silence`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NoReturn

import attrs
import msgspec
import numpy as np

from structllm.config import parse_address
from structllm.engine.rank_group.env import apply_env
from structllm.engine.rank_group.protocol import (
    HELLO_TIMEOUT,
    AllocateKV,
    Hello,
    Ping,
    RankFailed,
    RankMessage,
    RankSetup,
    Step,
    StepLoRA,
    frame,
    receive,
)
from structllm.errors import EngineConfigError

if TYPE_CHECKING:
    from structllm.config import EngineConfig
    from structllm.model.lora import LoRAAdapter, LoRASlots
    from structllm.model.protocol import CausalLM

__all__ = ["CONNECT_TIMEOUT", "Silence", "main"]

#: default seconds a ``--connect`` follower keeps trying to reach rank 0
CONNECT_TIMEOUT = 600.0
#: seconds past a ``--connect`` follower's silence timeout that its SIGALRM
#: ends it, if its reader thread could not (Paddle held the GIL)
_ALARM_GRACE = 1.0


def _follow(sock: socket.socket) -> int:
    """A spawned follower: its setup, then each step until EOF."""
    setup = receive(sock)
    if not isinstance(setup, RankSetup):
        return 0  # rank 0 went away before saying what to load
    return _run_steps(setup, lambda: receive(sock))


def _follow_connected(sock: socket.socket, setup_timeout: float) -> int:
    """A ``--connect`` follower: say Hello, take the setup, then steps.

    A reader thread takes every message off the socket and ends the process
    at once (even mid-step, blocked in a collective) when rank 0 closes the
    connection; a watchdog thread ends it when rank 0 has been silent past
    its :class:`Silence` deadline: no pidfd crosses machines, and a
    collective whose peer vanished may never return. A thread needs the
    GIL, which Paddle holds through some blocking calls
    (``init_parallel_env`` waiting for the store holds it; so does a kernel
    compiling in a step), so the kernel backs them up: every change of the
    deadline re-arms a SIGALRM (default action: the process ends) due
    ``_ALARM_GRACE`` seconds after it.
    """
    sock.sendall(frame(Hello(os.getpid(), socket.gethostname())))
    sock.settimeout(setup_timeout)  # rank 0 answers once every rank is in
    try:
        setup = receive(sock)
    except TimeoutError:
        _exit_now(f"rank 0 sent no setup within {setup_timeout:g}s", 1)
    if not isinstance(setup, RankSetup) or setup.silence_timeout is None:
        return 0  # rank 0 went away (or gave up waiting for the others)
    sock.settimeout(None)
    apply_env(setup.env)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    watch = _Watch(Silence(setup.silence_timeout, setup.step_timeout, time.monotonic()))
    inbox: queue.SimpleQueue[RankMessage] = queue.SimpleQueue()
    threading.Thread(
        target=_read_rank0, args=(sock, inbox, watch), name="rank0-reader", daemon=True
    ).start()
    threading.Thread(target=watch.run, name="rank0-watchdog", daemon=True).start()
    return _run_steps(setup, inbox.get, watch.step)


def _read_rank0(
    sock: socket.socket, inbox: queue.SimpleQueue[RankMessage], watch: _Watch
) -> None:
    while True:
        try:
            msg = receive(sock)
        except (OSError, msgspec.DecodeError):
            msg = None
        if msg is None:
            _exit_now(None, 0)  # rank 0 closed the group
        watch.heard()
        if not isinstance(msg, Ping):
            inbox.put(msg)


@attrs.define
class Silence:
    """How long a ``--connect`` follower waits for word from rank 0: the
    deadline, kept as times of :func:`time.monotonic` (pure, for tests).

    Between steps rank 0 pings every heartbeat interval, so
    ``heartbeat_timeout`` (``timeout``) of silence means it is gone. A step
    may take far longer (a long prefill on a loaded machine, a kernel
    compiling with the GIL held on either side, when no thread reads or
    sends pings), and rank 0's front end lets rank 0's steps run
    ``step_timeout`` before it stops hearing heartbeats; so mid-step the
    follower waits ``step_timeout + timeout`` after the step began, as the
    front end does for rank 0, and a wedged or frozen rank 0 is still
    caught. The end of the follower's forward counts as word from rank 0:
    the forward's all-reduces met rank 0's.
    """

    timeout: float
    #: None: rank 0 gave none (it waits only ``timeout`` mid-step too)
    step_timeout: float | None
    #: when rank 0 was last heard from
    heard_at: float
    #: when this rank's current step began (None: between steps)
    step_began: float | None = None

    def heard(self, now: float) -> None:
        self.heard_at = max(self.heard_at, now)

    def begin_step(self, now: float) -> None:
        self.step_began = now

    def end_step(self, now: float) -> None:
        self.step_began = None
        self.heard(now)

    def deadline(self) -> float:
        """When rank 0's silence ends this follower."""
        quiet = self.heard_at + self.timeout
        if self.step_began is None or self.step_timeout is None:
            return quiet
        return max(quiet, self.step_began + self.step_timeout + self.timeout)

    def why(self, now: float) -> str:
        """What to say on the way out, at ``now`` past the deadline."""
        silent = f"no word from rank 0 for {now - self.heard_at:.3g}s"
        if self.step_began is None or self.step_timeout is None:
            return f"{silent} (heartbeat timeout {self.timeout:g}s)"
        return (
            f"{silent}, {now - self.step_began:.3g}s into a step (step_timeout "
            f"{self.step_timeout:g}s + heartbeat timeout {self.timeout:g}s)"
        )


@attrs.define(eq=False)
class _Watch:
    """:class:`Silence` kept by the reader (``heard``) and the step loop
    (``step``), enforced by a watchdog thread (``run``) and a SIGALRM."""

    silence: Silence
    _cond: threading.Condition = attrs.Factory(threading.Condition)

    def __attrs_post_init__(self) -> None:
        self._rearm()

    def heard(self) -> None:
        with self._cond:
            self.silence.heard(time.monotonic())
            self._rearm()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        with self._cond:
            self.silence.begin_step(time.monotonic())
            self._rearm()
        try:
            yield
        finally:
            with self._cond:
                self.silence.end_step(time.monotonic())
                self._rearm()
                self._cond.notify()  # the deadline may be sooner now

    def run(self) -> None:
        """End the process once the deadline passes without word."""
        with self._cond:
            while (left := self.silence.deadline() - time.monotonic()) > 0:
                self._cond.wait(left)
            why = self.silence.why(time.monotonic())
        _exit_now(why, 1)

    def _rearm(self) -> None:
        """Have the kernel end this process a grace after the deadline (for
        when the watchdog cannot run to say why)."""
        left = self.silence.deadline() - time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, max(left, 0.0) + _ALARM_GRACE)


def _exit_now(why: str | None, code: int) -> NoReturn:
    """End the process from any thread, whatever the others are doing."""
    if why is not None:
        rank = os.environ.get("PADDLE_TRAINER_ID", "?")
        with contextlib.suppress(OSError):
            os.write(2, f"structllm rank {rank}: {why}; exiting\n".encode())
    os._exit(code)


def _run_steps(
    setup: RankSetup,
    next_message: Callable[[], RankMessage | None],
    during_step: Callable[[], contextlib.AbstractContextManager[None]] = (
        contextlib.nullcontext
    ),
) -> int:
    """Load the shard, then run each step's forward (inside ``during_step()``)
    until no message is left."""
    from structllm.core.engine_setup import load_engine_model
    from structllm.core.runner import run_forward
    from structllm.engine.child import (
        inject_fault,
        release_kept_memory,
        release_library_pages,
        trims_after,
    )
    from structllm.model._paddle import (
        paddle,
        set_num_threads,
    )

    config = setup.config
    set_num_threads(config.cpu_threads())
    paddle.distributed.init_parallel_env()
    # as the core does: the pages Paddle's import alone touched leave the
    # process before the shard loads (rank 0's warm-up steps bring back
    # what a step needs)
    release_library_pages()
    rank = paddle.distributed.get_rank()
    model = load_engine_model(config, rank).model
    lora = _FollowerLoRA.enable(model, config, rank) if config.enable_lora else None
    fault_kind, _, fault_step = (setup.fault or "").partition(":")
    kv_caches = None
    steps = 0
    while (msg := next_message()) is not None:
        if isinstance(msg, AllocateKV):
            kv_caches = model.allocate_kv_cache(msg.num_blocks)
        elif isinstance(msg, Step):
            if kv_caches is None:
                raise RuntimeError("a step before the KV cache was allocated")
            with during_step():
                if lora is not None:
                    rows = next_message()
                    if rows is None:
                        break  # rank 0 closed the group mid-step
                    lora.apply(rows)
                if fault_kind and steps == int(fault_step):
                    inject_fault(fault_kind, steps)
                run_forward(model, kv_caches, msg.input)
            steps += 1
            # as rank 0 does after the same step (int64 token ids)
            if trims_after(len(msg.input.token_ids) // 8, len(msg.input.seqs)):
                release_kept_memory()
    return 0


@attrs.define(eq=False)
class _FollowerLoRA:
    """A follower's LoRA slots, changed as rank 0's are; ``read`` reads
    this rank's share of an adapter directory."""

    slots: LoRASlots
    read: Callable[[str], LoRAAdapter]

    @classmethod
    def enable(cls, model: CausalLM, config: EngineConfig, rank: int) -> _FollowerLoRA:
        from structllm.model.llama import LlamaForCausalLM
        from structllm.model.lora import enable_lora
        from structllm.model.parallel import lora_reader

        assert isinstance(model, LlamaForCausalLM)  # rank 0 checked the model
        slots = enable_lora(
            model, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank
        )
        read = lora_reader(
            config.model,
            config.tensor_parallel_size,
            rank,
            max_rank=config.max_lora_rank,
        )
        return cls(slots, read)

    def apply(self, msg: RankMessage | None) -> None:
        """The step's ``StepLoRA`` (it follows each Step): its slot changes,
        then its rows."""
        if not isinstance(msg, StepLoRA):
            raise RuntimeError(
                f"expected the step's LoRA rows after it, got {type(msg).__name__}"
            )
        for slot, path in msg.changes:
            if path is None:
                self.slots.clear_slot(slot)
            else:
                self.slots.load_adapter(slot, self.read(path))
        rows = None if msg.rows is None else np.frombuffer(msg.rows, np.int64)
        self.slots.set_rows(rows)


def _connect(address: str, timeout: float) -> socket.socket:
    """A connection to rank 0, retried until it listens or ``timeout`` passes."""
    host, port = parse_address(address, "--connect")
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=HELLO_TIMEOUT)
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
    """The follower's command line; its exit status (0: rank 0 closed the
    group; 1: the follower raised, and told rank 0)."""
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
    from structllm.engine.child import exit_with_parent

    exit_with_parent(ns.parent_pid)
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
                frame(
                    RankFailed(
                        rank, type(exc).__name__, str(exc), traceback.format_exc()
                    )
                )
            )
        return 1
    finally:
        sock.close()
