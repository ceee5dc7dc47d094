"""The logprobs objects of responses: completions' (OpenAI legacy, with
the echoed prompt's entries), chat's, and vLLM's ``prompt_logprobs`` list.
"""

from __future__ import annotations

from structllm.outputs import CompletionOutput, Logprob, RequestOutput
from structllm.server.protocol.bodies import Body

__all__ = [
    "ChatLogprobs",
    "ChatTokenLogprob",
    "CompletionLogprobs",
    "PromptLogprob",
    "PromptLogprobs",
    "TopLogprob",
    "chat_logprobs",
    "completion_logprobs",
    "prompt_logprobs",
]

#: what JSON gets for a -inf logprob (vLLM and OpenAI clamp the same way)
MIN_LOGPROB = -9999.0


class CompletionLogprobs(Body):
    """OpenAI's legacy logprobs; an echoed prompt's first token has nulls."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(Body):
    """vLLM's Logprob in ``prompt_logprobs``."""

    logprob: float
    rank: int | None
    decoded_token: str | None


#: one entry per prompt token, keyed by token id; the first is null
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class TopLogprob(Body):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Body):
    content: list[ChatTokenLogprob]


def _token_name(token_id: int, piece: str | None, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else (piece or "")


def completion_logprobs(
    out: CompletionOutput,
    text_offset: int = 0,
    *,
    as_ids: bool = False,
    echo: RequestOutput | None = None,
    first_piece: str = "",
) -> CompletionLogprobs | None:
    """The completions API's logprobs object for the tokens in ``out``.

    With ``echo`` (the output that carries the prompt logprobs) the prompt's
    tokens come first, its first one (text ``first_piece``: nothing predicts
    it) with null logprobs, as OpenAI's legacy completions do. Each
    ``top_logprobs`` object names the token at its position first.
    """
    if out.logprobs is None:
        return None
    ids: list[int] = []
    entries: list[dict[int, Logprob] | None] = []
    if echo is not None and echo.prompt_logprobs is not None:
        ids += echo.prompt_token_ids
        entries += echo.prompt_logprobs
    ids += out.token_ids
    entries += out.logprobs
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = text_offset
    for token_id, d in zip(ids, entries, strict=True):
        if d is None:
            piece = first_piece
            token_lps.append(None)
            tops.append(None)
        else:
            lp = d[token_id]
            piece = lp.decoded_token or ""
            token_lps.append(_clamp(lp.logprob))
            tops.append(
                {
                    _token_name(t, v.decoded_token, as_ids): _clamp(v.logprob)
                    for t, v in _own_first(token_id, d)
                }
            )
        tokens.append(_token_name(token_id, piece, as_ids))
        offsets.append(offset)
        offset += len(piece)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_lps, top_logprobs=tops, text_offset=offsets
    )


def _own_first(token_id: int, d: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    """``d``'s entries with ``token_id``'s first, then the others in order.

    vLLM's ``top_logprobs`` objects start with the token at that position
    (the sampled one, or the prompt's own when echoed), then the most likely;
    clients read ``next(iter(top))`` as the token itself.
    """
    return [(token_id, d[token_id])] + [(t, v) for t, v in d.items() if t != token_id]


def prompt_logprobs(out: RequestOutput) -> PromptLogprobs | None:
    """vLLM's ``prompt_logprobs`` list, if ``out`` carries one."""
    if out.prompt_logprobs is None:
        return None
    return [_prompt_entry(d) for d in out.prompt_logprobs]


def _prompt_entry(d: dict[int, Logprob] | None) -> dict[str, PromptLogprob] | None:
    if d is None:
        return None
    return {
        str(t): PromptLogprob(
            logprob=_clamp(v.logprob), rank=v.rank, decoded_token=v.decoded_token
        )
        for t, v in d.items()
    }


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def chat_logprobs(
    out: CompletionOutput, top_n: int, *, as_ids: bool = False
) -> ChatLogprobs | None:
    """The chat API's logprobs object: each token with its ``top_n`` best."""
    if out.logprobs is None:
        return None
    content = []
    for token_id, d in zip(out.token_ids, out.logprobs, strict=True):
        lp = d[token_id]
        name = _token_name(token_id, lp.decoded_token, as_ids)
        ranked = sorted(
            d.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30
        )
        tops = []
        for t, v in ranked[:top_n]:
            top = _token_name(t, v.decoded_token, as_ids)
            tops.append(
                TopLogprob(token=top, logprob=v.logprob, bytes=list(top.encode()))
            )
        content.append(
            ChatTokenLogprob(
                token=name,
                logprob=lp.logprob,
                bytes=list(name.encode()),
                top_logprobs=tops,
            )
        )
    return ChatLogprobs(content=content)
