"""Prompt-grounded and open-ended prompts: speculative decoding's workloads.

Prompt lookup (``speculative_config`` method ``"ngram"``) pays where the
output repeats the input: rewriting or summarising a given text, editing
given code. ``grounded`` is such prompts; ``chat`` is open-ended chat,
where little repeats and speculation should cost next to nothing. Both are
user turns in the model's chat template (plain text for a model without
one), cycled to the number of prompts; they mean something to a real model
(``--model smollm2``) only: a random checkpoint's output repeats nothing.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from structllm.text.tokenizer import Tokenizer

__all__ = [
    "CHAT",
    "GROUNDED",
    "TextWorkload",
    "chat_prompt",
    "text_workload",
]

TextWorkload = Literal["grounded", "chat"]

PARAGRAPH = (
    "The city council met on Tuesday to discuss the new budget for the public "
    "library. After a long debate, the members agreed to extend the opening "
    "hours on weekends, to buy more books for children, and to repair the roof "
    "of the main reading room before the winter. The mayor said that the "
    "library is one of the most important places in the city, because it is "
    "open to everyone and it costs nothing to use."
)
CODE = """def average(numbers):
    total = 0
    for number in numbers:
        total += number
    return total / len(number)


def main():
    values = [3, 5, 8, 13]
    print("The average is", average(values))
"""
#: rewrite, edit and summarise given text: the output copies the prompt
GROUNDED = (
    f"Rewrite the following text, keeping every sentence:\n\n{PARAGRAPH}",
    f"Fix the bug in this code and show the whole corrected code:\n\n{CODE}",
    f"Repeat the following text exactly:\n\n{PARAGRAPH}",
    f"Summarise the following text in two sentences:\n\n{PARAGRAPH}",
)
#: open-ended: the output copies little
CHAT = (
    "Write a short story about a robot who learns to paint.",
    "What are three good habits for staying healthy? Explain each one.",
    "Describe a walk through a forest in autumn.",
)


def chat_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    """``text`` as a user turn, tokenised (as plain text where the model has
    no chat template)."""
    if tokenizer.chat_template is None:
        return tokenizer.encode(text)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    # the template writes BOS itself
    return tokenizer.encode(rendered, add_special_tokens=False)


def text_workload(
    kind: TextWorkload,
    n: int,
    output_len: tuple[int, int],
    tokenizer: Tokenizer,
    seed: int,
) -> list[tuple[list[int], int]]:
    """``n`` (prompt token ids, output length) pairs: ``kind``'s prompts in
    turn, output lengths drawn uniformly from ``output_len`` (``seed``)."""
    texts = GROUNDED if kind == "grounded" else CHAT
    prompts = [chat_prompt(tokenizer, t) for t in texts]
    rng = np.random.default_rng(seed)
    lengths = rng.integers(output_len[0], output_len[1] + 1, size=n).tolist()
    return [(prompts[i % len(prompts)], int(lengths[i])) for i in range(n)]
