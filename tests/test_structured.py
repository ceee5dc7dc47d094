"""The grammar layer: StructuredOutputs, the compiler and cache, the matcher
and the batched mask, driven by a random-logits "model" (seeded numpy).

Every generated output must be a complete match: JSON that validates
against its schema (``jsonschema``), a regex full match, one of the
choices, a sentence of the grammar. EOS must be allowed exactly when the
output so far is complete. Both the byte tokenizer (the ``tiny-random`` model's)
and a trained byte-level BPE are used.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from structllm.errors import InvalidRequestError
from structllm.structured import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarMatcher,
    GrammarVocabulary,
    StructuredOutputs,
    allocate_bitmask,
    apply_bitmask,
    fill_bitmasks,
)
from structllm.text import ByteTokenizer, HFTokenizer, Tokenizer
from tests.strategies import json_schemas

#: the fake model's logits are this much wider than the tokenizer (padding)
PADDING = 7


@pytest.fixture(scope="module")
def byte_setup() -> tuple[Tokenizer, GrammarCompiler]:
    tokenizer = ByteTokenizer()
    return tokenizer, GrammarCompiler(GrammarVocabulary.from_tokenizer(tokenizer))


@pytest.fixture(scope="module")
def bpe_setup(bpe: HFTokenizer) -> tuple[Tokenizer, GrammarCompiler]:
    return bpe, GrammarCompiler(GrammarVocabulary.from_tokenizer(bpe))


@pytest.fixture(params=["byte", "bpe"])
def setup(
    request: pytest.FixtureRequest,
    byte_setup: tuple[Tokenizer, GrammarCompiler],
    bpe_setup: tuple[Tokenizer, GrammarCompiler],
) -> tuple[Tokenizer, GrammarCompiler]:
    return byte_setup if request.param == "byte" else bpe_setup


def allowed_ids(matcher: GrammarMatcher) -> set[int]:
    bitmask = allocate_bitmask(1, matcher.vocabulary)
    matcher.fill_bitmask(bitmask, 0)
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits[: matcher.vocabulary.vocab_size]).tolist())


def generate(
    compiled: CompiledGrammar,
    tokenizer: Tokenizer,
    *,
    seed: int,
    greedy: bool,
    max_tokens: int = 2000,
) -> str:
    """Random logits through the mask until EOS; checks EOS and padding."""
    rng = np.random.default_rng(seed)
    matcher = compiled.matcher()
    vocab = compiled.vocabulary
    eos = vocab.eos_token_ids
    bitmask = allocate_bitmask(1, vocab)
    width = tokenizer.vocab_size + PADDING
    out: list[int] = []
    for _ in range(max_tokens):
        logits = rng.standard_normal((1, width), dtype=np.float32) * 2
        fill_bitmasks([matcher], bitmask)
        apply_bitmask(logits, bitmask)
        finite = np.isfinite(logits[0])
        assert not finite[tokenizer.vocab_size :].any()
        assert finite.any()
        # EOS exactly when the output so far is complete
        assert all(bool(finite[e]) == matcher.is_accepting() for e in eos)
        if greedy:
            token = int(np.argmax(logits[0]))
        else:
            p = np.exp(logits[0] - logits[0].max())
            token = int(rng.choice(width, p=p / p.sum()))
        assert matcher.accept_token(token), (token, tokenizer.decode(out))
        if token in eos:
            assert matcher.is_terminated()
            return tokenizer.decode(out)
        out.append(token)
    raise AssertionError(f"no EOS after {max_tokens} tokens: {tokenizer.decode(out)!r}")


# --- StructuredOutputs ---------------------------------------------------------


def test_spec_json_is_compact_hashable_and_keeps_key_order() -> None:
    a = StructuredOutputs(json={"type": "object", "properties": {"a": {}}})
    b = StructuredOutputs(json='{"type": "object",  "properties": {"a": {}}}')
    assert a == b
    assert hash(a) == hash(b)
    assert a.key == ("json", '{"type":"object","properties":{"a":{}}}')
    assert a.json_schema() == {"type": "object", "properties": {"a": {}}}
    assert a.field == "structured_outputs.json"
    # key order is the order the output's keys are generated in
    reordered = StructuredOutputs(json='{"properties": {"a": {}}, "type": "object"}')
    assert reordered != a and reordered.key != a.key


def test_output_keys_come_in_schema_order() -> None:
    from structllm import LLM, SamplingParams

    llm = LLM("tiny-random", show_progress=False, max_model_len=256, num_blocks=64)
    names = ["zeta", "alpha", "mid"]
    schema = {
        "type": "object",
        "properties": {n: {"type": "boolean"} for n in names},
        "required": names,
        "additionalProperties": False,
    }
    params = SamplingParams(
        max_tokens=120, seed=1, structured_outputs=StructuredOutputs(json=schema)
    )
    out = llm.generate(["{"], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    assert list(json.loads(out.text)) == names


def test_spec_kinds() -> None:
    assert StructuredOutputs(json_object=True).kind == "json_object"
    assert StructuredOutputs(regex="a+").key == ("regex", "a+")
    choice = StructuredOutputs(choice=["b", "a", "b"])
    assert choice.choice == ("b", "a")
    assert choice.key == ("choice", '["b","a"]')
    assert StructuredOutputs(grammar="start: 'x'").kind == "grammar"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({}, "structured_outputs"),
        ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
        ({"json_object": False}, "structured_outputs"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"json": "[1, 2]"}, "structured_outputs.json"),
        ({"json": {"a": object()}}, "structured_outputs.json"),
        ({"json": {"a": "\ud800"}}, "structured_outputs.json"),
        ({"regex": ""}, "structured_outputs.regex"),
        ({"regex": 5}, "structured_outputs.regex"),
        ({"choice": "abc"}, "structured_outputs.choice"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"choice": ["a", 1]}, "structured_outputs.choice"),
        ({"grammar": ""}, "structured_outputs.grammar"),
        ({"json_object": "yes"}, "structured_outputs.json_object"),
        ({"regex": "x" * 300_000}, "structured_outputs.regex"),
    ],
)
def test_spec_refuses_naming_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        StructuredOutputs(**kwargs)
    assert info.value.field == field
    assert field in str(info.value)


def test_spec_from_response_format() -> None:
    from_rf = StructuredOutputs.from_response_format
    assert from_rf({"type": "text"}) is None
    assert from_rf({"type": "json_object"}) == StructuredOutputs(json_object=True)
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    got = from_rf(
        {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    )
    assert got == StructuredOutputs(json=schema)
    for bad, field in [
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        (
            {"type": "json_schema", "json_schema": {"schema": [1]}},
            "response_format.json_schema.schema",
        ),
        ("json", "response_format"),
    ]:
        with pytest.raises(InvalidRequestError) as info:
            from_rf(bad)
        assert info.value.field == field


def test_types_layer_does_not_load_the_grammar_library() -> None:
    code = (
        "import sys, structllm.structured, structllm.structured.spec;"
        "assert 'llguidance' not in sys.modules, 'llguidance loaded'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- the compiler ------------------------------------------------------------


@pytest.mark.parametrize(
    ("constraint", "needle"),
    [
        (StructuredOutputs(json={"type": "wat"}), "wat"),
        (StructuredOutputs(json={"type": "string", "format": "nope"}), "nope"),
        (
            StructuredOutputs(json={"type": "string", "minLength": 5, "maxLength": 2}),
            "Unsatisfiable",
        ),
        (StructuredOutputs(json={"$ref": "#/$defs/missing"}), "missing"),
        (StructuredOutputs(regex="(?=a)b"), "look-around"),
        (StructuredOutputs(regex="(("), "unclosed"),
        (StructuredOutputs(grammar="start: undefined_rule"), "undefined_rule"),
        (StructuredOutputs(grammar="start: ("), ""),
        (StructuredOutputs(grammar="root ::= missing"), "missing"),
    ],
)
def test_refused_constraints_name_the_field(
    byte_setup: tuple[Tokenizer, GrammarCompiler],
    constraint: StructuredOutputs,
    needle: str,
) -> None:
    _, compiler = byte_setup
    before = compiler.statistics().size
    with pytest.raises(InvalidRequestError) as info:
        compiler.compile(constraint)
    assert info.value.field == constraint.field
    assert str(info.value).startswith(f"{constraint.field}: cannot compile")
    assert needle in str(info.value)
    assert compiler.statistics().size == before  # failures are not cached


def test_cache_hits_and_lru_eviction() -> None:
    compiler = GrammarCompiler(
        GrammarVocabulary.from_tokenizer(ByteTokenizer()), cache_size=2
    )
    a = compiler.compile(StructuredOutputs(json={"type": "integer", "minimum": 1}))
    again = compiler.compile(
        StructuredOutputs(json='{"type": "integer", "minimum": 1}')
    )
    assert again is a
    assert compiler.statistics().hits == 1
    assert compiler.statistics().misses == 1
    b = compiler.compile(StructuredOutputs(regex="b+"))
    assert (
        compiler.compile(StructuredOutputs(json={"type": "integer", "minimum": 1})) is a
    )
    compiler.compile(StructuredOutputs(choice=["c"]))  # evicts b, the older
    stats = compiler.statistics()
    assert (stats.size, stats.capacity) == (2, 2)
    assert compiler.compile(StructuredOutputs(regex="b+")) is not b
    # the same text as a regex and as a grammar are different keys
    assert compiler.statistics().misses == 4


def test_concurrent_compiles_keep_one_grammar() -> None:
    compiler = GrammarCompiler(GrammarVocabulary.from_tokenizer(ByteTokenizer()))
    constraint = StructuredOutputs(json={"type": "array", "items": {"type": "string"}})
    results: list[CompiledGrammar] = []
    barrier = threading.Barrier(4)

    def work() -> None:
        barrier.wait()
        results.append(compiler.compile(constraint))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(r) for r in results}) == 1
    assert compiler.statistics().size == 1


def test_vocabulary_from_tokenizer_json(bpe_dir: Path, bpe: HFTokenizer) -> None:
    vocab = GrammarVocabulary.from_tokenizer_json(
        bpe_dir / "tokenizer.json", eos_token_ids=bpe.eos_token_ids
    )
    assert vocab.vocab_size == bpe.vocab_size
    ours = GrammarCompiler(GrammarVocabulary.from_tokenizer(bpe))
    theirs = GrammarCompiler(vocab)
    c = StructuredOutputs(regex="[a-z ]{1,20}")
    assert allowed_ids(ours.compile(c).matcher()) == allowed_ids(
        theirs.compile(c).matcher()
    )


# --- JSON schemas (Hypothesis) -------------------------------------------------


def _check_schema_output(
    setup: tuple[Tokenizer, GrammarCompiler], schema: dict[str, Any], seed: int
) -> None:
    tokenizer, compiler = setup
    compiled = compiler.compile(StructuredOutputs(json=schema))
    for greedy in (True, False):
        text = generate(compiled, tokenizer, seed=seed, greedy=greedy)
        jsonschema.validate(json.loads(text), schema)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(schema=json_schemas, seed=st.integers(0, 2**32 - 1))
def test_json_schema_outputs_validate(
    setup: tuple[Tokenizer, GrammarCompiler], schema: dict[str, Any], seed: int
) -> None:
    _check_schema_output(setup, schema, seed)


@pytest.mark.slow
@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(schema=json_schemas, seed=st.integers(0, 2**32 - 1))
def test_json_schema_outputs_validate_200(
    setup: tuple[Tokenizer, GrammarCompiler], schema: dict[str, Any], seed: int
) -> None:
    _check_schema_output(setup, schema, seed)


def test_json_object_accepts_any_object_and_only_objects(
    setup: tuple[Tokenizer, GrammarCompiler],
) -> None:
    tokenizer, compiler = setup
    compiled = compiler.compile(StructuredOutputs(json_object=True))
    (eos,) = tokenizer.eos_token_ids
    good = compiled.matcher()
    ids = tokenizer.encode(
        '{"a": [1, {"b": null}], "c": "d"}', add_special_tokens=False
    )
    assert good.accept_tokens([*ids, eos]) == len(ids) + 1
    assert good.is_terminated()
    bad = compiled.matcher()
    assert not bad.accept_tokens(tokenizer.encode("[1]", add_special_tokens=False))
    opened = compiled.matcher()
    assert opened.accept_tokens(tokenizer.encode("{", add_special_tokens=False)) == 1
    assert not opened.accept_token(eos)  # incomplete: EOS refused


# --- regex, choice, grammar -------------------------------------------------------

REGEXES = [
    r"[0-9]{3}-[0-9]{4}",
    r"(yes|no|maybe)",
    r"[a-z]{2,5}@[a-z]{2,5}\.(com|org)",
    r"-?(0|[1-9][0-9]{0,5})(\.[0-9]{1,3})?",
    r"[A-Z][a-z]{0,6}( [A-Z][a-z]{0,6}){0,2}",
]


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_outputs_full_match(
    setup: tuple[Tokenizer, GrammarCompiler], pattern: str
) -> None:
    tokenizer, compiler = setup
    compiled = compiler.compile(StructuredOutputs(regex=pattern))
    for seed in range(6):
        text = generate(compiled, tokenizer, seed=seed, greedy=seed % 2 == 0)
        assert re.fullmatch(pattern, text), text


CHOICES = ["positive", "negative", "neutral", 'a "quoted" \\ one', "é ✨", "neg"]


def test_choice_outputs_are_members(setup: tuple[Tokenizer, GrammarCompiler]) -> None:
    tokenizer, compiler = setup
    compiled = compiler.compile(StructuredOutputs(choice=CHOICES))
    seen = {
        generate(compiled, tokenizer, seed=seed, greedy=False) for seed in range(30)
    }
    assert seen <= set(CHOICES)
    assert len(seen) > 1


ARITHMETIC = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[1-9][0-9]{0,2}|0/
"""


def test_grammar_outputs_are_sentences(
    setup: tuple[Tokenizer, GrammarCompiler],
) -> None:
    tokenizer, compiler = setup
    compiled = compiler.compile(StructuredOutputs(grammar=ARITHMETIC))
    for seed in range(8):
        text = generate(compiled, tokenizer, seed=seed, greedy=False)
        tree = ast.parse(text, mode="eval")
        assert all(
            isinstance(n, ast.Expression | ast.BinOp | ast.Constant | ast.operator)
            for n in ast.walk(tree)
        ), text
    # and a non-sentence is refused before EOS
    matcher = compiled.matcher()
    (eos,) = tokenizer.eos_token_ids
    ids = tokenizer.encode("(1+2", add_special_tokens=False)
    assert matcher.accept_tokens(ids) == len(ids)
    assert not matcher.is_accepting()
    assert not matcher.accept_token(eos)


GBNF = r"""
root ::= answer ("," answer)?
answer ::= "yes" | "no" | [0-9]
"""


def test_gbnf_grammar_is_converted(setup: tuple[Tokenizer, GrammarCompiler]) -> None:
    tokenizer, compiler = setup
    compiled = compiler.compile(StructuredOutputs(grammar=GBNF))
    for seed in range(6):
        text = generate(compiled, tokenizer, seed=seed, greedy=False)
        assert re.fullmatch(r"(yes|no|[0-9])(,(yes|no|[0-9]))?", text), text


# --- matcher state: EOS, rollback -------------------------------------------------


def test_eos_only_when_complete_and_nothing_after(
    byte_setup: tuple[Tokenizer, GrammarCompiler],
) -> None:
    _, compiler = byte_setup
    (eos,) = compiler.vocabulary.eos_token_ids
    m = compiler.compile(StructuredOutputs(regex="ab+")).matcher()
    assert allowed_ids(m) == {ord("a")}
    assert not m.accept_token(eos)
    assert m.accept_tokens(b"ab") == 2
    assert allowed_ids(m) == {ord("b"), eos}
    assert not m.is_terminated()
    assert m.accept_tokens([eos, ord("b")]) == 1  # nothing follows EOS
    assert m.is_terminated()
    assert allowed_ids(m) == {eos}
    assert not m.accept_token(ord("b"))
    # a grammar that cannot continue is terminated before EOS
    done = compiler.compile(StructuredOutputs(regex="ab")).matcher()
    assert done.accept_tokens(b"ab") == 2
    assert done.is_terminated()
    assert allowed_ids(done) == {eos}


def test_rollback_restores_masks(setup: tuple[Tokenizer, GrammarCompiler]) -> None:
    tokenizer, compiler = setup
    schema = {"type": "object", "properties": {"k": {"type": "array"}}}
    compiled = compiler.compile(StructuredOutputs(json=schema))
    (eos,) = tokenizer.eos_token_ids
    ids = tokenizer.encode('{"k": [1, "x", null]}', add_special_tokens=False)
    m = compiled.matcher()
    masks = []
    for token in [*ids, eos]:
        masks.append(allowed_ids(m))
        assert m.accept_token(token)
    assert m.is_terminated()
    for k in (1, 3, len(ids) + 1):
        m.rollback(k)
        assert m.num_tokens == len(ids) + 1 - k
        assert allowed_ids(m) == masks[m.num_tokens]
        assert m.accept_tokens([*ids, eos][m.num_tokens :]) == k
    with pytest.raises(ValueError, match="roll back"):
        m.rollback(len(ids) + 2)
    m.reset()
    assert m.num_tokens == 0
    assert allowed_ids(m) == masks[0]


# --- the batched mask --------------------------------------------------------


def _reference_apply(
    logits: npt.NDArray[np.float32], bitmask: npt.NDArray[np.int32]
) -> npt.NDArray[np.float32]:
    out = logits.copy()
    for b in range(out.shape[0]):
        for t in range(out.shape[1]):
            word = (
                int(bitmask[b, t // 32]) & 0xFFFFFFFF
                if t // 32 < bitmask.shape[1]
                else 0
            )
            if not (word >> (t % 32)) & 1:
                out[b, t] = -np.inf
    return out


@pytest.mark.parametrize("width", [64, 70, 100])
def test_apply_bitmask_matches_reference(width: int) -> None:
    rng = np.random.default_rng(width)
    bitmask = rng.integers(-(2**31), 2**31, size=(3, 2), dtype=np.int64).astype(
        np.int32
    )
    logits = rng.standard_normal((3, width)).astype(np.float32)
    expected = _reference_apply(logits, bitmask)
    apply_bitmask(logits, bitmask)
    np.testing.assert_array_equal(logits, expected)


def test_apply_bitmask_rows_leave_other_rows_alone() -> None:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 64)).astype(np.float32)
    before = logits.copy()
    bitmask = np.zeros((2, 2), np.int32)
    bitmask[0, 0] = 1  # row 3: token 0 only
    bitmask[1, 1] = np.int32(-(2**31))  # row 1: token 63 only
    apply_bitmask(logits, bitmask, rows=[3, 1])
    np.testing.assert_array_equal(logits[[0, 2, 4]], before[[0, 2, 4]])
    assert np.flatnonzero(np.isfinite(logits[3])).tolist() == [0]
    assert np.flatnonzero(np.isfinite(logits[1])).tolist() == [63]
    with pytest.raises(ValueError, match="distinct"):
        apply_bitmask(logits, bitmask, rows=[1, 1])


def test_batch_of_constrained_and_free_rows(
    setup: tuple[Tokenizer, GrammarCompiler],
) -> None:
    """16 requests in one bitmask: every other one constrained; free rows keep
    exactly their logits, constrained ones finish with valid JSON."""
    tokenizer, compiler = setup
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "s": {"enum": ["x", "y"]}},
        "required": ["n", "s"],
        "additionalProperties": False,
    }
    compiled = compiler.compile(StructuredOutputs(json=schema))
    matchers: list[GrammarMatcher | None] = [
        compiled.matcher() if i % 2 else None for i in range(16)
    ]
    constrained = [i for i, m in enumerate(matchers) if m is not None]
    outputs: dict[int, list[int]] = {i: [] for i in constrained}
    bitmask = allocate_bitmask(len(constrained), compiled.vocabulary)
    rng = np.random.default_rng(7)
    eos = compiled.vocabulary.eos_token_ids
    finished: set[int] = set()
    for _ in range(500):
        logits = rng.standard_normal((16, tokenizer.vocab_size + PADDING)).astype(
            np.float32
        )
        before = logits.copy()
        rows = [i for i in constrained if i not in finished]
        fill_bitmasks([matchers[i] for i in rows], bitmask)
        apply_bitmask(logits, bitmask, rows=rows)
        free = [i for i in range(16) if i not in constrained]
        np.testing.assert_array_equal(logits[free], before[free])
        for i in rows:
            token = int(np.argmax(logits[i]))
            m = matchers[i]
            assert m is not None and m.accept_token(token)
            if token in eos:
                finished.add(i)
            else:
                outputs[i].append(token)
        if len(finished) == len(constrained):
            break
    assert finished == set(constrained)
    for ids in outputs.values():
        jsonschema.validate(json.loads(tokenizer.decode(ids)), schema)


def test_fill_bitmask_checks_its_row(
    byte_setup: tuple[Tokenizer, GrammarCompiler],
) -> None:
    _, compiler = byte_setup
    m = compiler.compile(StructuredOutputs(regex="a")).matcher()
    with pytest.raises(ValueError, match="int32"):
        m.fill_bitmask(np.zeros((1, 3), np.int32), 0)
    with pytest.raises(ValueError, match="rows"):
        fill_bitmasks([m, m], allocate_bitmask(1, m.vocabulary))


def test_the_models_eos_ends_a_grammar_when_the_tokenizer_names_none(
    bpe: HFTokenizer,
) -> None:
    bare = HFTokenizer(backend=bpe.backend)  # tokenizer.json alone: no EOS
    assert not bare.eos_token_ids
    with pytest.raises(ValueError, match="EOS"):
        GrammarVocabulary.from_tokenizer(bare)
    eos = bpe.backend.token_to_id("<|im_end|>")
    vocabulary = GrammarVocabulary.from_tokenizer(bare, model_eos_token_ids=[eos])
    assert vocabulary.eos_token_ids == {eos}
    with_both = GrammarVocabulary.from_tokenizer(bpe, model_eos_token_ids=[eos, 0])
    assert with_both.eos_token_ids == set(bpe.eos_token_ids) | {eos, 0}
