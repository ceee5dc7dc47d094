"""The documentation tells the truth: its code runs and the tests it cites exist.

- Every ```` ```python ```` block in ``README.md`` and ``docs/**/*.md`` runs
  as a program in a fresh interpreter. A block with top-level ``await`` /
  ``async with`` (the README's style) runs under asyncio and under trio.
  ``"path/to/model"`` and ``"path/to/hf-checkpoint"`` stand for a checkpoint
  directory: the test writes a tiny one there. Blocks that only include a
  file (``--8<--``) are the programs in ``docs/examples/``, which
  ``test_exports.py`` runs.
- The shell commands of ``docs/getting-started.md`` run: every
  ``.venv/bin/structllm ...`` it shows (``serve`` on a free port), and its
  ``curl`` request against that server.
- Every ``tests/test_*.py::test_name`` a page names (the cancellation
  contract cites one per row) is a test that exists.

``nox -s docs`` builds the site itself with warnings as errors.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
PLACEHOLDERS = ('"path/to/model"', '"path/to/hf-checkpoint"')
CITED = re.compile(r"tests/(test_\w+\.py)::(test_\w+)")
SHELL = re.compile(r"^```bash\n(.*?)^```$", re.MULTILINE | re.DOTALL)
GETTING_STARTED = ROOT / "docs" / "getting-started.md"

RUN_ASYNC = """\
import ast, sys
import anyio

SOURCE = {source!r}
code = compile(SOURCE, "<doc>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


async def main() -> None:
    result = eval(code, {{"__name__": "__main__"}})
    if result is not None:
        await result


anyio.run(main, backend=sys.argv[1])
"""


def _blocks() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for i, match in enumerate(BLOCK.finditer(page.read_text())):
            source = match.group(1)
            if source.strip().startswith("--8<--"):
                continue
            found.append((f"{page.relative_to(ROOT)}#{i}", source))
    return found


def _needs_loop(source: str) -> bool:
    try:
        compile(source, "<doc>", "exec", dont_inherit=True)
    except SyntaxError:
        flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
        compile(source, "<doc>", "exec", flags=flags, dont_inherit=True)  # or broken
        return True
    return False


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from structllm.testing.checkpoints import make_tiny_model

    path = tmp_path_factory.mktemp("docs") / "model"
    make_tiny_model(path, max_position_embeddings=4096)
    return path


BLOCKS = _blocks()


@pytest.mark.parametrize(("where", "source"), BLOCKS, ids=[w for w, _ in BLOCKS])
def test_code_block_runs(where: str, source: str, checkpoint: Path) -> None:
    for placeholder in PLACEHOLDERS:
        source = source.replace(placeholder, repr(str(checkpoint)))
    if _needs_loop(source):
        runs = [["-c", RUN_ASYNC.format(source=source), b] for b in ("asyncio", "trio")]
    else:
        runs = [["-c", source]]
    for args in runs:
        proc = subprocess.run(
            [sys.executable, *args],
            capture_output=True,
            text=True,
            timeout=180,
            cwd=checkpoint.parent,
        )
        assert proc.returncode == 0, f"{where} {args[2:]}:\n{proc.stderr[-3000:]}"


def test_pages_have_code_blocks() -> None:
    # the pattern above must keep matching the pages' fences
    assert len(BLOCKS) >= 8


def test_cited_tests_exist() -> None:
    cited = {(f, t) for page in PAGES for f, t in CITED.findall(page.read_text())}
    assert len(cited) >= 20
    missing = sorted(
        f"tests/{f}::{t}"
        for f, t in cited
        if not re.search(
            rf"^(async )?def {t}\(", (ROOT / "tests" / f).read_text(), re.MULTILINE
        )
    )
    assert not missing, f"docs cite tests that do not exist: {missing}"


def _shell_commands(page: Path) -> list[str]:
    """The page's bash blocks, one command a line (backslash continuations joined)."""
    blocks = SHELL.findall(page.read_text())
    return [line for b in blocks for line in b.replace("\\\n", " ").splitlines()]


def _structllm(args: list[str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "structllm.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_getting_started_commands_run() -> None:
    lines = _shell_commands(GETTING_STARTED)
    found = [
        m for line in lines for m in re.findall(r"\.venv/bin/structllm ([^)\n]*)", line)
    ]
    commands = [shlex.split(c) for c in found]
    assert {c[0] for c in commands} >= {"--version", "generate", "completion", "serve"}
    for args in commands:
        if args[0] == "serve":
            continue
        proc = _structllm(args)
        assert proc.returncode == 0, (args, proc.stderr[-2000:])
        assert proc.stdout.strip(), args  # it printed something
    serve = next(c for c in commands if c[0] == "serve")
    port = serve.index("--port") + 1
    serve = [*serve[:port], "0", *serve[port + 1 :]]
    (curl,) = [line for line in lines if line.startswith("curl")]
    url, body = re.search(r"curl -s (\S+).*-d '(.*)'", curl).groups()  # type: ignore[union-attr]
    proc = subprocess.Popen(
        [sys.executable, "-m", "structllm.cli", *serve],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # ends when the server exits
            if m := re.search(r"serving .* on (http://\S+)", line):
                break
        else:
            pytest.fail(f"structllm serve exited with {proc.wait()}")
        target = url.replace("http://127.0.0.1:8000", m.group(1))
        r = httpx.post(target, json=json.loads(body), timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()
