"""The machinery behind :mod:`structllm.config`: fields that know their flag.

- :func:`setting`: an attrs field carrying its command-line help, its
  ``--help`` topic (:data:`TOPICS`) and its flag's name;
- :func:`at_least`, :func:`check_address`, :func:`check_api_keys` and
  :func:`check_config`: the checks a config runs when it is built, raising
  :class:`~structllm.errors.EngineConfigError` that names the field
  (bounds, addresses, API keys; types and ``Literal`` choices, which attrs
  does not check); :func:`parse_address` reads a ``HOST:PORT`` wherever
  one is given;
- :func:`add_arguments`, :func:`add_grouped_arguments` and
  :func:`from_arguments`: ``argparse`` flags from the fields of an attrs
  class (``max_num_seqs`` becomes ``--max-num-seqs``, a bool ``--x/--no-x``,
  a ``Literal`` the choices, ``tuple[int, int]`` two values) and the class
  back from the parsed namespace, so a default lives only on its field;
- :func:`split_fields`: keyword arguments shared out among classes.

Types layer: attrs, the standard library and ``errors``.
"""

from __future__ import annotations

import argparse
import functools
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import attrs

from structllm.errors import EngineConfigError

__all__ = [
    "TOPICS",
    "add_arguments",
    "add_grouped_arguments",
    "at_least",
    "check_address",
    "check_api_keys",
    "check_config",
    "from_arguments",
    "parse_address",
    "setting",
    "split_fields",
]

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
    parse: Any = None,
    many: bool = False,
) -> Any:
    """An attrs field with its command-line help (``cli=False``: no flag).

    ``topic``: its ``--help`` group, a key of :data:`TOPICS`. ``secret``:
    left out of the class's ``repr`` (API keys never reach a log).
    ``metavar``: the flag's value names (default: the type's). ``parse``:
    how the flag reads its text (default: the type; ``str`` leaves it to the
    field's converter, e.g. JSON for a structured setting). ``many``: a
    repeatable flag also takes several values at once (``--flag A B``).
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
            "parse": parse,
            "many": many,
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


def parse_address(value: str, field: str = "address") -> tuple[str, int]:
    """``"HOST:PORT"`` (``"[::1]:PORT"`` for IPv6) as ``(host, port)``;
    EngineConfigError naming ``field`` if it is not one."""
    host, sep, port = value.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise EngineConfigError(
            f"{field} must be HOST:PORT with a port from 1 to 65535, not {value!r}",
            field=field,
        )
    return host, int(port)


def check_address(_: Any, attribute: attrs.Attribute[Any], value: object) -> None:
    """A validator: the value is a ``HOST:PORT`` (:func:`parse_address`), or
    not a string at all (None passes; :func:`check_config` names a wrong
    type)."""
    if isinstance(value, str):
        parse_address(value, attribute.name)


def check_api_keys(
    _: Any, attribute: attrs.Attribute[Any], value: tuple[str, ...]
) -> None:
    """A validator: every key is non-empty printable ASCII without spaces."""
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
        if field.metadata.get("many"):
            kw["nargs"] = "+"
        if field.metadata.get("metavar"):
            kw["metavar"] = field.metadata["metavar"]
        text += " (repeatable)"
    else:
        kw.update(type=field.metadata.get("parse") or kind, choices=choices)
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
        new = values if isinstance(values, list) else [values]  # nargs="+"
        setattr(namespace, self.dest, [*items, *new])


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
