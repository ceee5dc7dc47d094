"""Shared fixtures: both AnyIO backends, and a trained BPE tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from structllm.text import HFTokenizer, write_byte_level_bpe_tokenizer


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trained byte-level BPE tokenizer directory (read-only: copy to change)."""
    directory = tmp_path_factory.mktemp("bpe")
    write_byte_level_bpe_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def bpe(bpe_dir: Path) -> HFTokenizer:
    return HFTokenizer.from_directory(bpe_dir)
