"""Record what GGUF tokenizers give, for tests/test_gguf_tokenizer.py.

Run it with a Python that has transformers, gguf and regex (not structllm's
environment; structllm itself is not imported):

    python tools/record_gguf_tokenizer.py --write-fixtures \\
        --smollm2 path/to/SmolLM2-135M-Instruct.Q4_1.gguf

``--write-fixtures`` (re)writes the two small GGUF files under
``tests/data/gguf_tokenizer/``: ``bpe.gguf``, a byte-level BPE vocabulary
trained here on a few sentences, and ``spm.gguf``, a SentencePiece-style one
with byte-fallback, control, user-defined and unused tokens. Then, for each
file and each text of ``TEXTS``, with and without special tokens, it records
into ``tests/data/gguf_tokenizer_oracle.json``:

``llama_cpp``
    the ids of :func:`llama_cpp_encode`, a line-by-line Python rendering of
    llama.cpp's ``llama_vocab::impl::tokenize`` (``src/llama-vocab.cpp``):
    special-token partition, the pre-tokenizer regexes applied in turn, the
    byte-level BPE by merge rank (``llm_tokenizer_bpe_session``) or the
    SentencePiece merge by score (``llm_tokenizer_spm_session``). The tests
    hold structllm to these.
``agrees_with_transformers``, ``transformers``
    whether ``AutoTokenizer.from_pretrained(dir, gguf_file=name)`` gives the
    same ids, and its ids where it does not (transformers splits with GPT-2's
    regex where it does not know the pre-tokenizer, and its SentencePiece
    prepends ``▁`` only at the start of the text, not after special tokens or
    before a leading space).
``decoded`` / ``decoded_skip_special``
    transformers' decoding of the ``llama_cpp`` ids.

The bpe file is recorded under several ``tokenizer.ggml.pre`` values (the
file's own is "qwen2"); the tests set the same value in the metadata.
"""

from __future__ import annotations

import argparse
import heapq
import importlib.metadata
import json
import shlex
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import gguf
import regex

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
FIXTURES = DATA / "gguf_tokenizer"
ORACLE = DATA / "gguf_tokenizer_oracle.json"

TEXTS = [
    "Hello world",
    "hello, world! How are you?",
    " leading space",
    "trailing space ",
    "two  spaces and   three",
    "    indented",
    "line one\nline two\n\n\nthree newlines",
    "tabs\tand\r\nwindows",
    "12345678 and 3.14159 and 1,000,000",
    "don't won't I'm you're they've we'll she'd IT'S",
    'Punctuation: (a) [b] {c} <d> ... !? -- ;; "quoted"',
    "emoji 😀🎉 and CJK 日本語の文章 한국어 中文",
    "accents: café naïve Ünïcödé",
    "def f(x):\n    return x ** 2  # square\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more text",
    "<think>reasoning</think> answer",
    "",
    " ",
    "\n",
]

BPE_PRES = [
    "qwen2",
    "gpt-2",
    "llama-bpe",
    "default",
    "smollm",
    "deepseek-coder",
    "falcon",
    "tekken",
    "gpt-4o",
    "qwen35",
]

# --- llama.cpp, in Python ------------------------------------------------------

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
# llm_tokenizer_bpe's regex_exprs, with ignore_merges and add_bos as
# llama_vocab::impl::load sets them. (tekken, gpt-4o: tokenizer.json's
# spelling, which llama.cpp's lookahead form stands for.)
LLAMA_CPP_PRE: dict[str, tuple[list[str], bool, bool]] = {
    "default": (
        [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
        False,
        False,
    ),
    "gpt-2": ([_GPT2], False, False),
    "smollm": ([r"\p{N}", _GPT2], False, False),
    "llama-bpe": (
        [
            _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        ],
        True,
        True,
    ),
    "qwen2": (
        [
            _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        ],
        False,
        False,
    ),
    "qwen35": (
        [
            _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
            r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        ],
        False,
        False,
    ),
    "deepseek-coder": (
        [
            "[\r\n]",
            r"\s?\p{L}+",
            r"\s?\p{P}+",
            "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
            r"\p{N}",
        ],
        False,
        False,
    ),
    "falcon": (
        [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"],
        False,
        False,
    ),
    "tekken": (
        [
            rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+"
            rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
            r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        ],
        True,
        True,
    ),
    "gpt-4o": (
        [
            rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
            rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
            r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        ],
        False,
        False,
    ),
}


def _bytes_to_unicode() -> dict[int, str]:
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


BYTE_CHARS = _bytes_to_unicode()


def _partition(
    text: str, tokens: Sequence[str], types: Sequence[int]
) -> list[str | int]:
    """tokenizer_st_partition with parse_special: control, user-defined and
    unknown tokens, longest first, cut out of the raw text."""
    specials = [i for i, t in enumerate(types) if t in (2, 3, 4)]
    specials.sort(key=lambda i: -len(tokens[i].encode()))  # std::sort: ties any
    fragments: list[str | int] = [text] if text else []
    for sid in specials:
        piece = tokens[sid]
        out: list[str | int] = []
        for frag in fragments:
            if not isinstance(frag, str):
                out.append(frag)
                continue
            rest = frag
            while True:
                at = rest.find(piece)
                if at < 0:
                    if rest:
                        out.append(rest)
                    break
                if at > 0:
                    out.append(rest[:at])
                out.append(sid)
                rest = rest[at + len(piece) :]
        fragments = out
    return fragments


def _regex_split(text: str, exprs: Sequence[str]) -> list[str]:
    """unicode_regex_split: each expression splits every piece into its
    matches and the gaps between them."""
    words = [text]
    for expr in exprs:
        pattern = regex.compile(expr)
        out = []
        for word in words:
            start = 0
            for m in pattern.finditer(word):
                if m.start() > start:
                    out.append(word[start : m.start()])
                if m.end() > m.start():
                    out.append(m.group())
                start = m.end()
            if start < len(word):
                out.append(word[start:])
        words = out
    return words


def _bpe_word(
    word: str,
    vocab: Mapping[str, int],
    ranks: Mapping[tuple[str, str], int],
    ignore_merges: bool,
) -> list[int]:
    """llm_tokenizer_bpe_session::tokenize for one (byte-encoded) word."""
    if ignore_merges and word in vocab:
        return [vocab[word]]
    symbols = list(word)
    while len(symbols) > 1:
        best = None
        for k in range(len(symbols) - 1):
            rank = ranks.get((symbols[k], symbols[k + 1]))
            if rank is not None and (best is None or rank < best[0]):
                best = (rank, k)
        if best is None:
            break
        k = best[1]
        symbols[k : k + 2] = [symbols[k] + symbols[k + 1]]
    out = []
    for s in symbols:
        if s in vocab:
            out.append(vocab[s])
        else:
            out.extend(vocab[c] for c in s if c in vocab)
    return out


def _spm_fragment(
    text: str, vocab: Mapping[str, int], scores: Sequence[float]
) -> list[int]:
    """llm_tokenizer_spm_session::tokenize."""
    n_tokens = len(scores)
    symbols = [
        [c, k - 1, k + 1 if k + 1 < len(text) else -1] for k, c in enumerate(text)
    ]
    queue: list[tuple[float, int, int, int, int]] = []
    rev_merge: dict[str, tuple[int, int]] = {}
    seq = 0

    def try_add(left: int, right: int) -> None:
        nonlocal seq
        if left == -1 or right == -1:
            return
        joined = symbols[left][0] + symbols[right][0]
        tid = vocab.get(joined)
        if tid is None or tid >= n_tokens:
            return
        # max-heap on score; equal scores: the smaller left first
        heapq.heappush(queue, (-scores[tid], left, seq, right, len(joined.encode())))
        seq += 1
        rev_merge[joined] = (left, right)

    for k in range(1, len(symbols)):
        try_add(k - 1, k)
    while queue:
        _, left, _, right, size = heapq.heappop(queue)
        ls, rs = symbols[left], symbols[right]
        if not ls[0] or not rs[0] or len((ls[0] + rs[0]).encode()) != size:
            continue
        ls[0] += rs[0]
        rs[0] = ""
        ls[2] = rs[2]
        if rs[2] >= 0:
            symbols[rs[2]][1] = left
        try_add(ls[1], left)
        try_add(left, ls[2])

    out: list[int] = []

    def resegment(s: str) -> None:
        if s in vocab:
            out.append(vocab[s])
            return
        if s not in rev_merge:
            out.extend(vocab[f"<0x{b:02X}>"] for b in s.encode())
            return
        left, right = rev_merge[s]
        resegment(symbols[left][0])
        resegment(symbols[right][0])

    k = 0
    while symbols and k != -1:
        resegment(symbols[k][0])
        k = symbols[k][2]
    return out


def llama_cpp_encode(
    md: Mapping[str, Any], text: str, *, add_special: bool
) -> list[int]:
    """llama_vocab::impl::tokenize(text, add_special, parse_special=true)."""
    tokens = md["tokenizer.ggml.tokens"]
    types = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    model = md["tokenizer.ggml.model"]
    out: list[int] = []
    fragments = _partition(text, tokens, types)
    if model == "llama":
        add_bos = md.get("tokenizer.ggml.add_bos_token", True)
        add_eos = md.get("tokenizer.ggml.add_eos_token", False)
        prefix = md.get("tokenizer.ggml.add_space_prefix", True)
        if add_special and add_bos:
            out.append(md.get("tokenizer.ggml.bos_token_id", 1))
        prev_special = True
        for frag in fragments:
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            piece = (" " if prefix and prev_special else "") + frag
            out.extend(
                _spm_fragment(
                    piece.replace(" ", "\u2581"), vocab, md["tokenizer.ggml.scores"]
                )
            )
            prev_special = False
        if add_special and add_eos:
            out.append(md.get("tokenizer.ggml.eos_token_id", 2))
        return out
    exprs, ignore_merges, add_bos_default = LLAMA_CPP_PRE[
        md.get("tokenizer.ggml.pre", "default")
    ]
    ranks = {}
    for n, merge in enumerate(md["tokenizer.ggml.merges"]):
        cut = merge.find(" ", 1)
        ranks.setdefault((merge[:cut], merge[cut + 1 :]), n)
    add_bos = md.get("tokenizer.ggml.add_bos_token", add_bos_default)
    if add_special and add_bos:
        out.append(md["tokenizer.ggml.bos_token_id"])
    for frag in fragments:
        if isinstance(frag, int):
            out.append(frag)
            continue
        for word in _regex_split(frag, exprs):
            encoded = "".join(BYTE_CHARS[b] for b in word.encode())
            out.extend(_bpe_word(encoded, vocab, ranks, ignore_merges))
    if add_special and md.get("tokenizer.ggml.add_eos_token", False):
        out.append(md["tokenizer.ggml.eos_token_id"])
    return out


# --- the fixtures --------------------------------------------------------------

CORPUS = [
    "hello world, how are you? I'm fine, thanks for asking.",
    "The quick brown fox jumps over the lazy dog.",
    "don't stop believing; we'll see what they've done.",
    "def square(x):\n    return x * x\n",
    "Numbers like 12345 and 3.14159 are common in text.",
    "Line one\nline two\n\nAnd the last line, with spaces  and tabs\t.",
    "café naïve résumé, emoji 😀 and 日本語 text.",
]

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _arch(writer: gguf.GGUFWriter, n_vocab: int) -> None:
    writer.add_context_length(128)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)


def _write(path: Path, md: Mapping[str, Any]) -> None:
    """A GGUF holding the llama architecture's bare hyperparameters and the
    tokenizer keys of *md*; no tensors."""
    writer = gguf.GGUFWriter(str(path), "llama")
    _arch(writer, len(md["tokenizer.ggml.tokens"]))
    for key, value in md.items():
        if key in ("general.architecture",):
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif key == "tokenizer.ggml.token_type":
            writer.add_array(key, [int(v) for v in value])
        elif key == "tokenizer.ggml.scores":
            writer.add_array(key, [float(v) for v in value])
        else:
            writer.add_array(key, list(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def make_bpe_metadata() -> dict[str, Any]:
    """Byte-level BPE trained on CORPUS, with ChatML control tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    tokens += ["<think>", "</think>"]
    types = [3 if t.startswith("<|") else 1 for t in tokens]
    types[-2:] = [4, 4]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
        "tokenizer.ggml.padding_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML,
    }


def make_spm_metadata() -> dict[str, Any]:
    """A SentencePiece-style vocabulary: <unk> <s> </s>, the 256 byte tokens,
    ChatML control tokens, a user-defined and an unused token, then pieces:
    every character of CORPUS and every prefix of each ▁word, shorter
    pieces scoring higher (so merging builds words left to right)."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [2, 3, 3]
    scores = [0.0, 0.0, 0.0]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(6)
        scores.append(0.0)
    for t, kind in [
        ("<|im_start|>", 3),
        ("<|im_end|>", 3),
        ("<think>", 4),
        ("<unused0>", 5),
    ]:
        tokens.append(t)
        types.append(kind)
        scores.append(0.0)
    pieces: dict[str, None] = {}
    text = " ".join(CORPUS).replace("\n", " ").replace("\t", " ")
    for c in sorted(set(text.replace(" ", "\u2581"))):
        pieces[c] = None
    pieces["\u2581"] = None
    for word in text.split(" "):
        if not word or any(ord(c) > 0x2FFF for c in word):
            continue  # CJK and emoji stay byte fallback
        spelled = "\u2581" + word
        for k in range(2, len(spelled) + 1):
            pieces[spelled[:k]] = None
        for k in range(2, len(word) + 1):
            pieces[word[:k]] = None
    pieces["\u2581\u2581"] = None
    for n, piece in enumerate(p for p in pieces if p not in tokens):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(len(piece) * 1000 + n))
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": True,
        "tokenizer.chat_template": CHATML,
    }


def read_metadata(path: Path) -> dict[str, Any]:
    reader = gguf.GGUFReader(str(path))
    return {
        key: field.contents()
        for key, field in reader.fields.items()
        if key.startswith("tokenizer.")
    }


# --- recording -----------------------------------------------------------------


def _transformers(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def record(
    md: Mapping[str, Any], hf: Any, texts: Sequence[str]
) -> list[dict[str, Any]]:
    cases = []
    for text in texts:
        for add in (True, False):
            ids = llama_cpp_encode(md, text, add_special=add)
            case: dict[str, Any] = {
                "text": text,
                "add_special_tokens": add,
                "llama_cpp": ids,
                "decoded": hf.decode(ids, skip_special_tokens=False),
                "decoded_skip_special": hf.decode(ids, skip_special_tokens=True),
            }
            theirs = hf.encode(text, add_special_tokens=add)
            case["agrees_with_transformers"] = theirs == ids
            if theirs != ids:
                case["transformers"] = theirs
            cases.append(case)
    return cases


def _dump(oracle: Mapping[str, Any]) -> str:
    """JSON with one line per case."""

    def compact(value: Any) -> str:
        return json.dumps(value, ensure_ascii=False)

    lines = ["{"]
    for key in ("command", "versions"):
        lines.append(f" {compact(key)}: {compact(oracle[key])},")
    lines.append(' "fixtures": {')
    names = list(oracle["fixtures"])
    for n, name in enumerate(names):
        fixture = oracle["fixtures"][name]
        lines.append(f"  {compact(name)}: {{")
        for key, value in fixture.items():
            if key != "cases":
                lines.append(f"   {compact(key)}: {compact(value)},")
        lines.append('   "cases": [')
        cases = fixture["cases"]
        for k, case in enumerate(cases):
            lines.append(f"    {compact(case)}{',' if k + 1 < len(cases) else ''}")
        lines.append("   ]")
        lines.append(f"  }}{',' if n + 1 < len(names) else ''}")
    lines.append(" }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write-fixtures", action="store_true")
    parser.add_argument("--smollm2", type=Path, help="SmolLM2-135M-Instruct GGUF")
    args = parser.parse_args(argv)
    FIXTURES.mkdir(parents=True, exist_ok=True)
    if args.write_fixtures:
        _write(FIXTURES / "bpe.gguf", make_bpe_metadata())
        _write(FIXTURES / "spm.gguf", make_spm_metadata())

    import tokenizers
    import transformers

    fixtures: dict[str, Any] = {}
    bpe = read_metadata(FIXTURES / "bpe.gguf")
    with tempfile.TemporaryDirectory() as tmp:
        for pre in BPE_PRES:
            md = {**bpe, "tokenizer.ggml.pre": pre}
            path = Path(tmp) / f"bpe-{pre}.gguf"
            _write(path, md)
            fixtures[f"bpe:{pre}"] = {
                "file": "bpe.gguf",
                "pre": pre,
                "cases": record(md, _transformers(path), TEXTS),
            }
    spm = read_metadata(FIXTURES / "spm.gguf")
    fixtures["spm"] = {
        "file": "spm.gguf",
        "cases": record(spm, _transformers(FIXTURES / "spm.gguf"), TEXTS),
    }
    if args.smollm2 is not None:
        smol = read_metadata(args.smollm2)
        fixtures["smollm2"] = {
            "file": args.smollm2.name,
            "cases": record(smol, _transformers(args.smollm2), TEXTS),
        }
    command = "python tools/record_gguf_tokenizer.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)
    )
    oracle = {
        "command": command,
        "versions": {
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "gguf": importlib.metadata.version("gguf"),
        },
        "fixtures": fixtures,
    }
    ORACLE.write_text(_dump(oracle))
    for name, fixture in fixtures.items():
        cases = fixture["cases"]
        agree = sum(c["agrees_with_transformers"] for c in cases)
        print(f"{name}: {agree}/{len(cases)} agree with transformers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
