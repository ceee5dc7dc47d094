"""llama.cpp's native API over a real socket with httpx, both loops.

``/completion`` (whole, streamed, batched, token ids, constrained, with
``n_probs``), ``/tokenize`` / ``/detokenize`` in llama.cpp's shape beside
vLLM's, ``/props``, ``/slots`` and the routes without ``/v1``. Greedy texts
are checked against ``/v1/completions`` for the same prompt.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.test_server_app import open_server, open_socket_server

pytestmark = pytest.mark.anyio

PROMPT = "I believe the meaning of life is"


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with (
        open_server() as s,
        open_socket_server(s) as url,
        httpx.AsyncClient(base_url=url, timeout=30) as http,
    ):
        yield http


async def openai(http: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    r = await http.post("/v1/completions", json={"temperature": 0, **body})
    assert r.status_code == 200, r.text
    choice: dict[str, Any] = r.json()["choices"][0]
    return choice


async def native(http: httpx.AsyncClient, **body: Any) -> Any:
    r = await http.post("/completion", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def sse(text: str) -> list[dict[str, Any]]:
    events = [b.removeprefix("data: ") for b in text.split("\n\n") if b]
    assert all(e != "[DONE]" for e in events)  # llama.cpp sends none
    return [json.loads(e) for e in events]


async def test_completion_matches_v1_whole_and_streamed(
    http: httpx.AsyncClient,
) -> None:
    expected = await openai(http, prompt=PROMPT, max_tokens=8, return_token_ids=True)
    whole = await native(
        http, prompt=PROMPT, n_predict=8, temperature=0, return_tokens=True
    )
    assert whole["content"] == expected["text"]
    assert whole["tokens"] == expected["token_ids"]
    assert whole["stop"] is True and whole["stop_type"] == "limit"
    assert whole["timings"]["predicted_n"] == 8
    n_prompt = len(expected["prompt_token_ids"])
    assert whole["timings"]["prompt_n"] + whole["timings"]["cache_n"] == n_prompt
    assert whole["tokens_evaluated"] == n_prompt
    assert whole["generation_settings"]["n_predict"] == 8
    assert isinstance(whole["has_new_line"], bool) and whole["truncated"] is False
    without = await native(http, prompt=PROMPT, n_predict=8, temperature=0)
    assert without["tokens"] == []
    r = await http.post(
        "/completion",
        json={"prompt": PROMPT, "n_predict": 8, "temperature": 0, "stream": True},
    )
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert "".join(e["content"] for e in events) == expected["text"]
    assert [t for e in events[:-1] for t in e["tokens"]] == expected["token_ids"]
    last = events[-1]
    assert last["stop_type"] == "limit" and last["timings"]["predicted_n"] == 8
    assert last["generation_settings"]["stream"] is True


async def test_prompts_as_ids_mixed_and_batched(http: httpx.AsyncClient) -> None:
    r = await http.post("/tokenize", json={"content": PROMPT, "add_special": True})
    ids = r.json()["tokens"]
    text = (await native(http, prompt=PROMPT, n_predict=4, temperature=0))["content"]
    assert (await native(http, prompt=ids, n_predict=4, temperature=0))[
        "content"
    ] == text
    batch = await native(
        http,
        prompt=[ids, PROMPT, {"prompt_string": PROMPT}],
        n_predict=4,
        temperature=0,
    )
    assert [b["content"] for b in batch] == [text] * 3
    assert [b["index"] for b in batch] == [0, 1, 2]
    # ids and strings in one prompt: the strings after the first without BOS
    mixed = await native(http, prompt=[*ids[:3], PROMPT], n_predict=4, temperature=0)
    expected = await openai(
        http,
        prompt=[[*ids[:3], *(await tokens(http, PROMPT))]],
        max_tokens=4,
    )
    assert mixed["content"] == expected["text"]


async def tokens(http: httpx.AsyncClient, content: str) -> list[int]:
    r = await http.post("/tokenize", json={"content": content})
    assert r.status_code == 200
    ids: list[int] = r.json()["tokens"]
    return ids


async def test_grammar_json_schema_and_stop_word(http: httpx.AsyncClient) -> None:
    out = await native(http, prompt="hi", n_predict=10, grammar='root ::= "yes" | "no"')
    assert out["content"] in ("yes", "no") and out["stop_type"] == "eos"
    out = await native(
        http, prompt="hi", n_predict=10, json_schema={"enum": ["up", "down"]}
    )
    assert json.loads(out["content"]) in ("up", "down")
    out = await native(
        http, prompt="hi", n_predict=10, grammar='root ::= "yes"', stop=["e"]
    )
    assert out["content"] == "y"
    assert out["stop_type"] == "word" and out["stopping_word"] == "e"
    r = await http.post("/completion", json={"prompt": "hi", "grammar": "root ::= ("})
    assert r.status_code == 400 and r.json()["error"]["param"] == "grammar"


async def test_n_probs_and_logit_bias(http: httpx.AsyncClient) -> None:
    out = await native(
        http, prompt=PROMPT, n_predict=3, n_probs=4, temperature=0, return_tokens=True
    )
    probs = out["completion_probabilities"]
    assert [p["id"] for p in probs] == out["tokens"]
    for p in probs:
        assert p["logprob"] <= 0 and len(p["top_logprobs"]) == 4
        assert p["top_logprobs"][0]["id"] == p["id"]  # greedy: the best
        assert p["bytes"] == list(p["token"].encode())
    first = probs[0]["id"]
    banned = await native(
        http,
        prompt=PROMPT,
        n_predict=1,
        temperature=0,
        logit_bias=[[first, False]],
        return_tokens=True,
    )
    assert banned["tokens"] != [first]
    same = await native(
        http,
        prompt=PROMPT,
        n_predict=1,
        temperature=0,
        logit_bias={str(first): -100},
        return_tokens=True,
    )
    assert same["tokens"] == banned["tokens"]


async def test_response_fields(http: httpx.AsyncClient) -> None:
    out = await native(
        http,
        prompt="hi",
        n_predict=3,
        response_fields=["content", "generation_settings/n_predict"],
    )
    assert set(out) == {"content", "generation_settings/n_predict"}
    assert out["generation_settings/n_predict"] == 3


REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"mirostat": 2}, "mirostat"),
    ({"return_progress": True}, "return_progress"),
    ({"post_sampling_probs": True}, "post_sampling_probs"),
    ({"samplers": ["top_k"]}, "samplers"),
    ({"id_slot": 1}, "id_slot"),
    ({"n_predict": 0}, "n_predict"),
    ({"n_predict": 4096}, "n_predict"),
    ({"repeat_penalty": 1.1, "repeat_last_n": 64}, "repeat_last_n"),
    ({"logit_bias": [[1, "x"]]}, "logit_bias[0]"),
    ({"grammar": 'root ::= "a"', "json_schema": {}}, "grammar"),
    (
        {"prompt": {"prompt_string": "x", "multimodal_data": ["aGk="]}},
        "prompt.multimodal_data",
    ),
    ({"prompt": [[1, 2], 3.5]}, "prompt[1]"),
    ({"prompt": [1, 2], "stream": True, "n": 2}, "n"),
]


async def test_refused_by_name(http: httpx.AsyncClient) -> None:
    for body, named in REFUSED:
        r = await http.post(
            "/completion", json={"prompt": "hi", "n_predict": 2, **body}
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == named


async def test_tokenize_detokenize_both_shapes(http: httpx.AsyncClient) -> None:
    content = "What is the capital of France ?"
    plain = (await http.post("/tokenize", json={"content": content})).json()
    assert set(plain) == {"tokens"}
    vllm = (await http.post("/tokenize", json={"prompt": content})).json()
    assert vllm["tokens"][1:] == plain["tokens"]  # vLLM's default adds BOS
    special = (
        await http.post("/tokenize", json={"content": content, "add_special": True})
    ).json()
    assert special["tokens"] == vllm["tokens"]
    pieces = (
        await http.post("/tokenize", json={"content": content, "with_pieces": True})
    ).json()
    assert [p["id"] for p in pieces["tokens"]] == plain["tokens"]
    assert "".join(p["piece"] for p in pieces["tokens"]) == content
    back = (await http.post("/detokenize", json={"tokens": plain["tokens"]})).json()
    assert back["content"] == back["prompt"] == content
    r = await http.post("/tokenize", json={"content": content, "parse_special": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "parse_special"


async def test_props_slots_and_aliases(http: httpx.AsyncClient) -> None:
    props = (await http.get("/props")).json()
    assert props["default_generation_settings"]["n_ctx"] == 256
    assert props["model_path"] == "tiny-random" and props["total_slots"] >= 1
    assert "messages" in props["chat_template"]
    messages = [
        {"role": "system", "content": "You are a test."},
        {"role": "user", "content": "Hi there"},
    ]
    applied = await http.post("/apply-template", json={"messages": messages})
    tokenized = await http.post("/tokenize", json={"messages": messages})
    assert await tokens(http, applied.json()["prompt"]) == tokenized.json()["tokens"]
    assert applied.json()["prompt"].startswith("<|system|>\nYou are a test.")
    r = await http.get("/slots")
    assert r.status_code == 501 and "error" in r.json()
    assert (await http.post("/props", json={})).status_code == 400
    assert (await http.get("/models")).json()["data"][0]["id"] == "tiny-random"
    expected = await openai(http, prompt="hi", max_tokens=3)
    alias = await http.post(
        "/completions", json={"prompt": "hi", "n_predict": 3, "temperature": 0}
    )
    assert alias.json()["content"] == expected["text"]
    chat = await http.post(
        "/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert chat.json()["object"] == "chat.completion"


async def test_api_key_covers_the_new_routes() -> None:
    async with open_server(api_key=("k",)) as s:
        http = s.http
        for method, path in [
            ("POST", "/completion"),
            ("POST", "/completions"),
            ("POST", "/chat/completions"),
            ("GET", "/models"),
            ("GET", "/props"),
            ("GET", "/slots"),
            ("POST", "/apply-template"),
            ("POST", "/api/chat"),
            ("POST", "/api/generate"),
            ("GET", "/api/tags"),
        ]:
            r = await http.request(method, path, json={})
            assert r.status_code == 401, path
        assert (await http.get("/api/version")).status_code == 200
        r = await http.post(
            "/completion",
            json={"prompt": "hi", "n_predict": 1},
            headers={"Authorization": "Bearer k"},
        )
        assert r.status_code == 200
