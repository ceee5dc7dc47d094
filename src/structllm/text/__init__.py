"""The text layer: tokenizers, incremental detokenization, chat templates.

Knows about ``tokenizers`` and ``jinja2``; never imports paddle or anyio.
"""

from structllm.text.byte_tokenizer import BYTE_CHAT_TEMPLATE, ByteTokenizer
from structllm.text.chat import CHATML_TEMPLATE, render_chat_template, validate_messages
from structllm.text.detokenizer import DetokenizerUpdate, IncrementalDetokenizer
from structllm.text.tokenizer import HFTokenizer, Tokenizer, load_tokenizer
from structllm.text.training import write_byte_level_bpe_tokenizer

__all__ = [
    "BYTE_CHAT_TEMPLATE",
    "CHATML_TEMPLATE",
    "ByteTokenizer",
    "DetokenizerUpdate",
    "HFTokenizer",
    "IncrementalDetokenizer",
    "Tokenizer",
    "load_tokenizer",
    "render_chat_template",
    "validate_messages",
    "write_byte_level_bpe_tokenizer",
]
