"""OpenAI request parsing and response bodies (plain dicts, no pydantic).

Parsing by hand keeps every refusal an OpenAI-style 400 whose ``param``
names the field, instead of FastAPI's 422 validation schema.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from structllm.errors import InvalidRequestError
from structllm.outputs import CompletionOutput
from structllm.params import OutputKind, SamplingParams
from structllm.text.tokenizer import Tokenizer

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "chat_logprobs",
    "completion_logprobs",
    "error_body",
    "parse_chat",
    "parse_completion",
    "usage",
]

MAX_N = 16


def error_body(
    message: str,
    *,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@attrs.frozen
class CompletionRequest:
    model: str
    #: one entry per prompt: text or token ids
    prompts: tuple[str | tuple[int, ...], ...]
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    echo: bool


@attrs.frozen
class ChatRequest:
    model: str
    prompt_text: str
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    logprobs: bool


def _get(
    body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], default: Any
) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        and kind is not bool
        and bool not in (kind if isinstance(kind, tuple) else (kind,))
    ):
        raise InvalidRequestError(
            f"{name} must be {_kind_name(kind)}, got {value!r}", field=name
        )
    if not isinstance(value, kind):
        raise InvalidRequestError(
            f"{name} must be {_kind_name(kind)}, got {value!r:.60}", field=name
        )
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {
        bool: "a boolean",
        int: "an integer",
        str: "a string",
        dict: "an object",
        list: "an array",
        float: "a number",
    }
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _common(
    body: Mapping[str, Any], default_max_tokens: int | None
) -> tuple[SamplingParams, int, bool, bool]:
    if not isinstance(body, Mapping):
        raise InvalidRequestError("the request body must be a JSON object", field=None)
    n = _get(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise InvalidRequestError(f"n must be in [1, {MAX_N}], got {n}", field="n")
    stream = _get(body, "stream", bool, False)
    options = _get(body, "stream_options", dict, {})
    include_usage = bool(options.get("include_usage", False))
    params = SamplingParams.from_openai(body, default_max_tokens=default_max_tokens)
    kind = OutputKind.DELTA if stream else OutputKind.FINAL
    return attrs.evolve(params, output_kind=kind), n, stream, include_usage


def parse_completion(
    body: Any, *, default_max_tokens: int | None = 16
) -> CompletionRequest:
    params, n, stream, include_usage = _common(body, default_max_tokens)
    model = _get(body, "model", str, "")
    prompt = body.get("prompt")
    prompts: list[str | tuple[int, ...]]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
        prompts = [tuple(prompt)]
    elif (
        isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt)
    ):
        prompts = list(prompt)
    elif (
        isinstance(prompt, list)
        and prompt
        and all(
            isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt
        )
    ):
        prompts = [tuple(p) for p in prompt]
    else:
        raise InvalidRequestError(
            "prompt must be a non-empty string, a list of strings, a list of token ids "
            "or a list of lists of token ids",
            field="prompt",
        )
    if any(p == "" for p in prompts):
        raise InvalidRequestError("prompt must not be empty", field="prompt")
    if len(prompts) * n > MAX_N * 8:
        raise InvalidRequestError("too many prompts in one request", field="prompt")
    echo = _get(body, "echo", bool, False)
    return CompletionRequest(
        model, tuple(prompts), params, n, stream, include_usage, echo
    )


def parse_chat(
    body: Any, tokenizer: Tokenizer, *, default_max_tokens: int | None = None
) -> ChatRequest:
    params, n, stream, include_usage = _common(body, default_max_tokens)
    model = _get(body, "model", str, "")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError(
            "messages must be a non-empty array", field="messages"
        )
    flat = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequestError(
                f"messages[{i}] must be an object with a string role", field="messages"
            )
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            parts = []
            for p in content:
                if isinstance(p, dict) and p.get("type") == "text":
                    text = p.get("text", "")
                    if not isinstance(text, str):
                        raise InvalidRequestError(
                            f"messages[{i}].content[].text must be a string",
                            field="messages",
                        )
                    parts.append(text)
            content = "".join(parts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise InvalidRequestError(
                f"messages[{i}].content must be a string or an array of parts",
                field="messages",
            )
        flat.append({"role": m["role"], "content": content})
    add_generation_prompt = _get(body, "add_generation_prompt", bool, True)
    text = tokenizer.apply_chat_template(
        flat, add_generation_prompt=add_generation_prompt
    )
    logprobs = _get(body, "logprobs", bool, False)
    return ChatRequest(model, text, params, n, stream, include_usage, logprobs)


def _is_token(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs(
    out: CompletionOutput, text_offset: int = 0
) -> dict[str, Any] | None:
    """The completions API's logprobs object for the tokens in ``out``."""
    if out.logprobs is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = text_offset
    for token_id, d in zip(out.token_ids, out.logprobs, strict=True):
        lp = d[token_id]
        piece = lp.decoded_token or ""
        tokens.append(piece)
        token_lps.append(lp.logprob)
        tops.append({(v.decoded_token or ""): v.logprob for v in d.values()})
        offsets.append(offset)
        offset += len(piece)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(out: CompletionOutput, top_n: int) -> dict[str, Any] | None:
    if out.logprobs is None:
        return None
    content = []
    for token_id, d in zip(out.token_ids, out.logprobs, strict=True):
        lp = d[token_id]
        piece = lp.decoded_token or ""
        ranked = sorted(
            d.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30
        )
        content.append(
            {
                "token": piece,
                "logprob": lp.logprob,
                "bytes": list(piece.encode()),
                "top_logprobs": [
                    {
                        "token": v.decoded_token or "",
                        "logprob": v.logprob,
                        "bytes": list((v.decoded_token or "").encode()),
                    }
                    for _, v in ranked[:top_n]
                ],
            }
        )
    return {"content": content}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def choice_seed(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index`` of ``n``: a distinct seed when the request gave one."""
    if params.seed is None or index == 0:
        return params
    return attrs.evolve(params, seed=(params.seed + index) % 2**63)


def as_prompt(p: str | Sequence[int]) -> str | dict[str, Any]:
    return p if isinstance(p, str) else {"prompt_token_ids": list(p)}
