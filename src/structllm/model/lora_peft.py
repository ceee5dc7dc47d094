"""LoRA adapters in PEFT's format, read into structllm's fused projections.

A PEFT adapter directory holds ``adapter_config.json`` and
``adapter_model.safetensors``; for every targeted module a pair::

    base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight   (r, in)
    base_model.model.model.layers.N.self_attn.q_proj.lora_B.weight   (out, r)

and the module computes ``W x + scale * B (A x)``, ``scale = lora_alpha /
r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``). structllm runs q/k/v as
one projection and gate/up as one (``llama.LAYER_PROJECTIONS``), so an
adapter is kept per fused projection (:class:`LoRAProjection`): its
pieces' A rows stacked (``(W, in)``, ``W`` the sum of the targeted
pieces' ranks) and their B matrices, scaled and transposed, each in its
piece's rank rows and output columns of a ``(W, out)`` matrix, zero
elsewhere. A piece the adapter does not target has no rank rows and
contributes nothing.

Only what runs exactly is accepted: ``r``, ``lora_alpha``,
``use_rslora``, ``target_modules`` among the decoder's seven projections,
``bias: "none"``. Anything else that changes the output (DoRA,
``modules_to_save``, biases on the LoRA or base layers, embedding or
``lm_head`` adapters, ``layers_to_transform``, per-module ranks or
alphas, aLoRA, layer replication, a rank over ``max_rank``) and any tensor
that does not fit the model is refused by name, as a
:class:`~structllm.errors.ModelLoadError` naming the file and the key.
Keys that only steer training or initialisation are ignored: the saved
weights are what runs.

A tensor-parallel rank reads its part of each pair through the model's
:class:`~structllm.model.linear.LinearLoader` s (``projection_loaders``
with its heads and columns): column-parallel projections keep their rows of
B (A whole), row-parallel ones their columns of A (B whole), so each rank's
update is its share of the whole one and the group's all-reduce of the o
and down outputs sums the low-rank products with the base's.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from structllm.errors import ModelLoadError
from structllm.model.config import ModelConfig
from structllm.model.linear import LinearLoader

__all__ = [
    "CONFIG_FILE",
    "TARGET_MODULES",
    "WEIGHTS_FILE",
    "LoRAAdapter",
    "LoRAProjection",
    "fuse_pieces",
    "read_peft_adapter",
]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

#: the projections an adapter may target, as PEFT names them
TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)

_KEY = re.compile(
    r"base_model\.model\.(model\.layers\.(\d+)\."
    r"(?:self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj))\.lora_([AB])\.weight"
)

#: adapter_config.json keys that change what the adapter computes when set,
#: with the value under which they change nothing (empty and false values
#: count as unset too)
_NEUTRAL: dict[str, Any] = {
    "bias": "none",
    "use_dora": False,
    "modules_to_save": None,
    "layers_to_transform": None,
    "rank_pattern": None,
    "alpha_pattern": None,
    "lora_bias": False,
    "fan_in_fan_out": False,
    "layer_replication": None,
    "trainable_token_indices": None,
    "alora_invocation_tokens": None,
    "use_qalora": False,
    "target_parameters": None,
    "use_bdlora": None,
    "arrow_config": None,
    "kasa_config": None,
    "monteclora_config": None,
    "megatron_config": None,
}

#: keys read below, or that only steer training and initialisation
#: (VeLoRA changes the backward pass alone; MiCA, an init_lora_weights
#: value, runs as plain LoRA)
_INERT = frozenset(
    (
        "peft_type",
        "peft_version",
        "task_type",
        "base_model_name_or_path",
        "revision",
        "inference_mode",
        "auto_mapping",
        "r",
        "lora_alpha",
        "use_rslora",
        "target_modules",
        "exclude_modules",
        "lora_dropout",
        "init_lora_weights",
        "layers_pattern",
        "loftq_config",
        "eva_config",
        "corda_config",
        "lora_ga_config",
        "megatron_core",
        "runtime_config",
        "ensure_weight_tying",
        "qalora_group_size",
        "velora_config",
    )
)


@attrs.frozen(eq=False)
class LoRAProjection:
    """An adapter's update of one fused projection: ``y += (x @ a.T) @ b``."""

    #: ``(W, in)`` float32: the targeted pieces' A rows, stacked in order
    a: np.ndarray
    #: ``(W, out)`` float32: piece ``p``'s ``scale * B.T`` in rows
    #: ``spans[p, 0:2]`` and columns ``spans[p, 2:4]``, zero elsewhere
    b: np.ndarray
    #: ``(P, 4)`` int64: per piece, rank rows ``r0, r1`` and output columns
    #: ``c0, c1``; ``r0 == r1`` for a piece the adapter leaves alone
    spans: np.ndarray

    @property
    def width(self) -> int:
        return int(self.a.shape[0])


@attrs.frozen(eq=False)
class LoRAAdapter:
    """An adapter ready to load into a model's slot (``LoRASlots.load_adapter``)."""

    #: where it was read from, named in refusals
    source: str
    #: ``r``: every pair's rank
    rank: int
    #: ``lora_alpha / r``, or ``/ sqrt(r)`` (rsLoRA); folded into each ``b``
    scale: float
    #: module name (``model.layers.0.self_attn.qkv_proj``) -> its update;
    #: projections the adapter leaves alone are absent
    projections: Mapping[str, LoRAProjection]


def fuse_pieces(
    pieces: Sequence[tuple[np.ndarray, np.ndarray] | None],
    features: Sequence[int],
    scale: float,
) -> LoRAProjection:
    """One projection's update from its pieces' ``(A (r, in), B (out_p, r))``
    pairs (None: a piece left alone), ``features[p]`` outputs each."""
    present = [p for p in pieces if p is not None]
    if not present:
        raise ValueError("no piece to fuse")
    in_features = int(present[0][0].shape[1])
    width = sum(int(p[0].shape[0]) for p in present)
    a = np.zeros((width, in_features), np.float32)
    b = np.zeros((width, sum(features)), np.float32)
    spans = np.zeros((len(pieces), 4), np.int64)
    r0 = c0 = 0
    for p, (pair, n) in enumerate(zip(pieces, features, strict=True)):
        r1 = r0
        if pair is not None:
            pa, pb = pair
            if pa.shape[1] != in_features or pb.shape != (n, pa.shape[0]):
                raise ValueError(f"piece {p}: A {pa.shape}, B {pb.shape}")
            r1 = r0 + pa.shape[0]
            a[r0:r1] = pa
            b[r0:r1, c0 : c0 + n] = (pb * np.float32(scale)).T
        spans[p] = (r0, r1, c0, c0 + n)
        r0, c0 = r1, c0 + n
    return LoRAProjection(a, b, spans)


def read_peft_adapter(
    path: str | Path,
    config: ModelConfig,
    *,
    max_rank: int | None = None,
    loaders: Mapping[str, LinearLoader] | None = None,
) -> LoRAAdapter:
    """The PEFT adapter in directory ``path``, for a model of ``config``.

    ``loaders``: the model's projection loaders (``projection_loaders``;
    by default the whole model's), whose ``index`` says which part of each
    pair a tensor-parallel rank keeps. Refuses, as :class:`ModelLoadError`
    naming the file and the key, what structllm cannot run exactly (see
    the module docstring), and a rank over ``max_rank``.
    """
    from structllm.model.loader import hf_tensor_shapes, projection_loaders

    directory = Path(path)
    rank, scale = _read_config(directory / CONFIG_FILE, max_rank)
    file = directory / WEIGHTS_FILE
    pairs = _read_pairs(file, config, rank, hf_tensor_shapes(config))
    if loaders is None:
        loaders = projection_loaders(config)
    full = hf_tensor_shapes(config)
    projections: dict[str, LoRAProjection] = {}
    for module, loader in loaders.items():
        if not any(p in pairs for p in loader.pieces):
            continue
        features: list[int] = []
        fused: list[tuple[np.ndarray, np.ndarray] | None] = []
        for i, piece in enumerate(loader.pieces):
            out_slice, in_slice = loader.index(i, "weight")
            features.append(len(range(full[piece + ".weight"][0])[out_slice]))
            pair = pairs.get(piece)
            if pair is not None:
                pa, pb = pair
                pair = (
                    np.ascontiguousarray(pa[:, in_slice]),
                    np.ascontiguousarray(pb[out_slice]),
                )
            fused.append(pair)
        projections[module] = fuse_pieces(fused, features, scale)
    return LoRAAdapter(
        source=str(directory), rank=rank, scale=scale, projections=projections
    )


def _read_config(file: Path, max_rank: int | None) -> tuple[int, float]:
    """``r`` and the scale, every other key checked."""
    try:
        raw = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{file} could not be read: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{file} is not a JSON object")
    where = f"{file}:"
    if raw.get("peft_type", "LORA") != "LORA":
        raise ModelLoadError(
            f"{where} peft_type is {raw['peft_type']!r}; structllm runs LORA only"
        )
    for key, value in raw.items():
        if key in _INERT:
            continue
        neutral = _NEUTRAL.get(key)
        if value in (None, False, "", [], {}) or value == neutral:
            continue
        if key in _NEUTRAL:
            raise ModelLoadError(
                f"{where} {key}={value!r} changes what the adapter computes and "
                f"structllm does not run it (it needs {key}={neutral!r})"
            )
        raise ModelLoadError(
            f"{where} {key}={value!r} is a setting structllm does not know; it "
            "may change what the adapter computes"
        )
    r = raw.get("r")
    alpha = raw.get("lora_alpha", r)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ModelLoadError(f"{where} r must be a positive integer, not {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ModelLoadError(f"{where} lora_alpha must be a number, not {alpha!r}")
    if max_rank is not None and r > max_rank:
        raise ModelLoadError(f"{where} r={r} is over max_lora_rank={max_rank}")
    _check_targets(where, raw.get("target_modules"))
    rslora = bool(raw.get("use_rslora", False))
    return r, float(alpha) / (math.sqrt(r) if rslora else r)


def _check_targets(where: str, targets: Any) -> None:
    """Names (or PEFT's full module paths) of the seven projections only;
    a regular expression must not reach the embedding or the head."""
    if targets is None:
        return  # PEFT's default for the architecture; the tensors tell
    if isinstance(targets, str):
        if targets.lower() == "all-linear":
            return  # PEFT leaves the head out of it
        try:
            pattern = re.compile(targets)
        except re.error as exc:
            raise ModelLoadError(
                f"{where} target_modules={targets!r} is not a regular expression"
            ) from exc
        for name in ("model.embed_tokens", "lm_head"):
            if pattern.fullmatch(name):
                raise ModelLoadError(
                    f"{where} target_modules={targets!r} targets {name}; structllm "
                    "runs adapters on the decoder's projections only"
                )
        return
    if not isinstance(targets, list):
        raise ModelLoadError(
            f"{where} target_modules must be a list or a string, not {targets!r}"
        )
    for t in targets:
        if not isinstance(t, str) or t.rsplit(".", 1)[-1] not in TARGET_MODULES:
            raise ModelLoadError(
                f"{where} target_modules names {t!r}; structllm runs adapters on "
                f"{', '.join(TARGET_MODULES)} only"
            )


def _read_pairs(
    file: Path,
    config: ModelConfig,
    rank: int,
    shapes: Mapping[str, tuple[int, ...]],
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """HF module name (``model.layers.0.self_attn.q_proj``) -> its float32
    ``(A (r, in), B (out, r))``, every key and shape checked."""
    from safetensors import safe_open

    if not file.is_file():
        raise ModelLoadError(f"{file} is missing (adapters in safetensors only)")
    halves: dict[str, dict[str, np.ndarray]] = {}
    try:
        with safe_open(str(file), framework="numpy") as st:
            keys = list(st.keys())
            for key in keys:
                m = _KEY.fullmatch(key)
                if m is None:
                    raise ModelLoadError(
                        f"{file}: tensor {key} is not a LoRA pair of the "
                        f"decoder's projections ({', '.join(TARGET_MODULES)}); "
                        "structllm does not run it"
                    )
                module, layer, half = m.group(1), int(m.group(2)), m.group(3)
                if layer >= config.num_hidden_layers:
                    raise ModelLoadError(
                        f"{file}: tensor {key} is for layer {layer}; the model "
                        f"has {config.num_hidden_layers}"
                    )
                out_f, in_f = shapes[module + ".weight"]
                want = (rank, in_f) if half == "A" else (out_f, rank)
                got = tuple(st.get_slice(key).get_shape())
                if got != want:
                    raise ModelLoadError(
                        f"{file}: tensor {key} has shape {got}; the model and r="
                        f"{rank} need {want}"
                    )
                halves.setdefault(module, {})[half] = _float32(st, key, file)
    except ModelLoadError:
        raise
    except Exception as exc:  # truncated or corrupt file, odd dtype
        raise ModelLoadError(f"{file} could not be read: {exc}") from exc
    pairs = {}
    for module, h in halves.items():
        if "A" not in h or "B" not in h:
            lacks = "lora_B" if "A" in h else "lora_A"
            raise ModelLoadError(
                f"{file}: base_model.model.{module} lacks its {lacks}.weight"
            )
        pairs[module] = (h["A"], h["B"])
    if not pairs:
        raise ModelLoadError(f"{file} holds no LoRA tensors")
    return pairs


def _float32(st: Any, key: str, file: Path) -> np.ndarray:
    """A tensor as float32 (bfloat16, which numpy lacks, through Paddle)."""
    try:
        t = st.get_tensor(key)
    except TypeError:  # bfloat16
        from safetensors import safe_open

        with safe_open(str(file), framework="paddle") as pst:
            return np.ascontiguousarray(pst.get_tensor(key).astype("float32").numpy())
    if t.dtype.kind != "f":
        raise ModelLoadError(f"{file}: tensor {key} is {t.dtype}, not floating point")
    return np.ascontiguousarray(t, dtype=np.float32)
