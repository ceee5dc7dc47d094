"""Compile :class:`StructuredOutputs` into grammars: :class:`GrammarCompiler`.

One compiler per model (it holds the model's
:class:`~structllm.structured.vocabulary.GrammarVocabulary`). ``compile``
turns a request's constraint into a :class:`CompiledGrammar`, from a bounded
LRU cache keyed by ``(kind, canonical spec)``; each request then takes its
own :class:`~structllm.structured.matcher.GrammarMatcher` from it.

The cache is bounded twice: by entries (``cache_size``) and by memory
(``cache_bytes``). A count alone bounds nothing in bytes: llguidance's
compiled grammar (its lexer and parser tables, native memory) holds 30-130
KiB for a short spec and about 55-130 bytes per character of grammar text
beyond that, 2.9 MiB for one nested JSON schema of 52,000 characters
(``tools/core_memory.py``, docs/operations.md), so 256 such specs would keep
740 MiB. llguidance reports no size, so each entry counts
:func:`estimate_grammar_bytes`, an upper estimate from its grammar text.

Errors: a constraint llguidance cannot compile (an unknown JSON Schema
keyword or format, an unsatisfiable schema, a regex with look-around, a
grammar that does not parse) raises
:class:`~structllm.errors.InvalidRequestError` whose ``field`` is the
constraint's (``"structured_outputs.json"``), with llguidance's message.
Failures are not cached: they cost little to find again.

Threads: ``compile`` may run in any thread, several at once (the engine
runs it off the step loop with ``anyio.to_thread.run_sync``). llguidance
builds the grammar with the GIL released (``LLMatcher``'s constructor); the
cache is guarded by a lock that is never held while compiling, so two
threads asking for the same new spec may both compile it, and the first
result is kept. A :class:`CompiledGrammar` is immutable and shareable; its
``matcher()`` deep-copies a prototype matcher in microseconds.
"""

from __future__ import annotations

import collections
import hashlib
import json
import threading
from typing import TYPE_CHECKING, Literal

import attrs
import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from structllm.errors import InvalidRequestError
from structllm.structured.spec import StructuredOutputKind, StructuredOutputs
from structllm.structured.vocabulary import GrammarVocabulary

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

    from structllm.structured.matcher import GrammarMatcher

__all__ = [
    "CompiledGrammar",
    "CompilerStatistics",
    "GrammarCompiler",
    "estimate_grammar_bytes",
    "grammar_text",
    "is_validated",
    "validate",
]

#: How JSON output may be spaced. ``"compact"``: exactly ``", "`` between
#: items and ``": "`` after keys, nothing else (what most models write, and a
#: model cannot emit whitespace forever); ``"flexible"``: any JSON whitespace.
JsonWhitespace = Literal["compact", "flexible"]

#: :func:`estimate_grammar_bytes`: what any compiled grammar holds (measured 29-130
#: KiB with llguidance 1.9), and what each character of its text adds
#: (measured 55 for a nested JSON schema, 120 for a 300-way choice)
GRAMMAR_BASE_BYTES = 128 * 1024
GRAMMAR_BYTES_PER_CHAR = 128


def estimate_grammar_bytes(llguidance_grammar: str) -> int:
    """An upper estimate of the memory a grammar compiled from this text holds
    (llguidance's tables; a matcher's use adds a little to them: 0.65 MiB
    over 30 runs of the 2.9 MiB schema above)."""
    return GRAMMAR_BASE_BYTES + GRAMMAR_BYTES_PER_CHAR * len(llguidance_grammar)


@attrs.frozen(eq=False)
class CompiledGrammar:
    """A constraint compiled for one vocabulary; hand out matchers with
    :meth:`matcher`."""

    kind: StructuredOutputKind
    spec: str = attrs.field(repr=False)
    #: the grammar in llguidance's JSON envelope (what ``LLMatcher`` takes)
    llguidance_grammar: str = attrs.field(repr=False)
    vocabulary: GrammarVocabulary = attrs.field(repr=False)
    _prototype: llguidance.LLMatcher = attrs.field(repr=False, alias="prototype")
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock, repr=False)

    @property
    def estimated_bytes(self) -> int:
        """What the cache counts this grammar as holding
        (:func:`estimate_grammar_bytes`)."""
        return estimate_grammar_bytes(self.llguidance_grammar)

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar (one per request)."""
        # the core's (numpy's bitmasks): the front end only validates specs
        from structllm.structured.matcher import GrammarMatcher

        with self._lock:  # deep_copy takes the prototype by &self; keep it simple
            clone = self._prototype.deep_copy()
        return GrammarMatcher(clone, self.vocabulary)


@attrs.frozen
class CompilerStatistics:
    """A snapshot of a compiler's cache."""

    hits: int
    misses: int
    size: int
    capacity: int
    #: the cached grammars' :func:`estimate_grammar_bytes`, and the budget for them
    estimated_bytes: int = 0
    capacity_bytes: int = 0


@attrs.define(eq=False)
class GrammarCompiler:
    """Compiles constraints for one vocabulary, with a bounded LRU cache:
    at most ``cache_size`` grammars and ``cache_bytes`` of them (estimated),
    the least recently used evicted first; the newest is kept whatever its
    size (it is what its request runs)."""

    vocabulary: GrammarVocabulary
    cache_size: int = attrs.field(default=256, kw_only=True)
    cache_bytes: int = attrs.field(default=64 * 2**20, kw_only=True)
    json_whitespace: JsonWhitespace = attrs.field(default="compact", kw_only=True)
    #: llguidance's parser limits (None: its defaults)
    limits: llguidance.LLParserLimits | None = attrs.field(default=None, kw_only=True)

    _cache: collections.OrderedDict[tuple[str, str], CompiledGrammar] = attrs.field(
        init=False, factory=collections.OrderedDict
    )
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)
    _hits: int = attrs.field(init=False, default=0)
    _misses: int = attrs.field(init=False, default=0)
    #: the cached grammars' estimated bytes, summed
    _bytes: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        if self.cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {self.cache_size}")
        if self.cache_bytes < 1:
            raise ValueError(f"cache_bytes must be >= 1, got {self.cache_bytes}")
        if self.json_whitespace not in ("compact", "flexible"):
            raise ValueError(
                f"json_whitespace must be 'compact' or 'flexible', "
                f"got {self.json_whitespace!r}"
            )

    def compile(self, constraint: StructuredOutputs) -> CompiledGrammar:
        """The grammar of *constraint*, from the cache when it is there.

        Raises :class:`~structllm.errors.InvalidRequestError` naming the
        constraint's field when llguidance refuses it. Thread-safe.
        """
        key = constraint.key
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self._hits += 1
                return cached
            self._misses += 1
        compiled = self._compile(constraint)
        with self._lock:
            kept = self._cache.setdefault(key, compiled)
            if kept is compiled:
                self._bytes += compiled.estimated_bytes
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size or (
                self._bytes > self.cache_bytes and len(self._cache) > 1
            ):
                self._bytes -= self._cache.popitem(last=False)[1].estimated_bytes
        return kept

    def cached(self, constraint: StructuredOutputs) -> CompiledGrammar | None:
        """The grammar of *constraint* if it is in the cache (never compiles).

        The engine core calls this on its step loop: a hit is ready at once,
        a miss goes to a compile thread.
        """
        with self._lock:
            found = self._cache.get(constraint.key)
            if found is not None:
                self._cache.move_to_end(constraint.key)
                self._hits += 1
            return found

    def statistics(self) -> CompilerStatistics:
        with self._lock:
            return CompilerStatistics(
                hits=self._hits,
                misses=self._misses,
                size=len(self._cache),
                capacity=self.cache_size,
                estimated_bytes=self._bytes,
                capacity_bytes=self.cache_bytes,
            )

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()
            self._bytes = 0

    # --- compiling ----------------------------------------------------------

    def _compile(self, c: StructuredOutputs) -> CompiledGrammar:
        try:
            text = grammar_text(c, self.json_whitespace)
        except Exception as exc:  # llguidance raises ValueError; its GBNF
            # converter (pure Python) anything
            raise _refused(c, str(exc)) from None
        lltok = self.vocabulary.lltokenizer
        matcher = llguidance.LLMatcher(lltok, text, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise _refused(c, matcher.get_error())
        return CompiledGrammar(c.kind, c.spec, text, self.vocabulary, prototype=matcher)


def _json_options(whitespace: JsonWhitespace) -> JsonCompileOptions:
    if whitespace == "flexible":
        return {}
    return {
        "whitespace_flexible": False,
        "item_separator": ", ",
        "key_separator": ": ",
    }


def grammar_text(c: StructuredOutputs, json_whitespace: JsonWhitespace) -> str:
    """llguidance's grammar text for *c* (may raise for bad input)."""
    matcher = llguidance.LLMatcher
    if c.json is not None:
        return matcher.grammar_from_json_schema(
            c.json, defaults=_json_options(json_whitespace)
        )
    if c.json_object:
        return matcher.grammar_from_json_schema(
            {"type": "object"}, defaults=_json_options(json_whitespace)
        )
    if c.regex is not None:
        return matcher.grammar_from_regex(c.regex)
    if c.choice is not None:
        # A Lark alternation of string literals, JSON-quoted: Lark string
        # literals take JSON escapes, so any text is spelled safely.
        alternatives = " | ".join(json.dumps(s) for s in c.choice)
        return matcher.grammar_from_lark(f"start: {alternatives}")
    assert c.grammar is not None
    # Lark is the dialect; GBNF (llama.cpp, "root ::= ...") is converted,
    # as vLLM's guidance backend does
    return matcher.grammar_from_lark(any_to_lark(c.grammar))


def is_validated(
    constraint: StructuredOutputs, *, json_whitespace: JsonWhitespace = "compact"
) -> bool:
    """True when :func:`validate` has passed *constraint* (and remembers it)."""
    return _valid_key(constraint, json_whitespace) in _VALID


def validate(
    constraint: StructuredOutputs, *, json_whitespace: JsonWhitespace = "compact"
) -> None:
    """Raise what :meth:`GrammarCompiler.compile` would for *constraint*,
    without a vocabulary.

    What the front ends call at admission, so that a spec llguidance refuses
    fails its request before the engine core sees it (vLLM's guidance
    backend validates the same way). Grammars are checked without a
    tokenizer (llguidance's ``validate_grammar``), so this needs no model;
    what only the vocabulary could reveal still fails in the core. ~0.1-2
    ms; known-good keys are remembered, so a repeated spec costs nothing.
    Thread-safe.
    """
    key = _valid_key(constraint, json_whitespace)
    if key in _VALID:
        return
    try:
        text = grammar_text(constraint, json_whitespace)
    except Exception as exc:  # as in GrammarCompiler._compile
        raise _refused(constraint, str(exc)) from None
    error = llguidance.LLMatcher.validate_grammar(text)
    if error:
        raise _refused(constraint, error)
    with _VALID_LOCK:
        _VALID[key] = None
        while len(_VALID) > 1024:
            _VALID.pop(next(iter(_VALID)))


#: digests of the keys that validate() has passed, oldest first: at most
#: 1,024 of 16 bytes, whatever the size of the specs (a key itself holds
#: the canonical spec, which may be megabytes of JSON schema)
_VALID: dict[bytes, None] = {}
_VALID_LOCK = threading.Lock()


def _valid_key(constraint: StructuredOutputs, json_whitespace: str) -> bytes:
    kind, spec = constraint.key
    h = hashlib.blake2b(f"{kind}\0{json_whitespace}\0".encode(), digest_size=16)
    h.update(spec.encode("utf-8", "surrogatepass"))  # a lone surrogate is text too
    return h.digest()


_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "choice": "choice list",
    "grammar": "Lark grammar",
}


def _refused(c: StructuredOutputs, reason: str) -> InvalidRequestError:
    reason = reason.strip()
    if len(reason) > 500:
        reason = reason[:500] + "..."
    return InvalidRequestError(
        f"{c.field}: cannot compile this {_NAMES[c.kind]}: {reason}", field=c.field
    )
