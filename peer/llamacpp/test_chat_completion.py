# Adapted for structllm from ggml-org/llama.cpp
# tools/server/tests/unit/test_chat_completion.py
# (commit f3beb22b17eb6bbf7096a132d9c3b3ac82453e72), MIT licence
# (peer/llamacpp/LICENSE). What changed and why: peer/llamacpp/NOTES.md;
# every change is marked "structllm:" below.
# structllm: the parameter rows with jinja=False (llama.cpp's built-in
# template engine) or a chat_template (a server flag choosing a template by
# name) are gone, and so are test_chat_template and
# test_chat_template_assistant_prefill (they read llama.cpp's "__verbose"
# debug field), test_apply_chat_template (/apply-template),
# test_chat_completion_with_timings_per_token ("timings") and
# test_return_progress ("return_progress"): not applicable,
# docs/peer-suites.md.
# The texts of llama.cpp's stories260K model (re_content) are not tiny's: a
# matching row checks that the content is non-empty text instead, and the
# prompt token counts (n_prompt) are tiny's (n_prompt_tokens).

import pytest
from openai import OpenAI

from peer.llamacpp.utils import (
    ServerError,
    ServerPreset,
    ServerProcess,
    match_regex,
    n_prompt_tokens,
)

server: ServerProcess

ANY_TEXT = r"\S"


@pytest.fixture(autouse=True)
def create_server():
    global server
    server = ServerPreset.tinyllama2()


@pytest.mark.parametrize(
    "model,system_prompt,user_prompt,max_tokens,re_content,n_prompt,n_predicted,finish_reason,jinja,chat_template",
    [
        (None, "Book", "Hey", 8, ANY_TEXT, None, 8, "length", True, None),
        (
            None,
            "Book",
            "What is the best book",
            8,
            ANY_TEXT,
            None,
            8,
            "length",
            True,
            None,
        ),
        (
            "codellama70b",
            "You are a coding assistant.",
            "Write the fibonacci function in c++.",
            128,
            ANY_TEXT,
            None,
            128,
            "length",
            True,
            None,
        ),
        (
            None,
            "Book",
            [
                {"type": "text", "text": "What is"},
                {"type": "text", "text": "the best book"},
            ],
            8,
            ANY_TEXT,
            None,
            8,
            "length",
            True,
            None,
        ),
    ],
)
def test_chat_completion(
    model,
    system_prompt,
    user_prompt,
    max_tokens,
    re_content,
    n_prompt,
    n_predicted,
    finish_reason,
    jinja,
    chat_template,
):
    global server
    server.jinja = jinja
    server.chat_template = chat_template
    server.start()
    messages = [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": user_prompt},
    ]
    res = server.make_request(
        "POST",
        "/chat/completions",
        data={
            "model": model,
            "max_tokens": max_tokens,
            "messages": messages,
        },
    )
    if model is not None:
        # structllm: a model other than the served one is a 404 naming
        # "model" (OpenAI's and vLLM's answer); llama.cpp serves any name.
        assert res.status_code == 404
        assert res.body["error"]["param"] == "model"
        return
    assert res.status_code == 200
    assert (
        "cmpl" in res.body["id"]
    )  # make sure the completion id has the expected format
    # structllm: "fp_" + a hash of the model (llama.cpp: "b" + its build)
    assert res.body["system_fingerprint"].startswith("fp_")
    if isinstance(user_prompt, str):
        n_prompt = n_prompt_tokens(messages)
        assert res.body["usage"]["prompt_tokens"] == n_prompt
    else:
        assert res.body["usage"]["prompt_tokens"] > 0
    assert res.body["usage"]["completion_tokens"] == n_predicted
    choice = res.body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert match_regex(re_content, choice["message"]["content"]), (
        f"Expected {re_content}, got {choice['message']['content']}"
    )
    assert choice["finish_reason"] == finish_reason


@pytest.mark.parametrize(
    "system_prompt,user_prompt,max_tokens,re_content,n_prompt,n_predicted,finish_reason",
    [
        ("Book", "What is the best book", 8, ANY_TEXT, None, 8, "length"),
        (
            "You are a coding assistant.",
            "Write the fibonacci function in c++.",
            128,
            ANY_TEXT,
            None,
            128,
            "length",
        ),
    ],
)
def test_chat_completion_stream(
    system_prompt,
    user_prompt,
    max_tokens,
    re_content,
    n_prompt,
    n_predicted,
    finish_reason,
):
    global server
    server.model_alias = "llama-test-model"
    server.start()
    res = server.make_stream_request(
        "POST",
        "/chat/completions",
        data={
            "max_tokens": max_tokens,
            "messages": [
                {"role": "system", "content": system_prompt},
                {"role": "user", "content": user_prompt},
            ],
            "stream": True,
        },
    )
    content = ""
    last_cmpl_id = None
    finished = False
    for i, data in enumerate(res):
        if data["choices"]:
            choice = data["choices"][0]
            if i == 0:
                # Check first role message for stream=True
                # structllm: "" as OpenAI sends it (llama.cpp: null)
                assert choice["delta"]["content"] in (None, "")
                assert choice["delta"]["role"] == "assistant"
            else:
                assert "role" not in choice["delta"]
            assert data["system_fingerprint"].startswith("fp_")
            assert data["model"] == "llama-test-model"
            if last_cmpl_id is None:
                last_cmpl_id = data["id"]
            assert (
                last_cmpl_id == data["id"]
            )  # make sure the completion id is the same for all events in the stream
            if choice["finish_reason"] in ["stop", "length"]:
                # structllm: the last token comes with finish_reason, as vLLM
                # sends it (llama.cpp: a chunk of its own, without content)
                content += choice["delta"].get("content") or ""
                assert match_regex(re_content, content)
                assert choice["finish_reason"] == finish_reason
                finished = True
            else:
                assert choice["finish_reason"] is None
                content += choice["delta"]["content"] or ""
        else:
            assert data["usage"]["prompt_tokens"] == n_prompt
            assert data["usage"]["completion_tokens"] == n_predicted
    assert finished


def test_chat_completion_with_openai_library():
    global server
    server.start()
    client = OpenAI(
        api_key="dummy", base_url=f"http://{server.server_host}:{server.server_port}/v1"
    )
    # structllm: model "gpt-3.5-turbo-instruct" -> the served name (an
    # unknown model is a 404; see test_chat_completion)
    with client:
        res = client.chat.completions.create(
            model=server.model_alias,
            messages=[
                {"role": "system", "content": "Book"},
                {"role": "user", "content": "What is the best book"},
            ],
            max_tokens=8,
            seed=42,
            temperature=0.8,
        )
    assert res.system_fingerprint is not None and res.system_fingerprint.startswith(
        "fp_"
    )
    assert res.choices[0].finish_reason == "length"
    assert res.choices[0].message.content is not None
    assert match_regex(ANY_TEXT, res.choices[0].message.content)


# structllm: llama.cpp's response_format extensions ("schema" inside
# json_object, json_schema without "name") are refused with a 400 naming the
# field; OpenAI's forms work. Those rows expect 400 (re_content None).
@pytest.mark.parametrize(
    "response_format,n_predicted,re_content",
    [
        ({"type": "json_object", "schema": {"const": "42"}}, 6, None),
        ({"type": "json_object", "schema": {"items": [{"type": "integer"}]}}, 10, None),
        (
            {"type": "json_schema", "json_schema": {"schema": {"const": "foooooo"}}},
            10,
            None,
        ),
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"const": "foooooo"}},
            },
            10,
            '"foooooo"',
        ),
        ({"type": "json_object"}, 10, "(\\{|John)+"),
        ({"type": "sound"}, 0, None),
        # invalid response format (expected to fail)
        ({"type": "json_object", "schema": 123}, 0, None),
        ({"type": "json_object", "schema": {"type": 123}}, 0, None),
        ({"type": "json_object", "schema": {"type": "hiccup"}}, 0, None),
    ],
)
def test_completion_with_response_format(
    response_format: dict, n_predicted: int, re_content: str | None
):
    global server
    server.start()
    res = server.make_request(
        "POST",
        "/chat/completions",
        data={
            # structllm: max_tokens 0 -> 1 (0 is refused: counts start at 1)
            "max_tokens": max(n_predicted, 1),
            "messages": [
                {"role": "system", "content": "You are a coding assistant."},
                {"role": "user", "content": "Write an example"},
            ],
            "response_format": response_format,
        },
    )
    if re_content is not None:
        assert res.status_code == 200
        choice = res.body["choices"][0]
        assert match_regex(re_content, choice["message"]["content"])
    else:
        assert res.status_code == 400
        assert "error" in res.body


@pytest.mark.parametrize(
    "jinja,json_schema,n_predicted,re_content",
    [
        (True, {"const": "42"}, 6, '"42"'),
    ],
)
def test_completion_with_json_schema(
    jinja: bool, json_schema: dict, n_predicted: int, re_content: str
):
    global server
    server.jinja = jinja
    server.start()
    res = server.make_request(
        "POST",
        "/chat/completions",
        data={
            "max_tokens": n_predicted,
            "messages": [
                {"role": "system", "content": "You are a coding assistant."},
                {"role": "user", "content": "Write an example"},
            ],
            "json_schema": json_schema,
        },
    )
    assert res.status_code == 200, f"Expected 200, got {res.status_code}"
    choice = res.body["choices"][0]
    assert match_regex(re_content, choice["message"]["content"]), (
        f"Expected {re_content}, got {choice['message']['content']}"
    )


@pytest.mark.parametrize(
    "jinja,grammar,n_predicted,re_content",
    [
        (True, 'root ::= "a"{5,5}', 6, "a{5,5}"),
    ],
)
def test_completion_with_grammar(
    jinja: bool, grammar: str, n_predicted: int, re_content: str
):
    global server
    server.jinja = jinja
    server.start()
    res = server.make_request(
        "POST",
        "/chat/completions",
        data={
            "max_tokens": n_predicted,
            "messages": [
                {"role": "user", "content": "Does not matter what I say, does it?"},
            ],
            "grammar": grammar,
        },
    )
    assert res.status_code == 200, res.body
    choice = res.body["choices"][0]
    assert match_regex(re_content, choice["message"]["content"]), choice["message"][
        "content"
    ]


@pytest.mark.parametrize(
    "messages",
    [
        None,
        "string",
        [123],
        [{}],
        [{"role": 123}],
        [{"role": "system", "content": 123}],
        # [{"content": "hello"}], # TODO: should not be a valid case
        [{"role": "system", "content": "test"}, {}],
    ],
)
def test_invalid_chat_completion_req(messages):
    global server
    server.start()
    res = server.make_request(
        "POST",
        "/chat/completions",
        data={
            "messages": messages,
        },
    )
    assert res.status_code == 400 or res.status_code == 500
    assert "error" in res.body


# structllm: upstream's last row, two assistant messages in a row, is refused
# by llama.cpp's template handling; structllm renders what the model's
# template renders (tiny's ChatML takes it, as vLLM does): a 200.
def test_consecutive_assistant_messages_are_rendered():
    global server
    server.start()
    res = server.make_request(
        "POST",
        "/chat/completions",
        data={
            "messages": [
                {"role": "user", "content": "test"},
                {"role": "assistant", "content": "test"},
                {"role": "assistant", "content": "test"},
            ],
            "max_tokens": 4,
        },
    )
    assert res.status_code == 200


def test_logprobs():
    global server
    server.start()
    client = OpenAI(
        api_key="dummy", base_url=f"http://{server.server_host}:{server.server_port}/v1"
    )
    with client:
        res = client.chat.completions.create(
            model=server.model_alias,
            temperature=0.0,
            messages=[
                {"role": "system", "content": "Book"},
                {"role": "user", "content": "What is the best book"},
            ],
            max_tokens=5,
            logprobs=True,
            top_logprobs=10,
        )
    output_text = res.choices[0].message.content
    aggregated_text = ""
    assert res.choices[0].logprobs is not None
    assert res.choices[0].logprobs.content is not None
    for token in res.choices[0].logprobs.content:
        aggregated_text += token.token
        assert token.logprob <= 0.0
        assert token.bytes is not None
        assert len(token.top_logprobs) > 0
    assert aggregated_text == output_text


def test_logprobs_stream():
    global server
    server.start()
    client = OpenAI(
        api_key="dummy", base_url=f"http://{server.server_host}:{server.server_port}/v1"
    )
    with client:
        res = client.chat.completions.create(
            model=server.model_alias,
            temperature=0.0,
            messages=[
                {"role": "system", "content": "Book"},
                {"role": "user", "content": "What is the best book"},
            ],
            max_tokens=5,
            logprobs=True,
            top_logprobs=10,
            stream=True,
        )
        output_text = ""
        aggregated_text = ""
        for i, data in enumerate(res):
            if data.choices:
                choice = data.choices[0]
                if i == 0:
                    # Check first role message for stream=True
                    # structllm: "" as OpenAI sends it (llama.cpp: null)
                    assert choice.delta.content in (None, "")
                    assert choice.delta.role == "assistant"
                else:
                    assert choice.delta.role is None
                    # structllm: the finishing chunk carries the last token
                    # (vLLM's way), so it is read too
                    if choice.delta.content:
                        output_text += choice.delta.content
                    assert choice.logprobs is not None
                    assert choice.logprobs.content is not None
                    for token in choice.logprobs.content:
                        aggregated_text += token.token
                        assert token.logprob <= 0.0
                        assert token.bytes is not None
                        assert token.top_logprobs is not None
                        assert len(token.top_logprobs) > 0
    assert aggregated_text == output_text


def test_logit_bias():
    global server
    server.start()

    exclude = [
        "i",
        "I",
        "the",
        "The",
        "to",
        "a",
        "an",
        "be",
        "is",
        "was",
        "but",
        "But",
        "and",
        "And",
        "so",
        "So",
        "you",
        "You",
        "he",
        "He",
        "she",
        "She",
        "we",
        "We",
        "they",
        "They",
        "it",
        "It",
        "his",
        "His",
        "her",
        "Her",
        "book",
        "Book",
    ]

    # structllm: upstream asks llama.cpp's POST /tokenize {"content": ...};
    # the ids come from tiny's tokenizer here (the test is about logit_bias).
    from structllm.text.tokenizer import load_tokenizer

    tokens = load_tokenizer("tiny").encode(" " + " ".join(exclude) + " ")
    logit_bias = dict.fromkeys(tokens, -100)

    client = OpenAI(
        api_key="dummy", base_url=f"http://{server.server_host}:{server.server_port}/v1"
    )
    with client:
        res = client.chat.completions.create(
            model=server.model_alias,
            temperature=0.0,
            messages=[
                {"role": "system", "content": "Book"},
                {"role": "user", "content": "What is the best book"},
            ],
            max_tokens=64,
            logit_bias=logit_bias,
        )
    output_text = res.choices[0].message.content
    assert output_text
    assert all(output_text.find(" " + tok + " ") == -1 for tok in exclude)


def test_context_size_exceeded():
    global server
    server.start()
    res = server.make_request(
        "POST",
        "/chat/completions",
        data={
            "messages": [
                {"role": "system", "content": "Book"},
                {"role": "user", "content": "What is the best book"},
            ]
            * 100,  # make the prompt too long
        },
    )
    assert res.status_code == 400
    assert "error" in res.body
    # structllm: OpenAI's error body (type BadRequestError, the counts in
    # the message, param "max_tokens": the harness sends n_predict as
    # max_tokens, and prompt + max_tokens is what does not fit; "prompt"
    # without max_tokens); llama.cpp's exceed_context_size_error with
    # n_prompt_tokens and n_ctx fields is its own.
    assert res.body["error"]["param"] in ("prompt", "max_tokens")
    assert server.n_ctx is not None
    assert server.n_slots is not None
    assert str(server.n_ctx // server.n_slots) in res.body["error"]["message"]


def test_context_size_exceeded_stream():
    global server
    server.start()
    try:
        for _ in server.make_stream_request(
            "POST",
            "/chat/completions",
            data={
                "messages": [
                    {"role": "system", "content": "Book"},
                    {"role": "user", "content": "What is the best book"},
                ]
                * 100,  # make the prompt too long
                "stream": True,
            },
        ):
            pass
        raise AssertionError("Should have failed")
    except ServerError as e:
        assert e.code == 400
        assert "error" in e.body
        # structllm: as in test_context_size_exceeded
        assert e.body["error"]["param"] in ("prompt", "max_tokens")
        assert server.n_ctx is not None
        assert server.n_slots is not None
        assert str(server.n_ctx // server.n_slots) in e.body["error"]["message"]


def test_chat_completions_multiple_choices():
    global server
    server.start()
    res = server.make_request(
        "POST",
        "/chat/completions",
        data={
            "max_tokens": 8,
            "n": 2,
            "messages": [
                {"role": "system", "content": "Book"},
                {"role": "user", "content": "What is the best book"},
            ],
        },
    )
    assert res.status_code == 200
    assert len(res.body["choices"]) == 2
    for choice in res.body["choices"]:
        assert choice["message"]["role"] == "assistant"
        assert match_regex(ANY_TEXT, choice["message"]["content"])
        assert choice["finish_reason"] == "length"
