# Adapted for structllm from ggml-org/llama.cpp
# tools/server/tests/unit/test_tokenize.py
# (commit ac18090e240036cc0dfc88b4538e38240f965d9f), MIT licence
# (peer/llamacpp/LICENSE). What changed and why: peer/llamacpp/NOTES.md.
# structllm: test_tokenize_with_bos is not applicable (tiny has no BOS
# token; docs/peer-suites.md).

import pytest


@pytest.fixture
def server(server_factory):
    return server_factory("tinyllama2")


def test_tokenize_detokenize(server):
    server.start()
    # tokenize
    content = "What is the capital of France ?"
    res_tok = server.make_request("POST", "/tokenize", data={"content": content})
    assert res_tok.status_code == 200
    assert len(res_tok.body["tokens"]) > 5
    # detokenize
    res_detok = server.make_request(
        "POST",
        "/detokenize",
        data={
            "tokens": res_tok.body["tokens"],
        },
    )
    assert res_detok.status_code == 200
    assert res_detok.body["content"].strip() == content


def test_tokenize_with_pieces(server):
    server.start()
    # tokenize
    content = "This is a test string with unicode 媽 and emoji 🤗"
    res_tok = server.make_request(
        "POST",
        "/tokenize",
        data={
            "content": content,
            "with_pieces": True,
        },
    )
    assert res_tok.status_code == 200
    for token in res_tok.body["tokens"]:
        assert "id" in token
        assert token["id"] > 0
        assert "piece" in token
        assert len(token["piece"]) > 0
