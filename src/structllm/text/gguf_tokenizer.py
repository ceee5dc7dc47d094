"""A tokenizer built from a GGUF file's ``tokenizer.*`` metadata.

A GGUF file carries no ``tokenizer.json``: llama.cpp's converters store the
vocabulary, the merges or scores, the token types and the special token ids
under ``tokenizer.ggml.*`` keys, and the chat template under
``tokenizer.chat_template``. :func:`tokenizer_from_gguf` rebuilds from them the
``tokenizers.Tokenizer`` that tokenizes as llama.cpp does
(``src/llama-vocab.cpp``), and wraps it in an
:class:`~structllm.text.tokenizer.HFTokenizer`, so the detokenizer, the chat
templates and structured output's vocabulary see no difference from a model
directory.

Two vocabulary models are read:

``gpt2``
    Byte-level BPE from ``tokens`` and ``merges``. Text is first split by the
    regular expressions llama.cpp keeps for the pre-tokenizer that
    ``tokenizer.ggml.pre`` names (:data:`PRE_TOKENIZERS`), each one splitting
    the pieces of the one before and keeping what lies between matches.
``llama``
    SentencePiece BPE from ``tokens`` and ``scores``: merges are rebuilt from
    the scores (a pair whose concatenation scores higher merges first), bytes
    that no token covers fall back to the ``<0xXX>`` tokens, spaces become
    ``▁`` and, with ``tokenizer.ggml.add_space_prefix`` (the default), every
    run of text between special tokens gets a leading ``▁``, as llama.cpp
    does.

Token types (``tokenizer.ggml.token_type``, llama.cpp's ``LLAMA_TOKEN_TYPE_*``):
1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte. Control and
unknown tokens are special tokens: matched whole in the text and dropped by
``decode(..., skip_special_tokens=True)``. User-defined tokens (``<think>``)
are matched whole but decoded like text. Unused and byte tokens are plain
vocabulary.

End of generation is the EOS id, ``eot_token_id``, ``eom_token_id``, and the
tokens that llama.cpp takes for end-of-generation by their text
(``<|im_end|>``, ``<|eot_id|>``, ``<|endoftext|>``, ...), less its two
exceptions; the fill-in-the-middle tokens llama.cpp adds there are left out.

What the metadata asks for and this module does not do is refused with
:class:`~structllm.errors.ModelLoadError` naming the key, as is malformed
metadata: never a tokenizer that silently splits text differently.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs
import tokenizers
from tokenizers import (
    AddedToken,
    Regex,
    decoders,
    normalizers,
    pre_tokenizers,
    processors,
)
from tokenizers import models as tokenizer_models

from structllm.errors import ModelLoadError
from structllm.text.gguf_vocab import (
    PRE_TOKENIZERS,
    PreTokenizer,
    byte_alphabet,
    end_of_generation_ids,
    merges_from_scores,
    respell,
)
from structllm.text.tokenizer import HFTokenizer

__all__ = [
    "PRE_TOKENIZERS",
    "PreTokenizer",
    "tokenizer_from_gguf",
]

# llama.cpp's LLAMA_TOKEN_TYPE_*
_NORMAL: Final = 1
_UNKNOWN: Final = 2
_CONTROL: Final = 3
_USER_DEFINED: Final = 4
_UNUSED: Final = 5
_BYTE: Final = 6

_KEY = "tokenizer.ggml."


# Keys that change how text is tokenized and that this module does not
# implement, with the value that is harmless.
_REFUSED_FLAGS: Final = {
    "tokenizer.ggml.remove_extra_whitespaces": False,
    "tokenizer.ggml.add_sep_token": False,
}


def tokenizer_from_gguf(metadata: Mapping[str, Any], *, source: str) -> HFTokenizer:
    """The tokenizer described by a GGUF file's metadata.

    *metadata* maps the file's keys to their values (strings, ints, floats,
    bools, and arrays as lists or numpy arrays); *source* names the file in
    error messages.

    Raises :class:`~structllm.errors.ModelLoadError`, naming the key and
    *source*, when a key is missing or malformed, or asks for something this
    module does not implement (a vocabulary model other than ``gpt2`` and
    ``llama``, an unknown ``tokenizer.ggml.pre``).
    """
    return _Reader(metadata, source).tokenizer()


@attrs.frozen
class _Reader:
    metadata: Mapping[str, Any]
    source: str

    def error(self, key: str, problem: str) -> ModelLoadError:
        return ModelLoadError(f"{self.source}: {key} {problem}")

    # --- typed access --------------------------------------------------------

    def string(self, key: str, *, required: bool = False) -> str | None:
        value = self.metadata.get(key)
        if value is None:
            if required:
                raise self.error(key, "is missing")
            return None
        if not isinstance(value, str):
            raise self.error(key, f"must be a string, got {_describe(value)}")
        return value

    def flag(self, key: str) -> bool | None:
        value = self.metadata.get(key)
        if value is None:
            return None
        if not isinstance(value, bool):
            raise self.error(key, f"must be a bool, got {_describe(value)}")
        return value

    def array(self, key: str, *, required: bool = False) -> list[Any] | None:
        # a GGUF file's numbers as lists: the server reads them without numpy
        as_list = getattr(self.metadata, "as_list", None)
        value = self.metadata.get(key) if as_list is None else as_list(key)
        if value is None:
            if required:
                raise self.error(key, "is missing")
            return None
        if hasattr(value, "tolist") and getattr(value, "ndim", None) == 1:
            value = value.tolist()  # a numpy array
        if not isinstance(value, (list, tuple)):
            raise self.error(key, f"must be an array, got {_describe(value)}")
        return list(value)

    def strings(self, key: str, *, required: bool = False) -> list[str] | None:
        values = self.array(key, required=required)
        if values is None:
            return None
        for i, v in enumerate(values):
            if not isinstance(v, str):
                raise self.error(key, f"[{i}] must be a string, got {_describe(v)}")
        return values

    def numbers(self, key: str, count: int, *, integer: bool) -> list[Any] | None:
        values = self.array(key)
        if values is None:
            return None
        if len(values) != count:
            raise self.error(
                key,
                f"has {len(values)} entries but tokenizer.ggml.tokens has {count}",
            )
        kinds: tuple[type, ...] = (int,) if integer else (int, float)
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, kinds):
                raise self.error(
                    key,
                    f"[{i}] must be {'an integer' if integer else 'a number'}, "
                    f"got {_describe(v)}",
                )
        return values

    def token_id(self, key: str, count: int) -> int | None:
        value = self.metadata.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"must be an integer, got {_describe(value)}")
        if not 0 <= value < count:
            raise self.error(
                key, f"is {value}, outside the vocabulary of {count} tokens"
            )
        return value

    # --- the tokenizer -------------------------------------------------------

    def tokenizer(self) -> HFTokenizer:
        model = self.string(_KEY + "model", required=True)
        if model not in ("gpt2", "llama"):
            raise self.error(
                _KEY + "model",
                f"is {model!r}; structllm reads the 'gpt2' (byte-level BPE) and "
                f"'llama' (SentencePiece BPE) tokenizers",
            )
        for key, harmless in _REFUSED_FLAGS.items():
            if self.flag(key) not in (None, harmless):
                raise self.error(key, "is set; structllm does not implement it")

        tokens = self.strings(_KEY + "tokens", required=True)
        assert tokens is not None
        count = len(tokens)
        if count == 0:
            raise self.error(_KEY + "tokens", "is empty")
        types = self.numbers(_KEY + "token_type", count, integer=True)
        if types is None:
            types = [_NORMAL] * count
        for i, t in enumerate(types):
            if not _NORMAL <= t <= _BYTE:
                raise self.error(
                    _KEY + "token_type", f"[{i}] is {t}, not a token type (1 to 6)"
                )
        for i, token in enumerate(tokens):
            if not token:  # llama.cpp's name for an empty token
                tokens[i] = f"[EMPTY_{i}]"
        # one token -> id map for the whole build: the duplicate check, the
        # merges' check and the model's vocabulary (49,152 entries, 4 MiB)
        ids: dict[str, int] = {}
        for i, token in enumerate(tokens):
            first = ids.setdefault(token, i)
            if first != i:
                raise self.error(
                    _KEY + "tokens", f"holds {token!r} twice (ids {first} and {i})"
                )

        spm = model == "llama"
        # llama.cpp's defaults: a SentencePiece vocabulary has <unk> <s> </s>
        # at 0 1 2 and adds BOS; a gpt2 one has none of these.
        bos_id = self.token_id(_KEY + "bos_token_id", count)
        eos_id = self.token_id(_KEY + "eos_token_id", count)
        unk_id = self.token_id(_KEY + "unknown_token_id", count)
        self.token_id(_KEY + "padding_token_id", count)
        eot_id = self.token_id(_KEY + "eot_token_id", count)
        eom_id = self.token_id(_KEY + "eom_token_id", count)
        if spm:
            bos_id = _default_id(bos_id, 1, count)
            eos_id = _default_id(eos_id, 2, count)
            unk_id = _default_id(unk_id, 0, count)

        if spm:
            pre = None
            add_bos_default = True
        else:
            pre_name = self.string(_KEY + "pre") or "default"
            pre = PRE_TOKENIZERS.get(pre_name)
            if pre is None:
                raise self.error(
                    _KEY + "pre",
                    f"is {pre_name!r}, a pre-tokenizer structllm does not know "
                    f"(known: {', '.join(sorted(PRE_TOKENIZERS))})",
                )
            add_bos_default = pre.add_bos
        add_bos = self.flag(_KEY + "add_bos_token")
        add_bos = add_bos_default if add_bos is None else add_bos
        add_eos = self.flag(_KEY + "add_eos_token") or False
        if add_bos and bos_id is None:
            raise self.error(
                _KEY + "add_bos_token", "is set but tokenizer.ggml.bos_token_id is not"
            )
        if add_eos and eos_id is None:
            raise self.error(
                _KEY + "add_eos_token", "is set but tokenizer.ggml.eos_token_id is not"
            )

        special = {i for i, t in enumerate(types) if t in (_CONTROL, _UNKNOWN)}
        special.update(i for i in (bos_id, eos_id, unk_id) if i is not None)
        user_defined = [
            i for i, t in enumerate(types) if t == _USER_DEFINED and i not in special
        ]

        if spm:
            backend = self.sentencepiece(tokens, ids, unk_id)
        else:
            assert pre is not None
            backend = self.byte_level(tokens, ids, special | set(user_defined), pre)
        del ids  # the model has its own copy
        # Added tokens are matched whole in the raw text, longest first.
        backend.add_special_tokens(
            [AddedToken(tokens[i], normalized=False, special=True) for i in special]
        )
        backend.add_tokens(
            [
                AddedToken(tokens[i], normalized=False, special=False)
                for i in user_defined
            ]
        )
        if backend.get_vocab_size(with_added_tokens=True) != count:
            raise self.error(
                _KEY + "tokens", "gives a vocabulary whose added tokens are not its own"
            )
        backend.post_processor = _bos_eos_processor(
            tokens, bos_id if add_bos else None, eos_id if add_eos else None
        )

        chat_template = self.string("tokenizer.chat_template")
        end_ids = {i for i in (eot_id, eom_id) if i is not None}
        end_ids.update(end_of_generation_ids(tokens))
        return HFTokenizer(
            backend=backend,
            bos_token=None if bos_id is None else tokens[bos_id],
            eos_token=None if eos_id is None else tokens[eos_id],
            chat_template=chat_template,
            add_bos_token=add_bos,
            extra_eos_token_ids=frozenset(end_ids),
        )

    def byte_level(
        self,
        tokens: list[str],
        ids: dict[str, int],
        added: set[int],
        pre: PreTokenizer,
    ) -> tokenizers.Tokenizer:
        merges_key = _KEY + "merges"
        merges = self.strings(merges_key, required=True)
        assert merges is not None
        # Tokens are stored in the byte alphabet (Ġ for a space). A normal
        # token that is not (a rare converter slip) is respelled, as
        # transformers does; added tokens stay as written, being matched on
        # the raw text.
        alphabet = byte_alphabet()
        respelled: dict[str, int] = {}
        for i, token in enumerate(tokens):
            if i not in added and not set(token) <= alphabet.keys():
                spelled = respell(token)
                if spelled not in ids and spelled not in respelled:
                    respelled[spelled] = i
        vocab, names = ids, tokens  # each id's name in the model
        if respelled:
            vocab, names = dict(ids), list(tokens)
            for spelled, i in respelled.items():
                del vocab[tokens[i]]
                vocab[spelled] = i
                names[i] = spelled
        # Each pair holds the vocabulary's own strings, not the two new ones
        # a split makes: 49,000 merges' pairs take 3 MiB instead of 9.
        pairs: list[tuple[str, str]] = []
        for n, merge in enumerate(merges):
            # llama.cpp splits at the first space after the first character
            cut = merge.find(" ", 1)
            left, right = merge[:cut], merge[cut + 1 :]
            if cut < 0 or not right or " " in right:
                raise self.error(
                    merges_key, f"[{n}] is {merge!r}, not two tokens and a space"
                )
            for part in (left, right, left + right):
                if part not in vocab:
                    raise self.error(
                        merges_key,
                        f"[{n}] is {merge!r}, but {part!r} is not a token",
                    )
            pairs.append((names[vocab[left]], names[vocab[right]]))
        try:
            model = tokenizer_models.BPE(
                vocab=vocab, merges=pairs, ignore_merges=pre.ignore_merges
            )
        except Exception as exc:  # tokenizers raises plain Exception
            raise self.error(merges_key, f"cannot be loaded: {exc}") from exc
        backend = tokenizers.Tokenizer(model)
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                *(
                    pre_tokenizers.Split(Regex(r), behavior="isolated")
                    for r in pre.regexes
                ),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        backend.decoder = decoders.ByteLevel()
        return backend

    def sentencepiece(
        self, tokens: list[str], ids: dict[str, int], unk_id: int | None
    ) -> tokenizers.Tokenizer:
        scores = self.numbers(_KEY + "scores", len(tokens), integer=False)
        if scores is None:
            raise self.error(_KEY + "scores", "is missing")
        add_space_prefix = self.flag(_KEY + "add_space_prefix")
        add_space_prefix = True if add_space_prefix is None else add_space_prefix
        model = tokenizer_models.BPE(
            vocab=ids,
            merges=merges_from_scores(tokens, scores),
            unk_token=None if unk_id is None else tokens[unk_id],
            fuse_unk=True,
            byte_fallback=True,
        )
        backend = tokenizers.Tokenizer(model)
        # A normalizer, not Metaspace: it runs on each stretch of text between
        # added tokens and prepends ▁ even to one that starts with a space,
        # which is llama.cpp's (and SentencePiece's) add_dummy_prefix.
        steps: list[normalizers.Normalizer] = []
        if add_space_prefix:
            steps.append(normalizers.Prepend("\u2581"))
        steps.append(normalizers.Replace(" ", "\u2581"))
        backend.normalizer = normalizers.Sequence(steps)
        backend.pre_tokenizer = None
        decoding: list[decoders.Decoder] = [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
        ]
        if add_space_prefix:
            decoding.append(decoders.Strip(" ", 1, 0))
        backend.decoder = decoders.Sequence(decoding)
        return backend


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _default_id(value: int | None, default: int, count: int) -> int | None:
    if value is not None:
        return value
    return default if default < count else None


def _bos_eos_processor(
    tokens: Sequence[str], bos_id: int | None, eos_id: int | None
) -> processors.PostProcessor | None:
    if bos_id is None and eos_id is None:
        return None
    single: list[str] = []
    special: list[dict[str, Any]] = []
    if bos_id is not None:
        single.append("BOS")
        special.append({"id": "BOS", "ids": [bos_id], "tokens": [tokens[bos_id]]})
    single.append("$A")
    if eos_id is not None:
        single.append("EOS")
        special.append({"id": "EOS", "ids": [eos_id], "tokens": [tokens[eos_id]]})
    pair = [*single, *(s.replace("$A", "$B") for s in single)]
    return processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(pair), special_tokens=special
    )
