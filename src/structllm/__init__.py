"""structllm: an LLM inference engine for structured-concurrency programs."""

from structllm.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    ModelLoadError,
    RequestError,
    StructLLMError,
    UnsupportedModelError,
)
from structllm.outputs import CompletionOutput, Logprob, RequestOutput
from structllm.params import OutputKind, SamplingParams

__all__ = [
    "CompletionOutput",
    "EngineDeadError",
    "EngineOverloadedError",
    "InvalidRequestError",
    "Logprob",
    "ModelLoadError",
    "OutputKind",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "StructLLMError",
    "UnsupportedModelError",
]

__version__ = "0.1.0"
