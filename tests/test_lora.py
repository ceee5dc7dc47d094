"""LoRA adapters (model/lora.py) against transformers + peft.

The oracle (tests/data/lora/oracle.json, tools/record_lora_oracle.py):
peft adapters with random weights on two small random bases, their float32
logits for a fixed prompt. structllm reads the same files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy

from structllm.errors import ModelLoadError
from structllm.model import kernels, lora_kernels
from structllm.model._paddle import paddle
from structllm.model.attention import SequenceSlice
from structllm.model.linear import DenseLinear
from structllm.model.llama import LlamaForCausalLM
from structllm.model.loader import load_model, projection_loaders
from structllm.model.lora import (
    LoRABatch,
    LoRALinear,
    LoRASlots,
    enable_lora,
    read_peft_adapter,
    rows_for_sequences,
)
from structllm.model.lora_peft import CONFIG_FILE, WEIGHTS_FILE, fuse_pieces
from structllm.model.quantized import QuantizedLinear, QuantizedPart

DATA = Path(__file__).parent / "data" / "lora"
ORACLE: dict[str, Any] = json.loads((DATA / "oracle.json").read_text())
PROMPT: list[int] = ORACLE["prompt"]
#: float32 on both sides; logits spread ~8
ATOL = 1e-4
BLOCK = 4


def _model(base: str, attention: str = "kernels") -> LlamaForCausalLM:
    model = load_model(DATA / base, backend="eager", block_size=BLOCK).model
    assert isinstance(model, LlamaForCausalLM)
    assert model.attention.use_kernels
    model.attention.use_kernels = attention == "kernels"
    return model


def _lora_model(
    base: str, attention: str = "kernels", max_loras: int = 4, max_rank: int = 8
) -> tuple[LlamaForCausalLM, LoRASlots]:
    model = _model(base, attention)
    return model, enable_lora(model, max_loras=max_loras, max_lora_rank=max_rank)


def _adapter(model: LlamaForCausalLM, name: str, max_rank: int = 8) -> Any:
    return read_peft_adapter(DATA / name, model.config, max_rank=max_rank)


def _step(
    model: LlamaForCausalLM,
    caches: Any,
    seqs: list[SequenceSlice],
    ids: list[int],
    positions: list[int],
    rows: list[int] | None,
) -> np.ndarray:
    meta = model.attention.build_metadata(seqs)
    if model.lora is not None:
        model.set_lora_rows(rows)
    hidden = model.forward(
        paddle.to_tensor(np.asarray(ids, np.int64)),
        paddle.to_tensor(np.asarray(positions, np.int64)),
        caches,
        meta,
    )
    logits: np.ndarray = model.compute_logits(hidden).numpy()
    return logits


def _prompt_logits(
    model: LlamaForCausalLM, slot: int | None, path: str = "prefill"
) -> np.ndarray:
    """The prompt's logits with every row on ``slot``: one prefill, or a
    first token then one decode step a token (the compiled decode path)."""
    caches = model.allocate_kv_cache(8)
    table = [5, 1, 7, 0]
    n = len(PROMPT)
    if path == "prefill":
        rows = None if slot is None else [slot] * n
        return _step(
            model, caches, [SequenceSlice(0, n, table)], PROMPT, [*range(n)], rows
        )
    out = []
    for p in range(n):
        rows = None if slot is None else [slot]
        seq = SequenceSlice(p, 1, table)
        out.append(_step(model, caches, [seq], [PROMPT[p]], [p], rows))
    return np.concatenate(out)


PATHS = [("kernels", "prefill"), ("kernels", "decode"), ("ops", "prefill")]


@pytest.mark.parametrize("method", ["kernel", "grouped"])
@pytest.mark.parametrize(("attention", "path"), PATHS)
@pytest.mark.parametrize("name", list(ORACLE["adapters"]))
def test_adapter_logits_match_peft(
    name: str, attention: str, path: str, method: str
) -> None:
    case = ORACLE["adapters"][name]
    model, slots = _lora_model(case["base"], attention)
    slots.batch.method = method
    slots.load_adapter(2, _adapter(model, name))
    got = _prompt_logits(model, 2, path)
    np.testing.assert_allclose(got, case["logits"], atol=ATOL, rtol=0)
    # and it is the adapter that moved them: the base is far off
    assert np.abs(got - ORACLE["bases"][case["base"]]["logits"]).max() > 1.0


@pytest.mark.parametrize(("attention", "path"), PATHS)
@pytest.mark.parametrize("base", list(ORACLE["bases"]))
def test_rows_without_an_adapter_compute_the_base_model(
    base: str, attention: str, path: str
) -> None:
    expected = ORACLE["bases"][base]["logits"]
    plain = _prompt_logits(_model(base, attention), None, path)
    np.testing.assert_allclose(plain, expected, atol=ATOL, rtol=0)
    model, slots = _lora_model(base, attention)
    name = next(n for n, a in ORACLE["adapters"].items() if a["base"] == base)
    slots.load_adapter(0, _adapter(model, name))
    for rows in (None, -1):  # no rows set, and every row on "none"
        if rows is None:
            got = _prompt_logits(model, None, path)
        else:
            got = _prompt_logits(model, -1, path)
        np.testing.assert_allclose(got, plain, atol=1e-6, rtol=0)


MIXED = ["llama-qv-r4", "llama-all-r8", "llama-kogd-r8-rslora", None]


def _alone(model: LlamaForCausalLM, slot: int, ids: list[int]) -> np.ndarray:
    """One sequence's logits, prefill of its first 4 tokens then decodes."""
    caches = model.allocate_kv_cache(8)
    table = [3, 0, 6, 2]
    got = [
        _step(
            model,
            caches,
            [SequenceSlice(0, 4, table)],
            ids[:4],
            [*range(4)],
            [slot] * 4,
        )
    ]
    for p in range(4, len(ids)):
        seq = SequenceSlice(p, 1, table)
        got.append(_step(model, caches, [seq], [ids[p]], [p], [slot]))
    return np.concatenate(got)


@pytest.mark.parametrize("method", ["kernel", "grouped"])
def test_a_batch_mixing_three_adapters_and_none_equals_each_alone(
    method: str,
) -> None:
    model, slots = _lora_model("llama-base")
    slots.batch.method = method
    slot_of = []
    for s, name in enumerate(MIXED):
        if name is None:
            slot_of.append(-1)
        else:
            slots.load_adapter(s, _adapter(model, name))
            slot_of.append(s)
    rng = np.random.default_rng(7)
    lengths = [9, 11, 8, 10]
    prompts = [rng.integers(0, 128, size=n).tolist() for n in lengths]
    alone = [_alone(model, s, p) for s, p in zip(slot_of, prompts, strict=True)]
    # the sequences that differ only in adapter are told apart
    assert np.abs(alone[0][:4] - alone[1][:4]).max() > 1.0

    caches = model.allocate_kv_cache(40)
    tables = [[4 * i + j for j in range(4)] for i in range(4)]
    done = [0, 0, 0, 0]
    # prefill chunks, then decodes mixed with a late prefill, then decodes only
    plan = [[4, 3, 0, 0], [1, 1, 5, 4], [0, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]]
    got: list[list[np.ndarray]] = [[], [], [], []]
    for step in plan:
        order = sorted((i for i in range(4) if step[i]), key=lambda i: step[i] > 1)
        seqs, ids, pos = [], [], []
        for i in order:
            n = step[i]
            seqs.append(SequenceSlice(done[i], n, tables[i]))
            ids += prompts[i][done[i] : done[i] + n]
            pos += range(done[i], done[i] + n)
        rows = rows_for_sequences([slot_of[i] for i in order], [step[i] for i in order])
        logits = _step(model, caches, seqs, ids, pos, rows.tolist())
        r = 0
        for i in order:
            got[i].append(logits[r : r + step[i]])
            r += step[i]
            done[i] += step[i]
    for i in range(4):
        mixed = np.concatenate(got[i])
        np.testing.assert_allclose(mixed, alone[i][: done[i]], atol=ATOL, rtol=0)


def test_adapters_load_and_clear_at_run_time() -> None:
    model, slots = _lora_model("llama-base", max_loras=2)
    a = ORACLE["adapters"]
    weights = [lin._a for lin in slots.linears.values()]
    slots.load_adapter(1, _adapter(model, "llama-qv-r4"))
    np.testing.assert_allclose(
        _prompt_logits(model, 1), a["llama-qv-r4"]["logits"], atol=ATOL, rtol=0
    )
    # replaced in place: the same slot, another adapter, nothing rebuilt
    slots.load_adapter(1, _adapter(model, "llama-all-r8"))
    assert [lin._a for lin in slots.linears.values()] == weights
    np.testing.assert_allclose(
        _prompt_logits(model, 1), a["llama-all-r8"]["logits"], atol=ATOL, rtol=0
    )
    slots.clear_slot(1)
    assert slots.adapters == [None, None]
    with pytest.raises(ValueError, match="empty slots"):
        model.set_lora_rows([1] * 3)
    np.testing.assert_allclose(
        _prompt_logits(model, None),
        ORACLE["bases"]["llama-base"]["logits"],
        atol=ATOL,
        rtol=0,
    )
    # a cleared slot's matrices are zero: rows naming it get the base
    for lin in slots.linears.values():
        assert lin._a_host is not None and not lin._a_host[1].any()
    slots.load_adapter(0, _adapter(model, "llama-kogd-r8-rslora"))
    np.testing.assert_allclose(
        _prompt_logits(model, 0),
        a["llama-kogd-r8-rslora"]["logits"],
        atol=ATOL,
        rtol=0,
    )


def test_rows_are_checked() -> None:
    model, slots = _lora_model("llama-base", max_loras=2)
    slots.load_adapter(0, _adapter(model, "llama-qv-r4"))
    with pytest.raises(ValueError, match="outside"):
        model.set_lora_rows([0, 2])
    with pytest.raises(ValueError, match="outside"):
        model.set_lora_rows([-2])
    with pytest.raises(ValueError, match="slot must be"):
        slots.load_adapter(2, _adapter(model, "llama-qv-r4"))
    # rows set for another step's size: refused, not misapplied
    seqs = [SequenceSlice(0, 2, [0])]
    with pytest.raises(ValueError, match="set for 3 rows"):
        _step(model, model.allocate_kv_cache(2), seqs, [1, 2], [0, 1], [0, 0, -1])
    with pytest.raises(ValueError, match="not enabled"):
        _model("llama-base").set_lora_rows([0])
    with pytest.raises(ValueError, match="already enabled"):
        enable_lora(model, max_loras=1, max_lora_rank=1)


# -- LoRALinear over any base ------------------------------------------------


def _reference_update(
    x: np.ndarray,
    rows: np.ndarray,
    pairs: dict[int, list[tuple[np.ndarray, np.ndarray] | None]],
    features: list[int],
    scale: float,
) -> np.ndarray:
    """Each row's ``scale * B A x`` per piece, in float64."""
    out = np.zeros((x.shape[0], sum(features)))
    for t, s in enumerate(rows):
        if s < 0:
            continue
        c0 = 0
        for pair, n in zip(pairs[s], features, strict=True):
            if pair is not None:
                a, b = pair
                out[t, c0 : c0 + n] = scale * (b.astype(np.float64) @ (a @ x[t]))
            c0 += n
    return out


@pytest.mark.parametrize("method", ["kernel", "grouped"])
@pytest.mark.parametrize("base_kind", ["dense", "quantized"])
def test_lora_linear_adds_each_rows_update_into_out(
    base_kind: str, method: str
) -> None:
    rng = np.random.default_rng(3)
    features, d_in, rank = [32, 16, 16], 64, 4
    w = rng.standard_normal((sum(features), d_in)).astype(np.float32)  # (out, in)
    base: Any
    if base_kind == "dense":
        base = DenseLinear(paddle.to_tensor(w.T.copy()))
    else:
        from structllm.model import quant_kernels, quantize

        q8 = int(quant_kernels.GGMLType.Q8_0)
        base = QuantizedLinear((QuantizedPart(quantize.quantize(w, q8), q8),), d_in)
    batch = LoRABatch(method=method)  # type: ignore[arg-type]
    lin = LoRALinear(base, batch, tuple(features), 3, rank)
    slots = LoRASlots(3, rank, batch, {"p": lin})
    pairs: dict[int, list[tuple[np.ndarray, np.ndarray] | None]] = {}
    for s, targeted in enumerate([(1, 1, 1), (0, 1, 0), (1, 0, 1)]):
        r = rank if s != 1 else 2  # a rank under the slots' maximum
        pieces: list[tuple[np.ndarray, np.ndarray] | None] = [
            (
                rng.standard_normal((r, d_in)).astype(np.float32),
                rng.standard_normal((n, r)).astype(np.float32),
            )
            if on
            else None
            for on, n in zip(targeted, features, strict=True)
        ]
        pairs[s] = pieces
        from structllm.model.lora_peft import LoRAAdapter

        update = fuse_pieces(pieces, features, 0.5)
        slots.load_adapter(s, LoRAAdapter(f"a{s}", rank, 0.5, {"p": update}))
    rows = np.array([0, -1, 2, 1, 1, 0, -1, 2, 2, 0, 1, -1, 0, 0, 2, 1])
    x = rng.standard_normal((rows.size, d_in)).astype(np.float32)
    slots.set_rows(rows)
    out = paddle.empty([rows.size, sum(features)], "float32")
    plain = base(paddle.to_tensor(x)).numpy()
    lin(paddle.to_tensor(x), out=out)
    expected = plain + _reference_update(x, rows, pairs, features, 0.5)
    np.testing.assert_allclose(out.numpy(), expected, atol=1e-3, rtol=1e-5)
    # all rows on one slot: no gather
    slots.set_rows(np.ones(rows.size, np.int64))
    y = lin(paddle.to_tensor(x))
    expected = plain + _reference_update(x, np.ones_like(rows), pairs, features, 0.5)
    np.testing.assert_allclose(y.numpy(), expected, atol=1e-3, rtol=1e-5)


def test_the_threaded_kernel_equals_the_serial_one() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((33, 48)).astype(np.float32)
    a = rng.standard_normal((3, 8, 48)).astype(np.float32)
    b = rng.standard_normal((3, 8, 40)).astype(np.float32)
    # slot 0: two pieces; slot 1: the second piece alone; slot 2: empty
    spans = np.array(
        [
            [[0, 4, 0, 24], [4, 8, 24, 40]],
            [[0, 0, 0, 24], [0, 3, 24, 40]],
            [[0, 0, 0, 24], [0, 0, 24, 40]],
        ],
        np.int64,
    )
    rows = rng.integers(-1, 3, size=33).astype(np.int64)
    tiles = lora_kernels.tiles_for(rows)
    # every row on a slot once, four to a tile of one slot
    assert sorted(t for tile in tiles for t in tile[2 : 2 + tile[1]]) == [
        t for t in range(33) if rows[t] >= 0
    ]
    assert all((rows[tile[2 : 2 + tile[1]]] == tile[0]).all() for tile in tiles)
    serial = lora_kernels.add_lora(
        x, tiles, a, b, spans, np.zeros((33, 40), np.float32), threaded=False
    )
    before = kernels._threads
    kernels.set_num_threads(2)
    try:
        threaded = lora_kernels.add_lora(
            x, tiles, a, b, spans, np.zeros((33, 40), np.float32), threaded=True
        )
    finally:
        kernels.set_num_threads(before)
    np.testing.assert_array_equal(threaded, serial)
    expected = np.zeros((33, 40))
    for t, s in enumerate(rows):
        for r0, r1, c0, c1 in spans[s] if s >= 0 else ():
            expected[t, c0:c1] = (a[s, r0:r1] @ x[t]) @ b[s, r0:r1, c0:c1]
    np.testing.assert_allclose(serial, expected, atol=1e-4, rtol=1e-5)


def test_kernel_checks_its_arrays() -> None:
    x = np.zeros((2, 4), np.float32)
    a = np.zeros((1, 2, 4), np.float32)
    spans = np.zeros((1, 1, 4), np.int64)
    tiles = lora_kernels.tiles_for(np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="disagree"):
        lora_kernels.add_lora(x, tiles, a, a, spans, x[:1].copy())
    with pytest.raises(ValueError, match="tiles must be"):
        lora_kernels.add_lora(x, tiles[:, :3], a, a, spans, x.copy())
    with pytest.raises(ValueError, match="float32"):
        lora_kernels.add_lora(x.astype(np.float64), tiles, a, a, spans, x.copy())
    with pytest.raises(ValueError, match="a \\("):
        lora_kernels.add_lora(x, tiles, a[:, :1], a, spans, x.copy())


def test_tensor_parallel_shards_sum_to_the_whole_update() -> None:
    # column-parallel q/k/v and gate/up keep their rows of B, row-parallel o
    # and down their columns of A: each rank's update is its share
    model = _model("llama-base")
    c = model.config
    whole = read_peft_adapter(DATA / "llama-all-r8", c)
    ranks = [
        read_peft_adapter(
            DATA / "llama-all-r8",
            c,
            loaders=projection_loaders(
                c,
                q_heads=range(2 * k, 2 * k + 2),
                kv_heads=range(k, k + 1),
                intermediate=range(64 * k, 64 * k + 64),
            ),
        )
        for k in range(2)
    ]
    rng = np.random.default_rng(0)
    for module, update in whole.projections.items():
        x = rng.standard_normal((3, update.a.shape[1])).astype(np.float32)
        full = (x @ update.a.T) @ update.b
        parts = [r.projections[module] for r in ranks]
        if module.endswith(("o_proj", "down_proj")):  # the inputs split
            half = x.shape[1] // 2
            xs = [x[:, :half], x[:, half:]]
            total = sum((xi @ p.a.T) @ p.b for xi, p in zip(xs, parts, strict=True))
            np.testing.assert_allclose(total, full, atol=1e-4)
        else:  # each rank's columns of every piece
            outs = [(x @ p.a.T) @ p.b for p in parts]
            n = len(update.spans)
            for piece in range(n):
                c0, c1 = update.spans[piece, 2:]
                got = np.concatenate(
                    [
                        o[:, p.spans[piece, 2] : p.spans[piece, 3]]
                        for o, p in zip(outs, parts, strict=True)
                    ],
                    axis=1,
                )
                np.testing.assert_allclose(got, full[:, c0:c1], atol=1e-4)


# -- backends --------------------------------------------------------------


def test_the_inference_backend_refuses_lora_by_name() -> None:
    model = load_model(DATA / "llama-base", backend="inference", block_size=BLOCK)
    with pytest.raises(ModelLoadError, match="inference backend does not run lora"):
        enable_lora(model.model, max_loras=1, max_lora_rank=4)  # type: ignore[arg-type]
    # and a compiled model built over LoRA wrappers
    from structllm.model.compiled import CompiledLlamaForCausalLM

    eager, _ = _lora_model("llama-base")
    with pytest.raises(ModelLoadError, match="inference backend does not run lora"):
        CompiledLlamaForCausalLM(
            eager.config, eager.weights, block_size=BLOCK, max_model_len=64
        )


def test_training_refuses_lora_by_name() -> None:
    from structllm.model.training import trainable_weights

    model, _ = _lora_model("llama-base")
    with pytest.raises(ModelLoadError, match="training backend does not run lora"):
        trainable_weights(model)


# -- refusals ----------------------------------------------------------------


def _copy(tmp_path: Path, name: str = "llama-all-r8") -> Path:
    return Path(shutil.copytree(DATA / name, tmp_path / name))


def _edit_config(directory: Path, **changes: Any) -> None:
    file = directory / CONFIG_FILE
    raw = json.loads(file.read_text())
    raw.update(changes)
    file.write_text(json.dumps(raw))


def _edit_tensors(directory: Path, edit: Any) -> None:
    file = directory / WEIGHTS_FILE
    tensors = dict(safetensors.numpy.load_file(str(file)))
    edit(tensors)
    safetensors.numpy.save_file(tensors, str(file))


CONFIG_REFUSALS = {
    "use_dora": True,
    "modules_to_save": ["lm_head"],
    "bias": "all",
    "lora_bias": True,
    "layers_to_transform": [0],
    "rank_pattern": {"q_proj": 4},
    "alpha_pattern": {"q_proj": 4},
    "trainable_token_indices": [1, 2],
    "layer_replication": [[0, 2]],
    "alora_invocation_tokens": [5, 6],
    "fan_in_fan_out": True,
    "a_future_setting": 3,
}


@pytest.mark.parametrize("key", list(CONFIG_REFUSALS))
def test_settings_that_change_the_output_are_refused_by_name(
    key: str, tmp_path: Path
) -> None:
    model = _model("llama-base")
    d = _copy(tmp_path)
    _edit_config(d, **{key: CONFIG_REFUSALS[key]})
    with pytest.raises(ModelLoadError, match=f"{CONFIG_FILE}: {key}=") as info:
        read_peft_adapter(d, model.config)
    assert str(d) in str(info.value)


def test_settings_that_do_not_change_the_output_are_accepted(tmp_path: Path) -> None:
    model = _model("llama-base")
    d = _copy(tmp_path)
    neutral = {
        "lora_dropout": 0.1,
        "init_lora_weights": "gaussian",
        "modules_to_save": [],
        "rank_pattern": {},
        "task_type": "CAUSAL_LM",
        "a_future_setting": None,
    }
    _edit_config(d, **neutral)
    read_peft_adapter(d, model.config)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"peft_type": "IA3"}, "peft_type is 'IA3'"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "names 'embed_tokens'"),
        ({"target_modules": ["lm_head"]}, "names 'lm_head'"),
        ({"target_modules": ".*(q_proj|lm_head)"}, "targets lm_head"),
        ({"target_modules": "(["}, "not a regular expression"),
        ({"r": 0}, "r must be a positive integer"),
        ({"lora_alpha": "8"}, "lora_alpha must be a number"),
    ],
)
def test_bad_configs_are_refused(
    changes: dict[str, Any], match: str, tmp_path: Path
) -> None:
    model = _model("llama-base")
    d = _copy(tmp_path)
    _edit_config(d, **changes)
    with pytest.raises(ModelLoadError, match=match):
        read_peft_adapter(d, model.config)


def test_a_rank_over_the_limit_is_refused(tmp_path: Path) -> None:
    model, slots = _lora_model("llama-base", max_rank=4)
    with pytest.raises(ModelLoadError, match="r=8 is over max_lora_rank=4"):
        read_peft_adapter(DATA / "llama-all-r8", model.config, max_rank=4)
    adapter = read_peft_adapter(DATA / "llama-all-r8", model.config)
    with pytest.raises(ModelLoadError, match="llama-all-r8: r=8 is over"):
        slots.load_adapter(0, adapter)
    assert slots.adapters == [None] * 4


_L0 = "base_model.model.model.layers.0."


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        # DoRA's magnitudes, embedding and head adapters, modules_to_save
        (
            lambda t: t.update(
                {
                    _L0 + "self_attn.q_proj.lora_magnitude_vector": np.ones(
                        64, np.float32
                    )
                }
            ),
            "q_proj.lora_magnitude_vector is not a LoRA pair",
        ),
        (
            lambda t: t.update(
                {
                    "base_model.model.model.embed_tokens.lora_embedding_A": np.ones(
                        (8, 128), np.float32
                    )
                }
            ),
            "embed_tokens.lora_embedding_A is not a LoRA pair",
        ),
        (
            lambda t: t.update(
                {"base_model.model.lm_head.lora_A.weight": np.ones((8, 64), np.float32)}
            ),
            "lm_head.lora_A.weight is not a LoRA pair",
        ),
        (
            lambda t: t.update(
                {"base_model.model.lm_head.modules_to_save.weight": np.ones((2, 2))}
            ),
            "modules_to_save.weight is not a LoRA pair",
        ),
        (
            lambda t: t.update({_L0 + "self_attn.q_proj.lora_B.bias": np.ones(64)}),
            "q_proj.lora_B.bias is not a LoRA pair",
        ),
        # a tensor that does not fit the model
        (
            lambda t: t.update(
                {_L0 + "self_attn.k_proj.lora_B.weight": np.ones((64, 8), np.float32)}
            ),
            r"k_proj.lora_B.weight has shape \(64, 8\); the model and r=8 need "
            r"\(32, 8\)",
        ),
        (
            lambda t: t.update(
                {_L0 + "mlp.down_proj.lora_A.weight": np.ones((4, 128), np.float32)}
            ),
            r"down_proj.lora_A.weight has shape \(4, 128\)",
        ),
        (
            lambda t: t.update(
                {
                    "base_model.model.model.layers.2.mlp.up_proj.lora_A.weight": (
                        np.ones((8, 64), np.float32)
                    )
                }
            ),
            "is for layer 2; the model has 2",
        ),
        (
            lambda t: t.pop(_L0 + "mlp.up_proj.lora_B.weight"),
            "mlp.up_proj lacks its lora_B.weight",
        ),
        (lambda t: t.clear(), "holds no LoRA tensors"),
    ],
)
def test_tensors_that_do_not_fit_are_refused_by_name(
    edit: Any, match: str, tmp_path: Path
) -> None:
    model = _model("llama-base")
    d = _copy(tmp_path)
    _edit_tensors(d, edit)
    with pytest.raises(ModelLoadError, match=match) as info:
        read_peft_adapter(d, model.config)
    assert WEIGHTS_FILE in str(info.value)


def test_missing_and_corrupt_files_are_refused(tmp_path: Path) -> None:
    model = _model("llama-base")
    d = _copy(tmp_path)
    (d / WEIGHTS_FILE).write_bytes(b"not safetensors")
    with pytest.raises(ModelLoadError, match="could not be read"):
        read_peft_adapter(d, model.config)
    (d / WEIGHTS_FILE).unlink()
    with pytest.raises(ModelLoadError, match=f"{WEIGHTS_FILE} is missing"):
        read_peft_adapter(d, model.config)
    (d / CONFIG_FILE).write_text("{")
    with pytest.raises(ModelLoadError, match=f"{CONFIG_FILE} could not be read"):
        read_peft_adapter(d, model.config)


def test_an_adapter_for_another_model_is_refused(tmp_path: Path) -> None:
    # the qwen2 base has another head layout in its k/v pieces: refused
    # when read against it, and when loaded into a model it does not fit
    llama = _model("llama-base")
    qwen, slots = _lora_model("qwen2-base")
    adapter = read_peft_adapter(DATA / "llama-all-r8", llama.config)
    d = _copy(tmp_path)
    _edit_tensors(
        d,
        lambda t: t.update(
            {_L0 + "self_attn.q_proj.lora_A.weight": np.ones((8, 32), np.float32)}
        ),
    )
    with pytest.raises(ModelLoadError, match=r"q_proj\.lora_A\.weight has shape"):
        read_peft_adapter(d, qwen.config)
    # same shapes here (both bases are hidden 64): the update loads; a
    # mismatched one is refused before any slot changes
    slots.load_adapter(0, adapter)
    small = read_peft_adapter(DATA / "llama-qv-r4", llama.config)
    bad_update = fuse_pieces(
        [(np.ones((4, 32), np.float32), np.ones((64, 4), np.float32)), None, None],
        [64, 32, 32],
        1.0,
    )
    from structllm.model.lora_peft import LoRAAdapter

    bad = LoRAAdapter(
        "bad", 4, 1.0, {**small.projections, "model.layers.1.mlp.down_proj": bad_update}
    )
    with pytest.raises(
        ModelLoadError, match=r"bad: the update of model\.layers\.1\.mlp"
    ):
        slots.load_adapter(0, bad)
    assert slots.adapters[0] is adapter
