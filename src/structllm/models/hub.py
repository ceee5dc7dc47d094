"""Hugging Face Hub repo ids as model references, through ``huggingface_hub``.

``owner/name`` (or ``owner/name@revision``) that is not a local path names a
Hub repository. :func:`hub_snapshot` asks ``huggingface_hub`` for a snapshot
of the files structllm reads (configs, tokenizer, safetensors, GGUF), so its
cache (``HF_HOME``, ``HF_HUB_CACHE``), its offline mode
(``HF_HUB_OFFLINE=1``: the cache alone, no network) and its token apply
unchanged. ``huggingface_hub`` is imported here only.
"""

from __future__ import annotations

import re
from pathlib import Path

from structllm.errors import ModelLoadError

__all__ = ["hub_snapshot", "parse_repo_id"]

_REPO_ID = re.compile(
    r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)"
    r"(?:@(?P<revision>[A-Za-z0-9._/-]+))?$"
)

#: what structllm reads from a repository; nothing else is downloaded
ALLOW_PATTERNS = [
    "*.json",
    "*.jinja",
    "*.safetensors",
    "*.gguf",
    "tokenizer.model",
]


def parse_repo_id(reference: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` if ``reference`` has a repo id's form, else None."""
    if reference.startswith((".", "/", "~")) or reference.endswith(".gguf"):
        return None
    m = _REPO_ID.match(reference)
    if m is None or ".." in reference:
        return None
    return m["repo"], m["revision"]


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The local directory of ``repo_id`` at ``revision``, from the Hub's cache
    or (online) downloaded into it."""
    try:
        import huggingface_hub
        from huggingface_hub.errors import HFValidationError
    except ImportError as exc:  # pragma: no cover - a dependency
        raise ModelLoadError(
            f"{repo_id!r} is not a local path, and reading Hugging Face Hub "
            "repositories needs huggingface_hub (pip install huggingface_hub)"
        ) from exc
    where = f"{repo_id}@{revision}" if revision else repo_id
    try:
        path = huggingface_hub.snapshot_download(
            repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS
        )
    except HFValidationError as exc:
        raise ModelLoadError(f"{where!r} is not a valid repo id: {exc}") from exc
    except Exception as exc:  # offline misses, 401/404, network errors
        offline = "HF_HUB_OFFLINE is set and " if _offline() else ""
        raise ModelLoadError(
            f"model {where!r} is not a local path and the Hugging Face Hub could "
            f"not provide it: {offline}{type(exc).__name__}: {exc}"
        ) from exc
    return Path(path)


def _offline() -> bool:
    import huggingface_hub.constants as constants

    return bool(constants.HF_HUB_OFFLINE)
