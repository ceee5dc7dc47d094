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
    continue_final_message: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
    bos_token: str = "",
    eos_token: str = "",
    **extra: Any,
) -> str:
    """Render *messages* with the Hugging Face chat *template*.

    The template sees ``messages``, ``add_generation_prompt``, ``bos_token``,
    ``eos_token``, every keyword in *extra* (``tools``, ``date_string``...)
    and the caller's *template_kwargs* (a request's ``chat_template_kwargs``,
    such as ``enable_thinking``; they may not replace the others). With
    ``continue_final_message`` the text ends where the final message's
    content ends (no end-of-turn after it), so the model continues that
    message, as transformers renders it. Compiled templates are cached.
    """
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError(
            "continue_final_message: the final message is continued, so no "
            "generation prompt can follow it (set add_generation_prompt false)",
            field="continue_final_message",
        )
    checked = validate_messages(messages)
    named = {
        "messages": checked,
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token,
        "eos_token": eos_token,
        **extra,
    }
    for key in template_kwargs or {}:
        if key in named:
            raise InvalidRequestError(
                f"chat_template_kwargs.{key}: {key!r} is set by the request "
                "itself, not through chat_template_kwargs",
                field=f"chat_template_kwargs.{key}",
            )
    compiled = _compile(template)
    try:
        text: str = compiled.render(**(template_kwargs or {}), **named)
    except _TemplateRaised as exc:
        raise InvalidRequestError(
            f"chat template refused the messages: {exc}", field="messages"
        ) from None
    except Exception as exc:  # a template is foreign code: any failure is its own
        raise InvalidRequestError(
            f"chat template failed on these messages: {type(exc).__name__}: {exc}",
            field="messages",
        ) from exc
    if continue_final_message:
        text = _cut_after_final_content(text, checked[-1])
    return text


def _cut_after_final_content(text: str, final: Mapping[str, Any]) -> str:
    """``text`` up to the end of the final message's content (its last copy)."""
    content = final.get("content")
    if isinstance(content, str) and content.strip():
        for piece in (content, content.strip()):
            end = text.rfind(piece)
            if end >= 0:
                return text[: end + len(piece)]
    raise InvalidRequestError(
        "continue_final_message: the template does not write the final "
        "message's content, so it cannot be continued",
        field="continue_final_message",
    )
