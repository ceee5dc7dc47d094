"""``/v1/embeddings``, Ollama's ``/api/embed`` and llama.cpp's ``/embedding``.

In process through the ASGI app (``tests/test_server_app.py``'s
``open_server``), and on a real socket with the ``openai`` and ``ollama``
clients. The vectors are checked against the numpy reference forward
(``tests/test_embeddings.py``'s ``expected``): tiny-random has no
sentence-transformers config, so its default is the last token, normalised.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import anyio
import anyio.to_thread
import httpx
import numpy as np
import ollama
import openai
import pytest

from tests.core_record import assert_core_holds_nothing
from tests.test_embeddings import TOL, expected, in_core
from tests.test_server_app import Exchange, open_server, open_socket_server

pytestmark = pytest.mark.anyio

IDS = [5, 17, 33, 2, 99, 120, 7, 64, 3]
ENGINE = {"max_model_len": 2048, "num_blocks": 256, "max_num_batched_tokens": 16}


def vector(item: dict[str, Any]) -> np.ndarray:
    e = item["embedding"]
    if isinstance(e, str):
        return np.frombuffer(base64.b64decode(e), "<f4")
    return np.asarray(e, dtype=np.float64)


async def post(http: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    r = await http.post("/v1/embeddings", json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


async def test_embeddings_floats_base64_batches_and_usage() -> None:
    async with open_server(engine=ENGINE) as s:
        one = await post(s.http, {"input": IDS, "model": "tiny-random"})
        assert one["object"] == "list" and one["model"] == "tiny-random"
        assert one["usage"] == {
            "prompt_tokens": 9,
            "total_tokens": 9,
            "completion_tokens": 0,
        }
        (item,) = one["data"]
        assert item["object"] == "embedding" and item["index"] == 0
        np.testing.assert_allclose(vector(item), expected(IDS, "last", True), atol=TOL)

        # base64 is the same float32 values, bit for bit
        b64 = await post(s.http, {"input": IDS, "encoding_format": "base64"})
        assert isinstance(b64["data"][0]["embedding"], str)
        assert vector(b64["data"][0]).tolist() == item["embedding"]

        # several inputs in one request: the vectors of one at a time
        inputs: list[Any] = ["Hello world", "abc", "Hello world, again"]
        batch = await post(s.http, {"input": inputs, "pooling": "mean"})
        assert [d["index"] for d in batch["data"]] == [0, 1, 2]
        for text, d in zip(inputs, batch["data"], strict=True):
            alone = await post(s.http, {"input": text, "pooling": "mean"})
            np.testing.assert_allclose(vector(d), vector(alone["data"][0]), atol=1e-5)
        sizes = [len(s.llm.tokenizer.encode(text)) for text in inputs]
        assert batch["usage"]["prompt_tokens"] == sum(sizes)

        # lists of token ids; mean pooling, not normalised; Matryoshka
        lists = await post(
            s.http,
            {"input": [IDS, IDS[:4]], "pooling": "mean", "normalize": False},
        )
        for ids, d in zip([IDS, IDS[:4]], lists["data"], strict=True):
            np.testing.assert_allclose(
                vector(d), expected(ids, "mean", False), atol=TOL
            )
        # vLLM's other name for normalize; a salt changes nothing but sharing
        raw = await post(
            s.http, {"input": IDS, "use_activation": False, "cache_salt": "s"}
        )
        np.testing.assert_allclose(
            vector(raw["data"][0]), expected(IDS, "last", False), atol=TOL
        )
        # every input counted as a finished request, its prompt tokens too
        before = await s.metric('structllm_requests_total{finished_reason="stop"}')
        tokens = await s.metric("structllm_prompt_tokens_total")
        await post(s.http, {"input": [IDS, IDS[:3]]})
        after = await s.metric('structllm_requests_total{finished_reason="stop"}')
        assert after - before == 2
        assert await s.metric("structllm_prompt_tokens_total") - tokens == 12
        # tiny-random is no Matryoshka model: its full size only
        full = await post(s.http, {"input": IDS, "dimensions": 64})
        assert vector(full["data"][0]).tolist() == item["embedding"]
        await assert_core_holds_nothing(s.llm)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "dimensions": 65}, "dimensions"),
        ({"input": "x", "dimensions": 8}, "dimensions"),  # not a Matryoshka model
        ({"input": "x", "pooling": "max"}, "pooling"),
        ({"input": "x", "normalize": "yes"}, "normalize"),
        ({"input": "x", "truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
        ({"input": "x", "embed_dtype": "float16"}, "embed_dtype"),
        ({"messages": [{"role": "user", "content": "x"}]}, "messages"),
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": [[1, 2], "x"]}, "input"),
        ({"input": ["x", "y" * 3000]}, "input[1]"),
        ({"input": [[1, 2, 300]]}, "input"),
        ({"input": "x", "request_id": "r"}, "request_id"),
        ({"input": "x", "normalize": True, "use_activation": False}, "use_activation"),
        ({"input": "x", "cache_salt": ""}, "cache_salt"),
    ],
)
async def test_bad_fields_are_400_naming_them(body: dict[str, Any], param: str) -> None:
    async with open_server(engine=ENGINE) as s:
        r = await s.http.post("/v1/embeddings", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text
        if param == "input[1]":
            assert "too large" in r.json()["error"]["message"]
        other = await s.http.post("/v1/embeddings", json={"input": "x", "model": "m"})
        assert other.status_code == 404
        await assert_core_holds_nothing(s.llm)


async def test_a_client_that_leaves_or_times_out_aborts_the_inputs() -> None:
    long = [[(3 * i + k) % 250 + 1 for i in range(2000)] for k in range(2)]
    async with open_server(engine=ENGINE) as s:
        x = Exchange(json.dumps({"input": long, "pooling": "mean"}).encode())
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(x.run, s.app, "/v1/embeddings")
                await in_core(s.llm)
                x.hang_up.set()
        assert x.sent[0]["status"] == 499
        await assert_core_holds_nothing(s.llm)
        r = await s.http.post(
            "/v1/embeddings",
            json={"input": long, "pooling": "mean"},
            headers={"X-Request-Timeout": "0.05"},
        )
        assert r.status_code == 408, r.text
        await assert_core_holds_nothing(s.llm)
        await post(s.http, {"input": "still serving"})


async def test_openapi_lists_the_routes() -> None:
    async with open_server(load=False) as s:
        doc = (await s.http.get("/openapi.json")).json()
    post_ = doc["paths"]["/v1/embeddings"]["post"]
    ok = post_["responses"]["200"]["content"]["application/json"]["schema"]
    assert ok["$ref"].endswith("/EmbeddingResponse")
    body = post_["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/EmbeddingRequest")
    for path in ("/api/embed", "/api/embeddings", "/embedding", "/embeddings"):
        assert "post" in doc["paths"][path], path


async def test_the_openai_and_ollama_clients() -> None:
    async with open_server(engine=ENGINE) as s, open_socket_server(s) as url:
        floats = await post(s.http, {"input": ["Hello", "world"]})
        want = [vector(d) for d in floats["data"]]
        tokens = floats["usage"]["prompt_tokens"]

        def use_openai() -> None:
            with openai.OpenAI(
                base_url=f"{url}/v1", api_key="none", max_retries=0
            ) as c:
                # the client asks for base64 and decodes it itself
                got = c.embeddings.create(model="tiny-random", input=["Hello", "world"])
                assert [d.index for d in got.data] == [0, 1]
                for d, w in zip(got.data, want, strict=True):
                    np.testing.assert_allclose(d.embedding, w, atol=1e-6)
                assert got.usage.prompt_tokens == got.usage.total_tokens == tokens
                f = c.embeddings.create(
                    model="tiny-random", input=IDS, encoding_format="float"
                )
                np.testing.assert_allclose(
                    f.data[0].embedding, expected(IDS, "last", True), atol=TOL
                )
                with pytest.raises(openai.BadRequestError) as e:
                    c.embeddings.create(model="tiny-random", input="x", dimensions=0)
                assert isinstance(e.value.body, dict)
                assert e.value.body["param"] == "dimensions"

        await anyio.to_thread.run_sync(use_openai)

        async with ollama.AsyncClient(host=url, timeout=30) as client:
            got = await client.embed("tiny-random", ["Hello", "world"])
            for e, w in zip(got.embeddings, want, strict=True):
                np.testing.assert_allclose(e, w, atol=1e-6)  # normalised too
            assert got.prompt_eval_count == tokens
            legacy = await client.embeddings("tiny-random:latest", "Hello")
            raw = await post(s.http, {"input": "Hello", "normalize": False})
            np.testing.assert_allclose(
                legacy.embedding, vector(raw["data"][0]), atol=1e-6
            )
            with pytest.raises(ollama.ResponseError) as missing:
                await client.embed("other", "x")
            assert missing.value.status_code == 404
            with pytest.raises(ollama.ResponseError) as bad:
                await client.embed("tiny-random", [""])
            assert bad.value.status_code == 400 and "input[0]" in bad.value.error

        # llama.cpp's native route: [{"index", "embedding": [[...]]}]
        async with httpx.AsyncClient(base_url=url) as http:
            r = await http.post("/embedding", json={"content": ["Hello", [5, 6, "x"]]})
            assert r.status_code == 200, r.text
            native = r.json()
            assert [d["index"] for d in native] == [0, 1]
            np.testing.assert_allclose(native[0]["embedding"][0], want[0], atol=1e-6)
            r = await http.post("/embeddings", json={"input": "x", "embd_normalize": 1})
            assert (
                r.status_code == 400 and r.json()["error"]["param"] == "embd_normalize"
            )
        await assert_core_holds_nothing(s.llm)
