"""A draft model proposes; the target still decides every token.

Speculative decoding's ``"draft_model"`` method end to end in the engine
core: greedy outputs identical to the run without speculation with a draft
that is the target itself (every proposal accepted) and with another random
checkpoint of the same tokenizer (few accepted); seeded sampling unchanged;
the draft's own KV cache rolled back, evicted, and freed by every path a
request ends (finish, abort mid-verification, preemption); a draft of
another tokenizer refused by name; the counts reaching the front end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from structllm.config import EngineConfig
from structllm.core.draft import DRAFT_FIELD, DraftProposer, check_same_tokenizer
from structllm.core.engine_core import EngineCore
from structllm.core.request import CoreRequest, Request
from structllm.errors import EngineConfigError
from structllm.params import SamplingParams
from structllm.text.tokenizer import load_tokenizer

PROMPTS = [
    tuple(np.random.default_rng(s).integers(0, 250, size=n).tolist())
    for s, n in [(1, 7), (2, 40), (3, 90)]
]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def draft(model: str, **kw: Any) -> dict[str, Any]:
    return {
        "method": "draft_model",
        "model": model,
        "num_speculative_tokens": 4,
        "disable_by_batch_size": None,
        **kw,
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A target and a smaller, unrelated draft: random weights, one tokenizer."""
    from structllm.models import make_tiny_model

    root = tmp_path_factory.mktemp("draft")
    make_tiny_model(root / "target", arch="qwen3", vocab_size=300, seed=3)
    make_tiny_model(
        root / "draft", hidden_size=32, num_layers=1, vocab_size=300, seed=4
    )
    return str(root / "target"), str(root / "draft")


_CORES: dict[tuple[Any, ...], EngineCore] = {}


def core_for(model: str, spec: dict[str, Any] | None, **kw: Any) -> EngineCore:
    key = (model, repr(spec), tuple(sorted(kw.items())))
    if key not in _CORES:
        _CORES[key] = EngineCore(
            EngineConfig(
                model=model,
                max_model_len=256,
                speculative_config=spec,
                **{"num_blocks": 64, **kw},
            )
        )
    return _CORES[key]


def run(
    core: EngineCore,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
) -> dict[str, list[int]]:
    """Every request's tokens; then nothing is held, in either cache."""
    plist = [params] * len(prompts) if isinstance(params, SamplingParams) else params
    for i, (p, sp) in enumerate(zip(prompts, plist, strict=True)):
        core.add_request(
            CoreRequest(request_id=f"r{i}", prompt_token_ids=tuple(p), params=sp)
        )
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        step = core.step()
        ended = {o.request_id for o in step.outputs if o.finish_reason is not None}
        for out in step.outputs:
            tokens[out.request_id] += out.new_token_ids
        if core.draft is not None:  # a finished or preempted request: dropped
            assert not {*ended, *step.preempted} & {*core.draft._seqs}
    assert_holds_nothing(core)
    return tokens


def assert_holds_nothing(core: EngineCore) -> None:
    core.pool.audit()
    assert core.pool.num_used == 0
    if core.draft is not None:
        core.draft.pool.audit()
        assert core.draft.num_requests == 0
        assert core.draft.pool.num_used == 0


def counts(core: EngineCore) -> tuple[int, int]:
    s = core.statistics().scheduler
    return s.num_draft_tokens, s.num_accepted_tokens


def compare(
    model: str,
    spec: dict[str, Any],
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    **kw: Any,
) -> tuple[int, int]:
    """Outputs with the draft equal those without; (proposed, accepted)."""
    plain = run(core_for(model, None, **kw), prompts, params)
    core = core_for(model, spec, **kw)
    before = counts(core)
    assert run(core, prompts, params) == plain
    after = counts(core)
    return after[0] - before[0], after[1] - before[1]


def test_the_target_as_its_own_draft_is_always_right() -> None:
    proposed, accepted = compare("tiny-random", draft("tiny-random"), PROMPTS, GREEDY)
    assert proposed > 40
    assert accepted >= 0.95 * proposed  # near-ties may flip between paths


def test_another_checkpoint_of_the_same_tokenizer(checkpoints: tuple[str, str]) -> None:
    target, other = checkpoints
    same = compare(target, draft(target), PROMPTS, GREEDY)
    assert same[1] >= 0.95 * same[0] > 0
    proposed, accepted = compare(target, draft(other), PROMPTS, GREEDY)
    # an unrelated draft is mostly wrong, and the output is the target's
    assert proposed > 0 and accepted < 0.5 * proposed


def test_seeded_sampling_is_reproducible_and_unchanged(
    checkpoints: tuple[str, str],
) -> None:
    target, other = checkpoints
    params = [
        SamplingParams(temperature=t, top_k=k, seed=s, max_tokens=30, ignore_eos=True)
        for t, k, s in [(0.8, 0, 1), (0.3, 5, 2), (1.2, 0, 3)]
    ]
    for ref in (target, other):
        compare(target, draft(ref), PROMPTS, params)
    first = run(core_for(target, draft(other)), PROMPTS, params)
    assert run(core_for(target, draft(other)), PROMPTS, params) == first


def test_preemption_drops_the_draft_state() -> None:
    kw = {"num_blocks": 20, "enable_prefix_caching": False}
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    compare("tiny-random", draft("tiny-random"), PROMPTS, params, **kw)
    stats = core_for("tiny-random", draft("tiny-random"), **kw).statistics()
    assert stats.scheduler.total_preemptions > 0
    assert stats.scheduler.num_accepted_tokens > 0


class Checked:
    """Each of the live draft's proposals against a fresh draft's (an empty
    cache that computes the request's whole sequence): equal, whatever the
    live one kept, rolled back or evicted before."""

    def __init__(self, live: DraftProposer) -> None:
        self.live = live
        self.fresh = DraftProposer(
            live.model,
            num_blocks=live.pool.num_blocks,
            block_size=live.pool.block_size,
            max_len=live.max_len,
            vocab_size=live.vocab_size,
            max_chunk=live.max_chunk,
        )
        self.calls = 0

    def propose(self, request: Request, k: int) -> list[int]:
        got = self.live.propose(request, k)
        want = self.fresh.propose(request, k)
        self.fresh.release(request.request_id)
        assert got == want
        seq = self.live._seqs[request.request_id]
        # the request's tokens and every guess but the last, in whole blocks
        assert seq.num_seen == request.num_tokens
        assert len(seq.written) == len(got) - 1
        held = seq.num_seen + len(seq.written)
        assert len(seq.block_ids) == self.live.pool.blocks_for(held)
        self.calls += 1
        return got


def test_the_draft_cache_keeps_what_is_still_right(
    checkpoints: tuple[str, str],
) -> None:
    """Rolled back to the accepted proposals after each verification: the
    next proposals are those of a draft that computed everything afresh."""
    target, other = checkpoints
    for ref in (target, other):
        core = EngineCore(
            EngineConfig(
                model=target,
                max_model_len=256,
                num_blocks=64,
                speculative_config=draft(ref),
            )
        )
        assert core.draft is not None
        checked = core.scheduler.proposer = Checked(core.draft)
        out = run(core, PROMPTS, GREEDY)
        assert out == run(core_for(target, None), PROMPTS, GREEDY)
        assert checked.calls > 10
        # incremental: far fewer positions than recomputing each time
        assert core.draft.num_tokens < checked.fresh.num_tokens / 3


def test_more_requests_than_the_draft_cache_holds() -> None:
    """The draft's cache holds four sequences; six long requests speculating
    at once evict one another's state, which catches up when next needed."""
    prompts = [
        tuple(np.random.default_rng(s).integers(0, 250, size=180).tolist())
        for s in range(6)
    ]
    spec = draft("tiny-random")
    core = EngineCore(
        EngineConfig(
            model="tiny-random",
            max_model_len=256,
            num_blocks=128,
            speculative_config=spec,
        )
    )
    assert core.draft is not None and core.draft.pool.num_blocks == 4 * 16
    checked = core.scheduler.proposer = Checked(core.draft)
    plain = run(core_for("tiny-random", None, num_blocks=128), prompts, GREEDY)
    assert run(core, prompts, GREEDY) == plain
    assert core.draft.num_evictions > 0 and checked.calls > 0
    assert core.statistics().scheduler.total_preemptions == 0


def test_abort_during_verification_frees_both_caches(
    checkpoints: tuple[str, str],
) -> None:
    target, other = checkpoints
    for ref in (target, other):
        core = core_for(target, draft(ref))
        params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        core.add_request(
            CoreRequest(request_id="a", prompt_token_ids=PROMPTS[1], params=params)
        )
        drafts = core.statistics().scheduler.num_drafts
        while core.statistics().scheduler.num_drafts == drafts:
            core.step()
        assert core.draft is not None and core.draft.pool.num_used > 0
        assert core.abort_requests(["a"]) == ["a"]
        assert not core.has_unfinished_requests()
        assert_holds_nothing(core)


def test_a_draft_of_a_shorter_context_proposes_within_it(
    tmp_path_factory: pytest.TempPathFactory, checkpoints: tuple[str, str]
) -> None:
    """A draft that knows 64 positions drafts for a target of 256 while the
    sequence fits in them, and nothing past; the output is the target's."""
    from structllm.models import make_tiny_model

    target, _ = checkpoints
    short = tmp_path_factory.mktemp("short") / "draft"
    make_tiny_model(short, vocab_size=300, seed=5, max_position_embeddings=64)
    spec = draft(str(short))
    core = core_for(target, spec)
    live = core.draft
    assert live is not None and live.max_len == 64
    seen: list[tuple[int, int]] = []  # (tokens so far, proposals)

    class Recorded:
        def propose(self, request: Request, k: int) -> list[int]:
            assert live is not None
            out = live.propose(request, k)
            seen.append((request.num_tokens, len(out)))
            return out

    core.scheduler.proposer = Recorded()
    compare(target, spec, [PROMPTS[1]], GREEDY)  # 40 tokens, then 40 more
    # the last guess is read at position size + n - 2 <= 63
    assert all(size + n - 1 <= 64 for size, n in seen if n)
    assert any(n for size, n in seen) and any(size > 64 for size, _ in seen)


def test_warm_up_runs_a_proposal_on_scratch_blocks(
    checkpoints: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """At load the draft runs a catch-up and the guesses after it, as the
    target's warm-up runs a short request; its blocks and counts are then
    free and zero, and a pool too small to propose warms nothing."""
    target, small = checkpoints
    core = core_for(target, draft(small), max_num_seqs=2)
    assert core.draft is not None
    assert (core.draft.num_forwards, core.draft.num_tokens) == (0, 0)
    assert core.draft.pool.num_used == 0 and core.draft.num_requests == 0

    def proposer(num_blocks: int) -> tuple[DraftProposer, list[tuple[int, int]]]:
        assert core.draft is not None
        fresh = DraftProposer(
            core.draft.model,
            num_blocks=num_blocks,
            block_size=4,
            max_len=256,
            vocab_size=300,
            max_chunk=64,
        )
        calls: list[tuple[int, int]] = []
        forward = fresh._forward

        def spy(block_ids: list[int], tokens: Sequence[int], start: int) -> int:
            calls.append((start, len(tokens)))
            return forward(block_ids, tokens, start)

        monkeypatch.setattr(fresh, "_forward", spy)
        return fresh, calls

    warm, calls = proposer(8)
    warm.warm_up(4)
    assert calls == [(0, 8), (8, 1), (9, 1), (10, 1)]  # 8 tokens, 3 guesses
    warm.pool.audit()
    assert warm.pool.num_used == 0 and warm.num_forwards == warm.num_tokens == 0
    cramped, calls = proposer(2)  # 11 positions need 3 blocks of 4
    cramped.warm_up(4)
    assert calls == [] and cramped.pool.num_used == 0


def test_a_draft_of_another_tokenizer_is_refused_by_name(
    checkpoints: tuple[str, str],
) -> None:
    target, _ = checkpoints
    with pytest.raises(EngineConfigError, match="vocabulary of 258") as info:
        EngineCore(
            EngineConfig(
                model=target,
                max_model_len=64,
                speculative_config=draft("tiny-random"),
            )
        )
    assert info.value.field == DRAFT_FIELD == "speculative_config.model"


class _Swapped:
    """A tokenizer with two ids' pieces exchanged (same size, other ids)."""

    def __init__(self, inner: Any, a: int, b: int) -> None:
        self.inner, self.swap = inner, {a: b, b: a}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def id_to_piece(self, token_id: int) -> str:
        return str(self.inner.id_to_piece(self.swap.get(token_id, token_id)))


def test_the_tokenizer_check_compares_ids(checkpoints: tuple[str, str]) -> None:
    target, other = checkpoints
    tok = load_tokenizer(target)
    check_same_tokenizer(tok, load_tokenizer(other), other)
    with pytest.raises(EngineConfigError, match="id 0 is") as info:
        check_same_tokenizer(tok, _Swapped(tok, 0, 299), "swapped")  # type: ignore[arg-type]
    assert info.value.field == DRAFT_FIELD


@pytest.mark.anyio
async def test_the_front_end_counts_draft_proposals_and_an_early_exit_frees_all() -> (
    None
):
    from structllm import AsyncLLM
    from structllm.params import OutputKind
    from tests.core_record import assert_core_holds_nothing

    async with AsyncLLM.open(
        "tiny-random",
        max_model_len=256,
        speculative_config=draft("tiny-random"),
        executor="inline",
    ) as llm:
        for prompt in PROMPTS[:2]:
            await llm.complete({"prompt_token_ids": list(prompt)}, GREEDY)
        stats = llm.statistics()
        # leave a stream after a step that verified proposals (several
        # tokens in one delta): the core holds nothing before its next step
        params = SamplingParams(
            temperature=0, max_tokens=200, ignore_eos=True, output_kind=OutputKind.DELTA
        )
        async with llm.stream({"prompt_token_ids": list(PROMPTS[2])}, params) as s:
            async for out in s:
                if len(out.outputs[0].token_ids) > 1:
                    break
        assert s.finish_reason == "abort"
        await assert_core_holds_nothing(llm)
    assert stats.spec_decode_num_drafts > 0
    assert (
        0.95 * stats.spec_decode_num_draft_tokens
        <= stats.spec_decode_num_accepted_tokens
        <= stats.spec_decode_num_draft_tokens
    )
