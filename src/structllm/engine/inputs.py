"""Prompt forms a caller may pass, normalised to text and token ids."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import attrs

from structllm.errors import InvalidRequestError
from structllm.text.tokenizer import Tokenizer

__all__ = ["Prompt", "PromptInput", "is_batch", "parse_prompt"]

#: A string, a list of token ids, or ``{"prompt": str}`` /
#: ``{"prompt_token_ids": [int, ...]}`` (vLLM's TextPrompt / TokensPrompt).
PromptInput: TypeAlias = str | Sequence[int] | Mapping[str, Any]


@attrs.frozen
class Prompt:
    text: str | None
    token_ids: tuple[int, ...]


def parse_prompt(prompt: PromptInput, tokenizer: Tokenizer) -> Prompt:
    """Tokenise ``prompt`` if needed; refuse malformed input naming the field."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", field="prompt")
        return Prompt(prompt, tuple(tokenizer.encode(prompt)))
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            return Prompt(prompt.get("prompt"), _token_ids(prompt["prompt_token_ids"]))
        if "prompt" in prompt:
            return parse_prompt(_text(prompt["prompt"]), tokenizer)
        raise InvalidRequestError(
            "a prompt dict needs 'prompt' or 'prompt_token_ids'", field="prompt"
        )
    return Prompt(None, _token_ids(prompt))


def is_batch(prompts: object) -> bool:
    """True for a list of prompts, False for a single prompt."""
    if isinstance(prompts, str | Mapping):
        return False
    if isinstance(prompts, Sequence):
        return not prompts or not isinstance(prompts[0], int)
    return False


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise InvalidRequestError(
            f"prompt must be a string, got {value!r:.60}", field="prompt"
        )
    return value


def _token_ids(value: object) -> tuple[int, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise InvalidRequestError(
            f"prompt token ids must be a list of integers, got {value!r:.60}",
            field="prompt",
        )
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int):
            raise InvalidRequestError(
                f"prompt token ids must be integers, got {t!r:.60}", field="prompt"
            )
    if not value:
        raise InvalidRequestError("prompt must not be empty", field="prompt")
    return tuple(value)
