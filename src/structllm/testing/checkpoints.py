"""Tiny random-weight checkpoints in Hugging Face layout, for tests and benches.

``make_tiny_model`` writes ``config.json``, safetensors weights and a byte-level
BPE tokenizer trained on a built-in corpus; ``transformers`` loads the result
as it would a real Llama, Qwen2, Qwen3 or Mistral checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import tokenizers

from structllm.model.checkpoint import write_random_checkpoint
from structllm.model.config import ModelConfig, RopeScaling
from structllm.text.training import write_byte_level_bpe_tokenizer

__all__ = ["ARCHITECTURES", "make_tiny_model"]

#: --arch value -> (HF architecture, qkv bias, tied embeddings by default)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", False, False),
    "qwen2": ("Qwen2ForCausalLM", True, True),
    "qwen3": ("Qwen3ForCausalLM", False, True),
    "mistral": ("MistralForCausalLM", False, False),
}


def make_tiny_model(
    directory: str | Path,
    *,
    arch: Literal["llama", "qwen2", "qwen3", "mistral"] = "llama",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    vocab_size: int = 512,
    tie_word_embeddings: bool | None = None,
    max_position_embeddings: int = 2048,
    dtype: Literal["float32", "float16", "bfloat16"] = "float32",
    shards: int = 1,
    seed: int = 0,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    sliding_window: int | None = None,
) -> ModelConfig:
    """Write a random checkpoint of ``arch`` to ``directory``; return its config."""
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"arch must be one of {', '.join(ARCHITECTURES)}, got {arch!r}"
        )
    if hidden_size % num_heads:
        raise ValueError(
            f"hidden_size {hidden_size} is not a multiple of num_heads {num_heads}"
        )
    architecture, bias, tied = ARCHITECTURES[arch]
    directory = Path(directory)
    write_byte_level_bpe_tokenizer(
        directory, vocab_size=vocab_size, model_max_length=max_position_embeddings
    )
    tok = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    assert eos is not None, "the trained tokenizer lacks <|im_end|>"
    config = ModelConfig(
        architecture=architecture,
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta,
        rope_scaling=RopeScaling.from_hf(rope_scaling),
        tie_word_embeddings=tied
        if tie_word_embeddings is None
        else tie_word_embeddings,
        qkv_bias=bias,
        qk_norm=arch == "qwen3",
        sliding_window=(sliding_window or max_position_embeddings)
        if arch == "mistral"
        else None,
        bos_token_id=None,
        eos_token_ids=(eos,),
        checkpoint_dtype=dtype,
    )
    write_random_checkpoint(directory, config, seed=seed, dtype=dtype, shards=shards)
    return config
