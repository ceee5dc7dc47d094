"""The errors structllm raises.

Two families, because a caller reacts to them differently::

    StructLLMError
    ├── RequestError                 this request failed; the engine serves on
    │   ├── InvalidRequestError      bad input (also a ValueError); names the field
    │   ├── EngineOverloadedError    admission refused; retry later
    │   └── RequestFailedError       an internal error in this request alone
    ├── EngineDeadError              the engine is gone; raised ``from`` the cause
    └── ModelLoadError               a checkpoint could not be loaded
        └── UnsupportedModelError    the architecture is not one we implement

Foreign errors (Paddle, msgspec, OSError on pipes, safetensors) are translated
into these at layer boundaries only; inside a layer they propagate unchanged.
"""

from __future__ import annotations

__all__ = [
    "EngineDeadError",
    "EngineOverloadedError",
    "InvalidRequestError",
    "ModelLoadError",
    "RequestError",
    "RequestFailedError",
    "StructLLMError",
    "UnsupportedModelError",
]


class StructLLMError(Exception):
    """Base class of every error structllm raises on purpose."""


class RequestError(StructLLMError):
    """One request failed; other requests and the engine are unaffected."""


class InvalidRequestError(RequestError, ValueError):
    """A request was refused because of its input.

    ``field`` names the offending argument (``"temperature"``, ``"prompt"``)
    when there is one, so servers can report it without parsing the message.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class EngineOverloadedError(RequestError):
    """Admission control refused the request (queue full); retry later."""


class RequestFailedError(RequestError):
    """One request hit an internal error (a bug, not its input); others go on."""


class EngineDeadError(StructLLMError):
    """The engine core died and will not come back for this request."""


class ModelLoadError(StructLLMError):
    """A model directory or checkpoint could not be loaded."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint's architecture is not implemented by structllm."""


# -- raised by the HTTP server (structllm.server) ------------------------------
#
#   RequestError
#   ├── EngineLoadingError           the server listens, the engine is not up yet
#   └── ShuttingDownError            the server is draining before it stops
#
# Both are answered with 503 and Retry-After.

__all__ += ["EngineLoadingError", "ShuttingDownError"]


class EngineLoadingError(RequestError):
    """The server is up but the engine has not finished loading; retry later."""


class ShuttingDownError(RequestError):
    """The server is draining before it stops; retry on another replica."""
