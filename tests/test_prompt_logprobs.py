"""SamplingParams.prompt_logprobs: the raw model distribution at every prompt
position, whatever the chunking, batching, prefix cache or preemption."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

from structllm import LLM, OutputKind, SamplingParams
from structllm.config import EngineConfig
from structllm.core.engine_core import EngineCore, RequestStepOutput
from structllm.core.request import CoreRequest
from structllm.engine.async_llm import AsyncLLM
from structllm.model._paddle import paddle
from structllm.model.llama import LlamaForCausalLM
from structllm.model.training import causal_lm_logits
from structllm.outputs import Logprob

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
