"""The oneDNN model backend (Paddle Inference predictors) against eager Paddle."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from structllm.config import EngineConfig
from structllm.core.engine_core import EngineCore
from structllm.core.request import CoreRequest
from structllm.errors import ModelLoadError
from structllm.model.config import tiny_random_config
from structllm.model.loader import AUTO_INFERENCE_MIN_PARAMETERS, resolve_backend
from structllm.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _tokens(backend: str) -> tuple[dict[str, list[int]], type]:
    core = EngineCore(
        EngineConfig(
            model="tiny-random",
            model_backend=backend,
            num_blocks=12,
            max_model_len=128,
            max_num_batched_tokens=24,
        )
    )
    rng = np.random.default_rng(4)
    for i, n in enumerate([1, 9, 30, 47, 70]):
        prompt = tuple(rng.integers(0, 256, size=n).tolist())
        core.add_request(
            CoreRequest(request_id=str(i), prompt_token_ids=prompt, params=GREEDY)
        )
    tokens: dict[str, list[int]] = {str(i): [] for i in range(5)}
    preempted = 0
    while core.has_unfinished_requests():
        step = core.step()
        preempted += len(step.preempted)
        for out in step.outputs:
            tokens[out.request_id] += out.new_token_ids
    assert preempted, "the 12-block pool should preempt"
    return tokens, type(core.runner.model)


def test_inference_backend_gives_the_eager_tokens() -> None:
    # chunked prefills, decodes batched with them, and preemption
    eager, eager_cls = _tokens("eager")
    compiled, compiled_cls = _tokens("inference")
    assert compiled_cls.__name__ == "CompiledLlamaForCausalLM"
    assert eager_cls.__name__ == "LlamaForCausalLM"
    assert compiled == eager


@pytest.mark.parametrize(
    ("vendor", "big_model"),
    [("AuthenticAMD", "inference"), ("", "inference"), ("GenuineIntel", "eager")],
)
def test_auto_picks_by_size_and_cpu_and_bad_names_are_refused(
    monkeypatch: pytest.MonkeyPatch, vendor: str, big_model: str
) -> None:
    # without the compiled kernels (numba) eager projections are Paddle's
    # matmul, Intel MKL, fast on Intel CPUs only
    monkeypatch.setattr("structllm.model.loader.cpu_vendor", lambda: vendor)
    monkeypatch.setattr("structllm.model.kernels.available", lambda: False)
    small = tiny_random_config()
    big = attrs.evolve(
        small, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8
    )
    assert small.num_parameters < AUTO_INFERENCE_MIN_PARAMETERS <= big.num_parameters
    assert resolve_backend("auto", "float32", small) == "eager"
    assert resolve_backend("auto", "float32", big) == big_model
    assert resolve_backend("eager", "float32", big) == "eager"
    assert resolve_backend("inference", "float32", small) == "inference"
    with pytest.raises(ModelLoadError, match="model_backend"):
        resolve_backend("onnx", "float32", small)
    # with them, eager projections are the packed panels': eager everywhere
    monkeypatch.setattr("structllm.model.kernels.available", lambda: True)
    assert resolve_backend("auto", "float32", big) == "eager"


def test_cpu_vendor_reads_this_machine() -> None:
    from structllm.model._paddle import cpu_vendor

    with open("/proc/cpuinfo") as f:
        ids = {ln.split(":")[1].strip() for ln in f if ln.startswith("vendor_id")}
    assert cpu_vendor() in (ids or {""})  # no vendor_id line on ARM


def test_small_steps_run_eager_and_large_ones_through_the_predictors() -> None:
    from structllm.model.compiled import SMALL_STEP

    core = EngineCore(EngineConfig(model="tiny-random", model_backend="inference"))
    model = core.runner.model
    calls: list[int] = []
    original = model._first

    def spy(feeds):  # type: ignore[no-untyped-def]
        calls.append(int(feeds["x"].shape[0]))
        return original(feeds)

    model._first = spy
    prompt = tuple(range(3, 3 + 2 * SMALL_STEP))
    core.add_request(
        CoreRequest(request_id="a", prompt_token_ids=prompt, params=GREEDY)
    )
    while core.has_unfinished_requests():
        core.step()
    # the prefill went through the predictors; the batch-1 decodes did not
    assert calls == [len(prompt)]
