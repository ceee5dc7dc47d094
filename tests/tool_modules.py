"""The scripts of ``tools/`` as modules, for the tests of their parts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).parent.parent / "tools"


def load_tool(name: str) -> ModuleType:
    """``tools/NAME.py`` imported as the module ``NAME`` (put in
    ``sys.modules``: attrs resolves a class's module there)."""
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
