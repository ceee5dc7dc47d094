"""What every response body shares: :class:`Body`, :func:`dump`, errors, usage, ids.

Routes build a response model and :func:`dump` turns it into the JSON object
sent; the same models give the response schemas of ``/openapi.json``, so the
document describes what is really sent. Fields listed in a model's
``_omit_unset`` appear only when given (``usage`` on a chunk, the
``tool_calls`` of a message); every other field is always
present, ``null`` included, and is marked required in the schema. Each API's
own response models are in its room's ``protocol.py``.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

__all__ = [
    "Body",
    "ErrorInfo",
    "ErrorResponse",
    "PerRequestMetrics",
    "PromptTokensDetails",
    "Usage",
    "dump",
    "error_body",
    "fingerprint",
    "new_id",
    "now",
    "usage",
]


def _required_unless_omitted(schema: dict[str, Any], cls: type[Any]) -> None:
    omit: frozenset[str] = getattr(cls, "_omit_unset", frozenset())
    schema["required"] = [n for n in schema.get("properties", {}) if n not in omit]


class Body(BaseModel):
    """A response object: fields in ``_omit_unset`` are sent only when given."""

    model_config = ConfigDict(json_schema_extra=_required_unless_omitted)
    _omit_unset: ClassVar[frozenset[str]] = frozenset()

    def model_post_init(self, context: Any, /) -> None:
        # every other field counts as given, so dump(exclude_unset) sends it
        self.__pydantic_fields_set__.update(
            n for n in type(self).model_fields if n not in self._omit_unset
        )


def dump(body: BaseModel) -> dict[str, Any]:
    """The JSON object for ``body`` (Python values: floats stay floats)."""
    return body.model_dump(exclude_unset=True)


class ErrorInfo(Body):
    message: str
    type: str
    param: str | None
    code: int | str | None


class ErrorResponse(Body):
    """Every status other than 200, and the last event of a failed stream."""

    error: ErrorInfo


def error_body(
    message: str,
    *,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
) -> dict[str, Any]:
    info = ErrorInfo(message=message, type=type_, param=param, code=code)
    return dump(ErrorResponse(error=info))


class PromptTokensDetails(Body):
    #: prompt tokens served from the prefix cache, as OpenAI and vLLM report
    cached_tokens: int


class Usage(Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class PerRequestMetrics(Body):
    """vLLM's per-request timings (``--enable-per-request-metrics``), in
    milliseconds; null where unknown (``mean_itl_ms`` for one token)."""

    #: from being scheduled to the first output token
    time_to_first_token_ms: float | None
    #: from the first output token to the last
    generation_time_ms: float | None
    #: waiting in the scheduler before being scheduled
    queue_time_ms: float | None
    #: generation time over the gaps between output tokens
    mean_itl_ms: float | None
    #: output tokens over the time from being scheduled to the last token
    tokens_per_second: float | None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def fingerprint(*parts: object) -> str:
    """``system_fingerprint``: changes when the serving configuration does."""
    digest = hashlib.sha256(repr(parts).encode()).hexdigest()[:12]
    return f"fp_{digest}"
