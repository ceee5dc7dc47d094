"""tools/fidelity.py's measures on a tiny quantized model: the settings it
compares really run (float activations give the reference's distributions
again, q8 ones move them a little), and its KL divergence is KL's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from structllm.model import quant_kernels
from structllm.model.loader import load_model
from structllm.models import make_tiny_model
from tests.gguf_convert import convert
from tests.tool_modules import load_tool

pytestmark = pytest.mark.skipif(
    not quant_kernels.available(), reason="the quantized kernels need numba"
)


tool = load_tool("fidelity")


def test_kl_divergence_is_kl_of_each_row() -> None:
    p = np.log(np.array([[0.5, 0.5], [0.9, 0.1]]))
    q = np.log(np.array([[0.25, 0.75], [0.9, 0.1]]))
    expected = 0.5 * np.log(0.5 / 0.25) + 0.5 * np.log(0.5 / 0.75)
    np.testing.assert_allclose(tool.kl_divergence(p, q), [expected, 0.0], atol=1e-12)
    assert tool.kl_divergence(q, p)[0] != pytest.approx(expected)  # not symmetric


def test_settings_change_what_the_model_computes(tmp_path: Path) -> None:
    make_tiny_model(tmp_path / "m", arch="llama", seed=3)
    convert(tmp_path / "m", tmp_path / "m.gguf", qtype="Q8_0")
    model = load_model(tmp_path / "m.gguf", max_model_len=64).model
    ids = np.random.default_rng(0).integers(0, 256, size=40).tolist()
    ref = tool.log_probs(model, ids, "float", "float32")
    assert ref.shape == (40, model.config.vocab_size)
    np.testing.assert_allclose(np.exp(ref).sum(axis=1), 1.0, atol=1e-9)
    np.testing.assert_array_equal(tool.log_probs(model, ids, "float", "float32"), ref)
    q8 = tool.kl_divergence(ref, tool.log_probs(model, ids, "q8", "float32"))
    half = tool.kl_divergence(ref, tool.log_probs(model, ids, "float", "float16"))
    # q8 rounds every projection's input to 8 bits, a float16 cache only
    # the keys and values: both move the distributions, q8 by far more
    assert (q8 >= -1e-12).all() and 0 < half.mean() < q8.mean() < 0.05
