"""Import Paddle once, quietly, and configure its CPU threads."""

from __future__ import annotations

import functools
import os
import threading
import warnings

import numpy as np

# Paddle's C++ logging (glog) writes warnings to stderr, e.g. one from
# to_static on every process that builds oneDNN predictors; errors still show
os.environ.setdefault("GLOG_minloglevel", "2")

with warnings.catch_warnings():
    # Paddle warns at import about ccache (a build tool) and other trivia.
    warnings.simplefilter("ignore")
    import paddle

__all__ = [
    "cpu_vendor",
    "default_num_threads",
    "host_tensor",
    "paddle",
    "set_num_threads",
]


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


_holders = threading.local()


def host_tensor(array: np.ndarray, slot: str) -> paddle.Tensor:
    """``array`` as a Paddle tensor, without a copy and without a leak.

    Paddle 3.3's eager ``Tensor`` constructor leaks a Python list on every
    call (``paddle.to_tensor`` and ``paddle.from_dlpack`` included: about
    100 bytes each, found by the soak in docs/operations.md), and a step
    builds several such tensors per layer. Instead, each thread keeps one
    eager tensor per ``slot`` and re-points it at ``array``'s memory. The
    tensor returned is valid until this thread asks for ``slot`` again, so a
    slot names one use within a step; ``array`` may be a temporary (the
    tensor keeps its memory alive).
    """
    holders: dict[str, paddle.Tensor] | None = getattr(_holders, "tensors", None)
    if holders is None:
        holders = _holders.tensors = {}
    tensor = holders.get(slot)
    if tensor is None:
        tensor = holders[slot] = paddle.empty([1], dtype="float32")
    if not (array.flags.c_contiguous and array.flags.writeable):
        array = np.array(array)  # DLPack exports neither read-only nor strided
    tensor.get_tensor()._share_data_with(
        paddle.base.core.from_dlpack(array.__dlpack__())
    )
    return tensor
