"""The pieces of a ``/completion`` answer: one job's run (:class:`Run`: its
final output and when its first output came, for ``timings``), the grammar
``json_schema`` or ``grammar`` asks for, ``completion_probabilities`` and
``response_fields``."""

from __future__ import annotations

from typing import Any

import attrs

from structllm.errors import InvalidRequestError
from structllm.outputs import CompletionOutput, RequestOutput
from structllm.server.llamacpp.protocol import LlamaCompletionRequest
from structllm.server.protocol.constraints import rename_field
from structllm.server.protocol.logprobs import MIN_LOGPROB
from structllm.structured import StructuredOutputs

__all__ = ["Run", "completion_constraint", "completion_probabilities", "pick_fields"]


@attrs.frozen
class Run:
    """One job's final output and when its first output arrived."""

    final: RequestOutput
    start: float
    first: float
    end: float


def completion_constraint(
    req: LlamaCompletionRequest,
) -> tuple[StructuredOutputs | None, str | None]:
    try:
        if req.json_schema is not None:
            return StructuredOutputs(json=req.json_schema), "json_schema"
        if req.grammar:
            return StructuredOutputs(grammar=req.grammar), "grammar"
    except InvalidRequestError as exc:
        name = "json_schema" if req.json_schema is not None else "grammar"
        raise rename_field(exc, name) from None
    return None, None


def pick_fields(answer: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    """llama.cpp's ``response_fields``: each path (``a/b``) that exists."""
    picked: dict[str, Any] = {}
    for path in paths:
        value: Any = answer
        for part in path.split("/"):
            if not isinstance(value, dict) or part not in value:
                break
            value = value[part]
        else:
            picked[path] = value
    return picked


def completion_probabilities(c: CompletionOutput, top_n: int) -> list[dict[str, Any]]:
    """``completion_probabilities``: each token, its logprob, the ``top_n`` best."""
    if c.logprobs is None:
        return []
    out = []
    for token_id, d in zip(c.token_ids, c.logprobs, strict=True):
        ranked = sorted(
            d.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30
        )
        chosen = d[token_id]
        text = chosen.decoded_token or ""
        out.append(
            {
                "id": token_id,
                "token": text,
                "logprob": max(chosen.logprob, MIN_LOGPROB),
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {
                        "id": t,
                        "token": v.decoded_token or "",
                        "logprob": max(v.logprob, MIN_LOGPROB),
                        "bytes": list((v.decoded_token or "").encode()),
                    }
                    for t, v in ranked[:top_n]
                ],
            }
        )
    return out
