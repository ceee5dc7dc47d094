"""The server's LoRA room (``server/lora``): the registry of adapters by name
and ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``.

The engine is a stand-in that keeps the core's books (a real
``LoRAManager`` over recording slots, tests/test_lora_core.py), so its
refusals are the core's; the app is the real one, driven in process.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import attrs
import httpx
import pytest

from structllm.config import ServerConfig
from structllm.core.lora_manager import LoRAManager
from structllm.errors import EngineLoadingError, InvalidRequestError
from structllm.lora_request import LoRARequest
from structllm.server.app import build_app
from structllm.server.lora.registry import (
    AdapterNotFoundError,
    LoRARegistry,
    parse_lora_modules,
)
from structllm.server.lora.serving import LoRAServing
from structllm.server.models.protocol import ModelCard
from structllm.server.protocol.bodies import dump
from structllm.server.serving import EngineSlot
from tests.test_lora_core import FakeSlots, _reader
from tests.test_server_app import events

BASE = "base-model"
KEY = "sk-lora-0123456789"


@attrs.define(eq=False)
class FakeEngine:
    """``AsyncLLM``'s two LoRA calls over a core's registry; ``gate``, when
    set, holds each load until it is set (a slow read)."""

    manager: LoRAManager = attrs.Factory(
        lambda: LoRAManager(FakeSlots(2), _reader(reads := []))
    )
    gate: anyio.Event | None = None
    started: anyio.Event = attrs.Factory(anyio.Event)
    removed: list[int] = attrs.Factory(list)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        return self.manager.add(lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        self.removed.append(lora_id)
        return self.manager.remove(lora_id)

    def ids(self) -> list[int]:
        return [i.request.lora_int_id for i in self.manager.adapters()]


@asynccontextmanager
async def open_app(
    engine: Any, **config: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, LoRARegistry]]:
    """The app, its LoRA room's engine the stand-in ``engine`` gives."""
    server = ServerConfig(model_name=BASE, **config)
    slot = EngineSlot()
    app = build_app(slot, server)
    assert slot.loras is not None
    registry = slot.loras
    app.state.lora = LoRAServing(
        slot, server, app.state.metrics, registry=registry, engine=engine
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        yield http, registry


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error: dict[str, Any] = r.json()["error"]
    return error


@pytest.mark.anyio
async def test_load_and_unload_over_http() -> None:
    engine = FakeEngine()
    async with open_app(lambda: engine) as (http, registry):
        r = await http.post(
            "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/ad/sql"}
        )
        assert r.status_code == 200
        assert r.text == "Success: LoRA adapter 'sql' added successfully."
        r = await http.post(
            "/v1/load_lora_adapter", json={"lora_name": "poem", "lora_path": "/ad/p"}
        )
        assert r.status_code == 200
        assert registry.adapters() == [
            LoRARequest("sql", 1, "/ad/sql"),
            LoRARequest("poem", 2, "/ad/p"),
        ]
        assert registry.lookup("sql") == LoRARequest("sql", 1, "/ad/sql")
        assert registry.lookup(BASE) is None
        assert registry.lookup(None) is None
        assert engine.ids() == [1, 2]
        cards = registry.cards(created=5, max_model_len=64)
        assert [(c.id, c.parent, c.root) for c in cards] == [
            ("sql", BASE, "/ad/sql"),
            ("poem", BASE, "/ad/p"),
        ]
        assert dump(cards[0])["parent"] == BASE  # the base's card: null (vLLM's)
        assert (
            dump(ModelCard(id=BASE, created=5, root="m", max_model_len=64))["parent"]
            is None
        )
        # the id must match when given
        r = await http.post(
            "/v1/unload_lora_adapter", json={"lora_name": "sql", "lora_int_id": 2}
        )
        assert _error(r, 404)["param"] == "lora_name"
        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert r.status_code == 200
        assert r.text == "Success: LoRA adapter 'sql' removed successfully."
        assert engine.ids() == [2]
        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        error = _error(r, 404)
        assert error["param"] == "lora_name"
        assert "'sql' is not loaded" in error["message"]
        # loaded again: a new id (ids are never reused)
        r = await http.post(
            "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/ad/sql"}
        )
        assert r.status_code == 200
        assert registry.lookup("sql") == LoRARequest("sql", 3, "/ad/sql")


@pytest.mark.anyio
async def test_refused_loads_change_nothing() -> None:
    engine = FakeEngine()
    async with open_app(lambda: engine) as (http, registry):
        load = {"lora_name": "sql", "lora_path": "/ad/sql"}
        assert (await http.post("/v1/load_lora_adapter", json=load)).status_code == 200
        cases: list[tuple[dict[str, Any], str, str]] = [
            (load, "lora_name", "'sql' is already loaded"),
            ({"lora_name": BASE, "lora_path": "/x"}, "lora_name", "base model's name"),
            # the core's refusal of a corrupt adapter, naming the tensor
            (
                {"lora_name": "bad", "lora_path": "/broken"},
                "lora_path",
                "tensor x is cut short",
            ),
            ({"lora_name": "big", "lora_path": "/big"}, "lora_path", "r=16 is over"),
            ({"lora_name": "x"}, "lora_path", ""),
            ({"lora_name": "", "lora_path": "/x"}, "lora_name", ""),
            ({"lora_name": 3, "lora_path": "/x"}, "lora_name", ""),
        ]
        for body, param, message in cases:
            r = await http.post("/v1/load_lora_adapter", json=body)
            error = _error(r, 400)
            assert error["param"] == param, error
            assert message in error["message"]
        r = await http.post(
            "/v1/unload_lora_adapter", json={"lora_name": "sql", "lora_int_id": 0}
        )
        assert _error(r, 400)["param"] == "lora_int_id"
        assert registry.adapters() == [LoRARequest("sql", 1, "/ad/sql")]
        assert engine.ids() == [1]
        engine.manager.audit()


@pytest.mark.anyio
async def test_load_inplace_replaces_the_adapter_of_that_name() -> None:
    engine = FakeEngine()
    async with open_app(lambda: engine) as (http, registry):
        load = {"lora_name": "sql", "lora_path": "/ad/sql"}
        await http.post("/v1/load_lora_adapter", json=load)
        engine.manager.acquire("running", 1)  # a request runs with the old one
        new = {"lora_name": "sql", "lora_path": "/ad/sql-v2", "load_inplace": True}
        r = await http.post("/v1/load_lora_adapter", json=new)
        assert r.status_code == 200
        assert registry.lookup("sql") == LoRARequest("sql", 2, "/ad/sql-v2")
        # the old one is unloading: it goes when its last request ends
        assert [
            (i.request.lora_int_id, i.unloading) for i in engine.manager.adapters()
        ] == [
            (1, True),
            (2, False),
        ]
        engine.manager.release(["running"])
        assert engine.ids() == [2]
        # a replacement that fails leaves the old one in place
        bad = {"lora_name": "sql", "lora_path": "/broken", "load_inplace": True}
        _error(await http.post("/v1/load_lora_adapter", json=bad), 400)
        assert registry.lookup("sql") == LoRARequest("sql", 2, "/ad/sql-v2")
        assert engine.ids() == [2]


@pytest.mark.anyio
async def test_the_routes_need_the_key_and_the_engine() -> None:
    engine = FakeEngine()
    async with open_app(lambda: engine, api_key=(KEY,)) as (http, registry):
        body = {"lora_name": "sql", "lora_path": "/ad/sql"}
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            assert (await http.post(path, json=body)).status_code == 401
        assert registry.adapters() == [] and engine.ids() == []
        auth = {"Authorization": f"Bearer {KEY}"}
        r = await http.post("/v1/load_lora_adapter", json=body, headers=auth)
        assert r.status_code == 200

    def loading() -> FakeEngine:
        raise EngineLoadingError("the engine is loading")

    async with open_app(loading) as (http, registry):
        r = await http.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert registry.adapters() == []


@pytest.mark.anyio
async def test_a_load_cancelled_midway_leaves_registry_and_engine_agreeing() -> None:
    engine = FakeEngine(gate=anyio.Event())
    registry = LoRARegistry(BASE)
    gate = engine.gate
    assert gate is not None
    scope = anyio.CancelScope()

    async def client() -> None:
        with scope:
            await registry.load(engine, "sql", "/ad/sql")

    async with anyio.create_task_group() as tg:
        tg.start_soon(client)
        await engine.started.wait()
        scope.cancel()  # the client went away while the engine reads it
        await anyio.lowlevel.checkpoint()
        assert registry.lookup("sql") is None  # shielded: still loading
        gate.set()
    assert scope.cancel_called
    # the engine's part ran to its end, and the name was recorded with it
    assert registry.lookup("sql") == LoRARequest("sql", 1, "/ad/sql")
    assert engine.ids() == [1]


@pytest.mark.anyio
async def test_lora_modules_load_in_order_and_the_first_failure_stops() -> None:
    assert parse_lora_modules(["a=/x", "b=/y=z"]) == [("a", "/x"), ("b", "/y=z")]
    engine = FakeEngine()
    registry = LoRARegistry(BASE)
    loaded = await registry.load_modules(engine, ["a=/x", "b=/y"])
    assert loaded == [LoRARequest("a", 1, "/x"), LoRARequest("b", 2, "/y")]
    with pytest.raises(InvalidRequestError, match="cut short"):
        await registry.load_modules(engine, ["c=/broken", "d=/z"])
    assert [r.lora_name for r in registry.adapters()] == ["a", "b"]
    with pytest.raises(AdapterNotFoundError):
        await registry.unload(engine, "c")


# -- the whole server, its engine and the openai client ----------------------


@pytest.mark.anyio
async def test_adapters_over_http_with_the_openai_client(bpe_dir: Path) -> None:
    import openai

    from structllm import AsyncLLM, SamplingParams

    data = Path(__file__).parent / "data" / "lora"
    slot = EngineSlot()
    app = build_app(slot, ServerConfig(model_name=BASE, api_key=(KEY,)))
    assert slot.loras is not None
    prompt = [5, 17, 99, 3, 42, 8, 61, 7, 120]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    async with AsyncLLM.open(
        str(data / "llama-base"),
        tokenizer=str(bpe_dir),
        executor="inline",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        block_size=4,
        num_blocks=64,
        show_progress=False,
    ) as llm:
        await slot.loras.load_modules(llm, [f"qv={data / 'llama-qv-r4'}"])
        slot.llm = llm
        want = {
            name: (await llm.complete(prompt, greedy, lora_request=lora))
            .outputs[0]
            .text
            for name, lora in [
                (BASE, None),
                ("qv", slot.loras.lookup("qv")),
                ("all", LoRARequest("x", 99, str(data / "llama-all-r8"))),
            ]
        }
        transport = httpx.ASGITransport(app=app)
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://t") as http,
            openai.AsyncOpenAI(
                base_url="http://t/v1",
                api_key=KEY,
                http_client=http,  # type: ignore[arg-type]
                max_retries=0,
            ) as client,
        ):

            async def complete(model: str) -> str:
                r = await client.completions.create(
                    model=model,
                    prompt=prompt,
                    max_tokens=6,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                assert r.model == model  # vLLM's: the adapter's name
                return r.choices[0].text

            assert await complete(BASE) == want[BASE]
            assert await complete("qv") == want["qv"]
            # streamed (read whole: the openai client leaves the ASGI body
            # unfinished after [DONE], which trio reports)
            body = {
                "model": "qv",
                "prompt": prompt,
                "max_tokens": 6,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            auth = {"Authorization": f"Bearer {KEY}"}
            r = await http.post("/v1/completions", json=body, headers=auth)
            chunks = events(r.text)[:-1]
            assert {c["model"] for c in chunks} == {"qv"}
            assert "".join(c["choices"][0]["text"] for c in chunks) == want["qv"]
            models = {m.id: m.model_dump() for m in (await client.models.list()).data}
            assert models["qv"]["parent"] == BASE and models[BASE]["parent"] is None
            # loaded at run time, behind the key
            body = {"lora_name": "all", "lora_path": str(data / "llama-all-r8")}
            r = await http.post("/v1/load_lora_adapter", json=body, headers=auth)
            assert r.status_code == 200, r.text
            assert await complete("all") == want["all"]
            # chat takes the adapter's name as its model too (the template
            # renders ids past this tiny vocabulary: a 400, not a 404)
            for model, error in [
                ("all", openai.BadRequestError),
                ("nope", openai.NotFoundError),
            ]:
                with pytest.raises(error):
                    await client.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": "a"}]
                    )
            r = await http.post(
                "/v1/unload_lora_adapter", json={"lora_name": "all"}, headers=auth
            )
            assert r.status_code == 200
            with pytest.raises(openai.NotFoundError):
                await complete("all")
            assert "all" not in {m.id for m in (await client.models.list()).data}
            assert await complete("qv") == want["qv"]  # the others serve on
        slot.llm = None


def test_serve_flags() -> None:
    from structllm.cli import build_parser, engine_args
    from structllm.config import EngineConfig
    from structllm.errors import EngineConfigError
    from structllm.server.run import configs_from_args

    argv = ["serve", "m", "--enable-lora", "--max-loras", "3", "--max-lora-rank", "8"]
    ns = build_parser().parse_args([*argv, "--lora-modules", "a=/x", "b=/y"])
    engine = EngineConfig(model="m", **engine_args(ns))
    assert (engine.enable_lora, engine.max_loras, engine.max_lora_rank) == (True, 3, 8)
    server, _ = configs_from_args(ns, engine)
    assert server.lora_modules == ("a=/x", "b=/y")
    ns = build_parser().parse_args(["serve", "m", "--lora-modules", "a=/x"])
    with pytest.raises(EngineConfigError, match="needs --enable-lora") as e:
        configs_from_args(ns, EngineConfig(model="m", **engine_args(ns)))
    assert e.value.field == "lora_modules"
