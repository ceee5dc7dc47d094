"""The incremental detokenizer releases exactly the text a full decode gives."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from structllm.text import (
    ByteTokenizer,
    DetokenizerUpdate,
    HFTokenizer,
    IncrementalDetokenizer,
    Tokenizer,
)

BYTE = ByteTokenizer()


def _run(detok: IncrementalDetokenizer, chunks: Sequence[Sequence[int]]) -> list[str]:
    """Feed *chunks*; return every delta, the final flush included."""
    deltas = [detok.add_tokens(chunk).text for chunk in chunks]
    deltas.append(detok.finish().text)
    assert "".join(deltas) == detok.text
    return deltas


def _split(ids: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    """Cut *ids* into consecutive chunks of the given sizes, cycling them."""
    chunks, i, k = [], 0, 0
    while i < len(ids):
        size = sizes[k % len(sizes)] if sizes else 1
        chunks.append(list(ids[i : i + size]))
        i, k = i + size, k + 1
    return chunks


def _reference(text: str, stop: Sequence[str], include: bool) -> tuple[str, str | None]:
    """*text* cut at the stop string that completes first (longest on ties)."""
    found = [(i + len(s), i, s) for s in stop if (i := text.find(s)) >= 0]
    if not found:
        return text, None
    end, start, s = min(found)
    return text[: end if include else start], s


# --- plain streaming -----------------------------------------------------------


def test_multibyte_characters_split_across_tokens() -> None:
    text = "héllo 世界 🎉"
    detok = IncrementalDetokenizer(BYTE, BYTE.encode("Hi: "))
    deltas = _run(detok, [[b] for b in text.encode()])
    assert "".join(deltas) == text
    assert "\ufffd" not in "".join(deltas)
    # 🎉 is four bytes: three steps release nothing, the fourth releases it
    assert deltas[-5:] == ["", "", "", "🎉", ""]
    assert detok.token_ids == list(text.encode())


def test_finish_releases_an_incomplete_character_as_replacement() -> None:
    detok = IncrementalDetokenizer(BYTE, [])
    assert detok.add_tokens([65, 0xE4, 0xB8]).text == "A"
    assert detok.finish() == DetokenizerUpdate("\ufffd")
    assert detok.text == "A\ufffd"
    assert detok.finished
    assert detok.finish() == DetokenizerUpdate("")
    assert detok.add_tokens([66]) == DetokenizerUpdate("")


def test_invalid_bytes_do_not_block_the_stream() -> None:
    detok = IncrementalDetokenizer(BYTE, [])
    assert detok.add_tokens([0xFF]).text == ""
    assert detok.add_tokens([65]).text == "\ufffdA"


def test_special_tokens() -> None:
    skip = IncrementalDetokenizer(BYTE, [256])
    assert "".join(_run(skip, [[104], [257], [105]])) == "hi"
    keep = IncrementalDetokenizer(BYTE, [256], skip_special_tokens=False)
    assert "".join(_run(keep, [[104], [257], [105]])) == "h<|eos|>i"


def test_prompt_ending_inside_a_character() -> None:
    detok = IncrementalDetokenizer(BYTE, [65, 0xE4])
    assert "".join(_run(detok, [[0xB8], [0x96]])) == BYTE.decode([0xB8, 0x96])


def test_prompt_context_keeps_metaspace_leading_spaces() -> None:
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "▁again": 3}
    backend = tokenizers.Tokenizer(
        tokenizers.models.WordLevel(vocab, unk_token="<unk>")
    )
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    backend.decoder = tokenizers.decoders.Metaspace()
    tokenizer = HFTokenizer(backend=backend)
    assert tokenizer.decode([2, 3]) == "world again"  # no context: space dropped
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hello"))
    assert _run(detok, [[2], [3]]) == [" world", " again", ""]


def test_each_step_decodes_a_bounded_window() -> None:
    lengths: list[int] = []

    class CountingTokenizer(ByteTokenizer):
        def decode(
            self, ids: Sequence[int], *, skip_special_tokens: bool = True
        ) -> str:
            lengths.append(len(ids))
            return super().decode(ids, skip_special_tokens=skip_special_tokens)

    tokenizer = CountingTokenizer()
    detok = IncrementalDetokenizer(
        tokenizer, BYTE.encode("prompt " * 100), stop=["zzz"]
    )
    text = "a long answer with 世界 and 🎉 " * 200
    _run(detok, [[b] for b in text.encode()])
    assert detok.text == text
    assert max(lengths) <= 8  # 5 context tokens + one 4-byte character


# --- stop strings ----------------------------------------------------------------


def test_stop_string_spanning_tokens() -> None:
    detok = IncrementalDetokenizer(BYTE, [], stop=["STOP"])
    ids = BYTE.encode("say STOP now", add_special_tokens=False)
    updates = [detok.add_tokens([i]) for i in ids]
    assert "".join(u.text for u in updates) == "say "
    stopped = [u for u in updates if u.stopped]
    assert len(stopped) == 1
    assert stopped[0].stop_str == "STOP"
    assert detok.stop_str == "STOP"
    assert detok.token_ids == ids[: len("say STOP")]  # later tokens not taken
    assert detok.finish() == DetokenizerUpdate("")
    assert detok.text == "say "


def test_include_stop_str_in_output() -> None:
    detok = IncrementalDetokenizer(
        BYTE, [], stop="世界", include_stop_str_in_output=True
    )
    update = detok.add_tokens(BYTE.encode("hi 世界 more", add_special_tokens=False))
    # taken through the last byte of 界; " more" is past the end
    assert update == DetokenizerUpdate("hi 世界", "世界", num_taken=9)
    assert detok.token_ids == list("hi 世界".encode())


def test_partial_stop_string_is_held_back_until_it_fails() -> None:
    detok = IncrementalDetokenizer(BYTE, [], stop=["abc"])
    steps = [detok.add_tokens([b]).text for b in b"xabd"]
    assert steps == ["x", "", "", "abd"]
    assert detok.add_tokens(b"ab").text == ""
    assert detok.finish() == DetokenizerUpdate("ab")
    assert detok.text == "xabdab"


def test_without_stop_strings_nothing_is_held_back() -> None:
    detok = IncrementalDetokenizer(BYTE, [])
    assert [detok.add_tokens([b]).text for b in b"abc"] == ["a", "b", "c"]


def test_the_stop_string_that_completes_first_wins() -> None:
    detok = IncrementalDetokenizer(BYTE, [], stop=["abcd", "bc"])
    assert detok.add_tokens(b"xabcd") == DetokenizerUpdate("xa", "bc", num_taken=4)
    detok = IncrementalDetokenizer(
        BYTE, [], stop=["bc", "abc"], include_stop_str_in_output=True
    )
    assert detok.add_tokens(b"xabc") == DetokenizerUpdate("xabc", "abc", num_taken=4)


def test_stop_string_completed_by_finish() -> None:
    detok = IncrementalDetokenizer(BYTE, [], stop=["a\ufffd"])
    assert detok.add_tokens([97, 0xE4]).text == ""
    assert detok.finish() == DetokenizerUpdate("", "a\ufffd")


def test_stop_strings_are_checked() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(BYTE, [], stop=["ok", ""])


# --- properties ------------------------------------------------------------------

sizes = st.lists(st.integers(1, 5), max_size=8)


@given(prompt=st.text(max_size=20), text=st.text(max_size=40), sizes=sizes)
def test_byte_streaming_equals_full_decode(
    prompt: str, text: str, sizes: list[int]
) -> None:
    ids = BYTE.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(BYTE, BYTE.encode(prompt), skip_special_tokens=False)
    assert "".join(_run(detok, _split(ids, sizes))) == text


@settings(deadline=None)
@given(
    prompt=st.text(max_size=20),
    ids=st.lists(st.integers(0, 511), max_size=40),
    sizes=sizes,
    skip=st.booleans(),
)
def test_bpe_streaming_of_any_ids_equals_full_decode(
    bpe: HFTokenizer, prompt: str, ids: list[int], sizes: list[int], skip: bool
) -> None:
    detok = IncrementalDetokenizer(bpe, bpe.encode(prompt), skip_special_tokens=skip)
    deltas = _run(detok, _split(ids, sizes))
    assert "".join(deltas) == bpe.decode(ids, skip_special_tokens=skip)


@settings(deadline=None)
@given(text=st.text(max_size=60), sizes=sizes)
def test_bpe_streaming_of_text_round_trips(
    bpe: HFTokenizer, text: str, sizes: list[int]
) -> None:
    ids = bpe.encode(text)
    detok = IncrementalDetokenizer(
        bpe, bpe.encode("<|im_start|>assistant\n"), skip_special_tokens=False
    )
    assert "".join(_run(detok, _split(ids, sizes))) == text


# A small alphabet so that stop strings actually occur.
small_text = st.text(alphabet="ab é世🎉\n", max_size=40)
stops = st.lists(st.text(alphabet="ab é世🎉\n", min_size=1, max_size=4), max_size=3)


@settings(deadline=None)
@given(
    use_bpe=st.booleans(),
    text=small_text,
    stop=stops,
    include=st.booleans(),
    sizes=sizes,
)
def test_stop_strings_cut_where_a_full_decode_would(
    bpe: HFTokenizer,
    use_bpe: bool,
    text: str,
    stop: list[str],
    include: bool,
    sizes: list[int],
) -> None:
    tokenizer: Tokenizer = bpe if use_bpe else BYTE
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(
        tokenizer, [], stop=stop, include_stop_str_in_output=include
    )
    chunks = _split(ids, sizes)
    updates = [detok.add_tokens(chunk) for chunk in chunks]
    updates.append(detok.finish())
    expected_text, expected_stop = _reference(text, stop, include)
    assert "".join(u.text for u in updates) == expected_text == detok.text
    assert detok.stop_str == expected_stop
    assert [u.stop_str for u in updates if u.stopped] == (
        [expected_stop] if expected_stop else []
    )
    # What was released never contains a stop string it should have cut at.
    released = ""
    for update in updates:
        released += update.text
        if update.stopped:
            break
        assert _reference(released, stop, include) == (released, None)
    # Tokens taken are a prefix of the tokens fed; all of them when not stopped.
    assert detok.token_ids == ids[: len(detok.token_ids)]
    if expected_stop is None:
        assert detok.token_ids == ids
