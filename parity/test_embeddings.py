"""structllm's embeddings vs transformers' ``AutoModel`` hidden states, pooled.

Run with ``nox -s parity`` (installs torch and transformers). For one
generated checkpoint of each family (``test_parity.py``'s config space and
weights, saved by transformers), the sentence-transformers way of pooling
is computed from ``AutoModel(...).last_hidden_state`` (the final-normed
hidden states): the last token's row, or the mean over the prompt's
positions, then ``F.normalize``. structllm's ``LLM.embed`` must give the
same within 1e-4 with every prompt batched together (chunked prefill over
the block and chunk edges), last and mean, normalised and not, and with
the checkpoint's own ``modules.json`` / ``1_Pooling/config.json`` /
``Normalize`` read as the default.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from parity.test_parity import (  # noqa: E402
    BLOCK,
    CHUNK,
    FAMILIES,
    MAX_MODEL_LEN,
    _hf_model,
    _prompts,
    sample_case,
)
from structllm import LLM  # noqa: E402

TOL = 1e-4


def _reference(hf: Any, prompt: list[int], method: str, normalize: bool) -> np.ndarray:
    """transformers' last hidden states of ``prompt``, pooled as
    sentence-transformers pools them."""
    with torch.inference_mode():
        out = hf.model(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt))
        )
    h = out.last_hidden_state[0]  # (T, H)
    v = h[-1] if method == "last" else h.mean(dim=0)
    if normalize:
        v = torch.nn.functional.normalize(v, p=2, dim=0)
    return v.float().numpy()


def _write_sentence_transformers(path: Path, mode: str) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]  # fmt: skip
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_mean_tokens": mode == "mean",
                    "pooling_mode_lasttoken": mode == "last"})
    )  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_embeddings_match_transformers(tmp_path: Path, family: str) -> None:
    index = FAMILIES.index(family)  # the first generated case of the family
    _, kw = sample_case(index)
    hf, _ = _hf_model(index, family, kw)
    hf.save_pretrained(tmp_path)
    _write_sentence_transformers(tmp_path, "mean")
    prompts = _prompts(index, kw["vocab_size"])
    llm = LLM(
        str(tmp_path),
        tokenizer="tiny-random",  # the prompts are token ids: any tokenizer
        show_progress=False,
        block_size=BLOCK,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=CHUNK,
        num_blocks=64,
        num_threads=2,
    )
    worst = 0.0
    for method in ("last", "mean"):
        for normalize in (False, True):
            outs = llm.embed(
                prompts, pooling=method, normalize=normalize, use_tqdm=False
            )
            for prompt, out in zip(prompts, outs, strict=True):
                ref = _reference(hf, prompt, method, normalize)
                assert out.embedding is not None
                diff = float(np.abs(out.embedding - ref).max())
                worst = max(worst, diff)
                assert diff < TOL, (family, method, normalize, len(prompt), diff)
    # the checkpoint's own config: mean, normalised
    for prompt, out in zip(prompts, llm.embed(prompts, use_tqdm=False), strict=True):
        ref = _reference(hf, prompt, "mean", True)
        assert float(np.abs(out.embedding - ref).max()) < TOL
    print(f"\nembeddings parity {family}: worst difference {worst:.2e}")
