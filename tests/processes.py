"""Process checks the fault tests share: is a pid alive, wait for pids to go."""

from __future__ import annotations

import time
from pathlib import Path


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, exited but not reaped, counts as gone)."""
    try:  # the state follows the command name, which may hold spaces: "(a b)"
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def wait_gone(*pids: int, timeout: float = 5.0) -> None:
    """Every pid exits within ``timeout`` seconds (polled: exits are asynchronous)."""
    deadline = time.monotonic() + timeout
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if alive(pid)]
