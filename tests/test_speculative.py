"""Speculative decoding changes how fast tokens come, never which tokens.

The n-gram proposer against a naive reference; the sampler's verification
(greedy, penalties, seeded, and a chi-square test of the distribution); and
the engine core end to end: greedy and seeded outputs identical token for
token with and without speculation, through stop tokens and max_tokens cut
inside an accepted run, preemption, prefix caching, logprobs and an abort
during a verification step. (Structured output under speculation is
test_speculative_structured.)
(The scheduler's bookkeeping under speculation, with rejected proposals,
preemption and aborts mid-step, is the state machine of test_scheduler.)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from structllm.config import EngineConfig
from structllm.core.engine_core import EngineCore
from structllm.core.request import CoreRequest
from structllm.core.speculative import propose_ngram
from structllm.model.sampler import Sampler, SamplingRow, make_generator
from structllm.params import SamplingParams

SAMPLER = Sampler()

# -- the n-gram proposer -------------------------------------------------------


def reference_ngram(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup, spelled out: the latest earlier match of the last n
    tokens, then copy on from it (the proposal itself where the copy reaches
    the end)."""
    seq = list(tokens)
    size = len(seq)
    for n in range(max_n, min_n - 1, -1):
        if n >= size:
            continue
        for i in range(size - n - 1, -1, -1):
            if seq[i : i + n] == seq[size - n :]:
                out: list[int] = []
                for j in range(k):
                    src = i + n + j
                    out.append(seq[src] if src < size else out[src - size])
                return out
    return []


def test_ngram_examples() -> None:
    assert propose_ngram([1, 2, 3, 9, 1, 2], 2, min_n=1, max_n=3) == [3, 9]
    # the latest match wins, the longest n first
    assert propose_ngram([1, 2, 5, 1, 2, 6, 0, 2], 1, min_n=1, max_n=2) == [6]
    assert propose_ngram([4, 1, 2, 5, 3, 1, 2], 3, min_n=1, max_n=2) == [5, 3, 1]
    assert propose_ngram([4, 1, 2, 5, 3, 1, 2], 3, min_n=3, max_n=3) == []
    # a match overlapping the suffix repeats with its period
    assert propose_ngram([7, 7, 7], 4, min_n=1, max_n=2) == [7, 7, 7, 7]
    assert propose_ngram([1, 2, 1, 2], 5, min_n=2, max_n=2) == [1, 2, 1, 2, 1]
    assert propose_ngram([1, 2, 3], 3, min_n=1, max_n=3) == []
    assert propose_ngram([5], 3, min_n=1, max_n=3) == []


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=40),
    k=st.integers(1, 6),
    bounds=st.tuples(st.integers(1, 5), st.integers(0, 3)),
)
def test_ngram_matches_the_reference(
    tokens: list[int], k: int, bounds: tuple[int, int]
) -> None:
    min_n, extra = bounds
    got = propose_ngram(tokens, k, min_n=min_n, max_n=min_n + extra)
    assert got == reference_ngram(tokens, k, min_n, min_n + extra)
    assert len(got) in (0, k)


@settings(max_examples=100, deadline=None)
@given(
    period=st.lists(st.integers(0, 50), min_size=1, max_size=6, unique=True),
    reps=st.integers(2, 5),
    k=st.integers(1, 8),
)
def test_ngram_continues_a_repeating_sequence(
    period: list[int], reps: int, k: int
) -> None:
    tokens = period * reps
    got = propose_ngram(tokens, k, min_n=1, max_n=3)
    assert got == (period * (k // len(period) + 2))[:k]


# -- verification in the sampler ----------------------------------------------


def rows_for(params: SamplingParams, seed: int | None = None, **kw: Any) -> SamplingRow:
    return SamplingRow(params, make_generator(seed), **kw)


def test_greedy_accepts_while_the_proposal_is_the_argmax() -> None:
    v = 6
    best = [3, 1, 4, 1]  # the argmax of each of 4 rows
    logits = np.zeros((4, v), np.float32)
    logits[np.arange(4), best] = 5.0
    greedy = SamplingParams(temperature=0)
    for drafts, want in [
        ((3, 1, 4), (3, 1, 4, 1)),  # all accepted, and the bonus token
        ((3, 1, 5), (3, 1, 4)),  # the model's token at the first mismatch
        ((2, 1, 4), (3,)),
        ((), None),
    ]:
        n = 1 + len(drafts)
        out = SAMPLER.verify(logits[:n], [rows_for(greedy)], [drafts])
        assert out.token_ids == [want or (3,)]


def test_each_row_sees_the_proposals_before_it() -> None:
    # repetition penalty: without seeing token 2 as generated, row 1 picks 2
    logits = np.array([[0, 0, 3.0, 2.9], [0, 0, 3.0, 2.9]], np.float32)
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    out = SAMPLER.verify(logits, [rows_for(params, prompt_token_ids=[0])], [(2,)])
    assert out.token_ids == [(2, 3)]
    # and min_tokens masks EOS (token 2 here) at row 0 only
    params = SamplingParams(temperature=0, min_tokens=1)
    row = rows_for(params, eos_token_ids=frozenset({2}))
    assert SAMPLER.verify(logits, [row], [(3,)]).token_ids == [(3, 2)]


def sequential(
    logits: np.ndarray, params: SamplingParams, seed: int, drafts: Sequence[int]
) -> tuple[list[int], np.random.Generator]:
    """What a request samples one step at a time, without speculation,
    until it leaves the proposals (or takes them all and one more)."""
    gen = make_generator(seed)
    out: list[int] = []
    for j in range(len(drafts) + 1):
        row = SamplingRow(params, gen, output_token_ids=tuple(out))
        out.append(int(SAMPLER.sample(logits[j : j + 1], [row]).token_ids[0]))
        if j == len(drafts) or out[-1] != drafts[j]:
            break
    return out, gen


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    data=st.data(),
    params=st.builds(
        SamplingParams,
        temperature=st.sampled_from([0.0, 0.5, 1.0, 1.5]),
        top_k=st.sampled_from([0, 2, 3]),
        top_p=st.sampled_from([1.0, 0.8]),
        presence_penalty=st.sampled_from([0.0, 1.0]),
        logprobs=st.sampled_from([None, 2]),
    ),
)
def test_seeded_rows_take_the_tokens_they_would_without_speculation(
    seed: int, data: st.DataObject, params: SamplingParams
) -> None:
    v = 5
    drafts = tuple(data.draw(st.lists(st.integers(0, v - 1), max_size=4)))
    logits = np.asarray(
        data.draw(
            st.lists(
                st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=v, max_size=v),
                min_size=len(drafts) + 1,
                max_size=len(drafts) + 1,
            )
        ),
        np.float32,
    )
    # a second request in the batch, without proposals, must not matter
    other = rows_for(SamplingParams(temperature=1.0), seed=1)
    batch = np.concatenate([logits, np.zeros((1, v), np.float32)])
    row = rows_for(params, seed=seed)
    out = SAMPLER.verify(batch, [row, other], [drafts, ()])
    want, gen = sequential(logits, params, seed, drafts)
    assert list(out.token_ids[0]) == want
    # the generator is where the sequential run left it
    assert row.generator.random() == gen.random()
    lps = out.logprobs[0]
    assert (lps is None) == (params.logprobs is None)
    if lps is not None:
        assert len(lps) == len(want)
        assert [lp.sampled_rank >= 1 for lp in lps] == [True] * len(want)


#: chi-square critical values at p = 0.001 by degrees of freedom
CHI2_999 = {3: 16.27, 6: 22.46}


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


def test_sampled_tokens_follow_the_target_distribution() -> None:
    """V = 4, two positions; a fixed proposal (the likeliest token, then the
    second likeliest). Without speculation and with it, the first token and
    the second (after the first proposal) follow the target softmax."""
    logits = np.log(
        np.array([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4], [0.25] * 4], np.float32)
    )
    p0, p1 = np.exp(logits[0]), np.exp(logits[1])
    params = SamplingParams(temperature=1.0)
    trials = 6000
    first = {"plain": np.zeros(4), "speculative": np.zeros(4)}
    second = {"plain": np.zeros(4), "speculative": np.zeros(4)}
    for t in range(trials):
        # plain: one token per step, as without speculation
        gen = make_generator(t)
        a = int(SAMPLER.sample(logits[:1], [SamplingRow(params, gen)]).token_ids[0])
        row = SamplingRow(params, gen, output_token_ids=(a,))
        b = int(SAMPLER.sample(logits[1:2], [row]).token_ids[0])
        first["plain"][a] += 1
        if a == 0:
            second["plain"][b] += 1
        # speculative, other seeds: proposals (0, 3)
        out = SAMPLER.verify(
            logits, [SamplingRow(params, make_generator(trials + t))], [(0, 3)]
        )
        tokens = out.token_ids[0]
        first["speculative"][tokens[0]] += 1
        if tokens[0] == 0:
            second["speculative"][tokens[1]] += 1
    for kind in ("plain", "speculative"):
        assert chi_square(first[kind], p0) < CHI2_999[3], (kind, first[kind])
        assert chi_square(second[kind], p1) < CHI2_999[3], (kind, second[kind])
    # and the two runs against each other (homogeneity, 3 dof per table)
    for table in (first, second):
        both = np.stack([table["plain"], table["speculative"]])  # (2, 4)
        expected = both.sum(1, keepdims=True) * both.sum(0) / both.sum()
        assert float(((both - expected) ** 2 / expected).sum()) < CHI2_999[3]


# -- the engine core end to end ----------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None}
_CORES: dict[tuple[Any, ...], EngineCore] = {}


def core_for(model: str = "tiny-random", spec: bool = True, **kw: Any) -> EngineCore:
    key = (model, spec, tuple(sorted(kw.items())))
    if key not in _CORES:
        _CORES[key] = EngineCore(
            EngineConfig(
                model=model,
                max_model_len=256,
                speculative_config=NGRAM if spec else None,
                **{"num_blocks": 64, **kw},
            )
        )
    return _CORES[key]


def run(
    core: EngineCore,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
) -> tuple[dict[str, list[int]], dict[str, list[Any]], int]:
    """Tokens and logprobs per request, and the most tokens one step gave."""
    plist = [params] * len(prompts) if isinstance(params, SamplingParams) else params
    for i, (p, sp) in enumerate(zip(prompts, plist, strict=True)):
        core.add_request(
            CoreRequest(request_id=f"r{i}", prompt_token_ids=tuple(p), params=sp)
        )
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    logprobs: dict[str, list[Any]] = {f"r{i}": [] for i in range(len(prompts))}
    most = 0
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens[out.request_id] += out.new_token_ids
            most = max(most, len(out.new_token_ids))
            if out.logprobs is not None:
                assert len(out.logprobs) == len(out.new_token_ids)
                logprobs[out.request_id] += out.logprobs
    pool = core.pool
    assert pool.num_used == 0 and pool.num_free == pool.num_blocks
    pool.audit()
    return tokens, logprobs, most


def spec_counts(core: EngineCore) -> tuple[int, int]:
    s = core.statistics().scheduler
    return s.num_draft_tokens, s.num_accepted_tokens


REPEATING = [
    tuple([5, 6, 7, 8, 9] * 8),
    tuple(list(range(20, 40)) * 3),
    tuple([11, 12] * 10 + [13, 14, 15] * 6),
]
RANDOM = [
    tuple(np.random.default_rng(s).integers(0, 256, size=n).tolist())
    for s, n in [(1, 7), (2, 40), (3, 90)]
]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def compare(
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    model: str = "tiny-random",
    **kw: Any,
) -> tuple[dict[str, list[int]], int, int]:
    """Run with and without speculation; the tokens must be equal."""
    plain, plain_lps, _ = run(core_for(model, spec=False, **kw), prompts, params)
    spec_core = core_for(model, spec=True, **kw)
    before = spec_counts(spec_core)
    tokens, lps, most = run(spec_core, prompts, params)
    assert tokens == plain
    for rid, entries in lps.items():
        want = plain_lps[rid]
        assert len(entries) == len(want)  # one per token, or none
        if not want:
            continue
        assert [e.sampled_rank for e in entries] == [e.sampled_rank for e in want]
        np.testing.assert_allclose(
            [e.sampled_logprob for e in entries],
            [e.sampled_logprob for e in want],
            rtol=1e-4,
            atol=1e-4,
        )
    after = spec_counts(spec_core)
    return tokens, after[1] - before[1], most


def test_greedy_is_identical_and_repeats_are_accepted() -> None:
    _, accepted, most = compare(REPEATING + RANDOM, GREEDY)
    assert accepted > 20 and most > 1


def test_greedy_is_identical_on_prompts_that_do_not_repeat() -> None:
    for prompt in RANDOM:
        compare([prompt], GREEDY)


def test_a_generated_checkpoint(tmp_path: Path) -> None:
    from structllm.models import make_tiny_model

    make_tiny_model(tmp_path / "m", arch="qwen3", vocab_size=300, seed=3)
    _, accepted, _ = compare(
        REPEATING + RANDOM,
        SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
        model=str(tmp_path / "m"),
    )
    assert accepted > 0


def test_logprobs_for_every_token() -> None:
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=3)
    _, accepted, _ = compare(REPEATING, params)
    assert accepted > 0


def test_stops_cut_inside_an_accepted_run() -> None:
    """max_tokens inside a run of accepted proposals, and stop tokens: the
    same tokens as without speculation. (A stop token inside an accepted
    run is test_scheduler's ``test_a_stop_inside_an_accepted_run...``.)"""
    prompt = REPEATING[0]
    plain, _, _ = run(core_for(spec=False), [prompt], GREEDY)
    out = plain["r0"]
    last = max(set(out), key=out.index)  # the latest new token
    cases: list[tuple[SamplingParams, list[int]]] = [
        (SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), out[:n])
        for n in (1, 2, 7, 30)
    ]
    first = out.index(last)
    cases.append(
        (
            SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[last]),
            out[: first + 1],
        )
    )
    for params, want in cases:
        tokens, _, _ = compare([prompt], params)
        assert tokens["r0"] == want
    assert spec_counts(core_for())[1] > 0


def test_seeded_sampling_is_reproducible_and_unchanged() -> None:
    params = [
        SamplingParams(temperature=t, top_k=k, seed=s, max_tokens=40, ignore_eos=True)
        for t, k, s in [(0.8, 0, 1), (0.3, 5, 2), (1.2, 0, 3)]
    ]
    prompts = [REPEATING[0], REPEATING[1], RANDOM[1]]
    first, accepted, _ = compare(prompts, params)
    again, _, _ = run(core_for(), prompts, params)
    assert again == first
    assert accepted > 0


def test_preemption(monkeypatch: pytest.MonkeyPatch) -> None:
    # 20 blocks of 16 hold one sequence of max_model_len (256) and a bit
    kw = {"num_blocks": 20, "enable_prefix_caching": False}
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    compare(REPEATING + RANDOM[:2], params, **kw)
    stats = core_for(**kw).statistics().scheduler
    assert stats.total_preemptions > 0 and stats.num_accepted_tokens > 0


def test_prefix_caching() -> None:
    core = core_for()
    hits = core.statistics().scheduler.prefix_cache_hits
    prompt = REPEATING[1]
    # the same prompt twice at once, then once more: blocks filled by a
    # verification step are shared and reused
    compare([prompt, prompt], GREEDY)
    compare([(*prompt, 1, 2, 3)], GREEDY)
    assert core.statistics().scheduler.prefix_cache_hits > hits


def test_speculation_pauses_for_a_large_batch() -> None:
    core = EngineCore(
        EngineConfig(
            model="tiny-random",
            max_model_len=256,
            num_blocks=64,
            speculative_config={**NGRAM, "disable_by_batch_size": 2},
        )
    )
    run(core, REPEATING, GREEDY)  # 3 running: none until one finishes
    alone = spec_counts(core)
    assert alone == (0, 0)
    run(core, REPEATING[:2], GREEDY)
    assert spec_counts(core)[1] > 0


def test_abort_during_verification_frees_every_block() -> None:
    core = core_for()
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    core.add_request(
        CoreRequest(request_id="a", prompt_token_ids=REPEATING[0], params=params)
    )
    drafts = core.statistics().scheduler.num_drafts
    while core.statistics().scheduler.num_drafts == drafts:
        core.step()
    # the verification step took blocks for proposals; some may be held yet
    assert core.pool.num_used > 0
    assert core.abort_requests(["a"]) == ["a"]
    assert core.pool.num_used == 0
    core.pool.audit()
    assert not core.has_unfinished_requests()


def test_a_stop_string_inside_an_accepted_run_ends_tokens_and_logprobs() -> None:
    """Several tokens a step reach the front end: a stop string met at one of
    them ends the text, the token ids and the logprobs there, as without
    speculation (the trained ``tiny`` repeats the licence its prompt holds)."""
    from structllm import LLM

    mit = (
        "Permission is hereby granted, free of charge, to any person obtaining "
        "a copy of this software and associated documentation files"
    )
    prompt = f"{mit}.\n\n{mit}.\n\nPermission is hereby granted"
    params = SamplingParams(
        temperature=0, max_tokens=40, stop=["obtaining"], logprobs=1
    )
    outs = [
        LLM("tiny", show_progress=False, speculative_config=spec).generate(
            [prompt], params
        )[0]
        for spec in (None, NGRAM)
    ]
    plain, fast = outs
    assert plain.finish_reason == fast.finish_reason == "stop"
    assert fast.text == plain.text and fast.text.endswith("any person ")
    assert fast.token_ids == plain.token_ids
    lp_fast, lp_plain = fast.outputs[0].logprobs, plain.outputs[0].logprobs
    assert lp_fast is not None and lp_plain is not None
    assert len(lp_fast) == len(fast.token_ids) == len(lp_plain)


@pytest.mark.anyio
async def test_the_front_end_counts_proposals_and_acceptances() -> None:
    from structllm import AsyncLLM

    async with AsyncLLM.open(
        "tiny-random", max_model_len=256, speculative_config=NGRAM
    ) as llm:
        for prompt in REPEATING[:2]:
            await llm.complete({"prompt_token_ids": list(prompt)}, GREEDY)
        stats = llm.statistics()
    assert stats.spec_decode_num_drafts > 0
    assert (
        0 < stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    )
    assert stats.spec_decode_acceptance_rate == (
        stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_draft_tokens
    )
