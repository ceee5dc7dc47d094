"""Structured output under speculative decoding: the grammar cuts each
proposal at the first token it refuses and masks every verified position, so
a constrained request speculates and still gives, token for token, the
output it gives without speculation.

The matcher's draft checks and per-position masks against stepping a fresh
matcher; the sampler's verification under per-position masks against
step-by-step masked sampling; and the engine core end to end (JSON schema,
regex, choice; greedy, seeded, logprobs, max_tokens inside an accepted run,
a stop string and n > 1, the grammar's forced tokens as proposals, proposals
the grammar refuses, a draft model, a broken matcher, preemption, an abort
during a verification step), on the random-weight ``tiny-random`` model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from structllm import LLM
from structllm.config import EngineConfig
from structllm.core.engine_core import EngineCore
from structllm.core.request import CoreRequest, Request
from structllm.model.sampler import Sampler, SamplingRow, make_generator
from structllm.params import SamplingParams
from structllm.structured import (
    GrammarCompiler,
    GrammarMatcher,
    GrammarVocabulary,
    StructuredOutputs,
    allocate_bitmask,
)
from structllm.text import ByteTokenizer

TOKENIZER = ByteTokenizer()
EOS = 257

SCHEMA = StructuredOutputs(
    json={
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "city": {"enum": ["Paris", "Lisbon"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "city", "count"],
        "additionalProperties": False,
    }
)
REGEX = StructuredOutputs(regex=r"(Paris|Lisbon)( (Paris|Lisbon)){2,6}")
CHOICE = StructuredOutputs(
    choice=["Paris is lovely in the spring", "Lisbon is lovely in the spring"]
)
#: each constraint with a prompt that repeats what its output copies (the
#: compact JSON separators are ", " and ": "), so prompt lookup proposes
CASES = {
    "json": (
        SCHEMA,
        'Copy: {"name": "Ada", "city": "Paris", "count": 7}\n'
        '{"name": "Bob", "city": "Lisbon", "count": 12}\n',
    ),
    "regex": (REGEX, "Paris Lisbon Paris Lisbon Lisbon Paris Paris"),
    "choice": (
        CHOICE,
        "Paris is lovely in the spring. Lisbon is lovely in the spring.",
    ),
}


def prompt_ids(text: str) -> tuple[int, ...]:
    return tuple(TOKENIZER.encode(text))


# -- the matcher ------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(GrammarVocabulary.from_tokenizer(TOKENIZER))


def masks_stepping(
    compiler: GrammarCompiler,
    spec: StructuredOutputs,
    before: Sequence[int],
    drafts: Sequence[int],
) -> npt.NDArray[np.int32]:
    """The masks after ``before`` and each prefix of ``drafts``, from a fresh
    matcher per position (no rollback involved)."""
    rows = []
    for j in range(len(drafts) + 1):
        m = compiler.compile(spec).matcher()
        assert m.accept_tokens([*before, *drafts[:j]]) == len(before) + j
        mask = allocate_bitmask(1, m.vocabulary)
        m.fill_bitmask(mask, 0)
        rows.append(mask[0])
    return np.stack(rows)


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    ("spec", "before", "drafts", "valid"),
    [
        # "Par" then "is" and a refused "x": two of the four checked
        (REGEX, ids("Par"), [*ids("is"), *ids("x "), *ids("L")], 2),
        (REGEX, ids("Paris Lis"), ids("bon Paris"), 9),
        # EOS once complete, and nothing after it
        (CHOICE, ids("Lisbon is lovely in the sprin"), [*ids("g"), EOS, 5], 2),
        (SCHEMA, ids('{"name": "A'), ids('", "city": "Pa'), 14),
        # "c" may begin "city", "co" not: the schema's order holds
        (SCHEMA, ids('{"name": "A'), ids('", "count": 1'), 5),
    ],
)
def test_draft_checks_and_masks_leave_the_matcher_as_it_was(
    compiler: GrammarCompiler,
    spec: StructuredOutputs,
    before: list[int],
    drafts: list[int],
    valid: int,
) -> None:
    m = compiler.compile(spec).matcher()
    assert m.accept_tokens(before) == len(before)
    assert m.validate_tokens(drafts) == valid
    assert m.num_tokens == len(before)
    bitmask = allocate_bitmask(len(drafts) + 3, m.vocabulary)
    bitmask[:] = 0
    m.fill_draft_bitmask(drafts, bitmask, 1)
    assert m.num_tokens == len(before)
    assert not bitmask[0].any() and not bitmask[len(drafts) + 2].any()
    rows = bitmask[1 : len(drafts) + 2]
    stepping = masks_stepping(compiler, spec, before, drafts[:valid])
    np.testing.assert_array_equal(rows[: valid + 1], stepping)
    assert (rows[valid + 1 :] == -1).all()  # past the refused draft: unused
    # the matcher still follows its own tokens: the same next mask
    again = allocate_bitmask(1, m.vocabulary)
    m.fill_bitmask(again, 0)
    np.testing.assert_array_equal(again[0], stepping[0])


def test_a_draft_mask_after_eos_allows_eos_alone(compiler: GrammarCompiler) -> None:
    m = compiler.compile(StructuredOutputs(choice=["yes"])).matcher()
    bitmask = allocate_bitmask(5, m.vocabulary)
    m.fill_draft_bitmask([*ids("yes"), EOS], bitmask, 0)
    bits = np.unpackbits(bitmask[4].view(np.uint8), bitorder="little")
    assert np.flatnonzero(bits).tolist() == [EOS]
    assert m.num_tokens == 0 and not m.is_terminated()


# -- the sampler: a mask per verified position ---------------------------------------


def pack(allowed: Sequence[set[int]], vocab: int) -> npt.NDArray[np.int32]:
    bits = np.zeros((len(allowed), (vocab + 31) // 32 * 32), dtype=np.uint8)
    for i, allowed_ids in enumerate(allowed):
        bits[i, sorted(allowed_ids)] = 1
    return np.packbits(bits, axis=1, bitorder="little").view(np.int32)


V = 6
SAMPLER = Sampler()


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    data=st.data(),
    params=st.builds(
        SamplingParams,
        temperature=st.sampled_from([0.0, 0.7, 1.5]),
        top_k=st.sampled_from([0, 2]),
        presence_penalty=st.sampled_from([0.0, 1.0]),
        logprobs=st.sampled_from([None, 1]),
    ),
)
def test_verification_samples_each_position_under_its_own_mask(
    seed: int, data: st.DataObject, params: SamplingParams
) -> None:
    drafts = data.draw(st.lists(st.integers(0, V - 1), max_size=4))
    n = len(drafts) + 1
    allowed = data.draw(
        st.lists(st.sets(st.integers(0, V - 1), min_size=1), min_size=n, max_size=n)
    )
    logits = np.asarray(
        data.draw(
            st.lists(
                st.lists(st.sampled_from([0.0, 0.5, 2.0]), min_size=V, max_size=V),
                min_size=n,
                max_size=n,
            )
        ),
        np.float32,
    )
    mask = pack(allowed, V)
    # an unconstrained request with proposals of its own comes first
    free = SamplingRow(SamplingParams(temperature=1.0), make_generator(1))
    batch = np.concatenate([np.zeros((2, V), np.float32), logits])
    row = SamplingRow(params, make_generator(seed))
    out = SAMPLER.verify(
        batch, [free, row], [(3,), drafts], bitmask=mask, bitmask_rows=[1]
    )
    # step by step without speculation, each step under its mask
    gen = make_generator(seed)
    want: list[int] = []
    for j in range(n):
        one = SamplingRow(params, gen, output_token_ids=tuple(want))
        token = SAMPLER.sample(logits[j : j + 1], [one], bitmask=mask[j : j + 1])
        want.append(int(token.token_ids[0]))
        assert want[-1] in allowed[j]
        if j == len(drafts) or want[-1] != drafts[j]:
            break
    assert list(out.token_ids[1]) == want
    assert row.generator.random() == gen.random()
    lps = out.logprobs[1]
    assert (lps is None) == (params.logprobs is None)
    assert lps is None or len(lps) == len(want)


def test_too_few_mask_rows_for_the_positions_are_refused() -> None:
    row = SamplingRow(SamplingParams(temperature=0), make_generator(0))
    with pytest.raises(ValueError, match="3 positions to mask"):
        SAMPLER.verify(
            np.zeros((3, V), np.float32), [row], [(1, 2)], bitmask=pack([{1}], V)
        )


# -- the engine core end to end --------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None}
_CORES: dict[tuple[Any, ...], EngineCore] = {}


def core_for(spec: bool = True, **kw: Any) -> EngineCore:
    key = (spec, tuple(sorted(kw.items())))
    if key not in _CORES:
        _CORES[key] = EngineCore(
            EngineConfig(
                model="tiny-random",
                speculative_config=NGRAM if spec else None,
                **{"max_model_len": 512, "num_blocks": 64, **kw},
            )
        )
    return _CORES[key]


@attrs.frozen
class Run:
    tokens: dict[str, list[int]]
    finish: dict[str, str | None]
    logprobs: dict[str, list[Any]]


def run(
    core: EngineCore,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
) -> Run:
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        core.add_request(
            CoreRequest(request_id=f"r{i}", prompt_token_ids=tuple(p), params=sp)
        )
    got = Run({f"r{i}": [] for i in range(len(prompts))}, {}, {})
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            got.tokens[out.request_id] += out.new_token_ids
            if out.logprobs is not None:
                assert len(out.logprobs) == len(out.new_token_ids)
                got.logprobs.setdefault(out.request_id, []).extend(out.logprobs)
            if out.finish_reason is not None:
                got.finish[out.request_id] = out.finish_reason
    assert core.pool.num_used == 0
    core.pool.audit()
    return got


def spec_counts(core: EngineCore) -> tuple[int, int, int]:
    s = core.statistics().scheduler
    return s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens


def compare(
    prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], **kw: Any
) -> tuple[Run, int]:
    """Run with and without speculation: the same tokens, finish reasons and
    logprobs. Returns the run and the proposals accepted in it."""
    plain = run(core_for(spec=False, **kw), prompts, params)
    core = core_for(**kw)
    before = spec_counts(core)[2]
    fast = run(core, prompts, params)
    assert fast.tokens == plain.tokens
    assert fast.finish == plain.finish
    assert fast.logprobs.keys() == plain.logprobs.keys()
    for rid, entries in fast.logprobs.items():
        want = plain.logprobs[rid]
        assert [e.sampled_rank for e in entries] == [e.sampled_rank for e in want]
        np.testing.assert_allclose(
            [e.sampled_logprob for e in entries],
            [e.sampled_logprob for e in want],
            rtol=1e-4,
            atol=1e-4,
        )
    return fast, spec_counts(core)[2] - before


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_is_identical_and_proposals_are_accepted(case: str) -> None:
    spec, text = CASES[case]
    params = SamplingParams(
        temperature=0, max_tokens=80, logprobs=2, structured_outputs=spec
    )
    got, accepted = compare([prompt_ids(text)], [params])
    assert got.finish == {"r0": "stop"}
    assert accepted > 0


def test_prompt_lookup_alone_is_accepted_under_the_grammar(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The grammar's forced tokens off: the n-gram proposals that copy the
    prompt's fields are accepted."""
    monkeypatch.setattr(GrammarMatcher, "forced_tokens", lambda self: [])
    spec, text = CASES["json"]
    params = SamplingParams(temperature=0, max_tokens=80, structured_outputs=spec)
    _, accepted = compare([prompt_ids(text)], [params])
    assert accepted > 0


def test_seeded_sampling_is_identical_and_reproducible() -> None:
    params = [
        SamplingParams(
            temperature=t, top_k=k, seed=s, max_tokens=80, structured_outputs=spec
        )
        for spec, _ in CASES.values()
        for t, k, s in [(1.0, 0, 1), (0.7, 20, 2)]
    ]
    prompts = [prompt_ids(text) for _, text in CASES.values() for _ in range(2)]
    first, accepted = compare(prompts, params)
    again = run(core_for(), prompts, params)
    assert again.tokens == first.tokens
    assert accepted > 0


def test_a_draft_model_proposes_under_the_grammar_too() -> None:
    """``draft_model`` (the target as its own draft): its unconstrained
    guesses are cut by the grammar like prompt lookup's; the outputs are
    those without speculation."""
    draft = {**NGRAM, "method": "draft_model", "model": "tiny-random"}
    core = EngineCore(
        EngineConfig(
            model="tiny-random",
            max_model_len=512,
            num_blocks=64,
            speculative_config=draft,
        )
    )
    prompts = [prompt_ids(text) for _, text in CASES.values()] * 2
    params = [
        SamplingParams(temperature=t, seed=4, max_tokens=80, structured_outputs=spec)
        for t in (0.0, 1.0)
        for spec, _ in CASES.values()
    ]
    fast = run(core, prompts, params)
    plain = run(core_for(spec=False), prompts, params)
    assert (fast.tokens, fast.finish) == (plain.tokens, plain.finish)
    assert spec_counts(core)[2] > 0


def test_max_tokens_inside_an_accepted_run() -> None:
    spec, text = CASES["json"]
    greedy = SamplingParams(temperature=0, max_tokens=80, structured_outputs=spec)
    full = run(core_for(spec=False), [prompt_ids(text)], [greedy]).tokens["r0"]
    for n in (1, 3, 9, 20):
        params = attrs.evolve(greedy, max_tokens=n)
        got, _ = compare([prompt_ids(text)], [params])
        assert got.tokens["r0"] == full[:n]
        assert got.finish["r0"] == "length"


@attrs.define
class Oracle:
    """Proposes what the run without speculation generated next, with
    ``refused`` (a token the grammar never allows) at proposal ``at``."""

    outputs: list[int]
    at: int | None = None
    refused: int = 1  # a control character: no JSON token, in or out of strings

    def propose(self, request: Request, k: int) -> list[int]:
        n = len(request.output_token_ids)
        guess = self.outputs[n : n + k]
        if self.at is not None and len(guess) > self.at:
            guess[self.at] = self.refused
        return guess


@pytest.mark.parametrize("at", [None, 1])
def test_masks_are_right_at_every_position_and_refused_proposals_are_cut(
    at: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proposing exactly what greedy decoding gives (the grammar's forced
    tokens off): every proposal is accepted (a position's mask that was not
    its grammar state would change the argmax somewhere). With a refused
    token at proposal 1, every verification proposes one token: the
    grammar cut the rest."""
    monkeypatch.setattr(GrammarMatcher, "forced_tokens", lambda self: [])
    spec, text = CASES["json"]
    params = SamplingParams(temperature=0, max_tokens=80, structured_outputs=spec)
    prompt = prompt_ids(text)
    want = run(core_for(spec=False), [prompt], [params]).tokens["r0"]
    core = core_for()
    proposer = core.scheduler.proposer
    core.scheduler.proposer = Oracle(want, at)
    try:
        before = spec_counts(core)
        got = run(core, [prompt], [params]).tokens["r0"]
    finally:
        core.scheduler.proposer = proposer
    drafts, proposed, accepted = (
        a - b for a, b in zip(spec_counts(core), before, strict=True)
    )
    assert got == want
    assert drafts > 0 and accepted == proposed
    if at is None:
        assert proposed > drafts
    else:
        assert proposed == drafts


def test_the_grammar_proposes_the_tokens_it_forces() -> None:
    """With a proposer that guesses nothing, the JSON schema's forced tokens
    (``{"name": "``, ``", "city": "``, ...) are proposed and accepted, and
    never while the next token is free: every proposal is accepted."""
    spec, text = CASES["json"]
    params = SamplingParams(temperature=0, max_tokens=80, structured_outputs=spec)
    prompt = prompt_ids(text)
    want = run(core_for(spec=False), [prompt], [params]).tokens["r0"]
    core = core_for()
    proposer = core.scheduler.proposer
    core.scheduler.proposer = Oracle([])
    try:
        before = spec_counts(core)
        got = run(core, [prompt], [params]).tokens["r0"]
    finally:
        core.scheduler.proposer = proposer
    drafts, proposed, accepted = (
        a - b for a, b in zip(spec_counts(core), before, strict=True)
    )
    assert got == want
    assert drafts > 0 and accepted == proposed >= 10


def test_forced_tokens(compiler: GrammarCompiler) -> None:
    m = compiler.compile(SCHEMA).matcher()
    forced = m.forced_tokens()
    assert forced and '{"name": "'.startswith(TOKENIZER.decode(forced))
    assert m.validate_tokens(forced) == len(forced) and m.num_tokens == 0
    m.accept_tokens(ids('{"name": "Ada'))
    assert m.forced_tokens() == []  # the string may go on
    m.accept_tokens(ids('"'))
    assert TOKENIZER.decode(m.forced_tokens()).startswith(', "city": ')
    m = compiler.compile(StructuredOutputs(choice=["yes"])).matcher()
    m.accept_tokens([*ids("yes"), EOS])
    assert m.forced_tokens() == []


def test_a_stop_string_and_n_samples_through_the_front_end() -> None:
    """``LLM``: a stop string met inside an accepted run, and n = 2 seeded
    samples (two core requests, a matcher each), as without speculation."""
    spec, text = CASES["regex"]
    params = [
        SamplingParams(
            temperature=0, max_tokens=60, stop=["Paris P"], structured_outputs=spec
        ),
        SamplingParams(n=2, seed=5, max_tokens=60, logprobs=1, structured_outputs=spec),
    ]
    outs = [
        LLM("tiny-random", show_progress=False, max_model_len=512, **kw).generate(
            [text, text], params, use_tqdm=False
        )
        for kw in ({}, {"speculative_config": NGRAM})
    ]
    plain, fast = outs
    for a, b in zip(plain, fast, strict=True):
        assert [o.text for o in a.outputs] == [o.text for o in b.outputs]
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        assert [o.finish_reason for o in a.outputs] == [
            o.finish_reason for o in b.outputs
        ]


def test_preemption() -> None:
    """Preempted by recompute mid-way, speculating requests keep their
    grammar state (it follows the output alone: proposals are rolled back)."""
    # prompts of 4 blocks, outputs of ~3: two run at once, then outgrow 10
    kw = {"num_blocks": 10, "block_size": 16, "max_model_len": 128}
    text = '{"name": "Ada", "city": "Paris", "count": 7}\n'
    prompts = [prompt_ids(f"{i} {text}") for i in range(4)]
    params = [
        SamplingParams(temperature=0, max_tokens=60, structured_outputs=SCHEMA)
    ] * len(prompts)
    compare(prompts, params, **kw)
    stats = core_for(**kw).statistics().scheduler
    assert stats.total_preemptions > 0 and stats.num_accepted_tokens > 0


def test_a_broken_grammar_ends_the_request_as_without_speculation() -> None:
    """A matcher llguidance gave up on (a resource limit; here a token fed
    past the checks) proposes nothing and ends its request with "error",
    its tokens the same as without speculation broken at the same point."""
    spec, text = CASES["json"]
    params = SamplingParams(temperature=0, max_tokens=80, structured_outputs=spec)

    def broken_at(core: EngineCore, at: int) -> tuple[list[int], int, str | None]:
        core.add_request(
            CoreRequest(
                request_id="r", prompt_token_ids=prompt_ids(text), params=params
            )
        )
        tokens: list[int] = []
        finish = None
        broke = 0
        while core.has_unfinished_requests():
            if len(tokens) >= at and not broke:
                grammar = core.scheduler.requests["r"].grammar
                assert grammar is not None
                grammar._matcher.consume_token(1)  # refused: its error state
                assert grammar.error is not None
                broke = len(tokens)
            for out in core.step().outputs:
                tokens += out.new_token_ids
                finish = out.finish_reason
        assert core.pool.num_used == 0
        return tokens, broke, finish

    fast = broken_at(core_for(), 12)  # speculating: some point past 12
    assert broken_at(core_for(spec=False), fast[1]) == fast
    assert fast[2] == "error"


def test_abort_during_verification_frees_every_block() -> None:
    spec, text = CASES["json"]
    params = SamplingParams(temperature=0, max_tokens=80, structured_outputs=spec)
    core = core_for()
    core.add_request(
        CoreRequest(request_id="a", prompt_token_ids=prompt_ids(text), params=params)
    )
    drafts = core.statistics().scheduler.num_drafts
    while core.statistics().scheduler.num_drafts == drafts:
        assert core.has_unfinished_requests()
        core.step()
    assert core.pool.num_used > 0
    assert core.abort_requests(["a"]) == ["a"]
    assert core.pool.num_used == 0
    core.pool.audit()
    assert not core.has_unfinished_requests()
    # and it serves on, speculating, as without speculation
    _, accepted = compare([prompt_ids(text)], [params])
    assert accepted > 0
