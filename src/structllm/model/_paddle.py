"""Import Paddle once, quietly, and configure its CPU threads."""

from __future__ import annotations

import functools
import os
import threading
import warnings

import numpy as np

from structllm._cores import cpu_cores
from structllm.model import kernels

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
    "eager_mode_here",
    "host_tensor",
    "paddle",
    "set_num_threads",
]


def eager_mode_here() -> None:
    """Paddle's eager (dynamic-graph) mode in the calling thread.

    Paddle keeps its mode per thread, and when it was first imported in a
    thread other than the main one, threads that touch it later start in
    static-graph mode, where the model's ops build a program instead of
    running. The front end never imports Paddle, so an inline core imports
    it in its own thread, and the next inline core (a restart) would start
    in static mode.
    """
    if not paddle.in_dynamic_mode():
        paddle.disable_static()


def default_num_threads() -> int:
    """CPU threads for Paddle's math: the cores this process may run on."""
    return cpu_cores()


def set_num_threads(n: int | None = None) -> None:
    """Paddle runs CPU math on one thread unless told otherwise; the
    compiled attention kernels take the same number."""
    n = n or default_num_threads()
    kernels.set_num_threads(n)  # first: see its docstring
    paddle.base.core.set_num_threads(n)


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


_holder = threading.local()


def host_tensor(array: np.ndarray) -> paddle.Tensor:
    """``array`` as a CPU Paddle tensor sharing its memory, without a leak.

    Paddle 3.3's eager ``Tensor`` constructor leaks a Python list on every
    call (``paddle.to_tensor`` and ``paddle.from_dlpack`` included: about
    100 bytes each, found by the soak in docs/operations.md), and a step
    builds several host tensors per layer. Instead, one eager tensor per
    thread is re-pointed at ``array`` (with a trailing axis of 1) and a
    ``squeeze`` op makes the tensor returned: an independent view that
    keeps ``array``'s memory alive, built in C++ with no constructor call.
    On an accelerator the array is copied there by ``paddle.to_tensor``.
    """
    if paddle.get_device() != "cpu":
        return paddle.to_tensor(array)
    holder: paddle.Tensor | None = getattr(_holder, "tensor", None)
    if holder is None:
        holder = _holder.tensor = paddle.empty([1], dtype="float32")
    if not (array.flags.c_contiguous and array.flags.writeable):
        array = np.array(array)  # DLPack exports neither read-only nor strided
    holder.get_tensor()._share_data_with(
        paddle.base.core.from_dlpack(array[..., None].__dlpack__())
    )
    return holder.squeeze(-1)
