"""Sampling through the server, checked against an expectation computed here.

The expected tokens come from the model's own logits, computed by the naive
numpy forward of ``tests/reference.py`` on ``tiny-random``'s weights, and
from the published definitions of each parameter, written out below (not
structllm's sampler): a field the server drops, or a sampler that reads the
wrong tokens, changes the tokens that come back. Requests go through the
ASGI app in process with httpx, as ``tests/test_server_app.py`` does.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import numpy as np
import pytest

from structllm.model.config import tiny_random_config
from structllm.model.loader import random_hf_tensors
from tests.reference import reference_logits
from tests.test_server_app import events, open_server

pytestmark = pytest.mark.anyio

PROMPT = [72, 101, 108, 108, 111, 37, 37, 37, 37, 37, 37]  # b"Hello%%%%%%": the
# model repeats "%", so the prompt matters to the repetition penalty


@functools.cache
def _weights() -> dict[str, np.ndarray]:
    return dict(random_hf_tensors(tiny_random_config(), 0))  # EngineConfig.seed


def next_logits(ids: list[int]) -> np.ndarray:
    """The model's logits for the token after ``ids`` (float64)."""
    return reference_logits(tiny_random_config(), _weights(), ids)[-1]


def penalised(
    logits: np.ndarray,
    prompt: list[int],
    output: list[int],
    *,
    repetition: float = 1.0,
    presence: float = 0.0,
    frequency: float = 0.0,
) -> np.ndarray:
    """vLLM's (and OpenAI's) penalties, from their definitions.

    repetition (CTRL, Keskar et al. 2019, as transformers applies it): every
    token seen in the prompt or the output has a positive logit divided by
    the penalty, a negative one multiplied. presence and frequency (OpenAI
    API reference): ``logit - frequency * count - presence * (count > 0)``
    over the output's tokens only.
    """
    x = logits.copy()
    for t in set(prompt) | set(output):
        x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    for t, count in Counter(output).items():
        x[t] -= frequency * count + presence
    return x


def greedy(prompt: list[int], n: int, **penalties: float) -> list[int]:
    """The tokens greedy decoding picks, penalised; each pick by a margin."""
    out: list[int] = []
    for _ in range(n):
        x = penalised(next_logits(prompt + out), prompt, out, **penalties)
        first, second = np.sort(x)[-2:][::-1]
        assert first - second > 1e-3, "a near tie: float32 may pick either"
        out.append(int(np.argmax(x)))
    return out


async def completion(s: Any, body: dict[str, Any]) -> dict[str, Any]:
    r = await s.http.post(
        "/v1/completions",
        json={"prompt": PROMPT, "return_token_ids": True, **body},
    )
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "penalties",
    [
        {"repetition_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"frequency_penalty": 2.0},
        {"repetition_penalty": 1.5, "presence_penalty": 2.0, "frequency_penalty": 1.0},
    ],
    ids=["repetition", "presence", "frequency", "all"],
)
async def test_penalties_pick_the_tokens_their_definition_does(
    penalties: dict[str, float],
) -> None:
    names = {
        "repetition_penalty": "repetition",
        "presence_penalty": "presence",
        "frequency_penalty": "frequency",
    }
    mine = {names[k]: v for k, v in penalties.items()}
    n = 12
    expected = greedy(PROMPT, n, **mine)
    # the test can fail: the penalties change the greedy tokens, and the
    # repetition penalty's prompt tokens matter
    assert expected != greedy(PROMPT, n)
    if "repetition" in mine:
        assert expected != _greedy_without_prompt(n, mine)  # no prompt tokens
    body = {"max_tokens": n, "temperature": 0, "ignore_eos": True, **penalties}
    async with open_server() as s:
        whole = await completion(s, body)
        assert whole["choices"][0]["token_ids"] == expected
        streamed = events(
            (
                await s.http.post(
                    "/v1/completions",
                    json={
                        "prompt": PROMPT,
                        "return_token_ids": True,
                        "stream": True,
                        **body,
                    },
                )
            ).text
        )
        ids = [t for e in streamed[:-1] for t in e["choices"][0]["token_ids"] or []]
        assert ids == expected


def _greedy_without_prompt(n: int, penalties: dict[str, float]) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        x = penalised(next_logits(PROMPT + out), [], out, **penalties)
        out.append(int(np.argmax(x)))
    return out


#: spreads the first token's distribution: the top two hold 41% of it
TEMPERATURE = 4.0


def first_token_probabilities() -> np.ndarray:
    """Softmax of the logits over the temperature: what top_p and min_p
    filter (the temperature comes first, in vLLM and in OpenAI's API)."""
    x = next_logits(PROMPT) / TEMPERATURE
    p = np.exp(x - x.max())
    return p / p.sum()  # type: ignore[no-any-return]


async def sampled_first_tokens(body: dict[str, Any]) -> set[int]:
    """The first token of 16 seeded samples (sample i is seeded ``seed + i``)."""
    async with open_server() as s:
        out = await completion(
            s,
            {"max_tokens": 1, "temperature": TEMPERATURE, "n": 16, "seed": 5, **body},
        )
    return {c["token_ids"][0] for c in out["choices"]}


async def test_top_p_samples_only_from_the_nucleus() -> None:
    """``top_p`` halfway into the second most likely token's mass keeps the
    top two (whatever the convention at the boundary); the first token of
    every sample is one of them, and without top_p it is not."""
    p = first_token_probabilities()
    order = np.argsort(p)[::-1]
    top_p = float(p[order[0]] + p[order[1]] / 2)
    nucleus = {int(order[0]), int(order[1])}
    assert await sampled_first_tokens({"top_p": top_p}) <= nucleus
    assert not await sampled_first_tokens({}) <= nucleus  # the test can fail


async def test_min_p_keeps_tokens_near_the_most_likely() -> None:
    """``min_p`` between the third's and the second's probability relative
    to the first's keeps exactly the top two."""
    p = first_token_probabilities()
    order = np.argsort(p)[::-1]
    ratio = p[order] / p[order[0]]
    min_p = float((ratio[1] + ratio[2]) / 2)
    kept = {int(order[0]), int(order[1])}
    got = await sampled_first_tokens({"min_p": min_p})
    assert got <= kept and len(got) == 2
    assert not await sampled_first_tokens({}) <= kept  # the test can fail


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_stop_strings_truncate_and_say_which(path: str, stream: bool) -> None:
    """The text up to the stop string, ``finish_reason`` "stop" and
    ``stop_reason`` the string; a stop token id's ``stop_reason`` is the id."""
    chat = "chat" in path
    base: dict[str, Any] = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
    base.update(
        {"messages": [{"role": "user", "content": "Hello world"}]}
        if chat
        else {"prompt": "Hello"}
    )

    def text_of(choice: dict[str, Any]) -> str:
        return str(choice["message"]["content"] if chat else choice["text"])

    async def ask(**extra: Any) -> tuple[str, dict[str, Any]]:
        """The text, and the last choice (its finish and stop reason)."""
        body = {**base, **extra, "stream": stream}
        r = await s.http.post(path, json=body)
        assert r.status_code == 200, r.text
        if not stream:
            (choice,) = r.json()["choices"]
            return text_of(choice), choice
        got = events(r.text)
        assert got[-1] == "[DONE]"
        chunks = [e["choices"][0] for e in got[:-1] if e["choices"]]
        key = "delta" if chat else None
        text = "".join(
            (c[key].get("content") or "") if key else c["text"] for c in chunks
        )
        return text, chunks[-1]

    async with open_server() as s:
        full, last = await ask()
        assert last["finish_reason"] == "length" and last.get("stop_reason") is None
        # tiny-random writes bytes that are not UTF-8 too: stop on plain text
        stop = next(
            full[i : i + 2]
            for i in range(1, len(full) - 1)
            if full[i : i + 2].isascii() and full[i : i + 2].isprintable()
        )
        text, last = await ask(stop=[stop, "never said"])
        assert text == full[: full.index(stop)]
        assert last["finish_reason"] == "stop" and last["stop_reason"] == stop
        text, last = await ask(stop=[stop], include_stop_str_in_output=True)
        assert text == full[: full.index(stop) + len(stop)]
        assert last["stop_reason"] == stop
        # a stop token id: the text before it, its id as the reason
        ids = (await s.http.post(path, json={**base, "return_token_ids": True})).json()[
            "choices"
        ][0]["token_ids"]
        token = ids[5]
        text, last = await ask(stop_token_ids=[token])
        assert last["finish_reason"] == "stop" and last["stop_reason"] == token
        assert len(text) < len(full) and full.startswith(text)
