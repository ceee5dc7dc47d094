"""``structllm completion bash``: the script completes what the parser accepts."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from structllm.cli import build_parser
from structllm.completion import bash_script

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _complete(*words: str) -> list[str]:
    """COMPREPLY for the command line ``structllm WORDS`` (the last is the cursor)."""
    line = " ".join(["structllm", *words])
    program = (
        bash_script(build_parser())
        + f"\nCOMP_WORDS=({line})\n"
        + ("COMP_WORDS+=('')\n" if words and words[-1] == "" else "")
        + "COMP_CWORD=$((${#COMP_WORDS[@]} - 1))\n"
        + "_structllm_complete\nprintf '%s\\n' \"${COMPREPLY[@]}\"\n"
    )
    out = subprocess.run(
        ["bash", "--norc", "-c", program], capture_output=True, text=True, check=True
    )
    return [w for w in out.stdout.splitlines() if w]


def test_script_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", "-c", bash_script(build_parser())], check=True)


def test_commands_and_subcommands() -> None:
    assert set(_complete("")) >= {"generate", "serve", "bench", "inspect"}
    assert _complete("ser") == ["serve"]
    assert set(_complete("bench", "")) >= {"throughput", "serve", "prefix"}
    assert _complete("completion", "b") == ["bash"]


def test_flags_of_each_command() -> None:
    assert _complete("serve", "--max-num-s") == ["--max-num-seqs"]
    assert "--api-key" not in _complete("generate", "--")
    assert "--temperature" in _complete("generate", "--")
    assert "--temperature" not in _complete("serve", "--")
    assert "--request-rate" in _complete("bench", "serve", "--")


def test_choices_and_values() -> None:
    assert _complete("serve", "tiny", "--loop", "") == ["asyncio", "trio"]
    assert _complete("serve", "--model-backend", "e") == ["eager"]
    assert _complete("serve", "--port", "") == []  # a free value
    assert set(_complete("serve", "tiny")) >= {"tiny", "tiny-random"}
    after_switch = _complete("serve", "--no-enable-prefix-caching", "tin")
    assert set(after_switch) >= {"tiny", "tiny-random"}
