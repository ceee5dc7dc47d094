"""Embeddings: how a checkpoint pools its hidden states, and the pooling.

A pooling request (``CoreRequest.pooling``) is prefilled like any prompt and
finished at the end of its prefill: no sampling, no decode. Its embedding is
pooled from the model's last hidden states (after the final norm, the rows
the LM head would read): the last token's row, or the mean of every prompt
position's, then optionally scaled to unit length (L2).

What a checkpoint asks for comes from its sentence-transformers files, as
that library reads them: ``modules.json`` lists the modules in order, a
``sentence_transformers.models.Pooling`` module's ``config.json`` (usually
``1_Pooling/config.json``) says the mode, and a
``sentence_transformers.models.Normalize`` module after it normalises. A
GGUF file says it with llama.cpp's ``{arch}.pooling_type`` (1 mean, 3 last;
llama.cpp's server normalises by default). Without either: the last token,
normalised (what vLLM does for a decoder model). A mode this module does not
compute (max, CLS, weighted mean, a ``Dense`` projection after the pooling)
is recorded with its reason, so generation with the checkpoint still works
and an embedding request that relies on the default is refused, naming it.
Fewer ``dimensions`` (the first values, then normalised) are served only
for a model trained for them (Matryoshka: config.json's ``is_matryoshka`` or
``matryoshka_dimensions``, which vLLM reads); another model's first values
are no embedding, so that is refused, as vLLM and OpenAI refuse it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import attrs
import msgspec

from structllm.errors import InvalidRequestError, ModelLoadError

if TYPE_CHECKING:  # the front end reads this module's requests without numpy
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "POOLING_METHODS",
    "Pooling",
    "PoolingConfig",
    "PoolingMethod",
    "finish_embedding",
    "pooling_request",
    "read_pooling_config",
]

PoolingMethod = Literal["last", "mean"]
#: the pooling methods the engine computes
POOLING_METHODS: tuple[PoolingMethod, ...] = ("last", "mean")

_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
#: sentence-transformers' modules that are no-ops for the output here
_ST_NEUTRAL = frozenset(
    {"sentence_transformers.models.Transformer", "sentence_transformers.models.Dropout"}
)
#: llama.cpp's enum llama_pooling_type
_GGUF_POOLING: Mapping[int, PoolingMethod | str] = {
    -1: "last",  # unspecified: the model's default
    0: "last",  # none: llama.cpp returns every token's; the engine pools the last
    1: "mean",
    2: "cls",
    3: "last",
    4: "rank",
}


class Pooling(msgspec.Struct, frozen=True, array_like=True):
    """What a pooling request asks for; None: the checkpoint's default."""

    method: PoolingMethod | None = None
    normalize: bool | None = None
    #: keep the first ``dimensions`` values (Matryoshka), renormalised if
    #: normalising; None: all of them
    dimensions: int | None = None


def pooling_request(
    method: object = None, normalize: object = None, dimensions: object = None
) -> Pooling:
    """A caller's pooling arguments, checked: InvalidRequestError names the
    argument (``pooling``, ``normalize``, ``dimensions``)."""
    if method is not None and method not in POOLING_METHODS:
        raise InvalidRequestError(
            f"pooling must be one of {', '.join(POOLING_METHODS)} or None "
            f"(the model's own), got {method!r:.40}",
            field="pooling",
        )
    if normalize is not None and not isinstance(normalize, bool):
        raise InvalidRequestError(
            f"normalize must be true, false or None, got {normalize!r:.40}",
            field="normalize",
        )
    if dimensions is not None and (
        isinstance(dimensions, bool)
        or not isinstance(dimensions, int)
        or dimensions < 1
    ):
        raise InvalidRequestError(
            f"dimensions must be a positive integer or None, got {dimensions!r:.40}",
            field="dimensions",
        )
    return Pooling(method, normalize, dimensions)


@attrs.frozen
class PoolingConfig:
    """A checkpoint's default pooling, and where it was read."""

    method: PoolingMethod
    normalize: bool
    #: the file (or "default") it came from, for messages
    source: str = "default"
    #: why the checkpoint's own pooling cannot be computed (None: it can);
    #: requests that rely on the default are then refused with it
    unsupported: str | None = None
    #: trained so that a vector's first values are an embedding too
    #: (config.json's ``is_matryoshka`` or ``matryoshka_dimensions``, as
    #: vLLM reads them); only then may a request ask for fewer ``dimensions``
    matryoshka: bool = False
    #: the sizes it was trained for (None: any)
    matryoshka_dimensions: tuple[int, ...] | None = None

    def resolve(self, pooling: Pooling, hidden_size: int) -> Pooling:
        """``pooling`` with the defaults filled in; InvalidRequestError if the
        default is needed and not computable, or ``dimensions`` does not fit
        the model (a size it was not trained for, as vLLM refuses it)."""
        if pooling.method is None and self.unsupported is not None:
            raise InvalidRequestError(
                f"pooling: {self.unsupported}; ask for 'last' or 'mean' by name",
                field="pooling",
            )
        d = pooling.dimensions
        if d is not None and not 1 <= d <= hidden_size:
            raise InvalidRequestError(
                f"dimensions must be between 1 and the model's {hidden_size}, got {d}",
                field="dimensions",
            )
        if d is not None and d != hidden_size:
            if not self.matryoshka:
                raise InvalidRequestError(
                    f"dimensions: this model is not a Matryoshka model (its "
                    f"config.json sets neither is_matryoshka nor "
                    f"matryoshka_dimensions), so its first {d} values are no "
                    "embedding; leave dimensions out",
                    field="dimensions",
                )
            sizes = self.matryoshka_dimensions
            if sizes is not None and d not in sizes:
                raise InvalidRequestError(
                    f"dimensions must be one of the model's matryoshka_dimensions "
                    f"{list(sizes)} (or {hidden_size}), got {d}",
                    field="dimensions",
                )
        return Pooling(
            self.method if pooling.method is None else pooling.method,
            self.normalize if pooling.normalize is None else pooling.normalize,
            d,
        )


def read_pooling_config(path: Path | None) -> PoolingConfig:
    """The default pooling of the checkpoint at ``path`` (a directory or a
    ``.gguf`` file; None: a built-in random model, last token normalised)."""
    if path is None or not path.exists():
        return PoolingConfig("last", True)
    if path.is_file():
        return _gguf_pooling(path)
    matryoshka = _matryoshka(path / "config.json")
    modules_path = path / "modules.json"
    if not modules_path.exists():
        return attrs.evolve(PoolingConfig("last", True), **matryoshka)
    try:
        config = _st_config(path, modules_path)
    except ModelLoadError as exc:  # generation does not need these files
        config = PoolingConfig("last", True, str(modules_path), str(exc))
    return attrs.evolve(config, **matryoshka)


def _matryoshka(config_path: Path) -> dict[str, Any]:
    """``matryoshka`` and ``matryoshka_dimensions`` from config.json (none
    when it is unreadable: the loader says why)."""
    try:
        config = _read_json(config_path)
    except ModelLoadError:
        return {}
    if not isinstance(config, dict):
        return {}
    sizes = config.get("matryoshka_dimensions")
    ok = isinstance(sizes, list) and all(
        isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes
    )
    return {
        "matryoshka": config.get("is_matryoshka") is True or bool(ok and sizes),
        "matryoshka_dimensions": tuple(sizes) if ok and sizes else None,
    }


def _st_config(path: Path, modules_path: Path) -> PoolingConfig:
    modules = _read_json(modules_path)
    if not isinstance(modules, list):
        raise ModelLoadError(f"{modules_path}: expected a list of modules")
    method: PoolingMethod | None = None
    normalize = False
    source = str(modules_path)
    unsupported = None
    for entry in sorted(modules, key=lambda m: _int(m, "idx", modules_path)):
        kind = entry.get("type")
        if kind == _ST_POOLING:
            config_path = path / str(entry.get("path", "")) / "config.json"
            source = str(config_path)
            method, reason = _st_pooling(_read_json(config_path), config_path)
            unsupported = unsupported or reason
        elif kind == _ST_NORMALIZE:
            normalize = True
        elif kind not in _ST_NEUTRAL and unsupported is None:
            unsupported = (
                f"{modules_path} has a {kind} module, which structllm does not run"
            )
    if method is None:
        return PoolingConfig("last", normalize, source, unsupported)
    return PoolingConfig(method, normalize, source, unsupported)


def _st_pooling(config: Any, where: Path) -> tuple[PoolingMethod | None, str | None]:
    """(the method, or None with the reason) of a Pooling module's config."""
    if not isinstance(config, dict):
        raise ModelLoadError(f"{where}: expected a JSON object")
    modes = sorted(
        k.removeprefix("pooling_mode_")
        for k, v in config.items()
        if k.startswith("pooling_mode_") and v is True
    )
    if config.get("include_prompt", True) is not True:
        return None, f"{where} sets include_prompt false, which structllm lacks"
    if modes == ["lasttoken"]:
        return "last", None
    if modes == ["mean_tokens"]:
        return "mean", None
    return None, f"{where} asks for pooling {'+'.join(modes) or 'none'}"


def _gguf_pooling(path: Path) -> PoolingConfig:
    from structllm.formats.gguf import GGUFFile

    with GGUFFile.open(path) as f:
        arch = f.metadata.get("general.architecture")
        key = f"{arch}.pooling_type"
        value = f.metadata.get(key, -1)
    method = _GGUF_POOLING.get(value) if isinstance(value, int) else None
    if method == "mean":
        return PoolingConfig("mean", True, f"{path.name}: {key}")
    if method == "last":
        return PoolingConfig("last", True, f"{path.name}: {key}")
    return PoolingConfig(
        "last", True, str(path), f"{path.name}: {key}={value!r} is not computed"
    )


def finish_embedding(
    pooled: npt.NDArray[np.float32], pooling: Pooling
) -> npt.NDArray[np.float32]:
    """``pooled`` (H,) truncated to ``dimensions`` and, if asked, scaled to
    unit L2 norm (after truncating, as sentence-transformers' Matryoshka
    models are used): float32."""
    import numpy as np  # the core's, loaded there already

    v = np.asarray(pooled, dtype=np.float64)
    if pooling.dimensions is not None:
        v = v[: pooling.dimensions]
    if pooling.normalize:
        v = v / max(float(np.linalg.norm(v)), 1e-12)  # torch's F.normalize eps
    return v.astype(np.float32)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def _int(entry: Any, key: str, where: Path) -> int:
    if not isinstance(entry, dict):
        raise ModelLoadError(f"{where}: each module must be a JSON object")
    value = entry.get(key, 0)
    return value if isinstance(value, int) else 0
