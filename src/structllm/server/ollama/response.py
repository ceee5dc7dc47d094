"""Ollama's response models: ``/api/generate``'s and ``/api/chat``'s objects
(each line of a stream, the last one ``done: true`` with the timings),
``/api/tags``, ``/api/ps``, ``/api/show``, ``/api/version`` and the
embeddings'."""

from __future__ import annotations

import json
from typing import Any, Literal

from structllm.server.protocol.bodies import Body

__all__ = [
    "OllamaChatMessage",
    "OllamaChatResponse",
    "OllamaDetails",
    "OllamaEmbedResponse",
    "OllamaEmbeddingsResponse",
    "OllamaGenerateResponse",
    "OllamaLogprob",
    "OllamaModel",
    "OllamaProcesses",
    "OllamaRunningModel",
    "OllamaShowResponse",
    "OllamaTags",
    "OllamaTokenLogprob",
    "OllamaVersion",
    "call",
]


class _Final(Body):
    """The fields of an answer's last object (``done: true``)."""

    _omit_unset = frozenset(
        {
            "done_reason",
            "total_duration",
            "load_duration",
            "prompt_eval_count",
            "prompt_eval_duration",
            "eval_count",
            "eval_duration",
        }
    )

    model: str
    #: RFC 3339, UTC
    created_at: str
    done: bool
    #: "stop", "length", or "load" for a request that only loads the model
    done_reason: str | None = None
    #: nanoseconds
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class OllamaTokenLogprob(Body):
    token: str
    logprob: float
    #: the token's UTF-8 bytes
    bytes: list[int]


class OllamaLogprob(OllamaTokenLogprob):
    """A generated token's logprob, with the ``top_logprobs`` best ones."""

    _omit_unset = frozenset({"top_logprobs"})

    top_logprobs: list[OllamaTokenLogprob] | None = None


class OllamaGenerateResponse(_Final):
    """A line of ``/api/generate`` (or its whole answer without streaming)."""

    _omit_unset = _Final._omit_unset | {"context", "logprobs"}

    response: str
    #: the prompt's and the answer's token ids, for the next request
    context: list[int] | None = None
    #: with ``logprobs``: those of this line's tokens
    logprobs: list[OllamaLogprob] | None = None


class _CallFunction(Body):
    name: str
    arguments: dict[str, Any]


class _Call(Body):
    function: _CallFunction


class OllamaChatMessage(Body):
    _omit_unset = frozenset({"tool_calls"})

    role: Literal["assistant"] = "assistant"
    content: str
    tool_calls: list[_Call] | None = None


class OllamaChatResponse(_Final):
    """A line of ``/api/chat`` (or its whole answer without streaming)."""

    _omit_unset = _Final._omit_unset | {"logprobs"}

    message: OllamaChatMessage
    #: with ``logprobs``: those of this line's tokens
    logprobs: list[OllamaLogprob] | None = None


def call(name: str, arguments: str) -> _Call:
    """A parsed call (``arguments`` JSON text of an object) in Ollama's shape."""
    return _Call(function=_CallFunction(name=name, arguments=json.loads(arguments)))


class OllamaDetails(Body):
    parent_model: str = ""
    #: "gguf" or "safetensors"
    format: str
    family: str = ""
    families: list[str] | None = None
    parameter_size: str = ""
    quantization_level: str = ""


class OllamaModel(Body):
    """An entry of ``/api/tags``."""

    name: str
    model: str
    modified_at: str
    #: bytes of the weights, when they are local files (else 0)
    size: int
    digest: str
    details: OllamaDetails


class OllamaTags(Body):
    """``GET /api/tags``: the served model, then its LoRA adapters."""

    models: list[OllamaModel]


class OllamaRunningModel(OllamaModel):
    """An entry of ``/api/ps``."""

    expires_at: str
    size_vram: int
    context_length: int


class OllamaProcesses(Body):
    """``GET /api/ps``."""

    models: list[OllamaRunningModel]


class OllamaShowResponse(Body):
    """``POST /api/show``."""

    modelfile: str
    parameters: str
    template: str
    details: OllamaDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class OllamaVersion(Body):
    """``GET /api/version``."""

    version: str


class OllamaEmbedResponse(Body):
    model: str
    embeddings: list[list[float]]
    #: nanoseconds
    total_duration: int
    load_duration: int
    prompt_eval_count: int


class OllamaEmbeddingsResponse(Body):
    embedding: list[float]
