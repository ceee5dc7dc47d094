# Adapted for structllm after ggml-org/llama.cpp
# tools/server/tests/unit/test_compat_oai_responses.py
# (commit 084f0cf303da68fa7a586f48fdbbecdd08997625), MIT licence
# (peer/llamacpp/LICENSE): the same tests, written for structllm. What
# changed and why: peer/llamacpp/NOTES.md; every change is marked
# "structllm:" below.
# structllm: test_responses_stream_with_llama_telemetry reads llama.cpp's
# "timings" and "prompt_progress" (timings_per_token, return_progress): not
# applicable, docs/peer-suites.md.
# The texts of llama.cpp's stories260K model ("Suddenly") are not tiny's: the
# tests check for non-empty text instead.

import pytest
from openai import OpenAI

from peer.llamacpp.utils import ServerPreset, ServerProcess, match_regex

server: ServerProcess

ANY_TEXT = r"\S"


@pytest.fixture(autouse=True)
def create_server():
    global server
    server = ServerPreset.tinyllama2()


@pytest.mark.parametrize(
    ("text_format", "n_predicted", "re_content"),
    [
        ({"type": "json_schema", "name": "test", "schema": {"const": "foooooo"}}, 10,
         '"foooooo"'),
        # structllm: "(\{|Suddenly)+" -> the object's opening brace
        ({"type": "json_object"}, 10, r"^\{"),
        ({"type": "text"}, 10, None),
        # a json_schema format without its schema is refused
        ({"type": "json_schema", "name": "test"}, 0, None),
    ],
)  # fmt: skip
def test_responses_with_text_format(text_format, n_predicted, re_content):
    server.start()
    body = {"input": "Write an example", "text": {"format": text_format}}
    if n_predicted:
        body["max_output_tokens"] = n_predicted
    res = server.make_request("POST", "/responses", data=body)
    if re_content is not None:
        assert res.status_code == 200
        message = next(o for o in res.body["output"] if o["type"] == "message")
        assert match_regex(re_content, message["content"][0]["text"])
    elif text_format["type"] == "text":
        assert res.status_code == 200
    else:
        assert res.status_code == 400
        # structllm: the 400 names the field
        assert res.body["error"]["param"] == "text.format.schema"


def _client() -> OpenAI:
    return OpenAI(
        api_key="dummy", base_url=f"http://{server.server_host}:{server.server_port}/v1"
    )


INPUT = [
    {"role": "system", "content": "Book"},
    {"role": "user", "content": "What is the best book"},
]


def test_responses_with_openai_library():
    server.start()
    res = _client().responses.create(
        # structllm: "gpt-4.1" -> the served name (another is a 404)
        model=server.model_alias,
        input=INPUT,
        max_output_tokens=8,
        temperature=0.8,
    )
    assert res.id.startswith("resp_")
    assert res.output[0].id is not None and res.output[0].id.startswith("msg_")
    assert match_regex(ANY_TEXT, res.output_text)


def test_responses_stream_with_openai_library():
    server.start()
    stream = _client().responses.create(
        model=server.model_alias,  # structllm: the served name
        input=INPUT,
        max_output_tokens=8,
        temperature=0.8,
        stream=True,
    )
    text = resp_id = msg_id = ""
    completed = False
    for event in stream:
        if event.type == "response.created":
            assert event.response.id.startswith("resp_")
            resp_id = event.response.id
        elif event.type == "response.in_progress":
            assert event.response.id == resp_id
        elif event.type == "response.output_item.added":
            assert event.item.id is not None and event.item.id.startswith("msg_")
            msg_id = event.item.id
        elif event.type in (
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
        ):
            assert event.item_id == msg_id
            if event.type == "response.output_text.delta":
                text += event.delta
        elif event.type == "response.output_item.done":
            assert event.item.id == msg_id
        elif event.type == "response.completed":
            out = event.response
            assert out.id.startswith("resp_")
            assert out.output[0].id is not None and out.output[0].id.startswith("msg_")
            assert text == out.output_text
            assert match_regex(ANY_TEXT, out.output_text)
            completed = True
    # structllm: added, so that a stream without response.completed fails
    assert completed
