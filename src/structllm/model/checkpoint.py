"""Write random-weight checkpoints in Hugging Face layout (for tests, benches)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from structllm.model.config import ModelConfig

__all__ = ["write_random_checkpoint"]


def write_random_checkpoint(
    directory: Path,
    config: ModelConfig,
    *,
    seed: int = 0,
    dtype: str = "float32",
    shards: int = 1,
    legacy_config: bool = False,
) -> None:
    """Write ``config.json`` and random weights as safetensors.

    ``config.json`` is in the current transformers form, or with
    ``legacy_config`` in the 4.x form (``rope_theta``, ``torch_dtype``).

    ``shards > 1`` splits the tensors over ``model-0000i-of-0000n.safetensors``
    with a ``model.safetensors.index.json``, as large HF checkpoints are.
    ``dtype`` is float32, float16 or bfloat16 (bfloat16 written by Paddle,
    since numpy has no such type).
    """
    directory.mkdir(parents=True, exist_ok=True)
    hf = config.to_hf(legacy=legacy_config)
    hf["torch_dtype" if legacy_config else "dtype"] = dtype
    (directory / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    from structllm.model.loader import random_hf_tensors  # Paddle: only when used

    tensors = dict(random_hf_tensors(config, seed))
    names = list(tensors)
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    groups = [names[i::shards] for i in range(shards)] if shards > 1 else [names]
    files = (
        [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
        if shards > 1
        else ["model.safetensors"]
    )
    for group, file in zip(groups, files, strict=True):
        _save({n: tensors[n] for n in group}, directory / file, dtype)
    if shards > 1:
        weight_map = {
            n: f for group, f in zip(groups, files, strict=True) for n in group
        }
        total = sum(t.size * (4 if dtype == "float32" else 2) for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(
            json.dumps(index, indent=2)
        )


def _save(tensors: dict[str, np.ndarray], file: Path, dtype: str) -> None:
    metadata = {"format": "pt"}
    if dtype == "bfloat16":
        import safetensors.paddle

        from structllm.model._paddle import paddle

        safetensors.paddle.save_file(
            {n: paddle.to_tensor(t).astype("bfloat16") for n, t in tensors.items()},
            str(file),
            metadata=metadata,
        )
        return
    if dtype not in ("float32", "float16"):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")
    import safetensors.numpy

    safetensors.numpy.save_file(
        {n: np.ascontiguousarray(t.astype(dtype)) for n, t in tensors.items()},
        str(file),
        metadata=metadata,
    )
