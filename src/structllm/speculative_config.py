"""``speculative_config`` in vLLM's form: what a user asks of speculative decoding.

A value type (the engine's setting ``EngineConfig.speculative_config``
converts a dict, a :class:`SpeculativeConfig` or JSON text with
:func:`speculative_config`); the core's proposer and scheduler read it.
Every refusal is an :class:`~structllm.errors.EngineConfigError` on the
field ``speculative_config`` naming the key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal, TypeGuard

import attrs

from structllm.errors import EngineConfigError

__all__ = ["SpeculativeConfig", "speculative_config"]


_SPEC = "speculative_config"


def _spec_error(message: str) -> EngineConfigError:
    return EngineConfigError(f"{_SPEC}: {message}", field=_SPEC)


@attrs.frozen(kw_only=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's ``speculative_config`` form.

    ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min":
    a, "prompt_lookup_max": b}``: each decoding step proposes up to ``k``
    tokens by prompt lookup (the continuation after the latest earlier
    occurrence of the request's last ``n`` tokens, ``n`` from ``b`` down to
    ``a``, over its prompt and output) and verifies them in the same
    forward pass; the output is the one without speculation (greedy: token
    for token; sampling: the same distribution). Given one bound, the other
    takes its value (as vLLM); given neither, 2 and 5. Speculation pauses
    while more than ``disable_by_batch_size`` requests run (None: never):
    a batch already reads the weights once for many tokens. The default, 1,
    is the measured crossover (docs/benchmarks.md, in CPU time per output
    token: prompt lookup saves up to a third at one request and costs
    13-30% more from two on, on the bench checkpoint and on SmolLM2).

    ``{"method": "draft_model", "model": REF, "num_speculative_tokens": k}``:
    a smaller model (any reference :func:`structllm.models.resolve_model`
    takes) proposes its greedy next ``k`` tokens; its tokenizer must be the
    target's (checked when the core loads it, refused on the field
    ``speculative_config.model``). A dict with ``model`` and no ``method``
    means a draft model, as in vLLM. The prompt lookup bounds belong to
    ``"ngram"`` and are None here.
    """

    method: Literal["ngram", "draft_model"]
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = 1
    #: the draft model's reference (``"draft_model"`` only)
    model: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.method not in ("ngram", "draft_model"):
            raise _spec_error(
                f"method must be 'ngram' or 'draft_model', not {self.method!r}"
            )
        value = self.num_speculative_tokens
        if not _is_int(value) or value < 1:
            raise _spec_error(
                f"num_speculative_tokens must be an integer >= 1, not {value!r}"
            )
        limit = self.disable_by_batch_size
        if limit is not None and (not _is_int(limit) or limit < 1):
            raise _spec_error(
                f"disable_by_batch_size must be an integer >= 1 or None, not {limit!r}"
            )
        if self.method == "draft_model":
            self._check_draft()
        else:
            self._check_ngram()

    def _check_draft(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise _spec_error(
                "model (the draft model's reference) is required for method "
                f"'draft_model', not {self.model!r}"
            )
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(self, name) is not None:
                raise _spec_error(f"{name} is for method 'ngram', not 'draft_model'")

    def _check_ngram(self) -> None:
        if self.model is not None:
            raise _spec_error(
                "model is for method 'draft_model'; method 'ngram' needs none"
            )
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if not _is_int(low) or low < 1:
            raise _spec_error(f"prompt_lookup_min must be an integer >= 1, not {low!r}")
        if not _is_int(high) or high < low:
            raise _spec_error(
                "prompt_lookup_max must be an integer >= prompt_lookup_min "
                f"({low}), not {high!r}"
            )

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> SpeculativeConfig:
        """vLLM's dict (``LLM(speculative_config={...})``, the JSON of
        ``--speculative-config``); unknown keys are refused by name."""
        method = value.get("method")
        if method is None and "model" in value:
            method = "draft_model"  # as vLLM infers it
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise _spec_error(
                f"unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})"
            )
        if method not in ("ngram", "draft_model"):
            raise _spec_error(
                f"method must be 'ngram' or 'draft_model', not {method!r}"
            )
        if "num_speculative_tokens" not in value:
            raise _spec_error("num_speculative_tokens is required")
        if method == "draft_model":
            return cls(**{**value, "method": method})
        low = value.get("prompt_lookup_min")
        high = value.get("prompt_lookup_max")
        if low is None and high is None:
            low, high = 2, 5
        kw = dict(value)
        kw["prompt_lookup_min"] = high if low is None else low
        kw["prompt_lookup_max"] = low if high is None else high
        return cls(**kw)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def speculative_config(value: object) -> SpeculativeConfig | None:
    """The converter of ``EngineConfig.speculative_config``: a
    SpeculativeConfig, its dict, its JSON text (the command line), or None."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise _spec_error(f"not valid JSON ({exc})") from None
    if not isinstance(value, Mapping):
        raise _spec_error(
            f"must be a dict like {{'method': 'ngram', 'num_speculative_tokens': 4}}, "
            f"not {value!r}"
        )
    return SpeculativeConfig.from_dict(value)
