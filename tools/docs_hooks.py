"""MkDocs hooks: pages generated from the code, so they cannot drift from it.

``<!-- cli-reference -->`` in a page becomes the ``--help`` of every
``structllm`` command and subcommand, taken from the real argument parser.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

MARKER = "<!-- cli-reference -->"


def _subcommands(
    parser: argparse.ArgumentParser,
) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _sections(parser: argparse.ArgumentParser, name: str, level: int) -> list[str]:
    out = [
        f"{'#' * level} `{name}`",
        "",
        "```text",
        parser.format_help().rstrip(),
        "```",
        "",
    ]
    for sub, p in _subcommands(parser).items():
        out += _sections(p, f"{name} {sub}", level + 1)
    return out


def cli_reference() -> str:
    from structllm.cli import build_parser

    os.environ["COLUMNS"] = "88"  # argparse wraps help at the terminal width
    return "\n".join(_sections(build_parser(), "structllm", 2))


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, cli_reference())
    return markdown
