"""Request and response models of the operational routes, vLLM's shapes.

``POST /tokenize`` takes a :class:`TokenizeCompletionRequest` (``prompt``)
or a :class:`TokenizeChatRequest` (``messages``, rendered with the chat
template, with ``tools`` if given) and answers a :class:`TokenizeResponse`; ``POST /detokenize``
takes a :class:`DetokenizeRequest` and answers a :class:`DetokenizeResponse`;
``GET /tokenizer_info`` answers a :class:`TokenizerInfoResponse`. The request models
validate as strictly as :mod:`structllm.server.protocol`'s (strict types,
valid Unicode, bounded lists); the vLLM fields structllm does not
implement are refused naming them (:data:`TOKENIZE_REFUSED`).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from structllm.server.chat.messages import ChatPrompt
from structllm.server.protocol.bodies import Body
from structllm.server.protocol.fields import Text, TokenId

__all__ = [
    "MAX_DETOKENIZE",
    "TOKENIZE_REFUSED",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "TokenizeChatRequest",
    "TokenizeCompletionRequest",
    "TokenizeResponse",
    "TokenizerInfoResponse",
]

#: the most token ids one ``/detokenize`` takes
MAX_DETOKENIZE = 1 << 20


#: vLLM's tokenize fields that structllm refuses (present and not null)
TOKENIZE_REFUSED = {
    "chat_template": "custom chat templates are not supported",
    "mm_processor_kwargs": "multimodal input is not supported",
}


_CONFIG = ConfigDict(
    strict=True,
    extra="ignore",
    frozen=True,
    allow_inf_nan=False,
    hide_input_in_errors=True,
)


class _Request(BaseModel):
    model_config = _CONFIG

    model: Text | None = None
    #: the text of each token as well (``token_strs``)
    return_token_strs: bool = False

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise PydanticCustomError("body", "the request body must be a JSON object")
        for name, reason in TOKENIZE_REFUSED.items():
            if data.get(name) is not None:
                raise PydanticCustomError(
                    "refused", "{reason}", {"name": name, "reason": reason}
                )
        return data


class TokenizeCompletionRequest(_Request):
    """``POST /tokenize`` with a ``prompt``."""

    prompt: Text
    #: BOS and the like, as a completion request adds them
    add_special_tokens: bool = True


class TokenizeChatRequest(_Request, ChatPrompt):
    """``POST /tokenize`` with ``messages``, rendered as chat completions does."""

    #: chat templates write BOS themselves
    add_special_tokens: bool = False


class DetokenizeRequest(_Request):
    """``POST /detokenize``."""

    tokens: Annotated[list[TokenId], Field(max_length=MAX_DETOKENIZE)]


class TokenizeResponse(Body):
    count: int
    max_model_len: int
    tokens: list[int]
    #: with ``return_token_strs``: each token's vocabulary entry (``"Ġi"`` in
    #: a byte-level BPE, as transformers' ``convert_ids_to_tokens``); null
    #: otherwise, as vLLM sends it
    token_strs: list[str] | None = None


class DetokenizeResponse(Body):
    prompt: str


class TokenizerInfoResponse(Body):
    """``GET /tokenizer_info``: vLLM's route, the tokenizer's settings.

    vLLM sends transformers' ``init_kwargs`` (tokenizer_config.json) with
    the class name; structllm sends the settings it reads from the model's
    files, under the same keys.
    """

    #: structllm's tokenizer class (``HFTokenizer`` for tokenizer.json and
    #: GGUF vocabularies, ``ByteTokenizer`` for the built-in byte models)
    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    #: the model's chat template (null: the model has none)
    chat_template: str | None
    #: the served context length (``--max-model-len``)
    model_max_length: int
    #: the added tokens by id (decimal strings), their text as the value
    added_tokens_decoder: dict[str, str]
