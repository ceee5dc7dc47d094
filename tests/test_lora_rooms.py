"""LoRA adapters in every room: a request whose ``model`` names a loaded
adapter runs with it in Responses, Anthropic Messages, Ollama's API,
llama.cpp's native API, the chat batch route and embeddings, as it does in
completions and chat (tests/test_lora_server.py).

tiny-random has the shapes of the LoRA parity checkpoints (tests/data/lora),
so their peft adapters fit it, and ``llama-all-r8`` changes its greedy
tokens. Each room's greedy answer under the adapter equals the completions
route's (chat's, for a conversation, itself checked against completions) and
differs from the base model's; the answer names the adapter as its model; a
name neither served nor loaded is the room's own not-found error. Each room
is driven by its own client where one exists (openai, anthropic, ollama).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import numpy as np
import ollama
import openai
import pytest

from structllm.model.config import tiny_random_config
from structllm.model.loader import random_hf_tensors
from tests.test_server_app import Server, events, open_server, open_socket_server

pytestmark = pytest.mark.anyio

BASE = "tiny-random"
ADAPTER = "ad"
DATA = Path(__file__).parent / "data" / "lora"
#: room for the chat template's prompt
ENGINE = {
    "enable_lora": True,
    "max_loras": 2,
    "max_lora_rank": 8,
    "max_model_len": 256,
    "num_blocks": 64,
}
MAX = 8
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture
async def served() -> AsyncIterator[tuple[Server, str]]:
    """tiny-random with ``llama-all-r8`` loaded as ``ad``; its socket's URL."""
    async with open_server(engine=ENGINE) as s, open_socket_server(s) as url:
        assert s.slot.loras is not None
        await s.slot.loras.load_modules(s.llm, [f"{ADAPTER}={DATA / 'llama-all-r8'}"])
        yield s, url


async def post(s: Server, route: str, body: dict[str, Any]) -> Any:
    r = await s.http.post(route, json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def completion(s: Server, model: str, prompt: Any) -> dict[str, Any]:
    """The completions route's greedy choice (with its token ids)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX,
        "temperature": 0,
        "return_token_ids": True,
    }
    r = await post(s, "/v1/completions", body)
    assert r["model"] == model
    choice: dict[str, Any] = r["choices"][0]
    return choice


async def chat(s: Server, model: str, messages: list[dict[str, Any]]) -> str:
    """Chat's greedy answer, checked against the completions route's for
    the prompt chat rendered (same adapter, same tokens)."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": MAX,
        "temperature": 0,
        "return_token_ids": True,
    }
    r = await post(s, "/v1/chat/completions", body)
    assert r["model"] == model
    choice = r["choices"][0]
    plain = await completion(s, model, r["prompt_token_ids"])
    assert plain["token_ids"] == choice["token_ids"]
    assert plain["text"] == choice["message"]["content"]
    return str(choice["message"]["content"])


async def test_openai_rooms(served: tuple[Server, str]) -> None:
    s, url = served
    want = await chat(s, ADAPTER, HELLO)
    assert want != await chat(s, BASE, HELLO)  # the adapter changes tokens
    async with openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="x", max_retries=0
    ) as client:
        # Responses, whole and streamed
        r = await client.responses.create(
            model=ADAPTER, input="Hello", max_output_tokens=MAX, temperature=0
        )
        assert (r.model, r.output_text) == (ADAPTER, want)
        stream = await client.responses.create(
            model=ADAPTER,
            input="Hello",
            max_output_tokens=MAX,
            temperature=0,
            stream=True,
        )
        seen = [e async for e in stream]
        assert seen[0].type == "response.created"
        assert seen[0].response.model == ADAPTER
        assert seen[-1].type == "response.completed"
        assert seen[-1].response.output_text == want
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model="nope", input="Hello")
    # the chat batch route: each conversation under the adapter
    hi = [{"role": "user", "content": "Hi"}]
    body = {"model": ADAPTER, "messages": [HELLO, hi], "max_tokens": MAX}
    batch = await post(s, "/v1/chat/completions/batch", {**body, "temperature": 0})
    assert batch["model"] == ADAPTER
    answers = [c["message"]["content"] for c in batch["choices"]]
    assert answers == [want, await chat(s, ADAPTER, hi)]
    r2 = await s.http.post("/v1/chat/completions/batch", json={**body, "model": "nope"})
    assert r2.status_code == 404 and r2.json()["error"]["param"] == "model"


@functools.cache
def _embedding_matrix() -> np.ndarray:
    """tiny-random's (tied) embedding: its head, (V, H)."""
    weights = dict(random_hf_tensors(tiny_random_config(), 0))  # EngineConfig.seed
    return weights["model.embed_tokens.weight"].astype(np.float64)


async def test_embeddings_pool_under_the_adapter(served: tuple[Server, str]) -> None:
    """The last token's hidden state under the adapter, through the tied head,
    gives the adapter's next-token logprobs (as the completions route says)."""
    s, url = served
    ids = [256, *b"Hello wo"]  # as the byte tokenizer writes "Hello wo": BOS, bytes

    async def vector(model: str, normalize: bool) -> np.ndarray:
        body = {"model": model, "input": [ids], "pooling": "last"}
        r = await post(s, "/v1/embeddings", {**body, "normalize": normalize})
        assert r["model"] == model
        return np.array(r["data"][0]["embedding"], dtype=np.float64)

    async def top_logprobs(model: str) -> dict[int, float]:
        body = {
            "model": model,
            "prompt": ids,
            "max_tokens": 1,
            "temperature": 0,
            "logprobs": 5,
            "return_tokens_as_token_ids": True,
        }
        r = await post(s, "/v1/completions", body)
        top = r["choices"][0]["logprobs"]["top_logprobs"][0]
        return {int(k.removeprefix("token_id:")): v for k, v in top.items()}

    raw = {model: await vector(model, False) for model in (ADAPTER, BASE)}
    for model in (ADAPTER, BASE):
        logits = _embedding_matrix() @ raw[model]
        logprobs = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        top = await top_logprobs(model)
        assert {t: logprobs[t] for t in top} == pytest.approx(top, abs=1e-3)
    unit = await vector(ADAPTER, True)
    assert not np.allclose(unit, await vector(BASE, True), atol=1e-2)
    # Ollama's /api/embed (normalised) and /api/embeddings (not), and
    # llama.cpp's /embedding too
    async with ollama.AsyncClient(host=url, timeout=30) as client:
        e = await client.embed(model=ADAPTER, input="Hello wo")
        old = await client.embeddings(model=f"{ADAPTER}:latest", prompt="Hello wo")
    assert e.model == ADAPTER
    np.testing.assert_allclose(e.embeddings[0], unit, atol=1e-5)
    np.testing.assert_allclose(old.embedding, raw[ADAPTER], atol=1e-4)
    body = {"model": ADAPTER, "content": "Hello wo", "embd_normalize": 2}
    native = await post(s, "/embedding", body)
    np.testing.assert_allclose(native[0]["embedding"][0], unit, atol=1e-5)
    r = await s.http.post("/v1/embeddings", json={"model": "nope", "input": "a"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


async def test_anthropic_messages(served: tuple[Server, str]) -> None:
    s, url = served
    want = await chat(s, ADAPTER, HELLO)
    async with anthropic.AsyncAnthropic(
        base_url=url, api_key="x", max_retries=0
    ) as client:
        ask: Any = {
            "max_tokens": MAX,
            "messages": HELLO,
            "extra_body": {"temperature": 0},
        }
        whole = await client.messages.create(model=ADAPTER, **ask)
        assert whole.model == ADAPTER
        assert [b.text for b in whole.content if b.type == "text"] == [want]
        async with client.messages.stream(model=ADAPTER, **ask) as stream:
            final = await stream.get_final_message()
        assert final.model == ADAPTER  # message_start's
        assert [b.text for b in final.content if b.type == "text"] == [want]
        counted = await client.messages.count_tokens(model=ADAPTER, messages=HELLO)
        base = await client.messages.count_tokens(model=BASE, messages=HELLO)
        assert counted.input_tokens == base.input_tokens
        with pytest.raises(anthropic.NotFoundError):
            await client.messages.create(model="nope", **ask)


async def test_ollama(served: tuple[Server, str]) -> None:
    s, url = served
    want_chat = await chat(s, ADAPTER, HELLO)
    want = (await completion(s, ADAPTER, "Hello world"))["text"]
    assert want != (await completion(s, BASE, "Hello world"))["text"]
    greedy = {"temperature": 0, "num_predict": MAX}
    async with ollama.AsyncClient(host=url, timeout=30) as client:
        loaded = await client.generate(ADAPTER)  # no prompt: loads the model
        assert (loaded.model, loaded.done_reason) == (ADAPTER, "load")
        r = await client.chat(model=ADAPTER, messages=HELLO, options=greedy)
        assert (r.model, r.message.content) == (ADAPTER, want_chat)
        g = await client.generate(
            f"{ADAPTER}:latest", "Hello world", raw=True, options=greedy
        )
        assert (g.model, g.response) == (ADAPTER, want)
        parts = [
            p
            async for p in await client.generate(
                ADAPTER, "Hello world", raw=True, options=greedy, stream=True
            )
        ]
        assert {p.model for p in parts} == {ADAPTER}
        assert "".join(p.response or "" for p in parts) == want
        # the adapter is a model of its own over the served one
        models = {m.model: m for m in (await client.list()).models}
        assert models[ADAPTER].details is not None
        assert models[ADAPTER].details.parent_model == BASE
        assert models[BASE].details is not None
        assert not models[BASE].details.parent_model
        running = {m.model for m in (await client.ps()).models}
        assert running == {BASE, ADAPTER}
        shown = await client.show(ADAPTER)
        assert shown.modelfile is not None
        assert f"ADAPTER {DATA / 'llama-all-r8'}" in shown.modelfile
        assert shown.details is not None and shown.details.parent_model == BASE
        with pytest.raises(ollama.ResponseError) as missing:
            await client.chat(model="nope", messages=HELLO)
        assert missing.value.status_code == 404


async def test_llamacpp_native(served: tuple[Server, str]) -> None:
    s, _ = served
    want = (await completion(s, ADAPTER, "Hello world"))["text"]
    body = {"prompt": "Hello world", "n_predict": MAX, "temperature": 0}
    r = await post(s, "/completion", {**body, "model": ADAPTER})
    assert (r["model"], r["content"]) == (ADAPTER, want)
    assert r["generation_settings"]["model"] == ADAPTER
    assert (await post(s, "/completion", body))["model"] == BASE
    streamed = await s.http.post(
        "/completion", json={**body, "model": ADAPTER, "stream": True}
    )
    chunks = events(streamed.text)
    assert "".join(c["content"] for c in chunks) == want
    assert chunks[-1]["model"] == ADAPTER
    missing = await s.http.post("/completion", json={**body, "model": "nope"})
    assert missing.status_code == 404
    # llama.cpp's per-request scales stay refused, pointing at model
    refused = await s.http.post(
        "/completion", json={**body, "lora": [{"id": 0, "scale": 0.5}]}
    )
    assert refused.status_code == 400 and "model" in refused.json()["error"]["message"]


def test_llm_embed_takes_the_adapter() -> None:
    """The synchronous ``LLM.embed(lora_request=)``: the adapter's vector is
    the one ``/v1/embeddings`` pools (through ``AsyncLLM.embed``), and not
    the base model's."""
    from structllm import LLM, LoRARequest

    llm = LLM(BASE, show_progress=False, **ENGINE)  # type: ignore[arg-type]
    lora = LoRARequest(ADAPTER, 1, str(DATA / "llama-all-r8"))
    base, adapted, again = (
        np.array(out.embedding)
        for out in (
            llm.embed("Hello there", use_tqdm=False)[0],
            llm.embed("Hello there", use_tqdm=False, lora_request=lora)[0],
            llm.embed(["Hello there"], use_tqdm=False, lora_request=lora)[0],
        )
    )
    np.testing.assert_array_equal(adapted, again)
    assert not np.allclose(base, adapted, atol=1e-3)
