"""llama.cpp's native API: its request models and its response models.

``POST /completion`` (and ``/completions``) takes llama.cpp's fields:

===========================================  ================================
``prompt``                                   a string, token ids, ids and
                                             strings mixed in one list, or a
                                             list of such prompts (answered
                                             with a list); ``{"prompt_string":
                                             ...}`` objects too
``n_predict``                                ``max_tokens``; -1 (default) up
                                             to the context
``temperature``, ``top_k`` (0: off),         the same
``top_p``, ``min_p``, ``stop``,
``presence_penalty``, ``frequency_penalty``,
``ignore_eos``
``seed``                                     the same; -1 (llama.cpp's
                                             "random") none
``repeat_penalty``                           ``repetition_penalty`` over the
                                             whole context (``repeat_last_n``
                                             -1)
``logit_bias``                               ``[[id or text, bias or false],
                                             ...]`` or ``{id: bias}``; a text
                                             biases each of its tokens
``json_schema``, ``grammar`` (GBNF)          structured output
``n_probs``                                  ``completion_probabilities``
                                             (logprobs, the top N each)
``return_tokens``, ``response_fields``       as llama.cpp
``cache_prompt``                             accepted: the prefix cache is
                                             automatic and does not change
                                             the output
===========================================  ================================

``POST /embedding`` (and ``/embeddings``) takes ``content`` (or ``input``)
shaped as ``prompt`` above and answers ``[{"index": i, "embedding":
[[...]]}]``, one pooled vector per prompt (llama.cpp's shape), normalised
unless ``embd_normalize`` is -1.

The fields of :data:`NATIVE_REFUSED` are refused with a 400 naming them
unless they hold their no-op value; other unknown fields are ignored, as
llama.cpp ignores them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, model_validator
from pydantic_core import PydanticCustomError

from structllm.errors import InvalidRequestError
from structllm.params import MAX_LOGPROBS
from structllm.server.protocol.bodies import Body
from structllm.server.protocol.fields import (
    REQUEST_CONFIG,
    NonEmptyText,
    Penalty,
    Seed,
    Stop,
    Text,
)
from structllm.server.protocol.formats import SchemaObject
from structllm.server.protocol.refusals import refuse

__all__ = [
    "NATIVE_REFUSED",
    "LlamaCompletionRequest",
    "LlamaEmbeddingRequest",
    "LlamaTimings",
    "LlamaTokenizeRequest",
    "LlamaTokenizeResponse",
    "NativePrompt",
]

#: llama.cpp's fields structllm cannot honour -> (reason, no-op values)
NATIVE_REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "mirostat": ("mirostat sampling is not supported", (0,)),
    "typical_p": ("typical sampling is not supported", (1, 1.0)),
    "dynatemp_range": ("dynamic temperature is not supported", (0, 0.0)),
    "dry_multiplier": ("DRY sampling is not supported", (0, 0.0)),
    "xtc_probability": ("XTC sampling is not supported", (0, 0.0)),
    "top_n_sigma": ("top-n-sigma sampling is not supported", (-1, -1.0)),
    "samplers": ("the sampler order is fixed", ()),
    "n_keep": ("the context is never shifted, so nothing is kept", (0, -1)),
    "n_discard": ("the context is never shifted", (0,)),
    "n_indent": ("n_indent is not supported", (0,)),
    "t_max_predict_ms": ("a time limit per request is --request-timeout", (0,)),
    "t_max_prompt_ms": ("a time limit per request is --request-timeout", (0, -1)),
    "id_slot": ("requests are not bound to slots", (-1,)),
    "lora": (
        "per-request LoRA scales are not supported; name a loaded adapter "
        "as the request's model",
        ([],),
    ),
    "post_sampling_probs": (
        "probabilities after sampling are not supported; n_probs gives the "
        "model's logprobs",
        (False,),
    ),
    "return_progress": (
        "prompt progress is not reported: the prompt is computed in one step",
        (False,),
    ),
    "timings_per_token": ("timings come with the final answer", (False,)),
    "multimodal_data": ("images and audio are not supported", ([],)),
    "n_cmpl": ("one completion per prompt", (1,)),
    "n": ("one completion per prompt; use /v1/completions for n", (1,)),
    "chat_template_kwargs": ("a completion prompt is not templated", ({},)),
    "penalize_nl": ("penalize_nl is not supported", (False,)),
    "min_keep": ("min_keep is not supported", (0,)),
}


def _prompt(value: Any, name: str = "prompt") -> list[Any]:
    """The prompts of a request, each a string or a list of ids and strings."""

    def one(p: Any, where: str) -> Any:
        if isinstance(p, dict):
            if p.get("multimodal_data"):
                raise PydanticCustomError(
                    "refused",
                    "images and audio are not supported",
                    {"name": f"{where}.multimodal_data"},
                )
            text = p.get("prompt_string")
            if not isinstance(text, str):
                raise PydanticCustomError(
                    "field",
                    "a prompt object needs prompt_string, a string",
                    {"name": f"{where}.prompt_string"},
                )
            return text
        if isinstance(p, str):
            return p
        if isinstance(p, list) and p and all(_piece(x) for x in p):
            return p
        raise PydanticCustomError(
            "field",
            "a prompt is a string, token ids (strings may be mixed in), or an "
            "object with prompt_string",
            {"name": where},
        )

    if isinstance(value, list) and value and any(_is_id(x) for x in value):
        return [one(value, name)]  # one prompt of ids and strings mixed
    if isinstance(value, list):
        if not value:
            raise PydanticCustomError("field", "no prompt given", {"name": name})
        return [one(p, f"{name}[{i}]") for i, p in enumerate(value)]
    return [one(value, name)]


def _is_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _piece(x: Any) -> bool:
    return (_is_id(x) and 0 <= x < 2**31) or isinstance(x, str)


NativePrompt = str | list[int | str]


def _bias_error(field: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{field}: {message}", field=field)


class LlamaCompletionRequest(BaseModel):
    """``POST /completion``."""

    model_config = REQUEST_CONFIG

    prompt: Any
    n_predict: Annotated[int, Field(ge=-2, le=2**31 - 1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Seed | None = None
    stop: Stop = ()
    stream: bool | None = None
    repeat_penalty: Annotated[float, Field(gt=0.0, le=100.0)] | None = None
    repeat_last_n: Annotated[int, Field(ge=-1)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    ignore_eos: bool | None = None
    #: ``[[id or text, bias or false], ...]`` or ``{"id": bias}`` (read by
    #: :meth:`bias`)
    logit_bias: list[Any] | dict[str, Any] | None = None
    json_schema: SchemaObject | None = None
    grammar: Text | None = None
    n_probs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    return_tokens: bool | None = None
    response_fields: Annotated[list[NonEmptyText], Field(max_length=64)] | None = None
    #: accepted: the prefix cache is automatic and never changes the output
    cache_prompt: bool | None = None
    model: Text | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise PydanticCustomError("body", "the request body must be a JSON object")
        refuse(data, NATIVE_REFUSED)
        if "prompt" not in data:
            raise PydanticCustomError("field", "required", {"name": "prompt"})
        return {**data, "prompt": _prompt(data["prompt"])}

    @model_validator(mode="after")
    def _checks(self) -> LlamaCompletionRequest:
        if self.n_predict == 0:
            raise PydanticCustomError(
                "field",
                "must be at least 1, or -1 for no limit",
                {"name": "n_predict"},
            )
        penalised = self.repeat_penalty not in (None, 1.0)
        if penalised and self.repeat_last_n not in (None, -1):
            raise PydanticCustomError(
                "refused",
                "the repetition penalty covers the whole context (-1)",
                {"name": "repeat_last_n"},
            )
        if self.json_schema is not None and self.grammar:
            raise PydanticCustomError(
                "field",
                "give json_schema or grammar, not both",
                {"name": "grammar"},
            )
        return self

    def bias_entries(self) -> list[tuple[int | str, float, str]]:
        """``logit_bias`` as (token id or text, bias, field) triples.

        ``false`` bans the token (-100, as OpenAI's strongest bias); a bias
        outside [-100, 100] is a 400 naming the entry.
        """
        raw = self.logit_bias
        if raw is None:
            return []
        items: list[tuple[Any, Any, str]]
        if isinstance(raw, dict):
            items = [(k, v, f"logit_bias.{k}") for k, v in raw.items()]
        else:
            items = []
            for i, entry in enumerate(raw):
                if not (isinstance(entry, list) and len(entry) == 2):
                    raise _bias_error(f"logit_bias[{i}]", "must be [token, bias]")
                items.append((entry[0], entry[1], f"logit_bias[{i}]"))
        out: list[tuple[int | str, float, str]] = []
        for given, bias, field in items:
            key: Any = given
            if isinstance(key, str) and key.isdigit() and isinstance(raw, dict):
                key = int(key)
            if not (isinstance(key, str) or (_is_id(key) and 0 <= key < 2**31)):
                raise _bias_error(field, "the token must be an id or a text")
            if bias is False:
                bias = -100.0
            if isinstance(bias, bool) or not isinstance(bias, int | float):
                raise _bias_error(field, "the bias must be a number or false")
            if not -100.0 <= bias <= 100.0:
                raise _bias_error(field, "the bias must be in [-100, 100]")
            out.append((key, float(bias), field))
        return out

    @property
    def prompts(self) -> list[NativePrompt]:
        return list(self.prompt)

    @property
    def max_tokens(self) -> int | None:
        n = self.n_predict
        return None if n is None or n < 0 else n


class LlamaEmbeddingRequest(BaseModel):
    """llama.cpp's ``POST /embedding`` (and ``/embeddings``): ``content`` (or
    ``input``) as ``/completion``'s prompt; ``embd_normalize`` -1 (none) or
    2 (Euclidean, the default); structllm's ``pooling``."""

    model_config = REQUEST_CONFIG

    content: Any
    embd_normalize: int = 2
    pooling: Literal["last", "mean"] | None = None
    model: Text | None = None

    @model_validator(mode="before")
    @classmethod
    def _content(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise PydanticCustomError("body", "the request body must be a JSON object")
        name = "content" if "content" in data else "input"
        if name not in data:
            raise PydanticCustomError("field", "required", {"name": "content"})
        return {**data, "content": _prompt(data[name], name)}

    @model_validator(mode="after")
    def _normalize(self) -> LlamaEmbeddingRequest:
        if self.embd_normalize not in (-1, 2):
            raise PydanticCustomError(
                "refused",
                "only -1 (none) and 2 (Euclidean) are supported",
                {"name": "embd_normalize"},
            )
        return self

    @property
    def prompts(self) -> list[NativePrompt]:
        return list(self.content)


class LlamaTimings(Body):
    """``timings``: what the answer cost (milliseconds)."""

    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float


class LlamaTokenizeRequest(BaseModel):
    """llama.cpp's ``POST /tokenize``."""

    model_config = REQUEST_CONFIG

    content: Text
    #: llama.cpp's default: no BOS
    add_special: bool = False
    #: special tokens written in the text are parsed as such (llama.cpp's
    #: default); false is refused: the tokenizer always parses them
    parse_special: bool = True
    with_pieces: bool = False

    @model_validator(mode="after")
    def _special(self) -> LlamaTokenizeRequest:
        if not self.parse_special:
            raise PydanticCustomError(
                "refused",
                "special tokens written in the text are always parsed",
                {"name": "parse_special"},
            )
        return self


class _Piece(Body):
    id: int
    #: the token's text, or its bytes when they are not valid UTF-8 alone
    piece: str | list[int]


class LlamaTokenizeResponse(Body):
    tokens: list[int] | list[_Piece]
