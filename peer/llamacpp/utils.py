# Adapted for structllm from ggml-org/llama.cpp tools/server/tests/utils.py
# (commit 17f5f8a80d8ac9c18c23ecb2321640daeec77096), MIT licence
# (peer/llamacpp/LICENSE). What changed and why: peer/llamacpp/NOTES.md.
"""llama.cpp's test harness (``ServerProcess``, ``ServerPreset``,
``match_regex``, ``parallel_function_calls``) driving ``structllm serve``.

``ServerProcess.start()`` turns the llama.cpp options a test set into
``structllm serve`` flags and reuses a running server started with the same
flags (llama.cpp starts one per test; a pool keeps the suite to a few
servers). Options structllm has no flag for raise ``NotApplicable``.
llama.cpp's server-wide sampling defaults (``--temp``, ``--seed``,
``--n-predict``) have no structllm flag for chat, so ``make_request`` and
``make_stream_request`` put them into each request body that does not set
them, which is what llama.cpp does with them (``n_predict`` on the native
``/completion``, ``max_tokens`` on the OpenAI routes). Paths are used as the
tests give them: structllm serves llama.cpp's native routes and its
``/v1``-less aliases too, except ``/responses``, which gets the ``/v1``
prefix (structllm serves the Responses API under ``/v1`` only).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from re import RegexFlag
from typing import Any

import requests

from peer.conftest import StructllmServer

__all__ = [
    "NotApplicable",
    "ServerError",
    "ServerPreset",
    "ServerProcess",
    "ServerResponse",
    "close_pool",
    "match_regex",
    "n_prompt_tokens",
    "n_text_tokens",
    "parallel_function_calls",
]

DEFAULT_HTTP_TIMEOUT = 60

#: Running servers by their ``structllm serve`` arguments.
_POOL: dict[tuple[str, ...], StructllmServer] = {}

_SAMPLING_ROUTES = ("/v1/chat/completions", "/v1/completions", "/chat/completions")
#: structllm pools per request: ``--pooling`` goes into these bodies
_EMBEDDING_ROUTES = ("/v1/embeddings", "/embedding", "/embeddings")
_NATIVE_ROUTES = ("/completion", "/completions")
#: llama.cpp serves these without ``/v1`` too; structllm under ``/v1`` only
_V1_ONLY = ("/responses",)


class NotApplicable(Exception):
    """A llama.cpp option structllm has no counterpart for."""


class ServerResponse:
    headers: dict
    status_code: int
    body: dict | Any


class ServerError(Exception):
    def __init__(self, code, body):
        self.code = code
        self.body = body


def close_pool() -> None:
    while _POOL:
        _, server = _POOL.popitem()
        server.close()


class ServerProcess:
    # default options
    server_port: int = 8080
    server_host: str = "127.0.0.1"
    model_alias: str | None = None
    temperature: float = 0.8
    seed: int = 42

    # custom options (those a structllm flag can stand for)
    n_ctx: int | None = None
    n_slots: int | None = None
    n_predict: int | None = None
    api_key: str | None = None
    n_batch: int | None = None
    jinja: bool | None = None
    chat_template: str | None = None
    #: structllm: llama.cpp's --pooling, sent as each embedding request's
    #: ``pooling`` (structllm has no server-wide pooling flag)
    pooling: str | None = None

    def _serve_args(self) -> list[str]:
        if self.chat_template is not None:
            raise NotApplicable("--chat-template: structllm uses the model's template")
        if self.jinja is False:
            raise NotApplicable("--no-jinja: structllm renders the Jinja template")
        args = ["--num-blocks", "128"]
        if self.model_alias:
            args += ["--served-model-name", self.model_alias]
        if self.n_ctx:
            # llama.cpp splits its context between the slots
            args += ["--max-model-len", str(self.n_ctx // (self.n_slots or 1))]
        if self.n_slots:
            args += ["--max-num-seqs", str(self.n_slots)]
        if self.n_predict and self.n_predict > 0:  # -1: no limit
            args += ["--default-max-tokens", str(self.n_predict)]
        if self.api_key:
            args += ["--api-key", self.api_key]
        if self.n_batch:
            # llama.cpp's logical batch: the most tokens one step computes
            args += ["--max-num-batched-tokens", str(self.n_batch)]
        return args

    def start(self, timeout_seconds: int | None = DEFAULT_HTTP_TIMEOUT) -> None:
        args = self._serve_args()
        key = tuple(args)
        server = _POOL.get(key)
        if server is None or server.proc.poll() is not None:
            server = StructllmServer("tiny", args, timeout=timeout_seconds or 60)
            _POOL[key] = server
        self.server_host, self.server_port = server.host, server.port

    def stop(self) -> None:
        """Pooled servers stop at the end of the session (``close_pool``)."""

    def _url(self, path: str) -> str:
        if path in _V1_ONLY:
            path = "/v1" + path
        return f"http://{self.server_host}:{self.server_port}{path}"

    def _with_defaults(self, url: str, data: Any) -> Any:
        path = url.split(str(self.server_port), 1)[1]
        native = path in _NATIVE_ROUTES
        if isinstance(data, dict) and path in _EMBEDDING_ROUTES and self.pooling:
            data = {"pooling": self.pooling, **data}
        if isinstance(data, dict) and (native or path in _SAMPLING_ROUTES):
            data = {"temperature": self.temperature, "seed": self.seed, **data}
            limit = "n_predict" if native else "max_tokens"
            if self.n_predict is not None and limit not in data:
                data[limit] = self.n_predict
        return data

    def make_request(
        self,
        method: str,
        path: str,
        data: dict | Any | None = None,
        headers: dict | None = None,
        timeout: float | None = None,
    ) -> ServerResponse:
        url = self._url(path)
        parse_body = False
        if method == "GET":
            response = requests.get(url, headers=headers, timeout=timeout)
            parse_body = True
        elif method == "POST":
            data = self._with_defaults(url, data)
            response = requests.post(url, headers=headers, json=data, timeout=timeout)
            parse_body = True
        elif method == "OPTIONS":
            response = requests.options(url, headers=headers, timeout=timeout)
        else:
            raise ValueError(f"Unimplemented method: {method}")
        result = ServerResponse()
        result.headers = dict(response.headers)
        result.status_code = response.status_code
        if parse_body:
            try:
                result.body = response.json()
            except json.JSONDecodeError:
                result.body = response.text
        else:
            result.body = None
        response.close()
        return result

    def make_stream_request(
        self,
        method: str,
        path: str,
        data: dict | None = None,
        headers: dict | None = None,
    ) -> Iterator[dict]:
        url = self._url(path)
        if method == "POST":
            data = self._with_defaults(url, data)
            response = requests.post(url, headers=headers, json=data, stream=True)
        else:
            raise ValueError(f"Unimplemented method: {method}")
        with response:
            if response.status_code != 200:
                raise ServerError(response.status_code, response.json())
            for line_bytes in response.iter_lines():
                line = line_bytes.decode("utf-8")
                if "[DONE]" in line:
                    break
                elif line.startswith("data: "):
                    yield json.loads(line[6:])


class ServerPreset:
    @staticmethod
    def tinyllama2() -> ServerProcess:
        # structllm: ggml-org/test-model-stories260K -> the built-in tiny
        server = ServerProcess()
        server.model_alias = "tinyllama-2"
        server.n_ctx = 512
        server.n_slots = 2
        server.n_predict = 64
        server.seed = 42
        return server

    @staticmethod
    def bert_bge_small() -> ServerProcess:
        # structllm: ggml-org/models bert-bge-small -> the built-in tiny, whose
        # last hidden states are pooled (one slot of 1024 tokens)
        server = ServerProcess()
        server.model_alias = "bert-bge-small"
        server.n_ctx = 1024
        server.n_slots = 1
        return server

    @staticmethod
    def bert_bge_small_with_fa() -> ServerProcess:
        # structllm: flash attention is llama.cpp's kernel choice; the same server
        return ServerPreset.bert_bge_small()


def parallel_function_calls(
    function_list: list[tuple[Callable[..., Any], tuple[Any, ...]]],
) -> list[Any]:
    """
    Run multiple functions in parallel and return results in the same order as calls. Equivalent to Promise.all in JS.
    """
    results: list[Any] = [None] * len(function_list)
    exceptions = []

    def worker(index, func, args):
        try:
            result = func(*args)
            results[index] = result
        except Exception as e:
            exceptions.append((index, str(e)))

    with ThreadPoolExecutor() as executor:
        futures = []
        for i, (func, args) in enumerate(function_list):
            future = executor.submit(worker, i, func, args)
            futures.append(future)

        # Wait for all futures to complete
        for _future in as_completed(futures):
            pass

    # structllm: upstream prints the exceptions and returns None for them;
    # raising keeps a failed call from passing for a None result.
    if exceptions:
        raise RuntimeError(f"parallel calls failed: {exceptions}")

    return results


def n_prompt_tokens(messages: list[dict]) -> int:
    """structllm: what llama.cpp's tests hard-code for their model (``n_prompt``):
    the tokens of ``messages`` rendered with tiny's chat template."""
    from structllm.text.tokenizer import load_tokenizer

    tok = load_tokenizer("tiny")
    return len(tok.encode(tok.apply_chat_template(messages)))


def n_text_tokens(text: str) -> int:
    """structllm: ``n_prompt`` of a plain prompt: its tokens with tiny's tokenizer
    (as ``/completion`` tokenises it; tiny has no BOS)."""
    from structllm.text.tokenizer import load_tokenizer

    return len(load_tokenizer("tiny").encode(text))


def match_regex(regex: str, text: str) -> bool:
    return (
        re.compile(
            regex, flags=RegexFlag.IGNORECASE | RegexFlag.MULTILINE | RegexFlag.DOTALL
        ).search(text)
        is not None
    )
