"""structllm: an LLM inference engine for structured-concurrency programs.

The engine classes (``LLM``, ``AsyncLLM``, ...) are imported lazily, on first
use, so that importing a light layer (``structllm.params``, ``structllm.text``)
does not pull in Paddle or AnyIO.
"""

from typing import TYPE_CHECKING, Any

from structllm.config import EngineConfig, FrontendConfig, ServerConfig
from structllm.errors import (
    EngineConfigError,
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    ModelLoadError,
    RequestError,
    RequestFailedError,
    StructLLMError,
    UnsupportedModelError,
)
from structllm.outputs import CompletionOutput, Logprob, RequestOutput
from structllm.params import OutputKind, SamplingParams

if TYPE_CHECKING:
    from structllm.engine.async_llm import AsyncLLM, EngineStatistics, RequestStream
    from structllm.llm import LLM

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineConfigError",
    "EngineDeadError",
    "EngineOverloadedError",
    "EngineStatistics",
    "FrontendConfig",
    "InvalidRequestError",
    "Logprob",
    "ModelLoadError",
    "OutputKind",
    "RequestError",
    "RequestFailedError",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "ServerConfig",
    "StructLLMError",
    "UnsupportedModelError",
]

__version__ = "0.1.0"

_LAZY = {
    "LLM": "structllm.llm",
    "AsyncLLM": "structllm.engine.async_llm",
    "EngineStatistics": "structllm.engine.async_llm",
    "RequestStream": "structllm.engine.async_llm",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'structllm' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
