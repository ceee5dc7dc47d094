"""Import Paddle once, quietly, and configure its CPU threads."""

from __future__ import annotations

import functools
import os
import warnings

# Paddle's C++ logging (glog) writes warnings to stderr, e.g. one from
# to_static on every process that builds oneDNN predictors; errors still show
os.environ.setdefault("GLOG_minloglevel", "2")

with warnings.catch_warnings():
    # Paddle warns at import about ccache (a build tool) and other trivia.
    warnings.simplefilter("ignore")
    import paddle

__all__ = ["cpu_vendor", "default_num_threads", "paddle", "set_num_threads"]


def default_num_threads() -> int:
    """CPU threads for Paddle's math: the cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def set_num_threads(n: int | None = None) -> None:
    """Paddle runs CPU math on one thread unless told otherwise."""
    paddle.base.core.set_num_threads(n or default_num_threads())


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor id (``GenuineIntel``, ``AuthenticAMD``; "" if unknown).

    It decides the CPU model backend: Paddle's eager matmul is Intel MKL,
    whose fast kernels run on Intel CPUs only (docs/benchmarks.md).
    """
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip()
    except OSError:  # pragma: no cover - not Linux
        pass
    return ""
