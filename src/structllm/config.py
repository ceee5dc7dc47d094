"""The settings users pass, in one place, and the command-line flags made from them.

==================  =========================================================
:class:`EngineConfig`    the engine core: model, KV cache, batch limits
                         (``LLM(model, **fields)``, ``AsyncLLM.open``)
:class:`FrontendConfig`  ``AsyncLLM``'s front end: where the core runs, its
                         supervision, admission limits
:class:`ServerConfig`    ``structllm serve``: listening, HTTP limits, defaults
==================  =========================================================

Each field carries its command-line help in ``metadata``; :func:`add_arguments`
turns the fields into ``argparse`` flags (``max_num_seqs`` becomes
``--max-num-seqs``, a bool becomes ``--x/--no-x``, a ``Literal`` gives the
choices) and :func:`from_arguments` builds the config back from the parsed
namespace, so every default lives here once. This module is in the types
layer: attrs and the standard library only.
"""

from __future__ import annotations

import argparse
import functools
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import attrs

__all__ = [
    "EngineConfig",
    "FrontendConfig",
    "ServerConfig",
    "add_arguments",
    "from_arguments",
    "setting",
    "split_fields",
]

_GiB = 1 << 30


def setting(
    default: Any = attrs.NOTHING,
    *,
    help: str | None = None,
    flag: str | None = None,
    cli: bool = True,
    validator: Any = None,
    secret: bool = False,
) -> Any:
    """An attrs field with its command-line help (``cli=False``: no flag).

    ``secret``: left out of the class's ``repr`` (API keys never reach a log).
    """
    return attrs.field(
        default=default,
        validator=validator,
        repr=not secret,
        metadata={"help": help, "flag": flag, "cli": cli},
    )


def _api_key(_: Any, attribute: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
    for key in value:  # the message never shows the key itself
        if not key or not key.isascii() or not key.isprintable() or " " in key:
            raise ValueError(
                f"--{attribute.name.replace('_', '-')}: every key must be "
                "non-empty printable ASCII without spaces"
            )


def _positive_or_none(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{attribute.name} must be at least 1 (or unset), not {value}")


@attrs.frozen(kw_only=True)
class EngineConfig:
    """How to build an engine core. Every field but ``model`` has a working default."""

    model: str = setting(
        help="a model directory, or a built-in name (see structllm.builtin)", cli=False
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = setting(
        "auto", help="compute dtype; auto: float32 on CPU, else the checkpoint's"
    )
    load_format: Literal["auto", "safetensors", "dummy"] = setting(
        "auto", help="dummy: random weights from config.json alone"
    )
    seed: int = setting(0, help="seed for dummy weights", cli=False)
    block_size: int = setting(
        16, help="tokens per KV block", validator=attrs.validators.ge(1)
    )
    num_blocks: int | None = setting(
        None, help="KV blocks (default: as many as fit in --kv-cache-memory)"
    )
    kv_cache_memory: int = setting(
        _GiB // 2, help="bytes for the KV cache when --num-blocks is not given"
    )
    max_model_len: int | None = setting(
        None,
        help="longest prompt + output (default: the model's max_position_embeddings)",
    )
    max_num_seqs: int = setting(64, help="most sequences in one batch")
    max_num_batched_tokens: int = setting(1024, help="most tokens in one step")
    enable_chunked_prefill: bool = setting(
        True, help="split prompts longer than the token budget over several steps"
    )
    enable_prefix_caching: bool = setting(
        True, help="reuse the KV blocks of repeated prompt prefixes"
    )
    num_threads: int | None = setting(
        None, help="CPU threads for Paddle's math (default: every usable core)"
    )
    model_backend: Literal["auto", "eager", "inference"] = setting(
        "auto",
        help="inference: oneDNN predictors (Paddle Inference); auto picks them for "
        "float32 CPU models of 10M+ parameters, else eager",
    )


@attrs.frozen(kw_only=True)
class FrontendConfig:
    """Front-end settings of :meth:`AsyncLLM.open` (engine settings are separate)."""

    executor: Literal["process", "inline"] = setting(
        "process", help="where the engine core runs: a child process, or a thread"
    )
    tokenizer: str | None = setting(
        None, help="tokenizer directory (default: the model's)"
    )
    max_queued_requests: int | None = setting(
        None,
        help="refuse new requests (overloaded) once this many wait beyond "
        "--max-num-seqs (default: no limit)",
    )
    shutdown_grace: float = setting(
        5.0, help="seconds that stopping the engine waits for in-flight requests"
    )
    heartbeat_interval: float = setting(1.0, help="seconds between core heartbeats")
    heartbeat_timeout: float = setting(
        10.0, help="a core silent this long (no heartbeat, no step) is declared dead"
    )
    startup_timeout: float = setting(600.0, help="seconds the core may take to load")
    max_restarts: int = setting(
        3, help="core restarts allowed within --restart-window seconds"
    )
    restart_window: float = setting(300.0, help="see --max-restarts")
    restart_backoff: float = setting(0.25, help="seconds before the first restart")
    show_progress: bool = setting(True, help="progress bars while the model loads")
    max_prompt_bytes: int | None = setting(
        None,
        help="refuse longer prompts (UTF-8 bytes) before tokenising "
        "(default: 32 per token of max-model-len, at least 64 KiB)",
    )
    health_timeout: float | None = setting(
        None,
        help="report unhealthy once the core has been silent this long "
        "(default: 3 heartbeat intervals)",
    )
    #: test hook forwarded to the core ("raise_at_step:N", "hang_at_step:N",
    #: "exit_at_step:N") for its first ``fault_starts`` starts
    fault: str | None = setting(None, cli=False)
    fault_starts: int = setting(1, cli=False)


@attrs.frozen(kw_only=True)
class ServerConfig:
    """How ``structllm serve`` listens and answers (the app needs ``model_name``)."""

    model_name: str = setting(
        help="the model name the API answers to (default: the model argument)",
        flag="--served-model-name",
    )
    host: str = setting("127.0.0.1", help="address to listen on")
    port: int = setting(8000, help="port to listen on; 0 picks a free one")
    loop: Literal["asyncio", "trio"] = setting("asyncio", help="the event loop")
    backlog: int = setting(4096, help="listen backlog (>= 1024)")
    header_timeout: float = setting(
        10.0, help="seconds a connection may take to send its request headers"
    )
    graceful_timeout: float = setting(
        5.0, help="seconds open requests get to finish after SIGINT/SIGTERM"
    )
    request_timeout: float | None = setting(
        None, help="seconds before a request ends with a timeout error (default: never)"
    )
    retry_after: int = setting(
        1, help="the Retry-After header (seconds) of 503 answers"
    )
    default_max_tokens: int = setting(
        16, help="max_tokens of a request that does not say"
    )
    max_body_bytes: int = setting(
        32 << 20, help="larger request bodies are refused with 413 before being read"
    )
    body_timeout: float = setting(
        30.0, help="seconds to receive a request body (408 after)"
    )
    api_key: tuple[str, ...] = setting(
        (),
        help="require 'Authorization: Bearer KEY' on /v1, /tokenize and "
        "/detokenize (also STRUCTLLM_API_KEY, comma-separated; default: no key, "
        "an open server)",
        validator=_api_key,
        secret=True,
    )
    metrics_require_auth: bool = setting(
        False, help="/metrics needs the API key too (/health and /version never do)"
    )
    max_concurrent_requests: int | None = setting(
        None,
        help="requests handled at once (all routes but /health, /metrics); more "
        "get 503 with Retry-After (default: no limit)",
        validator=_positive_or_none,
    )
    max_concurrent_requests_per_client: int | None = setting(
        None,
        help="the same, per client address, so one client cannot hold the "
        "server (default: no limit)",
        validator=_positive_or_none,
    )
    access_log: bool = setting(
        True, help="one structured line per request on the structllm.access logger"
    )
    max_log_len: int = setting(
        0,
        help="log at most this many characters of the prompt in the access "
        "log (0: no prompt text)",
        validator=attrs.validators.ge(0),
    )
    allowed_origins: tuple[str, ...] = setting(
        (), help="CORS: origins allowed to call the API ('*' for any; default: no CORS)"
    )
    allowed_methods: tuple[str, ...] = setting(
        ("*",), help="CORS: allowed methods (with --allowed-origins)"
    )
    allowed_headers: tuple[str, ...] = setting(
        ("*",), help="CORS: allowed request headers (with --allowed-origins)"
    )
    allow_credentials: bool = setting(
        False, help="CORS: allow credentials (with --allowed-origins)"
    )


def split_fields(
    kwargs: Mapping[str, Any], *classes: type, caller: str
) -> list[dict[str, Any]]:
    """Share keyword arguments out among the attrs ``classes`` by field name."""
    parts: list[dict[str, Any]] = [{} for _ in classes]
    fields = [attrs.fields_dict(cls) for cls in classes]
    for key, value in kwargs.items():
        i = next((i for i, f in enumerate(fields) if key in f), None)
        if i is None:
            raise TypeError(f"{caller} got an unexpected argument {key!r}")
        parts[i][key] = value
    return parts


# -------------------------------------------------------------- the flags


def _flag(field: attrs.Attribute[Any]) -> str:
    return str(field.metadata.get("flag") or "--" + field.name.replace("_", "-"))


def _dest(field: attrs.Attribute[Any]) -> str:
    return _flag(field)[2:].replace("-", "_")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _kind(hint: Any) -> tuple[Any, list[Any] | None, bool]:
    """``(element type, choices, repeatable)`` of an annotation."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint)
    if origin is Literal:
        return type(args[0]), list(args), False
    if origin is tuple:
        return args[0], None, True
    if args and origin is not None and len(args) == 1:  # X | None
        return _kind(args[0])
    return hint, None, False


def _cli_fields(
    cls: type, only: Iterable[str] | None, skip: Iterable[str]
) -> list[attrs.Attribute[Any]]:
    fields = attrs.fields_dict(cls)
    names = list(fields) if only is None else list(only)
    unknown = [n for n in [*names, *skip] if n not in fields]
    if unknown:
        raise KeyError(f"{cls.__name__} has no field {unknown[0]!r}")
    chosen = [fields[n] for n in names if n not in set(skip)]
    return [f for f in chosen if only is not None or f.metadata.get("cli", True)]


def add_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    only: Iterable[str] | None = None,
    skip: Iterable[str] = (),
    defaults: Mapping[str, Any] | None = None,
    help: Mapping[str, str] | None = None,
) -> None:
    """Add a ``--flag`` for each field of the attrs class ``cls``.

    ``only`` picks fields (in that order; even ``cli=False`` ones), ``skip``
    leaves some out, ``defaults`` and ``help`` override a field's default
    and help for this command only. A required field's flag defaults to None
    (the caller fills it in, see :func:`from_arguments`).
    """
    defaults = defaults or {}
    help = help or {}
    for field in _cli_fields(cls, only, skip):
        kind, choices, repeat = _kind(_hints(cls)[field.name])
        default = defaults.get(
            field.name, None if field.default is attrs.NOTHING else field.default
        )
        text = help.get(field.name, field.metadata.get("help")) or ""
        kw: dict[str, Any] = {"dest": _dest(field), "default": default}
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
            text += " (default: on)" if default else " (default: off)"
        elif repeat:
            kw.update(action=_Append, type=kind, default=tuple(default))
            text += " (repeatable)"
        else:
            kw.update(type=kind, choices=choices)
            if choices is None:
                kw["metavar"] = kind.__name__.upper()
        if repeat and default:
            text += f" (default: {' '.join(default)})"
        elif default not in (None, (), []) and kind is not bool:
            text += " (default: %(default)s)"
        parser.add_argument(_flag(field), help=text.strip() or None, **kw)


class _Append(argparse.Action):
    """``append`` whose first use replaces the default instead of extending it."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        items = getattr(namespace, self.dest)
        items = [] if items is self.default else list(items)
        setattr(namespace, self.dest, [*items, values])


def from_arguments(
    cls: type[Any],
    ns: argparse.Namespace,
    *,
    only: Iterable[str] | None = None,
    skip: Iterable[str] = (),
    **given: Any,
) -> Any:
    """Build ``cls`` from the flags :func:`add_arguments` added, plus ``given``.

    A required field left None on the command line must be in ``given``.
    """
    kw: dict[str, Any] = {}
    for field in _cli_fields(cls, only, skip):
        value = getattr(ns, _dest(field))
        if value is None and field.default is attrs.NOTHING:
            continue
        kw[field.name] = tuple(value) if isinstance(value, list | tuple) else value
    kw.update(given)
    return cls(**kw)
