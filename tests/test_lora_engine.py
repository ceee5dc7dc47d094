"""LoRA through the engine: ``LLM(enable_lora=True)`` and ``lora_request=``.

The base is tests/data/lora/llama-base (2 layers, vocab 128) with its three
PEFT adapters; prompts are token ids (the tokenizer only detokenises).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from structllm import LLM, InvalidRequestError, LoRARequest, SamplingParams
from structllm.model.lora_peft import WEIGHTS_FILE
from tests.test_lora_core import _random_copy

DATA = Path(__file__).parent / "data" / "lora"
ADAPTERS = ["llama-qv-r4", "llama-all-r8", "llama-kogd-r8-rslora"]
LORAS = [LoRARequest(n, i + 1, str(DATA / n)) for i, n in enumerate(ADAPTERS)]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _llm(bpe_dir: Path, **engine: Any) -> LLM:
    args: dict[str, Any] = {
        "enable_lora": True,
        "max_loras": 4,
        "max_lora_rank": 8,
        "block_size": 4,
        "num_blocks": 128,
        "max_num_seqs": 8,
        **engine,
    }
    return LLM(
        str(DATA / "llama-base"), tokenizer=str(bpe_dir), show_progress=False, **args
    )


def _open_async(bpe_dir: Path, **engine: Any) -> Any:
    """``AsyncLLM.open`` on the base checkpoint with two adapter slots."""
    from structllm import AsyncLLM

    return AsyncLLM.open(
        str(DATA / "llama-base"),
        tokenizer=str(bpe_dir),
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        block_size=4,
        show_progress=False,
        **engine,
    )


def _prompts(n: int, length: int = 11) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(3, 128, size=length + i).tolist() for i in range(n)]


def _tokens(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    from structllm.text import write_byte_level_bpe_tokenizer

    directory = tmp_path_factory.mktemp("bpe")
    write_byte_level_bpe_tokenizer(directory)
    yield _llm(directory)


@pytest.mark.parametrize("max_loras", [4, 2])
def test_a_batch_mixing_three_adapters_and_the_base_equals_each_alone(
    llm: LLM, max_loras: int, bpe_dir: Path
) -> None:
    engine = llm if max_loras == 4 else _llm(bpe_dir, max_loras=max_loras)
    choices: list[LoRARequest | None] = [*LORAS, None]
    prompts = _prompts(4)
    alone = [
        _tokens(engine.generate([p], GREEDY, lora_request=c, use_tqdm=False))[0]
        for p, c in zip(prompts, choices, strict=True)
    ]
    # the same prompt under each adapter: they are told apart (tokens of a
    # tiny random model often agree; the logprobs do not)
    scored = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0)
    under_each = engine.generate(
        [prompts[0]] * 4, scored, lora_request=choices, use_tqdm=False
    )
    firsts = [(o.outputs[0].logprobs or ())[0] for o in under_each]
    values = {round(next(iter(lp.values())).logprob, 5) for lp in firsts}
    assert len(values) == 4
    engine.reset_prefix_cache()
    mixed = engine.generate(prompts, GREEDY, lora_request=choices, use_tqdm=False)
    assert _tokens(mixed) == alone
    # with 2 slots, 3 adapters took turns: each request ran with its own
    assert engine.core.lora is not None
    engine.core.lora.audit()
    assert all(i.users == 0 for i in engine.core.lora.adapters())
    # max_cpu_loras is max_loras: with 2, the host forgot the idlest one
    assert len(engine.core.lora.adapters()) == min(3, max_loras)
    assert engine.core.pool.num_used == 0


def test_the_prefix_cache_never_hits_across_adapters(llm: LLM) -> None:
    llm.reset_prefix_cache()
    prompt = _prompts(1, length=17)[0]  # 4 full blocks of 4
    params = SamplingParams(max_tokens=2, temperature=0.0)

    def cached(lora: LoRARequest | None) -> int | None:
        [out] = llm.generate([prompt], params, lora_request=lora, use_tqdm=False)
        return out.num_cached_tokens

    assert cached(LORAS[0]) == 0
    assert cached(LORAS[1]) == 0  # the same tokens, another adapter
    assert cached(None) == 0  # ... or none
    assert cached(LORAS[0]) == 16  # its own blocks are found
    assert cached(None) == 16
    # the same weights under another id share the blocks: the key is the weights
    twin = LoRARequest("twin", 9, LORAS[1].lora_path + "/")
    assert cached(twin) == 16


def test_unloading_lets_a_running_stream_finish(llm: LLM, tmp_path: Path) -> None:
    path = _random_copy(tmp_path, "llama-all-r8", 5)
    lora = LoRARequest("short-lived", 20, str(path))
    prompt = _prompts(1)[0]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    [whole] = llm.generate([prompt], params, lora_request=lora, use_tqdm=False)
    assert llm.remove_lora(20)
    assert 20 not in llm.list_loras()
    assert llm.core.lora is not None
    assert lora not in [i.request for i in llm.core.lora.adapters()]
    # loaded again by the request that names it; unloaded mid-stream
    stream = llm.stream(prompt, params, lora_request=lora)
    first = next(stream)
    assert llm.remove_lora(20)
    assert not llm.remove_lora(20)  # being unloaded already
    [info] = [i for i in llm.core.lora.adapters() if i.request == lora]
    assert info.unloading and info.slot is not None and info.users == 1
    # another request may not reuse the id for other weights meanwhile
    other = LoRARequest("other", 20, str(DATA / "llama-qv-r4"))
    with pytest.raises(InvalidRequestError, match="being unloaded") as e:
        llm.generate([prompt], params, lora_request=other, use_tqdm=False)
    assert e.value.field == "lora_request"
    outs = [first, *stream]
    assert outs[-1].finished
    assert list(outs[-1].outputs[0].token_ids) == list(whole.outputs[0].token_ids)
    # its last user gone, so is the adapter, its slot cleared
    assert lora not in [i.request for i in llm.core.lora.adapters()]
    held = llm.core.lora.slots.adapters  # type: ignore[attr-defined]
    assert held[info.slot] is None
    llm.core.lora.audit()
    assert llm.core.pool.num_used == 0


def test_bad_adapters_fail_their_request_and_the_engine_serves_on(
    llm: LLM, tmp_path: Path, bpe_dir: Path
) -> None:
    broken = _random_copy(tmp_path, "llama-qv-r4", 1)
    data = (broken / WEIGHTS_FILE).read_bytes()
    (broken / WEIGHTS_FILE).write_bytes(data[: len(data) // 2])
    prompt = _prompts(1)[0]
    bad = LoRARequest("broken", 30, str(broken))
    with pytest.raises(InvalidRequestError, match=WEIGHTS_FILE) as e:
        llm.generate([prompt], GREEDY, lora_request=bad, use_tqdm=False)
    assert e.value.field == "lora_request"
    with pytest.raises(InvalidRequestError, match="1 LoRA requests for 2") as e:
        llm.generate([prompt] * 2, GREEDY, lora_request=[None], use_tqdm=False)
    assert e.value.field == "lora_request"
    [out] = llm.generate([prompt], GREEDY, lora_request=LORAS[0], use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 8
    assert llm.core.lora is not None
    assert 30 not in [i.request.lora_int_id for i in llm.core.lora.adapters()]
    # an engine without LoRA refuses the request by name
    plain = _llm(bpe_dir, enable_lora=False)
    with pytest.raises(InvalidRequestError, match="LoRA is not enabled") as e:
        plain.generate([prompt], GREEDY, lora_request=LORAS[0], use_tqdm=False)
    assert e.value.field == "lora_request"


@pytest.mark.anyio
async def test_async_llm_over_the_core_process(bpe_dir: Path, tmp_path: Path) -> None:
    from structllm import ModelLoadError

    prompt = _prompts(1)[0]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    async with _open_async(
        bpe_dir,
        num_blocks=64,
    ) as llm:
        assert await llm.add_lora(LORAS[1])
        assert not await llm.add_lora(LORAS[1])
        bad = _random_copy(tmp_path, "llama-qv-r4", 2)
        (bad / WEIGHTS_FILE).write_bytes(b"not safetensors")
        with pytest.raises(ModelLoadError, match=WEIGHTS_FILE):
            await llm.add_lora(LoRARequest("bad", 7, str(bad)))
        base = await llm.complete(prompt, params)
        whole = await llm.complete(prompt, params, lora_request=LORAS[1])
        gen = [o async for o in llm.generate(prompt, params, lora_request=LORAS[0])]
        assert gen[-1].finished
        # unloaded mid-stream: the stream finishes with its adapter
        async with llm.stream(prompt, params, lora_request=LORAS[1]) as stream:
            outs = [await stream.__anext__()]
            assert await llm.remove_lora(LORAS[1].lora_int_id)
            outs += [o async for o in stream]
        assert outs[-1].outputs[0].token_ids == whole.outputs[0].token_ids
        assert whole.outputs[0].token_ids != base.outputs[0].token_ids or (
            gen[-1].outputs[0].token_ids != base.outputs[0].token_ids
        )
        assert not await llm.remove_lora(LORAS[1].lora_int_id)
        [state] = await llm.inspect_cores()
        assert state is not None and state.request_ids == [] and state.blocks_used == 0


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_every_data_parallel_replica_gets_the_adapter(bpe_dir: Path) -> None:

    prompts = _prompts(4)
    async with _open_async(
        bpe_dir,
        num_blocks=64,
        data_parallel_size=2,
    ) as llm:
        assert await llm.add_lora(LORAS[0])
        assert not await llm.add_lora(LORAS[0])  # both replicas know it
        outs = [await llm.complete(p, GREEDY, lora_request=LORAS[0]) for p in prompts]
        again = [await llm.complete(p, GREEDY, lora_request=LORAS[0]) for p in prompts]
        assert [o.outputs[0].token_ids for o in outs] == [
            o.outputs[0].token_ids for o in again
        ]
        assert await llm.remove_lora(LORAS[0].lora_int_id)
        assert not await llm.remove_lora(LORAS[0].lora_int_id)
        states = await llm.inspect_cores()
        assert all(s is not None and s.blocks_used == 0 for s in states)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_adapters_work_again_after_the_core_restarts(bpe_dir: Path) -> None:
    """The core is killed while LoRA requests stream: they fail with
    EngineDeadError, and the restarted core, which knows no adapter, reads
    each again from the LoRARequest its next request carries, whether it
    was loaded by ``add_lora`` (the server's registry) or only named."""
    import anyio

    from structllm import EngineDeadError
    from structllm.server.lora.registry import LoRARegistry

    prompts = _prompts(3)
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    async with _open_async(
        bpe_dir,
        num_blocks=128,
        max_restarts=2,
    ) as llm:
        registry = LoRARegistry("base")
        loaded = await registry.load(llm, "all", LORAS[1].lora_path)
        only_named = LoRARequest(
            "qv", 10, LORAS[0].lora_path
        )  # the registry's are 1...
        named: list[LoRARequest | None] = [loaded, only_named, None]

        async def run() -> list[list[int]]:
            return [
                list(
                    (await llm.complete(p, GREEDY, lora_request=c)).outputs[0].token_ids
                )
                for p, c in zip(prompts, named, strict=True)
            ]

        before = await run()
        pid = llm.statistics().core_pid
        assert pid is not None
        died: list[EngineDeadError] = []

        async def stream(prompt: list[int], lora: LoRARequest | None) -> None:
            with pytest.raises(EngineDeadError) as e:
                async with llm.stream(prompt, long, lora_request=lora) as s:
                    async for _ in s:
                        pass
            died.append(e.value)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for p, c in zip(prompts, named, strict=True):
                    tg.start_soon(stream, p, c)
                await llm.wait_statistics(lambda s: s.running == 3)
                os.kill(pid, signal.SIGKILL)
        assert len(died) == 3
        with anyio.fail_after(60):
            after = await run()  # waits for the restart
        assert after == before
        stats = llm.statistics()
        assert stats.restarts == 1 and stats.core_pid != pid
        # the new core knows both adapters now, from the requests alone
        assert not await llm.add_lora(loaded)
        assert not await llm.add_lora(only_named)
        await registry.unload(llm, "all")
        [state] = await llm.inspect_cores()
        assert state is not None and state.request_ids == [] and state.blocks_used == 0
