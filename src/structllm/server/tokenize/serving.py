"""``POST /tokenize`` and ``POST /detokenize``: the model's tokenizer over HTTP.

Bodies go through the same guard as the generation routes (size cap,
strict JSON, deadline, disconnects). A ``prompt`` is tokenised as
completions tokenises it (``add_special_tokens`` defaults to true),
``messages`` as chat completions renders them (chat template, then no
special tokens). Long texts are tokenised in a worker thread, and the
``--max-prompt-bytes`` cap is checked before. ``/detokenize`` refuses ids
outside the vocabulary naming ``tokens[i]`` and decodes with the special
tokens spelled out, so it inverts ``/tokenize``. ``token_strs``
(``return_token_strs``) are vocabulary entries, not decoded text: a
byte-level BPE's ``"Ġi"`` where the text is ``" i"``, as vLLM answers.
``GET /tokenizer_info`` describes the tokenizer (vLLM's route).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio.to_thread
import attrs
from fastapi.responses import Response

from structllm.engine.frontend.inputs import OFF_LOOP_CHARS, check_prompt_bytes
from structllm.errors import InvalidRequestError
from structllm.server.http.body import maybe_off_loop, validate
from structllm.server.http.errors import ASCIIJSONResponse
from structllm.server.protocol import bodies
from structllm.server.serving import Serving
from structllm.server.tokenize.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from structllm.text.tokenizer import HFTokenizer, Tokenizer

__all__ = ["TokenizeServing", "vocabulary_entries"]


@attrs.define(eq=False)
class TokenizeServing(Serving):
    """The two routes' logic."""

    async def tokenize(self, body: Any, big: bool) -> Response:
        llm = self.slot.get()
        tok = llm.tokenizer
        req: TokenizeChatRequest | TokenizeCompletionRequest
        if isinstance(body, dict) and "messages" in body:
            chat: TokenizeChatRequest = await maybe_off_loop(
                big, validate, TokenizeChatRequest, body
            )
            messages = chat.template_messages()
            options = chat.template_options()
            text = "".join(m["content"] for m in messages)
            field, req = "messages", chat

            def render() -> str:
                return tok.apply_chat_template(messages, **options)
        else:
            plain: TokenizeCompletionRequest = await maybe_off_loop(
                big, validate, TokenizeCompletionRequest, body
            )
            text, field, req = plain.prompt, "prompt", plain

            def render() -> str:
                return plain.prompt

        self.check_model(req.model)
        check_prompt_bytes(text, llm.max_prompt_bytes, field)

        def encode() -> list[int]:
            return tok.encode(render(), add_special_tokens=req.add_special_tokens)

        if len(text) > OFF_LOOP_CHARS:
            ids = await anyio.to_thread.run_sync(encode)
        else:
            ids = encode()
        response = TokenizeResponse(
            count=len(ids),
            max_model_len=llm.max_model_len,
            tokens=ids,
            token_strs=vocabulary_entries(tok, ids) if req.return_token_strs else None,
        )
        return ASCIIJSONResponse(bodies.dump(response))

    async def detokenize(self, body: Any, big: bool) -> Response:
        llm = self.slot.get()
        req: DetokenizeRequest = await maybe_off_loop(
            big, validate, DetokenizeRequest, body
        )
        self.check_model(req.model)
        vocab = llm.tokenizer.vocab_size
        for i, t in enumerate(req.tokens):
            if t >= vocab:
                raise InvalidRequestError(
                    f"tokens[{i}]: token id {t} is outside the vocabulary [0, {vocab})",
                    field=f"tokens[{i}]",
                )

        def decode() -> str:
            return llm.tokenizer.decode(req.tokens, skip_special_tokens=False)

        if len(req.tokens) > OFF_LOOP_CHARS:
            text = await anyio.to_thread.run_sync(decode)
        else:
            text = decode()
        return ASCIIJSONResponse(bodies.dump(DetokenizeResponse(prompt=text)))

    async def tokenizer_info(self) -> Response:
        """``GET /tokenizer_info``: no body, so no guard beyond the slot."""
        llm = self.slot.get()
        tok = llm.tokenizer
        added: dict[str, str] = {}
        if isinstance(tok, HFTokenizer):
            decoder = tok.backend.get_added_tokens_decoder()
            added = {str(i): t.content for i, t in sorted(decoder.items())}
        info = TokenizerInfoResponse(
            tokenizer_class=type(tok).__name__,
            bos_token=tok.bos_token,
            eos_token=tok.eos_token,
            chat_template=tok.chat_template,
            model_max_length=llm.max_model_len,
            added_tokens_decoder=added,
        )
        return ASCIIJSONResponse(bodies.dump(info))


def vocabulary_entries(tok: Tokenizer, ids: Sequence[int]) -> list[str]:
    """Each id's entry in the vocabulary, as transformers'
    ``convert_ids_to_tokens`` gives it (``"Ġi"``, ``"<|im_end|>"``).

    A tokenizer without a vocabulary of strings (the built-in byte
    tokenizer) gives each token's text instead.
    """
    if isinstance(tok, HFTokenizer):
        return [tok.backend.id_to_token(i) or "" for i in ids]
    return [tok.id_to_piece(i) for i in ids]
