"""Apply each deliberate bug of tools/mutants.toml to a copy of the tree; fail
if the tests it names pass with it (the mutant "survives").

    python tools/mutants.py                  # every mutant
    python tools/mutants.py NAME [NAME ...]  # some of them
    python tools/mutants.py --list
    python tools/mutants.py --check          # each original found exactly once

Run by ``nox -s mutants`` (not by CI: minutes on a small machine). The copy
is the tracked and untracked-but-not-ignored files of this checkout, so
uncommitted changes count. One mutant at a time, in that copy; the tests run
with ``-x -p no:randomly`` and the copy's ``src`` first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LIST = ROOT / "tools" / "mutants.toml"


def load() -> list[dict[str, Any]]:
    mutants: list[dict[str, Any]] = tomllib.loads(LIST.read_text())["mutant"]
    names = [m["name"] for m in mutants]
    if len(set(names)) != len(names):
        raise SystemExit("tools/mutants.toml: mutant names must be unique")
    for m in mutants:
        missing = {"name", "file", "original", "replacement", "tests", "why"} - set(m)
        if missing:
            raise SystemExit(f"mutant {m.get('name')!r} lacks {sorted(missing)}")
    return mutants


def check(mutants: list[dict[str, Any]], root: Path) -> list[str]:
    """Problems: an original not found exactly once, a test file missing."""
    problems = []
    for m in mutants:
        count = (root / m["file"]).read_text().count(m["original"])
        if count != 1:
            problems.append(f"{m['name']}: original found {count} times in {m['file']}")
        for test in m["tests"]:
            if not (root / test.split("::")[0]).is_file():
                problems.append(f"{m['name']}: no test file {test}")
    return problems


def copy_tree(dest: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for name in filter(None, files):
        src = ROOT / os.fsdecode(name)
        if src.is_file():
            target = dest / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)


def run_one(m: dict[str, Any], tree: Path, python: str) -> tuple[str, str, float]:
    """("killed" | "SURVIVED" | "error", the failing tests or the output, seconds)."""
    path = tree / m["file"]
    original = path.read_text()
    path.write_text(original.replace(m["original"], m["replacement"], 1))
    cmd = [
        python,
        "-m",
        "pytest",
        "-x",
        "-q",
        "-p",
        "no:randomly",
        "-p",
        "no:cacheprovider",
    ]
    cmd += ["-rf", *m["tests"]]
    if m.get("k"):
        cmd += ["-k", m["k"]]
    env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}{os.pathsep}{tree}"}
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    finally:
        path.write_text(original)
    took = time.monotonic() - start
    out = done.stdout + done.stderr
    if done.returncode == 0:
        return "SURVIVED", "", took
    if done.returncode == 1:  # tests failed: the mutant is caught
        failed = [ln.split()[1] for ln in out.splitlines() if ln.startswith("FAILED ")]
        return "killed", ", ".join(failed) or "(a failure)", took
    return "error", out[-2000:], took  # 5: nothing collected; 2-4: usage, crash


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--python", default=sys.executable)
    ns = parser.parse_args()
    mutants = load()
    if ns.list:
        for m in mutants:
            print(f"{m['name']:36} {m['file']}  ({', '.join(m['tests'])})")
        return 0
    problems = check(mutants, ROOT)
    if problems or ns.check:
        print(
            "\n".join(problems) or f"{len(mutants)} mutants, each original found once"
        )
        return 1 if problems else 0
    unknown = set(ns.names) - {m["name"] for m in mutants}
    if unknown:
        parser.error(f"no such mutant: {', '.join(sorted(unknown))}")
    chosen = [m for m in mutants if not ns.names or m["name"] in ns.names]
    results = []
    with tempfile.TemporaryDirectory(prefix="structllm-mutants-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        for m in chosen:
            verdict, detail, took = run_one(m, tree, ns.python)
            results.append((m, verdict))
            print(f"{verdict:8} {m['name']:36} {took:6.1f}s  {detail}", flush=True)
            if verdict == "SURVIVED":
                print(f"         why it matters: {m['why']}", flush=True)
    bad = [m["name"] for m, v in results if v != "killed"]
    print(f"\n{len(results) - len(bad)} of {len(results)} mutants killed")
    if bad:
        print("not killed: " + ", ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
