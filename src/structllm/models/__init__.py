"""The built-in models, by name: the one place that says what each name means.

=================  ==========================================================
``"tiny"``         a 0.92M-parameter Llama trained on permissively licensed
                   text (the files in ``structllm/models/tiny/``, rebuilt by
                   ``nox -s train-tiny``): a real checkpoint in Hugging Face
                   layout with a byte-level BPE tokenizer; it writes
                   readable, if simple, English
``"tiny-random"``  random weights (seeded by ``EngineConfig.seed``) of
                   :data:`TINY_RANDOM_CONFIG` with the byte tokenizer
                   (:class:`~structllm.text.ByteTokenizer`); no files, the
                   fastest steps: what the tests run
=================  ==========================================================

:func:`make_tiny_model` writes a random-weight checkpoint of any supported
architecture to a directory (``structllm make-tiny-model``). This module
imports nothing heavy: the loader and the tokenizer ask it what a name means.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from structllm.models.random_checkpoint import make_tiny_model

__all__ = [
    "BUILTIN_MODELS",
    "TINY",
    "TINY_RANDOM",
    "TINY_RANDOM_CONFIG",
    "make_tiny_model",
    "model_directory",
]

TINY = "tiny"
TINY_RANDOM = "tiny-random"
BUILTIN_MODELS = (TINY, TINY_RANDOM)

#: ``config.json`` of ``"tiny-random"``: byte tokenizer ids (256 bytes, then
#: BOS 256 and EOS 257), 2 layers, grouped-query attention, tied head
TINY_RANDOM_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 258,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "bos_token_id": 256,
    "eos_token_id": 257,
}


def model_directory(model: str | Path) -> Path | None:
    """Where the files of ``model`` are: None for ``"tiny-random"`` (none)."""
    if str(model) == TINY_RANDOM:
        return None
    if str(model) == TINY:
        return Path(__file__).parent / TINY
    return Path(model)


def __getattr__(name: str) -> Any:
    if name == "make_tiny_model":
        from structllm.models.random_checkpoint import make_tiny_model

        return make_tiny_model
    raise AttributeError(f"module 'structllm.models' has no attribute {name!r}")
