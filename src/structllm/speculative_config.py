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
from typing import Any, Literal

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
    a large batch already reads the weights once for many tokens.
    ``"draft_model"`` is refused by name for now.
    """

    method: Literal["ngram"]
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    disable_by_batch_size: int | None = 1

    def __attrs_post_init__(self) -> None:
        if self.method != "ngram":
            raise _spec_error(f"method must be 'ngram', not {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise _spec_error(f"{name} must be an integer >= 1, not {value!r}")
        if not _is_int(self.prompt_lookup_max) or (
            self.prompt_lookup_max < self.prompt_lookup_min
        ):
            raise _spec_error(
                "prompt_lookup_max must be an integer >= prompt_lookup_min "
                f"({self.prompt_lookup_min}), not {self.prompt_lookup_max!r}"
            )
        limit = self.disable_by_batch_size
        if limit is not None and (not _is_int(limit) or limit < 1):
            raise _spec_error(
                f"disable_by_batch_size must be an integer >= 1 or None, not {limit!r}"
            )

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> SpeculativeConfig:
        """vLLM's dict (``LLM(speculative_config={...})``, the JSON of
        ``--speculative-config``); unknown keys are refused by name."""
        method = value.get("method")
        if method == "draft_model" or (method is None and "model" in value):
            raise _spec_error(
                "method 'draft_model' (a draft model's proposals) is not "
                "supported yet; use method 'ngram'"
            )
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise _spec_error(
                f"unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})"
            )
        if method != "ngram":
            raise _spec_error(f"method must be 'ngram', not {method!r}")
        if "num_speculative_tokens" not in value:
            raise _spec_error("num_speculative_tokens is required")
        low = value.get("prompt_lookup_min")
        high = value.get("prompt_lookup_max")
        if low is None and high is None:
            low, high = 2, 5
        kw = dict(value)
        kw["prompt_lookup_min"] = high if low is None else low
        kw["prompt_lookup_max"] = low if high is None else high
        return cls(**kw)


def _is_int(value: object) -> bool:
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
