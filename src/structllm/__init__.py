"""structllm: an LLM inference engine for structured-concurrency programs."""

from structllm.engine.async_llm import AsyncLLM, EngineStatistics, RequestStream
from structllm.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    ModelLoadError,
    RequestError,
    StructLLMError,
    UnsupportedModelError,
)
from structllm.llm import LLM
from structllm.outputs import CompletionOutput, Logprob, RequestOutput
from structllm.params import OutputKind, SamplingParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "EngineDeadError",
    "EngineOverloadedError",
    "EngineStatistics",
    "InvalidRequestError",
    "Logprob",
    "ModelLoadError",
    "OutputKind",
    "RequestError",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "StructLLMError",
    "UnsupportedModelError",
]

__version__ = "0.1.0"
