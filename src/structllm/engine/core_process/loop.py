"""The core process: ``python -m structllm.engine.core_process --fd N``.

Runs an :class:`EngineCore` behind a socket (inherited as file descriptor N,
or one end of a socketpair when run in a thread by the inline client).
Synchronous by design: it waits in ``select`` when idle (waking only to send
a heartbeat) and steps the core back to back while there is work, reading
new requests and aborts between steps, so an abort frees its blocks within
one step.

It exits when told to (Shutdown), when the socket closes (the front end went
away), or when its parent process dies: a thread watches a pidfd of the
parent and ends the process at once, even mid-step (see
:func:`~structllm.engine.child.exit_with_parent`). It starts as a fresh interpreter and ignores
SIGINT: Ctrl-C is the front end's to handle.

With ``tensor_parallel_size > 1`` it is rank 0 of a group and starts the
other ranks itself (:mod:`structllm.engine.rank_group`); they die with it,
and it sends Fatal and exits when one of them dies or raises, so the front
end supervises the group as this one process. Only the process entry point
(:func:`main`) starts a group; the inline executor refuses it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

from structllm.engine.child import (
    exit_with_parent,
    inject_fault,
    peak_rss_bytes,
    release_kept_memory,
    release_library_pages,
    trims_after,
)
from structllm.engine.core_process.pulse import Pulse
from structllm.engine.protocol import (
    AbortRequests,
    AddFailed,
    AddLoRA,
    CoreRequest,
    CoreState,
    Fatal,
    FrameReader,
    Heartbeat,
    InspectCore,
    LoadProgressMsg,
    LoRAAdded,
    LoRARemoved,
    Message,
    PrefixCacheReset,
    Ready,
    RemoveLoRA,
    ResetPrefixCache,
    Shutdown,
    Start,
    encode,
)

if TYPE_CHECKING:
    from structllm.core.engine_core import EngineCore
    from structllm.engine.rank_group.group import RankGroup

__all__ = ["main", "release_kept_memory", "serve"]

Send = Callable[[Message], None]
#: messages that arrived within the timeout (None: wait); None on timeout
Receive = Callable[[float | None], list[Message] | None]


#: Fatal.kind when a follower rank of a tensor-parallel group died or raised
_RANK_LOST = "TensorParallelRankLost"


class _Closed(Exception):
    pass


def serve(sock: socket.socket, *, tensor_parallel: bool = False) -> int:
    """Run the protocol on ``sock`` until shutdown or EOF; return an exit code.

    ``tensor_parallel``: this is a process of its own, which may start the
    other ranks of a tensor-parallel group (see the module docstring).
    """
    reader = FrameReader()
    lock = threading.Lock()  # the rank watch thread may send a Fatal too

    def send(msg: Message) -> None:
        with lock:
            sock.sendall(encode(msg))

    def receive(timeout: float | None) -> list[Message] | None:
        ready, _, _ = select.select([sock], [], [], timeout)
        if not ready:
            return None
        data = sock.recv(1 << 20)
        if not data:
            raise _Closed
        return reader.feed(data)

    try:
        first: list[Message] = []
        while not first:
            first = receive(None) or []
        start = first.pop(0)
        if not isinstance(start, Start):
            raise RuntimeError(f"expected Start, got {type(start).__name__}")
        group: RankGroup | None = None
        ready = threading.Event()
        if tensor_parallel and start.config.tensor_parallel_size > 1:

            def on_lost(reason: str) -> None:
                _exit_group_lost(reason, sock, lock, group, ready)

            try:
                group = _start_group(start, on_lost)
            except Exception as exc:
                send(_load_fatal(exc))
                return 1
        try:
            core = _load(start, send, group)
            if core is None:
                return 1
            ready.set()
            pulse = Pulse(send, start.heartbeat_interval, start.step_timeout)
            try:
                return _loop(core, start, first, receive, send, pulse, group)
            finally:
                pulse.close()
                core.close()
        finally:
            if group is not None:
                group.close()
    except (_Closed, BrokenPipeError, ConnectionResetError):
        return 0


def _start_group(start: Start, on_lost: Callable[[str], None]) -> RankGroup:
    from structllm.engine.rank_group.group import RankGroup
    from structllm.model.parallel import check_tensor_parallel

    check_tensor_parallel(start.config.model, start.config.tensor_parallel_size)
    rank1, _, fault = (start.fault or "").partition(":")
    return RankGroup.start(
        start.config,
        on_lost=on_lost,
        fault=fault if rank1 == "rank1" else None,
        heartbeat=(start.heartbeat_interval, start.heartbeat_timeout),
        step_timeout=start.step_timeout,
    )


def _exit_group_lost(
    reason: str,
    sock: socket.socket,
    lock: threading.Lock,
    group: RankGroup | None,
    ready: threading.Event,
) -> None:
    """A follower rank died or raised: say so (Fatal), take the rest down, exit.

    Runs in the rank watch thread, whatever the main thread is doing (it
    may be blocked in a collective that will never complete).
    """
    fatal = Fatal(
        _RANK_LOST,
        reason,
        "",
        during_load=not ready.is_set(),
    )
    if lock.acquire(timeout=2.0):  # the main thread may be mid-send
        with contextlib.suppress(OSError):
            sock.sendall(encode(fatal))
    if group is not None:
        group.kill()
    os._exit(1)


def _load_fatal(exc: Exception) -> Fatal:
    from structllm.errors import EngineConfigError

    field = exc.field if isinstance(exc, EngineConfigError) else None
    return Fatal(
        type(exc).__name__,
        str(exc),
        traceback.format_exc(),
        during_load=True,
        field=field,
    )


def _load(start: Start, send: Send, group: RankGroup | None) -> EngineCore | None:
    from structllm.core.engine_core import EngineCore

    try:
        # Paddle first: the pages its import alone touched go back before
        # the model loads, so they never count in the core's peak with it
        import structllm.model._paddle  # noqa: F401

        release_library_pages()
        core = EngineCore(
            start.config,
            on_progress=lambda e: send(LoadProgressMsg(e.stage, e.done, e.total)),
            tokenizer=start.tokenizer,
            tp_group=group,
        )
        _warm_up(core, send)
    except Exception as exc:
        send(_load_fatal(exc))
        return None
    send(
        Ready(
            vocab_size=core.vocab_size,
            max_model_len=core.max_model_len,
            num_blocks=core.pool.num_blocks,
            block_size=core.pool.block_size,
            eos_token_ids=list(core.model_config.eos_token_ids),
            pid=os.getpid(),
            kv_cache_bytes=core.kv_cache_bytes,
            peak_rss_bytes=peak_rss_bytes(),
        )
    )
    return core


def _warm_up(core: EngineCore, send: Send) -> None:
    """One short request through every code path (prefill, decode, sampling),
    and every compiled attention kernel loaded (compiled once per install);
    then the library pages only loading touched are given back and the
    request runs again, so a first user step does not fault back the pages
    it needs (:func:`~structllm.engine.child.release_library_pages`).

    The pages loading touched go back before the first request too: the
    request touches the weights read in place (a GGUF file's pages, ~53 MiB
    on SmolLM2 Q4_1), and with the loading's library pages still resident
    that was the core's peak (408 MiB against 353 given back first: the
    import of Paddle's 347 is the peak now)."""
    from structllm.model import kernels

    send(LoadProgressMsg("warmup", 0, 1))
    kernels.warm_up(core.runner.model.resolved_kv_cache_dtype())
    release_kept_memory()  # what loading freed (the kernels' IR: ~28 MiB quantized)
    release_library_pages()
    _warm_request(core)
    release_kept_memory()
    release_library_pages()
    _warm_request(core)
    # neither its blocks nor its counts are the user's
    core.reset_prefix_cache()
    sched = core.scheduler
    sched.prefix_cache_queries = sched.prefix_cache_hits = 0
    sched.num_drafts = sched.num_draft_tokens = sched.num_accepted_tokens = 0
    send(LoadProgressMsg("warmup", 1, 1))


def _warm_request(core: EngineCore) -> None:
    """A short sampled request of 8 tokens, run to its end."""
    from structllm.params import SamplingParams

    # with speculation, room for a verification chunk of k + 1 positions (a
    # draft model always proposes; prompt lookup when the tokens repeat)
    spec = core.config.speculative_config
    extra = 0 if spec is None else spec.num_speculative_tokens
    core.add_request(
        CoreRequest(
            request_id="__warmup__",
            prompt_token_ids=(0,) * 8,
            params=SamplingParams(
                max_tokens=2 + extra, temperature=0.7, ignore_eos=True
            ),
        )
    )
    while core.has_unfinished_requests():
        core.step()


def _add_lora(core: EngineCore, msg: AddLoRA) -> LoRAAdded:
    """Read the adapter; a refusal is the answer, not the core's end."""
    from structllm.errors import InvalidRequestError, ModelLoadError

    try:
        return LoRAAdded(core.add_lora(msg.lora_request))
    except (InvalidRequestError, ModelLoadError) as exc:
        field = exc.field if isinstance(exc, InvalidRequestError) else None
        return LoRAAdded(False, type(exc).__name__, str(exc), field)


def _loop(
    core: EngineCore,
    start: Start,
    backlog: list[Message],
    receive: Receive,
    send: Send,
    pulse: Pulse,
    group: RankGroup | None = None,
) -> int:
    fault = start.fault if not (start.fault or "").startswith("rank1:") else None
    fault_kind, _, fault_step = (fault or "").partition(":")
    steps = 0
    pending: list[Message] = list(backlog)
    last_sent = time.monotonic()
    trimmed = False  # the allocator's kept memory given back since the last step
    while True:
        busy = core.has_unfinished_requests()
        if not pending or busy:
            got = receive(0.0 if busy else start.heartbeat_interval)
            # Idle, a heartbeat at least once an interval, also while messages
            # keep arriving (requests aborted before their first step make no
            # step outputs, and silence would look like a hung process).
            if not busy and (
                got is None or time.monotonic() - last_sent >= start.heartbeat_interval
            ):
                send(_heartbeat(core))
                last_sent = time.monotonic()
            if got is None and not busy:
                if not trimmed:  # a heartbeat interval idle
                    release_kept_memory()
                    trimmed = True
                continue
            pending += got or []
        for msg in pending:
            if isinstance(msg, CoreRequest):
                _add(core, msg, send)
            elif isinstance(msg, AbortRequests):
                core.abort_requests(msg.request_ids, msg.groups)
            elif isinstance(msg, ResetPrefixCache):
                send(PrefixCacheReset(core.reset_prefix_cache()))
            elif isinstance(msg, InspectCore):
                send(_state(core))
            elif isinstance(msg, AddLoRA):
                send(_add_lora(core, msg))
            elif isinstance(msg, RemoveLoRA):
                send(LoRARemoved(core.remove_lora(msg.lora_id)))
            elif isinstance(msg, Shutdown):
                return 0
        pending = []
        if not core.has_unfinished_requests():
            if busy:  # just went idle: report the freed blocks at once
                send(_heartbeat(core))
            continue
        try:
            with pulse.during_step(_heartbeat(core, memory=False)):
                if fault_kind and steps == int(fault_step):
                    inject_fault(fault_kind, steps)
                out = core.step()
        except Exception as exc:
            # A follower's death breaks the step's collective ("connection
            # reset by peer"): wait briefly for the watch to say whose.
            lost = None if group is None else group.wait_lost(1.0)
            kind = type(exc).__name__ if lost is None else _RANK_LOST
            send(Fatal(kind, lost or str(exc), traceback.format_exc()))
            return 1
        steps += 1
        last_sent = time.monotonic()
        send(out)
        # a large step's temporaries went back to malloc, which keeps them
        trimmed = trims_after(out.num_batched_tokens, out.num_seqs)
        if trimmed:
            release_kept_memory()
        if not core.has_unfinished_requests():
            # gone idle: the counts and the burst's peak memory (process
            # telemetry, not the core's) now, not a heartbeat interval later
            send(_heartbeat(core))


def _add(core: EngineCore, request: CoreRequest, send: Send) -> None:
    from structllm.errors import InvalidRequestError

    try:
        core.add_request(request)
    except InvalidRequestError as exc:
        send(AddFailed(request.request_id, str(exc), exc.field))
    except Exception as exc:  # one bad request never stops the core
        send(AddFailed(request.request_id, f"{type(exc).__name__}: {exc}"))


def _heartbeat(core: EngineCore, *, memory: bool = True) -> Heartbeat:
    """The core's counts, and its peak memory unless ``memory`` is false (a
    read of /proc: the step's pulse reads it only when it sends)."""
    s = core.scheduler
    peak = peak_rss_bytes() if memory else 0
    return Heartbeat(len(s.running), len(s.waiting), core.pool.num_used, peak)


def _state(core: EngineCore) -> CoreState:
    return CoreState(
        steps=core.steps,
        request_ids=sorted(core.scheduler.requests),
        blocks_used=core.pool.num_used,
        num_blocks=core.pool.num_blocks,
        grammars_compiling=core.structured.num_compiling,
        pins=sorted(core.pool.pinned_names()),
        blocks_pinned=len(core.pool.pinned_blocks()),
        draft_blocks_used=0 if core.draft is None else core.draft.pool.num_used,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m structllm.engine.core_process")
    parser.add_argument("--fd", type=int, required=True, help="inherited socket fd")
    parser.add_argument("--parent-pid", type=int, default=None)
    ns = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if ns.parent_pid is not None:
        exit_with_parent(ns.parent_pid)
        if os.getppid() != ns.parent_pid:
            return 0  # the parent died before the watch began
    sock = socket.socket(fileno=ns.fd)
    try:
        return serve(sock, tensor_parallel=True)
    finally:
        sock.close()
