"""The engine core's checks on a request before it is queued: its prompt, a
pin's room in the cache, its LoRA adapter.

Each refuses with :class:`~structllm.errors.InvalidRequestError` naming the
field, and changes nothing when it does. :func:`check_prompt` is also the
front end's check against the loaded model (``engine.frontend.inputs``), so
both refuse the same prompts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from structllm.config import EngineConfig
from structllm.core.block_pool import BlockPool
from structllm.core.request import CoreRequest, Request
from structllm.errors import InvalidRequestError, ModelLoadError
from structllm.lora_request import LoRARequest

if TYPE_CHECKING:  # the core's; the front end checks requests without it
    from structllm.core.lora_manager import LoRAManager

__all__ = ["check_pin", "check_prompt", "use_lora"]


def check_prompt(prompt: Sequence[int], *, vocab_size: int, max_model_len: int) -> None:
    """Refuse an empty prompt, out-of-vocabulary ids, or no room to generate."""
    if not prompt:
        raise InvalidRequestError("prompt must not be empty", field="prompt")
    if len(prompt) >= max_model_len:  # first: cheap, and bounds the scan below
        raise InvalidRequestError(
            f"prompt has {len(prompt)} tokens; max_model_len is {max_model_len}, "
            f"so at most {max_model_len - 1} prompt tokens leave room to generate",
            field="prompt",
        )
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})",
            field="prompt",
        )


def check_pin(
    r: CoreRequest, config: EngineConfig, pool: BlockPool, live: Iterable[Request]
) -> None:
    """Refuse a pin that holds nothing, or more than the cap leaves."""
    if not config.enable_prefix_caching:
        raise InvalidRequestError(
            "pin: a pinned prefix lives in the prefix cache; "
            "enable_prefix_caching is off",
            field="pin",
        )
    if pool.is_pinned(r.request_id):
        raise InvalidRequestError(
            f"pin: {r.request_id!r} is pinned already", field="pin"
        )
    bs = pool.block_size
    need = len(r.prompt_token_ids) // bs
    if need == 0:
        raise InvalidRequestError(
            f"pin: the prompt ({len(r.prompt_token_ids)} tokens) fills no "
            f"KV block of {bs} tokens; only full blocks are cached",
            field="pin",
        )
    cap = int(config.max_pinned_fraction * pool.num_blocks)
    # held, and what the pin requests in flight will hold (counted whole)
    held = len(pool.pinned_blocks()) + sum(
        len(q.prompt_token_ids) // bs for q in live if q.pin
    )
    if held + need > cap:
        raise InvalidRequestError(
            f"pin: the prompt fills {need} KV blocks and pins hold {held}, "
            f"beyond the cap of {cap} (max_pinned_fraction="
            f"{config.max_pinned_fraction:g} of {pool.num_blocks} "
            "blocks); release a pin or raise the cap",
            field="pin",
        )


def use_lora(manager: LoRAManager | None, req: Request, lora: LoRARequest) -> None:
    """``req`` runs with ``lora``'s adapter, read now if it is new."""
    if manager is None:
        raise InvalidRequestError(
            "lora_request: LoRA is not enabled on this engine (enable_lora)",
            field="lora_request",
        )
    try:
        manager.add(lora)
    except ModelLoadError as exc:  # this request's adapter, not the engine
        raise InvalidRequestError(str(exc), field="lora_request") from exc
    req.lora_id = lora.lora_int_id
    req.lora_key = manager.cache_key(lora.lora_int_id)
