"""Tokenizers: the built-in byte tokenizer, tokenizer.json directories, training."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import tokenizers
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import processors

from structllm.errors import InvalidRequestError, ModelLoadError
from structllm.text import (
    CHATML_TEMPLATE,
    ByteTokenizer,
    HFTokenizer,
    load_tokenizer,
    write_byte_level_bpe_tokenizer,
)

BYTE = ByteTokenizer()


def _copy_with(
    src: Path,
    dst: Path,
    *,
    config: dict[str, Any] | None = None,
    generation_config: dict[str, Any] | None = None,
) -> Path:
    """A copy of the tokenizer directory *src* with some config keys changed."""
    dst.mkdir()
    (dst / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    merged = json.loads((src / "tokenizer_config.json").read_text()) | (config or {})
    (dst / "tokenizer_config.json").write_text(json.dumps(merged))
    if generation_config is not None:
        (dst / "generation_config.json").write_text(json.dumps(generation_config))
    return dst


# --- ByteTokenizer -----------------------------------------------------------


def test_byte_tokenizer_facts() -> None:
    assert load_tokenizer("tiny-random") == BYTE
    assert BYTE.vocab_size == 258
    assert BYTE.bos_token_id == 256
    assert BYTE.eos_token_ids == {257}
    assert BYTE.all_special_ids == {256, 257}
    assert BYTE.chat_template is not None


def test_byte_tokenizer_encode() -> None:
    assert BYTE.encode("hé") == [256, 104, 195, 169]
    assert BYTE.encode("hé", add_special_tokens=False) == [104, 195, 169]
    specials = BYTE.encode("a<|eos|>b<|bos|>", add_special_tokens=False)
    assert specials == [97, 257, 98, 256]


def test_byte_tokenizer_decode() -> None:
    assert BYTE.decode([256, 104, 105, 257]) == "hi"
    assert BYTE.decode([256, 104, 105, 257], skip_special_tokens=False) == (
        "<|bos|>hi<|eos|>"
    )
    assert BYTE.decode([0xE4, 0xB8]) == "\ufffd"  # incomplete, replaced
    assert BYTE.decode([0xFF, 65]) == "\ufffdA"
    assert BYTE.decode([65, 1000, -1, 66]) == "AB"  # unknown ids are ignored


@given(st.text())
def test_byte_tokenizer_round_trip(text: str) -> None:
    ids = BYTE.encode(text, add_special_tokens=False)
    assert all(0 <= i < BYTE.vocab_size for i in ids)
    assert BYTE.decode(ids, skip_special_tokens=False) == text


def test_byte_tokenizer_pieces() -> None:
    assert BYTE.id_to_piece(97) == "a"
    assert BYTE.id_to_piece(0xE4) == "\ufffd"
    assert BYTE.id_to_piece(257) == "<|eos|>"


# --- HFTokenizer -------------------------------------------------------------


def test_trained_tokenizer_facts(bpe: HFTokenizer, bpe_dir: Path) -> None:
    assert bpe.vocab_size == 512
    assert bpe.bos_token_id is None
    assert bpe.bos_token is None
    assert bpe.eos_token == "<|im_end|>"
    assert bpe.eos_token_ids == {2}
    assert bpe.all_special_ids == {0, 1, 2}
    assert bpe.chat_template == CHATML_TEMPLATE
    assert isinstance(load_tokenizer(str(bpe_dir)), HFTokenizer)


@given(st.text())
def test_trained_tokenizer_round_trip(bpe: HFTokenizer, text: str) -> None:
    ids = bpe.encode(text)
    assert all(0 <= i < bpe.vocab_size for i in ids)
    assert bpe.decode(ids, skip_special_tokens=False) == text


def test_trained_tokenizer_merges_and_specials(bpe: HFTokenizer) -> None:
    ids = bpe.encode("the fox<|im_end|>")
    assert len(ids) < len("the fox") + 1  # merges happened
    assert ids[-1] == 2
    assert bpe.decode(ids) == "the fox"
    assert bpe.decode(ids, skip_special_tokens=False) == "the fox<|im_end|>"


def test_pieces_keep_leading_spaces(bpe: HFTokenizer) -> None:
    ids = bpe.encode(" the é世")
    pieces = [bpe.id_to_piece(i) for i in ids]
    assert pieces[0].startswith(" ")
    assert "".join(pieces).startswith(" the")
    assert bpe.id_to_piece(2) == "<|im_end|>"


def test_metaspace_pieces_keep_leading_spaces() -> None:
    backend = _metaspace_backend()
    tokenizer = HFTokenizer(backend=backend)
    assert tokenizer.decode([2]) == "world"  # the decoder drops it at the start
    assert tokenizer.id_to_piece(2) == " world"


def _metaspace_backend() -> tokenizers.Tokenizer:
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "▁a": 3}
    backend = tokenizers.Tokenizer(
        tokenizers.models.WordLevel(vocab, unk_token="<unk>")
    )
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    backend.decoder = tokenizers.decoders.Metaspace()
    return backend


def test_apply_chat_template(bpe: HFTokenizer) -> None:
    prompt = bpe.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = bpe.encode(prompt, add_special_tokens=False)
    assert ids[0] == 1
    assert bpe.decode(ids, skip_special_tokens=False) == prompt


def test_no_chat_template(bpe_dir: Path, tmp_path: Path) -> None:
    config = json.loads((bpe_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    directory = tmp_path / "tok"
    _copy_with(bpe_dir, directory)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = HFTokenizer.from_directory(directory)
    assert tokenizer.chat_template is None
    with pytest.raises(InvalidRequestError, match="no chat template") as info:
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert info.value.field == "messages"
    # transformers >= 4.43 may keep the template in its own file
    (directory / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    tokenizer = HFTokenizer.from_directory(directory)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}]) == "Hi"


def test_named_chat_templates_pick_default(bpe_dir: Path, tmp_path: Path) -> None:
    templates = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "default"},
    ]
    directory = _copy_with(bpe_dir, tmp_path / "t", config={"chat_template": templates})
    assert HFTokenizer.from_directory(directory).chat_template == "default"


def test_eos_ids_merge_generation_config(bpe_dir: Path, tmp_path: Path) -> None:
    one = _copy_with(bpe_dir, tmp_path / "one", generation_config={"eos_token_id": 0})
    assert HFTokenizer.from_directory(one).eos_token_ids == {0, 2}
    many = _copy_with(
        bpe_dir, tmp_path / "many", generation_config={"eos_token_id": [0, 1, 2]}
    )
    assert HFTokenizer.from_directory(many).eos_token_ids == {0, 1, 2}
    bad = _copy_with(bpe_dir, tmp_path / "bad", generation_config={"eos_token_id": "x"})
    with pytest.raises(ModelLoadError, match="eos_token_id"):
        HFTokenizer.from_directory(bad)


def test_special_tokens_as_dicts(bpe_dir: Path, tmp_path: Path) -> None:
    config = {
        "eos_token": {"content": "<|endoftext|>", "lstrip": False},
        "bos_token": {"content": "<|im_start|>"},
    }
    directory = _copy_with(bpe_dir, tmp_path / "t", config=config)
    tokenizer = HFTokenizer.from_directory(directory)
    assert tokenizer.eos_token_ids == {0}
    assert tokenizer.bos_token_id == 1
    assert tokenizer.encode("a")[0] != 1  # add_bos_token is false


def test_add_bos_token(bpe_dir: Path, tmp_path: Path) -> None:
    config = {"bos_token": "<|endoftext|>", "add_bos_token": True}
    directory = _copy_with(bpe_dir, tmp_path / "t", config=config)
    tokenizer = HFTokenizer.from_directory(directory)
    ids = tokenizer.encode("the fox")
    assert ids[0] == 0
    assert ids[1:] == tokenizer.encode("the fox", add_special_tokens=False)
    assert tokenizer.decode(ids) == "the fox"


def test_add_bos_token_when_post_processor_adds_it(
    bpe_dir: Path, tmp_path: Path
) -> None:
    config = {"bos_token": "<|endoftext|>", "add_bos_token": True}
    directory = _copy_with(bpe_dir, tmp_path / "t", config=config)
    backend = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    backend.save(str(directory / "tokenizer.json"))
    ids = HFTokenizer.from_directory(directory).encode("the fox")
    assert ids[:2] != [0, 0]
    assert ids[0] == 0


def test_saved_truncation_and_padding_are_ignored(
    bpe_dir: Path, tmp_path: Path
) -> None:
    directory = _copy_with(bpe_dir, tmp_path / "t")
    backend = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    backend.enable_truncation(max_length=4)
    backend.enable_padding(length=64, pad_id=0)
    backend.save(str(directory / "tokenizer.json"))
    tokenizer = HFTokenizer.from_directory(directory)
    text = "the quick brown fox jumps over the lazy dog"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert 0 not in tokenizer.encode("a")


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=r"no tokenizer\.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(ModelLoadError, match="not a directory"):
        load_tokenizer(tmp_path / "nope")


def test_malformed_files(bpe_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        HFTokenizer.from_directory(broken)
    config = _copy_with(bpe_dir, tmp_path / "config")
    (config / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json"):
        HFTokenizer.from_directory(config)
    unknown = _copy_with(bpe_dir, tmp_path / "unknown", config={"eos_token": "</s>"})
    with pytest.raises(ModelLoadError, match="'</s>' is not in the vocabulary"):
        HFTokenizer.from_directory(unknown)


def test_tokenizer_config_is_optional(bpe_dir: Path, tmp_path: Path) -> None:
    directory = tmp_path / "bare"
    directory.mkdir()
    (directory / "tokenizer.json").write_bytes(
        (bpe_dir / "tokenizer.json").read_bytes()
    )
    tokenizer = HFTokenizer.from_directory(directory)
    assert tokenizer.eos_token_ids == frozenset()
    assert tokenizer.chat_template is None
    assert tokenizer.all_special_ids == {0, 1, 2}


# --- training ------------------------------------------------------------------


def test_training_is_deterministic_and_fast(bpe_dir: Path, tmp_path: Path) -> None:
    start = time.perf_counter()
    write_byte_level_bpe_tokenizer(tmp_path / "again")
    assert time.perf_counter() - start < 1.0
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (bpe_dir / name).read_bytes()


def test_training_options(tmp_path: Path) -> None:
    write_byte_level_bpe_tokenizer(tmp_path, vocab_size=300, chat_template=None)
    tokenizer = HFTokenizer.from_directory(tmp_path)
    assert tokenizer.vocab_size == 300
    assert tokenizer.chat_template is None
    with pytest.raises(ValueError, match="vocab_size"):
        write_byte_level_bpe_tokenizer(tmp_path, vocab_size=100)


def test_text_layer_imports_neither_paddle_nor_anyio() -> None:
    code = (
        "import sys, structllm.text; "
        "print(sorted(m for m in ('paddle', 'anyio', 'trio') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
