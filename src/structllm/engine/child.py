"""What every child process of the engine does, whichever program it runs.

The core process (:mod:`structllm.engine.core_process`) and the follower
ranks of a tensor-parallel group (:mod:`structllm.engine.rank_group`) are
separate programs; both end with their parent (:func:`exit_with_parent`),
take the test faults of ``Start.fault`` (:func:`inject_fault`), report
their memory (:func:`peak_rss_bytes`), give back the library pages that
loading alone touched (:func:`release_library_pages`) and the memory malloc
keeps (:func:`release_kept_memory`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import resource
import select
import sys
import threading
import time
from collections.abc import Callable

__all__ = [
    "SLOW_STEP_S",
    "TRIM_AFTER_TOKENS",
    "exit_with_parent",
    "inject_fault",
    "library_ranges",
    "peak_rss_bytes",
    "release_kept_memory",
    "release_library_pages",
    "trims_after",
]


def peak_rss_bytes() -> int:
    """This process's peak resident memory.

    Linux's ``VmHWM``, of this program's memory only: ``getrusage``'s
    ``ru_maxrss`` would also count the parent's, which a fork had shared
    before the exec. Elsewhere ``ru_maxrss`` (macOS counts it in bytes).
    """
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/self/status") as f:
            line = next(ln for ln in f if ln.startswith("VmHWM:"))
        return 1024 * int(line.split()[1])  # "VmHWM:  437320 kB"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else 1024 * peak


#: ``madvise``'s advice to drop a range's pages from the process; a file
#: mapping's come back from the page cache on their next touch
_MADV_DONTNEED = 4
#: a shared object's path: ``libpaddle.so``, ``libstdc++.so.6.0.30``
_SHARED_OBJECT = re.compile(r"\.so(\.\d+)*$")


def library_ranges(smaps: str) -> list[tuple[int, int]]:
    """The read-only mappings of shared objects in ``smaps`` (the text of
    ``/proc/PID/smaps``) that hold no page of the process's own, as
    ``(start, stop)`` addresses: code and constants, every page of them
    the file's.

    Left out: writable mappings (a library's globals); read-only ones that
    hold anonymous pages (a relocated table that the loader wrote before
    making it read-only: dropping those pages would bring back the file's
    unrelocated bytes); other files (a model's mapped weights, read every
    step) and anonymous memory.
    """
    ranges = []
    candidate = None
    for line in smaps.splitlines():
        fields = line.split(maxsplit=5)
        if not fields:
            continue
        if not fields[0].endswith(":"):  # a mapping: "start-stop perms ..."
            candidate = None
            shared_object = len(fields) == 6 and _SHARED_OBJECT.search(fields[5])
            if shared_object and "w" not in fields[1]:  # " (deleted)": none
                start, _, stop = fields[0].partition("-")
                candidate = (int(start, 16), int(stop, 16))
        elif fields[0] == "Anonymous:" and candidate is not None:
            if fields[1] == "0":
                ranges.append(candidate)
            candidate = None
    return ranges


def release_library_pages() -> int:
    """Drop from this process the pages of its shared libraries' code and
    constants (:func:`library_ranges`); the bytes of the ranges dropped (0
    where ``/proc`` is missing).

    ``import paddle`` registers its ~1,300 operators, touching ~200 MiB of
    ``libpaddle.so``'s and its companions' pages that no step reads again
    (LLVM's are in the same case once numba's cached kernels are linked):
    they stay mapped, and count in the process's RSS and peak. Dropped,
    they stay in the kernel's page cache (clean, reclaimed when memory
    runs short, shared with any other process that maps them), and a page
    touched again maps back from there without a read (a warm-up step
    afterwards takes back what a step needs: ~13 MiB on SmolLM2-135M,
    docs/benchmarks.md). ``MADV_PAGEOUT`` was tried first and gave the
    same RSS, but it evicts the pages from the page cache as well, so
    every core started later read them back from disk (0.3 s more a start
    on this machine).
    """
    try:
        with open("/proc/self/smaps") as f:
            ranges = library_ranges(f.read())
        madvise = ctypes.CDLL(None).madvise
    except (OSError, AttributeError):  # not Linux
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    dropped = 0
    for start, stop in ranges:
        if madvise(start, stop - start, _MADV_DONTNEED) == 0:
            dropped += stop - start
    return dropped


#: a step that ran at least this many tokens beyond one a sequence (prompt
#: chunks, drafts to verify) gives malloc's kept memory back once its output
#: is sent (:func:`release_kept_memory`). Its temporaries, freed into
#: malloc's heaps, stayed resident beside the KV cache and were most of the
#: core's peak above it: 16 clients on SmolLM2 Q4_1 peaked at 560-636 MiB,
#: 544-556 trimming after such steps, at the same speed (docs/benchmarks.md).
#: A decode step (one token a sequence, any batch) never trims, nor does
#: speculation at 16 sequences of 4 drafts; a trim costs 0.5-3 ms.
TRIM_AFTER_TOKENS = 128


def trims_after(num_tokens: int, num_seqs: int) -> bool:
    """Whether a step of ``num_tokens`` over ``num_seqs`` sequences gives
    malloc's kept memory back after it (:data:`TRIM_AFTER_TOKENS`)."""
    return num_tokens - num_seqs >= TRIM_AFTER_TOKENS


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``; None under another C library."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except AttributeError:  # pragma: no cover - not glibc
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_kept_memory() -> None:
    """Give the memory malloc holds freed back to the system.

    A burst's temporaries (a prefill's activations and gathers, Paddle's
    and numpy's) are freed into malloc's heaps, where they stay resident
    until reused: 70 MiB after 16 prompts of 256 tokens on SmolLM2-135M
    (docs/benchmarks.md). The loop calls this after a step of many tokens
    (:data:`TRIM_AFTER_TOKENS`: the next such step faults back the pages
    it needs, not the heap's whole high-water mark) and once per idle
    spell, a heartbeat interval after its last step: a server that goes
    quiet shrinks. First the IR numba keeps of the kernels loaded since
    the last call is freed (``kernels.release_linking_ir``).
    """
    kernels = sys.modules.get("structllm.model.kernels")
    if kernels is not None:  # not imported here: no kernel has run
        kernels.release_linking_ir()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


#: how long the ``slow_at_step`` and ``stall_at_step`` faults' steps take
SLOW_STEP_S = 3.0


def inject_fault(kind: str, step: int) -> None:
    """Test hook: fail on purpose at a given step."""
    if kind == "raise_at_step":
        raise_at = RuntimeError(f"injected fault at step {step}")
        raise raise_at
    if kind == "hang_at_step":
        while True:  # a wedged kernel: no output, no heartbeat
            time.sleep(3600)
    if kind == "exit_at_step":
        os._exit(3)
    if kind == "slow_at_step":  # a step far longer than heartbeat_timeout
        time.sleep(SLOW_STEP_S)
        return
    if kind == "stall_at_step":  # as slow, holding the GIL (a kernel compiling)
        ctypes.PyDLL(None).usleep(int(SLOW_STEP_S * 1e6))  # no thread runs
        return
    raise ValueError(f"unknown fault {kind!r}")


def exit_with_parent(parent_pid: int) -> None:
    """Exit at once, even mid-step, when the parent process dies.

    A thread waits on a pidfd of the parent (readable when it exits). Not
    ``PR_SET_PDEATHSIG``: that fires when the parent *thread* that forked us
    exits, and trio starts processes from a pooled thread that retires after
    10 s idle, which would kill a healthy core process.
    """

    def watch_pidfd(fd: int) -> None:
        select.select([fd], [], [])
        os._exit(0)

    def watch_ppid() -> None:  # no pidfd (not Linux): check once a second
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    try:
        fd = os.pidfd_open(parent_pid)
    except (AttributeError, OSError):
        watch = watch_ppid
    else:
        watch = functools.partial(watch_pidfd, fd)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
