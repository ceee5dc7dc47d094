"""The CPU cores this process may run on.

Apart from :mod:`structllm.model._paddle` so that the front end, which
never imports Paddle, can share cores out between engine processes too.
"""

from __future__ import annotations

import os

__all__ = ["cpu_cores"]


def cpu_cores() -> int:
    """The cores this process may run on (its affinity mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1
