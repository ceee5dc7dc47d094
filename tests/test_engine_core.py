"""EngineCore with the real tiny model: batching never changes the tokens."""

from __future__ import annotations

import numpy as np
import pytest

from structllm.config import EngineConfig
from structllm.core.engine_core import EngineCore
from structllm.core.request import CoreRequest
from structllm.errors import InvalidRequestError
from structllm.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompts(n: int, seed: int = 0) -> list[tuple[int, ...]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 90, size=n)
    return [tuple(rng.integers(0, 256, size=int(k)).tolist()) for k in lengths]


def _run(core: EngineCore, prompts, params) -> dict[str, list[int]]:
    plist = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, plist, strict=True)):
        core.add_request(CoreRequest(request_id=f"r{i}", prompt_token_ids=p, params=sp))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens[out.request_id] += out.new_token_ids
    stats = core.statistics().scheduler
    assert stats.blocks.num_free == stats.blocks.num_blocks
    return tokens


_SOLO: list[EngineCore] = []


def _alone(prompt, params=GREEDY) -> list[int]:
    """Tokens for ``prompt`` run by itself (one shared core, one at a time)."""
    if not _SOLO:
        _SOLO.append(
            EngineCore(
                EngineConfig(model="tiny-random", max_model_len=256, num_blocks=32)
            )
        )
    return _run(_SOLO[0], [prompt], params)["r0"]


def _top2_gap(prompt: tuple[int, ...], generated: list[int], k: int) -> float:
    """Gap between the best two logits where a batched run chose token ``k``."""
    from structllm.model._paddle import paddle
    from structllm.model.attention import SequenceSlice
    from structllm.model.loader import load_model

    model = load_model("tiny-random", block_size=16).model
    ids = list(prompt) + generated[:k]
    caches = model.allocate_kv_cache(len(ids) // 16 + 1)
    meta = model.attention.build_metadata(
        [SequenceSlice(0, len(ids), list(range(len(ids) // 16 + 1)))]
    )
    hidden = model.forward(
        paddle.to_tensor(np.array(ids)),
        paddle.to_tensor(np.arange(len(ids))),
        caches,
        meta,
    )
    logits = np.sort(model.compute_logits(hidden).numpy()[-1])
    return float(logits[-1] - logits[-2])


def _assert_same_or_near_tie(prompts, batched, alone) -> None:
    for i, p in enumerate(prompts):
        a, b = batched[f"r{i}"], alone[i]
        if a != b:
            k = next(j for j in range(len(a)) if a[j] != b[j])
            # a flip is only acceptable where the model itself can't decide
            assert _top2_gap(p, b, k) < 1e-4, f"prompt {i} diverged at token {k}"


def test_batched_greedy_equals_alone() -> None:
    prompts = _prompts(32)
    core = EngineCore(
        EngineConfig(
            model="tiny-random", max_model_len=256, max_num_seqs=32, num_blocks=256
        )
    )
    batched = _run(core, prompts, GREEDY)
    _assert_same_or_near_tie(prompts, batched, [_alone(p) for p in prompts])
    assert core.statistics().scheduler.total_preemptions == 0


def test_preemption_keeps_tokens() -> None:
    prompts = _prompts(32)
    # 16 blocks of 16 tokens: a fraction of what 32 requests need at once
    core = EngineCore(
        EngineConfig(
            model="tiny-random",
            max_model_len=256,
            max_num_seqs=32,
            num_blocks=16,
            max_num_batched_tokens=64,
        )
    )
    batched = _run(core, prompts, GREEDY)
    assert core.statistics().scheduler.total_preemptions > 0
    _assert_same_or_near_tie(prompts, batched, [_alone(p) for p in prompts])


def test_seeded_sampling_is_batch_independent() -> None:
    prompts = _prompts(12, seed=1)
    params = [
        SamplingParams(
            temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=16, ignore_eos=True
        )
        for i in range(len(prompts))
    ]
    core = EngineCore(
        EngineConfig(model="tiny-random", max_model_len=128, num_blocks=8)
    )
    batched = _run(core, prompts, params)
    assert core.statistics().scheduler.total_preemptions > 0
    for i, p in enumerate(prompts):
        assert batched[f"r{i}"] == _alone(p, params[i])


def test_prompt_length_boundaries() -> None:
    core = EngineCore(EngineConfig(model="tiny-random", max_model_len=64, num_blocks=8))
    core.add_request(
        CoreRequest(
            request_id="ok", prompt_token_ids=(1,) * 63, params=SamplingParams()
        )
    )
    with pytest.raises(
        InvalidRequestError, match="64 tokens; max_model_len is 64"
    ) as e:
        core.add_request(
            CoreRequest(
                request_id="long", prompt_token_ids=(1,) * 64, params=SamplingParams()
            )
        )
    assert e.value.field == "prompt"
    tokens = _run_existing(core)
    # one token of room: the request ends by length after exactly one token
    assert tokens == {"ok": 1}


def _run_existing(core: EngineCore) -> dict[str, int]:
    counts: dict[str, int] = {}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            counts[out.request_id] = counts.get(out.request_id, 0) + len(
                out.new_token_ids
            )
            if out.finish_reason is not None:
                assert out.finish_reason == "length"
    return counts


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ((), "must not be empty"),
        ((5, 258), "outside the vocabulary"),
        ((-1,), "outside"),
    ],
)
def test_bad_prompts_refused_without_side_effects(prompt, match) -> None:
    core = EngineCore(EngineConfig(model="tiny-random", max_model_len=64, num_blocks=8))
    with pytest.raises(InvalidRequestError, match=match):
        core.add_request(
            CoreRequest(request_id="x", prompt_token_ids=prompt, params=GREEDY)
        )
    assert not core.has_unfinished_requests()
    core.add_request(
        CoreRequest(request_id="x", prompt_token_ids=(1, 2), params=GREEDY)
    )
    assert core.has_unfinished_requests()


def test_duplicate_live_id_refused_then_reusable() -> None:
    core = EngineCore(EngineConfig(model="tiny-random", max_model_len=64, num_blocks=8))
    req = CoreRequest(request_id="a", prompt_token_ids=(1, 2, 3), params=GREEDY)
    core.add_request(req)
    with pytest.raises(InvalidRequestError, match="already in use") as e:
        core.add_request(req)
    assert e.value.field == "request_id"
    core.step()
    assert core.abort_requests(["a", "a", "unknown"]) == ["a"]
    assert core.statistics().scheduler.blocks.num_used == 0
    core.add_request(req)  # the id is free again


def test_kv_cache_too_small_for_max_model_len() -> None:
    with pytest.raises(ValueError, match="fewer than one sequence"):
        EngineCore(EngineConfig(model="tiny-random", max_model_len=256, num_blocks=4))


def test_step_timing_and_counts() -> None:
    core = EngineCore(EngineConfig(model="tiny-random", max_model_len=64, num_blocks=8))
    core.add_request(
        CoreRequest(request_id="a", prompt_token_ids=(1,) * 20, params=GREEDY)
    )
    step = core.step()
    assert step.num_batched_tokens == 20 and step.num_seqs == 1
    assert 0 < step.forward_s <= step.total_s
    assert [o.request_id for o in step.outputs] == ["a"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_16_bit_kv_cache_holds_twice_the_blocks_and_serves(dtype: str) -> None:
    memory = 1 << 20
    full, half = (
        EngineCore(
            EngineConfig(
                model="tiny-random",
                max_model_len=128,
                kv_cache_memory=memory,
                kv_cache_dtype=kv,
            )
        )
        for kv in ("auto", dtype)
    )
    blocks = [c.statistics().scheduler.blocks.num_blocks for c in (full, half)]
    assert blocks[1] == min(2 * blocks[0], half.scheduler.config.max_num_seqs * 8)
    assert half.runner.kv_caches[0][0].dtype.name == dtype.upper()
    prompts = _prompts(6, seed=3)
    tokens, exact = _run(half, prompts, GREEDY), _run(full, prompts, GREEDY)
    # the tokens of a float32 cache, but where the rounding tips a near tie
    # (measured, bfloat16: 142 of 144 tokens, every request's first 22); a
    # cache read wrongly gives other tokens from the second one on
    for rid, want in exact.items():
        got = tokens[rid]
        assert len(got) == GREEDY.max_tokens
        assert got[:16] == want[:16], rid
    same = sum(a == b for t in exact for a, b in zip(exact[t], tokens[t], strict=True))
    assert same >= 0.9 * 6 * GREEDY.max_tokens


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_16_bit_kv_cache_needs_the_kernels(dtype: str) -> None:
    from structllm.errors import EngineConfigError
    from structllm.model.loader import load_model

    model = load_model("tiny-random").model
    model.attention.use_kernels = False  # as without numba, or off the CPU
    with pytest.raises(EngineConfigError) as info:
        model.set_kv_cache_dtype(dtype)
    assert info.value.field == "kv_cache_dtype"
