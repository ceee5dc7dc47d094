# Adapted for structllm from ggml-org/llama.cpp
# tools/server/tests/unit/test_basic.py
# (commit fad84e392f836d5a37048690dd9fc74631047631), MIT licence
# (peer/llamacpp/LICENSE). What changed and why: peer/llamacpp/NOTES.md.
# structllm: test_load_split_model (split GGUF files) and test_no_webui (the
# web UI) are llama.cpp's own (not applicable: docs/peer-suites.md);
# test_server_slots is a strict xfail (/slots is refused: SLOTS below).

import pytest

from peer.llamacpp.utils import ServerPreset

server = ServerPreset.tinyllama2()

SLOTS = (
    "deliberate difference: /slots is refused (501, as llama.cpp without "
    "--slots): structllm schedules one continuous batch, not slots"
)


@pytest.fixture(autouse=True)
def create_server():
    global server
    server = ServerPreset.tinyllama2()


def test_server_start_simple():
    global server
    server.start()
    res = server.make_request("GET", "/health")
    assert res.status_code == 200


def test_server_props():
    global server
    server.start()
    res = server.make_request("GET", "/props")
    assert res.status_code == 200
    # structllm: the model reference it was started with (tiny is built in,
    # not a .gguf file)
    assert res.body["model_path"] == "tiny"
    assert res.body["total_slots"] == server.n_slots
    default_val = res.body["default_generation_settings"]
    assert server.n_ctx is not None and server.n_slots is not None
    assert default_val["n_ctx"] == server.n_ctx / server.n_slots
    # structllm: no server-wide --seed (the harness sends one per request):
    # the default is -1, llama.cpp's "random"
    assert default_val["params"]["seed"] == -1


def test_server_models():
    global server
    server.start()
    res = server.make_request("GET", "/models")
    assert res.status_code == 200
    assert len(res.body["data"]) == 1
    assert res.body["data"][0]["id"] == server.model_alias


@pytest.mark.xfail(reason=SLOTS, strict=True)
def test_server_slots():
    global server

    # without slots endpoint enabled, this should return error
    server.server_slots = False
    server.start()
    res = server.make_request("GET", "/slots")
    assert res.status_code == 501  # ERROR_TYPE_NOT_SUPPORTED
    assert "error" in res.body
    server.stop()

    # with slots endpoint enabled, this should return slots info
    server.server_slots = True
    server.n_slots = 2
    server.start()
    res = server.make_request("GET", "/slots")
    assert res.status_code == 200
    assert len(res.body) == server.n_slots
    assert server.n_ctx is not None and server.n_slots is not None
    assert res.body[0]["n_ctx"] == server.n_ctx / server.n_slots
    assert "params" in res.body[0]
    assert res.body[0]["params"]["seed"] == server.seed
