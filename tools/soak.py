"""Soak `structllm serve`: many streams at once, then clients that hang up.

    python tools/soak.py [--loop asyncio] [--loop trio] [--streams 1000]
        [--hangups 2000] [--hangup-concurrency 250] [--serve-arg=--flag ...]

For each loop, against ``structllm serve tiny-random`` (core process
included):

1. ``--streams`` streaming completions opened at once over raw sockets;
   each must end with ``data: [DONE]`` or be a 503 with an OpenAI error
   body (a clean refusal). Anything else (reset, truncated stream, other
   status) is a failure.
2. ``--hangups`` requests (streaming and not, ``--hangup-concurrency`` at
   a time), each cut by its client at a random point: in the headers, in
   the body, before the first byte of the answer, or after a random number
   of bytes of it; half close the socket, half abort it (RST).
3. Then: within 30 s, 0 requests running, 0 waiting and every KV block free
   (``/metrics``); a good request still succeeds; the RSS of the server
   plus its engine process within 10% of the baseline.

The baseline is taken after a warm-up, so that what the processes allocate
once and keep does not count: 64 streams, ``--warmup`` hang-ups, and the
largest batches the soak can make (64 requests of 200-character prompts and
200 tokens at once: steps of ``--max-num-batched-tokens`` prompt tokens, a
full KV cache, preemptions), ``--warmup-rounds`` times. The allocators
keep freed memory. ``--hangup-rounds N`` repeats step 2 and records the
RSS of each process after each round: growth that stops is the allocator,
growth per round a leak (``plateau_pct``: the change over the second half
of the rounds). ``tools/core_memory.py`` measures the engine core alone
under mixed requests and attributes its growth, cache by cache.

Prints one JSON object per loop; exits 1 if any check failed. ``nox -s
soak`` runs it on both loops.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
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

from structllm.bench.serve_targets import tree_memory
from structllm.testing.sse import request_bytes, stream_once

ENGINE = ["--max-model-len", "2048", "--num-blocks", "1024", "--max-num-seqs", "64"]


#: ``--trace-memory``: a ``sitecustomize`` for the server and its engine
#: process (they inherit PYTHONPATH): tracemalloc from the start, and on
#: SIGUSR1 a snapshot and the count of live objects per type into the folder
TRACE_HOOK = """\
import collections, gc, json, os, signal, tracemalloc

_DIR = os.environ["STRUCTLLM_SOAK_TRACE"]
tracemalloc.start(8)
_count = [0]


def _dump(signum, frame):
    _count[0] += 1
    name = f"{_DIR}/{os.getpid()}-{_count[0]}"
    tracemalloc.take_snapshot().dump(name + ".tracemalloc")
    types = collections.Counter(type(o).__qualname__ for o in gc.get_objects())
    with open(name + ".tmp", "w") as f:
        json.dump(types, f)
    os.replace(name + ".tmp", name + ".types.json")


signal.signal(signal.SIGUSR1, _dump)
"""


@contextmanager
def serve(
    loop: str, extra: list[str], log: Path | None, trace: Path | None = None
) -> Iterator[tuple[str, int]]:
    cmd = [sys.executable, "-m", "structllm.cli", "serve", "tiny-random"]
    cmd += ["--port", "0", "--loop", loop, "--no-show-progress", *ENGINE, *extra]
    err = subprocess.DEVNULL if log is None else log.open("w")
    env = dict(os.environ)
    if trace is not None:
        trace.mkdir(parents=True, exist_ok=True)
        (trace / "sitecustomize.py").write_text(TRACE_HOOK)
        env["STRUCTLLM_SOAK_TRACE"] = str(trace)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(trace), env.get("PYTHONPATH")) if p
        )
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    assert proc.stdout is not None
    url = None
    while url is None:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"server exited with {proc.wait()}")
        m = re.search(r"serving .* on (http://\S+)", line)
        url = m.group(1) if m else None
    try:
        yield url, proc.pid
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        path = Path(f"/proc/{pid}/task/{task}/children")
        if path.exists():
            kids += [int(p) for p in path.read_text().split()]
    return kids


def trace_dump(trace: Path, pid: int) -> dict[str, Path]:
    """Have the server ``pid`` and its engine dump their memory (``--trace-memory``).

    Returns, per process, the snapshot's path without its extensions.
    """
    out = {}
    for name, p in (("server", pid), *(("engine", k) for k in children(pid))):
        before = set(trace.glob(f"{p}-*.types.json"))
        os.kill(p, signal.SIGUSR1)
        deadline = time.monotonic() + 300
        while not (new := set(trace.glob(f"{p}-*.types.json")) - before):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} ({p}) wrote no memory snapshot")
            time.sleep(0.2)
        out[name] = Path(str(new.pop()).removesuffix(".types.json"))
    return out


def trace_compare(first: Path, last: Path, top: int = 12) -> dict[str, Any]:
    """Python allocations and live objects that grew from ``first`` to ``last``."""
    import tracemalloc

    a = tracemalloc.Snapshot.load(f"{first}.tracemalloc")
    b = tracemalloc.Snapshot.load(f"{last}.tracemalloc")
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__)]
    a, b = a.filter_traces(ignore), b.filter_traces(ignore)
    diff = b.compare_to(a, "traceback")
    grew = [d for d in diff if d.size_diff > 0][:top]
    types_a = Counter(json.loads(Path(f"{first}.types.json").read_text()))
    types_b = Counter(json.loads(Path(f"{last}.types.json").read_text()))
    more = Counter({k: types_b[k] - types_a[k] for k in types_b})
    return {
        "traced_mib": [
            round(sum(t.size for t in a.traces) / 2**20, 2),
            round(sum(t.size for t in b.traces) / 2**20, 2),
        ],
        "grew": [
            {
                "kib": round(d.size_diff / 1024, 1),
                "blocks": d.count_diff,
                "at": [f"{f.filename}:{f.lineno}" for f in d.traceback][-4:],
            }
            for d in grew
        ],
        "objects_grew": dict((+more).most_common(top)),
    }


def rss_mib(pid: int) -> dict[str, float]:
    """Resident memory of the server ``pid`` and of its engine process, MiB."""
    tree = tree_memory(pid)  # the server first, then its descendants
    server = sum(m.rss_bytes for m in tree[:1]) / 2**20
    engine = sum(m.rss_bytes for m in tree[1:]) / 2**20
    return {
        "server": round(server, 1),
        "engine": round(engine, 1),
        "total": round(server + engine, 1),
    }


def gauges(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("structllm_") and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def streams(host: str, port: int, count: int) -> Counter[str]:
    request = request_bytes(
        {"prompt": "hi", "max_tokens": 16, "ignore_eos": True, "stream": True}
    )
    go = asyncio.Event()

    async def one() -> str:
        await go.wait()
        return await stream_once(host, port, request)

    tasks = [asyncio.ensure_future(one()) for _ in range(count)]
    await asyncio.sleep(0.2)
    go.set()
    return Counter(await asyncio.gather(*tasks))


def complete(data: bytes) -> bool:
    """``data`` holds a whole answer (its Content-Length, or ``[DONE]``)."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    m = re.search(rb"(?i)content-length: *(\d+)", head)
    return b"data: [DONE]" in body or (m is not None and len(body) >= int(m[1]))


async def hang_up(host: str, port: int, rng: random.Random) -> str:
    stream = rng.random() < 0.5
    body = {"prompt": "x" * rng.randint(1, 200), "max_tokens": rng.randint(1, 200)}
    request = request_bytes({**body, "ignore_eos": True, "stream": stream})
    head = request.index(b"\r\n\r\n") + 4
    where = rng.choice(["headers", "body", "before-answer", "in-answer"])
    cut = {
        "headers": rng.randint(1, head - 1),
        "body": rng.randint(head, len(request) - 1),
    }.get(where, len(request))
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(request[:cut])
        await writer.drain()
        if where == "before-answer":
            await asyncio.sleep(rng.random() * 0.05)
        elif where == "in-answer":
            want = rng.randint(1, 4000)
            data = b""
            async with asyncio.timeout(600):
                # to `want` bytes or the end of the answer (under trio,
                # hypercorn keeps the connection open after it)
                while len(data) < want and not complete(data):
                    if not (chunk := await reader.read(want - len(data))):
                        break
                    data += chunk
        if rng.random() < 0.5:
            writer.transport.abort()  # RST
        else:
            writer.close()
    except (ConnectionError, OSError) as exc:
        return f"{where}:error:{type(exc).__name__}"
    return where


async def hang_ups(
    host: str, port: int, count: int, concurrency: int, seed: int = 0
) -> Counter[str]:
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency)

    async def one(seed: int) -> str:
        async with gate:
            return await hang_up(host, port, random.Random(seed))

    seeds = [rng.randrange(2**32) for _ in range(count)]
    return Counter(await asyncio.gather(*(one(s) for s in seeds)))


def wait_idle(url: str, seconds: float = 30) -> tuple[dict[str, float], float]:
    start = time.monotonic()
    while True:
        g = gauges(url)
        idle = (
            g["structllm_num_requests_running"] == 0
            and g["structllm_num_requests_waiting"] == 0
            and g["structllm_kv_cache_usage_perc"] == 0
        )
        if idle or time.monotonic() - start > seconds:
            return g, round(time.monotonic() - start, 2)
        time.sleep(0.2)


async def largest_batches(url: str, count: int = 64) -> Counter[str]:
    """``count`` long prompts generating 200 tokens each, all at once."""
    body = {"prompt": "x" * 200, "max_tokens": 200, "ignore_eos": True}
    limits = httpx.Limits(max_connections=count)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as ac:

        async def one() -> str:
            return str((await ac.post("/v1/completions", json=body)).status_code)

        return Counter(await asyncio.gather(*(one() for _ in range(count))))


def soak(loop: str, ns: argparse.Namespace) -> dict[str, Any]:
    log = None if ns.server_log is None else Path(f"{ns.server_log}.{loop}")
    trace = None if ns.trace_memory is None else Path(ns.trace_memory) / loop
    with serve(loop, ns.serve_arg, log, trace) as (url, pid):
        host, port = url.removeprefix("http://").split(":")
        cold = rss_mib(pid)
        # warm-up: what the processes allocate once and keep (see above)
        warmups = []
        for r in range(ns.warmup_rounds):
            asyncio.run(streams(host, int(port), 64))
            asyncio.run(
                hang_ups(host, int(port), ns.warmup, ns.hangup_concurrency, 1 + r)
            )
            asyncio.run(largest_batches(url))
            wait_idle(url)
            warmups.append(rss_mib(pid))
            print(f"{loop}: warm-up round {r + 1}: {warmups[-1]}", file=sys.stderr)
        warm = rss_mib(pid)
        t = time.monotonic()
        phase1 = asyncio.run(streams(host, int(port), ns.streams))
        s1 = round(time.monotonic() - t, 1)
        after1 = rss_mib(pid)
        t = time.monotonic()
        phase2: Counter[str] = Counter()
        rounds = []
        dumps = []
        for r in range(ns.hangup_rounds):
            phase2 += asyncio.run(
                hang_ups(host, int(port), ns.hangups, ns.hangup_concurrency, 100 + r)
            )
            g, waited = wait_idle(url)
            rounds.append(rss_mib(pid))
            print(f"{loop}: hang-up round {r + 1}: {rounds[-1]}", file=sys.stderr)
            if trace is not None and r in (0, ns.hangup_rounds - 1):
                dumps.append(trace_dump(trace, pid))
        s2 = round(time.monotonic() - t, 1)
        good = httpx.post(
            f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60
        )
        end = rss_mib(pid)
        bad1 = {k: v for k, v in phase1.items() if k not in ("200-done", "503-clean")}
        checks = {
            "streams_complete_or_clean_503": not bad1,
            "idle_after": g["structllm_num_requests_running"] == 0
            and g["structllm_num_requests_waiting"] == 0,
            "kv_blocks_all_free": g["structllm_kv_cache_usage_perc"] == 0,
            "still_serves": good.status_code == 200,
            "rss_within_10pct": end["total"] <= warm["total"] * 1.10,
        }
        traced = {}
        if len(dumps) == 2:  # from after the first round to after the last
            traced = {k: trace_compare(dumps[0][k], dumps[1][k]) for k in dumps[0]}
        return {
            "loop": loop,
            **({"traced": traced} if traced else {}),
            "streams": {"outcomes": dict(phase1), "seconds": s1},
            "hangups": {"outcomes": dict(phase2), "seconds": s2},
            "aborted_in_engine": g.get(
                'structllm_requests_total{finished_reason="abort"}', 0
            ),
            "idle_after_s": waited,
            "rss_mib": {
                "cold": cold,
                "after_each_warmup_round": warmups,
                "warm": warm,
                "after_streams": after1,
                "after_each_hangup_round": rounds,
                "end": end,
            },
            "rss_change_pct": round(100 * (end["total"] / warm["total"] - 1), 1),
            "plateau_pct": plateau_pct(rounds),
            "checks": checks,
            "ok": all(checks.values()),
        }


def plateau_pct(rounds: list[dict[str, float]]) -> dict[str, float] | None:
    """Per process, the RSS change from the middle round to the last, %."""
    if len(rounds) < 3:
        return None
    mid, last = rounds[(len(rounds) - 1) // 2], rounds[-1]
    return {k: round(100 * (last[k] / mid[k] - 1), 1) for k in last}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loop", action="append", choices=["asyncio", "trio"])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--hangups", type=int, default=2000)
    parser.add_argument("--hangup-concurrency", type=int, default=250)
    parser.add_argument("--hangup-rounds", type=int, default=1)
    parser.add_argument(
        "--warmup", type=int, default=500, help="hang-ups per warm-up round"
    )
    parser.add_argument(
        "--warmup-rounds",
        type=int,
        default=1,
        help="warm-up rounds before the RSS baseline",
    )
    parser.add_argument("--serve-arg", action="append", default=[])
    parser.add_argument(
        "--trace-memory",
        metavar="DIR",
        help="tracemalloc in the server and engine (slow): compare the Python "
        "allocations and objects per type after the first and the last "
        "hang-up round (snapshots in DIR/LOOP)",
    )
    parser.add_argument(
        "--server-log", help="write the server's stderr to PATH.LOOP (the access log)"
    )
    ns = parser.parse_args()
    failed = False
    for loop in ns.loop or ["asyncio"]:
        result = soak(loop, ns)
        print(json.dumps(result, indent=1), flush=True)
        failed |= not result["ok"]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
