"""Tokenizers built from GGUF metadata (text/gguf_tokenizer.py).

The expected ids are in tests/data/gguf_tokenizer_oracle.json, written by
tools/record_gguf_tokenizer.py: llama.cpp's tokenizer as that script renders
it in Python, next to what transformers gives for the same file.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from structllm.errors import ModelLoadError
from structllm.models import SMOLLM2, resolve_model
from structllm.text import HFTokenizer
from structllm.text.detokenizer import IncrementalDetokenizer
from structllm.text.gguf_tokenizer import PRE_TOKENIZERS, tokenizer_from_gguf

DATA = Path(__file__).parent / "data"
ORACLE = json.loads((DATA / "gguf_tokenizer_oracle.json").read_text("utf-8"))


@functools.cache
def smollm2_path() -> str:
    """The real SmolLM2 GGUF (the built-in ``smollm2``, fetched once through pip)."""
    return str(resolve_model(SMOLLM2))


def read_metadata(path: Path | str, *, as_numpy: bool = False) -> dict[str, Any]:
    """The tokenizer keys of a GGUF file, as the project's reader gives them:
    strings, Python numbers, arrays as lists (or numpy arrays)."""
    reader = gguf.GGUFReader(str(path))
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if as_numpy and isinstance(value, list):
            value = np.array(value)
        metadata[key] = value
    return metadata


BPE = read_metadata(DATA / "gguf_tokenizer" / "bpe.gguf")
SPM = read_metadata(DATA / "gguf_tokenizer" / "spm.gguf")


def _fixture_metadata(name: str) -> dict[str, Any]:
    fixture = ORACLE["fixtures"][name]
    if name == "smollm2":
        return read_metadata(smollm2_path())
    if name == "spm":
        return SPM
    return {**BPE, "tokenizer.ggml.pre": fixture["pre"]}


_CACHE: dict[str, HFTokenizer] = {}


def _tokenizer(name: str) -> HFTokenizer:
    if name not in _CACHE:
        _CACHE[name] = tokenizer_from_gguf(_fixture_metadata(name), source=name)
    return _CACHE[name]


@pytest.mark.parametrize("name", sorted(ORACLE["fixtures"]))
def test_encode_and_decode_match_llama_cpp(name: str) -> None:
    tok = _tokenizer(name)
    for case in ORACLE["fixtures"][name]["cases"]:
        text, add = case["text"], case["add_special_tokens"]
        assert tok.encode(text, add_special_tokens=add) == case["llama_cpp"], case
        ids = case["llama_cpp"]
        assert tok.decode(ids, skip_special_tokens=False) == case["decoded"], case
        assert (
            tok.decode(ids, skip_special_tokens=True) == case["decoded_skip_special"]
        ), case


def test_the_oracle_differs_from_transformers_only_where_llama_cpp_does() -> None:
    # transformers 5 leaves the split of pre-tokenizers it does not know to
    # GPT-2's regex, and prepends ▁ only to the start of the text (and not
    # to text that already starts with a space); llama.cpp, and so structllm,
    # split as tokenizer.ggml.pre says and prepend ▁ to every stretch of text
    # between special tokens.
    differing = {
        name
        for name, fixture in ORACLE["fixtures"].items()
        if not all(c["agrees_with_transformers"] for c in fixture["cases"])
    }
    assert differing <= {
        "spm",
        "bpe:default",
        "bpe:smollm",
        "bpe:deepseek-coder",
        "bpe:falcon",
    }
    for case in ORACLE["fixtures"]["spm"]["cases"]:
        if not case["agrees_with_transformers"]:
            assert case["text"].startswith(" ") or "<" in case["text"], case


def test_every_recorded_pre_tokenizer_is_known() -> None:
    pres = {f["pre"] for f in ORACLE["fixtures"].values() if "pre" in f}
    assert pres <= PRE_TOKENIZERS.keys()
    assert {"smollm", "llama-bpe", "qwen2", "gpt-2", "default"} <= pres


def test_numpy_arrays_are_read_like_lists() -> None:
    for path in ("bpe.gguf", "spm.gguf"):
        as_lists = read_metadata(DATA / "gguf_tokenizer" / path)
        as_arrays = read_metadata(DATA / "gguf_tokenizer" / path, as_numpy=True)
        assert isinstance(as_arrays["tokenizer.ggml.tokens"], np.ndarray)
        text = "<|im_start|>user\nhello world 123<|im_end|>"
        a = tokenizer_from_gguf(as_lists, source=path)
        b = tokenizer_from_gguf(as_arrays, source=path)
        assert a.encode(text) == b.encode(text)
        assert a.vocab_size == b.vocab_size == len(as_lists["tokenizer.ggml.tokens"])


@pytest.mark.parametrize("name", ["bpe", "spm"])
def test_a_gguf_files_tokenizer_builds_without_numpy(name: str) -> None:
    """As the server's process reads it, with no numpy: the file's numbers
    (token types, scores) come as lists (``GGUFMetadata.as_list``), and the
    tokenizer encodes as the one built from numpy arrays."""
    path = DATA / "gguf_tokenizer" / f"{name}.gguf"
    text = "Hello world, it's 2026! \u00fc <s> tabs\tand  spaces"
    code = f"""
import sys
sys.modules["numpy"] = None  # an import of it fails
from structllm.formats import GGUFFile
from structllm.text.gguf_tokenizer import tokenizer_from_gguf
with GGUFFile.open({str(path)!r}) as f:
    tok = tokenizer_from_gguf(f.metadata, source="x")
print(tok.encode({text!r}))
"""
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    tok = tokenizer_from_gguf(read_metadata(path, as_numpy=True), source="x")
    assert json.loads(run.stdout) == tok.encode(text)


def test_special_tokens_of_the_bpe_file() -> None:
    tok = tokenizer_from_gguf(BPE, source="bpe.gguf")
    tokens = BPE["tokenizer.ggml.tokens"]
    im_end = tokens.index("<|im_end|>")
    endoftext = tokens.index("<|endoftext|>")
    assert tok.eos_token == "<|im_end|>"
    assert tok.bos_token_id == endoftext
    # <|im_end|> is the EOS; <|endoftext|> ends generation in llama.cpp too
    assert tok.eos_token_ids == {im_end, endoftext}
    # control tokens are special; the user-defined <think> is not
    assert tokens.index("<|im_start|>") in tok.all_special_ids
    think = tokens.index("<think>")
    assert think not in tok.all_special_ids
    assert tok.encode("<think>", add_special_tokens=False) == [think]
    assert tok.decode([think, im_end]) == "<think>"
    assert tok.id_to_piece(im_end) == "<|im_end|>"
    assert tok.vocab_size == len(tokens)
    # the file says add_bos_token false
    assert tok.encode("hello") == tok.encode("hello", add_special_tokens=False)


def test_special_tokens_of_the_sentencepiece_file() -> None:
    tok = tokenizer_from_gguf(SPM, source="spm.gguf")
    tokens = SPM["tokenizer.ggml.tokens"]
    assert (tok.bos_token, tok.eos_token, tok.bos_token_id) == ("<s>", "</s>", 1)
    assert tok.eos_token_ids == {2, tokens.index("<|im_end|>")}
    assert {0, 1, 2, tokens.index("<|im_start|>")} <= tok.all_special_ids
    assert tokens.index("<unused0>") not in tok.all_special_ids
    assert tok.encode("hello")[0] == 1
    # byte fallback pieces decode to the character, in logprobs too
    ids = tok.encode("🎉", add_special_tokens=False)
    assert [tokens[i] for i in ids] == [
        "\u2581",
        "<0xF0>",
        "<0x9F>",
        "<0x8E>",
        "<0x89>",
    ]
    assert tok.decode(ids) == "🎉"
    assert tok.id_to_piece(tokens.index("\u2581hello")) == " hello"


def test_a_sentencepiece_file_without_space_prefix() -> None:
    tok = tokenizer_from_gguf(
        {**SPM, "tokenizer.ggml.add_space_prefix": False}, source="spm.gguf"
    )
    tokens = SPM["tokenizer.ggml.tokens"]
    ids = tok.encode("hello world", add_special_tokens=False)
    assert [tokens[i] for i in ids] == ["hello", "\u2581world"]
    assert tok.decode(ids) == "hello world"
    assert tok.decode(tok.encode(" hello", add_special_tokens=False)) == " hello"


def test_add_bos_and_add_eos() -> None:
    tok = tokenizer_from_gguf(
        {**SPM, "tokenizer.ggml.add_bos_token": False}, source="spm.gguf"
    )
    assert tok.encode("hello") == tok.encode("hello", add_special_tokens=False)
    tok = tokenizer_from_gguf(
        {**SPM, "tokenizer.ggml.add_eos_token": True}, source="spm.gguf"
    )
    ids = tok.encode("hello")
    assert (ids[0], ids[-1]) == (1, 2)
    assert tok.encode("") == [1, 2]
    # a file without the key: llama.cpp adds BOS for SentencePiece and llama3
    no_key = {k: v for k, v in SPM.items() if k != "tokenizer.ggml.add_bos_token"}
    assert tokenizer_from_gguf(no_key, source="spm.gguf").encode("a")[0] == 1
    bpe = {k: v for k, v in BPE.items() if k != "tokenizer.ggml.add_bos_token"}
    bos = BPE["tokenizer.ggml.bos_token_id"]
    llama3 = tokenizer_from_gguf({**bpe, "tokenizer.ggml.pre": "llama-bpe"}, source="x")
    assert llama3.encode("a")[0] == bos
    assert tokenizer_from_gguf(bpe, source="x").encode("a")[0] != bos


def test_eot_and_eom_ids_end_generation() -> None:
    tok = tokenizer_from_gguf(
        {
            **BPE,
            "tokenizer.ggml.eot_token_id": 5,
            "tokenizer.ggml.eom_token_id": 6,
        },
        source="bpe.gguf",
    )
    assert {5, 6} <= tok.eos_token_ids


def test_llama_cpp_exceptions_to_end_of_generation_by_name() -> None:
    names = ["<|end|>", "<|return|>", "<|call|>"]
    md = {
        **BPE,
        "tokenizer.ggml.tokens": [*BPE["tokenizer.ggml.tokens"], *names],
        "tokenizer.ggml.token_type": [*BPE["tokenizer.ggml.token_type"], 3, 3, 3],
    }
    tok = tokenizer_from_gguf(md, source="harmony.gguf")
    n = len(BPE["tokenizer.ggml.tokens"])
    assert {n + 1, n + 2} <= tok.eos_token_ids
    assert n not in tok.eos_token_ids  # <|end|> goes on when <|return|> exists


def test_chat_template_renders() -> None:
    for md in (BPE, SPM):
        tok = tokenizer_from_gguf(md, source="x.gguf")
        messages = [{"role": "user", "content": "hi"}]
        prompt = tok.apply_chat_template(messages)
        assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        assert tok.apply_chat_template(messages, add_generation_prompt=False) == (
            "<|im_start|>user\nhi<|im_end|>\n"
        )
    no_template = {k: v for k, v in BPE.items() if k != "tokenizer.chat_template"}
    assert tokenizer_from_gguf(no_template, source="x").chat_template is None


def test_incremental_detokenizer_reads_it() -> None:
    tok = tokenizer_from_gguf(SPM, source="spm.gguf")
    text = "hello world 😀 café"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    out = "".join(detok.add_tokens([i]).text for i in ids) + detok.finish().text
    assert out == text


def test_smollm2_facts() -> None:
    path = smollm2_path()
    md = read_metadata(path)
    assert md["tokenizer.ggml.pre"] == "smollm"
    tok = tokenizer_from_gguf(md, source=Path(path).name)
    assert tok.eos_token == "<|im_end|>"
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [2]
    assert tok.eos_token_ids == {0, 2}  # <|im_end|>, <|endoftext|>
    assert tok.bos_token_id == 1
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.startswith("<|im_start|>system\n")


def test_smollm2_builds_within_a_few_mib_of_python_temporaries() -> None:
    """The server process builds the tokenizer once; its peak memory is the
    metadata's arrays and the temporaries. The arrays are read from the map
    when the tokenizer asks for them (never at open), one token -> id map
    serves the duplicate check, the merges' check and the model, and the
    merges' pairs hold the vocabulary's own strings: 15 MiB of Python
    allocations at peak, open to built, for SmolLM2's 49,152 tokens and
    48,900 merges (16.6 MiB when open read every array; the temporaries
    alone were 18 MiB more when each step kept its own copies)."""
    import tracemalloc

    from structllm.formats.gguf import GGUFFile

    with GGUFFile.open(smollm2_path()) as f:
        tokenizer_from_gguf(f.metadata, source="smollm2.gguf")  # the caches
    tracemalloc.start()
    try:
        with GGUFFile.open(smollm2_path()) as f:  # as the server reads it
            md = f.metadata
        tok = tokenizer_from_gguf(md, source="smollm2.gguf")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert tok.vocab_size == 49152
    assert peak < 18 * 2**20, f"{peak / 2**20:.1f} MiB"


# --- malformed metadata -----------------------------------------------------


def _without(md: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in md.items() if k != key}


MALFORMED: list[tuple[str, dict[str, Any], str]] = [
    ("no model", _without(BPE, "tokenizer.ggml.model"), "tokenizer.ggml.model"),
    (
        "unknown model",
        {**BPE, "tokenizer.ggml.model": "bert"},
        "tokenizer.ggml.model",
    ),
    ("model not a string", {**BPE, "tokenizer.ggml.model": 3}, "tokenizer.ggml.model"),
    ("no tokens", _without(BPE, "tokenizer.ggml.tokens"), "tokenizer.ggml.tokens"),
    ("empty tokens", {**BPE, "tokenizer.ggml.tokens": []}, "tokenizer.ggml.tokens"),
    (
        "tokens not strings",
        {**BPE, "tokenizer.ggml.tokens": [*BPE["tokenizer.ggml.tokens"][:-1], 7]},
        "tokenizer.ggml.tokens",
    ),
    (
        "tokens not an array",
        {**BPE, "tokenizer.ggml.tokens": "abc"},
        "tokenizer.ggml.tokens",
    ),
    (
        "duplicate token",
        {
            **BPE,
            "tokenizer.ggml.tokens": [
                *BPE["tokenizer.ggml.tokens"][:-1],
                BPE["tokenizer.ggml.tokens"][0],
            ],
        },
        "tokenizer.ggml.tokens",
    ),
    ("no merges", _without(BPE, "tokenizer.ggml.merges"), "tokenizer.ggml.merges"),
    (
        "merge without a space",
        {**BPE, "tokenizer.ggml.merges": ["ab", *BPE["tokenizer.ggml.merges"]]},
        "tokenizer.ggml.merges",
    ),
    (
        "merge of three",
        {**BPE, "tokenizer.ggml.merges": ["a b c", *BPE["tokenizer.ggml.merges"]]},
        "tokenizer.ggml.merges",
    ),
    (
        "merge of unknown tokens",
        {**BPE, "tokenizer.ggml.merges": ["Ġzzz qqq", *BPE["tokenizer.ggml.merges"]]},
        "tokenizer.ggml.merges",
    ),
    ("unknown pre", {**BPE, "tokenizer.ggml.pre": "nonesuch"}, "tokenizer.ggml.pre"),
    (
        "token types too short",
        {**BPE, "tokenizer.ggml.token_type": BPE["tokenizer.ggml.token_type"][:-1]},
        "tokenizer.ggml.token_type",
    ),
    (
        "token type out of range",
        {
            **BPE,
            "tokenizer.ggml.token_type": [9, *BPE["tokenizer.ggml.token_type"][1:]],
        },
        "tokenizer.ggml.token_type",
    ),
    (
        "bos out of range",
        {**BPE, "tokenizer.ggml.bos_token_id": 10**6},
        "tokenizer.ggml.bos_token_id",
    ),
    (
        "eos negative",
        {**BPE, "tokenizer.ggml.eos_token_id": -1},
        "tokenizer.ggml.eos_token_id",
    ),
    (
        "eos not an int",
        {**BPE, "tokenizer.ggml.eos_token_id": "2"},
        "tokenizer.ggml.eos_token_id",
    ),
    (
        "padding out of range",
        {**BPE, "tokenizer.ggml.padding_token_id": 10**6},
        "tokenizer.ggml.padding_token_id",
    ),
    (
        "unknown out of range",
        {**SPM, "tokenizer.ggml.unknown_token_id": 10**6},
        "tokenizer.ggml.unknown_token_id",
    ),
    (
        "eot out of range",
        {**BPE, "tokenizer.ggml.eot_token_id": 10**6},
        "tokenizer.ggml.eot_token_id",
    ),
    (
        "add_bos without bos",
        {
            **_without(BPE, "tokenizer.ggml.bos_token_id"),
            "tokenizer.ggml.add_bos_token": True,
        },
        "tokenizer.ggml.add_bos_token",
    ),
    (
        "add_eos without eos",
        {
            **_without(BPE, "tokenizer.ggml.eos_token_id"),
            "tokenizer.ggml.add_eos_token": True,
        },
        "tokenizer.ggml.add_eos_token",
    ),
    (
        "add_bos not a bool",
        {**BPE, "tokenizer.ggml.add_bos_token": "yes"},
        "tokenizer.ggml.add_bos_token",
    ),
    (
        "chat template not a string",
        {**BPE, "tokenizer.chat_template": ["a"]},
        "tokenizer.chat_template",
    ),
    ("no scores", _without(SPM, "tokenizer.ggml.scores"), "tokenizer.ggml.scores"),
    (
        "scores too long",
        {**SPM, "tokenizer.ggml.scores": [*SPM["tokenizer.ggml.scores"], 0.0]},
        "tokenizer.ggml.scores",
    ),
    (
        "scores not numbers",
        {**SPM, "tokenizer.ggml.scores": ["x", *SPM["tokenizer.ggml.scores"][1:]]},
        "tokenizer.ggml.scores",
    ),
    (
        "remove_extra_whitespaces",
        {**SPM, "tokenizer.ggml.remove_extra_whitespaces": True},
        "tokenizer.ggml.remove_extra_whitespaces",
    ),
    (
        "add_sep_token",
        {**BPE, "tokenizer.ggml.add_sep_token": True},
        "tokenizer.ggml.add_sep_token",
    ),
]


@pytest.mark.parametrize(
    ("metadata", "key"),
    [pytest.param(md, key, id=name) for name, md, key in MALFORMED],
)
def test_malformed_metadata_is_refused_by_key_and_file(
    metadata: dict[str, Any], key: str
) -> None:
    with pytest.raises(ModelLoadError) as info:
        tokenizer_from_gguf(metadata, source="model-q4.gguf")
    message = str(info.value)
    assert "model-q4.gguf" in message
    assert key in message


def test_harmless_values_of_refused_keys_are_accepted() -> None:
    md = {
        **SPM,
        "tokenizer.ggml.remove_extra_whitespaces": False,
        "tokenizer.ggml.add_sep_token": False,
    }
    assert tokenizer_from_gguf(md, source="x").encode("hi") == tokenizer_from_gguf(
        SPM, source="x"
    ).encode("hi")


def test_from_gguf_metadata_classmethod() -> None:
    tok = HFTokenizer.from_gguf_metadata(BPE, source="bpe.gguf")
    assert tok.encode("hello") == tokenizer_from_gguf(BPE, source="b").encode("hello")


def test_a_control_token_outside_the_byte_alphabet_is_matched_whole() -> None:
    # DeepSeek's end token is written with full-width bars and ▁; llama.cpp
    # matches it in the text as it is written.
    end = "<\uff5cend\u2581of\u2581sentence\uff5c>"
    md = {
        **BPE,
        "tokenizer.ggml.tokens": [*BPE["tokenizer.ggml.tokens"], end],
        "tokenizer.ggml.token_type": [*BPE["tokenizer.ggml.token_type"], 3],
    }
    tok = tokenizer_from_gguf(md, source="deepseek.gguf")
    end_id = len(BPE["tokenizer.ggml.tokens"])
    ids = tok.encode(f"hi{end}", add_special_tokens=False)
    assert ids[-1] == end_id
    assert tok.decode(ids, skip_special_tokens=False) == f"hi{end}"
    assert tok.decode(ids) == "hi"
    assert end_id in tok.eos_token_ids


def test_a_normal_token_outside_the_byte_alphabet_is_respelled() -> None:
    """A converter's slip: a normal token written with a raw space. As in
    transformers, the model holds it in the byte alphabet ("Zz Zz" as
    "ZzĠZz", which a merge may name), unless that spelling is taken, when
    it stays as written."""
    tokens = BPE["tokenizer.ggml.tokens"]
    new = ["Zz", "ĠZz", "Zz Zz", "Qq Qq", "QqĠQq"]
    md = {
        **BPE,
        "tokenizer.ggml.tokens": [*tokens, *new],
        "tokenizer.ggml.token_type": [*BPE["tokenizer.ggml.token_type"], *[1] * 5],
        "tokenizer.ggml.merges": [*BPE["tokenizer.ggml.merges"], "Zz ĠZz"],
    }
    tok = tokenizer_from_gguf(md, source="slip.gguf")
    zz, qq, taken = len(tokens) + 2, len(tokens) + 3, len(tokens) + 4
    assert tok.backend.token_to_id("ZzĠZz") == zz
    assert tok.backend.token_to_id("Zz Zz") is None
    assert tok.decode([zz]) == "Zz Zz"
    assert tok.backend.token_to_id("Qq Qq") == qq
    assert tok.backend.token_to_id("QqĠQq") == taken
    assert tok.vocab_size == len(tokens) + 5


@pytest.mark.parametrize("metadata", [BPE, SPM], ids=["bpe", "spm"])
def test_structured_output_reads_its_vocabulary(metadata: dict[str, Any]) -> None:
    from structllm.structured.vocabulary import GrammarVocabulary

    tok = tokenizer_from_gguf(metadata, source="x.gguf")
    vocabulary = GrammarVocabulary.from_tokenizer(tok)
    assert vocabulary.vocab_size == tok.vocab_size
    assert vocabulary.eos_token_ids == tok.eos_token_ids
