"""llama.cpp's token shapes: a native prompt's tokens (:func:`native_prompt`:
text, or ids and text mixed), a ``/tokenize`` body in its shape
(``content``), ``/detokenize``'s answer with its ``content``, and a token's
``piece`` (``with_pieces``): its text, or its bytes when it is part of a
longer character (byte-level BPE's table read backwards)."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import Response

from structllm.engine.frontend.async_llm import AsyncLLM
from structllm.engine.frontend.inputs import (
    Prompt,
    check_prompt_bytes,
    parse_prompt_off_loop,
)
from structllm.errors import InvalidRequestError
from structllm.server.http.errors import ASCIIJSONResponse
from structllm.server.llamacpp.protocol import NativePrompt

__all__ = [
    "byte_level",
    "is_native_tokenize",
    "native_prompt",
    "token_piece",
    "unicode_to_byte",
    "with_content",
]


def is_native_tokenize(body: Any) -> bool:
    """A ``/tokenize`` body in llama.cpp's shape (``content``, not vLLM's
    ``prompt`` or ``messages``)."""
    return (
        isinstance(body, dict)
        and "content" in body
        and "prompt" not in body
        and "messages" not in body
    )


def with_content(response: Response) -> Response:
    """vLLM's ``/detokenize`` answer with llama.cpp's ``content`` beside
    ``prompt`` (the two servers take the same request)."""
    if response.status_code != 200:
        return response
    body = json.loads(bytes(response.body))
    if "prompt" in body and "content" not in body:
        body["content"] = body["prompt"]
    return ASCIIJSONResponse(body)


async def native_prompt(
    llm: AsyncLLM, p: NativePrompt, i: int, count: int, name: str = "prompt"
) -> Prompt:
    """A ``/completion`` or ``/embedding`` prompt's tokens: a string tokenised
    with the special tokens; in a list, ids as they are and each string after
    the first without them (llama.cpp's rule)."""
    field = f"{name}[{i}]" if count > 1 else name
    tok = llm.tokenizer
    if isinstance(p, str):
        try:
            return await parse_prompt_off_loop(p, tok, max_bytes=llm.max_prompt_bytes)
        except InvalidRequestError as exc:
            raise InvalidRequestError(str(exc), field=field) from None
    ids: list[int] = []
    first = True
    for piece in p:
        if isinstance(piece, str):
            check_prompt_bytes(piece, llm.max_prompt_bytes, field)
            ids += tok.encode(piece, add_special_tokens=first)
        else:
            if piece >= llm.vocab_size:
                raise InvalidRequestError(
                    f"{field}: token id {piece} is outside the vocabulary "
                    f"[0, {llm.vocab_size})",
                    field=field,
                )
            ids.append(piece)
        first = False
    return Prompt(None, tuple(ids))


def token_piece(llm: AsyncLLM, token_id: int) -> str | list[int]:
    """The token's text, or (a byte of a longer character) its bytes."""
    text = llm.tokenizer.decode([token_id], skip_special_tokens=False)
    if "\ufffd" not in text:
        return text
    raw = byte_level(llm.tokenizer.id_to_piece(token_id))
    return raw if raw is not None else text


def byte_level(piece: str) -> list[int] | None:
    """A byte-level BPE piece's bytes (GPT-2's byte-to-character table)."""
    table = unicode_to_byte()
    if not all(ch in table for ch in piece):
        return None
    return [table[ch] for ch in piece]


def unicode_to_byte() -> dict[str, int]:
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}
