"""Ollama's ``options``: the sampling settings of ``/api/generate`` and
``/api/chat``. They map onto :class:`~structllm.params.SamplingParams`:

=================================  =========================================
``temperature``, ``top_p``,        the same; ``top_k: 0`` is no top-k
``min_p``, ``top_k``
``seed``                           the same; ``-1`` (Ollama's "random") none
``num_predict``                    ``max_tokens``; ``-1`` / ``-2`` (no limit,
                                   fill the context): up to the context
``stop``                           the same
``repeat_penalty``                 ``repetition_penalty`` (over the prompt
                                   and the output: ``repeat_last_n: -1``)
``presence_penalty``,              the same
``frequency_penalty``
``num_ctx``                        the request must fit in it (400 naming
                                   it when the prompt does not; above the
                                   server's context: 400)
``numa``, ``num_batch``,           accepted, no effect on the output: how
``num_gpu``, ``main_gpu``,         llama.cpp loads and runs the model;
``low_vram``, ``use_mmap``,        structllm's are server flags
``use_mlock``, ``num_thread``,
``f16_kv``, ``penalize_newline``
=================================  =========================================

Any other option, or one of the above with a value structllm cannot honour
(``mirostat`` other than 0, ``typical_p`` / ``tfs_z`` other than 1,
``repeat_last_n`` other than -1 while ``repeat_penalty`` is on, ...), is a
400 naming it (:data:`OPTIONS_REFUSED`).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field, model_validator
from pydantic_core import PydanticCustomError

from structllm.server.protocol.fields import REQUEST_CONFIG, Count, Penalty, Seed, Stop
from structllm.server.protocol.refusals import refuse

__all__ = ["OPTIONS_REFUSED", "OllamaOptions"]

#: options structllm cannot honour -> (reason, no-op values)
OPTIONS_REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "mirostat": ("mirostat sampling is not supported", (0,)),
    "typical_p": ("typical sampling is not supported", (1, 1.0)),
    "tfs_z": ("tail-free sampling is not supported", (1, 1.0)),
    "num_keep": ("the context is never shifted, so nothing is kept", ()),
    "vocab_only": ("the server always loads the weights", (False,)),
    "logits_all": ("use logprobs on /v1/completions", (False,)),
    "embedding_only": ("embeddings are served at /api/embed", (False,)),
}

#: options accepted with no effect on the output (llama.cpp's load settings)
_NO_EFFECT = frozenset(
    {
        "numa",
        "num_batch",
        "num_gpu",
        "main_gpu",
        "low_vram",
        "use_mmap",
        "use_mlock",
        "num_thread",
        "f16_kv",
        "penalize_newline",
    }
)


_Probability = Annotated[float, Field(ge=0.0, le=1.0)]


class OllamaOptions(BaseModel):
    """``options``: Ollama's Modelfile parameters, per request."""

    model_config = REQUEST_CONFIG

    temperature: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    min_p: _Probability | None = None
    seed: Seed | None = None
    #: -1: no limit; -2: fill the context (the same here)
    num_predict: Annotated[int, Field(ge=-2, le=2**31 - 1)] | None = None
    stop: Stop = ()
    repeat_penalty: Annotated[float, Field(gt=0.0, le=100.0)] | None = None
    repeat_last_n: Annotated[int, Field(ge=-1)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    num_ctx: Count | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None

    @model_validator(mode="before")
    @classmethod
    def _known(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise PydanticCustomError("field", "must be an object", {"name": ""})
        known = set(cls.model_fields) | _NO_EFFECT | set(OPTIONS_REFUSED)
        for name in data:
            if name not in known:
                raise PydanticCustomError(
                    "refused",
                    "not an option structllm knows",
                    {"name": name},
                )
        refuse(data, OPTIONS_REFUSED)
        return data

    @model_validator(mode="after")
    def _checks(self) -> OllamaOptions:
        if self.num_predict == 0:
            raise PydanticCustomError(
                "field",
                "must be at least 1, or -1 / -2 for no limit",
                {"name": "num_predict"},
            )
        penalised = self.repeat_penalty not in (None, 1.0)
        if penalised and self.repeat_last_n not in (None, -1):
            raise PydanticCustomError(
                "refused",
                "the repetition penalty covers the whole context (-1)",
                {"name": "repeat_last_n"},
            )
        return self

    def sampling_kwargs(self) -> dict[str, Any]:
        """The :class:`SamplingParams` keywords these options set."""
        kw: dict[str, Any] = {}
        for name in ("temperature", "top_p", "min_p", "presence_penalty"):
            if (value := getattr(self, name)) is not None:
                kw[name] = value
        if self.frequency_penalty is not None:
            kw["frequency_penalty"] = self.frequency_penalty
        if self.top_k is not None:
            kw["top_k"] = self.top_k  # 0: no top-k, as SamplingParams
        if self.seed is not None and self.seed != -1:
            kw["seed"] = self.seed
        if self.repeat_penalty is not None:
            kw["repetition_penalty"] = self.repeat_penalty
        kw["stop"] = self.stop
        return kw

    @property
    def max_tokens(self) -> int | None:
        n = self.num_predict
        return None if n is None or n < 0 else n
