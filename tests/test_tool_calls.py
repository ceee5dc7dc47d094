"""Tool calls out of text: the parsers, whole and streamed, and the deltas.

No engine: the parsers of ``structllm.text.tool_parser`` are fed text as a
model would write it, in one piece and cut at arbitrary places, and the
server's ``StreamedCalls`` turns their events into OpenAI deltas.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from structllm.outputs import CompletionOutput
from structllm.server.chat.protocol import ChatRequest
from structllm.server.chat.tool_calls import StreamedCalls, message, parser_for
from structllm.server.http.body import validate
from structllm.server.protocol import bodies
from structllm.server.protocol.constraints import check_constraint
from structllm.server.protocol.tools import Tool, call_list_schema
from structllm.structured import StructuredOutputs
from structllm.text.auto_tool_parser import HERMES_CLOSE, AutoParser
from structllm.text.chat import render_chat_template
from structllm.text.tool_parser import (
    CallListParser,
    NamedCallParser,
    ParsedCall,
    ParsedOutput,
    ToolCallParser,
    collect,
    parse,
)

NAMES = ["get_weather", "search", "noop"]


def auto(text: str, *, parallel: bool = True) -> ParsedOutput:
    return parse(AutoParser(NAMES, parallel=parallel), text)


def streamed(parser: ToolCallParser, pieces: list[str]) -> ParsedOutput:
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    return collect(events, complete=parser.complete)


def call(name: str, **arguments: Any) -> ParsedCall:
    return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


# -- auto: the formats found in free text ------------------------------------------


def test_hermes_blocks_with_content_around_them() -> None:
    text = (
        "Let me look.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>\n"
        '<tool_call>{"name": "search", "arguments": {"q": "x", "n": 2}}</tool_call>'
    )
    out = auto(text)
    assert out.calls == (
        call("get_weather", city="Paris"),
        call("search", q="x", n=2),
    )
    assert out.content == "Let me look.\n\n"


def test_bare_json_calls() -> None:
    one = '{"name": "search", "parameters": {"q": "a"}}'
    assert auto(one).calls == (call("search", q="a"),)
    assert auto(one).content is None
    many = f'  [{one}, {{"type": "function", "name": "noop", "arguments": {{}}}}]\n'
    assert auto(many).calls == (call("search", q="a"), call("noop"))
    assert auto("<|python_tag|>" + one).calls == (call("search", q="a"),)
    assert auto("[TOOL_CALLS][" + one + "]").calls == (call("search", q="a"),)
    # arguments given as a JSON string, as OpenAI writes them
    text = '{"name": "search", "arguments": "{\\"q\\": \\"a\\"}"}'
    assert auto(text).calls == (call("search", q="a"),)


@pytest.mark.parametrize(
    "text",
    [
        "plain text",
        "  spaced\n out  ",
        "",
        "   ",
        '{"answer": 42}',
        '[{"name": "search"}]',  # no arguments
        '{"name": "unknown", "arguments": {}}',  # not one of the tools
        '{"name": "search", "arguments": {}, "extra": 1}',
        '{"name": "search", "arguments": [1]}',
        '{"name": "search", "arguments": {}} trailing',
        "<tool_call>not json</tool_call> after",
        '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
        "a < b and <tool but no call",
        "ends with <tool_ca",
    ],
)
def test_what_is_not_a_call_is_content_unchanged(text: str) -> None:
    out = auto(text)
    assert out.calls == ()
    assert (out.content or "") == (text if text.strip() else "")
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    assert streamed(AutoParser(NAMES), pieces) == out


def test_an_unclosed_block_at_the_end_is_still_a_call() -> None:
    out = auto('<tool_call>{"name": "noop", "arguments": {}}')
    assert out.calls == (call("noop"),) and out.content is None


def test_parallel_false_keeps_the_first_call() -> None:
    text = "".join(
        f'<tool_call>{{"name": "{n}", "arguments": {{}}}}</tool_call>' for n in NAMES
    )
    assert auto(text, parallel=False).calls == (call("get_weather"),)
    assert len(auto(text).calls) == 3


def test_content_streams_before_the_call_completes() -> None:
    p = AutoParser(NAMES)
    assert collect(p.feed("Hi there <tool")).content == "Hi there "
    assert p.feed('_call>{"name": "noop", ') == []
    events = p.feed('"arguments": {}}</tool_call>')
    assert collect(events).calls == (call("noop"),)


def test_text_that_cannot_be_bare_calls_streams_at_once() -> None:
    p = AutoParser(NAMES)
    assert collect(p.feed("[1] first")).content == "[1] first"
    p = AutoParser(NAMES)
    assert p.feed('[{"name": "noop"') == []  # might still be a call


FRAGMENTS = [
    "[", "]", "{", "}", '"', ",", ":", " ", "\n", "x", "name", "<", ">", "|",
    '"name"', '"arguments"', '"parameters"', '"noop"', '"search"', "{}",
    "<tool_call>", "</tool_call>", "<tool_", "call>", "<|python_tag|>", "[TOOL_CALLS]",
    '{"name": "noop", "arguments": {}}', '{"name": "search", "parameters": {"q": 1}}',
    '<tool_call>{"name": "noop", "arguments": {}}</tool_call>',
    '<tool_call>\n{"name": "search", "arguments": {"q": "<"}}\n</tool_call>',
]  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(
    text=st.lists(st.sampled_from(FRAGMENTS), max_size=12).map("".join),
    parallel=st.booleans(),
    data=st.data(),
)
def test_auto_streamed_is_auto_whole_for_any_text(
    text: str, parallel: bool, data: st.DataObject
) -> None:
    whole = auto(text, parallel=parallel)
    pieces = data.draw(cuts(text))
    assert streamed(AutoParser(NAMES, parallel=parallel), pieces) == whole
    if not whole.calls:
        assert (whole.content or "") == (text if text.strip() else "")


# -- the constrained formats ---------------------------------------------------------


def test_call_list_streams_name_then_argument_fragments() -> None:
    text = '[{"name": "search", "parameters": {"q": "a,b}"}}, {"name": "noop", "parameters": {}}]'
    p = CallListParser()
    events = []
    for ch in text:
        events.append(p.feed(ch))
    flat = [e for es in events for e in es]
    assert p.complete
    assert collect(flat).calls == (call("search", q="a,b}"), call("noop"))
    # the name is out as soon as its closing quote is
    at = text.index('search"') + len("search")
    assert any(e for e in events[at]), "the call started with its name"


def test_call_list_holds_arguments_until_the_name() -> None:
    text = '[ {"parameters" : {"q": [1, {"x": null}]}, "name": "s\\u00e9arch"} ]'
    out = parse(CallListParser(), text)
    assert out.complete and out.calls == (
        ParsedCall("séarch", '{"q": [1, {"x": null}]}'),
    )


@pytest.mark.parametrize(
    "text",
    [
        '[{"name": "search", "parameters": {"q"',  # cut short
        '{"name": "search", "parameters": {}}',  # not a list
        '[{"name": "search", "parameters": "{}"}]',  # arguments as a string
        '[{"name": "search"}]',
        '[{"name": "search", "parameters": {}}] and more',
    ],
)
def test_call_list_that_is_not_complete(text: str) -> None:
    assert not parse(CallListParser(), text).complete


def test_named_call_is_the_whole_output() -> None:
    out = streamed(NamedCallParser("search"), ['{"q": ', '"a"}'])
    assert out.complete and out.calls == (ParsedCall("search", '{"q": "a"}'),)
    assert not parse(NamedCallParser("search"), '{"q": ').complete


# -- round trips ---------------------------------------------------------------------

json_leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    json_leaves,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=10,
)
arguments = st.dictionaries(st.text(max_size=8), json_values, max_size=4)


@st.composite
def cuts(draw: st.DrawFn, text: str) -> list[str]:
    points = sorted(draw(st.sets(st.integers(0, len(text)), max_size=16)))
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@settings(max_examples=60, deadline=None)
@given(
    calls=st.lists(
        st.tuples(st.sampled_from(NAMES), arguments), min_size=1, max_size=3
    ),
    style=st.sampled_from(["hermes", "bare", "list", "python_tag", "mistral"]),
    key=st.sampled_from(["arguments", "parameters"]),
    indent=st.sampled_from([None, 2]),
    data=st.data(),
)
def test_arguments_round_trip_through_every_auto_format(
    calls: list[tuple[str, dict[str, Any]]],
    style: str,
    key: str,
    indent: int | None,
    data: st.DataObject,
) -> None:
    objects = [{"name": n, key: a} for n, a in calls]
    if style == "hermes":
        text = "\n".join(
            f"<tool_call>\n{json.dumps(o, indent=indent)}\n</tool_call>"
            for o in objects
        )
        if any(HERMES_CLOSE in json.dumps(o) for o in objects):
            return
    elif style == "bare":
        objects = objects[:1]
        text = json.dumps(objects[0], indent=indent)
    else:
        prefix = {"list": "", "python_tag": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}
        text = prefix[style] + json.dumps(objects, indent=indent, ensure_ascii=False)
    whole = auto(text)
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [
        (o["name"], o[key]) for o in objects
    ]
    assert whole.content is None
    assert streamed(AutoParser(NAMES), data.draw(cuts(text))) == whole


@settings(max_examples=60, deadline=None)
@given(
    calls=st.lists(
        st.tuples(st.sampled_from(NAMES), arguments), min_size=1, max_size=3
    ),
    separators=st.sampled_from([(", ", ": "), (",", ":"), (" , ", " : ")]),
    ensure_ascii=st.booleans(),
    data=st.data(),
)
def test_call_list_round_trips_cut_anywhere(
    calls: list[tuple[str, dict[str, Any]]],
    separators: tuple[str, str],
    ensure_ascii: bool,
    data: st.DataObject,
) -> None:
    objects = [{"name": n, "parameters": a} for n, a in calls]
    text = json.dumps(objects, separators=separators, ensure_ascii=ensure_ascii)
    out = streamed(CallListParser(), data.draw(cuts(text)))
    assert out.complete
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == calls
    assert out == parse(CallListParser(), text)


# -- the server's side: messages and deltas --------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {"q": {"type": "string"}},
                "required": ["q"],
            },
        },
    },
    {"type": "function", "function": {"name": "noop"}},
]
CHAT = [{"role": "user", "content": "hi"}]


def request(**fields: Any) -> ChatRequest:
    return validate(ChatRequest, {"messages": CHAT, "tools": TOOLS, **fields})


def output(text: str, finish: str | None = "stop") -> CompletionOutput:
    return CompletionOutput(text=text, token_ids=(), finish_reason=finish)  # type: ignore[arg-type]


def test_whole_message_with_calls() -> None:
    req = request(tool_choice="required")
    text = '[{"name": "search", "parameters": {"q": "x"}}]'
    msg, finish = message(req, output(text))
    assert finish == "tool_calls" and msg.content is None
    assert msg.tool_calls is not None
    [tc] = msg.tool_calls
    assert tc.id.startswith("call_") and len(tc.id) == 29
    assert (tc.type, tc.function.name, json.loads(tc.function.arguments)) == (
        "function",
        "search",
        {"q": "x"},
    )
    assert "tool_calls" in bodies.dump(msg)


def test_a_forced_call_cut_short_is_content() -> None:
    req = request(tool_choice={"type": "function", "function": {"name": "search"}})
    msg, finish = message(req, output('{"q": "unfinish', "length"))
    assert finish == "length" and msg.content == '{"q": "unfinish'
    assert "tool_calls" not in bodies.dump(msg)


def test_tool_choice_none_parses_nothing() -> None:
    text = '<tool_call>{"name": "noop", "arguments": {}}</tool_call>'
    assert parser_for(request(tool_choice="none")) is None
    msg, finish = message(request(tool_choice="none"), output(text))
    assert (msg.content, finish) == (text, "stop")
    msg, finish = message(request(), output(text))  # auto by default
    assert msg.content is None and finish == "tool_calls"


def test_streamed_deltas_are_openai_shaped() -> None:
    req = request(tool_choice="required")
    parser = parser_for(req)
    assert parser is not None
    calls = StreamedCalls(parser)
    text = '[{"name": "search", "parameters": {"q": "xy"}}, {"name": "noop", "parameters": {}}]'
    deltas = [
        bodies.dump(calls.delta(ch, i == len(text) - 1)) for i, ch in enumerate(text)
    ]
    tool_deltas = [tc for d in deltas for tc in d.get("tool_calls", [])]
    firsts = [tc for tc in tool_deltas if "id" in tc]
    assert [f["function"]["name"] for f in firsts] == ["search", "noop"]
    assert all(
        f["type"] == "function" and f["function"]["arguments"] == "" for f in firsts
    )
    assert all(set(tc) == {"index", "function"} for tc in tool_deltas if "id" not in tc)
    args = {0: "", 1: ""}
    for tc in tool_deltas:
        args[tc["index"]] += tc["function"].get("arguments", "")
    assert json.loads(args[0]) == {"q": "xy"} and json.loads(args[1]) == {}
    assert not any("content" in d for d in deltas)
    assert calls.called


def test_call_list_schema_accepts_exactly_the_calls() -> None:
    tools = [Tool.model_validate(t) for t in TOOLS]
    tools.append(
        Tool.model_validate(
            {
                "type": "function",
                "function": {
                    "name": "tree",
                    "parameters": {
                        "$defs": {"node": {"type": "object", "properties": {
                            "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}
                        }, "additionalProperties": False}},
                        "type": "object",
                        "properties": {"root": {"$ref": "#/$defs/node"}},
                        "required": ["root"],
                    },
                },
            }
        )
    )  # fmt: skip
    schema = call_list_schema(tools, parallel=True)
    check_constraint(StructuredOutputs(json=schema), "tools")
    ok = [
        {"name": "search", "parameters": {"q": "x"}},
        {"name": "noop", "parameters": {}},
        {"name": "tree", "parameters": {"root": {"kids": [{"kids": []}]}}},
    ]
    jsonschema.validate(ok, schema)
    for bad in (
        [],
        [{"name": "search", "parameters": {}}],
        [{"name": "noop", "parameters": {"x": 1}}],
        [{"name": "other", "parameters": {}}],
        [{"name": "tree", "parameters": {"root": {"kids": [{"x": 1}]}}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = call_list_schema(tools, parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok[:2], single)
    jsonschema.validate(ok[:1], single)


#: the tool parts of Qwen2.5's chat template (Hermes format), as transformers
#: renders them: tools as dicts, each past call's arguments a dict
QWEN_TOOLS_TEMPLATE = (
    "{%- if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}"
    "</tools>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "<|im_start|>assistant\n{{ message.content }}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{% set tool_call = tool_call.function %}"
    "{% endif %}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": '
    "{{ tool_call.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- endif %}{%- endfor %}"
)


def test_a_hermes_template_renders_what_the_auto_parser_reads() -> None:
    arguments = {"q": 'naïve "quotes"', "n": [1, {"deep": None}]}
    body = {
        "messages": [
            *CHAT,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {
                            "name": "search",
                            "arguments": json.dumps(arguments),
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "found"},
        ],
        "tools": TOOLS,
    }
    req = validate(ChatRequest, body)
    prompt = render_chat_template(
        QWEN_TOOLS_TEMPLATE,
        req.template_messages(),
        add_generation_prompt=False,
        tools=req.template_options()["tools"],
    )
    assert json.dumps(TOOLS[0]) in prompt  # the tools as transformers passes them
    assert "<tool_response>\nfound\n</tool_response>" in prompt
    # the past call, written as the model writes one, reads back as that call
    turn = prompt.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    parsed = parse(AutoParser(NAMES), turn)
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("search", arguments)
    ]
