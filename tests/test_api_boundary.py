"""The API boundary (issue 18): no request takes the server down, no field is
accepted and ignored, every status carries an OpenAI error body.

One real `structllm serve` per loop, with small caps so the limits are
cheap to reach.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import anyio
import anyio.lowlevel
import httpx
import pytest

from structllm.engine.frontend.inputs import parse_prompt
from structllm.llm import LLM
from structllm.params import SamplingParams
from structllm.text.tokenizer import load_tokenizer
from tests.test_server import ENGINE, _worker_pid, run_server, wait_idle

LIMITS = [
    "--max-model-len",
    "512",
    "--num-blocks",
    "128",
    "--max-num-seqs",
    "16",
    "--max-body-bytes",
    "1000000",
    "--body-timeout",
    "1",
    "--header-timeout",
    "2",
    "--max-prompt-bytes",
    "100000",
]


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def server(request: pytest.FixtureRequest) -> Iterator[str]:
    with run_server(*LIMITS, loop=request.param) as (url, proc):
        yield url
        assert proc.poll() is None, "the server exited"


def post(url: str, path: str, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=30, **kw)


def assert_serves(url: str) -> None:
    r = post(url, "/v1/completions", {"prompt": "ok", "max_tokens": 2})
    assert r.status_code == 200, r.text
    r = post(
        url,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "ok"}], "max_tokens": 2},
    )
    assert r.status_code == 200, r.text


def assert_openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert isinstance(err["message"], str) and err["message"]
    return dict(err)


CHAT = [{"role": "user", "content": "hi"}]
SURROGATE = "\ud800"
# Each of these used to exit the server (a value the engine wire cannot
# carry) or give a plain-text 500; now a 400 naming the field.
CRASHERS: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/completions", {"prompt": "x", "max_tokens": 2**64}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "top_k": 2**64}, "top_k"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 2**70}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": "x", "seed": -(2**63) - 1}, "seed"),
    ("/v1/completions", {"prompt": "x", "n": 2**64}, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 2**64}, "logprobs"),
    (
        "/v1/completions",
        {"prompt": "x", "stop_token_ids": [1, 2**64]},
        "stop_token_ids[1]",
    ),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [300]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "stop": [SURROGATE]}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": SURROGATE}, "stop"),
    ("/v1/completions", {"prompt": SURROGATE}, "prompt"),
    ("/v1/completions", {"prompt": ["a", SURROGATE]}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2**64]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": SURROGATE}, "model"),
    ("/v1/completions", {"prompt": "x", "user": SURROGATE}, "user"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 2**64}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"300": 1}}, "logit_bias"),
    (
        "/v1/completions",
        {"prompt": "x", "allowed_token_ids": [2**64]},
        "allowed_token_ids[0]",
    ),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2**64}, "max_tokens"),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "max_completion_tokens": 2**64},
        "max_completion_tokens",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": SURROGATE}]},
        "messages[0].content",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": SURROGATE, "content": "x"}]},
        "messages[0].role",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": SURROGATE}]}
            ]
        },
        "messages[0].content",
    ),
    ("/v1/chat/completions", {"messages": CHAT, "stop": [SURROGATE]}, "stop"),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "logprobs": True, "top_logprobs": 2**64},
        "top_logprobs",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "param"), CRASHERS, ids=[f"{p[4:]}-{f}" for p, _, f in CRASHERS]
)
def test_crashers_are_400_naming_the_field(
    server: str, path: str, body: dict[str, Any], param: str
) -> None:
    # json.dumps writes a lone surrogate as the \ud800 escape, as a client would
    r = httpx.post(
        f"{server}{path}",
        content=json.dumps(body),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    err = assert_openai_error(r, 400)
    assert err["param"] == param and param.split("[")[0] in err["message"]
    assert_serves(server)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "x", "temperature": NaN}',
        b'{"prompt": "x", "max_tokens": Infinity}',
        b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
        b'{"prompt": "x", "stop": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
        b'{"prompt": "\xff\xfe"}',
        b"",
    ],
    ids=["nan", "infinity", "5000-digits", "deep", "bad-utf8", "empty"],
)
def test_invalid_json_is_400(server: str, raw: bytes) -> None:
    r = httpx.post(f"{server}/v1/completions", content=raw, timeout=30)
    assert_openai_error(r, 400)
    assert_serves(server)


def test_json_overflowing_floats_name_the_field(server: str) -> None:
    r = httpx.post(
        f"{server}/v1/completions", content=b'{"prompt": "x", "temperature": 1e309}'
    )
    assert assert_openai_error(r, 400)["param"] == "temperature"


def test_a_stream_survives_every_crasher_on_both_endpoints(server: str) -> None:
    """Long streams keep running while each crasher is refused."""
    body = {"prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def main() -> list[list[str]]:
        events: list[list[str]] = [[], []]
        async with httpx.AsyncClient(base_url=server, timeout=60) as ac:

            async def stream(i: int, started: anyio.Event) -> None:
                async with ac.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data:"):
                            events[i].append(line)
                            started.set()

            async with anyio.create_task_group() as tg:
                for i in range(2):
                    started = anyio.Event()
                    tg.start_soon(stream, i, started)
                    await started.wait()
                for path, bad, _ in CRASHERS:
                    r = await ac.post(
                        path,
                        content=json.dumps(bad),
                        headers={"content-type": "application/json"},
                    )
                    assert r.status_code == 400, r.text
        return events

    for events in anyio.run(main):
        assert events[-1] == "data: [DONE]"
        assert not any('"error"' in e for e in events)
        assert sum(len(json.loads(e[5:])["choices"]) for e in events[:-1]) >= 2
    wait_idle(server)


def test_every_status_has_an_openai_body(server: str) -> None:
    err = assert_openai_error(httpx.get(f"{server}/v1/nowhere"), 404)
    assert "/v1/nowhere" in err["message"]
    assert_openai_error(httpx.get(f"{server}/v1/completions"), 405)
    assert_openai_error(
        httpx.post(f"{server}/v1/completions", content=b"x" * 1_000_001), 413
    )
    assert_openai_error(post(server, "/v1/completions", [1, 2]), 400)
    assert_openai_error(
        post(server, "/v1/completions", {"prompt": "x", "model": "m"}), 404
    )
    host, port = server.removeprefix("http://").split(":")

    def raw(request: bytes) -> tuple[int, dict[str, Any]]:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(request)
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        return int(head.split()[1]), json.loads(body)

    status, body = raw(
        b"GET /health HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 70_000 + b"\r\n\r\n"
    )
    assert status == 431 and body["error"]["code"] == 431
    status, body = raw(b"NOT HTTP AT ALL\r\n\r\n")
    assert status == 400 and body["error"]["code"] == 400
    assert_serves(server)


def test_slow_or_incomplete_body_gets_408(server: str) -> None:
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
            b'{"prompt": '
        )
        start = time.monotonic()
        data = sock.recv(65536)
        waited = time.monotonic() - start
    assert b" 408 " in data.split(b"\r\n")[0], data
    assert waited < 5
    # and one that never finishes its headers is closed (--header-timeout 2)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        start = time.monotonic()
        assert sock.recv(65536) == b""
        assert time.monotonic() - start < 6
    assert_serves(server)


def test_refused_fields_are_400_naming_them(server: str) -> None:
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
        ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        (
            "/v1/completions",
            {"prompt": "x", "use_beam_search": True},
            "use_beam_search",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        ("/v1/completions", {"prompt": "x", "max_tokens": 600}, "max_tokens"),
        ("/v1/chat/completions", {"messages": CHAT, "tools": [{}]}, "tools[0].type"),
        ("/v1/completions", {"prompt": "x", "tool_choice": "auto"}, "tool_choice"),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "functions": [{"name": "f"}]},
            "functions",
        ),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "max_completion_tokens": 600},
            "max_completion_tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
        ),
    ]
    for path, body, param in cases:
        err = assert_openai_error(post(server, path, body), 400)
        assert err["param"] == param, (body, err)
    # no-op values of refused fields are fine
    r = post(
        server,
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 1, "tool_choice": "none", "tools": []},
    )
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def reference() -> LLM:
    return LLM("tiny-random", show_progress=False, max_model_len=512, num_blocks=64)


def greedy(llm: LLM, prompt: str, n: int, **params: Any) -> list[int]:
    ids = parse_prompt(prompt, load_tokenizer("tiny-random")).token_ids
    out = llm.generate(
        {"prompt_token_ids": list(ids)},
        SamplingParams(temperature=0, max_tokens=n, **params),
        use_tqdm=False,
    )
    return list(out[0].token_ids)


def test_logit_bias_and_allowed_token_ids_work(server: str, reference: LLM) -> None:
    plain = greedy(reference, "abc", 6, ignore_eos=True)
    body = {"prompt": "abc", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = post(server, "/v1/completions", {**body, "logit_bias": {"65": 100}})
    assert r.json()["choices"][0]["text"] == "A" * 6
    banned = post(
        server,
        "/v1/completions",
        {**body, "logit_bias": {str(plain[0]): -100}, "return_token_ids": True},
    ).json()["choices"][0]
    assert banned["token_ids"][0] != plain[0]
    assert banned["token_ids"] == greedy(
        reference, "abc", 6, ignore_eos=True, logit_bias={plain[0]: -100}
    )
    allowed = [ord("x"), ord("y")]
    r = post(
        server,
        "/v1/completions",
        {**body, "temperature": 1.0, "seed": 3, "allowed_token_ids": allowed},
    )
    assert set(r.json()["choices"][0]["text"]) <= {"x", "y"}


def test_token_ids_usage_and_fingerprint(server: str, reference: LLM) -> None:
    ids = list(parse_prompt("hello", load_tokenizer("tiny-random")).token_ids)
    body = {
        "prompt": "hello",
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "logprobs": 1,
        "return_tokens_as_token_ids": True,
    }
    r = post(server, "/v1/completions", body).json()
    choice = r["choices"][0]
    assert choice["prompt_token_ids"] == ids
    assert choice["token_ids"] == greedy(reference, "hello", 5, ignore_eos=True)
    assert choice["logprobs"]["tokens"] == [
        f"token_id:{t}" for t in choice["token_ids"]
    ]
    assert r["system_fingerprint"].startswith("fp_")
    assert r["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert r["usage"]["prompt_tokens"] == len(ids)
    # streaming: token ids per chunk, usage in every chunk
    with httpx.stream(
        "POST",
        f"{server}/v1/completions",
        json={
            **body,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
        timeout=30,
    ) as s:
        events = [json.loads(x[5:]) for x in s.iter_lines() if x.startswith("data: {")]
    streamed = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
    assert streamed == choice["token_ids"]
    assert events[0]["choices"][0]["prompt_token_ids"] == ids
    assert all(e["usage"]["prompt_tokens"] == len(ids) for e in events)
    done = [e["usage"]["completion_tokens"] for e in events]
    assert done == sorted(done) and done[-1] == 5
    assert all(e["system_fingerprint"] == r["system_fingerprint"] for e in events)


def test_chat_echo_and_token_ids(server: str) -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hel"},
    ]
    body = {
        "messages": messages,
        "max_tokens": 3,
        "temperature": 0,
        "add_generation_prompt": False,
        "return_token_ids": True,
    }
    plain = post(server, "/v1/chat/completions", body).json()
    echoed = post(server, "/v1/chat/completions", {**body, "echo": True}).json()
    text = plain["choices"][0]["message"]["content"]
    assert echoed["choices"][0]["message"]["content"] == "Hel" + text
    assert plain["prompt_token_ids"] and plain["choices"][0]["token_ids"]


def test_large_prompts_are_capped_and_tokenised_off_the_loop(server: str) -> None:
    """A prompt over --max-prompt-bytes is refused before tokenising; a large
    body under the caps does not stall /health."""
    err = assert_openai_error(
        post(server, "/v1/completions", {"prompt": "a" * 100_001}), 400
    )
    assert err["param"] == "prompt" and "bytes" in err["message"]
    err = assert_openai_error(
        post(
            server,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "é" * 60_000}]},
        ),
        400,
    )
    assert err["param"] == "messages"

    async def main() -> float:
        worst = 0.0
        async with httpx.AsyncClient(base_url=server, timeout=30) as ac:
            done = anyio.Event()

            async def big() -> None:
                ids = [5] * 100_000  # ~300 kB of JSON, over the context
                for _ in range(5):
                    r = await ac.post("/v1/completions", json={"prompt": ids})
                    assert r.status_code == 400
                done.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(big)
                while not done.is_set():
                    start = time.monotonic()
                    assert (await ac.get("/health")).status_code == 200
                    worst = max(worst, time.monotonic() - start)
                    await anyio.sleep(0.01)
        return worst

    assert anyio.run(main) < 0.5
    assert_serves(server)


def test_health_is_503_while_the_worker_is_frozen() -> None:
    with run_server(*LIMITS) as (url, proc):
        pid = _worker_pid(proc.pid)
        os.kill(pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            while httpx.get(f"{url}/health").status_code == 200:
                assert time.monotonic() - start < 6, "still healthy"
                time.sleep(0.05)
            frozen_for = time.monotonic() - start
        finally:
            os.kill(pid, signal.SIGCONT)
        assert frozen_for < 4.5  # 3 heartbeat intervals, plus one of slack
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/health").status_code != 200:
            assert time.monotonic() < deadline, "never healthy again"
            time.sleep(0.05)


def test_sigterm_drains_then_cuts_streams_with_done() -> None:
    args = [*ENGINE, "--graceful-timeout", "1.5"]
    with run_server(*args, loop="trio") as (url, proc):

        async def main() -> tuple[list[str], list[int]]:
            events: list[str] = []
            statuses: list[int] = []
            # 8 choices of 2000 tokens: several seconds, longer than the grace
            body = {
                "prompt": "x",
                "n": 8,
                "max_tokens": 2000,
                "ignore_eos": True,
                "stream": True,
            }
            async with httpx.AsyncClient(base_url=url, timeout=60) as ac:
                started = anyio.Event()

                async def stream() -> None:
                    async with ac.stream("POST", "/v1/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data:"):
                                events.append(line)
                                started.set()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(stream)
                    await started.wait()
                    proc.send_signal(signal.SIGTERM)
                    # draining (as /health says once the signal is handled):
                    # the listener is open, new requests get 503
                    async with httpx.AsyncClient(base_url=url, timeout=10) as fresh:
                        with anyio.fail_after(10):
                            while (await fresh.get("/health")).status_code == 200:
                                await anyio.lowlevel.checkpoint()
                        r = await fresh.post("/v1/completions", json={"prompt": "y"})
                        statuses.append(r.status_code)
                        assert r.json()["error"]["code"] == 503
                        statuses.append((await fresh.get("/health")).status_code)
            return events, statuses

        events, statuses = anyio.run(main)
        assert statuses == [503, 503]
        assert events[-1] == "data: [DONE]"
        assert len(events) < 8 * 2000  # cut at the grace timeout, with an error
        assert json.loads(events[-2][5:])["error"]["code"] == 503
        assert proc.wait(timeout=30) == 0


# -- arbitrary JSON into every field ---------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from structllm.server.chat.protocol import ChatRequest  # noqa: E402
from structllm.server.completions.protocol import CompletionRequest  # noqa: E402
from structllm.server.protocol import refusals  # noqa: E402


def _nested(depth: int) -> str:
    """A placeholder that :func:`_dumps` turns into ``depth`` nested arrays."""
    return f"\x00deep:{depth}\x00"


def _dumps(body: Any) -> bytes:
    """JSON as a careless client writes it: NaN, Infinity, deep nesting."""
    text = json.dumps(body, allow_nan=True)
    for depth in {int(m) for m in re.findall(r"\\u0000deep:(\d+)\\u0000", text)}:
        deep = "[" * depth + "1" + "]" * depth
        text = text.replace(f'"\\u0000deep:{depth}\\u0000"', deep)
    return text.encode()


#: every JSON value, with what breaks parsers: huge integers, lone
#: surrogates, NaN and infinities, deep nesting
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([2**63, 2**64, -(2**63) - 1, 2**70, 10**400, -1, 0])
    | st.floats()
    | st.text(st.characters(codec=None, exclude_categories=()), max_size=8)
    | st.sampled_from(["\ud800", "a\udfff", "", "text"])
    | st.integers(100, 20_000).map(_nested),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.text(max_size=4) | st.sampled_from(["1", "type", "text"]),
            inner,
            max_size=4,
        )
    ),
    max_leaves=8,
)

_COMMON = sorted(
    set(CompletionRequest.model_fields)
    | set(ChatRequest.model_fields)
    | set(refusals.REFUSED)
    | set(refusals.CHAT_REFUSED)
    | set(refusals.COMPLETION_REFUSED)
)
_GOOD = {
    "/v1/completions": {"prompt": "ok", "max_tokens": 2},
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "ok"}],
        "max_tokens": 2,
    },
}
_MESSAGE_FIELDS = ["role", "content", "name", "tool_calls"]


@st.composite
def fuzzed_requests(draw: st.DrawFn) -> tuple[str, bytes]:
    path = draw(st.sampled_from(sorted(_GOOD)))
    body: dict[str, Any] = dict(_GOOD[path])
    for _ in range(draw(st.integers(1, 3))):
        if path.endswith("chat/completions") and draw(st.booleans()):
            message = {"role": "user", "content": "hi"}
            message[draw(st.sampled_from(_MESSAGE_FIELDS))] = draw(json_values)
            body["messages"] = [message]
        else:
            body[draw(st.sampled_from(_COMMON))] = draw(json_values)
    return path, _dumps(body)


def test_arbitrary_json_in_every_field_never_breaks_the_server(server: str) -> None:
    with httpx.Client(base_url=server, timeout=60) as http:

        @settings(
            max_examples=int(os.environ.get("STRUCTLLM_FUZZ_EXAMPLES", "120")),
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
            database=None,
        )
        @given(fuzzed_requests())
        def check(request: tuple[str, bytes]) -> None:
            path, raw = request
            r = http.post(
                path, content=raw, headers={"content-type": "application/json"}
            )
            assert r.status_code < 500, (raw[:300], r.text)
            if r.status_code != 200:
                assert r.json()["error"]["code"] == r.status_code
            good = http.post(path, json=_GOOD[path])
            assert good.status_code == 200, good.text

        check()


def test_listen_backlog_is_the_servers_own(server: str) -> None:
    """hypercorn re-listens with its default of 100 unless told the backlog."""
    import shutil

    if shutil.which("ss") is None:
        pytest.skip("needs ss(8) to read the listen queue")
    port = server.rsplit(":", 1)[1]
    out = subprocess.run(
        ["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True
    ).stdout.split()
    assert int(out[2]) >= 1024, out  # Send-Q of a listener: its backlog
