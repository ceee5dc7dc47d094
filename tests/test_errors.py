"""One error tree; the same mistake raises the same type from LLM and AsyncLLM."""

from __future__ import annotations

from typing import Any

import pytest

from structllm import LLM, AsyncLLM, FrontendConfig, ServerConfig, StructLLMError
from structllm.core.block_pool import NoFreeBlocksError as PoolNoFreeBlocksError
from structllm.errors import (
    EngineConfigError,
    EngineCoreError,
    EngineDeadError,
    ModelLoadError,
    NoFreeBlocksError,
    unwrap_group,
)

BAD_SETTINGS = [
    pytest.param({"max_model_len": 256, "num_blocks": 4}, "num_blocks", id="kv"),
    pytest.param({"max_model_len": 10**7}, "max_model_len", id="context"),
    pytest.param({"max_num_seqs": 0}, "max_num_seqs", id="max_num_seqs"),
    pytest.param({"block_size": 0}, "block_size", id="block_size"),
    pytest.param({"kv_cache_memory": 0}, "kv_cache_memory", id="kv_cache_memory"),
    pytest.param({"max_model_len": 1}, "max_model_len", id="max_model_len"),
    pytest.param({"dtype": "fp8"}, "dtype", id="dtype"),
    pytest.param({"kv_cache_dtype": "fp8"}, "kv_cache_dtype", id="kv_cache_dtype"),
    pytest.param({"max_num_batched_tokens": "8"}, "max_num_batched_tokens", id="type"),
]


def test_the_tree() -> None:
    for cls in (EngineConfigError, EngineCoreError, NoFreeBlocksError):
        assert issubclass(cls, StructLLMError)
    assert issubclass(EngineConfigError, ValueError)
    assert issubclass(EngineCoreError, RuntimeError)
    assert issubclass(NoFreeBlocksError, RuntimeError)
    assert PoolNoFreeBlocksError is NoFreeBlocksError
    assert not issubclass(EngineConfigError, ModelLoadError | EngineDeadError)
    err = EngineCoreError("RuntimeError", "boom", "Traceback ...")
    assert err.kind == "RuntimeError" and "boom" in str(err)


@pytest.mark.parametrize(("settings", "field"), BAD_SETTINGS)
def test_llm_refuses_a_setting_that_cannot_work(
    settings: dict[str, Any], field: str | None
) -> None:
    with pytest.raises(EngineConfigError) as info:
        LLM("tiny-random", show_progress=False, **settings)
    assert info.value.field == field


@pytest.mark.anyio
@pytest.mark.parametrize("executor", ["inline", "process"])
@pytest.mark.parametrize(("settings", "field"), BAD_SETTINGS)
async def test_async_llm_refuses_it_with_the_same_error(
    executor: str, settings: dict[str, Any], field: str | None
) -> None:
    """Build-time refusals start no core; the rest come back from the core."""
    with pytest.raises(EngineConfigError) as info:
        async with AsyncLLM.open(
            "tiny-random", executor=executor, show_progress=False, **settings
        ):
            pytest.fail("open() should have failed")  # pragma: no cover
    assert info.value.field == field


@pytest.mark.parametrize(
    ("cls", "settings", "field"),
    [
        (FrontendConfig, {"heartbeat_interval": 0}, "heartbeat_interval"),
        (FrontendConfig, {"max_restarts": -1}, "max_restarts"),
        (FrontendConfig, {"executor": "cloud"}, "executor"),
        (ServerConfig, {"port": 70000}, "port"),
        (ServerConfig, {"backlog": 0}, "backlog"),
        (ServerConfig, {"max_concurrent_requests": 0}, "max_concurrent_requests"),
        (ServerConfig, {"max_log_len": -1}, "max_log_len"),
        (ServerConfig, {"body_timeout": 0}, "body_timeout"),
        (ServerConfig, {"allowed_origins": ["*"]}, "allowed_origins"),
        (ServerConfig, {"api_key": ("a key",)}, "api_key"),
    ],
)
def test_every_config_refuses_a_bad_value_naming_the_field(
    cls: type, settings: dict[str, Any], field: str
) -> None:
    extra = {"model_name": "m"} if cls is ServerConfig else {}
    with pytest.raises(EngineConfigError) as info:
        cls(**extra, **settings)
    assert info.value.field == field
    assert field in str(info.value)


def test_a_small_backlog_is_allowed_and_the_help_promises_no_minimum() -> None:
    import attrs

    assert ServerConfig(model_name="m", backlog=5).backlog == 5
    assert ">=" not in attrs.fields(ServerConfig).backlog.metadata["help"]


@pytest.mark.anyio
async def test_an_unknown_executor_is_a_config_error() -> None:
    with pytest.raises(EngineConfigError) as info:
        async with AsyncLLM.open("tiny-random", executor="cloud", show_progress=False):
            pytest.fail("open() should have failed")  # pragma: no cover
    assert info.value.field == "executor"


def test_the_drawing_in_the_docstring_lists_every_error() -> None:
    import re

    import structllm.errors as errors

    drawn = set(re.findall(r"[├└]── (\w+)", errors.__doc__ or "")) | {"StructLLMError"}
    defined = {
        name
        for name, obj in vars(errors).items()
        if isinstance(obj, type) and issubclass(obj, StructLLMError)
    }
    exported = {n for n in errors.__all__ if isinstance(getattr(errors, n), type)}
    assert drawn == defined == exported | {"StructLLMError"}


def test_the_engine_guide_draws_the_same_tree() -> None:
    import re
    from pathlib import Path

    import structllm.errors as errors

    guide = (Path(__file__).parent.parent / "docs" / "engine.md").read_text()
    drawn = set(re.findall(r"[├└]── (\w+)", guide))
    assert drawn == set(re.findall(r"[├└]── (\w+)", errors.__doc__ or ""))


def test_unwrap_group_finds_the_error_a_group_stands_for() -> None:
    a, b = ValueError("a"), KeyError("b")
    nested = ExceptionGroup("outer", [ExceptionGroup("inner", [a, b]), b])
    assert unwrap_group(nested) is a  # the first leaf
    assert unwrap_group(a) is a  # no group: itself
    assert unwrap_group(ExceptionGroup("one", [a]), sole=True) is a
    several = ExceptionGroup("two", [a, b])
    assert unwrap_group(several, sole=True) is several  # several stay a group
    base = BaseExceptionGroup("base", [KeyboardInterrupt()])
    assert unwrap_group(base, sole=True) is base  # only an Exception unwraps
