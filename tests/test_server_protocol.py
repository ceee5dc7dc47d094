"""The request models: ranges, the field named in each 400, the conversion to
SamplingParams, and the response models' omitted fields.

No server: the models are called directly, as ``guarded()`` calls them.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from structllm.errors import InvalidRequestError
from structllm.params import MAX_COUNT, OutputKind, SamplingParams
from structllm.server.chat.protocol import ChatCompletionStreamResponse, ChatRequest
from structllm.server.completions.protocol import (
    CompletionRequest,
    CompletionStreamChoice,
)
from structllm.server.http.body import validate
from structllm.server.models.protocol import ModelCard
from structllm.server.protocol import bodies
from structllm.server.protocol.refusals import CHAT_REFUSED, COMPLETION_REFUSED, REFUSED
from structllm.server.protocol.validation import validation_error

CHAT = [{"role": "user", "content": "hi"}]


def refused(model: type[BaseModel], body: Any) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as e:
        validate(model, body)
    return e.value


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": MAX_COUNT + 1}, "max_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),  # strict: no string numbers
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 100.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"n": 17}, "n"),
        ({"best_of": 2}, "best_of"),
        ({"logprobs": 21}, "logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"stop": ""}, "stop"),
        ({"stop": ["a"] * 65}, "stop"),
        ({"stop": "\ud800"}, "stop"),
        ({"stop_token_ids": [1, 2**31]}, "stop_token_ids[1]"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": 1}},
         "stream_options.include_usage"),
        ({"echo": True, "logprobs": 21}, "logprobs"),
        ({"model": "\udfff"}, "model"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"response_format": {"type": "json"}}, "response_format.type"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"use_beam_search": True}, "use_beam_search"),
    ],
)  # fmt: skip
def test_completion_fields_out_of_range_name_the_field(
    body: dict[str, Any], field: str
) -> None:
    err = refused(CompletionRequest, {"prompt": "x", **body})
    assert err.field == field and str(err).startswith(f"{field}: ")


@pytest.mark.parametrize(
    ("prompt", "ok"),
    [
        ("text", True),
        (["a", "b"], True),
        ([1, 2, 3], True),
        ([[1], [2, 3]], True),
        ("", False),
        ([], False),
        ([""], False),
        ([1, "a"], False),
        ([[1], []], False),
        ([-1], False),
        ([2**31], False),
        (5, False),
        (["x"] * 129, False),
        ([[1]] * 129, False),
        (list(range(3, 1003)), True),  # one prompt of 1,000 token ids, not 1,000
    ],
)
def test_prompt_shapes(prompt: Any, ok: bool) -> None:
    if ok:
        req = validate(CompletionRequest, {"prompt": prompt})
        assert len(req.prompt) >= 1
    else:
        assert refused(CompletionRequest, {"prompt": prompt}).field == "prompt"


def test_prompts_times_n_is_capped() -> None:
    err = refused(CompletionRequest, {"prompt": ["a"] * 9, "n": 16})
    assert err.field == "prompt" and "128" in str(err)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content"),
        ({"messages": [CHAT[0], {"role": "user", "content": "\ud800"}]},
         "messages[1].content"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]},
         "messages[0].tool_calls[0].id"),
        ({"messages": [{"role": "user", "content": "x", "function_call": {}}]},
         "messages[0].function_call"),
        ({"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": CHAT, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"messages": CHAT, "logprobs": 1}, "logprobs"),
    ],
)  # fmt: skip
def test_chat_fields_name_the_field(body: dict[str, Any], field: str) -> None:
    err = refused(ChatRequest, body)
    assert err.field == field, str(err)


def test_a_body_that_is_not_an_object() -> None:
    for body in ([], "x", 5, None):
        assert "JSON object" in str(refused(CompletionRequest, body))


@pytest.mark.parametrize(
    ("model", "base", "table"),
    [
        (CompletionRequest, {"prompt": "x"}, REFUSED | COMPLETION_REFUSED),
        (ChatRequest, {"messages": CHAT}, REFUSED | CHAT_REFUSED),
    ],
)
def test_every_refused_field_is_refused_and_its_no_op_accepted(
    model: type[BaseModel], base: dict[str, Any], table: dict[str, Any]
) -> None:
    for name, (reason, no_ops) in table.items():
        err = refused(model, {**base, name: "something"})
        assert err.field == name and reason in str(err)
        for ok in no_ops:
            validate(model, {**base, name: ok})


def test_each_endpoint_refuses_the_other_ones_fields_only_for_itself() -> None:
    validate(ChatRequest, {"messages": CHAT, "prompt_embeds": None})
    assert refused(ChatRequest, {"messages": CHAT, "prompt_token_ids": [1]}).field == (
        "prompt_token_ids"
    )
    # the chat default for add_special_tokens is the completions refusal
    assert refused(CompletionRequest, {"prompt": "x", "add_special_tokens": False})
    assert refused(ChatRequest, {"messages": CHAT, "add_special_tokens": True})


def test_unknown_fields_are_ignored() -> None:
    req = validate(CompletionRequest, {"prompt": "x", "whatever": [1, {"a": 2}]})
    assert req.prompt == ("x",)


def test_validation_error_without_a_path() -> None:
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate([])
    err = validation_error(e.value)
    assert err.field is None and "JSON object" in str(err)


# -- conversion to SamplingParams ----------------------------------------------


def test_completion_to_sampling_params() -> None:
    req = validate(
        CompletionRequest,
        {
            "prompt": "x",
            "max_tokens": 5,
            "temperature": 0.5,
            "stop": "\n",
            "logprobs": 3,
            "seed": 1,
            "unknown_field": 1,
            "n": 2,
            "top_k": -1,
            "logit_bias": {"7": 1},
            "allowed_token_ids": [9, 2, 9],
            "ignore_eos": True,
        },
    )
    p = req.to_sampling_params(16)
    assert (p.max_tokens, p.temperature, p.stop, p.logprobs, p.seed) == (
        5,
        0.5,
        ("\n",),
        3,
        1,
    )
    assert p.top_k == 0 and p.ignore_eos and p.output_kind is OutputKind.FINAL
    assert p.logit_bias == ((7, 1.0),) and p.allowed_token_ids == (2, 9)
    assert req.choices == 2


def test_prompt_logprobs_and_echo_to_sampling_params() -> None:
    def params(body: dict[str, Any]) -> SamplingParams:
        return validate(CompletionRequest, {"prompt": "x", **body}).to_sampling_params(
            1
        )

    assert params({}).prompt_logprobs is None
    assert params({"prompt_logprobs": 0}).prompt_logprobs == 0
    # echo with logprobs: the echoed prompt's logprobs, as many as logprobs
    assert params({"echo": True, "logprobs": 3}).prompt_logprobs == 3
    assert (
        params({"echo": True, "logprobs": 3, "prompt_logprobs": 1}).prompt_logprobs == 1
    )
    assert params({"echo": True}).prompt_logprobs is None
    chat = validate(ChatRequest, {"messages": CHAT, "prompt_logprobs": 2})
    assert chat.to_sampling_params(None).prompt_logprobs == 2


def test_defaults_and_stream_output_kind() -> None:
    req = validate(CompletionRequest, {"prompt": "x", "stream": True})
    p = req.to_sampling_params(16)
    assert p.max_tokens == 16 and p.output_kind is OutputKind.DELTA
    defaults = SamplingParams()
    assert (p.temperature, p.top_p, p.stop) == (
        defaults.temperature,
        defaults.top_p,
        defaults.stop,
    )
    assert req.to_sampling_params(None).max_tokens is None


def test_chat_to_sampling_params() -> None:
    body = {"messages": CHAT, "max_completion_tokens": 7, "max_tokens": 3}
    req = validate(ChatRequest, {**body, "logprobs": True, "top_logprobs": 2})
    p = req.to_sampling_params(None)
    assert p.max_tokens == 7 and p.logprobs == 2
    assert req.limit_field == "max_completion_tokens"
    plain = validate(ChatRequest, {"messages": CHAT, "logprobs": False})
    assert plain.to_sampling_params(None).logprobs is None
    assert plain.to_sampling_params(None).max_tokens is None
    assert (
        validate(ChatRequest, {"messages": CHAT, "logprobs": True})
        .to_sampling_params(None)
        .logprobs
        == 0
    )


def test_min_tokens_above_max_tokens_is_refused_at_conversion() -> None:
    req = validate(CompletionRequest, {"prompt": "x", "max_tokens": 2, "min_tokens": 5})
    with pytest.raises(InvalidRequestError) as e:
        req.to_sampling_params(16)
    assert e.value.field == "min_tokens"


def test_chat_messages_for_the_template() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    req = validate(
        ChatRequest,
        {
            "messages": [
                {"role": "user", "content": parts, "name": "u"},
                {"role": "assistant", "content": "Sure"},
            ],
            "echo": True,
        },
    )
    assert req.template_messages() == [
        {"role": "user", "content": "ab", "name": "u"},
        {"role": "assistant", "content": "Sure"},
    ]
    assert req.echo_text == "Sure"


@given(
    max_tokens=st.integers(1, MAX_COUNT),
    temperature=st.floats(0, 100),
    top_p=st.floats(0, 1, exclude_min=True),
    top_k=st.integers(-1, 10_000),
    seed=st.integers(-(2**63), 2**64 - 1) | st.none(),
)
def test_whatever_the_model_accepts_converts(
    max_tokens: int, temperature: float, top_p: float, top_k: int, seed: int | None
) -> None:
    body = {
        "prompt": [1, 2],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": seed,
    }
    p = validate(CompletionRequest, body).to_sampling_params(16)
    assert p.max_tokens == max_tokens and p.seed == seed


# -- response models ------------------------------------------------------------


def test_responses_omit_only_what_was_not_given() -> None:
    choice = CompletionStreamChoice(index=0, text="", logprobs=None, finish_reason=None)
    assert bodies.dump(choice) == {  # vLLM's keys, null; no prompt_logprobs
        "index": 0,
        "text": "",
        "logprobs": None,
        "finish_reason": None,
        "stop_reason": None,
        "prompt_token_ids": None,
        "token_ids": None,
    }
    done = CompletionStreamChoice(
        index=0, text="", logprobs=None, finish_reason="stop", stop_reason=None
    )
    assert bodies.dump(done)["stop_reason"] is None
    usage = bodies.usage(3, 4, 2)
    assert bodies.dump(usage) == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    card = bodies.dump(ModelCard(id="m", created=1, root="/m", max_model_len=8))
    assert card == {
        "id": "m",
        "object": "model",
        "created": 1,
        "owned_by": "structllm",
        "root": "/m",
        "parent": None,  # vLLM's: null on the base model's card
        "max_model_len": 8,
    }
    assert bodies.error_body("bad", param="x", code=400) == {
        "error": {
            "message": "bad",
            "type": "invalid_request_error",
            "param": "x",
            "code": 400,
        }
    }


def test_response_schema_required_fields() -> None:
    schema = ChatCompletionStreamResponse.model_json_schema(mode="serialization")
    assert set(schema["required"]) == {
        "id",
        "object",
        "created",
        "model",
        "system_fingerprint",
        "choices",
    }
    delta = schema["$defs"]["ChatDelta"]
    assert delta["required"] == []


def _completion_chunks(**body: Any) -> Any:
    """A streaming completion's chunk writer, outside any server."""
    from structllm.server.base import EngineSlot
    from structllm.server.completions.serving import CompletionServing, _Chunks
    from structllm.server.metrics import Metrics
    from structllm.server.serving import ServerConfig

    slot = EngineSlot()
    serving = CompletionServing(slot, ServerConfig(model_name="m"), Metrics(lambda: {}))
    req = validate(CompletionRequest, {"model": "m", "prompt": [5, 6], **body})
    return _Chunks(serving, req, "cmpl-1")


def _chat_chunks(**body: Any) -> Any:
    """A streaming chat completion's chunk writer, outside any server."""
    from structllm.engine.frontend.inputs import Prompt
    from structllm.server.base import EngineSlot
    from structllm.server.chat.serving import ChatServing, RenderedChat, _Chunks
    from structllm.server.metrics import Metrics
    from structllm.server.serving import ServerConfig

    slot = EngineSlot()
    serving = ChatServing(slot, ServerConfig(model_name="m"), Metrics(lambda: {}))
    req = validate(ChatRequest, {"model": "m", "messages": CHAT, **body})
    chat = RenderedChat(Prompt(None, [5, 6]), SamplingParams(), None)
    return _Chunks(serving, req, "chatcmpl-1", 0, chat)


def _output(text: str, finish_reason: Any, stop_reason: Any) -> Any:
    from structllm.outputs import CompletionOutput, RequestOutput

    return RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=(5, 6),
        outputs=(
            CompletionOutput(
                text=text,
                token_ids=(7, 8),
                logprobs=None,
                cumulative_logprob=None,
                finish_reason=finish_reason,
                stop_reason=stop_reason,
            ),
        ),
        finished=finish_reason is not None,
        num_generated_tokens=2,
    )


_PLAIN_CHUNKS = [
    (" fox", None, None),
    ("", None, None),
    ("x", None, 3),  # a stop reason is sent with the finish only
    ('é\n"x"', "length", None),
    ("end", "stop", "</s>"),
    ("", "stop", 2),
]


@pytest.mark.parametrize("return_token_ids", [False, True])
@pytest.mark.parametrize(("text", "finish_reason", "stop_reason"), _PLAIN_CHUNKS)
def test_a_plain_chat_chunk_is_the_models_dump(
    return_token_ids: bool, text: str, finish_reason: Any, stop_reason: Any
) -> None:
    """As for completions: ``delta_event``'s object is the models' dump."""
    from structllm.engine.frontend.inputs import Prompt
    from structllm.server.jobs import Job

    fast = _chat_chunks(return_token_ids=return_token_ids)
    assert fast.plain
    model = _chat_chunks(return_token_ids=return_token_ids)
    job = Job(1, 0, Prompt(None, [5, 6]), SamplingParams())
    out = _output(text, finish_reason, stop_reason)
    got = fast.delta_event(job, out, None)
    want = bodies.dump(model.delta(job, out, None))
    got["created"] = want["created"]  # the clock may tick between them
    assert list(got) == list(want)
    assert list(got["choices"][0]) == list(want["choices"][0])
    assert got == want


def test_a_chat_with_tools_is_not_plain() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    assert not _chat_chunks(tools=[tool], tool_choice="required").plain


@pytest.mark.parametrize("return_token_ids", [False, True])
@pytest.mark.parametrize(("text", "finish_reason", "stop_reason"), _PLAIN_CHUNKS)
def test_a_plain_completion_chunk_is_the_models_dump(
    return_token_ids: bool,
    text: str,
    finish_reason: Any,
    stop_reason: Any,
) -> None:
    """``delta_event`` builds a plain chunk without the pydantic models: the
    same JSON object as the models' dump, keys in the same order, over two
    chunks (the prompt's ids go with the first only)."""
    from structllm.engine.frontend.inputs import Prompt
    from structllm.server.jobs import Job

    fast = _completion_chunks(return_token_ids=return_token_ids)
    model = _completion_chunks(return_token_ids=return_token_ids)
    job = Job(1, 0, Prompt(None, [5, 6]), SamplingParams())
    out = _output(text, finish_reason, stop_reason)
    for _ in range(2):
        got = fast.delta_event(job, out, None)
        want = bodies.dump(model.delta(job, out, None))
        got["created"] = want["created"]  # the clock may tick between them
        assert list(got) == list(want)
        assert list(got["choices"][0]) == list(want["choices"][0])
        assert got == want
