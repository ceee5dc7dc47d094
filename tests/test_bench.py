"""``structllm bench throughput`` and ``bench prefix`` on a tiny model.

The figures are machine-dependent, so these check what the benchmarks count:
every system produces exactly the workload's requested tokens, and prefix
caching computes fewer tokens than recomputing for the same requests.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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


def test_throughput_with_speculation_reports_acceptance(tmp_path: Path) -> None:
    """``--speculative-config``: the engines speculate, the same run without
    it follows, and every speculating system counts its proposals."""
    out = tmp_path / "throughput.json"
    # at any batch size (the 3 prompts run at once), from a match of one
    # token: a random model's output repeats little
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "disable_by_batch_size": None,
    }
    argv = ["bench", "throughput", *TINY, "--num-prompts", "3", "--skip-async"]
    argv += ["--workload", "grounded", "--output-len", "10", "10"]
    argv += ["--hf", "off", "--compare-backend", "none", "--repeats", "1"]
    argv += ["--speculative-config", json.dumps(spec)]
    assert main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["workload"] == "grounded"
    assert result["speculative_config"]["prompt_lookup_max"] == 1  # vLLM's rule
    systems = result["systems"]
    assert set(systems) == {
        "structllm",
        "structllm, no speculation",
        "structllm EngineCore (direct)",
    }
    for name, figures in systems.items():
        assert figures["output_tokens"] == result["output_tokens"] == 3 * 10, name
        if name.endswith("no speculation"):
            assert "acceptance_rate" not in figures
            continue
        proposed, accepted = figures["proposed_tokens"], figures["accepted_tokens"]
        assert proposed > 0 and 0 <= accepted <= proposed, name
        assert figures["acceptance_rate"] == (accepted / proposed if proposed else 0)


def test_text_workloads_are_chat_turns_in_turn(tmp_path: Path) -> None:
    from structllm.bench.grounded import CHAT, GROUNDED, chat_prompt, text_workload
    from structllm.testing.checkpoints import make_tiny_model
    from structllm.text.tokenizer import load_tokenizer

    make_tiny_model(tmp_path, hidden_size=32, num_layers=1, num_heads=2)
    tok = load_tokenizer(tmp_path)
    work = text_workload("grounded", 6, (4, 9), tok, seed=2)
    assert work == text_workload("grounded", 6, (4, 9), tok, seed=2)
    prompts = [p for p, _ in work]
    assert prompts[0] == chat_prompt(tok, GROUNDED[0]) == prompts[len(GROUNDED)]
    assert len({tuple(p) for p in prompts}) == len(GROUNDED)
    assert all(4 <= n <= 9 for _, n in work)
    # the given text is in the prompt: what prompt lookup copies from
    assert "The city council met on Tuesday" in tok.decode(prompts[0])
    chat = text_workload("chat", 2, (4, 4), tok, seed=0)
    assert [p for p, _ in chat] == [chat_prompt(tok, t) for t in CHAT[:2]]


def test_speculative_single_and_crossover(tmp_path: Path) -> None:
    """``bench speculative``: the same greedy outputs with and without
    speculation; a model drafting for itself has every proposal accepted;
    the crossover has a CPU figure per batch and engine."""
    from structllm.testing.checkpoints import make_tiny_model

    model = str(tmp_path / "model")
    make_tiny_model(model, seed=5)
    out = tmp_path / "single.json"
    common = ["--model", model, "--rounds", "1", "--max-tokens", "6", "-k", "2"]
    common += ["--prompt-lookup-min", "1", "--num-threads", "1"]
    argv = ["bench", "speculative", "single", *common, "--draft", model]
    assert main([*argv, "--json", str(out)]) == 0
    workloads = json.loads(out.read_text())["workloads"]
    assert set(workloads) == {"grounded", "chat"}
    for engines in workloads.values():
        assert set(engines) == {"none", "ngram", "draft"}
        assert all(f["identical"] for f in engines.values())
        assert engines["none"]["proposed_tokens"] == 0
        draft = engines["draft"]
        assert draft["proposed_tokens"] > 0 and draft["acceptance_rate"] == 1.0
        assert all(f["tpot_p50_ms"] > 0 for f in engines.values())

    out = tmp_path / "crossover.json"
    argv = ["bench", "speculative", "crossover", *common, "--clients", "1", "3"]
    assert main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["specs"]["ngram"]["disable_by_batch_size"] is None
    assert set(result["clients"]) == {"1", "3"}
    for engines in result["clients"].values():
        assert set(engines) == {"none", "ngram"}
        assert all(f["seconds_per_token"] > 0 for f in engines.values())
        ngram = engines["ngram"]
        assert 0 <= ngram["accepted_tokens"] <= ngram["proposed_tokens"]


def test_throughput_refuses_a_bad_speculative_config_by_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "throughput", *TINY, "--speculative-config", '{"method": "x"}']
    assert main(argv) == 2
    assert "speculative_config: method must be" in capsys.readouterr().err
