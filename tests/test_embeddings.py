"""Embeddings: pooling requests from the core to ``LLM.embed`` and ``AsyncLLM.embed``.

The expected vectors come from the naive numpy forward of
``tests/reference.py`` (its final-normed hidden states, float64), pooled
here from the definitions: the last position's row, or the mean of every
position's, then divided by its L2 norm. ``parity/test_embeddings.py``
compares the same with transformers' ``AutoModel``. The HTTP routes are in
``tests/test_embeddings_api.py``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import anyio
import msgspec
import numpy as np
import pytest
from safetensors.numpy import load_file

from structllm import LLM, AsyncLLM
from structllm.config import EngineConfig
from structllm.core.engine_core import EngineCore
from structllm.core.pooling import (
    Pooling,
    PoolingConfig,
    finish_embedding,
    read_pooling_config,
)
from structllm.core.request import CoreRequest
from structllm.errors import InvalidRequestError
from structllm.model.config import ModelConfig, tiny_random_config
from structllm.model.loader import random_hf_tensors
from structllm.params import SamplingParams
from structllm.testing.checkpoints import make_tiny_model
from tests.core_record import assert_core_holds_nothing, core_state, user_ids
from tests.reference import reference_hidden

TOL = 1e-4
#: crosses the block (4) and chunk (8) edges
IDS = [(7 * i + 3) % 250 + 1 for i in range(21)]
SMALL = {
    "max_model_len": 64,
    "num_blocks": 64,
    "block_size": 4,
    "max_num_batched_tokens": 8,
}


@functools.cache
def _weights() -> dict[str, np.ndarray]:
    return dict(random_hf_tensors(tiny_random_config(), 0))  # EngineConfig.seed


def expected(
    ids: list[int], method: str, normalize: bool, dims: int | None = None
) -> np.ndarray:
    h = reference_hidden(tiny_random_config(), _weights(), ids)  # (T, H) float64
    v = h[-1] if method == "last" else h.mean(axis=0)
    v = v[:dims] if dims is not None else v
    return v / np.linalg.norm(v) if normalize else v


def run_core(core: EngineCore, requests: list[CoreRequest]) -> dict[str, np.ndarray]:
    """Every request's embedding, stepping until the core is idle."""
    for r in requests:
        core.add_request(r)
    out: dict[str, np.ndarray] = {}
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            assert o.new_token_ids == ()
            assert o.finish_reason == "stop" and o.embedding is not None
            out[o.request_id] = np.frombuffer(o.embedding, "<f4")
    return out


def pooling_request(rid: str, ids: list[int], pooling: Pooling) -> CoreRequest:
    return CoreRequest(
        request_id=rid,
        prompt_token_ids=tuple(ids),
        params=SamplingParams(),
        pooling=pooling,
    )


@pytest.fixture(scope="module")
def core() -> EngineCore:
    return EngineCore(EngineConfig(model="tiny-random", **SMALL))  # type: ignore[arg-type]


# -- the core ----------------------------------------------------------------------


@pytest.mark.parametrize("method", ["last", "mean"])
@pytest.mark.parametrize("normalize", [False, True])
def test_core_pools_the_final_hidden_states(
    core: EngineCore, method: str, normalize: bool
) -> None:
    # 21 tokens in chunks of 8: mean pooling sums across three steps
    got = run_core(core, [pooling_request("a", IDS, Pooling(method, normalize))])  # type: ignore[arg-type]
    np.testing.assert_allclose(got["a"], expected(IDS, method, normalize), atol=TOL)
    assert core.pool.num_used == 0  # its blocks went back with its prefill
    assert core.statistics().scheduler.num_running == 0


def test_dimensions_only_for_a_matryoshka_model(
    core: EngineCore, tmp_path: Path
) -> None:
    # tiny-random is no Matryoshka model: fewer dimensions are refused
    with pytest.raises(InvalidRequestError) as bad:
        core.add_request(pooling_request("e", IDS, Pooling("mean", True, 16)))
    assert bad.value.field == "dimensions" and "Matryoshka" in str(bad.value)
    for d in (0, 65):
        with pytest.raises(InvalidRequestError) as bad:
            core.add_request(pooling_request("e", IDS, Pooling("mean", True, d)))
        assert bad.value.field == "dimensions"
    got = run_core(core, [pooling_request("d", IDS, Pooling("mean", True, 64))])
    np.testing.assert_allclose(got["d"], expected(IDS, "mean", True), atol=TOL)

    # one whose config.json says so: its first values, normalised after
    make_tiny_model(tmp_path, seed=2, max_position_embeddings=128)
    config_path = tmp_path / "config.json"
    hf = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**hf, "matryoshka_dimensions": [16, 32]}))
    weights = {
        k: v for f in tmp_path.glob("*.safetensors") for k, v in load_file(f).items()
    }
    h = reference_hidden(ModelConfig.from_path(tmp_path), weights, IDS[:9])
    llm = LLM(str(tmp_path), show_progress=False, **SMALL)  # type: ignore[arg-type]
    (out,) = llm.embed([IDS[:9]], pooling="mean", dimensions=16, use_tqdm=False)
    v = h.mean(axis=0)[:16]
    np.testing.assert_allclose(out.embedding, v / np.linalg.norm(v), atol=TOL)
    with pytest.raises(InvalidRequestError) as bad:
        llm.embed([IDS[:9]], dimensions=8, use_tqdm=False)  # not a trained size
    assert bad.value.field == "dimensions" and "[16, 32]" in str(bad.value)
    assert llm.core.pool.num_used == 0


def test_a_batch_equals_one_at_a_time_and_generation_runs_beside_it(
    core: EngineCore,
) -> None:
    prompts = {f"p{i}": IDS[: 3 + 5 * i] for i in range(4)}
    alone = {
        rid: run_core(core, [pooling_request(rid, ids, Pooling("mean", False))])[rid]
        for rid, ids in prompts.items()
    }
    core.add_request(
        CoreRequest(
            request_id="gen",
            prompt_token_ids=tuple(IDS),
            params=SamplingParams(max_tokens=6, temperature=0),
        )
    )
    together: dict[str, np.ndarray] = {}
    tokens = 0
    for rid, ids in prompts.items():
        core.add_request(pooling_request(rid, ids, Pooling("mean", False)))
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            if o.request_id == "gen":
                tokens += len(o.new_token_ids)
            else:
                assert o.embedding is not None
                together[o.request_id] = np.frombuffer(o.embedding, "<f4")
    assert tokens == 6
    for rid in prompts:
        np.testing.assert_allclose(together[rid], alone[rid], atol=1e-5)
    assert core.pool.num_used == 0


def test_prefix_cache_serves_last_pooling_and_never_mean(core: EngineCore) -> None:
    core.reset_prefix_cache()
    run_core(core, [pooling_request("warm", IDS, Pooling("last", False))])
    hits = core.scheduler.prefix_cache_hits
    got = run_core(core, [pooling_request("last", IDS, Pooling("last", False))])
    assert core.scheduler.prefix_cache_hits - hits == 20  # 5 full blocks of 4
    np.testing.assert_allclose(got["last"], expected(IDS, "last", False), atol=TOL)
    # mean pooling needs every position's hidden state: it looks nothing up
    queries, hits = (
        core.scheduler.prefix_cache_queries,
        core.scheduler.prefix_cache_hits,
    )
    got = run_core(core, [pooling_request("mean", IDS, Pooling("mean", False))])
    assert core.scheduler.prefix_cache_hits == hits
    assert core.scheduler.prefix_cache_queries == queries
    np.testing.assert_allclose(got["mean"], expected(IDS, "mean", False), atol=TOL)


def test_preempted_mean_pooling_counts_each_position_once() -> None:
    # 16 blocks of 4: a generation growing to 58 tokens (15 blocks) beside a
    # 52-token embedding (13 blocks) preempts the embedding, of lower
    # priority, mid-prefill; it is recomputed after
    core = EngineCore(
        EngineConfig(model="tiny-random", **{**SMALL, "num_blocks": 16})  # type: ignore[arg-type]
    )
    ids = (IDS * 3)[:52]
    core.add_request(
        CoreRequest(
            request_id="gen",
            prompt_token_ids=tuple(IDS[:8]),
            params=SamplingParams(max_tokens=50, ignore_eos=True),
        )
    )
    request = pooling_request("mean", ids, Pooling("mean", False))
    core.add_request(msgspec.structs.replace(request, priority=1))
    got = None
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            if o.embedding is not None:
                got = np.frombuffer(o.embedding, "<f4")
    assert core.scheduler.total_preemptions > 0
    np.testing.assert_allclose(got, expected(ids, "mean", False), atol=TOL)
    assert core.pool.num_used == 0


# -- the checkpoint's pooling --------------------------------------------------------


def write_sentence_transformers(
    directory: Path, modes: dict[str, bool], normalize: bool
) -> None:
    modules = [
        {
            "idx": 0,
            "name": "0",
            "path": "",
            "type": "sentence_transformers.models.Transformer",
        },
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    config = {
        "word_embedding_dimension": 64,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False,
        "pooling_mode_lasttoken": False,
        **{f"pooling_mode_{k}": v for k, v in modes.items()},
        "include_prompt": True,
    }
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(config))


def test_read_pooling_config(tmp_path: Path) -> None:
    assert read_pooling_config(None) == PoolingConfig("last", True)
    assert read_pooling_config(tmp_path) == PoolingConfig("last", True)
    write_sentence_transformers(tmp_path, {"mean_tokens": True}, normalize=True)
    c = read_pooling_config(tmp_path)
    assert (c.method, c.normalize, c.unsupported) == ("mean", True, None)
    write_sentence_transformers(tmp_path, {"lasttoken": True}, normalize=False)
    c = read_pooling_config(tmp_path)
    assert (c.method, c.normalize, c.unsupported) == ("last", False, None)
    write_sentence_transformers(tmp_path, {"cls_token": True}, normalize=True)
    c = read_pooling_config(tmp_path)
    assert c.unsupported is not None and "cls_token" in c.unsupported
    # a request that relies on it is refused naming pooling; one that names
    # a method is served
    with pytest.raises(InvalidRequestError) as refused:
        c.resolve(Pooling(), 64)
    assert refused.value.field == "pooling" and "1_Pooling" in str(refused.value)
    assert c.resolve(Pooling("mean"), 64) == Pooling("mean", True, None)
    # a projection after the pooling is not run: the default is refused
    write_sentence_transformers(tmp_path, {"mean_tokens": True}, normalize=False)
    modules = json.loads((tmp_path / "modules.json").read_text())
    dense = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}  # fmt: skip
    (tmp_path / "modules.json").write_text(json.dumps([*modules, dense]))
    c = read_pooling_config(tmp_path)
    assert c.method == "mean" and c.unsupported is not None and "Dense" in c.unsupported
    # a broken file does not stop the checkpoint from loading for generation
    (tmp_path / "modules.json").write_text("{not json")
    c = read_pooling_config(tmp_path)
    assert c.unsupported is not None and "modules.json" in c.unsupported


@pytest.mark.parametrize(
    ("pooling_type", "method", "unsupported"),
    [(None, "last", False), (1, "mean", False), (3, "last", False), (2, "last", True)],
)
def test_read_pooling_config_of_a_gguf_file(
    tmp_path: Path, pooling_type: int | None, method: str, unsupported: bool
) -> None:
    # llama.cpp's {arch}.pooling_type: 1 mean, 2 CLS (not computed), 3 last
    from tests.gguf_bytes import INT32, STRING, build, kv

    kvs = [kv("general.architecture", STRING, "llama")]
    if pooling_type is not None:
        kvs.append(kv("llama.pooling_type", INT32, pooling_type))
    path = tmp_path / "m.gguf"
    path.write_bytes(build(kvs).data)
    c = read_pooling_config(path)
    assert (c.method, c.normalize) == (method, True)
    assert (c.unsupported is not None) == unsupported


def test_llm_embed_follows_the_checkpoint(tmp_path: Path) -> None:
    make_tiny_model(tmp_path, arch="qwen3", seed=4, max_position_embeddings=128)
    write_sentence_transformers(tmp_path, {"mean_tokens": True}, normalize=True)
    config = ModelConfig.from_path(tmp_path)
    weights = {
        k: v for f in tmp_path.glob("*.safetensors") for k, v in load_file(f).items()
    }
    llm = LLM(str(tmp_path), show_progress=False, **SMALL)  # type: ignore[arg-type]
    ids = [(5 * i + 2) % 500 for i in range(13)]
    h = reference_hidden(config, weights, ids)
    (default,) = llm.embed([ids], use_tqdm=False)  # a list of ids is one prompt
    mean = h.mean(axis=0)
    np.testing.assert_allclose(default.embedding, mean / np.linalg.norm(mean), atol=TOL)
    (last,) = llm.embed(ids, pooling="last", normalize=False, use_tqdm=False)
    np.testing.assert_allclose(last.embedding, h[-1], atol=TOL)
    assert default.num_prompt_tokens == 13 and default.finish_reason == "stop"


# -- LLM and AsyncLLM ---------------------------------------------------------------


def test_llm_embed_batch_equals_one_at_a_time() -> None:
    llm = LLM("tiny-random", show_progress=False, **SMALL)  # type: ignore[arg-type]
    prompts: list[str | list[int]] = [
        "Hello there, world",
        IDS,
        "x",
        {"prompt_token_ids": IDS[:5]},
    ]  # type: ignore[list-item]
    batch = llm.embed(prompts, pooling="mean", use_tqdm=False)
    for prompt, out in zip(prompts, batch, strict=True):
        (alone,) = llm.embed([prompt], pooling="mean", use_tqdm=False)
        assert out.prompt_token_ids == alone.prompt_token_ids
        np.testing.assert_allclose(out.embedding, alone.embedding, atol=1e-5)
        assert abs(float(np.linalg.norm(out.embedding)) - 1) < 1e-5
    np.testing.assert_allclose(
        batch[1].embedding, expected(IDS, "mean", True), atol=TOL
    )
    assert batch[0].prompt == "Hello there, world" and batch[1].prompt is None
    assert llm.core.pool.num_used == 0
    with pytest.raises(InvalidRequestError) as bad:
        llm.embed("x", pooling="max")  # type: ignore[arg-type]
    assert bad.value.field == "pooling"
    with pytest.raises(InvalidRequestError) as bad:
        llm.embed("x", dimensions=0)
    assert bad.value.field == "dimensions"


async def in_core(llm: AsyncLLM, request_id: str | None = None) -> None:
    """Return once the core holds ``request_id`` (None: any request) and KV
    blocks for it (asked of the core itself: the statistics snapshot may be
    a step old)."""
    while True:
        state = await core_state(llm)
        ids = user_ids(state)
        if (request_id in ids if request_id else ids) and state.blocks_used > 0:
            return


@pytest.mark.anyio
async def test_async_embed_and_cancellation() -> None:
    kw = {
        "executor": "inline",
        "show_progress": False,
        **SMALL,
        "max_model_len": 2048,
        "num_blocks": 512,
    }
    async with AsyncLLM.open("tiny-random", **kw) as llm:
        out = await llm.embed(IDS, pooling="last", normalize=False)
        np.testing.assert_allclose(
            out.embedding, expected(IDS, "last", False), atol=TOL
        )
        assert out.embedding is not None and not out.embedding.flags.writeable
        with pytest.raises(InvalidRequestError) as bad:
            await llm.embed(IDS, normalize="yes")  # type: ignore[arg-type]
        assert bad.value.field == "normalize"

        # 250 steps of 8 tokens: long enough to be cut mid-prefill (each
        # its own, so none finds the one before in the prefix cache)
        def long(k: int) -> list[int]:
            return [(3 * i + k) % 250 + 1 for i in range(2000)]

        # the caller's scope cancelled mid-prefill
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(llm.embed, long(0), request_id="c"))
                await in_core(llm, "c")
                scope.cancel()
        assert scope.cancelled_caught
        await assert_core_holds_nothing(llm)

        # abort(request_id): it returns without an embedding
        result = []

        async def run() -> None:
            result.append(await llm.embed(long(1), request_id="e"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await in_core(llm, "e")
            await llm.abort("e")
        (aborted,) = result
        assert aborted.finish_reason == "abort" and aborted.embedding is None
        await assert_core_holds_nothing(llm)

        # a deadline that passes mid-prefill
        with anyio.move_on_after(0.05):
            await llm.embed(long(2))
        await assert_core_holds_nothing(llm)
        # and the engine serves on
        again = await llm.embed(IDS, pooling="last", normalize=False)
        np.testing.assert_allclose(
            again.embedding, expected(IDS, "last", False), atol=TOL
        )


def test_finish_embedding_eps() -> None:
    zero = finish_embedding(np.zeros(4, np.float32), Pooling("last", True))
    assert zero.dtype == np.float32 and not np.isnan(zero).any()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_pooling_crosses_the_core_process_wire() -> None:
    # CoreRequest.pooling out, RequestStepOutput.embedding back, as msgpack
    kw = {"executor": "process", "show_progress": False, **SMALL}
    async with AsyncLLM.open("tiny-random", **kw) as llm:
        out = await llm.embed(IDS, pooling="mean", normalize=True)
        np.testing.assert_allclose(out.embedding, expected(IDS, "mean", True), atol=TOL)
        await assert_core_holds_nothing(llm)
