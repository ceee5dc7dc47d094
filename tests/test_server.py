"""The HTTP server over real loopback sockets, with the real openai client.

Servers run as `structllm serve` subprocesses (worker process included),
one per --loop value, shared by the tests of this module.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import httpx
import openai
import pytest

from structllm.engine.frontend.inputs import parse_prompt
from structllm.llm import LLM
from structllm.params import SamplingParams
from structllm.text.tokenizer import load_tokenizer

ENGINE = ["--max-model-len", "2048", "--num-blocks", "512", "--max-num-seqs", "64"]


@contextmanager
def run_server(
    *args: str, loop: str = "asyncio"
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    cmd = [
        sys.executable,
        "-m",
        "structllm.cli",
        "serve",
        "tiny-random",
        "--port",
        "0",
        "--loop",
        loop,
        *args,
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        assert proc.stdout is not None
        url = None
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"server exited with {proc.wait()}")
            m = re.search(r"serving .* on (http://\S+)", line)
            url = m.group(1) if m else None
        assert url is not None
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def server(request: pytest.FixtureRequest) -> Iterator[str]:
    with run_server(*ENGINE, loop=request.param) as (url, _):
        yield url


@pytest.fixture(scope="module")
def reference() -> LLM:
    return LLM("tiny-random", show_progress=False, max_model_len=256, num_blocks=64)


def expected_text(llm: LLM, prompt: str, max_tokens: int) -> str:
    tok = load_tokenizer("tiny-random")
    ids = parse_prompt(prompt, tok).token_ids
    out = llm.generate(
        {"prompt_token_ids": list(ids)},
        SamplingParams(temperature=0, max_tokens=max_tokens),
        use_tqdm=False,
    )
    return out[0].text


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_idle(url: str) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if (
            metric(url, "structllm_num_requests_running") == 0
            and metric(url, "structllm_kv_cache_usage_perc") == 0
        ):
            return
        time.sleep(0.05)
    pytest.fail("the engine did not go idle")


def test_completions_match_engine(server: str, reference: LLM) -> None:
    c = client(server)
    want = expected_text(reference, "Hello world", 12)
    r = c.completions.create(
        model="tiny-random", prompt="Hello world", max_tokens=12, temperature=0
    )
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 12
    chunks = list(
        c.completions.create(
            model="tiny-random",
            prompt="Hello world",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_chat_sync_and_async(server: str) -> None:
    c = client(server)
    messages = [{"role": "user", "content": "Say hi"}]
    r = c.chat.completions.create(
        model="tiny-random", messages=messages, max_tokens=8, temperature=0
    )
    text = r.choices[0].message.content
    streamed = "".join(
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(
            model="tiny-random",
            messages=messages,
            max_tokens=8,
            temperature=0,
            stream=True,
        )
        if ch.choices
    )
    assert streamed == text

    async def use_async() -> str:
        ac = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
        async with ac:
            r = await ac.chat.completions.create(
                model="tiny-random", messages=messages, max_tokens=8, temperature=0
            )
        return r.choices[0].message.content or ""

    assert anyio.run(use_async) == text


def test_n_seed_and_logprobs(server: str) -> None:
    c = client(server)
    request = {
        "model": "tiny-random",
        "prompt": "abc",
        "max_tokens": 6,
        "temperature": 1.0,
    }
    r = c.completions.create(**request, n=3, seed=7, logprobs=2)
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2]
    again = c.completions.create(**request, n=3, seed=7, logprobs=2)
    assert [ch.text for ch in r.choices] == [ch.text for ch in again.choices]
    lp = r.choices[0].logprobs
    assert lp is not None and len(lp.token_logprobs) == 6
    # keyed by token text (OpenAI's format), so byte tokens may collide
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)


BAD = [
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [300, 5]}, "prompt"),
    ({"prompt": [1] * 2100}, "prompt"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": 5}, "prompt"),
]


@pytest.mark.parametrize(("body", "field"), BAD, ids=[f for _, f in BAD])
def test_bad_input_is_400_naming_the_field(server: str, body: dict, field: str) -> None:
    r = httpx.post(f"{server}/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"]
    good = httpx.post(
        f"{server}/v1/completions", json={"prompt": "ok", "max_tokens": 2}
    )
    assert good.status_code == 200


def test_invalid_json_and_unknown_model(server: str) -> None:
    r = httpx.post(f"{server}/v1/completions", content=b"{nope")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{server}/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.post(f"{server}/v1/chat/completions", json={"messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_more_refusals_and_usage(server: str) -> None:
    # streaming or not, a bad prompt is refused before any 200 is promised
    r = httpx.post(
        f"{server}/v1/completions", json={"prompt": [1] * 2100, "stream": True}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(f"{server}/v1/completions", content=b"[" * 100_000)
    assert r.status_code == 400
    r = httpx.post(
        f"{server}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
    )
    assert r.json()["error"]["param"] == "messages[0].content", r.text
    # two prompts, two choices each: each prompt's tokens counted once
    r = httpx.post(
        f"{server}/v1/completions", json={"prompt": ["a", "a"], "n": 2, "max_tokens": 1}
    )
    assert r.status_code == 200
    per_prompt = len(parse_prompt("a", load_tokenizer("tiny-random")).token_ids)
    assert r.json()["usage"]["prompt_tokens"] == 2 * per_prompt


def test_models_and_health(server: str) -> None:
    assert httpx.get(f"{server}/health").status_code == 200
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["tiny-random"]


def test_disconnect_mid_stream_aborts(server: str) -> None:
    aborted = metric(server, 'structllm_requests_total{finished_reason="abort"}')
    body = {"prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # one chunk, then hang up
    wait_idle(server)
    after = metric(server, 'structllm_requests_total{finished_reason="abort"}')
    assert after == aborted + 1


def test_disconnect_before_first_byte_aborts(server: str) -> None:
    """A non-streaming request, abandoned while it runs, leaves the engine."""
    aborted = metric(server, 'structllm_requests_total{finished_reason="abort"}')
    body = json.dumps(
        {"prompt": ["a", "b"], "n": 16, "max_tokens": 250, "ignore_eos": True}
    ).encode()
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.monotonic() + 10
        while metric(server, "structllm_num_requests_running") < 32:
            assert time.monotonic() < deadline, "the requests never ran"
            time.sleep(0.01)
    wait_idle(server)
    after = metric(server, 'structllm_requests_total{finished_reason="abort"}')
    assert after == aborted + 32


def test_256_concurrent_streams(server: str) -> None:
    async def main() -> list[int]:
        limits = httpx.Limits(max_connections=300)
        counts: list[int] = []
        async with httpx.AsyncClient(base_url=server, limits=limits, timeout=120) as ac:

            async def one(i: int) -> None:
                body = {
                    "prompt": f"req {i}",
                    "max_tokens": 8,
                    "ignore_eos": True,
                    "stream": True,
                    "temperature": 0,
                }
                n = 0
                async with ac.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            assert '"error"' not in line
                            n += 1
                        elif line == "data: [DONE]":
                            counts.append(n)

            async with anyio.create_task_group() as tg:
                for i in range(256):
                    tg.start_soon(one, i)
        return counts

    counts = anyio.run(main)
    assert len(counts) == 256 and min(counts) >= 1
    wait_idle(server)


LONG_STREAM = {"prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True}


def test_overload_timeout_and_death() -> None:
    args = [
        "--max-model-len",
        "2048",
        "--num-blocks",
        "256",
        "--max-num-seqs",
        "1",
        "--max-queued-requests",
        "0",
        "--request-timeout",
        "1",
        "--max-restarts",
        "0",
    ]
    with run_server(*args) as (url, proc):
        with httpx.stream(
            "POST",
            f"{url}/v1/completions",
            timeout=30,
            json=LONG_STREAM,
        ) as first:
            lines = first.iter_lines()  # keep a reference: closing it hangs up
            next(lines)
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "y"})
            assert r.status_code == 503 and r.headers["retry-after"], r.text
        wait_idle(url)
        # a request longer than --request-timeout ends with a clear error
        r = httpx.post(
            f"{url}/v1/completions",
            timeout=30,
            json={"prompt": "x", "max_tokens": 2000, "ignore_eos": True},
        )
        assert r.status_code == 408 and "longer than 1s" in r.json()["error"]["message"]
        wait_idle(url)
        # streaming: the 200 is already sent, so the error is the last event
        with httpx.stream(
            "POST",
            f"{url}/v1/completions",
            timeout=30,
            json=LONG_STREAM,
        ) as r:
            events = [line for line in r.iter_lines() if line.startswith("data:")]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][5:])["error"]["code"] == 408
        wait_idle(url)
        # kill the worker: no restarts allowed, so the engine is dead for good
        pid = _worker_pid(proc.pid)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.returncode == 1


def test_health_is_503_while_loading_then_200(tmp_path: Path) -> None:
    from structllm.models import make_tiny_model

    # big enough that loading takes a while (~30M parameters)
    make_tiny_model(
        tmp_path,
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=8,
        intermediate_size=1536,
    )
    cmd = [
        sys.executable,
        "-m",
        "structllm.cli",
        "serve",
        str(tmp_path),
        "--port",
        "0",
        "--max-model-len",
        "256",
        "--num-blocks",
        "64",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        url = re.search(r"listening on (http://\S+)", line)
        assert url is not None, line
        assert httpx.get(f"{url.group(1)}/health").status_code == 503
        r = httpx.post(f"{url.group(1)}/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        assert "serving" in proc.stdout.readline()
        assert httpx.get(f"{url.group(1)}/health").status_code == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_engine_that_cannot_start_stops_the_server_cleanly(loop: str) -> None:
    """A client polling over a kept-alive connection while the engine fails
    to start: exit 1 with the reason, and no traceback from the HTTP server
    (it was once cancelled mid-way through closing such connections)."""
    cmd = [sys.executable, "-m", "structllm.cli", "serve", "tiny", "--port", "0"]
    cmd += ["--loop", loop, "--num-blocks", "4"]  # fewer than one sequence needs
    with tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True)
        try:
            assert proc.stdout is not None
            url = re.search(r"listening on (http://\S+)", proc.stdout.readline())
            assert url is not None
            deadline = time.monotonic() + 60
            with httpx.Client(base_url=url.group(1)) as http:
                while proc.poll() is None and time.monotonic() < deadline:
                    with contextlib.suppress(httpx.TransportError):
                        assert http.get("/health").status_code == 503
                    time.sleep(0.05)  # leave the cores to the loading engine
            out = proc.communicate(timeout=30)[0]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        stderr.seek(0)
        err = stderr.read()
    assert proc.returncode == 1
    assert "the engine failed to start" in err and "num_blocks" in err
    assert "Traceback" not in err and "Error" not in out


def test_a_tokenizer_that_cannot_load_stops_serve_before_it_listens(
    tmp_path: Path,
) -> None:
    """The tokenizer loads first, before the HTTP server's modules (its
    transient lists are then memory those imports reuse): a broken one ends
    ``serve`` with the reason, naming the file, before anything listens."""
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (tmp_path / "tokenizer.json").write_text("{not json")
    cmd = [sys.executable, "-m", "structllm.cli", "serve", str(tmp_path)]
    done = subprocess.run(
        [*cmd, "--port", "0"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    assert "listening" not in done.stdout
    assert "the engine failed to start" in done.stderr
    assert "tokenizer.json" in done.stderr and "Traceback" not in done.stderr


def test_graceful_shutdown_exits_zero() -> None:
    with run_server(*ENGINE) as (url, proc):
        assert httpx.get(f"{url}/health").status_code == 200
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200
        # the model runs in the engine process: the server never loads Paddle
        # (or numba), which would cost it ~300 MiB of resident memory, nor
        # numpy (16 MiB)
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "paddle" not in maps and "numba" not in maps
        assert "_multiarray_umath" not in maps
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def _worker_pid(parent: int) -> int:
    for task in os.listdir(f"/proc/{parent}/task"):
        try:
            kids = Path(f"/proc/{parent}/task/{task}/children").read_text().split()
        except FileNotFoundError:  # the thread ended while we looked
            continue
        if kids:
            return int(kids[0])
    raise AssertionError("no worker process")


def test_repeated_prompt_reports_cached_tokens(server: str) -> None:
    c = client(server)
    prompt = "cached prefix " * 4 + server[-5:]  # ~60 byte tokens, unique per server
    first = c.completions.create(model="tiny-random", prompt=prompt, max_tokens=2)
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = c.completions.create(model="tiny-random", prompt=prompt, max_tokens=2)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    cached = again.usage.prompt_tokens_details.cached_tokens
    # whole 16-token blocks, and at least one prompt token is computed again
    assert cached and cached % 16 == 0 and cached < again.usage.prompt_tokens
    chunks = list(
        c.completions.create(
            model="tiny-random",
            prompt=prompt,
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == cached
