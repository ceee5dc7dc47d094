"""The request fields structllm refuses: OpenAI's and vLLM's that it does not
implement.

A field another OpenAI-compatible server defines is either implemented or
refused with a 400 naming it, never accepted and ignored; a field present
with ``null`` or one of its no-op values (the value that asks for what
structllm does anyway) passes. Fields that no such server defines are
ignored, as OpenAI's own API does. ``/tokenize`` has its own table
(:data:`~structllm.server.tokenize.protocol.TOKENIZE_REFUSED`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic_core import PydanticCustomError

__all__ = ["CHAT_ONLY", "CHAT_REFUSED", "COMPLETION_REFUSED", "REFUSED", "refuse"]

#: field -> (reason, no-op values); refused on both endpoints
REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "functions": ("function calling is not supported; use tools", ([],)),
    "function_call": ("function calling is not supported; use tool_choice", ("none",)),
    "guided_decoding_backend": ("there is one backend (llguidance)", ()),
    "guided_whitespace_pattern": ("JSON whitespace is not configurable", ()),
    "structural_tag": ("structural tags are not supported", ()),
    "suffix": ("suffix (insertion) is not supported", ("",)),
    "audio": ("audio output is not supported", ()),
    "modalities": ("only text output is supported", (["text"],)),
    "prediction": ("predicted outputs are not supported", ()),
    "web_search_options": ("web search is not supported", ()),
    "store": ("stored completions are not supported", (False,)),
    "metadata": ("metadata is for stored completions, which are not supported", ({},)),
    "use_beam_search": ("beam search is not supported", (False,)),
    "length_penalty": ("length_penalty is for beam search, not supported", (1.0, 1)),
    "reasoning_effort": (
        "reasoning effort is not adjustable; chat_template_kwargs.enable_thinking "
        "turns a model's thinking on or off",
        (),
    ),
    "verbosity": ("verbosity is not supported", ()),
    "service_tier": ("there is one service tier", ("auto", "default")),
    # vLLM's extensions
    "request_id": ("send the request id as the X-Request-Id header", ()),
    "truncate_prompt_tokens": ("prompt truncation is not supported", ()),
    "truncation_side": ("prompt truncation is not supported", ()),
    "logprob_token_ids": ("logprobs of chosen token ids are not supported", ()),
    "bad_words": ("bad_words is not supported; use logit_bias", ([],)),
    "logits_processors": ("custom logits processors are not supported", ([],)),
    "spaces_between_special_tokens": (
        "special tokens are always decoded with spaces between them",
        (True,),
    ),
    "mm_processor_kwargs": ("multimodal input is not supported", ()),
    "kv_transfer_params": ("KV transfer is not supported", ()),
    "vllm_xargs": ("vLLM's extra arguments are not supported", ()),
    "thinking_token_budget": ("a thinking budget is not supported", ()),
}

#: refused by ``/v1/completions`` only
COMPLETION_REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "prompt_embeds": ("prompt embeddings are not supported", ()),
    "include_reasoning": ("reasoning is split from the answer in chat", (False,)),
    "add_special_tokens": (
        "a completion prompt is always tokenised with its special tokens",
        (True,),
    ),
}

#: refused by ``/v1/chat/completions`` only
CHAT_REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "chat_template": ("custom chat templates are not supported", ()),
    "documents": ("documents for the chat template are not supported", ([],)),
    "prompt_token_ids": ("a chat request takes messages, not token ids", ()),
    "add_special_tokens": (
        "the chat template writes the special tokens; none are added",
        (False,),
    ),
}

#: chat's tool fields, refused by completions unless null or a no-op value
CHAT_ONLY: dict[str, tuple[Any, ...]] = {
    "tools": ([],),
    "tool_choice": ("none",),
    "parallel_tool_calls": (),
}


def refuse(
    data: Mapping[str, Any], table: Mapping[str, tuple[str, tuple[Any, ...]]]
) -> None:
    """A pydantic error naming the first field of ``table`` that ``data`` sets."""
    for name, (reason, no_ops) in table.items():
        value = data.get(name)
        if value is not None and not any(
            type(value) is type(ok) and value == ok for ok in no_ops
        ):
            raise PydanticCustomError(
                "refused", "{reason}", {"name": name, "reason": reason}
            )
