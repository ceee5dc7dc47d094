"""A ``--connect`` follower's patience with a silent rank 0 (``Silence``).

Between steps, the heartbeat timeout after the last word; mid-step,
``step_timeout`` plus the heartbeat timeout after the step began (as rank
0's front end waits for rank 0's steps), however rank 0's pings come; the
end of the follower's forward is word from rank 0. The watchdog ends a
follower past its deadline, saying why, and the SIGALRM does when a call
holds the GIL (the end-to-end case is
``test_tensor_parallel_connect.py::test_a_step_longer_than_the_heartbeat_timeout_keeps_the_follower``).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from structllm.engine.rank_group.follower import Silence


def test_between_steps_the_heartbeat_timeout_after_the_last_word() -> None:
    s = Silence(timeout=10.0, step_timeout=300.0, heard_at=100.0)
    assert s.deadline() == 110.0
    s.heard(105.0)  # a ping
    assert s.deadline() == 115.0
    s.heard(104.0)  # a reader late to say so never moves it back
    assert s.deadline() == 115.0
    assert s.why(116.0) == "no word from rank 0 for 11s (heartbeat timeout 10s)"


def test_mid_step_step_timeout_plus_the_timeout_after_the_step_began() -> None:
    s = Silence(timeout=10.0, step_timeout=300.0, heard_at=100.0)
    s.begin_step(101.0)
    assert s.deadline() == 101.0 + 300.0 + 10.0
    s.heard(200.0)  # pings through the step change nothing ...
    assert s.deadline() == 411.0
    s.heard(405.0)  # ... unless they outlast it
    assert s.deadline() == 415.0
    assert s.why(416.0) == (
        "no word from rank 0 for 11s, 315s into a step "
        "(step_timeout 300s + heartbeat timeout 10s)"
    )


def test_the_end_of_a_step_is_word_from_rank_0() -> None:
    """Its all-reduces met rank 0's; rank 0 may be sampling still, and the
    wait is the heartbeat timeout again, from then."""
    s = Silence(timeout=10.0, step_timeout=300.0, heard_at=100.0)
    s.begin_step(100.0)
    s.end_step(250.0)
    assert s.step_began is None
    assert s.deadline() == 260.0


def test_without_a_step_timeout_a_step_waits_only_the_timeout() -> None:
    s = Silence(timeout=10.0, step_timeout=None, heard_at=100.0)
    s.begin_step(100.0)
    assert s.deadline() == 110.0
    assert "heartbeat timeout 10s" in s.why(111.0)


_WEDGED = """
import ctypes, threading, time
from structllm.engine.rank_group.follower import Silence, _Watch

watch = _Watch(Silence(timeout=0.3, step_timeout=0.6, heard_at=time.monotonic()))
threading.Thread(target=watch.run, daemon=True).start()
with watch.step():
    print(time.monotonic(), flush=True)  # the step began
    {step}
"""


@pytest.mark.parametrize(
    ("step", "code", "after"),
    [
        # blocked in a collective: the watchdog ends it, saying why
        ("time.sleep(60)", 1, 0.9),
        # a call holds the GIL: the alarm, its grace after the deadline
        ("ctypes.PyDLL(None).sleep(60)", -signal.SIGALRM, 0.9 + 1.0),
    ],
    ids=["watchdog", "alarm"],
)
def test_a_follower_ends_itself_when_rank_0_is_silent_past_its_step(
    step: str, code: int, after: float
) -> None:
    """Mid-step, rank 0 silent (its machine froze): the follower ends
    ``step_timeout + timeout`` after the step began (0.9 s here), or the
    alarm's grace (1 s) later when a call holds the GIL."""
    script = textwrap.dedent(_WEDGED).format(step=step)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, timeout=60
    )
    took = time.monotonic() - float(done.stdout)  # CLOCK_MONOTONIC: one per host
    assert done.returncode == code, done.stderr.decode()
    assert after <= took < after + 5.0  # a loaded machine
    if code == 1:
        assert (
            "(step_timeout 0.6s + heartbeat timeout 0.3s); exiting"
            in done.stderr.decode()
        )
