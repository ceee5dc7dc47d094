"""Module attributes imported on first use (PEP 562 ``__getattr__``).

A package that re-exports names from heavy modules (Paddle, AnyIO,
llguidance) lists them in a table and sets ``__getattr__ =
lazy_getattr(__name__, table, globals())``; importing the package then
stays light, and the first use imports the one module that defines the
name and caches it in the package's namespace.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_getattr"]


def lazy_getattr(
    package: str, table: Mapping[str, str], namespace: dict[str, Any]
) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving ``table``'s names (name -> module)."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
