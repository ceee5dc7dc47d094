"""Request parameters: :class:`SamplingParams` and :class:`OutputKind`.

Every field is checked when the object is built; an invalid value raises
:class:`~structllm.errors.InvalidRequestError` (also a ``ValueError``) whose
message names the field and repeats the value, and whose ``field`` attribute
carries the field name for servers.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence

import attrs

from structllm.errors import InvalidRequestError
from structllm.structured.spec import StructuredOutputs

__all__ = [
    "MAX_COUNT",
    "MAX_LOGIT_BIAS",
    "MAX_LOGPROBS",
    "MAX_TOKEN_ID",
    "OutputKind",
    "SamplingParams",
]

#: The largest ``logprobs`` a request may ask for (OpenAI allows 20).
MAX_LOGPROBS = 20
#: Token ids are below this (the vocabulary is checked where it is known).
MAX_TOKEN_ID = 2**31 - 1
#: The largest token count (``max_tokens``, ``min_tokens``, ``top_k``).
MAX_COUNT = 2**31 - 1
#: The most samples one request may ask for (``SamplingParams.n``).
MAX_N = 1024
#: ``logit_bias`` values lie in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's range).
MAX_LOGIT_BIAS = 100.0


class OutputKind(enum.Enum):
    """What each streamed :class:`~structllm.outputs.RequestOutput` carries."""

    #: only the text and tokens that are new since the previous output
    DELTA = "delta"
    #: everything generated so far
    CUMULATIVE = "cumulative"
    #: nothing until the request finishes, then everything
    FINAL = "final"


def _fail(field: str, value: object, expected: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"{field} must be {expected}, got {value!r}", field=field
    )


def _int(
    field: str,
    value: object,
    *,
    lo: int | None = None,
    hi: int | None = None,
    expected: str,
) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(field, value, expected)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise _fail(field, value, expected)
    return value


def _float(
    field: str,
    value: object,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    expected: str,
) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _fail(field, value, expected)
    v = float(value)
    if not math.isfinite(v):
        raise _fail(field, value, expected)
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise _fail(field, value, expected)
    if hi is not None and v > hi:
        raise _fail(field, value, expected)
    return v


def is_valid_unicode(s: str) -> bool:
    """False for strings UTF-8 cannot encode (lone surrogates from JSON escapes)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _to_stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Sequence) or not all(isinstance(s, str) for s in value):
        raise _fail("stop", value, "a string or a list of strings")
    if any(s == "" for s in value):
        raise _fail("stop", value, "a list of non-empty strings")
    if not all(is_valid_unicode(s) for s in value):
        raise _fail("stop", value, "valid Unicode (no lone surrogates)")
    return tuple(value)


def _token_id_list(field: str, value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise _fail(field, value, "a list of token ids")
    for t in value:
        _int(
            field,
            t,
            lo=0,
            hi=MAX_TOKEN_ID,
            expected=f"a list of token ids in [0, {MAX_TOKEN_ID}]",
        )
    return tuple(value)


def _to_token_ids(value: object) -> tuple[int, ...]:
    return _token_id_list("stop_token_ids", value)


def _to_allowed(value: object) -> tuple[int, ...] | None:
    if value is None:
        return None
    ids = _token_id_list("allowed_token_ids", value)
    if not ids:
        raise _fail("allowed_token_ids", value, "a non-empty list of token ids")
    return tuple(sorted(set(ids)))


def _to_logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """``{token_id: bias}`` (keys may be strings, as JSON has them) or pairs."""
    if value is None:
        return ()
    items: Sequence[object]
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, Sequence) and not isinstance(value, str | bytes):
        items = value
    else:
        raise _fail("logit_bias", value, "a map from token ids to numbers")
    out: dict[int, float] = {}
    for item in items:
        if not isinstance(item, Sequence) or len(item) != 2:
            raise _fail("logit_bias", value, "a map from token ids to numbers")
        key, bias = item
        if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 12:
            key = int(key)
        token = _int(
            "logit_bias",
            key,
            lo=0,
            hi=MAX_TOKEN_ID,
            expected=f"keyed by token ids in [0, {MAX_TOKEN_ID}]",
        )
        out[token] = _float(
            "logit_bias",
            bias,
            lo=-MAX_LOGIT_BIAS,
            hi=MAX_LOGIT_BIAS,
            expected=f"values in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
        )
    return tuple(sorted(out.items()))


def _to_output_kind(value: object) -> OutputKind:
    if isinstance(value, OutputKind):
        return value
    try:
        return OutputKind(value)
    except ValueError:
        raise _fail(
            "output_kind", value, "one of 'delta', 'cumulative', 'final'"
        ) from None


def _bool(field: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise _fail(field, value, "true or false")
    return value


def _to_include_stop(value: object) -> bool:
    return _bool("include_stop_str_in_output", value)


def _to_ignore_eos(value: object) -> bool:
    return _bool("ignore_eos", value)


def _to_skip_special(value: object) -> bool:
    return _bool("skip_special_tokens", value)


def _check_structured(_: object, __: object, value: StructuredOutputs | None) -> None:
    # typed as the field is (attrs infers the field's type from it); callers
    # may pass anything, hence the isinstance check
    if value is not None and not isinstance(value, StructuredOutputs):
        raise _fail("structured_outputs", value, "a StructuredOutputs or None")


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to sample one request's tokens, when to stop and what to return.

    ``temperature == 0`` means greedy decoding; then ``top_p``, ``top_k``,
    ``min_p`` and ``seed`` have no effect. ``top_k`` of 0 (or -1, as vLLM
    spells it) disables top-k. ``max_tokens=None`` lets the request run to
    the model's context length.
    """

    #: samples per prompt, each its own ``CompletionOutput`` (``index`` 0 to
    #: n - 1) in one ``RequestOutput``; they share the prompt's KV blocks
    #: (computed once). ``LLM.generate`` and ``AsyncLLM.complete`` take n > 1;
    #: a stream carries one sample, so the streaming APIs refuse it.
    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = attrs.field(default=(), converter=_to_stop)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_to_token_ids)
    #: added to the logits of these token ids before sampling (OpenAI's logit_bias)
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(
        default=(), converter=_to_logit_bias
    )
    #: if set, only these token ids can be sampled
    allowed_token_ids: tuple[int, ...] | None = attrs.field(
        default=None, converter=_to_allowed
    )
    include_stop_str_in_output: bool = attrs.field(
        default=False, converter=_to_include_stop
    )
    ignore_eos: bool = attrs.field(default=False, converter=_to_ignore_eos)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    #: logprobs of the prompt tokens: each prompt token's own, plus the
    #: ``prompt_logprobs`` most likely tokens at its position, from the raw
    #: model distribution (``RequestOutput.prompt_logprobs``); such a request
    #: is not served from the prefix cache
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = attrs.field(default=True, converter=_to_skip_special)
    output_kind: OutputKind = attrs.field(
        default=OutputKind.CUMULATIVE, converter=_to_output_kind
    )
    #: constrain the output to a JSON Schema, a regex, choices or a grammar;
    #: the request finishes with "stop" when the grammar is complete (see
    #: docs/architecture.md, "Structured output")
    structured_outputs: StructuredOutputs | None = attrs.field(
        default=None, validator=_check_structured
    )

    def __attrs_post_init__(self) -> None:
        # Numbers are normalised here rather than by converters so that each
        # message can name its field; object.__setattr__ because we're frozen.
        set_ = object.__setattr__
        _int("n", self.n, lo=1, hi=MAX_N, expected=f"an integer in [1, {MAX_N}]")
        if self.max_tokens is not None:
            _int(
                "max_tokens",
                self.max_tokens,
                lo=1,
                hi=MAX_COUNT,
                expected=f"an integer in [1, {MAX_COUNT}]",
            )
        _int(
            "min_tokens",
            self.min_tokens,
            lo=0,
            hi=MAX_COUNT,
            expected=f"an integer in [0, {MAX_COUNT}]",
        )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                f"({self.max_tokens})",
                field="min_tokens",
            )
        set_(
            self,
            "temperature",
            _float(
                "temperature",
                self.temperature,
                lo=0.0,
                hi=100.0,
                expected="a number in [0, 100]",
            ),
        )
        set_(
            self,
            "top_p",
            _float(
                "top_p",
                self.top_p,
                lo=0.0,
                hi=1.0,
                lo_open=True,
                expected="a number in (0, 1]",
            ),
        )
        top_k = _int(
            "top_k",
            self.top_k,
            lo=-1,
            hi=MAX_COUNT,
            expected=f"-1, 0 or a positive integer up to {MAX_COUNT}",
        )
        set_(self, "top_k", max(top_k, 0))
        set_(
            self,
            "min_p",
            _float("min_p", self.min_p, lo=0.0, hi=1.0, expected="a number in [0, 1]"),
        )
        if self.seed is not None:
            _int(
                "seed",
                self.seed,
                lo=-(2**63),
                hi=2**64 - 1,
                expected="a 64-bit integer",
            )
        set_(
            self,
            "repetition_penalty",
            _float(
                "repetition_penalty",
                self.repetition_penalty,
                lo=0.0,
                lo_open=True,
                hi=100.0,
                expected="a number in (0, 100]",
            ),
        )
        for name in ("presence_penalty", "frequency_penalty"):
            set_(
                self,
                name,
                _float(
                    name,
                    getattr(self, name),
                    lo=-2.0,
                    hi=2.0,
                    expected="a number in [-2, 2]",
                ),
            )
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _int(
                    name,
                    getattr(self, name),
                    lo=0,
                    hi=MAX_LOGPROBS,
                    expected=f"an integer in [0, {MAX_LOGPROBS}]",
                )

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def for_choice(self, index: int) -> SamplingParams:
        """The params of sample ``index`` of ``n``, as one request of its own.

        ``n`` is 1; a seeded request gives each sample its own seed (seed +
        index), so the samples differ and each is reproducible.
        """
        seed = self.seed
        if seed is not None and index:
            seed = (seed + index) % 2**63
        return attrs.evolve(self, n=1, seed=seed)
