"""Build the training corpus of the built-in ``tiny`` model (run once; the
result, tools/tiny_corpus/, is committed, so training never depends on what a
machine happens to have installed).

Sources, all of them free to copy verbatim, recorded in SOURCES.md:

- licence texts: Debian's /usr/share/common-licenses (Apache-2.0, Artistic,
  BSD, CC0-1.0, MPL-2.0), Python's own LICENSE.txt (PSF), and the distinct
  MIT-style LICENSE files of the Python packages installed in the venv that
  runs this (each is the MIT licence with its copyright line);
- the docstrings of a fixed list of Python standard-library modules (PSF
  licence), prose paragraphs only.

Usage: python tools/build_tiny_corpus.py [--out tools/tiny_corpus]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
import sysconfig
from pathlib import Path

COMMON = ("Apache-2.0", "Artistic", "BSD", "CC0-1.0", "MPL-2.0")
STDLIB = [
    "abc",
    "argparse",
    "array",
    "asyncio",
    "base64",
    "bisect",
    "calendar",
    "collections",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email",
    "enum",
    "fractions",
    "functools",
    "glob",
    "gzip",
    "hashlib",
    "heapq",
    "hmac",
    "html",
    "http.client",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "logging",
    "math",
    "mimetypes",
    "operator",
    "os",
    "pathlib",
    "pickle",
    "pprint",
    "queue",
    "random",
    "re",
    "sched",
    "secrets",
    "selectors",
    "shelve",
    "shlex",
    "shutil",
    "signal",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "time",
    "timeit",
    "tokenize",
    "traceback",
    "typing",
    "unittest",
    "urllib.parse",
    "uuid",
    "warnings",
    "weakref",
    "zipfile",
    "zlib",
]


def _paragraphs(text: str) -> list[str]:
    out = []
    for p in re.split(r"\n\s*\n", text):
        p = " ".join(p.split())
        letters = sum(ch.isalpha() or ch == " " for ch in p)
        # prose: long enough, mostly letters, not a code sample or a table
        if len(p) >= 80 and letters / len(p) > 0.85 and ">>>" not in p:
            out.append(p)
    return out


def _docstrings(name: str) -> list[str]:
    module = importlib.import_module(name)
    docs = [inspect.getdoc(module) or ""]
    for attr, value in sorted(vars(module).items()):
        if attr.startswith("_") or getattr(value, "__module__", name) != name:
            continue
        docs.append(inspect.getdoc(value) or "")
        if inspect.isclass(value):
            for m, member in sorted(vars(value).items()):
                if not m.startswith("_") and callable(member):
                    docs.append(inspect.getdoc(member) or "")
    seen: set[str] = set()
    return [p for d in docs for p in _paragraphs(d) if not (p in seen or seen.add(p))]


def _mit_licences() -> dict[str, str]:
    site = Path(sysconfig.get_paths()["purelib"])
    found: dict[str, str] = {}
    for file in sorted(site.glob("*.dist-info/**/LICEN[CS]E*")):
        if not file.is_file():
            continue
        text = file.read_text(errors="replace").strip()
        if "Permission is hereby granted, free of charge" in text and len(text) < 4000:
            package = file.relative_to(site).parts[0].split("-")[0]
            found.setdefault(text, package)
    return {package: text for text, package in found.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(Path(__file__).parent / "tiny_corpus"))
    ns = p.parse_args(argv)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    sources = ["# Sources of the tiny model's corpus", ""]
    sources.append(
        f"Built by `python tools/build_tiny_corpus.py` with Python {sys.version.split()[0]}."
    )
    sources.append("")

    licences = []
    for name in COMMON:
        text = Path("/usr/share/common-licenses", name).read_text().strip()
        licences.append(text)
        sources.append(
            f"- licences.txt: `{name}` from Debian's /usr/share/common-licenses"
        )
    psf = Path(sysconfig.get_paths()["stdlib"], "LICENSE.txt")
    if psf.exists():
        licences.append(psf.read_text().strip())
        sources.append("- licences.txt: Python's LICENSE.txt (PSF licence and history)")
    mit = _mit_licences()
    licences += mit.values()
    sources.append(
        f"- licences.txt: the MIT licence as shipped by {len(mit)} Python packages: "
        + ", ".join(sorted(mit))
    )
    (out / "licences.txt").write_text("\n\n\n".join(licences) + "\n")

    docs = []
    for name in STDLIB:
        docs += _docstrings(name)
    (out / "docstrings.txt").write_text("\n\n".join(docs) + "\n")
    sources.append(
        f"- docstrings.txt: {len(docs)} prose paragraphs of the docstrings of "
        f"{len(STDLIB)} standard-library modules (PSF licence): " + ", ".join(STDLIB)
    )
    (out / "SOURCES.md").write_text("\n".join(sources) + "\n")
    for f in ("licences.txt", "docstrings.txt"):
        print(f, (out / f).stat().st_size, "bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
