"""structllm vs Hugging Face transformers on the same random checkpoints.

Run with ``nox -s parity`` (installs torch and transformers). For each tiny
checkpoint and prompt length, both generate 64 greedy tokens from the same
prompt token ids; the tokens must be equal. The largest absolute logit
difference over the prompt (one prefill through the paged KV cache) and over
the generated positions (decode steps) is printed for the record.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from structllm.core.engine_core import EngineConfig, EngineCore  # noqa: E402
from structllm.core.request import CoreRequest  # noqa: E402
from structllm.params import SamplingParams  # noqa: E402
from structllm.tiny import make_tiny_model  # noqa: E402

BLOCK = 16
NEW_TOKENS = 64
PROMPT_LENGTHS = [1, 7, BLOCK, 3 * BLOCK + 1]
CHECKPOINTS = {
    # name: make_tiny_model arguments
    "llama-gqa-untied": {"arch": "llama", "num_heads": 4, "num_kv_heads": 2},
    "llama-mha-tied": {"arch": "llama", "num_kv_heads": 4, "tie_word_embeddings": True},
    "qwen2-bias-tied": {"arch": "qwen2", "num_kv_heads": 2},
    "qwen2-bias-untied": {
        "arch": "qwen2",
        "num_kv_heads": 1,
        "tie_word_embeddings": False,
    },
    "llama3-rope-scaling": {
        "arch": "llama",
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    },
    "linear-rope-scaling": {
        "arch": "llama",
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    },
    "mistral-sliding-window-8": {"arch": "mistral", "sliding_window": 8},
    "mistral-gqa": {
        "arch": "mistral",
        "num_kv_heads": 2,
        "hidden_size": 96,
        "num_heads": 6,
    },
}
FIGURES: list[str] = []


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
):
    path = tmp_path_factory.mktemp(request.param)
    make_tiny_model(path, seed=11, num_layers=3, **CHECKPOINTS[request.param])
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.eval()
    # no EOS: generate exactly NEW_TOKENS without masking anything (HF's
    # min_new_tokens would suppress EOS, which structllm's ignore_eos doesn't)
    hf.generation_config.eos_token_id = None
    core = EngineCore(EngineConfig(model=str(path), block_size=BLOCK, num_threads=2))
    return request.param, path, hf, core


def _hf_greedy(hf, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
        tokens = out[0, len(prompt) :].tolist()
        # logits of the whole sequence in one causal forward, for the figures
        logits = hf(out).logits[0].float().numpy()
    return tokens, logits


def _structllm_greedy(
    core: EngineCore, prompt: list[int]
) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens, and the logits each step sampled from (hooked on the runner)."""
    seen: list[np.ndarray] = []
    sampler = core.runner.sampler
    original = sampler.sample

    def spy(logits, rows):  # type: ignore[no-untyped-def]
        seen.append(np.asarray(logits)[0].copy())
        return original(logits, rows)

    core.runner.sampler = type("Spy", (), {"sample": staticmethod(spy)})()
    try:
        core.add_request(
            CoreRequest(
                request_id="p",
                prompt_token_ids=tuple(prompt),
                params=SamplingParams(
                    temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True
                ),
            )
        )
        tokens: list[int] = []
        while core.has_unfinished_requests():
            for out in core.step().outputs:
                tokens += out.new_token_ids
    finally:
        core.runner.sampler = sampler
    return tokens, seen


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_greedy_tokens_match_transformers(checkpoint, length: int) -> None:
    name, _, hf, core = checkpoint
    rng = np.random.default_rng(length)
    prompt = rng.integers(3, hf.config.vocab_size, size=length).tolist()
    hf_tokens, hf_logits = _hf_greedy(hf, prompt)
    ours, our_logits = _structllm_greedy(core, prompt)
    # our_logits[k] predicts token k; HF's causal logits at position len(prompt)-1+k
    ref = hf_logits[length - 1 : length - 1 + len(our_logits)]
    diff = float(np.abs(np.stack(our_logits) - ref).max())
    gap = np.sort(ref, axis=-1)
    min_gap = float((gap[:, -1] - gap[:, -2]).min())
    FIGURES.append(
        f"{name:<20} prompt {length:>3}: {NEW_TOKENS} tokens equal={ours == hf_tokens}, "
        f"max |logit diff| {diff:.2e}, smallest top-2 gap {min_gap:.2e}"
    )
    print("\n" + FIGURES[-1])
    assert ours == hf_tokens
    assert diff < 1e-3
