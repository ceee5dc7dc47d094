"""Probe `structllm serve` the way issue 18 did; print figures as JSON.

    python tests/boundary_probe.py crashers [--src DIR] [--loop asyncio|trio]
    python tests/boundary_probe.py stall    [--src DIR] [--loop ...]
    python tests/boundary_probe.py frozen   [--src DIR] [--loop ...]
    python tests/boundary_probe.py sigterm  [--src DIR] [--loop ...]
    python tests/boundary_probe.py sigkill  [--src DIR] [--loop ...] [--clients 32]
        [--runs 5]
    python tests/boundary_probe.py load     [--src DIR] [--loop ...] [--clients 1000]

``--src`` is the ``src`` directory to serve from (default: this checkout),
so the same probe measures an older tree (``git archive REV src | tar -x``)
for before/after figures. ``nox -s load`` runs ``load`` on both loops.
Not a pytest module (no ``test_`` prefix): it takes minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from structllm.testing.sse import aiter_data, data_events, request_bytes, stream_once

HERE = Path(__file__).resolve().parent.parent / "src"
#: the model to serve: "tiny-random" (byte tokenizer) or a directory (--model)
MODEL = ["tiny-random"]
#: more `structllm serve` arguments (--serve-arg)
EXTRA: list[str] = []
ENGINE = ["--max-model-len", "2048", "--num-blocks", "1024", "--max-num-seqs", "64"]


@contextmanager
def serve(
    src: Path, loop: str, *extra: str
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    env = {**os.environ}
    env["PYTHONPATH"] = str(src) + os.pathsep + os.environ.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "structllm.cli", "serve", MODEL[0], "--port", "0"]
    proc = subprocess.Popen(
        [*cmd, "--loop", loop, *ENGINE, *EXTRA, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    url = None
    while url is None:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"server exited with {proc.wait()}")
        m = re.search(r"serving .* on (http://\S+)", line)
        url = m.group(1) if m else None
    try:
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        proc.stdout.close()


def worker_pid(parent: int) -> int:
    for task in os.listdir(f"/proc/{parent}/task"):
        try:
            kids = Path(f"/proc/{parent}/task/{task}/children").read_text().split()
        except FileNotFoundError:
            continue
        if kids:
            return int(kids[0])
    raise RuntimeError("no worker process")


CHAT = [{"role": "user", "content": "hi"}]
S = "\ud800"
CRASHERS: dict[str, tuple[str, dict[str, Any]]] = {
    "max_tokens=2**64": ("/v1/completions", {"prompt": "x", "max_tokens": 2**64}),
    "max_completion_tokens=2**64": (
        "/v1/chat/completions",
        {"messages": CHAT, "max_completion_tokens": 2**64},
    ),
    "top_k=2**64": ("/v1/completions", {"prompt": "x", "top_k": 2**64}),
    "stop_token_ids=[2**64]": (
        "/v1/completions",
        {"prompt": "x", "stop_token_ids": [2**64]},
    ),
    "stop=[surrogate]": ("/v1/completions", {"prompt": "x", "stop": [S]}),
    "prompt=surrogate": ("/v1/completions", {"prompt": S}),
    "content=surrogate": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": S}]},
    ),
    "role=surrogate": (
        "/v1/chat/completions",
        {"messages": [{"role": S, "content": "x"}]},
    ),
}


def crashers(src: Path, loop: str) -> dict[str, Any]:
    """Each crasher against a fresh server, with a long stream running."""
    results = {}
    for name, (path, body) in CRASHERS.items():
        with serve(src, loop) as (url, proc):
            long = {"prompt": "x", "max_tokens": 2000, "ignore_eos": True}
            with httpx.stream(
                "POST", f"{url}/v1/completions", json={**long, "stream": True}
            ) as s:
                lines = s.iter_lines()
                next(lines)
                try:
                    r = httpx.post(
                        f"{url}{path}",
                        content=json.dumps(body),
                        headers={"content-type": "application/json"},
                        timeout=30,
                    )
                except httpx.HTTPError as exc:
                    r = httpx.Response(599, text=type(exc).__name__)
                try:
                    ct = r.headers.get("content-type", "")
                    shaped = "json" in ct and "error" in r.json()
                except ValueError:
                    shaped = False
                events = []
                try:
                    events = data_events(lines)
                except httpx.HTTPError as exc:  # cut without a proper end
                    events.append(f"<{type(exc).__name__}>")
            time.sleep(6)
            results[name] = {
                "status": r.status_code,
                "openai_body": shaped,
                "param": r.json()["error"].get("param") if shaped else None,
                "stream_ended_with_done": events[-1:] == ["[DONE]"],
                "stream_error_event": any('"error"' in e for e in events),
                "server_exit_code": proc.poll(),
            }
    return results


def stall(src: Path, loop: str) -> dict[str, Any]:
    """Worst /health latency while a 5 MB prompt is posted."""
    with serve(src, loop) as (url, _):

        async def main() -> dict[str, Any]:
            worst = 0.0
            async with httpx.AsyncClient(base_url=url, timeout=120) as ac:
                started = time.monotonic()
                big = asyncio.ensure_future(
                    ac.post("/v1/completions", json={"prompt": "a" * 5_000_000})
                )
                while not big.done():
                    t = time.monotonic()
                    await ac.get("/health")
                    worst = max(worst, time.monotonic() - t)
                    await asyncio.sleep(0.02)
                r = await big
                return {
                    "big_status": r.status_code,
                    "big_seconds": round(time.monotonic() - started, 3),
                    "worst_health_latency_s": round(worst, 3),
                }

        return asyncio.run(main())


def frozen(src: Path, loop: str) -> dict[str, Any]:
    """Seconds from SIGSTOP of the worker to /health 503 (capped at 15)."""
    with serve(src, loop) as (url, proc):
        pid = worker_pid(proc.pid)
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        try:
            while time.monotonic() - start < 15:
                if httpx.get(f"{url}/health").status_code == 503:
                    break
                time.sleep(0.05)
            return {"seconds_to_503": round(time.monotonic() - start, 2)}
        finally:
            os.kill(pid, signal.SIGCONT)


def sigterm(src: Path, loop: str) -> dict[str, Any]:
    """A stream longer than the grace, then SIGTERM: how does it end?"""
    with serve(src, loop, "--graceful-timeout", "1.5") as (url, proc):
        body = {"prompt": "x", "n": 8, "max_tokens": 2000, "ignore_eos": True}
        events: list[str] = []
        probe: dict[str, Any] = {}

        async def main() -> None:
            first = asyncio.Event()
            async with httpx.AsyncClient(base_url=url, timeout=60) as ac:

                async def stream() -> None:
                    try:
                        async with ac.stream(
                            "POST", "/v1/completions", json={**body, "stream": True}
                        ) as r:
                            async for data in aiter_data(r):
                                events.append(data)
                                first.set()
                    except httpx.HTTPError as exc:
                        events.append(f"<{type(exc).__name__}>")

                task = asyncio.ensure_future(stream())
                await first.wait()
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.5)
                try:
                    async with httpx.AsyncClient(base_url=url, timeout=5) as fresh:
                        r = await fresh.post("/v1/completions", json={"prompt": "y"})
                        probe["new_request_during_drain"] = r.status_code
                except httpx.HTTPError as exc:
                    probe["new_request_during_drain"] = type(exc).__name__
                await task

        asyncio.run(main())
        return {
            **probe,
            "last_event": events[-1][:80] if events else None,
            "error_event_before_done": len(events) > 1 and '"error"' in events[-2],
            "exit_code": proc.wait(timeout=30),
        }


def sigkill(src: Path, loop: str, clients: int, runs: int) -> dict[str, Any]:
    """SIGKILL the worker under ``clients`` streams, ``runs`` times (one server).

    Per run: how each stream ended, seconds from the kill to the first 503
    of ``/health`` and to its first 200 after that (the recovery), and
    whether a request then succeeds. Restarts are allowed without limit.
    """
    body = {"prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    args = ["--max-restarts", str(runs), "--restart-window", "1"]
    with serve(src, loop, *args) as (url, proc):

        async def one() -> dict[str, Any]:
            outcomes: Counter[str] = Counter()
            started: list[int] = []
            go = asyncio.Event()
            limits = httpx.Limits(max_connections=clients + 8)
            async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as ac:

                async def stream() -> None:
                    events: list[str] = []
                    try:
                        async with ac.stream("POST", "/v1/completions", json=body) as r:
                            if r.status_code != 200:
                                outcomes[f"status:{r.status_code}"] += 1
                                return
                            async for data in aiter_data(r):
                                if not events:
                                    started.append(1)
                                    if len(started) == clients:
                                        go.set()
                                events.append(data)
                    except httpx.HTTPError as exc:
                        outcomes[f"cut:{type(exc).__name__}"] += 1
                        return
                    error = len(events) > 1 and '"error"' in events[-2]
                    code = json.loads(events[-2])["error"]["code"] if error else 0
                    done = events[-1:] == ["[DONE]"]
                    outcomes[f"event:{code}" if error and done else "other"] += 1

                tasks = [asyncio.ensure_future(stream()) for _ in range(clients)]
                await asyncio.wait_for(go.wait(), 120)
                os.kill(worker_pid(proc.pid), signal.SIGKILL)
                killed = time.monotonic()
                down = up = None
                while up is None and time.monotonic() - killed < 120:
                    status = (await ac.get("/health")).status_code
                    now = round(time.monotonic() - killed, 2)
                    if status == 503 and down is None:
                        down = now
                    elif status == 200 and down is not None:
                        up = now
                    await asyncio.sleep(0.01)
                try:
                    await asyncio.wait_for(asyncio.gather(*tasks), 30)
                    ended = True
                except TimeoutError:
                    ended = False
                r = await ac.post(
                    "/v1/completions", json={"prompt": "hi", "max_tokens": 4}
                )
                return {
                    "outcomes": dict(outcomes),
                    "all_streams_ended": ended,
                    "to_503_s": down,
                    "recovery_s": up,
                    "next_request": r.status_code,
                }

        results = [asyncio.run(one()) for _ in range(runs)]
        recovery = sorted(r["recovery_s"] for r in results if r["recovery_s"])
        return {
            "clients": clients,
            "runs": results,
            "recovery_s": {
                "min": recovery[0] if recovery else None,
                "median": recovery[len(recovery) // 2] if recovery else None,
                "max": recovery[-1] if recovery else None,
            },
            "server_alive": proc.poll() is None,
        }


def load(src: Path, loop: str, clients: int) -> dict[str, Any]:
    """``clients`` streaming requests opened at once over raw sockets."""
    with serve(src, loop) as (url, _):
        host, port = url.removeprefix("http://").split(":")
        request = request_bytes(
            {"prompt": "hi", "max_tokens": 8, "ignore_eos": True, "stream": True}
        )

        async def one(go: asyncio.Event) -> str:
            await go.wait()
            return await stream_once(host, int(port), request, give_up_after=300)

        async def main() -> tuple[Counter[str], float]:
            go = asyncio.Event()
            tasks = [asyncio.ensure_future(one(go)) for _ in range(clients)]
            await asyncio.sleep(0.2)
            start = time.monotonic()
            go.set()
            results = await asyncio.gather(*tasks)
            return Counter(results), time.monotonic() - start

        counts, seconds = asyncio.run(main())
        return {
            "clients": clients,
            "outcomes": dict(counts),
            "resets": counts["error:ConnectionResetError"]
            + counts["error:ConnectionRefusedError"],
            "seconds": round(seconds, 1),
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "probe", choices=["crashers", "stall", "frozen", "sigterm", "sigkill", "load"]
    )
    parser.add_argument("--src", type=Path, default=HERE)
    parser.add_argument("--loop", default="asyncio")
    parser.add_argument(
        "--clients", type=int, help="load: 1000 by default; sigkill: 32"
    )
    parser.add_argument("--runs", type=int, default=5, help="sigkill: kills per loop")
    parser.add_argument(
        "--model", default="tiny-random", help="e.g. a `structllm make-tiny-model` dir"
    )
    parser.add_argument("--serve-arg", action="append", default=[])
    parser.add_argument("--fail-on-reset", action="store_true")
    ns = parser.parse_args()
    MODEL[0] = ns.model
    EXTRA.extend(ns.serve_arg)
    if ns.probe == "load":
        result = load(ns.src, ns.loop, ns.clients or 1000)
    elif ns.probe == "sigkill":
        result = sigkill(ns.src, ns.loop, ns.clients or 32, ns.runs)
    else:
        result = globals()[ns.probe](ns.src, ns.loop)
    print(json.dumps({"probe": ns.probe, "loop": ns.loop, **result}, indent=1))
    if ns.fail_on_reset and result.get("resets"):
        sys.exit(f"{result['resets']} connections reset or refused")


if __name__ == "__main__":
    main()
