"""The values in Ollama's objects that the engine does not give as Ollama
writes them: a request's timings in nanoseconds (:class:`Timing`: the
prompt's time is the time to the first output), logprobs with their bytes,
RFC 3339 times, the weights' size and a stand-in digest, the model cards of
the served model and its LoRA adapters, and the error body
``{"error": message}`` (:func:`ollama_error`)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import attrs
from fastapi.responses import Response

from structllm.engine.frontend.async_llm import AsyncLLM
from structllm.lora_request import LoRARequest
from structllm.outputs import CompletionOutput, Logprob, RequestOutput
from structllm.server.http.errors import ASCIIJSONResponse
from structllm.server.ollama.response import OllamaDetails, OllamaLogprob, OllamaModel
from structllm.server.protocol.logprobs import MIN_LOGPROB

__all__ = [
    "Timing",
    "adapter_model",
    "model_digest",
    "ollama_error",
    "rfc3339",
    "served_model",
    "token_logprobs",
    "weights_size",
]


def token_logprobs(c: CompletionOutput, top: int | None) -> dict[str, Any]:
    """``{"logprobs": [...]}`` for ``c``'s tokens, or nothing when not asked."""
    if c.logprobs is None:
        return {}

    def entry(v: Logprob) -> dict[str, Any]:
        text = v.decoded_token or ""
        return {
            "token": text,
            "logprob": max(v.logprob, MIN_LOGPROB),
            "bytes": list(text.encode()),
        }

    out = []
    for token_id, d in zip(c.token_ids, c.logprobs, strict=True):
        item = entry(d[token_id])
        if top:
            ranked = sorted(
                d.values(), key=lambda v: v.rank if v.rank is not None else 1 << 30
            )
            item["top_logprobs"] = [entry(v) for v in ranked[:top]]
        out.append(OllamaLogprob.model_validate(item))
    return {"logprobs": out}


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def ollama_error(response: Response) -> Response:
    """An OpenAI error response as Ollama's ``{"error": "message"}``."""
    if response.status_code < 400 or response.media_type != "application/json":
        return response
    try:
        error = json.loads(bytes(response.body))["error"]
    except (ValueError, KeyError, TypeError):
        return response
    message = error.get("message", "") if isinstance(error, dict) else str(error)
    headers = {
        k: v
        for k, v in response.headers.items()
        if k not in ("content-length", "content-type")
    }
    return ASCIIJSONResponse(
        {"error": message}, status_code=response.status_code, headers=headers
    )


@attrs.frozen
class Timing:
    """When a request started and produced its first output (monotonic)."""

    start: float = attrs.field(factory=time.monotonic)
    first: list[float] = attrs.field(factory=list)

    def saw_output(self) -> None:
        if not self.first:
            self.first.append(time.monotonic())

    def fields(self, out: RequestOutput) -> dict[str, Any]:
        end = time.monotonic()
        first = self.first[0] if self.first else end
        c = out.outputs[0]
        return {
            "done_reason": "length" if c.finish_reason == "length" else "stop",
            "total_duration": int((end - self.start) * 1e9),
            "load_duration": 0,
            "prompt_eval_count": len(out.prompt_token_ids),
            "prompt_eval_duration": int((first - self.start) * 1e9),
            "eval_count": len(c.token_ids),
            "eval_duration": int((end - first) * 1e9),
        }


def weights_size(ref: str) -> int:
    """Bytes of the weights when ``ref`` is a local file or directory."""
    path = Path(ref)
    try:
        if path.is_file():
            return path.stat().st_size
        if path.is_dir():
            return sum(
                p.stat().st_size
                for p in path.iterdir()
                if p.suffix in (".safetensors", ".gguf", ".bin")
            )
    except OSError:
        pass
    return 0


def model_digest(ref: str) -> str:
    """A stand-in for Ollama's blob digest: the model reference's sha256."""
    return hashlib.sha256(os.fsencode(ref)).hexdigest()


def served_model(llm: AsyncLLM, name: str, started: float) -> OllamaModel:
    """The served model's card; ``started``: when this server started."""
    ref = llm.engine_config.model
    return OllamaModel(
        name=name,
        model=name,
        modified_at=rfc3339(started),
        size=weights_size(ref),
        digest=model_digest(ref),
        details=OllamaDetails(
            format="gguf" if ref.endswith(".gguf") else "safetensors"
        ),
    )


def adapter_model(adapter: LoRARequest, parent: str, started: float) -> OllamaModel:
    """A LoRA adapter's card: a model of its own over ``parent``."""
    path = adapter.lora_path
    return OllamaModel(
        name=adapter.lora_name,
        model=adapter.lora_name,
        modified_at=rfc3339(started),
        size=weights_size(path),
        digest=model_digest(path),
        details=OllamaDetails(parent_model=parent, format="safetensors"),
    )
