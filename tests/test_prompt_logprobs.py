"""SamplingParams.prompt_logprobs: the raw model distribution at every prompt
position, whatever the chunking, batching, prefix cache or preemption."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from structllm import LLM, OutputKind, SamplingParams
from structllm.config import EngineConfig
from structllm.core.engine_core import EngineCore, RequestStepOutput
from structllm.core.request import CoreRequest
from structllm.engine.frontend.async_llm import AsyncLLM
from structllm.engine.frontend.output_processor import (
    OutputProcessor,
    RequestOutputCollector,
    RequestState,
)
from structllm.model._paddle import paddle
from structllm.model.llama import LlamaForCausalLM
from structllm.model.sampler import TokenLogprobs
from structllm.model.training import causal_lm_logits
from structllm.outputs import Logprob
from structllm.text.tokenizer import load_tokenizer
from tests.test_server_app import CHAT, Server, events, open_server

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
TOL = 1e-4


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, size=n).tolist()


def _reference(model: LlamaForCausalLM, prompt: list[int]) -> npt.NDArray[np.float64]:
    """log_softmax of one full-sequence forward: row i predicts token i + 1."""
    with paddle.no_grad():
        logits = causal_lm_logits(model, paddle.to_tensor([prompt]))[0].numpy()
    x = logits.astype(np.float64)  # (T, V)
    top = x.max(axis=1, keepdims=True)
    out: npt.NDArray[np.float64] = (
        x - top - np.log(np.exp(x - top).sum(1, keepdims=True))
    )
    return out


def _check(
    entries: tuple[dict[int, Logprob] | None, ...] | None,
    prompt: list[int],
    ref: npt.NDArray[np.float64],
    k: int,
) -> None:
    assert entries is not None and len(entries) == len(prompt)
    assert entries[0] is None
    for i in range(1, len(prompt)):
        entry, row, tok = entries[i], ref[i - 1], prompt[i]
        assert entry is not None and tok in entry, i
        got = entry[tok]
        assert abs(got.logprob - row[tok]) < TOL, i
        # the rank, up to ties the float32 forward cannot order
        assert got.rank is not None
        lo = 1 + int((row > row[tok] + TOL).sum())
        hi = 1 + int((row > row[tok] - TOL).sum())
        assert lo <= got.rank <= hi, i
        # the top k, and the prompt token beside them when it is not one
        assert len(entry) == (k if got.rank <= k else k + 1)
        ranked = sorted(
            (lp for lp in entry.values() if (lp.rank or 0) <= k),
            key=lambda lp: lp.rank or 0,
        )
        assert [lp.rank for lp in ranked] == list(range(1, k + 1))
        want = np.sort(row)[::-1][:k]
        np.testing.assert_allclose([lp.logprob for lp in ranked], want, atol=TOL)


@pytest.fixture(scope="module")
def llm() -> LLM:
    # a budget of 16 tokens chunks the long prompts over several steps
    return LLM(
        "tiny-random",
        show_progress=False,
        model_backend="eager",
        max_model_len=256,
        num_blocks=64,
        max_num_batched_tokens=16,
    )


def _model(llm: LLM) -> LlamaForCausalLM:
    return llm.core.runner.model


@pytest.mark.parametrize("k", [0, 5])
def test_equal_a_full_forward_chunked_and_batched(llm: LLM, k: int) -> None:
    long = _prompt(70, seed=k)  # over four steps' budget
    others = [_prompt(30, seed=10 + k), _prompt(5, seed=20 + k)]
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in others]
    params = [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=k), GREEDY]
    outs = llm.generate(
        [long, *others], [params[0], params[1], params[1]], use_tqdm=False
    )
    _check(outs[0].prompt_logprobs, long, _reference(_model(llm), long), k)
    # the batch-mates are unaffected
    assert [o.token_ids for o in outs[1:]] == alone
    assert all(o.prompt_logprobs is None for o in outs[1:])


def test_one_token_prompt(llm: LLM) -> None:
    out = llm.generate(
        [[7]], SamplingParams(max_tokens=2, prompt_logprobs=3), use_tqdm=False
    )[0]
    assert out.prompt_logprobs == (None,)


def test_no_prefix_cache_hit_for_prompt_logprobs(llm: LLM) -> None:
    llm.reset_prefix_cache()
    prompt = _prompt(64, seed=30)
    with_pl = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    first = llm.generate([prompt], with_pl, use_tqdm=False)[0]
    again = llm.generate([prompt], with_pl, use_tqdm=False)[0]
    plain = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert again.prompt_logprobs == first.prompt_logprobs
    _check(again.prompt_logprobs, prompt, _reference(_model(llm), prompt), 1)
    # its blocks were offered to the cache all the same
    assert plain.num_cached_tokens == 48


def _step_outputs(core: EngineCore) -> list[RequestStepOutput]:
    outs: list[RequestStepOutput] = []
    while core.has_unfinished_requests():
        outs += core.step().outputs
    return outs


def test_preemption_emits_them_once() -> None:
    # 8 blocks of 16 tokens: A alone fills them, so B (newer) is preempted
    # mid-prefill, more than once, and recomputes its prompt
    core = EngineCore(
        EngineConfig(
            model="tiny-random",
            model_backend="eager",
            max_model_len=128,
            num_blocks=8,
            max_num_batched_tokens=16,
        )
    )
    a, b = _prompt(100, seed=40), _prompt(40, seed=41)
    core.add_request(
        CoreRequest(
            request_id="a",
            prompt_token_ids=tuple(a),
            params=SamplingParams(temperature=0, max_tokens=27, ignore_eos=True),
        )
    )
    params = SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=2
    )
    core.add_request(
        CoreRequest(request_id="b", prompt_token_ids=tuple(b), params=params)
    )
    outs = _step_outputs(core)
    assert core.statistics().scheduler.total_preemptions >= 2
    sent = [o for o in outs if o.prompt_logprobs is not None]
    assert [o.request_id for o in sent] == ["b"]
    assert sent[0] is next(o for o in outs if o.request_id == "b")  # the first
    assert sum(len(o.new_token_ids) for o in outs if o.request_id == "b") == 20
    ref = _reference(core.runner.model, b)
    entries = sent[0].prompt_logprobs
    assert entries is not None and entries[0] is None and len(entries) == len(b)
    for i, lp in enumerate(entries[1:], 1):
        assert lp is not None
        assert abs(lp.sampled_logprob - ref[i - 1, b[i]]) < TOL
        assert len(lp.top_ids) == 2


@pytest.mark.anyio
@pytest.mark.parametrize("executor", ["inline", "process"])
async def test_async_llm_delta_once_over_the_wire(
    executor: str, anyio_backend: str
) -> None:
    if executor == "process" and anyio_backend != "asyncio":
        pytest.skip("one process start is enough")
    prompt = _prompt(40, seed=50)
    params = SamplingParams(
        temperature=0,
        max_tokens=5,
        ignore_eos=True,
        prompt_logprobs=3,
        output_kind=OutputKind.DELTA,
    )
    async with AsyncLLM.open(
        "tiny-random",
        executor=executor,
        show_progress=False,
        model_backend="eager",
        max_model_len=128,
        num_blocks=32,
        max_num_batched_tokens=16,
    ) as engine:
        async with engine.stream({"prompt_token_ids": prompt}, params) as s:
            outs = [o async for o in s]
        cumulative = await engine.complete(
            {"prompt_token_ids": prompt},
            SamplingParams(max_tokens=2, prompt_logprobs=3),
        )
    assert outs[0].prompt_logprobs is not None
    assert all(o.prompt_logprobs is None for o in outs[1:])
    assert cumulative.prompt_logprobs == outs[0].prompt_logprobs
    model = LLM("tiny-random", show_progress=False, model_backend="eager")
    _check(outs[0].prompt_logprobs, prompt, _reference(_model(model), prompt), 3)


# -- the server ------------------------------------------------------------------


async def _engine_entries(server: Server, ids: list[int]) -> list[float]:
    out = await server.llm.complete(
        {"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0)
    )
    assert out.prompt_logprobs is not None
    return [d[t].logprob for t, d in zip(ids[1:], out.prompt_logprobs[1:], strict=True)]


def _check_body(
    entries: list[Any], ids: list[int], want: list[float], k: int, tol: float = TOL
) -> None:
    """vLLM's JSON prompt_logprobs: null, then {id: {logprob, rank, decoded_token}}."""
    assert len(entries) == len(ids) and entries[0] is None
    for tok, entry, lp in zip(ids[1:], entries[1:], want, strict=True):
        assert entry[str(tok)]["logprob"] == pytest.approx(lp, abs=tol)
        assert set(entry[str(tok)]) == {"logprob", "rank", "decoded_token"}
        assert k <= len(entry) <= k + 1


@pytest.mark.anyio
async def test_completions_echo_with_logprobs_whole_and_streamed() -> None:
    body = {"prompt": "Hello world", "max_tokens": 4, "temperature": 0,
            "echo": True, "logprobs": 2, "return_token_ids": True}  # fmt: skip
    async with open_server() as s:
        r = await s.http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        ids = choice["prompt_token_ids"]
        want = await _engine_entries(s, ids)
        lp = choice["logprobs"]
        n = len(ids) + 4
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == n
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(want, abs=TOL)
        assert all(2 <= len(t) <= 3 for t in lp["top_logprobs"][1:])
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(
            lp["text_offset"]
        )
        assert choice["text"].startswith("Hello world")
        # the tokens spell the text; the first is BOS, which the text has not
        assert "".join(lp["tokens"][1:]) == choice["text"]
        # echo with logprobs asks for the prompt's: returned as vLLM does
        _check_body(choice["prompt_logprobs"], ids, want, 2)

        r = await s.http.post("/v1/completions", json={**body, "stream": True})
        chunks = [e for e in events(r.text)[:-1] if e["choices"]]
        firsts = [c for c in chunks if "prompt_logprobs" in c["choices"][0]]
        assert firsts == [
            next(c for c in chunks if c["choices"][0]["logprobs"] is not None)
        ]
        text = "".join(c["choices"][0].get("text", "") for c in chunks)
        assert text == choice["text"]
        streamed = [
            x
            for c in chunks
            if c["choices"][0]["logprobs"] is not None
            for x in c["choices"][0]["logprobs"]["token_logprobs"]
        ]
        assert streamed[0] is None
        offsets = [
            x
            for c in chunks
            if c["choices"][0]["logprobs"] is not None
            for x in c["choices"][0]["logprobs"]["text_offset"]
        ]
        assert offsets == lp["text_offset"]  # they go on from chunk to chunk
        assert streamed[1:] == pytest.approx(lp["token_logprobs"][1:], abs=TOL)
        _check_body(firsts[0]["choices"][0]["prompt_logprobs"], ids, want, 2)
        await s.wait_idle()


@pytest.mark.anyio
async def test_completions_and_chat_prompt_logprobs() -> None:
    async with open_server() as s:
        body = {"prompt": "abc", "max_tokens": 2, "prompt_logprobs": 0,
                "return_token_ids": True}  # fmt: skip
        choice = (await s.http.post("/v1/completions", json=body)).json()["choices"][0]
        ids = choice["prompt_token_ids"]
        _check_body(choice["prompt_logprobs"], ids, await _engine_entries(s, ids), 0)
        assert choice["logprobs"] is None and choice["text"] != ""
        plain = (await s.http.post("/v1/completions", json={"prompt": "abc"})).json()
        assert plain["choices"][0]["prompt_logprobs"] is None  # vLLM's null

        body = {"messages": CHAT, "max_tokens": 3, "prompt_logprobs": 1, "n": 2,
                "return_token_ids": True}  # fmt: skip
        whole = (await s.http.post("/v1/chat/completions", json=body)).json()
        ids = whole["prompt_token_ids"]
        _check_body(whole["prompt_logprobs"], ids, await _engine_entries(s, ids), 1)
        assert all("prompt_logprobs" not in c for c in whole["choices"])
        r = await s.http.post("/v1/chat/completions", json={**body, "stream": True})
        chunks = events(r.text)[:-1]
        with_pl = [c for c in chunks if "prompt_logprobs" in c]
        # each choice's first chunk with tokens, none other
        assert sorted(c["choices"][0]["index"] for c in with_pl) == [0, 1]
        want = [
            e[str(t)]["logprob"]
            for t, e in zip(ids[1:], whole["prompt_logprobs"][1:], strict=True)
        ]
        for c in with_pl:  # equal up to the float noise of a different batch
            _check_body(c["prompt_logprobs"], ids, want, 1, tol=1e-4)
        await s.wait_idle()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", list(OutputKind))
async def test_output_kinds_and_a_lagging_delta_consumer(kind: OutputKind) -> None:
    tokenizer = load_tokenizer("tiny-random")
    queue = RequestOutputCollector(kind)
    proc = OutputProcessor()
    params = SamplingParams(prompt_logprobs=1, output_kind=kind)
    proc.add(RequestState("r", None, (5, 6, 7), params, tokenizer, queue=queue))
    entry = TokenLogprobs(-0.5, 2, (9,), (-0.25,))
    proc.process_outputs(
        [RequestStepOutput("r", (8,), prompt_logprobs=(None,) * 2 + (entry,))]
    )
    proc.process_outputs([RequestStepOutput("r", (8,))])  # lags: merged with the first
    out = await queue.next() if kind is not OutputKind.FINAL else None
    proc.process_outputs([RequestStepOutput("r", (8,), finish_reason="length")])
    last = await queue.next()
    assert last is not None and last.finished
    want = (None, None, {7: Logprob(-0.5, 2, "\x07"), 9: Logprob(-0.25, 1, "\t")})
    if kind is OutputKind.DELTA:
        assert out is not None and out.prompt_logprobs == want
        assert last.prompt_logprobs is None  # once
    else:
        assert last.prompt_logprobs == want
