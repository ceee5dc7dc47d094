# Adapted for structllm from ggml-org/llama.cpp
# tools/server/tests/unit/test_completion.py
# (commit f3beb22b17eb6bbf7096a132d9c3b3ac82453e72), MIT licence
# (peer/llamacpp/LICENSE). What changed and why: peer/llamacpp/NOTES.md.
# structllm: the file's other tests post to llama.cpp's native /completion
# (n_predict, timings, generation_settings, /slots, n_probs, ...) and
# test_completion_stream_with_openai_library_stops downloads Phi-3.5: not
# applicable (docs/peer-suites.md). These two use the OpenAI client on
# /v1/completions.

from openai import OpenAI

from peer.llamacpp.utils import ServerPreset, match_regex

server = ServerPreset.tinyllama2()

ANY_TEXT = r"\S"


def setup_function():
    # upstream: an autouse fixture doing the same
    global server
    server = ServerPreset.tinyllama2()


def test_completion_with_openai_library():
    global server
    server.start()
    client = OpenAI(
        api_key="dummy", base_url=f"http://{server.server_host}:{server.server_port}/v1"
    )
    # structllm: model "davinci-002" -> the served name (an unknown model is
    # a 404); the client is closed (warnings are errors here)
    with client:
        res = client.completions.create(
            model=server.model_alias,
            prompt="I believe the meaning of life is",
            max_tokens=8,
            # structllm: llama.cpp's server-wide --seed 42 --temp 0.8 (the
            # harness adds them to its own requests; this one is the
            # client's): unseeded, tiny may end before 8 tokens
            seed=server.seed,
            temperature=server.temperature,
        )
    # structllm: "fp_" + a hash of the model (llama.cpp: "b" + its build)
    assert res.system_fingerprint is not None and res.system_fingerprint.startswith(
        "fp_"
    )
    assert res.choices[0].finish_reason == "length"
    assert res.choices[0].text is not None
    # structllm: stories260K's words -> any text
    assert match_regex(ANY_TEXT, res.choices[0].text)


def test_completion_stream_with_openai_library():
    global server
    server.start()
    client = OpenAI(
        api_key="dummy", base_url=f"http://{server.server_host}:{server.server_port}/v1"
    )
    with client:
        res = client.completions.create(
            model=server.model_alias,
            prompt="I believe the meaning of life is",
            max_tokens=8,
            stream=True,
            # structllm: as above
            seed=server.seed,
            temperature=server.temperature,
        )
        output_text = ""
        for data in res:
            choice = data.choices[0]
            # structllm: the finishing chunk carries the last token too
            # (vLLM's way; llama.cpp's finishing chunk has no text), so every
            # chunk's text is read
            assert choice.text is not None
            output_text += choice.text
    assert match_regex(ANY_TEXT, output_text)
