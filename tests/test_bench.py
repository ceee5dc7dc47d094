"""``structllm bench throughput`` and ``bench prefix`` on a tiny model.

The figures are machine-dependent, so these check what the benchmarks count:
every system produces exactly the workload's requested tokens, and prefix
caching computes fewer tokens than recomputing for the same requests.
"""

from __future__ import annotations

import json
from pathlib import Path

from structllm.bench.throughput import make_workload
from structllm.cli import main

TINY = ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2"]
TINY += ["--intermediate", "128", "--num-threads", "1"]


def test_throughput_counts_the_requested_tokens(tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    argv = ["bench", "throughput", *TINY, "--num-prompts", "4"]
    argv += ["--input-len", "4", "16", "--output-len", "2", "8", "--seed", "3"]
    argv += ["--hf", "off", "--compare-backend", "none", "--repeats", "1"]
    assert main([*argv, "--json", str(out)]) == 0

    result = json.loads(out.read_text())
    work = make_workload(4, (4, 16), (2, 8), vocab=512, seed=3)
    assert result["input_tokens"] == sum(len(p) for p, _ in work)
    assert result["output_tokens"] == sum(n for _, n in work)
    systems = result["systems"]
    assert set(systems) == {
        "structllm",
        "structllm EngineCore (direct)",
        "structllm AsyncLLM (core process)",
    }
    for name, figures in systems.items():
        assert figures["output_tokens"] == result["output_tokens"], name
        assert figures["tokens_per_s"] > 0, name
    assert 0 < result["overhead"]["forward_ms"] <= result["overhead"]["step_ms"]


def test_prefix_caching_computes_fewer_tokens(tmp_path: Path) -> None:
    out = tmp_path / "prefix.json"
    argv = ["bench", "prefix", *TINY, "--workloads", "chat,none"]
    argv += ["--conversations", "2", "--turns", "2", "--system-len", "32"]
    argv += ["--user-len", "4", "8", "--answer-len", "4", "--repeats", "1"]
    argv += ["--unshared-requests", "3", "--unshared-input-len", "8", "16"]
    argv += ["--unshared-output-len", "2", "4"]
    assert main([*argv, "--json", str(out)]) == 0

    workloads = json.loads(out.read_text())["workloads"]
    chat_on, chat_off = (workloads["chat"]["median"][k] for k in ("on", "off"))
    assert chat_on["output_tokens"] == chat_off["output_tokens"] == 2 * 2 * 4
    assert chat_on["computed_tokens"] < chat_off["computed_tokens"]
    assert chat_on["hit_rate"] > 0 == chat_off["hit_rate"]
    none_on, none_off = (workloads["none"]["median"][k] for k in ("on", "off"))
    assert none_on["computed_tokens"] == none_off["computed_tokens"]
    assert none_on["hit_rate"] == 0
