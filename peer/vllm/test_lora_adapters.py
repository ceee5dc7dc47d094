# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Adapted for structllm from vllm-project/vllm
# tests/entrypoints/serve/lora/test_lora_adapters.py
# (commit 0306474e9d1f26d8717aad457b9511f0c9e57d60). What changed and why:
# peer/vllm/NOTES.md; every change is marked "structllm:" below.

import asyncio
import json
import shutil
from contextlib import suppress
from pathlib import Path

import openai  # use the official client for correctness check
import pytest

# structllm: tests.utils.RemoteOpenAIServer -> peer.conftest.StructllmServer
from peer.conftest import StructllmServer

# structllm: "Qwen/Qwen3-0.6B" -> tiny-random, whose shapes are those of the
# LoRA parity checkpoints: the peft adapters of tests/data/lora fit it
# (upstream's qwen3_*_lora_files are downloaded from the Hub).
MODEL_NAME = "tiny-random"
LORA_DATA = Path(__file__).resolve().parents[2] / "tests" / "data" / "lora"

# structllm: pytest.mark.asyncio -> pytest.mark.anyio (asyncio backend)
pytestmark = pytest.mark.anyio

#: structllm: an adapter the engine cannot read or run is a 400 naming
#: lora_path, in structllm's words (docs/serving.md); vLLM answers 500.
_LOAD_REFUSED_400 = pytest.mark.xfail(
    reason="deliberate: an adapter that cannot be read or run is a 400 "
    "(param lora_path) with structllm's words; vLLM answers 404 for a "
    "missing path and 500 for a bad one",
    strict=True,
)


BADREQUEST_CASES = [
    (
        "test_rank",
        {"r": 1024},
        "is greater than max_lora_rank",
    ),
    ("test_dora", {"use_dora": True}, "DoRA adapter loading is not implemented yet"),
    (
        "test_modules_to_save",
        {"modules_to_save": ["lm_head"]},
        "only supports modules_to_save being None",
    ),
]


# structllm: the adapter directories (fixtures of upstream's conftest)
@pytest.fixture(scope="module")
def qwen3_lora_files():
    return str(LORA_DATA / "llama-all-r8")


@pytest.fixture(scope="module")
def qwen3_meowing_lora_files():
    return str(LORA_DATA / "llama-all-r8")


@pytest.fixture(scope="module")
def qwen3_woofing_lora_files():
    return str(LORA_DATA / "llama-qv-r4")


@pytest.fixture(scope="module", params=[True])
def server_with_lora_modules_json(request, qwen3_lora_files):
    # structllm: --lora-modules NAME=PATH; vLLM's JSON form
    # ({"name", "path", "base_model_name"}) is not taken. --dtype,
    # --max-model-len 8192, --enforce-eager and --max-cpu-loras size or tune
    # vLLM (tiny-random's context is sized as the shared server's);
    # --max-loras 2 makes the 10 adapters of test_multiple_lora_adapters
    # take turns in the model's slots, as --max-cpu-loras 2 does upstream.
    args = [
        "--max-model-len",
        "256",
        "--num-blocks",
        "256",
        # lora config below
        "--enable-lora",
        "--lora-modules",
        f"qwen3-lora={qwen3_lora_files}",
        "--max-lora-rank",
        "64",
        "--max-loras",
        "2",
        "--max-num-seqs",
        "64",
    ]

    # structllm: VLLM_ALLOW_RUNTIME_LORA_UPDATING: /v1/load_lora_adapter is
    # always on (behind the API key, when there is one)
    with StructllmServer(MODEL_NAME, args) as remote_server:
        yield remote_server


# structllm: pytest_asyncio.fixture -> pytest.fixture (AnyIO's plugin)
@pytest.fixture
async def client(server_with_lora_modules_json):
    async with server_with_lora_modules_json.get_async_client() as async_client:
        yield async_client


async def test_static_lora_lineage(client: openai.AsyncOpenAI, qwen3_lora_files):
    models = await client.models.list()
    models = models.data
    served_model = models[0]
    lora_models = models[1:]
    assert served_model.id == MODEL_NAME
    assert served_model.root == MODEL_NAME
    assert served_model.parent is None
    assert all(lora_model.root == qwen3_lora_files for lora_model in lora_models)
    assert all(lora_model.parent == MODEL_NAME for lora_model in lora_models)
    assert lora_models[0].id == "qwen3-lora"


async def test_dynamic_lora_lineage(client: openai.AsyncOpenAI, qwen3_lora_files):
    response = await client.post(
        "load_lora_adapter",
        cast_to=str,
        body={"lora_name": "qwen3-lora-3", "lora_path": qwen3_lora_files},
    )
    # Ensure adapter loads before querying /models
    assert "success" in response

    models = await client.models.list()
    models = models.data
    dynamic_lora_model = models[-1]
    assert dynamic_lora_model.root == qwen3_lora_files
    assert dynamic_lora_model.parent == MODEL_NAME
    assert dynamic_lora_model.id == "qwen3-lora-3"


async def test_load_lora_adapter_with_same_name_replaces_inplace(
    client: openai.AsyncOpenAI, qwen3_meowing_lora_files, qwen3_woofing_lora_files
):
    """Test that loading a LoRA adapter with the same name replaces it inplace."""
    adapter_name = "replaceable-adapter"
    messages = [
        {"content": "Follow the instructions to make animal noises", "role": "system"},
        {"content": "Make your favorite animal noise.", "role": "user"},
    ]

    # structllm: tiny-random's adapters neither meow nor woof: each answer
    # is compared with the answer of the same files loaded under a name of
    # their own (greedy, so the two are the same run).
    async def answer(model: str) -> str:
        completion = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=10, temperature=0
        )
        return completion.choices[0].message.content

    for reference, path in [
        ("meowing-reference", qwen3_meowing_lora_files),
        ("woofing-reference", qwen3_woofing_lora_files),
    ]:
        await client.post(
            "load_lora_adapter",
            cast_to=str,
            body={"lora_name": reference, "lora_path": path},
        )
    meow = await answer("meowing-reference")
    woof = await answer("woofing-reference")
    assert meow != woof

    # Load LoRA that makes model meow
    response = await client.post(
        "load_lora_adapter",
        cast_to=str,
        body={"lora_name": adapter_name, "lora_path": qwen3_meowing_lora_files},
    )
    assert "success" in response.lower()

    # structllm: "Meow Meow Meow" in the answer -> the meowing adapter's answer
    assert await answer(adapter_name) == meow

    # Load LoRA that makes model woof
    response = await client.post(
        "load_lora_adapter",
        cast_to=str,
        body={
            "lora_name": adapter_name,
            "lora_path": qwen3_woofing_lora_files,
            "load_inplace": True,
        },
    )
    assert "success" in response.lower()

    # structllm: "Woof Woof Woof" in the answer -> the woofing adapter's answer
    assert await answer(adapter_name) == woof


async def test_load_lora_adapter_with_load_inplace_false_errors(
    client: openai.AsyncOpenAI, qwen3_meowing_lora_files
):
    """Test that load_inplace=False returns an error when adapter already exists."""
    adapter_name = "test-load-inplace-false"

    # Load LoRA adapter first time (should succeed)
    response = await client.post(
        "load_lora_adapter",
        cast_to=str,
        body={"lora_name": adapter_name, "lora_path": qwen3_meowing_lora_files},
    )
    assert "success" in response.lower()

    # Try to load the same adapter again with load_inplace=False (should fail)
    with pytest.raises(openai.BadRequestError) as exc_info:
        await client.post(
            "load_lora_adapter",
            cast_to=str,
            body={
                "lora_name": adapter_name,
                "lora_path": qwen3_meowing_lora_files,
            },
        )

    # Verify the error message
    # structllm: vLLM says "has already been loaded", structllm "is already
    # loaded" (a wording difference)
    assert "already loaded" in str(exc_info.value)


@_LOAD_REFUSED_400
async def test_dynamic_lora_not_found(client: openai.AsyncOpenAI):
    with pytest.raises(openai.NotFoundError):
        await client.post(
            "load_lora_adapter",
            cast_to=str,
            body={"lora_name": "notfound", "lora_path": "/not/an/adapter"},
        )


@_LOAD_REFUSED_400
async def test_dynamic_lora_invalid_files(client: openai.AsyncOpenAI, tmp_path):
    invalid_files = tmp_path / "invalid_files"
    invalid_files.mkdir()
    (invalid_files / "adapter_config.json").write_text("this is not json")

    with pytest.raises(openai.InternalServerError):
        await client.post(
            "load_lora_adapter",
            cast_to=str,
            body={"lora_name": "invalid-json", "lora_path": str(invalid_files)},
        )


@_LOAD_REFUSED_400
@pytest.mark.parametrize("test_name,config_change,expected_error", BADREQUEST_CASES)
async def test_dynamic_lora_badrequests(
    client: openai.AsyncOpenAI,
    tmp_path,
    qwen3_lora_files,
    test_name: str,
    config_change: dict,
    expected_error: str,
):
    # Create test directory
    test_dir = tmp_path / test_name

    # Copy adapter files
    shutil.copytree(qwen3_lora_files, test_dir)

    # Load and modify configuration
    config_path = test_dir / "adapter_config.json"
    # structllm: upstream's blocking file reads in an async test are kept
    with open(config_path) as f:  # noqa: ASYNC230
        adapter_config = json.load(f)
    # Apply configuration changes
    adapter_config.update(config_change)

    # Save modified configuration
    with open(config_path, "w") as f:  # noqa: ASYNC230
        json.dump(adapter_config, f)

    # Test loading the adapter
    with pytest.raises(openai.InternalServerError, match=expected_error):
        await client.post(
            "load_lora_adapter",
            cast_to=str,
            body={"lora_name": test_name, "lora_path": str(test_dir)},
        )


async def test_multiple_lora_adapters(
    client: openai.AsyncOpenAI, tmp_path, qwen3_lora_files
):
    """Validate that many loras can be dynamically registered and inferenced
    with concurrently"""

    # This test file configures the server with --max-cpu-loras=2 and this test
    # will concurrently load 10 adapters, so it should flex the LRU cache
    async def load_and_run_adapter(adapter_name: str):
        await client.post(
            "load_lora_adapter",
            cast_to=str,
            body={"lora_name": adapter_name, "lora_path": str(qwen3_lora_files)},
        )
        for _ in range(3):
            await client.completions.create(
                model=adapter_name,
                prompt=["Hello there", "Foo bar bazz buzz"],
                max_tokens=5,
            )

    lora_tasks = []
    for i in range(10):
        lora_tasks.append(asyncio.create_task(load_and_run_adapter(f"adapter_{i}")))

    results, _ = await asyncio.wait(lora_tasks)

    for r in results:
        # structllm: asyncio.wait gives the tasks, which are never exceptions:
        # each task's own exception is checked
        assert r.exception() is None, f"Got exception {r.exception()}"


async def test_loading_invalid_adapters_does_not_break_others(
    client: openai.AsyncOpenAI, tmp_path, qwen3_lora_files
):
    invalid_files = tmp_path / "invalid_files"
    invalid_files.mkdir()
    (invalid_files / "adapter_config.json").write_text("this is not json")

    stop_good_requests_event = asyncio.Event()

    async def run_good_requests(client):
        # Run chat completions requests until event set

        results = []

        while not stop_good_requests_event.is_set():
            try:
                batch = await client.completions.create(
                    model="qwen3-lora",
                    prompt=["Hello there", "Foo bar bazz buzz"],
                    max_tokens=5,
                )
                results.append(batch)
            except Exception as e:
                results.append(e)

        return results

    # Create task to run good requests
    good_task = asyncio.create_task(run_good_requests(client))

    # Run a bunch of bad adapter loads
    # structllm: both bad loads are 400s here (the xfails above): suppressed
    # as BadRequestError where upstream suppresses a 404 and a 500
    for _ in range(25):
        with suppress(openai.BadRequestError):
            await client.post(
                "load_lora_adapter",
                cast_to=str,
                body={"lora_name": "notfound", "lora_path": "/not/an/adapter"},
            )
    for _ in range(25):
        with suppress(openai.BadRequestError):
            await client.post(
                "load_lora_adapter",
                cast_to=str,
                body={"lora_name": "invalid", "lora_path": str(invalid_files)},
            )

    # Ensure all the running requests with lora adapters succeeded
    stop_good_requests_event.set()
    results = await good_task
    for r in results:
        assert not isinstance(r, Exception), f"Got exception {r}"

    # Ensure we can load another adapter and run it
    await client.post(
        "load_lora_adapter",
        cast_to=str,
        body={"lora_name": "valid", "lora_path": qwen3_lora_files},
    )
    await client.completions.create(
        model="valid",
        prompt=["Hello there", "Foo bar bazz buzz"],
        max_tokens=5,
    )


@pytest.mark.xfail(
    reason="not implemented: beam search is refused (400 naming use_beam_search)",
    strict=True,
)
async def test_beam_search_with_lora_adapters(
    client: openai.AsyncOpenAI,
    tmp_path,
    qwen3_lora_files,
):
    """Validate that async beam search can be used with lora."""

    async def load_and_run_adapter(adapter_name: str):
        # structllm: adapter_0..2 are loaded already (test_multiple_lora_adapters):
        # loading a name again is a 400, which upstream's check (of the tasks,
        # not their exceptions) never saw; the beam search is what is tested
        with suppress(openai.BadRequestError):
            await client.post(
                "load_lora_adapter",
                cast_to=str,
                body={"lora_name": adapter_name, "lora_path": str(qwen3_lora_files)},
            )
        for _ in range(3):
            await client.completions.create(
                model=adapter_name,
                prompt=["Hello there", "Foo bar bazz buzz"],
                max_tokens=5,
                extra_body=dict(use_beam_search=True),
            )

    lora_tasks = []
    for i in range(3):
        lora_tasks.append(asyncio.create_task(load_and_run_adapter(f"adapter_{i}")))

    results, _ = await asyncio.wait(lora_tasks)

    for r in results:
        # structllm: each task's own exception (see test_multiple_lora_adapters)
        assert r.exception() is None, f"Got exception {r.exception()}"
