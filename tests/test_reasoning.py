"""Reasoning split from the answer: the parser, then chat through the server.

The parser is checked on texts split at every boundary (Hypothesis): a
streamed answer adds up to the whole one whatever the pieces. Through the
server, the random ``tiny-random`` model's continuation is made known by
the prompt: a continued assistant message that opened ``<think>`` leaves the
parser in the reasoning, so the whole output is reasoning and equals a plain
completion of the same prompt.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from structllm.text.reasoning import (
    ReasoningDelta,
    ReasoningParser,
    new_parser,
    parser_for_template,
    split,
)

QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
R1_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% else %}<｜Assistant｜>{{ m.content.split('</think>')[-1] }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"
)


def whole(name: str, prompt: str, text: str, **kw: Any) -> tuple[str, str]:
    d = split(new_parser(name, prompt, kw), text)
    return d.reasoning, d.content


@pytest.mark.parametrize(
    ("name", "prompt", "text", "expected"),
    [
        # Qwen3 writes <think> itself; the answer after </think> loses its "\n\n"
        (
            "qwen3",
            "<|im_start|>assistant\n",
            "<think>\nHm.\n</think>\n\nHi",
            ("Hm.", "Hi"),
        ),
        ("qwen3", "", "Hi <think>", ("", "Hi <think>")),
        ("qwen3", "", "  Hi", ("", "  Hi")),
        # a prompt that closed the block (enable_thinking false): all answer
        ("qwen3", "<think>\n\n</think>\n\n", "a</think>b", ("", "a</think>b")),
        # a prompt that opened it: reasoning until </think>
        ("qwen3", "x<think>\n", "a b\n</think>\n\nc", ("a b", "c")),
        ("qwen3", "<think>", "cut short", ("cut short", "")),
        # DeepSeek-R1: before </think> is reasoning, with or without <think>
        ("deepseek_r1", "", "a</think>b", ("a", "b")),
        ("deepseek_r1", "", "<think>a</think>b", ("a", "b")),
        ("deepseek_r1", "", "no end", ("no end", "")),
        ("deepseek_r1", "<think>x</think>", "answer", ("", "answer")),
        ("deepseek_r1", "", "</think>", ("", "")),
        ("qwen3", "<think>", "a </thi", ("a </thi", "")),
    ],
)
def test_split(name: str, prompt: str, text: str, expected: tuple[str, str]) -> None:
    assert whole(name, prompt, text) == expected


def test_enable_thinking_false_is_all_answer() -> None:
    kw = {"enable_thinking": False}
    assert whole("deepseek_r1", "<think>", "a</think>b", **kw) == ("", "a</think>b")
    assert whole("qwen3", "", "<think>a</think>b", **kw) == ("", "<think>a</think>b")


def test_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="granite"):
        new_parser("granite", "")


PIECES = st.lists(
    st.sampled_from(
        ["<think>", "</think>", "<", "/", "think", ">", " ", "\n", "a", "é"]
    ),
    max_size=14,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(["qwen3", "deepseek_r1"]),
    prompt=st.sampled_from(["", "<think>\n", "<think>x</think>\n\n"]),
    text=PIECES,
    cuts=st.lists(st.integers(0, 60), max_size=8),
)
def test_streamed_split_adds_up_to_the_whole(
    name: str, prompt: str, text: str, cuts: list[int]
) -> None:
    """Fed in any pieces, the parser sends what it sends for the whole text."""
    expected = whole(name, prompt, text)
    parser = new_parser(name, prompt)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    total = ReasoningDelta()
    for a, b in itertools.pairwise(bounds):
        total += parser.feed(text[a:b])
        # no answer is sent while the output may still turn out to be reasoning
        assert not total.content or parser.reasoning_ended
    total += parser.finish()
    assert (total.reasoning, total.content) == expected


def test_every_boundary_of_a_qwen3_answer() -> None:
    text = "<think>\nLet me see: 2+2.\n</think>\n\nIt is 4."
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            p = new_parser("qwen3", "")
            d = p.feed(text[:i]) + p.feed(text[i:j]) + p.feed(text[j:]) + p.finish()
            assert d == ReasoningDelta("Let me see: 2+2.", "It is 4.")


def test_the_parser_holds_a_partial_tag_only() -> None:
    p = ReasoningParser("reasoning")
    assert p.feed("abc </th") == ReasoningDelta("abc")
    assert p.feed("x") == ReasoningDelta(" </thx")
    assert p.feed("</think>  ") == ReasoningDelta()
    assert p.reasoning_ended is False  # the answer has not begun: whitespace
    assert p.feed("ok") == ReasoningDelta(content="ok")
    assert p.reasoning_ended


@pytest.mark.parametrize(
    ("template", "name"),
    [
        (QWEN3_TEMPLATE, "qwen3"),
        (R1_TEMPLATE, "deepseek_r1"),
        ("{{ messages }}", None),
        (None, None),
        ("<|im_start|><｜Assistant｜></think>", None),  # both: ambiguous
    ],
)
def test_parser_for_template(template: str | None, name: str | None) -> None:
    assert parser_for_template(template) == name
