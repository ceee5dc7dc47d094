"""tools/compare_llamacpp_tokens.py's analysis: where two greedy runs part,
how close a call that step was, and the totals (no llama.cpp, no model)."""

from __future__ import annotations

import pytest

from tests.tool_modules import load_tool

tool = load_tool("compare_llamacpp_tokens")


@pytest.mark.parametrize(
    ("ours", "theirs", "expected"),
    [
        ([5, 6, 7], [5, 6, 7], None),
        ([], [], None),
        ([5, 6, 7], [5, 9, 7], 1),
        ([4, 6, 7], [5, 6, 7], 0),
        # one engine stopped (end of sequence) where the other went on
        ([5, 6], [5, 6, 7], 2),
        ([5, 6, 7, 8], [5, 6], 2),
        ([], [3], 0),
    ],
)
def test_first_divergence(
    ours: list[int], theirs: list[int], expected: int | None
) -> None:
    assert tool.first_divergence(ours, theirs) == expected


def test_top2_margin_is_the_gap_between_the_two_best() -> None:
    assert tool.top2_margin({3: -0.5, 9: -2.0}) == pytest.approx(1.5)
    # order in the mapping does not matter, nor a third entry
    assert tool.top2_margin({9: -2.0, 1: -7.0, 3: -0.5}) == pytest.approx(1.5)
    assert tool.top2_margin({3: -0.1}) is None
    assert tool.top2_margin(None) is None


def test_strip_stop_removes_only_a_final_stop_token() -> None:
    stop = frozenset({0, 2})
    assert tool.strip_stop([5, 6, 2], stop) == [5, 6]
    assert tool.strip_stop([5, 2, 6], stop) == [5, 2, 6]
    assert tool.strip_stop([], stop) == []


def test_compare_prompt_takes_both_margins_at_the_first_difference() -> None:
    ours = [5, 6, 8, 1]
    theirs = [5, 6, 7, 1, 4]
    our_steps = [{5: -0.1, 1: -3.0}, {6: -0.2, 1: -2.0}, {8: -1.0, 7: -1.004}, None]
    their_steps = [{5: -0.1, 1: -3.0}, {6: -0.2, 1: -2.0}, {7: -0.9, 8: -1.2}]
    row = tool.compare_prompt(ours, theirs, our_steps, their_steps)
    assert (row.divergence, row.matched, row.total) == (2, 2, 5)
    assert row.margin == pytest.approx(0.004)
    assert row.llama_margin == pytest.approx(0.3)


def test_compare_prompt_without_a_difference_or_without_steps() -> None:
    same = tool.compare_prompt([1, 2], [1, 2], [], [])
    assert (same.divergence, same.matched, same.total) == (None, 2, 2)
    assert same.margin is None and same.llama_margin is None
    # a stop one step early: the margin is the stop step's, if recorded
    short = tool.compare_prompt([1], [1, 2], [{1: -0.1, 9: -1.0}], [])
    assert (short.divergence, short.matched) == (1, 1)
    assert short.margin is None


def test_agreement_counts_identical_prompts_positions_and_near_ties() -> None:
    row = tool.PromptComparison
    rows = [
        row(divergence=None, matched=4, total=4, margin=None, llama_margin=None),
        row(divergence=1, matched=1, total=4, margin=0.005, llama_margin=0.2),
        row(divergence=0, matched=0, total=2, margin=0.5, llama_margin=0.01),
        row(divergence=3, matched=3, total=6, margin=None, llama_margin=None),
    ]
    total = tool.agreement(rows, near_tie=1e-2)
    assert (total.prompts, total.identical, total.divergent) == (4, 1, 3)
    assert total.positions == pytest.approx(8 / 16)
    # only structllm's margin decides a near-tie; an unknown one is not
    assert total.near_ties == 1
    assert total.margins == (0.005, 0.5, None)
    assert tool.agreement([], near_tie=1e-2).positions == 1.0
