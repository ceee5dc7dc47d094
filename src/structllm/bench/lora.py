"""Random PEFT LoRA adapters for a model, to benchmark serving many of them.

    python -m structllm.bench.lora MODEL DIR [--count 4] [--rank 8]

writes ``--count`` adapters (``DIR/a0``, ``DIR/a1``, ...) of rank ``--rank``
on every projection (q/k/v/o, gate/up/down) of ``MODEL`` (a built-in such
as ``smollm2``, a checkpoint directory or a GGUF file: only its config is
read) and prints them as ``structllm serve --lora-modules``' arguments
(``a0=DIR/a0 a1=DIR/a1 ...``). Their weights are random: A scaled by
``1/sqrt(in_features)``, B small but not zero (PEFT starts B at zero, and a
no-op adapter would measure nothing); each adapter its own seed.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import numpy as np
import safetensors.numpy

from structllm.model.config import ModelConfig
from structllm.model.loader import hf_tensor_shapes
from structllm.models import resolve_model

__all__ = ["PROJECTIONS", "write_random_adapter", "write_random_adapters"]

#: PEFT's target module names, and the block of a decoder layer each is in
PROJECTIONS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def write_random_adapter(
    directory: Path, config: ModelConfig, *, rank: int, seed: int
) -> None:
    """A random PEFT adapter of ``rank`` for ``config``'s model in
    ``directory`` (created; it must not exist)."""
    shapes = hf_tensor_shapes(config)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for name, block in PROJECTIONS.items():
            module = f"model.layers.{layer}.{block}.{name}"
            out_f, in_f = shapes[module + ".weight"]
            key = f"base_model.model.{module}.lora_"
            tensors[key + "A.weight"] = (  # (r, in)
                rng.standard_normal((rank, in_f)) / np.sqrt(in_f)
            ).astype(np.float32)
            tensors[key + "B.weight"] = (  # (out, r)
                rng.standard_normal((out_f, rank)) * 0.01
            ).astype(np.float32)
    directory.mkdir(parents=True)
    safetensors.numpy.save_file(tensors, str(directory / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(PROJECTIONS),
        "bias": "none",
    }
    (directory / "adapter_config.json").write_text(json.dumps(adapter_config))


def write_random_adapters(
    model: str | Path, directory: Path, *, count: int, rank: int = 8
) -> dict[str, Path]:
    """``count`` random adapters for ``model`` under ``directory``: name -> path
    (``a0``, ``a1``, ...; adapter ``i`` has seed ``i``)."""
    path = resolve_model(model)
    if path is None:
        raise ValueError(f"{model!r} has no config to read; name a checkpoint")
    config = ModelConfig.from_path(path)
    written = {}
    for i in range(count):
        written[f"a{i}"] = directory / f"a{i}"
        write_random_adapter(written[f"a{i}"], config, rank=rank, seed=i)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a built-in name, checkpoint or GGUF file")
    parser.add_argument("directory", type=Path, help="where to write them")
    parser.add_argument("--count", type=int, default=4, help="adapters to write")
    parser.add_argument("--rank", type=int, default=8, help="their rank (r)")
    args = parser.parse_args(argv)
    written = write_random_adapters(
        args.model, args.directory, count=args.count, rank=args.rank
    )
    print(" ".join(shlex.quote(f"{name}={path}") for name, path in written.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
