"""The OpenAI request models: the one validation boundary of the server.

Every request body is validated by a typed pydantic model before anything
else looks at it: JSON types (strict: ``"5"`` is not an integer, ``true`` is
not a number), integer and float ranges (64-bit at most anywhere, token ids
below 2**31, counts within sane limits), strings that must be valid Unicode
(a JSON ``"\\ud800"`` escape is a lone surrogate that cannot be encoded),
list lengths. A failure becomes an OpenAI-style 400 whose ``param`` is the
path of the field (``max_tokens``, ``messages[0].content``). The models also
give a truthful OpenAPI schema.

Fields OpenAI defines but structllm does not implement are refused with a
400 naming them (:data:`REFUSED`), never accepted and ignored; unknown
fields outside OpenAI's and vLLM's sets are ignored, as OpenAI-compatible
servers do.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import attrs
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import PydanticCustomError

from structllm.errors import InvalidRequestError
from structllm.outputs import CompletionOutput
from structllm.params import (
    MAX_COUNT,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_TOKEN_ID,
    OutputKind,
    SamplingParams,
    is_valid_unicode,
)

__all__ = [
    "REFUSED",
    "ChatRequest",
    "CompletionRequest",
    "chat_logprobs",
    "completion_logprobs",
    "error_body",
    "usage",
    "validation_error",
]

MAX_N = 16
#: prompts times n in one completions request
MAX_CHOICES = MAX_N * 8
MAX_STOP = 64
MAX_STOP_LEN = 1024
MAX_MESSAGES = 4096
MAX_ID_LIST = 8192
INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1

#: OpenAI (and vLLM) fields structllm refuses, with the reason. A field is
#: refused when present with a value other than null or a listed no-op value.
REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "tools": ("tool calling is not supported", ([],)),
    "tool_choice": ("tool calling is not supported", ("none",)),
    "functions": ("function calling is not supported", ([],)),
    "function_call": ("function calling is not supported", ("none",)),
    "parallel_tool_calls": ("tool calling is not supported", ()),
    "response_format": ("structured output is not supported", ({"type": "text"},)),
    "guided_json": ("structured output is not supported", ()),
    "guided_regex": ("structured output is not supported", ()),
    "guided_choice": ("structured output is not supported", ()),
    "guided_grammar": ("structured output is not supported", ()),
    "structured_outputs": ("structured output is not supported", ()),
    "suffix": ("suffix (insertion) is not supported", ("",)),
    "audio": ("audio output is not supported", ()),
    "modalities": ("only text output is supported", (["text"],)),
    "prediction": ("predicted outputs are not supported", ()),
    "web_search_options": ("web search is not supported", ()),
    "store": ("stored completions are not supported", (False,)),
    "prompt_logprobs": ("prompt_logprobs is not supported yet", ()),
    "use_beam_search": ("beam search is not supported", (False,)),
}

_MODEL_CONFIG = ConfigDict(
    strict=True,
    extra="ignore",
    frozen=True,
    allow_inf_nan=False,
    ser_json_inf_nan="null",
    hide_input_in_errors=True,
)


def _unicode(s: str) -> str:
    if not is_valid_unicode(s):
        raise PydanticCustomError(
            "unicode", "must be valid Unicode (it contains a lone surrogate)"
        )
    return s


Text = Annotated[str, AfterValidator(_unicode)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_unicode)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
Count = Annotated[int, Field(ge=1, le=MAX_COUNT)]
Seed = Annotated[int, Field(ge=INT64_MIN, le=UINT64_MAX)]
TopK = Annotated[int, Field(ge=-1, le=MAX_COUNT)]
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or len(items) > MAX_STOP:
        raise PydanticCustomError(
            "stop", f"must be a string or a list of at most {MAX_STOP} strings"
        )
    for s in items:
        if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_LEN:
            raise PydanticCustomError(
                "stop", f"must hold non-empty strings of at most {MAX_STOP_LEN} chars"
            )
        _unicode(s)
    return tuple(items)


Stop = Annotated[
    tuple[str, ...],
    PlainValidator(_stop),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}, "maxItems": MAX_STOP},
                {"type": "null"},
            ]
        }
    ),
]


def _logit_bias(value: Any) -> dict[int, float]:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_ID_LIST:
        raise PydanticCustomError(
            "logit_bias", f"must be an object of at most {MAX_ID_LIST} entries"
        )
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = key
        if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 12:
            token = int(key)
        if (
            isinstance(token, bool)
            or not isinstance(token, int)
            or not 0 <= token <= MAX_TOKEN_ID
        ):
            raise PydanticCustomError(
                "logit_bias", "keys must be token ids (decimal strings)"
            )
        if (
            isinstance(bias, bool)
            or not isinstance(bias, int | float)
            or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS
        ):
            raise PydanticCustomError(
                "logit_bias",
                f"values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            )
        out[token] = float(bias)
    return out


LogitBias = Annotated[
    dict[int, float],
    PlainValidator(_logit_bias),
    WithJsonSchema(
        {
            "type": "object",
            "additionalProperties": {
                "type": "number",
                "minimum": -MAX_LOGIT_BIAS,
                "maximum": MAX_LOGIT_BIAS,
            },
        }
    ),
]


def _prompts(value: Any) -> tuple[str | tuple[int, ...], ...]:
    """A string, strings, token ids or lists of token ids, none empty."""

    def fail(message: str) -> PydanticCustomError:
        return PydanticCustomError("prompt", message)

    def ids(v: list[Any]) -> tuple[int, ...] | None:
        if not v or not all(_is_token(t) for t in v):
            return None
        if len(v) > MAX_COUNT:
            raise fail("has too many token ids")
        for t in v:
            if not 0 <= t <= MAX_TOKEN_ID:
                raise fail(f"token ids must lie in [0, {MAX_TOKEN_ID}], got {t!r:.60}")
        return tuple(v)

    shape = (
        "must be a non-empty string, a list of strings, a list of token ids "
        "or a list of lists of token ids"
    )
    if isinstance(value, str):
        if not value:
            raise fail("must not be empty")
        return (_unicode(value),)
    if not isinstance(value, list) or not value:
        raise fail(shape)
    if len(value) > MAX_CHOICES:
        raise fail(f"has more than {MAX_CHOICES} prompts")
    if (one := ids(value)) is not None:
        return (one,)
    if all(isinstance(p, str) for p in value):
        if any(p == "" for p in value):
            raise fail("must not be empty")
        return tuple(_unicode(p) for p in value)
    if all(isinstance(p, list) for p in value):
        out = []
        for p in value:
            if (each := ids(p)) is None:
                raise fail(shape)
            out.append(each)
        return tuple(out)
    raise fail(shape)


_TOKEN_IDS_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0}}
Prompts = Annotated[
    tuple[str | tuple[int, ...], ...],
    PlainValidator(_prompts),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}},
                _TOKEN_IDS_SCHEMA,
                {"type": "array", "items": _TOKEN_IDS_SCHEMA},
            ]
        }
    ),
]


class StreamOptions(BaseModel):
    model_config = _MODEL_CONFIG

    include_usage: bool | None = None
    #: usage (so far) in every chunk, not only in the last one
    continuous_usage_stats: bool | None = None


class _Sampling(BaseModel):
    """Fields shared by completions and chat."""

    model_config = _MODEL_CONFIG

    model: Text | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    max_tokens: Count | None = None
    min_tokens: Annotated[int, Field(ge=0, le=MAX_COUNT)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: TopK | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Seed | None = None
    stop: Stop = ()
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_ID_LIST)] | None = (
        None
    )
    allowed_token_ids: (
        Annotated[list[TokenId], Field(min_length=1, max_length=MAX_ID_LIST)] | None
    ) = None
    logit_bias: LogitBias = Field(default_factory=dict)
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0)] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    echo: bool | None = None
    #: vLLM: the prompt's and the completion's token ids in the response
    return_token_ids: bool | None = None
    #: vLLM: logprobs name tokens as "token_id:N" instead of their text
    return_tokens_as_token_ids: bool | None = None
    user: Text | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise PydanticCustomError("body", "the request body must be a JSON object")
        for name, (reason, no_ops) in REFUSED.items():
            value = data.get(name)
            if value is not None and not any(
                type(value) is type(ok) and value == ok for ok in no_ops
            ):
                raise PydanticCustomError(
                    "refused", "{reason}", {"name": name, "reason": reason}
                )
        return data

    @model_validator(mode="after")
    def _cross_checks(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError(
                "stream_options", "stream_options is only allowed when stream is true"
            )
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise PydanticCustomError(
                "best_of", "best_of other than n is not supported"
            )
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        o = self.stream_options
        return bool(o and o.include_usage and o.continuous_usage_stats)

    @property
    def choices(self) -> int:
        return self.n or 1

    def _sampling_kwargs(self) -> dict[str, Any]:
        names = (
            "min_tokens",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "stop_token_ids",
            "allowed_token_ids",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
        )
        kw = {n: v for n in names if (v := getattr(self, n)) is not None}
        kw["stop"] = self.stop
        kw["logit_bias"] = self.logit_bias
        kw["output_kind"] = OutputKind.DELTA if self.stream else OutputKind.FINAL
        return kw


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: Prompts
    logprobs: Logprobs | None = None

    @model_validator(mode="after")
    def _completion_checks(self) -> CompletionRequest:
        if len(self.prompt) * self.choices > MAX_CHOICES:
            raise PydanticCustomError(
                "prompt",
                f"prompts times n must not exceed {MAX_CHOICES}",
            )
        if self.echo and self.logprobs is not None:
            raise PydanticCustomError(
                "echo", "echo with logprobs (prompt logprobs) is not supported yet"
            )
        return self

    def to_sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        kw = self._sampling_kwargs()
        kw["max_tokens"] = (
            default_max_tokens if self.max_tokens is None else (self.max_tokens)
        )
        kw["logprobs"] = self.logprobs
        return SamplingParams(**kw)


def _content(value: Any) -> str | None:
    """A string, or OpenAI content parts of type text (joined)."""
    if value is None or isinstance(value, str):
        return None if value is None else _unicode(value)
    if not isinstance(value, list) or len(value) > MAX_MESSAGES:
        raise PydanticCustomError(
            "content", "must be a string or an array of text parts"
        )
    texts = []
    for i, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise PydanticCustomError(
                "content",
                "part [{i}] must be an object of type 'text' (only text is supported)",
                {"i": i},
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise PydanticCustomError(
                "content", "part [{i}].text must be a string", {"i": i}
            )
        texts.append(_unicode(text))
    return "".join(texts)


Content = Annotated[
    str | None,
    PlainValidator(_content),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "object"}},
                {"type": "null"},
            ]
        }
    ),
]


class Message(BaseModel):
    model_config = _MODEL_CONFIG

    role: NonEmptyText
    content: Content = None
    name: Text | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in ("tool_calls", "tool_call_id", "function_call"):
                if data.get(name) not in (None, []):
                    raise PydanticCustomError(
                        "refused", "tool calling is not supported", {"name": name}
                    )
        return data

    @property
    def text(self) -> str:
        return self.content or ""


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Count | None = None
    logprobs: bool | None = None
    top_logprobs: Logprobs | None = None
    add_generation_prompt: bool | None = None

    @model_validator(mode="after")
    def _chat_checks(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError(
                "top_logprobs", "top_logprobs requires logprobs to be true"
            )
        return self

    @property
    def limit_field(self) -> str:
        """The field that set the length limit, for error messages."""
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    def to_sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        kw = self._sampling_kwargs()
        limit = self.max_completion_tokens or self.max_tokens
        kw["max_tokens"] = default_max_tokens if limit is None else limit
        if self.logprobs:
            kw["logprobs"] = self.top_logprobs or 0
        return SamplingParams(**kw)

    def template_messages(self) -> list[dict[str, str]]:
        out = []
        for m in self.messages:
            d = {"role": m.role, "content": m.text}
            if m.name is not None:
                d["name"] = m.name
            out.append(d)
        return out

    @property
    def echo_text(self) -> str:
        """vLLM's chat ``echo``: the last message, when it is the assistant's."""
        last = self.messages[-1]
        return last.text if self.echo and last.role == "assistant" else ""


def validation_error(exc: ValidationError) -> InvalidRequestError:
    """The first error of ``exc`` as an InvalidRequestError naming its path."""
    err = exc.errors(include_url=False, include_input=False)[0]
    param = _param(err["loc"], err["type"], err.get("ctx"))
    message = err["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    if param is None:
        return InvalidRequestError(message, field=None)
    return InvalidRequestError(f"{param}: {message}", field=param)


def _param(
    loc: Sequence[int | str], kind: str, ctx: Mapping[str, Any] | None
) -> str | None:
    if kind == "refused" and ctx:
        prefix = _path(loc)
        return f"{prefix}.{ctx['name']}" if prefix else str(ctx["name"])
    if kind in ("stream_options", "best_of", "top_logprobs", "echo") and not loc:
        return kind
    if kind == "prompt" and not loc:
        return "prompt"
    return _path(loc) or None


def _path(loc: Sequence[int | str]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part == "str" or "[" in part:
            continue  # a union member's tag (str, list[...]), not a field
        else:
            out += f".{part}" if out else part
    return out


def _is_token(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def error_body(
    message: str,
    *,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        # prompt tokens served from the prefix cache, as OpenAI and vLLM report
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _token_name(token_id: int, piece: str | None, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else (piece or "")


def completion_logprobs(
    out: CompletionOutput, text_offset: int = 0, *, as_ids: bool = False
) -> dict[str, Any] | None:
    """The completions API's logprobs object for the tokens in ``out``."""
    if out.logprobs is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = text_offset
    for token_id, d in zip(out.token_ids, out.logprobs, strict=True):
        lp = d[token_id]
        piece = lp.decoded_token or ""
        tokens.append(_token_name(token_id, piece, as_ids))
        token_lps.append(lp.logprob)
        tops.append(
            {_token_name(t, v.decoded_token, as_ids): v.logprob for t, v in d.items()}
        )
        offsets.append(offset)
        offset += len(piece)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(
    out: CompletionOutput, top_n: int, *, as_ids: bool = False
) -> dict[str, Any] | None:
    if out.logprobs is None:
        return None
    content = []
    for token_id, d in zip(out.token_ids, out.logprobs, strict=True):
        lp = d[token_id]
        name = _token_name(token_id, lp.decoded_token, as_ids)
        ranked = sorted(
            d.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30
        )
        content.append(
            {
                "token": name,
                "logprob": lp.logprob,
                "bytes": list(name.encode()),
                "top_logprobs": [
                    {
                        "token": (top := _token_name(t, v.decoded_token, as_ids)),
                        "logprob": v.logprob,
                        "bytes": list(top.encode()),
                    }
                    for t, v in ranked[:top_n]
                ],
            }
        )
    return {"content": content}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def fingerprint(*parts: object) -> str:
    """``system_fingerprint``: changes when the serving configuration does."""
    digest = hashlib.sha256(repr(parts).encode()).hexdigest()[:12]
    return f"fp_{digest}"


def choice_seed(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index`` of ``n``: a distinct seed when the request gave one."""
    if params.seed is None or index == 0:
        return params
    return attrs.evolve(params, seed=(params.seed + index) % 2**63)


def as_prompt(p: str | Sequence[int]) -> str | dict[str, Any]:
    return p if isinstance(p, str) else {"prompt_token_ids": list(p)}
