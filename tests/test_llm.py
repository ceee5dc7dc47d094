"""The offline LLM API and the CLI commands around it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from structllm import LLM, InvalidRequestError, SamplingParams
from structllm.model.config import ModelConfig
from structllm.text.tokenizer import HFTokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-random", show_progress=False, max_model_len=128, num_blocks=64)


def test_outputs_in_input_order(llm: LLM) -> None:
    prompts = ["a", "bb", [5, 6, 7], {"prompt_token_ids": [9]}, {"prompt": "zz"}]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    alone = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts]
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    assert outs[2].prompt_token_ids == (5, 6, 7) and outs[2].prompt is None
    assert outs[4].prompt == "zz"


def test_params_per_prompt_and_priority(llm: LLM) -> None:
    outs = llm.generate(
        ["x", "y"],
        [
            SamplingParams(max_tokens=2, ignore_eos=True),
            SamplingParams(max_tokens=5, ignore_eos=True),
        ],
        use_tqdm=False,
        priority=[1, 0],
    )
    assert [len(o.token_ids) for o in outs] == [2, 5]
    with pytest.raises(InvalidRequestError, match="2 prompts") as e:
        llm.generate(["x", "y"], [GREEDY], use_tqdm=False)
    assert e.value.field == "params"


def test_an_offline_list_runs_longest_first() -> None:
    # one request at a time, so the queue times give the admission order
    one = LLM(
        "tiny-random",
        show_progress=False,
        max_model_len=128,
        num_blocks=64,
        max_num_seqs=1,
    )
    lengths = [2, 9, None, 5, 9]
    params = [
        SamplingParams(temperature=0, max_tokens=n or 128, ignore_eos=n is not None)
        for n in lengths
    ]
    params[2] = SamplingParams(temperature=0, max_tokens=None, stop_token_ids=[7])
    outs = one.generate(["a", "b", "c", "d", "e"], params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs][:2] == [2, 9]
    waits = [o.queue_time for o in outs]
    assert all(w is not None for w in waits)
    admitted = sorted(range(5), key=lambda i: waits[i] or 0.0)
    # None (to the model's length) first, then 9, 9 in the given order, 5, 2
    assert admitted == [2, 1, 4, 3, 0]


def test_stop_string_and_logprobs(llm: LLM) -> None:
    base = llm.generate(
        "Hello", SamplingParams(temperature=0, max_tokens=20), use_tqdm=False
    )[0]
    stop = base.text[3:5]
    out = llm.generate(
        "Hello",
        SamplingParams(temperature=0, max_tokens=20, stop=[stop], logprobs=1),
        use_tqdm=False,
    )[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.text == base.text[: base.text.index(stop)]
    lps = out.outputs[0].logprobs
    assert lps is not None and len(lps) == len(out.token_ids)
    assert all(tok in d for tok, d in zip(out.token_ids, lps, strict=True))
    # the engine is left clean: the stop string aborted the request in the core
    assert not llm.core.has_unfinished_requests()
    assert llm.core.statistics().scheduler.blocks.num_used == 0


def test_invalid_prompt_leaves_nothing_behind(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine", [999]], GREEDY, use_tqdm=False)
    assert not llm.core.has_unfinished_requests()


def test_make_tiny_model_and_generate_cli(tmp_path: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "structllm.cli", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )

    made = cli("make-tiny-model", str(tmp_path), "--arch", "qwen2", "--shards", "2")
    assert made.returncode == 0, made.stderr
    assert "Qwen2ForCausalLM" in made.stdout
    config = ModelConfig.from_directory(tmp_path)
    assert config.qkv_bias and config.tie_word_embeddings
    assert len(list(tmp_path.glob("*.safetensors"))) == 2
    assert HFTokenizer.from_directory(tmp_path).vocab_size == config.vocab_size
    gen = cli("generate", str(tmp_path), "Hello", "--max-tokens", "5", "--chat")
    assert gen.returncode == 0, gen.stderr
    assert "finish_reason=" in gen.stderr
    bad = cli("generate", "tiny-random", "Hello", "--temperature", "-1")
    assert bad.returncode == 2 and "temperature" in bad.stderr


def test_stream_yields_deltas_and_closing_aborts(llm: LLM) -> None:
    from structllm import OutputKind

    params = SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, output_kind=OutputKind.DELTA
    )
    outs = list(llm.stream("Hello", params))
    whole = llm.generate("Hello", GREEDY, use_tqdm=False)[0]
    assert [t for o in outs for t in o.token_ids] == list(whole.token_ids)
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    stream = llm.stream("Hello", SamplingParams(max_tokens=100, ignore_eos=True))
    next(stream)
    stream.close()  # leaving early aborts the request in the core
    assert not llm.core.has_unfinished_requests()
    assert llm.core.statistics().scheduler.blocks.num_used == 0
