"""Train a small byte-level BPE tokenizer, for tests and the ``tiny`` models.

:func:`write_byte_level_bpe_tokenizer` writes a Qwen2-style tokenizer
(byte-level BPE, ChatML special tokens, no BOS) that both
:meth:`~structllm.text.HFTokenizer.from_directory` and ``transformers``'
``AutoTokenizer`` load. The corpus is built in and training is deterministic,
so the same arguments always give the same files.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from structllm.text.chat import CHATML_TEMPLATE

__all__ = ["SPECIAL_TOKENS", "TRAINING_CORPUS", "write_byte_level_bpe_tokenizer"]

#: The special tokens, in id order (0, 1, 2).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

#: What the tokenizer is trained on: English prose, some code and numbers,
#: and text in other scripts so that multi-byte merges exist.
TRAINING_CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog was not amused, and the
fox ran back into the forest before anyone could see where it had gone.

An inference engine turns a trained model into a service. It accepts prompts,
schedules them into batches, runs the model one step at a time and streams
the generated tokens back to whoever asked for them. When a client goes away,
the engine should notice quickly and free the memory that the request held.

Structured concurrency means that every task has a parent, and that a parent
does not finish before its children do. Cancelling a scope cancels everything
inside it. Errors travel upwards instead of being lost in the background.

A tokenizer splits text into pieces and maps each piece to an integer. Byte
pair encoding starts from single bytes and repeatedly merges the most frequent
adjacent pair into a new token, until the vocabulary reaches its target size.

Once upon a time there was a little robot who wanted to learn how to write
poems. Every morning it read a book, and every evening it wrote one line. After
a hundred days it had a poem of a hundred lines, and it was very proud of it.

def greet(name: str) -> str:
    return f"Hello, {name}! You have {len(name)} letters in your name."

for i in range(10):
    print(i, i * i, i ** 3)

Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1024 3.14159 2.71828 1e-5 -273.15

Le renard brun et rapide saute par-dessus le chien paresseux. Où est le café ?
Déjà vu, naïve, façade, élève, garçon, crème brûlée, à bientôt !

Der schnelle braune Fuchs springt über den faulen Hund. Grüße aus München,
Straße, Mädchen, schön, Größe, Übermut.

Быстрая коричневая лиса прыгает через ленивую собаку. Привет, мир!

Η γρήγορη καφέ αλεπού πηδάει πάνω από το τεμπέλικο σκυλί. Καλημέρα κόσμε.

敏捷的棕色狐狸跳过了懒狗。你好，世界！今天天气很好，我们去公园散步吧。
素早い茶色の狐がのろまな犬を飛び越える。こんにちは、世界。ありがとう。
빠른 갈색 여우가 게으른 개를 뛰어넘는다. 안녕하세요, 세계!

Emoji and symbols: 🎉 🚀 ✨ 👍🏽 ❤️ → ← ∑ ∞ ≈ ≠ ± × ÷ € £ ¥ © ® ™ “quotes” ‘single’ — …
"""


def _train(vocab_size: int, corpus: Iterable[str]) -> tokenizers.Tokenizer:
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return tokenizer


def write_byte_level_bpe_tokenizer(
    directory: str | Path,
    *,
    vocab_size: int = 512,
    chat_template: str | None = CHATML_TEMPLATE,
    model_max_length: int = 4096,
    corpus: Iterable[str] | None = None,
    eos_token: str = "<|im_end|>",
) -> None:
    """Train a byte-level BPE on *corpus* (default: the built-in one) and save
    it in *directory*.

    Writes ``tokenizer.json`` and ``tokenizer_config.json`` (eos
    ``<|im_end|>``, pad ``<|endoftext|>``, no BOS, like Qwen2), creating
    *directory* if needed. *vocab_size* counts the 3 special tokens and the
    256 byte tokens; the corpus is small, so very large sizes stop short.
    """
    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size must be at least 259, got {vocab_size}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    lines = TRAINING_CORPUS.splitlines() if corpus is None else corpus
    tokenizer = _train(vocab_size, lines)
    tokenizer.save(str(directory / "tokenizer.json"), pretty=True)
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": eos_token,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "added_tokens_decoder": {
            str(i): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, token in enumerate(SPECIAL_TOKENS)
        },
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
