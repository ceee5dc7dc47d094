"""Tokenizers: the :class:`Tokenizer` interface and :class:`HFTokenizer`.

:class:`HFTokenizer` reads a Hugging Face model directory (``tokenizer.json``
plus the optional ``tokenizer_config.json``, ``chat_template.jinja`` and
``generation_config.json``); :class:`~structllm.text.byte_tokenizer.ByteTokenizer`
needs no files and serves the built-in ``tiny-random`` model.
:func:`load_tokenizer` picks one.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import tokenizers

from structllm.errors import InvalidRequestError, ModelLoadError
from structllm.text.chat import render_chat_template

__all__ = [
    "HFTokenizer",
    "Tokenizer",
    "load_tokenizer",
]


class Tokenizer(abc.ABC):
    """Text to token ids and back, plus what the engine needs to know about it.

    Implementations are immutable and safe to share between threads.
    """

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """How many ids the tokenizer knows, added tokens included."""

    @property
    @abc.abstractmethod
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation (tokenizer and generation config)."""

    @property
    @abc.abstractmethod
    def bos_token_id(self) -> int | None: ...

    @property
    @abc.abstractmethod
    def bos_token(self) -> str | None: ...

    @property
    @abc.abstractmethod
    def eos_token(self) -> str | None: ...

    @property
    @abc.abstractmethod
    def all_special_ids(self) -> frozenset[int]:
        """Ids that ``decode(..., skip_special_tokens=True)`` drops."""

    @property
    @abc.abstractmethod
    def chat_template(self) -> str | None: ...

    @abc.abstractmethod
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of *text*; with *add_special_tokens*, BOS and the like.

        Special-token strings inside *text* (``"<|im_end|>"``) become their
        ids. Encode a rendered chat prompt with ``add_special_tokens=False``:
        chat templates write the BOS themselves.
        """

    @abc.abstractmethod
    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of *ids*; incomplete UTF-8 becomes U+FFFD.

        Ids the tokenizer does not know are ignored.
        """

    @abc.abstractmethod
    def id_to_piece(self, token_id: int) -> str:
        """The text one token adds in the middle of a sequence (for logprobs).

        Special tokens are spelled out; a token holding only part of a UTF-8
        character gives U+FFFD.
        """

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        **extra: Any,
    ) -> str:
        """Render *messages* with this tokenizer's chat template
        (:func:`~structllm.text.chat.render_chat_template`).

        Raises :class:`~structllm.errors.InvalidRequestError` when the model
        has no template, the messages are malformed or the template fails.
        """
        if self.chat_template is None:
            raise InvalidRequestError(
                "this model has no chat template; send a plain prompt instead",
                field="messages",
            )
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            template_kwargs=template_kwargs,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **extra,
        )


# --- Hugging Face tokenizer.json ---------------------------------------------


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


def _token_content(config: Mapping[str, Any], key: str) -> str | None:
    # "eos_token": "</s>" or {"content": "</s>", "lstrip": false, ...}
    value = config.get(key)
    if isinstance(value, Mapping):
        value = value.get("content")
    if value is None or isinstance(value, str):
        return value
    raise ModelLoadError(
        f"tokenizer_config.json: {key} must be a string, got {value!r}"
    )


def _chat_template(config: Mapping[str, Any], directory: Path) -> str | None:
    value = config.get("chat_template")
    if isinstance(value, list):
        # Several named templates: the unnamed use takes "default".
        named = {
            t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)
        }
        value = named.get("default")
    if value is None:
        jinja_file = directory / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text(encoding="utf-8")
        return None
    if not isinstance(value, str):
        raise ModelLoadError(
            f"tokenizer_config.json: chat_template must be a string, got {value!r}"
        )
    return value


def _eos_ids_from_generation_config(config: Mapping[str, Any]) -> frozenset[int]:
    value = config.get("eos_token_id")
    if value is None:
        return frozenset()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ModelLoadError(
            f"generation_config.json: eos_token_id must be an int or a list of "
            f"ints, got {value!r}"
        )
    return frozenset(values)


@attrs.frozen(kw_only=True, eq=False)
class HFTokenizer(Tokenizer):
    """A ``tokenizers.Tokenizer`` with the settings of tokenizer_config.json.

    Build it with :meth:`from_directory`. ``add_bos_token`` follows Llama's
    flag: when set and the tokenizer's post-processor does not already add
    BOS, :meth:`encode` with ``add_special_tokens=True`` prepends it.
    """

    backend: tokenizers.Tokenizer = attrs.field(repr=False)
    bos_token: str | None = None
    eos_token: str | None = None
    chat_template: str | None = None
    add_bos_token: bool = False
    #: more end-of-sequence ids, usually from generation_config.json
    extra_eos_token_ids: frozenset[int] = frozenset()

    _vocab_size: int = attrs.field(init=False)
    _bos_token_id: int | None = attrs.field(init=False)
    _eos_token_ids: frozenset[int] = attrs.field(init=False)
    _special_ids: frozenset[int] = attrs.field(init=False)
    _prepend_bos: bool = attrs.field(init=False)
    _pieces: dict[int, str] = attrs.field(init=False, factory=dict)
    _anchor: list[int] = attrs.field(init=False)
    _anchor_text: str = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        set_ = object.__setattr__
        backend = self.backend
        set_(self, "_vocab_size", backend.get_vocab_size(with_added_tokens=True))
        bos_id = self._token_id("bos_token", self.bos_token)
        eos_id = self._token_id("eos_token", self.eos_token)
        set_(self, "_bos_token_id", bos_id)
        eos_ids = set(self.extra_eos_token_ids)
        if eos_id is not None:
            eos_ids.add(eos_id)
        set_(self, "_eos_token_ids", frozenset(eos_ids))
        special = {
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        }
        special.update(i for i in (bos_id, eos_id) if i is not None)
        set_(self, "_special_ids", frozenset(special))
        adds_bos = backend.encode("", add_special_tokens=True).ids[:1] == [bos_id]
        set_(
            self,
            "_prepend_bos",
            self.add_bos_token and bos_id is not None and not adds_bos,
        )
        # id_to_piece decodes each token after this one, to keep leading spaces.
        anchor = backend.encode("a", add_special_tokens=False).ids[:1]
        set_(self, "_anchor", anchor)
        set_(self, "_anchor_text", self.decode(anchor, skip_special_tokens=False))

    def _token_id(self, name: str, token: str | None) -> int | None:
        if token is None:
            return None
        token_id: int | None = self.backend.token_to_id(token)
        if token_id is None:
            raise ModelLoadError(f"{name} {token!r} is not in the vocabulary")
        return token_id

    @classmethod
    def from_directory(cls, path: str | Path) -> HFTokenizer:
        """Load ``tokenizer.json`` and the configs beside it from *path*.

        Raises :class:`~structllm.errors.ModelLoadError` when a file is missing
        or malformed.
        """
        directory = Path(path)
        if not directory.is_dir():
            raise ModelLoadError(f"{directory} is not a directory")
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(
                f"{directory} has no tokenizer.json; structllm reads only fast "
                f"tokenizers (transformers' AutoTokenizer.save_pretrained "
                f"writes one)"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises plain Exception
            raise ModelLoadError(f"cannot load {tokenizer_file}: {exc}") from exc
        # A saved tokenizer.json may carry padding or truncation; we want neither.
        backend.no_padding()
        backend.no_truncation()
        config = _read_json(directory / "tokenizer_config.json") or {}
        generation_config = _read_json(directory / "generation_config.json") or {}
        add_bos = config.get("add_bos_token", False)
        return cls(
            backend=backend,
            bos_token=_token_content(config, "bos_token"),
            eos_token=_token_content(config, "eos_token"),
            chat_template=_chat_template(config, directory),
            add_bos_token=add_bos is True,
            extra_eos_token_ids=_eos_ids_from_generation_config(generation_config),
        )

    @classmethod
    def from_gguf_metadata(
        cls, metadata: Mapping[str, Any], *, source: str
    ) -> HFTokenizer:
        """The tokenizer a GGUF file's ``tokenizer.*`` metadata describes
        (:func:`~structllm.text.gguf_tokenizer.tokenizer_from_gguf`); *source*
        names the file in error messages."""
        from structllm.text.gguf_tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(metadata, source=source)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def all_special_ids(self) -> frozenset[int]:
        return self._special_ids

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if len(text) > 4096:
            # encode_batch releases the GIL (encode does not): a long text
            # tokenised in a worker thread then leaves the event loop running
            (encoding,) = self.backend.encode_batch(
                [text], add_special_tokens=add_special_tokens
            )
            ids: list[int] = encoding.ids
        else:
            ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos:
            assert self._bos_token_id is not None
            ids.insert(0, self._bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        text: str = self.backend.decode(
            list(ids), skip_special_tokens=skip_special_tokens
        )
        return text

    def id_to_piece(self, token_id: int) -> str:
        piece = self._pieces.get(token_id)
        if piece is None:
            # Decoders such as Metaspace drop the leading space of the first
            # token; decode after an anchor token and cut the anchor off.
            head = self._anchor_text
            both = self.decode([*self._anchor, token_id], skip_special_tokens=False)
            if head and both.startswith(head):
                piece = both[len(head) :]
            else:
                piece = self.decode([token_id], skip_special_tokens=False)
            self._pieces[token_id] = piece
        return piece


def load_tokenizer(path_or_name: str | Path) -> Tokenizer:
    """The tokenizer of a model reference (see ``structllm.models.resolve_model``):
    a directory read by :meth:`HFTokenizer.from_directory`, a GGUF file's
    own (``structllm.text.gguf_tokenizer``), or a built-in name
    (``"tiny-random"`` has the byte tokenizer)."""
    from structllm.models import resolve_model
    from structllm.text.byte_tokenizer import ByteTokenizer

    path = resolve_model(path_or_name)
    if path is None:
        return ByteTokenizer()
    if path.is_file():
        from structllm.formats.gguf import GGUFFile
        from structllm.text.gguf_tokenizer import tokenizer_from_gguf

        with GGUFFile.open(path) as f:
            metadata = f.metadata
        # the map closed; the tokenizer's arrays are read when it asks for
        # them, each from a brief new map of the file
        return tokenizer_from_gguf(metadata, source=path.name)
    return HFTokenizer.from_directory(path)
