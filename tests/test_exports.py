"""The public names of ``structllm``: a deliberate, tested list."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import structllm

PUBLIC = {
    "AsyncLLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineConfigError",
    "EmbeddingOutput",
    "EngineCoreError",
    "EngineDeadError",
    "EngineLoadingError",
    "EngineOverloadedError",
    "EngineStatistics",
    "FrontendConfig",
    "InvalidRequestError",
    "LLM",
    "LoRARequest",
    "Logprob",
    "ModelLoadError",
    "NoFreeBlocksError",
    "OutputKind",
    "RequestError",
    "RequestFailedError",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "ServerConfig",
    "ShuttingDownError",
    "StructLLMError",
    "StructuredOutputs",
    "UnsupportedModelError",
}


def test_all_is_the_public_api() -> None:
    assert set(structllm.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(structllm, name).__module__.startswith("structllm.")


def test_every_error_is_exported() -> None:
    import structllm.errors as errors

    defined = {
        name
        for name, obj in vars(errors).items()
        if isinstance(obj, type) and issubclass(obj, structllm.StructLLMError)
    }
    assert defined <= set(structllm.__all__)


def test_lazy_names_load_on_first_use_and_unknown_ones_raise() -> None:
    import structllm.structured

    assert structllm.EngineStatistics.__name__ == "EngineStatistics"
    assert structllm.structured.GrammarCompiler.__name__ == "GrammarCompiler"
    with pytest.raises(AttributeError, match="'structllm' has no attribute 'nope'"):
        structllm.nope  # noqa: B018
    with pytest.raises(AttributeError, match=r"'structllm\.structured' has no"):
        structllm.structured.nope  # noqa: B018


def test_the_front_end_never_imports_paddle() -> None:
    """``AsyncLLM``, the server and the command line (its parser included)
    import no Paddle and no numba: the model loads in the engine's process."""
    code = """
import sys
import structllm
from structllm import AsyncLLM, EngineStatistics, SamplingParams
import structllm.cli, structllm.server.run, structllm.bench.serve_compare
structllm.cli.build_parser().parse_args(["serve", "tiny"])
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"paddle", "numba"})
assert not heavy, heavy
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_structllm_serve_imports_no_numpy() -> None:
    """``structllm serve``'s process (its command line, the app, a GGUF
    file's tokenizer) imports no numpy, ~16 MiB of the server process: the
    model's arrays are the engine core's; an embedding loads it."""
    code = """
import sys
sys.modules["numpy"] = None  # an import of it fails
import structllm.cli, structllm.server.app, structllm.text.tokenizer
from structllm.formats import GGUFFile
structllm.cli.build_parser("serve").parse_args(["serve", "tiny"])
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_errors_tree() -> None:
    assert issubclass(structllm.InvalidRequestError, ValueError)
    assert issubclass(structllm.InvalidRequestError, structllm.RequestError)
    assert issubclass(structllm.EngineOverloadedError, structllm.RequestError)
    assert not issubclass(structllm.EngineDeadError, structllm.RequestError)


EXAMPLES = sorted((Path(__file__).parent.parent / "docs" / "examples").glob("*.py"))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_docs_examples_run(example: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "finish_reason" in proc.stdout or "length" in proc.stdout


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from structllm.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"structllm {structllm.__version__}"


def _module_imports() -> dict[
    str, tuple[bool, list[ast.ImportFrom | ast.Import], ast.Module]
]:
    """Each structllm module: (is a package, its imports, its tree)."""
    root = Path(structllm.__file__).parent
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if package else parts)
        tree = ast.parse(path.read_text())
        imports = [
            n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)
        ]
        out[name] = (package, imports, tree)
    return out


def _target(module: str, package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")[: None if package else -1]
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def test_no_module_imports_another_modules_private_names() -> None:
    modules = _module_imports()
    found = []
    for name, (package, imports, _) in modules.items():
        for node in imports:
            if not isinstance(node, ast.ImportFrom):
                continue
            target = _target(name, package, node)
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and f"{target}.{alias.name}" not in modules:
                    found.append(f"{name}: from {target} import {alias.name}")
    assert found == []


def test_module_level_imports_have_no_cycle() -> None:
    """Imports at module level (not in functions, not under TYPE_CHECKING)."""
    modules = _module_imports()

    def top(body: list[ast.stmt]) -> Iterator[ast.stmt]:
        for n in body:
            if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
                continue
            if isinstance(n, ast.If | ast.Try | ast.With | ast.ClassDef):
                for field in ("body", "orelse", "finalbody"):
                    yield from top(getattr(n, field, []))
                for handler in getattr(n, "handlers", []):
                    yield from top(handler.body)
            elif not isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
                yield n

    graph: dict[str, set[str]] = {}
    for name, (package, _, tree) in modules.items():
        edges = graph.setdefault(name, set())
        for node in top(tree.body):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                target = _target(name, package, node)
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    edges.add(sub if sub in modules else target)
        edges &= set(modules) - {name}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycle = [*path[path.index(name) :], name]
            raise AssertionError(" -> ".join(cycle))
        if name in done:
            return
        for other in sorted(graph[name]):
            visit(other, [*path, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_no_module_outside_model_is_over_450_lines() -> None:
    """Issue 28: a module outside ``model/`` (one file per architecture) that
    grows past 450 lines holds more than one job: split it by meaning."""
    root = Path(structllm.__file__).parent
    over = {}
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        lines = len(path.read_text().splitlines())
        if not name.startswith("model/") and lines > 450:
            over[name] = lines
    assert over == {}
