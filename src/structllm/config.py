"""The settings users pass, in one place, and the command-line flags made from them.

==================  =========================================================
:class:`EngineConfig`    the engine core: model, KV cache, batch limits
                         (``LLM(model, **fields)``, ``AsyncLLM.open``)
:class:`FrontendConfig`  ``AsyncLLM``'s front end: where the core runs, its
                         supervision, admission limits
:class:`ServerConfig`    ``structllm serve``: listening, HTTP limits, defaults
==================  =========================================================

Each field carries its command-line help and its topic (a ``--help``
group, :data:`TOPICS`) in ``metadata``; :func:`add_arguments` turns the
fields into ``argparse`` flags (``max_num_seqs`` becomes ``--max-num-seqs``,
a bool becomes ``--x/--no-x``, a ``Literal`` gives the choices),
:func:`add_grouped_arguments` does so for several classes at once, one
group per topic, and :func:`from_arguments` builds the config back from the
parsed namespace, so every default lives here once.

A value that cannot work raises :class:`~structllm.errors.EngineConfigError`
naming the field when the config is built, whoever builds it (``LLM``,
``AsyncLLM.open``, the command line): types, ``Literal`` choices and bounds
are checked here, what depends on the model when the core loads it. This
module is in the types layer: attrs, the standard library, ``errors`` and
``params``.
"""

from __future__ import annotations

import argparse
import functools
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import attrs

from structllm.errors import EngineConfigError
from structllm.params import SamplingParams

__all__ = [
    "TOPICS",
    "EngineConfig",
    "FrontendConfig",
    "ServerConfig",
    "add_arguments",
    "add_grouped_arguments",
    "at_least",
    "check_config",
    "from_arguments",
    "setting",
    "split_fields",
]

_GiB = 1 << 30

#: the ``--help`` groups, in the order ``--help`` shows them: a field's
#: ``topic`` is a key
TOPICS = {
    "model": "model",
    "engine": "engine and scheduling",
    "network": "network",
    "security": "security (API keys, CORS)",
    "limits": "limits and timeouts",
    "supervision": "engine supervision",
    "logging": "logging and metrics",
}


def setting(
    default: Any = attrs.NOTHING,
    *,
    help: str | None = None,
    flag: str | None = None,
    cli: bool = True,
    validator: Any = None,
    secret: bool = False,
    topic: str | None = None,
    converter: Any = None,
    metavar: str | tuple[str, ...] | None = None,
) -> Any:
    """An attrs field with its command-line help (``cli=False``: no flag).

    ``topic``: its ``--help`` group, a key of :data:`TOPICS`. ``secret``:
    left out of the class's ``repr`` (API keys never reach a log).
    ``metavar``: the flag's value names (default: the type's).
    """
    if topic is not None and topic not in TOPICS:
        raise KeyError(f"unknown topic {topic!r}")
    return attrs.field(
        default=default,
        validator=validator,
        converter=converter,
        repr=not secret,
        metadata={
            "help": help,
            "flag": flag,
            "cli": cli,
            "topic": topic,
            "metavar": metavar,
        },
    )


def at_least(low: float, *, above: bool = False, at_most: float | None = None) -> Any:
    """A validator: the value is ``>= low`` (``> low`` with ``above``; at
    most ``at_most``), or None.

    None passes: the type says whether a field may be unset, and
    :func:`check_config` checks types.
    """

    def check(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None or not isinstance(value, int | float):
            return  # the type check names it
        if (
            value < low
            or (above and value == low)
            or (at_most is not None and value > at_most)
        ):
            bound = f"greater than {low:g}" if above else f"at least {low:g}"
            if at_most is not None:
                bound = f"between {low:g} and {at_most:g}"
            raise EngineConfigError(
                f"{attribute.name} must be {bound}, not {value!r}",
                field=attribute.name,
            )

    return check


def _api_key(_: Any, attribute: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
    for key in value:  # the message never shows the key itself
        if not key or not key.isascii() or not key.isprintable() or " " in key:
            raise EngineConfigError(
                f"{attribute.name}: every key must be "
                "non-empty printable ASCII without spaces",
                field=attribute.name,
            )


def check_config(config: Any) -> None:
    """Refuse, naming the field, a value of the wrong type or not among the
    ``Literal`` choices (attrs checks neither; the bounds are validators)."""
    cls: type = type(config)
    for field in attrs.fields(cls):
        hint = _hints(cls)[field.name]
        value = getattr(config, field.name)
        if value is None and type(None) in typing.get_args(hint):
            continue
        kind, choices, repeat = _kind(hint)
        for item in value if repeat and isinstance(value, tuple) else [value]:
            if choices is not None and item not in choices:
                raise EngineConfigError(
                    f"{field.name} must be one of {', '.join(map(repr, choices))}, "
                    f"not {item!r}",
                    field=field.name,
                )
            if not _is_a(item, kind) or (repeat and not isinstance(value, tuple)):
                what = f"a tuple of {kind.__name__}" if repeat else kind.__name__
                raise EngineConfigError(
                    f"{field.name} must be {what}, not {value!r}", field=field.name
                )


def _is_a(value: Any, kind: Any) -> bool:
    if not isinstance(kind, type):
        return True
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


_ONE = at_least(1)
_ZERO = at_least(0)
_POSITIVE = at_least(0, above=True)


@attrs.frozen(kw_only=True)
class EngineConfig:
    """How to build an engine core. Every field but ``model`` has a working default."""

    model: str = setting(
        help="a model directory, or a built-in name (see structllm.builtin)", cli=False
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = setting(
        "auto",
        help="compute dtype; auto: float32 on CPU, else the checkpoint's",
        topic="model",
    )
    load_format: Literal["auto", "safetensors", "dummy"] = setting(
        "auto", help="dummy: random weights from config.json alone", topic="model"
    )
    seed: int = setting(0, help="seed for dummy weights", cli=False)
    block_size: int = setting(
        16, help="tokens per KV block", validator=_ONE, topic="engine"
    )
    num_blocks: int | None = setting(
        None,
        help="KV blocks (default: as many as fit in --kv-cache-memory)",
        validator=_ONE,
        topic="engine",
    )
    kv_cache_memory: int = setting(
        _GiB // 2,
        help="bytes for the KV cache when --num-blocks is not given",
        validator=_ONE,
        topic="engine",
    )
    max_model_len: int | None = setting(
        None,
        help="longest prompt + output (default: the model's max_position_embeddings)",
        validator=at_least(2),  # a prompt of one token, and one to sample
        topic="engine",
    )
    max_num_seqs: int = setting(
        64, help="most sequences in one batch", validator=_ONE, topic="engine"
    )
    max_num_batched_tokens: int = setting(
        1024, help="most tokens in one step", validator=_ONE, topic="engine"
    )
    enable_chunked_prefill: bool = setting(
        True,
        help="split prompts longer than the token budget over several steps",
        topic="engine",
    )
    enable_prefix_caching: bool = setting(
        True, help="reuse the KV blocks of repeated prompt prefixes", topic="engine"
    )
    num_threads: int | None = setting(
        None,
        help="CPU threads for Paddle's math (default: every usable core)",
        validator=_ONE,
        topic="model",
    )
    model_backend: Literal["auto", "eager", "inference"] = setting(
        "auto",
        help="inference: oneDNN predictors (Paddle Inference); auto picks them for "
        "float32 CPU models of 10M+ parameters, else eager",
        topic="model",
    )

    def __attrs_post_init__(self) -> None:
        check_config(self)


@attrs.frozen(kw_only=True)
class FrontendConfig:
    """Front-end settings of :meth:`AsyncLLM.open` (engine settings are separate)."""

    executor: Literal["process", "inline"] = setting(
        "process",
        help="where the engine core runs: a child process, or a thread",
        topic="engine",
    )
    tokenizer: str | None = setting(
        None, help="tokenizer directory (default: the model's)", topic="model"
    )
    max_queued_requests: int | None = setting(
        None,
        help="refuse new requests (overloaded) once this many wait beyond "
        "--max-num-seqs (default: no limit)",
        validator=_ZERO,
        topic="limits",
    )
    shutdown_grace: float = setting(
        5.0,
        help="seconds that stopping the engine waits for in-flight requests",
        validator=_ZERO,
        topic="supervision",
    )
    heartbeat_interval: float = setting(
        1.0,
        help="seconds between core heartbeats",
        validator=_POSITIVE,
        topic="supervision",
    )
    heartbeat_timeout: float = setting(
        10.0,
        help="a core silent this long (no heartbeat, no step) is declared dead",
        validator=_POSITIVE,
        topic="supervision",
    )
    startup_timeout: float = setting(
        600.0,
        help="seconds the core may take to load",
        validator=_POSITIVE,
        topic="supervision",
    )
    max_restarts: int = setting(
        3,
        help="core restarts allowed within --restart-window seconds",
        validator=_ZERO,
        topic="supervision",
    )
    restart_window: float = setting(
        300.0, help="see --max-restarts", validator=_POSITIVE, topic="supervision"
    )
    restart_backoff: float = setting(
        0.25,
        help="seconds before the first restart",
        validator=_ZERO,
        topic="supervision",
    )
    show_progress: bool = setting(
        True, help="progress bars while the model loads", topic="logging"
    )
    max_prompt_bytes: int | None = setting(
        None,
        help="refuse longer prompts (UTF-8 bytes) before tokenising "
        "(default: 32 per token of max-model-len, at least 64 KiB)",
        validator=_ONE,
        topic="limits",
    )
    health_timeout: float | None = setting(
        None,
        help="report unhealthy once the core has been silent this long "
        "(default: 3 heartbeat intervals)",
        validator=_POSITIVE,
        topic="supervision",
    )
    #: test hook forwarded to the core ("raise_at_step:N", "hang_at_step:N",
    #: "exit_at_step:N") for its first ``fault_starts`` starts
    fault: str | None = setting(None, cli=False)
    fault_starts: int = setting(1, cli=False, validator=_ZERO)

    def __attrs_post_init__(self) -> None:
        check_config(self)


@attrs.frozen(kw_only=True)
class ServerConfig:
    """How ``structllm serve`` listens and answers (the app needs ``model_name``)."""

    model_name: str = setting(
        help="the model name the API answers to (default: the model argument)",
        flag="--served-model-name",
        topic="model",
    )
    host: str = setting("127.0.0.1", help="address to listen on", topic="network")
    port: int = setting(
        8000,
        help="port to listen on; 0 picks a free one",
        validator=at_least(0, at_most=65535),
        topic="network",
    )
    loop: Literal["asyncio", "trio"] = setting(
        "asyncio", help="the event loop", topic="network"
    )
    backlog: int = setting(
        4096,
        help="connections the kernel queues before the server accepts them "
        "(capped by net.core.somaxconn)",
        validator=_ONE,
        topic="network",
    )
    header_timeout: float = setting(
        10.0,
        help="seconds a connection may take to send its request headers",
        validator=_POSITIVE,
        topic="limits",
    )
    graceful_timeout: float = setting(
        5.0,
        help="seconds open requests get to finish after SIGINT/SIGTERM",
        validator=_ZERO,
        topic="limits",
    )
    request_timeout: float | None = setting(
        None,
        help="seconds before a request ends with a timeout error (default: never)",
        validator=_POSITIVE,
        topic="limits",
    )
    retry_after: int = setting(
        1,
        help="the Retry-After header (seconds) of 503 answers",
        validator=_ZERO,
        topic="limits",
    )
    default_max_tokens: int = setting(
        attrs.fields(SamplingParams).max_tokens.default,
        help="max_tokens of a request that does not say",
        validator=_ONE,
        topic="limits",
    )
    max_body_bytes: int = setting(
        32 << 20,
        help="larger request bodies are refused with 413 before being read",
        validator=_ONE,
        topic="limits",
    )
    body_timeout: float = setting(
        30.0,
        help="seconds to receive a request body (408 after)",
        validator=_POSITIVE,
        topic="limits",
    )
    api_key: tuple[str, ...] = setting(
        (),
        help="require 'Authorization: Bearer KEY' on /v1, /tokenize and "
        "/detokenize (also STRUCTLLM_API_KEY, comma-separated; default: no key, "
        "an open server)",
        validator=_api_key,
        secret=True,
        metavar="KEY",
        topic="security",
    )
    metrics_require_auth: bool = setting(
        False,
        help="/metrics needs the API key too (/health and /version never do)",
        topic="security",
    )
    max_concurrent_requests: int | None = setting(
        None,
        help="requests handled at once (all routes but /health, /metrics); more "
        "get 503 with Retry-After (default: no limit)",
        validator=_ONE,
        topic="limits",
    )
    max_concurrent_requests_per_client: int | None = setting(
        None,
        help="the same, per client address, so one client cannot hold the "
        "server (default: no limit)",
        validator=_ONE,
        topic="limits",
    )
    access_log: bool = setting(
        True,
        help="one structured line per request on the structllm.access logger",
        topic="logging",
    )
    max_log_len: int = setting(
        0,
        help="log at most this many characters of the prompt in the access "
        "log (0: no prompt text)",
        validator=_ZERO,
        topic="logging",
    )
    allowed_origins: tuple[str, ...] = setting(
        (),
        help="CORS: origins allowed to call the API ('*' for any; default: no CORS)",
        topic="security",
        metavar="ORIGIN",
    )
    allowed_methods: tuple[str, ...] = setting(
        ("*",),
        help="CORS: allowed methods (with --allowed-origins)",
        topic="security",
        metavar="METHOD",
    )
    allowed_headers: tuple[str, ...] = setting(
        ("*",),
        help="CORS: allowed request headers (with --allowed-origins)",
        topic="security",
        metavar="HEADER",
    )
    allow_credentials: bool = setting(
        False, help="CORS: allow credentials (with --allowed-origins)", topic="security"
    )

    def __attrs_post_init__(self) -> None:
        check_config(self)


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


def _fixed_size(hint: Any) -> int | None:
    """``n`` for ``tuple[X, ..., X]`` of n items (not ``tuple[X, ...]``)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and Ellipsis not in args:
        return len(args)
    return None


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
    for field in _cli_fields(cls, only, skip):
        _add_flag(parser, cls, field, defaults or {}, help or {})


def add_grouped_arguments(
    parser: argparse.ArgumentParser, *classes: type
) -> dict[str, argparse._ArgumentGroup]:
    """Add the flags of every field of ``classes``, one ``--help`` group per
    topic in :data:`TOPICS` order (fields without a topic: "other").

    Returns the groups by topic, so a caller can add its own flags to one.
    """
    fields = [(cls, f) for cls in classes for f in _cli_fields(cls, None, ())]
    groups: dict[str, argparse._ArgumentGroup] = {}
    for topic, title in [*TOPICS.items(), ("other", "other")]:
        for cls, field in fields:
            if (field.metadata.get("topic") or "other") == topic:
                if topic not in groups:
                    groups[topic] = parser.add_argument_group(title)
                _add_flag(groups[topic], cls, field, {}, {})
    return groups


def _add_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    field: attrs.Attribute[Any],
    defaults: Mapping[str, Any],
    help: Mapping[str, str],
) -> None:
    kind, choices, repeat = _kind(_hints(cls)[field.name])
    default = defaults.get(
        field.name, None if field.default is attrs.NOTHING else field.default
    )
    text = help.get(field.name, field.metadata.get("help")) or ""
    kw: dict[str, Any] = {"dest": _dest(field), "default": default}
    size = _fixed_size(_hints(cls)[field.name])
    if kind is bool:
        kw["action"] = argparse.BooleanOptionalAction
        text += " (default: on)" if default else " (default: off)"
    elif size is not None:  # tuple[int, int]: --flag A B
        kw.update(type=kind, nargs=size, metavar=field.metadata.get("metavar"))
        text += f" (default: {' '.join(map(str, default))})"
    elif repeat:
        kw.update(action=_Append, type=kind, default=tuple(default))
        if field.metadata.get("metavar"):
            kw["metavar"] = field.metadata["metavar"]
        text += " (repeatable)"
    else:
        kw.update(type=kind, choices=choices)
        if choices is None:
            kw["metavar"] = field.metadata.get("metavar") or kind.__name__.upper()
    if size is not None:
        pass
    elif repeat and default:
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
