"""An idle engine costs nothing: no polling, no busy loops."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import anyio
import pytest

from structllm import AsyncLLM, SamplingParams

pytestmark = pytest.mark.anyio


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


async def settled(pid: int) -> None:
    """Until the worker's CPU time stops moving (its math threads' spin-wait
    after a step has ended): read at the clock tick's resolution."""
    tick = 1 / os.sysconf("SC_CLK_TCK")
    with anyio.fail_after(10):
        before = _cpu_seconds(pid)
        while True:
            await anyio.sleep(10 * tick)  # a sampling interval, not a guess
            now = _cpu_seconds(pid)
            if now == before:
                return
            before = now


async def test_idle_cpu_is_negligible() -> None:
    async with AsyncLLM.open(
        "tiny-random", show_progress=False, heartbeat_interval=0.5
    ) as llm:
        await llm.complete("warm", SamplingParams(max_tokens=4))
        pid = llm.statistics().core_pid
        assert pid is not None
        await settled(pid)  # math threads may spin briefly after work
        front0 = resource.getrusage(resource.RUSAGE_SELF)
        worker0 = _cpu_seconds(pid)
        start = time.monotonic()
        await anyio.sleep(2.0)
        wall = time.monotonic() - start
        front1 = resource.getrusage(resource.RUSAGE_SELF)
        front = (front1.ru_utime + front1.ru_stime) - (
            front0.ru_utime + front0.ru_stime
        )
        worker = _cpu_seconds(pid) - worker0
    # measured ~0.1% each; 5% of a core leaves room for a noisy machine
    assert front / wall < 0.05, f"front end used {100 * front / wall:.1f}% of a core"
    assert worker / wall < 0.05, f"worker used {100 * worker / wall:.1f}% of a core"
