"""Chat templates: render a list of messages into one prompt string.

Templates are the Jinja2 strings Hugging Face keeps in tokenizer_config.json
and are rendered the way ``transformers`` renders them: in an immutable
sandbox with ``trim_blocks`` and ``lstrip_blocks``, loop controls, a
``raise_exception`` function, a ``strftime_now`` function and a ``tojson``
filter that does not HTML-escape. Every failure, whether the messages are
malformed, the template does not compile or the template itself refuses the
conversation, raises :class:`~structllm.errors.InvalidRequestError`.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.sandbox

from structllm.errors import InvalidRequestError

__all__ = ["CHATML_TEMPLATE", "render_chat_template", "validate_messages"]

#: The ChatML template (as used by Qwen2 and many others).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class _TemplateRaised(Exception):
    """Raised by ``raise_exception`` inside a template."""


def _raise_exception(message: object) -> NoReturn:
    raise _TemplateRaised(str(message))


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Like transformers: unlike Jinja's own tojson, no HTML escaping.
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
    )


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


@functools.cache
def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidRequestError(
            f"chat template does not compile: {exc.message} (line {exc.lineno})",
            field="chat_template",
        ) from None


def validate_messages(messages: object) -> list[dict[str, Any]]:
    """Check that *messages* is a list of dicts with string role and content.

    Returns the messages as a new list of plain dicts (extra keys such as
    ``name`` or ``tool_calls`` are kept); raises
    :class:`~structllm.errors.InvalidRequestError` with ``field="messages"``.
    """
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise InvalidRequestError(
            f"messages must be a list of messages, got {type(messages).__name__}",
            field="messages",
        )
    checked: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(
                f"messages[{i}] must be an object with 'role' and 'content', "
                f"got {message!r}",
                field="messages",
            )
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise InvalidRequestError(
                    f"messages[{i}].{key} must be a string, got {message.get(key)!r}",
                    field="messages",
                )
        checked.append(dict(message))
    return checked


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    bos_token: str = "",
    eos_token: str = "",
    **extra: Any,
) -> str:
    """Render *messages* with the Hugging Face chat *template*.

    The template sees ``messages``, ``add_generation_prompt``, ``bos_token``,
    ``eos_token`` and every keyword in *extra* (``tools``,
    ``date_string``...). Compiled templates are cached.
    """
    checked = validate_messages(messages)
    compiled = _compile(template)
    try:
        return compiled.render(
            **extra,
            messages=checked,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except _TemplateRaised as exc:
        raise InvalidRequestError(
            f"chat template refused the messages: {exc}", field="messages"
        ) from None
    except Exception as exc:  # a template is foreign code: any failure is its own
        raise InvalidRequestError(
            f"chat template failed on these messages: {type(exc).__name__}: {exc}",
            field="messages",
        ) from exc
