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
import json
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from structllm.params import SamplingParams
from structllm.server.chat.reasoning import after_thinking, parser_name
from structllm.structured import StructuredOutputs
from structllm.structured.compiler import GrammarCompiler, validate
from structllm.structured.vocabulary import GrammarVocabulary
from structllm.text import ByteTokenizer
from structllm.text.reasoning import (
    ReasoningDelta,
    ReasoningParser,
    new_parser,
    parser_for_template,
    split,
)
from tests.test_server_app import events, open_server

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


def test_parser_name_from_the_setting() -> None:
    assert parser_name("none", QWEN3_TEMPLATE) is None
    assert parser_name("auto", QWEN3_TEMPLATE) == "qwen3"
    assert parser_name("auto", "{{ messages }}") is None
    assert parser_name("deepseek_r1", None) == "deepseek_r1"


# -- structured output applies to the answer ---------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a"],
    "additionalProperties": False,
}


def accepts(c: StructuredOutputs, text: str) -> bool:
    tok = ByteTokenizer()
    grammar = GrammarCompiler(GrammarVocabulary.from_tokenizer(tok)).compile(c)
    m = grammar.matcher()
    ids = tok.encode(text, add_special_tokens=False)
    return m.accept_tokens(ids) == len(ids) and m.is_accepting()


@pytest.mark.parametrize(
    ("mode", "constraint", "good", "bad"),
    [
        (
            "reasoning",
            StructuredOutputs(json=SCHEMA),
            ['hm, a </thin k>.</think>\n\n{"a": 1}', '</think>{"a": 2}'],
            ['{"a": 1}', 'a</think>b</think>{"a": 1}', "a</think>x"],
        ),
        (
            "answer_start",
            StructuredOutputs(json_object=True),
            ['<think>x</think>{"b": 1}', '{"b": 1}'],
            ['x</think>{"b": 1}'],
        ),
        (
            "reasoning",
            StructuredOutputs(choice=["red", "a/b"]),
            ["so</think> a/b", "</think>red"],
            ["red", "so</think>blue"],
        ),
        (
            "answer_start",
            StructuredOutputs(regex="[0-9]+/x"),
            ["<think>y</think>12/x", "3/x"],
            ["y</think>3/x"],
        ),
    ],
)
def test_the_constraint_waits_for_the_end_of_the_thinking(
    mode: Any, constraint: StructuredOutputs, good: list[str], bad: list[str]
) -> None:
    wrapped, parser = after_thinking(constraint, ReasoningParser(mode))
    assert wrapped is not None and wrapped.grammar is not None
    assert parser is not None and parser.mode == mode
    validate(wrapped)
    for text in good:
        assert accepts(wrapped, text), text
    for text in bad:
        assert not accepts(wrapped, text), text


def test_a_constraint_on_an_answer_is_kept() -> None:
    c = StructuredOutputs(json=SCHEMA)
    assert after_thinking(c, ReasoningParser("answer")) == (
        c,
        ReasoningParser("answer"),
    )
    assert after_thinking(c, None) == (c, None)
    # a Lark grammar of the request's own: the whole output is the answer
    g = StructuredOutputs(grammar='start: "x"')
    kept, parser = after_thinking(g, ReasoningParser("reasoning"))
    assert kept is g and parser is not None and parser.mode == "answer"


# -- chat through the server, both loops ---------------------------------------------

CHAT_OPEN = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nLet me"},
]
CHAT_CLOSED = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\n"},
]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


async def _chat(s: Any, **body: Any) -> dict[str, Any]:
    body = {"max_tokens": 12, "temperature": 0, **CONTINUE, **body}
    r = await s.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


async def _chat_stream(s: Any, **body: Any) -> tuple[str, str, str]:
    body = {"max_tokens": 12, "temperature": 0, "stream": True, **CONTINUE, **body}
    r = await s.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    thought = content = finish = ""
    for e in events(r.text)[:-1]:
        for c in e["choices"]:
            thought += c["delta"].get("reasoning_content") or ""
            content += c["delta"].get("content") or ""
            finish = c["finish_reason"] or finish
    return thought, content, finish


async def _reference(s: Any, chat: dict[str, Any]) -> str:
    ids = chat["prompt_token_ids"]
    out = await s.llm.complete(
        {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=12)
    )
    return str(out.text)


@pytest.mark.anyio
async def test_chat_splits_the_thinking_whole_and_streamed() -> None:
    """A prompt that opened <think>: the continuation is thinking, and it is
    what a plain completion of the same prompt writes; one that closed it:
    the continuation is the answer."""
    async with open_server(reasoning_parser="qwen3") as s:
        whole = await _chat(s, messages=CHAT_OPEN, return_token_ids=True)
        message = whole["choices"][0]["message"]
        expected = (await _reference(s, whole)).strip()
        assert expected  # the random model writes something in 12 tokens
        assert message["reasoning_content"] == expected
        assert message["content"] is None
        assert await _chat_stream(s, messages=CHAT_OPEN) == (expected, "", "length")

        whole = await _chat(s, messages=CHAT_CLOSED, return_token_ids=True)
        message = whole["choices"][0]["message"]
        expected = await _reference(s, whole)
        assert message == {
            "role": "assistant",
            "content": expected,
            "reasoning_content": None,
        }
        assert await _chat_stream(s, messages=CHAT_CLOSED) == ("", expected, "length")

        # include_reasoning: false drops the thinking; the answer stays apart
        dropped = await _chat(s, messages=CHAT_OPEN, include_reasoning=False)
        assert dropped["choices"][0]["message"] == {
            "role": "assistant",
            "content": None,
        }
        thought, content, _ = await _chat_stream(
            s, messages=CHAT_OPEN, include_reasoning=False
        )
        assert (thought, content) == ("", "")

        # enable_thinking: false asks the template for none: all answer
        kw = {"chat_template_kwargs": {"enable_thinking": False}}
        whole = await _chat(s, messages=CHAT_OPEN, return_token_ids=True, **kw)
        message = whole["choices"][0]["message"]
        assert message["content"] == await _reference(s, whole)
        assert message["reasoning_content"] is None


@pytest.mark.anyio
async def test_structured_output_and_calls_apply_to_the_answer() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    engine = {"max_model_len": 1024, "num_blocks": 256, "block_size": 16}
    async with open_server(reasoning_parser="deepseek_r1", engine=engine) as s:
        # after a closed block the answer is held to the schema at once
        whole = await _chat(s, messages=CHAT_CLOSED, response_format=fmt, max_tokens=40)
        message = whole["choices"][0]["message"]
        jsonschema.validate(json.loads(message["content"]), SCHEMA)
        assert message["reasoning_content"] is None
        # inside the thinking the model is free: the schema waits for </think>
        whole = await _chat(s, messages=CHAT_OPEN, response_format=fmt)
        message = whole["choices"][0]["message"]
        assert message["reasoning_content"] and not message[
            "reasoning_content"
        ].startswith("{")
        assert message["content"] is None
        # a forced call is parsed from the answer
        tools = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]
        whole = await _chat(
            s,
            messages=CHAT_CLOSED,
            tools=tools,
            tool_choice={"type": "function", "function": {"name": "f"}},
            max_tokens=40,
        )
        choice = whole["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        call = choice["message"]["tool_calls"][0]["function"]
        jsonschema.validate(json.loads(call["arguments"]), SCHEMA)


@pytest.mark.anyio
async def test_no_reasoning_field_without_a_parser() -> None:
    async with open_server() as s:  # auto: the byte template has no <think>
        message = (await _chat(s, messages=CHAT_OPEN))["choices"][0]["message"]
        assert "reasoning_content" not in message and message["content"]
