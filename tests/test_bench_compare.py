"""``structllm bench serve --server/--launch``: one workload, several servers.

Running targets are the fake SSE servers of ``test_bench_serve``; launched
ones are real commands: ``structllm serve tiny``, and small Python programs
that fail to start in the ways a server can.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from structllm.bench.lora import write_random_adapters
from structllm.bench.serve import ServeConfig
from structllm.bench.serve_client import open_client
from structllm.bench.serve_compare import FIGURES, Comparison, Run, run_comparison
from structllm.bench.serve_results import (
    BenchmarkResult,
    RequestResult,
    SpecDecodeCounts,
    summarize,
)
from structllm.bench.serve_targets import (
    LaunchError,
    MemoryReport,
    ProcessMemory,
    Target,
    open_target,
    process_tree,
    tree_memory,
)
from tests.processes import alive, wait_gone
from tests.test_bench_serve import open_fake_server, parse, spec_metrics

WORKLOAD = {"num_prompts": 6, "input_len": (4, 12), "output_len": (3, 6)}
METRICS = """\
# TYPE structllm_kv_cache_bytes gauge
structllm_kv_cache_bytes 1048576.0
# TYPE structllm_engine_core_peak_rss_bytes gauge
structllm_engine_core_peak_rss_bytes 3145728.0
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 2097152.0
"""


# -- targets --------------------------------------------------------------------


def test_targets_parse_and_refuse_what_cannot_work() -> None:
    assert Target.parse("a=http://h:1/", launch=False) == Target("a", url="http://h:1")
    cmd = Target.parse("b=serve --port {port}", launch=True)
    assert cmd == Target("b", command="serve --port {port}")
    for text, launch, match in [
        ("http://h:1", False, "NAME=URL"),
        ("=http://h:1", False, "needs a name"),
        ("a=", True, "NAME=COMMAND"),
        ("a=h:1", False, "not an http URL"),
        ("a=serve --port 8000", True, r"must contain \{port\}"),
        ("a=serve '{port}", True, "quotation"),
    ]:
        with pytest.raises(ValueError, match=match):
            Target.parse(text, launch=launch)


def write_proc(root: Path, pid: int, ppid: int, name: str, hwm: int, rss: int) -> None:
    d = root / str(pid)
    d.mkdir()
    # a command name with spaces and parentheses, as the kernel allows
    (d / "stat").write_text(f"{pid} ({name} (x) y) S {ppid} 1 1 0")
    (d / "status").write_text(
        f"Name:\t{name}\nVmHWM:\t  {hwm} kB\nVmRSS:\t  {rss} kB\nThreads:\t1\n"
    )


def test_process_tree_memory_from_proc(tmp_path: Path) -> None:
    write_proc(tmp_path, 10, 1, "server", 100, 90)
    write_proc(tmp_path, 12, 10, "core", 300, 250)
    write_proc(tmp_path, 15, 12, "rank", 50, 50)
    write_proc(tmp_path, 11, 1, "other", 999, 999)
    assert process_tree(10, tmp_path) == [10, 12, 15]
    assert process_tree(12, tmp_path) == [12, 15]
    assert process_tree(99, tmp_path) == []
    mem = MemoryReport(tree_memory(10, tmp_path))
    assert [p.name for p in mem.processes] == ["server", "core", "rank"]
    assert mem.peak_rss_bytes == 450 * 1024 and mem.rss_bytes == 390 * 1024
    assert MemoryReport().peak_rss_bytes is None


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_tree_memory_of_a_real_process() -> None:
    (me, *_) = tree_memory(os.getpid())
    assert me.pid == os.getpid() and me.peak_rss_bytes >= me.rss_bytes > 10 * 2**20


# -- the comparison's figures -----------------------------------------------------


def run(target: str, round_: int, *, e2e: float, rss_mib: int | None = None) -> Run:
    """A run of 4 requests of 5 tokens each, each taking ``e2e`` seconds."""
    requests = tuple(
        RequestResult(
            index=i,
            prompt_tokens=8,
            max_tokens=5,
            send_time=0.0,
            end_time=e2e,
            chunk_times=tuple(e2e * (k + 1) / 5 for k in range(5)),
            output_tokens=5,
        )
        for i in range(4)
    )
    result = BenchmarkResult(ServeConfig(), requests, summarize(requests))
    procs = () if rss_mib is None else (ProcessMemory(1, "p", rss_mib * 2**20, 0),)
    return Run(target, round_, result, MemoryReport(procs))


def test_medians_over_rounds_and_ratios_within_rounds() -> None:
    a, b = Target("a", url="http://a"), Target("b", url="http://b")
    # the machine slows down by 2x in round 1; b is 2x faster in both rounds
    runs = (
        run("a", 0, e2e=1.0, rss_mib=100),
        run("b", 0, e2e=0.5),
        run("b", 1, e2e=1.0),
        run("a", 1, e2e=2.0, rss_mib=300),
    )
    c = Comparison((a, b), 2, runs)
    median, ratio = c.median(), c.ratio()
    assert median["a"]["output_throughput"] == pytest.approx((20 + 10) / 2)
    assert median["b"]["output_throughput"] == pytest.approx((40 + 20) / 2)
    assert median["a"]["peak_rss_mib"] == pytest.approx(200)
    assert median["b"]["peak_rss_mib"] is None and median["a"]["kv_cache_mib"] is None
    assert ratio["b"]["output_throughput"] == pytest.approx(2.0)
    assert ratio["b"]["median_e2el_ms"] == pytest.approx(0.5)
    assert ratio["a"]["median_ttft_ms"] == pytest.approx(1.0)
    assert ratio["b"]["peak_rss_mib"] is None  # unknown for b
    assert "completed" not in ratio["b"]  # counts are not compared
    table = c.format()
    assert "median of 2 rounds" in table and "Ratio to a" in table
    (row,) = [ln for ln in table.splitlines() if ln.startswith("Output token")][1:]
    assert row.split()[-2:] == ["1.00x", "2.00x"]
    assert set(median["a"]) == set(FIGURES)
    assert "Spec. decode" not in table  # neither speculated


@pytest.mark.anyio
async def test_acceptance_per_target_where_one_speculates() -> None:
    """Acceptance and proposed / accepted tokens from each server's /metrics
    over its runs; n/a for a server without the counters (llama.cpp)."""
    async with (
        open_fake_server(metrics=spec_metrics) as spec,
        open_fake_server(metrics=METRICS) as plain,
    ):
        targets = [Target("spec", url=spec.url), Target("plain", url=plain.url)]
        config = ServeConfig(**WORKLOAD)
        c = await run_comparison(config, targets, rounds=2, log=lambda _: None)
    # 6 requests a run (the warm-up's are not counted), 8 proposed and 6
    # accepted each
    assert [r.result.summary.spec_decode for r in c.runs_of("spec")] == [
        SpecDecodeCounts(12, 48, 36)
    ] * 2
    median = c.median()
    assert median["spec"]["spec_decode_acceptance_rate"] == pytest.approx(0.75)
    assert median["plain"]["spec_decode_draft_tokens"] is None
    table = c.format()
    rows = {
        line[: line.index("  ")]: line.split()[-2:]
        for line in table.splitlines()
        if line.startswith("Spec. decode")
    }
    assert rows == {
        "Spec. decode acceptance rate (%)": ["75.00", "n/a"],
        "Spec. decode proposed tokens": ["48", "n/a"],
        "Spec. decode accepted tokens": ["36", "n/a"],
    }
    assert "spec_decode_draft_tokens" not in c.ratio()["spec"]  # not compared


# -- against running servers ----------------------------------------------------


@pytest.mark.anyio
async def test_every_target_gets_the_same_workload_rotating() -> None:
    log: list[str] = []
    async with (
        open_fake_server(metrics=METRICS) as one,
        open_fake_server() as two,
    ):
        targets = [Target("one", url=one.url), Target("two", url=two.url)]
        config = ServeConfig(**WORKLOAD, seed=5)
        c = await run_comparison(config, targets, rounds=2, warmup=1, log=log.append)
    starts = [line.split(":")[1].split()[0] for line in log if line.startswith("round")]
    assert starts == ["one", "two", "two", "one"]  # who goes first rotates
    for fake in (one, two):
        warm, first, warm2, second = (
            fake.bodies[:1],
            fake.bodies[1:7],
            fake.bodies[7:8],
            fake.bodies[8:],
        )
        assert len(fake.bodies) == 14
        assert [b["max_tokens"] for b in warm + warm2] == [4, 4]  # not counted
        assert first != second  # round r sends seed + r's prompts
    assert sorted(map(json.dumps, one.bodies)) == sorted(map(json.dumps, two.bodies))
    assert [r.result.config.seed for r in c.runs] == [5, 5, 6, 6]
    assert all(r.result.summary.completed == 6 for r in c.runs)
    mem = c.runs_of("one")[0].memory
    assert (mem.kv_cache_bytes, mem.server_rss_bytes) == (2**20, 2 * 2**20)
    assert mem.engine_core_peak_rss_bytes == 3 * 2**20 and mem.processes == ()
    assert c.median()["one"]["kv_cache_mib"] == 1.0
    assert c.runs_of("two")[0].memory == MemoryReport()  # no /metrics: unknown


@pytest.mark.anyio
async def test_lora_modules_go_to_the_lora_targets_only() -> None:
    """Target "two" gets the requests spread over the adapters (and warm-up
    requests going round them), "one" the same prompts on its base model."""
    async with open_fake_server() as one, open_fake_server() as two:
        targets = [Target("one", url=one.url), Target("two", url=two.url)]
        workload = {**WORKLOAD, "num_prompts": 20}
        config = ServeConfig(**workload, lora_modules=("x", "y", "z"))
        c = await run_comparison(
            config, targets, warmup=3, lora_targets=["two"], log=lambda _: None
        )
    assert [b["model"] for b in one.bodies] == ["fake-model"] * 23
    assert [b["model"] for b in two.bodies[:3]] == ["x", "y", "z"]  # warm-up
    assert {b["model"] for b in two.bodies[3:]} == {"x", "y", "z"}
    prompts = [sorted(json.dumps(b["prompt"]) for b in f.bodies) for f in (one, two)]
    assert prompts[0] == prompts[1]
    runs = {r.target: r.to_json() for r in c.runs}
    assert (runs["one"]["lora_modules"], runs["two"]["lora_modules"]) == (
        [],
        ["x", "y", "z"],
    )
    with pytest.raises(ValueError, match="names no target"):
        await run_comparison(config, targets, lora_targets=["three"])


@pytest.mark.anyio
async def test_the_log_names_the_commonest_failure() -> None:
    log: list[str] = []
    async with open_fake_server(fail=lambda n: "500" if n % 2 else None) as one:
        targets = [Target("one", url=one.url)]
        await run_comparison(ServeConfig(**WORKLOAD), targets, warmup=0, log=log.append)
    assert "  3 ok, 3 failed" in log[1]
    assert log[2] == "  3 x HTTP 500: boom"


def test_command_line_table_json_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, png = tmp_path / "c.json", tmp_path / "c.png"

    async def main() -> int:
        async with open_fake_server() as one, open_fake_server() as two:
            argv = ["--server", f"one={one.url}", "--server", f"two={two.url}"]
            argv += ["--num-prompts", "5", "--output-len", "3", "5", "--rounds", "2"]
            argv += ["--json", str(out), "--plot", str(png)]
            from structllm.bench.serve import run_serve

            return await anyio.to_thread.run_sync(run_serve, parse(argv))

    assert anyio.run(main) == 0
    table = capsys.readouterr().out
    assert "Serving Benchmark Comparison" in table and "Ratio to one" in table
    data = json.loads(out.read_text())
    assert set(data) == {"config", "rounds", "targets", "runs", "median", "ratio"}
    assert "url" not in data["config"] and data["rounds"] == 2
    assert [(r["target"], r["round"]) for r in data["runs"]] == [
        ("one", 0),
        ("two", 0),
        ("two", 1),
        ("one", 1),
    ]
    assert all(len(r["requests"]) == 5 for r in data["runs"])
    assert data["ratio"]["one"]["output_throughput"] == 1.0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_server_that_cannot_start_keeps_the_runs_before_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "c.json"
    bad = python("print('bad config'); exit(2)")

    async def main() -> int:
        async with open_fake_server() as one:
            argv = ["--server", f"one={one.url}", "--launch", f"bad={bad}"]
            argv += ["--num-prompts", "3", "--output-len", "3", "4", "--rounds", "2"]
            argv += ["--json", str(out)]
            from structllm.bench.serve import run_serve

            return await anyio.to_thread.run_sync(run_serve, parse(argv))

    assert anyio.run(main) == 1
    captured = capsys.readouterr()
    assert "bad: exited with code 2" in captured.err and "bad config" in captured.err
    assert "the 1 run(s) finished before it" in captured.err
    assert "Serving Benchmark Comparison" in captured.out
    data = json.loads(out.read_text())
    assert [(r["target"], r["round"]) for r in data["runs"]] == [("one", 0)]
    assert data["median"]["bad"]["output_throughput"] is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--server", "a=http://x", "--url", "http://y"], "--url is one server"),
        (["--server", "a=http://x", "--server", "a=http://y"], "distinct names"),
        (["--server", "a=http://x", "--rounds", "0"], "--rounds must be"),
        (["--launch", "a=serve"], "must contain"),
        (["--server", "a=http://x", "--lora-targets", "a"], "needs --lora-modules"),
        (
            ["--server", "a=http://x", "--lora-modules", "m", "--lora-targets", "b"],
            "names no target ['b']",
        ),
    ],
)
def test_command_line_refusals(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from structllm.bench.serve import run_serve

    assert run_serve(parse(argv)) == 2
    assert message in capsys.readouterr().err


# -- launched servers -----------------------------------------------------------


def python(code: str) -> str:
    return f"{sys.executable} -c {json.dumps(code)} {{port}}"


@pytest.mark.anyio
async def test_a_server_that_exits_shows_its_output() -> None:
    target = Target("bad", command=python("print('no model here'); exit(3)"))
    async with open_client() as client:
        with pytest.raises(LaunchError, match="exited with code 3") as info:
            async with open_target(target, client, startup_timeout=30):
                pytest.fail("it never came up")
    assert "no model here" in str(info.value)


@pytest.mark.anyio
async def test_a_server_that_never_comes_up_is_killed() -> None:
    code = "import os, time; print(os.getpid(), flush=True); time.sleep(60)"
    target = Target("slow", command=python(code))
    async with open_client() as client:
        with pytest.raises(LaunchError, match=r"not serving after 5 s") as info:
            async with open_target(target, client, startup_timeout=5, grace=0.5):
                pytest.fail("it never came up")
    pid = int(str(info.value).splitlines()[-1])
    assert not alive(pid)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the command's loop
@pytest.mark.anyio
async def test_launched_structllm_is_measured_and_stopped() -> None:
    """``structllm serve`` started for its run: its processes' memory, its
    KV cache and speculative decoding counters from /metrics, and nothing
    left running after it."""
    serve = f"{sys.executable} -m structllm.cli serve tiny --port {{port}}"
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    serve += f" --max-model-len 256 --speculative-config '{spec}'"
    targets = [Target("asyncio", command=serve)]
    c = await run_comparison(ServeConfig(**WORKLOAD), targets, log=lambda _: None)
    (only,) = c.runs
    assert only.result.summary.completed == 6
    mem = only.memory
    pids = [p.pid for p in mem.processes]
    if sys.platform == "linux":
        assert len(pids) >= 2  # the server and its engine core
        assert mem.peak_rss_bytes is not None and mem.peak_rss_bytes > 200 * 2**20
    assert mem.kv_cache_bytes is not None and mem.kv_cache_bytes > 0
    assert mem.engine_core_peak_rss_bytes is not None
    assert mem.engine_core_peak_rss_bytes > 100 * 2**20
    wait_gone(*pids, timeout=10)
    assert only.result.config.model == "tiny"  # from its /v1/models
    counts = only.result.summary.spec_decode
    assert counts is not None  # structllm's counters, read before and after
    assert 0 <= counts.accepted_tokens <= counts.draft_tokens


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the command's loop
@pytest.mark.anyio
async def test_keep_up_starts_a_launched_server_once_for_every_round() -> None:
    """``keep_up``: the launched server is started before the first round
    and serves every round (the same processes measured in each), beside a
    running server the rounds rotate with; stopped after the last."""
    serve = f"{sys.executable} -m structllm.cli serve tiny --port {{port}}"
    log: list[str] = []
    async with open_fake_server(metrics=METRICS) as fake:
        targets = [
            Target("launched", command=f"{serve} --max-model-len 256"),
            Target("running", url=fake.url),
        ]
        c = await run_comparison(
            ServeConfig(**WORKLOAD), targets, rounds=3, keep_up=True, log=log.append
        )
    up = [line.split()[:2] for line in log if line.startswith(("start", "check"))]
    assert up == [["starting", "launched"], ["checking", "running"]]
    starts = [line.split(":")[1].split()[0] for line in log if line.startswith("round")]
    rotation = ["launched", "running", "running", "launched", "launched", "running"]
    assert starts == rotation
    runs = c.runs_of("launched")
    assert [r.result.summary.completed for r in runs] == [6, 6, 6]
    pids = [sorted(p.pid for p in r.memory.processes) for r in runs]
    if sys.platform == "linux":
        assert len(pids[0]) >= 2  # the server and its engine core
    assert pids == [pids[0]] * 3  # one server for all three rounds
    assert all("with start and stop" not in line for line in log)
    wait_gone(*pids[0], timeout=10)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the command's loop
@pytest.mark.anyio
async def test_launched_structllm_serves_random_adapters(tmp_path: Path) -> None:
    """A server started with two of ``bench.lora``'s random adapters serves
    the requests spread over them (an unknown model would be a 404)."""
    adapters = write_random_adapters("tiny", tmp_path, count=2, rank=4)
    assert sorted(adapters) == ["a0", "a1"]
    serve = f"{sys.executable} -m structllm.cli serve tiny --port {{port}}"
    serve += " --max-model-len 256 --enable-lora --max-loras 2 --max-lora-rank 4"
    serve += " --lora-modules " + " ".join(f"{n}={p}" for n, p in adapters.items())
    config = ServeConfig(**WORKLOAD, lora_modules=tuple(adapters))
    targets = [Target("lora", command=serve)]
    c = await run_comparison(config, targets, warmup=2, log=lambda _: None)
    (only,) = c.runs
    assert only.result.summary.completed == 6
    assert only.result.config.model == "tiny"  # the base: first of /v1/models


@pytest.mark.parametrize("keep_up", [False, True])
def test_sigterm_stops_the_benchmark_and_its_launched_server(keep_up: bool) -> None:
    """A launched server runs in a session of its own, out of reach of the
    signals a CI runner or a closed terminal sends the benchmark: SIGTERM
    must still stop it, also one kept up for every round (``--keep-up``)."""
    serve = f"{sys.executable} -m structllm.cli serve tiny --port {{port}}"
    cmd = [sys.executable, "-m", "structllm.cli", "bench", "serve"]
    cmd += ["--launch", f"s={serve} --max-model-len 256", "--num-prompts", "5000"]
    cmd += ["--max-concurrency", "1", "--output-len", "100", "128"]
    cmd += ["--keep-up"] if keep_up else []
    bench = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        assert bench.stderr is not None
        first = bench.stderr.readline() + bench.stderr.readline()
        assert ("starting s" if keep_up else "round 1/1") in first
        deadline = time.monotonic() + 60
        while len(process_tree(bench.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)  # the server and its engine core start
        tree = process_tree(bench.pid)
        assert len(tree) >= 3, tree
        bench.send_signal(signal.SIGTERM)
        err = bench.communicate(timeout=60)[1]
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.communicate()
    assert bench.returncode == 1
    assert "SIGTERM: stopping" in err and "interrupted" in err
    wait_gone(*tree, timeout=30)


def test_json_config_keeps_the_workload(tmp_path: Path) -> None:
    c = Comparison((Target("a", url="http://a"),), 1, (run("a", 0, e2e=1.0),))
    data: dict[str, Any] = c.to_json(ServeConfig(num_prompts=4).to_json())
    assert data["config"]["num_prompts"] == 4 and "model" not in data["config"]
    assert data["runs"][0]["memory"]["processes"] == []
