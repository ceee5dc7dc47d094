"""How ``structllm serve`` listens and answers: :class:`ServerConfig`.

Its own module beside :mod:`structllm.config` (which re-exports it, so
``from structllm.config import ServerConfig`` is the way to import it): the
server's fields (listening, HTTP limits, security, logging, the defaults a
request does not give) are a third of the settings and none of the engine's.
Each field is a :func:`~structllm.settings.setting`, checked when the config
is built, as every config class's are.
"""

from __future__ import annotations

from typing import Literal

import attrs

from structllm.errors import EngineConfigError
from structllm.params import SamplingParams
from structllm.settings import at_least, check_api_keys, check_config, setting

__all__ = ["ServerConfig", "check_lora_modules"]

_ONE = at_least(1)
_ZERO = at_least(0)
_POSITIVE = at_least(0, above=True)


def check_lora_modules(
    _: object, attribute: attrs.Attribute[tuple[str, ...]], value: tuple[str, ...]
) -> None:
    """A validator: each item is ``NAME=PATH``, both non-empty, each name once."""
    names: set[str] = set()
    for item in value:
        name, eq, path = item.partition("=") if isinstance(item, str) else ("", "", "")
        if not eq or not name.strip() or not path.strip():
            raise EngineConfigError(
                f"{attribute.name}: {item!r} is not NAME=PATH", field=attribute.name
            )
        if name in names:
            raise EngineConfigError(
                f"{attribute.name}: the name {name!r} is given twice",
                field=attribute.name,
            )
        names.add(name)


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
    reasoning_parser: Literal["auto", "none", "qwen3", "deepseek_r1"] = setting(
        "auto",
        help="split <think>...</think> from the answer (reasoning_content): "
        "auto picks the parser the chat template calls for, if clear",
        topic="model",
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
        validator=check_api_keys,
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
    lora_modules: tuple[str, ...] = setting(
        (),
        help="LoRA adapters to load at start, as NAME=PATH (PEFT's directory); "
        "a request's model NAME picks one (needs --enable-lora)",
        validator=check_lora_modules,
        metavar="NAME=PATH",
        many=True,
        topic="model",
    )
    enable_per_request_metrics: bool = setting(
        False,
        help="vLLM's per-request timings (a 'metrics' object: time to first "
        "token, generation and queue time, mean inter-token latency, tokens/s) "
        "in chat and completion responses of one choice",
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
