"""model/decode_plan.py: a step of decode rows alone runs kernel calls bound
once for its batch size; each step copies its inputs in and runs them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from structllm.model import kernels
from structllm.model._paddle import paddle
from structllm.model.attention import SequenceSlice
from structllm.model.loader import load_model
from structllm.models import make_tiny_model
from tests.gguf_convert import convert

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason="the plan runs the compiled kernels"
)

PROMPTS = [[3, 141, 59, 26, 53, 58, 97, 11, 200], [7, 7, 19, 230, 4]]


def _model(tmp_path: Path, arch: str, qtype: str, **kw: Any) -> Any:
    make_tiny_model(tmp_path / arch, arch=arch, seed=5, **kw)  # type: ignore[arg-type]
    convert(tmp_path / arch, tmp_path / "m.gguf", qtype=qtype)
    return load_model(tmp_path / "m.gguf", max_model_len=64).model


def _step(model: Any, caches: Any, seqs: list[tuple[SequenceSlice, list[int]]]) -> Any:
    """One step of ``seqs`` (a slice and its new tokens each): the residual
    stream (before the final norm) and the logits of every row."""
    meta = model.attention.build_metadata([s for s, _ in seqs])
    ids = [t for _, tokens in seqs for t in tokens]
    positions = [s.context_len + i for s, tokens in seqs for i in range(len(tokens))]
    args = (
        paddle.to_tensor(np.array(ids, np.int64)),
        paddle.to_tensor(np.array(positions, np.int64)),
        caches,
        meta,
    )
    residual = model.residual_stream(*args)
    logits = model.compute_logits(model.forward(*args)).numpy()
    return residual, logits


def _close(a: np.ndarray, b: np.ndarray) -> None:
    """Equal up to float32 sums in another order."""
    np.testing.assert_allclose(a, b, atol=2e-5 * float(np.abs(b).max()), rtol=0)


@pytest.mark.parametrize(
    ("arch", "qtype", "kw"),
    [
        ("llama", "Q8_0", {}),
        ("qwen3", "Q4_1", {}),  # q/k norms in the attention's call
        ("mistral", "Q8_0", {"sliding_window": 6}),
        ("llama", "F32", {}),  # float weights: Paddle's matmuls, bound as calls
    ],
)
def test_decode_rows_alone_match_decode_rows_beside_a_prefill(
    tmp_path: Path, arch: str, qtype: str, kw: dict[str, Any]
) -> None:
    """The plan's step (decode rows alone) gives what the per-layer path
    gives the same rows in a step that also prefills another sequence,
    at batch 1 and 2 and back, as the contexts grow past a block."""
    model = _model(tmp_path, arch, qtype, **kw)
    alone, beside = model.allocate_kv_cache(16), model.allocate_kv_cache(16)
    tables = [[0, 1, 2, 3], [4, 5, 6, 7]]
    for caches in (alone, beside):
        _step(
            model,
            caches,
            [
                (SequenceSlice(0, len(p), t), p)
                for p, t in zip(PROMPTS, tables, strict=True)
            ],
        )
    lens = [len(p) for p in PROMPTS]
    residuals = {}
    for n, (rows, token) in enumerate([(1, 17), (2, 23), (2, 5), (1, 88), (1, 9)]):
        decodes = [
            (SequenceSlice(lens[i], 1, tables[i]), [token + i]) for i in range(rows)
        ]
        residual, got = _step(model, alone, decodes)
        extra = (SequenceSlice(0, 3, [8 + n]), [1, 2, 3])  # a new sequence's prefill
        _, want = _step(model, beside, [*decodes, extra])
        _close(got, want[:rows])
        residuals.setdefault(rows, residual)
        assert residual is residuals[rows]  # the plan of that batch size, again
        lens = [n + 1 if i < rows else n for i, n in enumerate(lens)]
    assert residuals[1] is not residuals[2]


def test_a_plan_follows_new_caches_and_checks_each_steps_slots(
    tmp_path: Path,
) -> None:
    model = _model(tmp_path, "llama", "Q8_0")
    prompt = PROMPTS[0]
    logits = []
    for _ in range(2):  # new caches: a plan of their own, same results
        caches = model.allocate_kv_cache(4)
        _step(model, caches, [(SequenceSlice(0, len(prompt), [1, 0]), prompt)])
        decode = [(SequenceSlice(len(prompt), 1, [1, 0]), [42])]
        logits.append(_step(model, caches, decode)[1])
    np.testing.assert_array_equal(logits[0], logits[1])
    with pytest.raises(IndexError, match="slot out of range"):
        _step(model, caches, [(SequenceSlice(len(prompt), 1, [1, 9]), [42])])


def test_a_block_table_wider_than_the_model_takes_is_read_to_its_keys(
    tmp_path: Path,
) -> None:
    """The plan keeps tables as wide as max_model_len needs (64 tokens: 4
    blocks); a sequence's table may hold more blocks than that (here 6),
    of which the kernels read those below its key count."""
    model = _model(tmp_path, "llama", "Q8_0")
    caches = model.allocate_kv_cache(8)
    prompt = PROMPTS[0]
    table = [3, 2, 5, 0, 1, 4]
    _step(model, caches, [(SequenceSlice(0, len(prompt), table), prompt)])
    got = _step(model, caches, [(SequenceSlice(len(prompt), 1, table), [42])])[1]
    caches = model.allocate_kv_cache(8)
    _step(model, caches, [(SequenceSlice(0, len(prompt), table[:2]), prompt)])
    want = _step(model, caches, [(SequenceSlice(len(prompt), 1, table[:2]), [42])])[1]
    np.testing.assert_array_equal(got, want)
