# Written for structllm after ggml-org/llama.cpp
# tools/server/tests/unit/test_embedding.py
# (commit 3a0f73e51c5a30492da876969608442c8bf9ac09), MIT licence
# (peer/llamacpp/LICENSE): the same tests and checks, in the order upstream
# has them. What changed and why: peer/llamacpp/NOTES.md.
# structllm: the bge-small preset is the built-in tiny (ServerPreset), whose
# last hidden states are pooled; --pooling is sent per request by the
# harness. test_embedding_pooling_none (llama.cpp's per-token vectors) is not
# applicable (docs/peer-suites.md). The rows of llama.cpp's own input shapes
# (ids and strings mixed in one input, {"prompt_string"} and {"content":
# [parts]} objects) and the empty string are strict xfails: /v1/embeddings
# takes OpenAI's shapes. Token counts are tiny's (utils.n_text_tokens);
# the openai client names the served model (NOTES.md, "Model names").

import base64
import struct

import pytest
from openai import OpenAI

from peer.llamacpp.utils import ServerPreset, n_text_tokens

EPSILON = 1e-3

server = ServerPreset.bert_bge_small()

SHAPES = (
    "not implemented (refused): llama.cpp's own input shapes (ids and strings "
    "in one input, prompt_string and content-part objects); /v1/embeddings "
    "takes OpenAI's (a string, strings, ids, lists of ids)"
)
EMPTY = (
    "deliberate difference: an empty input is a 400 naming input, as OpenAI "
    "answers (llama.cpp embeds it)"
)


@pytest.fixture(autouse=True)
def create_server():
    global server
    server = ServerPreset.bert_bge_small()


def _norm2(vector):
    return sum(x * x for x in vector)


def _embeddings(body):
    res = server.make_request("POST", "/v1/embeddings", data=body)
    assert res.status_code == 200, res.body
    return res


def test_embedding_single():
    server.pooling = "last"
    server.start()
    res = _embeddings({"input": "I believe the meaning of life is"})
    data = res.body["data"]
    assert len(data) == 1 and "embedding" in data[0]
    assert len(data[0]["embedding"]) > 1
    # unit length
    assert abs(_norm2(data[0]["embedding"]) - 1) < EPSILON


def test_embedding_multiple():
    server.pooling = "last"
    server.start()
    inputs = [
        "I believe the meaning of life is",
        "Write a joke about AI from a very long prompt which will not be truncated",
        "This is a test",
        "This is another test",
    ]
    res = _embeddings({"input": inputs})
    assert len(res.body["data"]) == len(inputs)
    assert all(len(d["embedding"]) > 1 for d in res.body["data"])


def test_embedding_multiple_with_fa():
    global server
    server = ServerPreset.bert_bge_small_with_fa()
    server.pooling = "last"
    server.start()
    # upstream: lengths around 256, one of which takes llama.cpp's FA branch
    inputs = [
        letter * n for letter, n in (("a ", 253), ("b ", 254), ("c ", 255), ("d ", 256))
    ]
    res = _embeddings({"input": inputs})
    assert len(res.body["data"]) == 4
    assert all(len(d["embedding"]) > 1 for d in res.body["data"])


@pytest.mark.parametrize(
    "input,is_multi_prompt",
    [
        pytest.param("", False, marks=pytest.mark.xfail(reason=EMPTY, strict=True)),
        ("string", False),
        ([12, 34, 56], False),
        pytest.param(
            [12, 34, "string", 56, 78], False,
            marks=pytest.mark.xfail(reason=SHAPES, strict=True),
        ),
        (["string1", "string2"], True),
        pytest.param(
            ["string1", [12, 34, 56]], True,
            marks=pytest.mark.xfail(reason=SHAPES, strict=True),
        ),
        ([[12, 34, 56], [12, 34, 56]], True),
        pytest.param(
            [[12, 34, 56], [12, "string", 34, 56]], True,
            marks=pytest.mark.xfail(reason=SHAPES, strict=True),
        ),
        pytest.param(
            {"prompt_string": "string"}, False,
            marks=pytest.mark.xfail(reason=SHAPES, strict=True),
        ),
        pytest.param(
            {"content": [{"type": "text", "text": "string"}]}, False,
            marks=pytest.mark.xfail(reason=SHAPES, strict=True),
        ),
        pytest.param(
            ["string1", {"prompt_string": "string2"},
             {"content": [{"type": "text", "text": "string3"}]}], True,
            marks=pytest.mark.xfail(reason=SHAPES, strict=True),
        ),
    ],
)  # fmt: skip
def test_embedding_mixed_input(input, is_multi_prompt: bool):
    server.start()
    data = _embeddings({"input": input}).body["data"]
    if is_multi_prompt:
        assert len(data) == len(input)
    assert all("embedding" in d and len(d["embedding"]) > 1 for d in data)


@pytest.mark.xfail(reason=SHAPES, strict=True)
def test_embedding_content_text_same_as_string():
    server.pooling = "last"
    server.start()
    parts = [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]
    data = _embeddings({"input": ["hello world", {"content": parts}]}).body["data"]
    assert data[0]["embedding"] == data[1]["embedding"]


@pytest.mark.parametrize(
    "input",
    [
        [],
        {"content": "string"},
        {"content": [{"type": "input_audio", "input_audio": {}}]},
        # not a multimodal model
        {"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
    ],
)  # fmt: skip
def test_embedding_invalid_input(input):
    server.start()
    res = server.make_request("POST", "/v1/embeddings", data={"input": input})
    assert res.status_code == 400


def test_embedding_pooling_mean():
    server.pooling = "mean"
    server.start()
    data = _embeddings({"input": "I believe the meaning of life is"}).body["data"]
    assert len(data) == 1 and len(data[0]["embedding"]) > 1
    assert abs(_norm2(data[0]["embedding"]) - 1) < EPSILON


def test_embedding_pooling_mean_multiple():
    server.pooling = "mean"
    server.start()
    inputs = [
        "I believe the meaning of life is",
        "Write a joke about AI",
        "This is a test",
    ]
    data = _embeddings({"input": inputs}).body["data"]
    assert len(data) == 3
    assert all(len(d["embedding"]) > 1 for d in data)


def test_embedding_pooling_none_oai():
    server.pooling = "none"
    server.start()
    res = server.make_request(
        "POST", "/v1/embeddings", data={"input": "hello hello hello"}
    )
    # OpenAI's route has no per-token vectors
    assert res.status_code == 400
    assert "error" in res.body


def _client():
    return OpenAI(
        api_key="dummy", base_url=f"http://{server.server_host}:{server.server_port}/v1"
    )


def test_embedding_openai_library_single():
    server.pooling = "last"
    server.start()
    # structllm: the served model's name (upstream: text-embedding-3-small)
    with _client() as client:
        res = client.embeddings.create(
            model=server.model_alias, input="I believe the meaning of life is"
        )
    assert len(res.data) == 1 and len(res.data[0].embedding) > 1


def test_embedding_openai_library_multiple():
    server.pooling = "last"
    server.start()
    inputs = [
        "I believe the meaning of life is",
        "Write a joke about AI from a very long prompt which will not be truncated",
        "This is a test",
        "This is another test",
    ]
    with _client() as client:
        res = client.embeddings.create(model=server.model_alias, input=inputs)
    assert len(res.data) == 4
    assert all(len(d.embedding) > 1 for d in res.data)


def test_embedding_error_prompt_too_long():
    server.pooling = "last"
    server.start()
    res = server.make_request(
        "POST", "/v1/embeddings", data={"input": "This is a test " * 512}
    )
    assert res.status_code != 200
    assert "too large" in res.body["error"]["message"]


def test_same_prompt_give_same_result():
    server.pooling = "last"
    server.start()
    data = _embeddings({"input": ["I believe the meaning of life is"] * 5}).body["data"]
    assert len(data) == 5
    first = data[0]["embedding"]
    for other in data[1:]:
        pairs = zip(first, other["embedding"], strict=True)
        assert all(abs(x - y) < EPSILON for x, y in pairs)


@pytest.mark.parametrize(
    "content",
    # structllm: upstream's counts (9, 6) are bge's; tiny's come from its tokenizer
    ["I believe the meaning of life is", "This is a test"],
)
def test_embedding_usage_single(content):
    server.start()
    usage = _embeddings({"input": content}).body["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"]
    assert usage["prompt_tokens"] == n_text_tokens(content)


def test_embedding_usage_multiple():
    server.start()
    text = "I believe the meaning of life is"
    usage = _embeddings({"input": [text, text]}).body["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"]
    assert usage["prompt_tokens"] == 2 * n_text_tokens(text)


def test_embedding_openai_library_base64():
    server.start()
    text = "Test base64 embedding output"
    floats = _embeddings({"input": text}).body["data"][0]["embedding"]
    res = _embeddings({"input": text, "encoding_format": "base64"})
    assert "data" in res.body and len(res.body["data"]) == 1
    encoded = res.body["data"][0]["embedding"]
    assert isinstance(encoded, str)
    raw = base64.b64decode(encoded)
    decoded = struct.unpack(f"{len(raw) // 4}f", raw)
    assert decoded and all(isinstance(x, float) for x in decoded)
    assert len(decoded) == len(floats)
    assert all(abs(x - y) < EPSILON for x, y in zip(decoded, floats, strict=True))
