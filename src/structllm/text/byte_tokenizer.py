"""The built-in byte tokenizer of ``tiny-random``: no files, 258 ids."""

from __future__ import annotations

import re
from collections.abc import Sequence

import attrs

from structllm.text.tokenizer import Tokenizer

__all__ = ["BYTE_CHAT_TEMPLATE", "ByteTokenizer"]

#: The chat template of :class:`ByteTokenizer`.
BYTE_CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|tools|>\\n' + tools | tojson + '\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{{ '<tool_call>' + {'name': call['function']['name'],"
    " 'arguments': call['function']['arguments']} | tojson + '</tool_call>' }}"
    "{% endfor %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

_BYTE_BOS = 256
_BYTE_EOS = 257
_BYTE_SPECIALS = {"<|bos|>": _BYTE_BOS, "<|eos|>": _BYTE_EOS}
_BYTE_SPECIALS_RE = re.compile("(" + "|".join(map(re.escape, _BYTE_SPECIALS)) + ")")


@attrs.frozen
class ByteTokenizer(Tokenizer):
    """One token per UTF-8 byte (ids 0-255), then ``<|bos|>`` and ``<|eos|>``."""

    @property
    def vocab_size(self) -> int:
        return 258

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({_BYTE_EOS})

    @property
    def bos_token_id(self) -> int:
        return _BYTE_BOS

    @property
    def bos_token(self) -> str:
        return "<|bos|>"

    @property
    def eos_token(self) -> str:
        return "<|eos|>"

    @property
    def all_special_ids(self) -> frozenset[int]:
        return frozenset({_BYTE_BOS, _BYTE_EOS})

    @property
    def chat_template(self) -> str:
        return BYTE_CHAT_TEMPLATE

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = [_BYTE_BOS] if add_special_tokens else []
        for i, part in enumerate(_BYTE_SPECIALS_RE.split(text)):
            if i % 2:
                ids.append(_BYTE_SPECIALS[part])
            else:
                ids.extend(part.encode())
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        parts: list[str] = []
        buf = bytearray()
        for i in ids:
            if 0 <= i < 256:
                buf.append(i)
            elif i in (_BYTE_BOS, _BYTE_EOS) and not skip_special_tokens:
                parts.append(buf.decode(errors="replace"))
                buf.clear()
                parts.append("<|bos|>" if i == _BYTE_BOS else "<|eos|>")
        parts.append(buf.decode(errors="replace"))
        return "".join(parts)

    def id_to_piece(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)
