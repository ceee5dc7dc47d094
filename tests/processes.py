"""What the fault tests share: is a pid alive, wait for pids to go, stream
until the engine dies."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from structllm.engine.frontend.async_llm import AsyncLLM
from structllm.errors import EngineDeadError
from structllm.params import SamplingParams

#: a stream long enough to be cut by whatever fault a test injects
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


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


async def consume_until_dead(llm: AsyncLLM) -> tuple[EngineDeadError, float]:
    """Stream until the engine dies; return the error and when it arrived."""
    with pytest.raises(EngineDeadError) as e:
        async with llm.stream("Hello", LONG) as s:
            async for _ in s:
                pass
    return e.value, time.monotonic()
