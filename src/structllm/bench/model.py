"""The bench model and the flags every offline benchmark shares.

The default checkpoint is the 27.8M-parameter random Llama of
docs/benchmarks.md (hidden 512, 8 layers, float32), written to a temporary
directory unless ``--model`` names one; the engine flags are EngineConfig's
fields (:func:`structllm.config.add_arguments`) with bench defaults.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from structllm.config import EngineConfig, add_arguments

__all__ = [
    "add_bench_model_args",
    "bench_engine_args",
    "bench_model",
    "write_bench_checkpoint",
]

#: the engine settings benchmarks take from the command line
_ENGINE_FLAGS = ("max_num_seqs", "max_num_batched_tokens", "num_threads")


def add_bench_model_args(p: argparse.ArgumentParser) -> None:
    """``--model`` or the shape of the checkpoint to write; the engine's limits."""
    p.add_argument("--model", default=None, help="checkpoint dir (default: make one)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--seed", type=int, default=0, help="of the weights and workload")
    add_arguments(p, EngineConfig, only=_ENGINE_FLAGS, defaults={"max_num_seqs": 16})


def bench_engine_args(ns: argparse.Namespace, threads: int) -> dict[str, Any]:
    """EngineConfig fields for a bench engine: the flags, room for long runs."""
    return {
        "max_num_seqs": ns.max_num_seqs,
        "max_num_batched_tokens": ns.max_num_batched_tokens,
        "num_threads": threads,
        "max_model_len": 4096,
        "kv_cache_memory": 2 << 30,
    }


def bench_model(ns: argparse.Namespace, tmp: Path) -> str:
    """``--model``, or a random checkpoint of the ``--hidden ...`` shape in ``tmp``."""
    if ns.model is not None:
        return str(ns.model)
    model = str(tmp / "model")
    write_bench_checkpoint(
        model,
        hidden=ns.hidden,
        layers=ns.layers,
        heads=ns.heads,
        kv_heads=ns.kv_heads,
        intermediate=ns.intermediate,
        seed=ns.seed,
    )
    return model


def write_bench_checkpoint(
    directory: str | Path,
    *,
    hidden: int = 512,
    layers: int = 8,
    heads: int = 8,
    kv_heads: int = 8,
    intermediate: int = 1536,
    seed: int = 0,
) -> None:
    """A random Llama checkpoint; the defaults are the 27.8M bench model."""
    from structllm.testing.checkpoints import make_tiny_model

    make_tiny_model(
        directory,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=intermediate,
        max_position_embeddings=4096,
        seed=seed,
    )
