# Adapted for structllm from ggml-org/llama.cpp
# tools/server/tests/unit/test_basic.py
# (commit fad84e392f836d5a37048690dd9fc74631047631), MIT licence
# (peer/llamacpp/LICENSE). What changed and why: peer/llamacpp/NOTES.md.
# structllm: test_server_props (/props), test_server_slots (/slots),
# test_load_split_model (split GGUF files) and test_no_webui (the web UI) are
# llama.cpp's own (not applicable: docs/peer-suites.md).

import pytest

from peer.llamacpp.utils import ServerPreset

server = ServerPreset.tinyllama2()


@pytest.fixture(autouse=True)
def create_server():
    global server
    server = ServerPreset.tinyllama2()


def test_server_start_simple():
    global server
    server.start()
    res = server.make_request("GET", "/health")
    assert res.status_code == 200


def test_server_models():
    global server
    server.start()
    # structllm: "/models" -> "/v1/models" (utils.py adds the prefix)
    res = server.make_request("GET", "/models")
    assert res.status_code == 200
    assert len(res.body["data"]) == 1
    assert res.body["data"][0]["id"] == server.model_alias
