"""What a caller passes, checked and turned into the request the core takes.

The prompt forms (:data:`PromptInput`) normalised to text and token ids, the
checks of a request's arguments (before any engine is needed, and against
the loaded model), and :func:`new_request`, the front-end state and the
``CoreRequest`` of one request, which ``LLM`` and ``AsyncLLM`` share (vLLM's
input processor). ``AsyncLLM`` makes each request in one call,
:func:`process_inputs`: checks, parse, the engine's admission, the request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeAlias

import anyio.lowlevel
import anyio.to_thread
import attrs

from structllm.core.admission import check_prompt
from structllm.core.request import CoreRequest
from structllm.engine.frontend.output_processor import (
    RequestOutputCollector,
    RequestState,
)
from structllm.errors import EngineOverloadedError, InvalidRequestError
from structllm.params import SamplingParams
from structllm.text.tokenizer import Tokenizer

__all__ = [
    "MAX_CACHE_SALT_CHARS",
    "OFF_LOOP_CHARS",
    "PROMPT_KEYS",
    "Admission",
    "Prompt",
    "PromptInput",
    "check_cache_salt",
    "check_for_model",
    "check_overload",
    "check_prompt_bytes",
    "check_request_args",
    "check_structured_outputs",
    "check_structured_outputs_off_loop",
    "check_token_ids",
    "is_batch",
    "new_request",
    "parse_prompt",
    "parse_prompt_off_loop",
    "process_inputs",
    "prompt_byte_cap",
]

#: texts longer than this are tokenised in a worker thread, off the event loop
OFF_LOOP_CHARS = 8192


@attrs.frozen
class Prompt:
    """A prompt parsed: its text (None if given as ids), its token ids and its
    cache salt. What :func:`parse_prompt` returns, and a :data:`PromptInput`
    too, so a caller that parsed (the server) hands it on as it is: a request
    keeps one shape from the HTTP route to the core."""

    text: str | None
    token_ids: tuple[int, ...]
    cache_salt: str | None = None


#: A string, a list of token ids, or ``{"prompt": str}`` /
#: ``{"prompt_token_ids": [int, ...]}`` (vLLM's TextPrompt / TokensPrompt),
#: either with an optional ``"cache_salt"``: requests with different salts
#: never share prefix-cache blocks (vLLM's cache_salt); or a :class:`Prompt`.
PromptInput: TypeAlias = str | Sequence[int] | Mapping[str, Any] | Prompt

#: the keys a prompt dict may have
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})
#: the longest cache_salt
MAX_CACHE_SALT_CHARS = 1024


def check_cache_salt(value: object, field: str = "cache_salt") -> str | None:
    """None, or a non-empty string of valid Unicode, at most 1024 characters."""
    if value is None:
        return None
    if (
        not isinstance(value, str)
        or not value
        or len(value) > MAX_CACHE_SALT_CHARS
        or not value.isprintable()
    ):
        raise InvalidRequestError(
            f"{field} must be a non-empty printable string of at most "
            f"{MAX_CACHE_SALT_CHARS} characters, or null",
            field=field,
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError(
            f"{field} must be valid Unicode", field=field
        ) from None
    return value


def parse_prompt(prompt: PromptInput, tokenizer: Tokenizer) -> Prompt:
    """Tokenise ``prompt`` if needed; refuse malformed input naming the field."""
    if isinstance(prompt, Prompt):  # parsed already: checked, not re-tokenised
        if prompt.text is not None:
            _text(prompt.text)
        return Prompt(
            prompt.text,
            _token_ids(prompt.token_ids),
            check_cache_salt(prompt.cache_salt),
        )
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", field="prompt")
        return Prompt(prompt, tuple(tokenizer.encode(prompt)))
    if isinstance(prompt, Mapping):
        salt = _dict_salt(prompt)
        if "prompt_token_ids" in prompt:
            ids = _token_ids(prompt["prompt_token_ids"])
            return Prompt(prompt.get("prompt"), ids, salt)
        if "prompt" in prompt:
            parsed = parse_prompt(_text(prompt["prompt"]), tokenizer)
            return attrs.evolve(parsed, cache_salt=salt)
        raise InvalidRequestError(
            "a prompt dict needs 'prompt' or 'prompt_token_ids'", field="prompt"
        )
    return Prompt(None, _token_ids(prompt))


def _dict_salt(prompt: Mapping[str, Any]) -> str | None:
    """Refuse a prompt dict's unknown keys; its cache_salt, checked."""
    unknown = sorted(str(k) for k in prompt if k not in PROMPT_KEYS)
    if unknown:
        raise InvalidRequestError(
            f"a prompt dict takes only {', '.join(sorted(PROMPT_KEYS))}; "
            f"got {', '.join(map(repr, unknown))}",
            field="prompt",
        )
    return check_cache_salt(prompt.get("cache_salt"))


def check_prompt_bytes(text: str, max_bytes: int | None, field: str = "prompt") -> None:
    """Refuse, before tokenising, a text longer than ``max_bytes`` in UTF-8.

    Counted without encoding (a character takes at least one byte), so a
    huge text costs nothing; a lone surrogate is refused here too.
    """
    if max_bytes is not None and len(text) > max_bytes:
        raise InvalidRequestError(
            f"{field} has more than {max_bytes} bytes (max_prompt_bytes); "
            "it cannot fit the context",
            field=field,
        )
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidRequestError(
            f"{field} must be valid Unicode (it contains a lone surrogate)",
            field=field,
        ) from None
    if max_bytes is not None and size > max_bytes:
        raise InvalidRequestError(
            f"{field} is {size} bytes, more than max_prompt_bytes={max_bytes}; "
            "it cannot fit the context",
            field=field,
        )


async def parse_prompt_off_loop(
    prompt: PromptInput, tokenizer: Tokenizer, *, max_bytes: int | None = None
) -> Prompt:
    """:func:`parse_prompt`, tokenising long texts in a worker thread.

    The byte cap is checked first. Cancelled while a thread tokenises, it
    waits for the thread (bounded by the cap) and then raises; nothing is
    left behind.
    """
    text = prompt if isinstance(prompt, str) else None
    if isinstance(prompt, Mapping) and "prompt_token_ids" not in prompt:
        salt = _dict_salt(prompt)  # checked before tokenising
        text = _text(prompt.get("prompt"))
    if text is None:
        return parse_prompt(prompt, tokenizer)
    check_prompt_bytes(text, max_bytes)
    if len(text) <= OFF_LOOP_CHARS:
        parsed = parse_prompt(text, tokenizer)
    else:
        parsed = await anyio.to_thread.run_sync(parse_prompt, text, tokenizer)
        # the thread ran to the end under a cancelled scope: raise now, so a
        # caller cancelled while tokenising never gets to register the request
        await anyio.lowlevel.checkpoint_if_cancelled()
    if isinstance(prompt, Mapping):
        parsed = attrs.evolve(parsed, cache_salt=salt)
    return parsed


def check_request_args(params: object, request_id: object, priority: object) -> None:
    """Refuse arguments of the wrong type, naming the field."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(
            f"params must be SamplingParams, got {type(params).__name__}",
            field="params",
        )
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequestError(
            "request_id must be a non-empty string", field="request_id"
        )
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidRequestError(
            f"priority must be an integer, got {priority!r}", field="priority"
        )


def check_structured_outputs(params: SamplingParams) -> None:
    """Refuse a constraint the grammar compiler would refuse, naming its field.

    llguidance checks the grammar without a vocabulary (~0.1-2 ms; a spec
    seen before costs nothing), so a bad schema or regex fails at admission,
    before the engine core sees the request.
    """
    if params.structured_outputs is not None:
        from structllm.structured.compiler import validate

        validate(params.structured_outputs)


async def check_structured_outputs_off_loop(params: SamplingParams) -> None:
    """:func:`check_structured_outputs` in a worker thread (if there is work).

    No spec, or one already checked: returns at once, without a checkpoint
    (as :func:`parse_prompt_off_loop` for a short prompt), so admission
    inside a cancelled scope behaves as without a spec. Cancellation during
    the check waits for it (milliseconds) and then raises; nothing is kept
    from it but the compiler's record of known-good specs.
    """
    so = params.structured_outputs
    if so is None:
        return
    from structllm.structured.compiler import is_validated

    if is_validated(so):
        return
    await anyio.to_thread.run_sync(check_structured_outputs, params)
    # a cancellation during the check is delivered now, before admission
    await anyio.lowlevel.checkpoint_if_cancelled()


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Token ids in ``params`` must lie in the model's vocabulary."""
    fields: tuple[tuple[str, Sequence[int]], ...] = (
        ("stop_token_ids", params.stop_token_ids),
        ("allowed_token_ids", params.allowed_token_ids or ()),
        ("logit_bias", [t for t, _ in params.logit_bias]),
    )
    for name, ids in fields:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(
                f"{name} has token id {bad[0]}, outside the vocabulary "
                f"[0, {vocab_size})",
                field=name,
            )


def check_for_model(
    prompt_token_ids: Sequence[int],
    params: SamplingParams | None,
    *,
    vocab_size: int,
    max_model_len: int,
) -> None:
    """What only the loaded model can tell: the prompt fits its context and
    vocabulary, so do the token ids in ``params``; and the structured-output
    spec compiles (on the caller's thread; a spec checked before is free)."""
    check_prompt(prompt_token_ids, vocab_size=vocab_size, max_model_len=max_model_len)
    if params is not None:
        check_token_ids(params, vocab_size)
        check_structured_outputs(params)


def check_overload(
    live: int, count: int, *, max_num_seqs: int, max_queued_requests: int | None
) -> None:
    """EngineOverloadedError when ``count`` more requests beside the ``live``
    ones would leave more than ``max_queued_requests`` waiting beyond the
    ``max_num_seqs`` a step can run (None: no limit)."""
    limit = max_queued_requests
    if limit is not None and live + count > max_num_seqs + limit:
        raise EngineOverloadedError(
            f"{live} requests in flight; max_queued_requests={limit} "
            "are already waiting beyond max_num_seqs"
        )


def prompt_byte_cap(configured: int | None, max_model_len: int | None) -> int | None:
    """The byte cap on prompts: ``configured``, else 32 bytes per token of
    context and at least 64 KiB (None while the context is unknown)."""
    if configured is not None:
        return configured
    if max_model_len is None:
        return None
    return max(64 << 10, 32 * max_model_len)


def new_request(
    parsed: Prompt,
    params: SamplingParams,
    tokenizer: Tokenizer,
    *,
    request_id: str,
    eos_token_ids: frozenset[int],
    priority: int,
    core_id: str | None = None,
    queue: RequestOutputCollector | None = None,
) -> tuple[RequestState, CoreRequest]:
    """The front end's state of a request, and the request the core takes.

    ``core_id``: the id the core sees (default ``request_id``); ``queue``:
    where outputs go (None: the caller collects them, as ``LLM`` does).
    """
    if params.n != 1:
        raise InvalidRequestError(
            f"n: a stream carries one sample, not {params.n}; take n > 1 from "
            "LLM.generate or AsyncLLM.complete, or open one stream per sample "
            "(SamplingParams.for_choice)",
            field="n",
        )
    core_id = request_id if core_id is None else core_id
    state = RequestState(
        request_id,
        parsed.text,
        parsed.token_ids,
        params,
        tokenizer,
        core_id=core_id,
        queue=queue,
    )
    request = CoreRequest(
        request_id=core_id,
        prompt_token_ids=parsed.token_ids,
        params=params,
        eos_token_ids=eos_token_ids,
        priority=priority,
        cache_salt=parsed.cache_salt,
    )
    return state, request


@attrs.frozen
class Admission:
    """What the engine that admits a request adds to it: the id its core
    sees and the end-of-sequence ids of the loaded model."""

    core_id: str
    eos_token_ids: frozenset[int]


async def process_inputs(
    prompt: PromptInput,
    params: SamplingParams,
    request_id: str,
    priority: int,
    tokenizer: Tokenizer,
    *,
    max_bytes: int | None,
    admit: Callable[[Sequence[int], SamplingParams, str], Awaitable[Admission]],
) -> tuple[RequestState, CoreRequest]:
    """One ``AsyncLLM`` request, from what its caller passed to what the core
    takes: its state (outputs go to a :class:`RequestOutputCollector`) and
    its ``CoreRequest``.

    Every check that needs no engine, then the prompt parsed (long texts and
    new structured-output specs in worker threads), then ``admit``: it waits
    for the engine and checks, with no await after its checks, that the
    engine takes the request. Nothing here awaits after ``admit`` either, so
    the caller that registers and submits the result before its own next
    await does so on the engine's state as it was checked.
    """
    check_request_args(params, request_id, priority)
    await check_structured_outputs_off_loop(params)
    parsed = await parse_prompt_off_loop(prompt, tokenizer, max_bytes=max_bytes)
    admitted = await admit(parsed.token_ids, params, request_id)
    return new_request(
        parsed,
        params,
        tokenizer,
        request_id=request_id,
        core_id=admitted.core_id,
        eos_token_ids=admitted.eos_token_ids,
        priority=priority,
        queue=RequestOutputCollector(params.output_kind),
    )


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
