"""The oneDNN backend's bounded shapes: padded rows, and arrays it lets go."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import numpy as np
import pytest

from structllm.config import EngineConfig
from structllm.core.engine_core import EngineCore
from structllm.core.request import CoreRequest
from structllm.model.compiled import BUCKETS, SMALL_STEP, step_bucket
from structllm.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def test_step_sizes_fall_in_few_buckets_with_bounded_padding() -> None:
    assert list(BUCKETS) == sorted(set(BUCKETS)) and BUCKETS[0] == SMALL_STEP
    assert step_bucket(SMALL_STEP + 1) == SMALL_STEP + 2
    for limit, most in ((64, 21), (1024, 42), (2048, 48), (8192, 60)):
        used = {step_bucket(n) for n in range(SMALL_STEP, limit + 1)}
        assert len(used) <= most, limit
    for n in range(SMALL_STEP, 20_000):
        b = step_bucket(n)
        assert b in BUCKETS and b >= n
        # even sizes to 32 rows, multiples of 4 to 64, then ~2^(1/6) steps:
        # 21% at most (73 rows), 13.1% from 512 rows on
        if n <= 64:
            assert b - n < (2 if n <= 32 else 4)
        else:
            assert b <= n * (1.21 if n < 512 else 1.131)


def _core(backend: str) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model="tiny-random",
            model_backend=backend,
            num_blocks=64,
            max_model_len=256,
            max_num_seqs=8,
        )
    )


def _run(core: EngineCore, sizes: list[int]) -> dict[str, list[int]]:
    """Greedy tokens of prompts of ``sizes`` tokens, added together."""
    rng = np.random.default_rng([7, *sizes])  # no prefix shared across calls
    for i, n in enumerate(sizes):
        prompt = tuple(rng.integers(0, 256, size=n).tolist())
        core.add_request(
            CoreRequest(request_id=str(i), prompt_token_ids=prompt, params=GREEDY)
        )
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(sizes))}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens[out.request_id] += out.new_token_ids
    return tokens


class _Spy:
    """Wraps a predictor; records the rows of each input ``x`` it is fed."""

    def __init__(self, predictor: Any, rows: list[int]) -> None:
        self._predictor, self._rows = predictor, rows

    def __call__(self, feeds: Any) -> Any:
        self._rows.append(int(feeds["x"].shape[0]))
        return self._predictor(feeds)

    def run(self, feeds: Any) -> Any:
        self._rows.append(int(feeds["x"].shape[0]))
        return self._predictor.run(feeds)


def test_many_step_sizes_reach_the_predictors_as_buckets_with_eager_tokens() -> None:
    core = _core("inference")
    model = core.runner.model
    rows: list[int] = []
    model._first = _Spy(model._first, rows)
    model._head = _Spy(model._head, rows)
    # prefills of 65-191 tokens alone; prompts together; 2-3 sequence decodes
    batches = [[n] for n in range(65, 200, 9)] + [[9, 30, 47], [11, 13], [70, 33, 5]]
    compiled = [_run(core, sizes) for sizes in batches]
    eager_core = _core("eager")
    assert compiled == [_run(eager_core, sizes) for sizes in batches]
    assert set(rows) <= set(BUCKETS)
    # 15 prefills of distinct sizes alone ran as 8 buckets (72-208); the
    # batches' prefill steps (86 and 108 tokens) fell in two of them
    assert {r for r in rows if r > 64} == {72, 88, 104, 120, 136, 160, 184, 208}


def test_padded_logits_rows_are_the_real_rows_logits() -> None:
    from structllm.model._paddle import paddle

    model = _core("inference").runner.model
    rng = np.random.default_rng(3)
    hidden = rng.standard_normal((21, model.config.hidden_size)).astype(np.float32)
    logits = model.compute_logits(paddle.to_tensor(hidden)).numpy()
    assert logits.shape == (21, model.config.vocab_size)
    # each row alone (eager below SMALL_STEP)
    for r in (0, 13, 20):
        alone = model.compute_logits(paddle.to_tensor(hidden[r : r + 1])).numpy()
        np.testing.assert_allclose(logits[r], alone[0], rtol=1e-4, atol=1e-4)


class _Tracked(np.ndarray):
    """An ndarray that can be weakly referenced."""


@pytest.mark.parametrize("warm", [False, True])
def test_steps_let_go_of_every_predictor_output(warm: bool) -> None:
    # Paddle 3.3.1 never freed q when the outputs were host_tensor views of
    # copy_to_cpu's arrays: the attention imports q into Paddle a second time
    core = _core("inference")
    model = core.runner.model
    if warm:
        assert model.warm_up(64) == 21  # 8, 10, ..., 32, 36, ..., 64
    alive: list[weakref.ref[np.ndarray]] = []
    for predictor in [model._first, *model._mid, model._last]:
        outputs = predictor._outputs

        class Tracking:
            def __init__(self, handle: Any) -> None:
                self._handle = handle

            def copy_to_cpu(self) -> np.ndarray:
                array = self._handle.copy_to_cpu().view(_Tracked)
                alive.append(weakref.ref(array))
                return array

        predictor._outputs = [Tracking(h) for h in outputs]
    _run(core, [9, 40, 17, 23])
    gc.collect()
    assert alive, "the prefills should run the predictors"
    assert [r for r in alive if r() is not None] == []
