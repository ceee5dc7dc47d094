"""The server the peer suites run against: ``structllm serve`` in a subprocess.

``StructllmServer`` stands in for vLLM's ``RemoteOpenAIServer`` (``url_for``,
``get_client``, ``get_async_client``) and is what the llama.cpp suite's
``ServerProcess`` wraps. It starts ``python -m structllm.cli serve MODEL
--port 0 ...``, reads the port from the ``structllm: serving ... on URL``
line, then waits for ``GET /health`` to answer 200. Nothing is fetched: the
models are the built-in ``tiny`` (trained, a BPE tokenizer and a ChatML
template) and ``tiny-random``.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

__all__ = ["MODEL", "SERVER_ARGS", "StructllmServer", "get_tokenizer"]

#: The model every suite serves unless a test says otherwise.
MODEL = "tiny"
#: Engine flags of the shared server: small enough for 2 cores.
SERVER_ARGS = ["--max-model-len", "2048", "--num-blocks", "512", "--max-num-seqs"]
SERVER_ARGS += ["64"]

_SERVING = re.compile(r"structllm: serving .* on (http://\S+)")


class StructllmServer:
    """``structllm serve`` running as a child process until :meth:`close`."""

    def __init__(
        self, model: str = MODEL, args: list[str] | None = None, timeout: float = 120
    ) -> None:
        self.model = model
        cmd = [sys.executable, "-m", "structllm.cli", "serve", model, "--port", "0"]
        cmd += SERVER_ARGS if args is None else args
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.output: list[str] = []
        try:
            self.url = self._read_url(timeout)
            self._wait_healthy(timeout)
        except BaseException:
            self.close()
            raise
        # Keep draining the pipe so a chatty server never blocks on it.
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _read_url(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(
                    f"structllm serve exited with {self.proc.wait()}:\n"
                    + "".join(self.output[-40:])
                )
            self.output.append(line)
            m = _SERVING.search(line)
            if m:
                return m.group(1)
        raise TimeoutError("structllm serve did not report its address")

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url_for("health"), timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"structllm serve exited with {self.proc.returncode}"
                )
            time.sleep(0.2)
        raise TimeoutError("structllm serve did not become healthy")

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)

    @property
    def host(self) -> str:
        return httpx.URL(self.url).host

    @property
    def port(self) -> int:
        port = httpx.URL(self.url).port
        assert port is not None
        return port

    def url_for(self, *parts: str) -> str:
        return "/".join([self.url, *(p.strip("/") for p in parts)])

    def get_client(self, **kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(
            base_url=self.url_for("v1"), api_key="EMPTY", max_retries=0, **kwargs
        )

    def get_async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(
            base_url=self.url_for("v1"), api_key="EMPTY", max_retries=0, **kwargs
        )

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        reader = getattr(self, "_reader", None)
        if reader is not None:
            reader.join(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> StructllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture
def anyio_backend() -> str:
    """The vLLM tests are asyncio tests (``pytest.mark.asyncio`` upstream)."""
    return "asyncio"


@pytest.fixture(scope="session")
def shared_server() -> Iterator[StructllmServer]:
    """One ``structllm serve tiny`` for every module that needs no other flags."""
    with StructllmServer() as server:
        yield server


class _HFStyleTokenizer:
    """The served model's tokenizer with transformers' defaults (``decode``
    keeps special tokens), as vLLM's ``get_tokenizer`` returns it."""

    def __init__(self, name: str) -> None:
        from structllm.text.tokenizer import load_tokenizer

        self._tok = load_tokenizer(name)
        self.vocab_size = self._tok.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def get_tokenizer(tokenizer_name: str = MODEL) -> _HFStyleTokenizer:
    """vLLM's ``vllm.tokenizers.get_tokenizer`` for the built-in models."""
    return _HFStyleTokenizer(tokenizer_name)
