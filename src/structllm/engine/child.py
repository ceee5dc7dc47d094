"""What every child process of the engine does, whichever program it runs.

The core process (:mod:`structllm.engine.core_process`) and the follower
ranks of a tensor-parallel group (:mod:`structllm.engine.rank_group`) are
separate programs; both end with their parent (:func:`exit_with_parent`),
take the test faults of ``Start.fault`` (:func:`inject_fault`), report
their memory (:func:`peak_rss_bytes`) and give back the library pages that
loading alone touched (:func:`release_library_pages`).
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

__all__ = [
    "SLOW_STEP_S",
    "exit_with_parent",
    "inject_fault",
    "library_ranges",
    "peak_rss_bytes",
    "release_library_pages",
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


#: ``madvise``'s advice to reclaim a range's pages now (Linux 5.4+)
_MADV_PAGEOUT = 21
#: a shared object's path: ``libpaddle.so``, ``libstdc++.so.6.0.30``
_SHARED_OBJECT = re.compile(r"\.so(\.\d+)*$")


def library_ranges(maps: str) -> list[tuple[int, int]]:
    """The read-only mappings of shared objects in ``maps`` (the text of
    ``/proc/PID/maps``), as ``(start, stop)`` addresses: code and constants.

    Writable ones are left out: their changed pages are the process's own
    (a relocated table, a library's globals), and reclaiming them would
    mean swap. So are other files (a model's mapped weights, read every
    step) and anonymous memory.
    """
    ranges = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or "w" in fields[1]:
            continue
        if not _SHARED_OBJECT.search(fields[5]):  # " (deleted)" ends no name
            continue
        start, _, stop = fields[0].partition("-")
        ranges.append((int(start, 16), int(stop, 16)))
    return ranges


def release_library_pages() -> int:
    """Ask the kernel to reclaim now the pages of this process's shared
    libraries that no other process maps; the bytes of the ranges advised
    (0 where ``MADV_PAGEOUT`` or ``/proc`` is missing).

    ``import paddle`` registers its ~1,300 operators, touching ~200 MiB of
    ``libpaddle.so``'s and its companions' pages that no step reads again
    (LLVM's are in the same case once numba's cached kernels are linked):
    they stay resident until memory runs short, and count in the process's
    RSS. A page that is needed again is read back from the file on its
    first touch (a warm-up step afterwards takes them: ~13 MiB and ~50 ms
    on SmolLM2-135M, docs/benchmarks.md). Pages that another process maps
    too (a second core on the same machine) are skipped by the kernel.
    """
    try:
        with open("/proc/self/maps") as f:
            ranges = library_ranges(f.read())
        madvise = ctypes.CDLL(None).madvise
    except (OSError, AttributeError):  # not Linux
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    advised = 0
    for start, stop in ranges:
        # fails with EINVAL on a kernel before 5.4: nothing is reclaimed
        if madvise(start, stop - start, _MADV_PAGEOUT) == 0:
            advised += stop - start
    return advised


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
