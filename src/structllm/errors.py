"""The errors structllm raises.

Two families, because a caller reacts to them differently::

    StructLLMError
    ├── RequestError                 this request failed; the engine serves on
    │   ├── InvalidRequestError      bad input (also a ValueError); names the field
    │   ├── EngineOverloadedError    admission refused; retry later
    │   ├── EngineLoadingError       the engine is still loading (the server: 503)
    │   ├── ShuttingDownError        the server is draining (503)
    │   └── RequestFailedError       an internal error in this request alone
    ├── EngineDeadError              the engine is gone; raised ``from`` the cause
    ├── EngineCoreError              the core process failed (also a RuntimeError);
    │                                carries its traceback; a usual ``__cause__``
    │                                of EngineDeadError
    ├── EngineConfigError            a setting (EngineConfig, FrontendConfig,
    │                                ServerConfig) is invalid or does not fit the
    │                                model (also a ValueError); names the field
    ├── ModelLoadError               a checkpoint could not be loaded
    │   └── UnsupportedModelError    the architecture is not one we implement
    └── NoFreeBlocksError            the KV block pool ran dry (also a RuntimeError):
                                     the scheduler prevents it, so it means a bug

The offline ``LLM`` and the async ``AsyncLLM`` raise the same type for the
same mistake. A value that can never work (``max_num_seqs=0``, an unknown
``dtype``) is an EngineConfigError when the config is built, before anything
loads; one that does not fit the model (``num_blocks`` too small for one
sequence of ``max_model_len``) is an EngineConfigError from both too,
although ``AsyncLLM`` learns of it from the core process.

Foreign errors (Paddle, msgspec, OSError on pipes, safetensors) are translated
into these at layer boundaries only; inside a layer they propagate unchanged.
"""

from __future__ import annotations

__all__ = [
    "EngineConfigError",
    "EngineCoreError",
    "EngineDeadError",
    "EngineLoadingError",
    "EngineOverloadedError",
    "InvalidRequestError",
    "ModelLoadError",
    "NoFreeBlocksError",
    "RequestError",
    "RequestFailedError",
    "ShuttingDownError",
    "StructLLMError",
    "UnsupportedModelError",
    "dead_error",
    "load_error",
    "unwrap_group",
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


class EngineCoreError(StructLLMError, RuntimeError):
    """The engine core reported a fatal error; carries its traceback.

    ``kind`` is the type name of the original exception, which was raised
    in the core process and cannot travel as an object.
    """

    def __init__(self, kind: str, message: str, remote_traceback: str) -> None:
        super().__init__(
            f"{kind}: {message}\n--- engine core traceback ---\n{remote_traceback}"
        )
        self.kind = kind
        self.remote_traceback = remote_traceback


class EngineConfigError(StructLLMError, ValueError):
    """A setting is invalid, or cannot work with this model.

    ``field`` names the setting (``"num_blocks"``, ``"max_model_len"``,
    ``"port"``): the configs of :mod:`structllm.config` raise it when built.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class NoFreeBlocksError(StructLLMError, RuntimeError):
    """The KV block pool had fewer free blocks than asked for.

    The scheduler checks before it allocates, so reaching a caller means a bug.
    """


class ModelLoadError(StructLLMError):
    """A model directory or checkpoint could not be loaded."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint's architecture is not implemented by structllm."""


class EngineLoadingError(RequestError):
    """The server is up but the engine has not finished loading; retry later."""


class ShuttingDownError(RequestError):
    """The server is draining before it stops; retry on another replica."""


# -- rebuilding errors the core process reported --------------------------------


def load_error(
    kind: str, message: str, field: str | None = None
) -> ModelLoadError | EngineConfigError:
    """The front end's copy of the error (by type name) that stopped the core
    from loading; an unknown name becomes a ModelLoadError."""
    if kind == "EngineConfigError":
        return EngineConfigError(message, field=field)
    if kind == "UnsupportedModelError":
        return UnsupportedModelError(message)
    return ModelLoadError(message)


def dead_error(message: str, cause: BaseException) -> EngineDeadError:
    """EngineDeadError ``from`` ``cause``, with the cause in its message."""
    err = EngineDeadError(f"{message}: {cause}")
    err.__cause__ = cause
    return err


# -- exception groups -------------------------------------------------------------


def unwrap_group(exc: BaseException, *, sole: bool = False) -> BaseException:
    """The exception a task group's ``ExceptionGroup`` stands for.

    By default, the first leaf of ``exc`` (``exc`` itself if it is no group,
    the first leaf of nested groups): the error a response reports.

    With ``sole=True``, the group's one member if it has exactly one and that
    is an ``Exception`` (the error contract of ``AsyncLLM.open``: a failure
    comes out unwrapped), else ``exc`` unchanged (several at once stay a group).
    """
    if sole:
        if (
            isinstance(exc, BaseExceptionGroup)
            and len(exc.exceptions) == 1
            and isinstance(exc.exceptions[0], Exception)
        ):
            return exc.exceptions[0]
        return exc
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc
