"""structllm: an LLM inference engine for structured-concurrency programs.

The engine classes (``LLM``, ``AsyncLLM``, ...) are imported lazily, on first
use, so that importing a light layer (``structllm.params``, ``structllm.text``)
does not pull in Paddle or AnyIO.
"""

from typing import TYPE_CHECKING

from structllm._lazy import lazy_getattr
from structllm.config import EngineConfig, FrontendConfig, ServerConfig
from structllm.errors import (
    EngineConfigError,
    EngineCoreError,
    EngineDeadError,
    EngineLoadingError,
    EngineOverloadedError,
    InvalidRequestError,
    ModelLoadError,
    NoFreeBlocksError,
    RequestError,
    RequestFailedError,
    ShuttingDownError,
    StructLLMError,
    UnsupportedModelError,
)
from structllm.lora_request import LoRARequest
from structllm.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    Logprob,
    RequestOutput,
)
from structllm.params import OutputKind, SamplingParams
from structllm.structured.spec import StructuredOutputs

if TYPE_CHECKING:
    from structllm.engine.frontend.async_llm import AsyncLLM
    from structllm.engine.frontend.request_stream import RequestStream
    from structllm.engine.statistics import EngineStatistics
    from structllm.llm import LLM

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "EmbeddingOutput",
    "EngineConfig",
    "EngineConfigError",
    "EngineCoreError",
    "EngineDeadError",
    "EngineLoadingError",
    "EngineOverloadedError",
    "EngineStatistics",
    "FrontendConfig",
    "InvalidRequestError",
    "LoRARequest",
    "Logprob",
    "ModelLoadError",
    "NoFreeBlocksError",
    "OutputKind",
    "RequestError",
    "RequestFailedError",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "ServerConfig",
    "ShuttingDownError",
    "StructLLMError",
    "StructuredOutputs",
    "UnsupportedModelError",
]

__version__ = "0.1.0"

_LAZY = {
    "LLM": "structllm.llm",
    "AsyncLLM": "structllm.engine.frontend.async_llm",
    "EngineStatistics": "structllm.engine.statistics",
    "RequestStream": "structllm.engine.frontend.request_stream",
}

__getattr__ = lazy_getattr(__name__, _LAZY, globals())
