"""LoRA's two ways of adding each row's update, measured (model/lora.py).

    PYTHONPATH=src .venv/bin/python tools/bench_lora.py [--threads 1] [--rank 8]

For each shape (the bench model: hidden 512, 8 heads, intermediate 1536, 8
layers; SmolLM2-135M: hidden 576, 9 heads / 3 kv heads, intermediate 1536,
30 layers, vocab 49152), a batch of 16 decode rows: 4 on each of three
adapters (every projection targeted, rank ``--rank``) and 4 on none,
interleaved. Reports, median of ``--repeat`` runs:

- each projection (q/k/v, o, gate/up, down) alone: the base matmul, and the
  base plus the update by the kernel (``add_lora``, one call) and grouped
  (per adapter: gather, two matmuls, ``index_add_``);
- a whole decode step (the compiled-kernel decode path, random weights and
  cache): the model without LoRA, with LoRA but no row on an adapter, and
  the mixed batch by each method.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import attrs
import numpy as np

from structllm.model._paddle import paddle, set_num_threads
from structllm.model.attention import SequenceSlice
from structllm.model.config import ModelConfig, tiny_random_config
from structllm.model.llama import LAYER_PROJECTIONS, LlamaForCausalLM
from structllm.model.loader import build_model, random_hf_tensors
from structllm.model.lora import LoRAAdapter, LoRASlots, Method, enable_lora
from structllm.model.lora_peft import LoRAProjection, fuse_pieces

SHAPES = {
    "bench": {
        "hidden_size": 512,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "vocab_size": 512,
    },
    "smollm2": {
        "hidden_size": 576,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "vocab_size": 49152,
    },
}

ROWS = 16
CONTEXT = 64


def _config(shape: str) -> ModelConfig:
    return attrs.evolve(
        tiny_random_config(),
        architecture="LlamaForCausalLM",
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        **SHAPES[shape],
    )


def _adapter(config: ModelConfig, rank: int, seed: int) -> LoRAAdapter:
    """Every projection targeted, random A and B."""
    c = config
    rng = np.random.default_rng(seed)
    pieces = {
        "qkv": ((c.q_size, c.kv_size, c.kv_size), c.hidden_size),
        "o": ((c.hidden_size,), c.q_size),
        "gate_up": ((c.intermediate_size,) * 2, c.hidden_size),
        "down": ((c.hidden_size,), c.intermediate_size),
    }
    projections: dict[str, LoRAProjection] = {}
    for n in range(c.num_hidden_layers):
        for field, module in LAYER_PROJECTIONS.items():
            outs, d_in = pieces[field]
            pairs: list[tuple[np.ndarray, np.ndarray] | None] = [
                (
                    (rng.standard_normal((rank, d_in)) / np.sqrt(d_in)).astype(
                        np.float32
                    ),
                    (0.01 * rng.standard_normal((o, rank))).astype(np.float32),
                )
                for o in outs
            ]
            projections[f"model.layers.{n}.{module}"] = fuse_pieces(
                pairs, list(outs), 2.0
            )
    return LoRAAdapter(f"random-{seed}", rank, 2.0, projections)


def _median_us(fn: Callable[[], Any], repeat: int) -> float:
    for _ in range(max(3, repeat // 10)):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _rows() -> np.ndarray:
    return np.array([0, 1, 2, -1] * (ROWS // 4), np.int64)  # interleaved


def _per_projection(slots: LoRASlots, model: LlamaForCausalLM, repeat: int) -> None:
    rng = np.random.default_rng(1)
    layer = 0
    print(f"  {'projection':<10} {'base':>8} {'kernel':>8} {'grouped':>8}   (us)")
    for field, module in LAYER_PROJECTIONS.items():
        lin = slots.linears[f"model.layers.{layer}.{module}"]
        x = paddle.to_tensor(
            rng.standard_normal((ROWS, lin.in_features)).astype(np.float32)
        )
        out = paddle.empty([ROWS, lin.out_features], "float32")
        times = {"base": _median_us(partial(lin.base, x, out=out), repeat)}
        for method in ("kernel", "grouped"):
            slots.batch.method = method  # type: ignore[assignment]
            slots.set_rows(_rows())
            times[method] = _median_us(partial(lin, x, out=out), repeat)
        slots.set_rows(None)
        print(
            f"  {field:<10} {times['base']:8.1f} {times['kernel']:8.1f} "
            f"{times['grouped']:8.1f}"
        )


def _decode_step(model: LlamaForCausalLM) -> Callable[[], Any]:
    blocks_each = CONTEXT // 16 + 1
    caches = model.allocate_kv_cache(ROWS * blocks_each)
    seqs = [
        SequenceSlice(CONTEXT, 1, list(range(i * blocks_each, (i + 1) * blocks_each)))
        for i in range(ROWS)
    ]
    ids = paddle.to_tensor(np.arange(ROWS, dtype=np.int64) + 5)
    positions = paddle.to_tensor(np.full(ROWS, CONTEXT, np.int64))

    def step() -> Any:
        meta = model.attention.build_metadata(seqs)
        return model.compute_logits(model.forward(ids, positions, caches, meta))

    return step


def _time_unwrapped(
    model: LlamaForCausalLM, slots: LoRASlots, step: Callable[[], Any]
) -> float:
    """One step of the model with its projections unwrapped (no LoRA)."""
    layers = model.weights.layers
    wrapped = [{f: getattr(layer, f) for f in LAYER_PROJECTIONS} for layer in layers]
    for layer, fields in zip(layers, wrapped, strict=True):
        for f, lin in fields.items():
            setattr(layer, f, lin.base)
    try:
        start = time.perf_counter()
        step()
        return time.perf_counter() - start
    finally:
        for layer, fields in zip(layers, wrapped, strict=True):
            for f, lin in fields.items():
                setattr(layer, f, lin)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--repeat", type=int, default=200)
    p.add_argument("--step-repeat", type=int, default=30)
    ns = p.parse_args()
    set_num_threads(ns.threads)
    for shape in ns.shapes:
        config = _config(shape)
        model = build_model(
            config, dict(random_hf_tensors(config, seed=0)), block_size=16
        )
        assert isinstance(model, LlamaForCausalLM)
        step = _decode_step(model)
        for _ in range(3):
            step()  # warm
        slots = enable_lora(model, max_loras=4, max_lora_rank=ns.rank)
        for s in range(3):
            slots.load_adapter(s, _adapter(config, ns.rank, seed=s))
        print(
            f"{shape}: hidden {config.hidden_size}, intermediate "
            f"{config.intermediate_size}, {config.num_hidden_layers} layers; "
            f"{ROWS} rows: 3 adapters of rank {ns.rank} x 4 rows + 4 rows on none; "
            f"{ns.threads} thread(s)"
        )
        _per_projection(slots, model, ns.repeat)
        # the variants interleaved step by step: the machine's noise (other
        # processes on its cores) falls on all of them alike
        variants: dict[str, tuple[Method, np.ndarray | None]] = {
            "LoRA, no row on one": ("kernel", None),
            "mixed, kernel": ("kernel", _rows()),
            "mixed, grouped": ("grouped", _rows()),
        }
        samples: dict[str, list[float]] = {"no LoRA": [], **{v: [] for v in variants}}
        for _ in range(ns.step_repeat):
            for name, (method, rows) in variants.items():
                slots.batch.method = method
                slots.set_rows(rows)
                start = time.perf_counter()
                step()
                samples[name].append(time.perf_counter() - start)
            slots.set_rows(None)
            samples["no LoRA"].append(_time_unwrapped(model, slots, step))
        base_us = statistics.median(samples["no LoRA"]) * 1e6
        step_us = {n: statistics.median(t) * 1e6 for n, t in samples.items()}
        print(f"  decode step of {ROWS} (us, median of {ns.step_repeat}):")
        for name, us in step_us.items():
            print(f"    {name:<22} {us:10.0f}  {us / base_us - 1:+7.1%}")


if __name__ == "__main__":
    main()
