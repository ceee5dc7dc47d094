"""Structured output: constrain generation to JSON, a regex, choices or a grammar.

Modules, bottom-up:

- :mod:`~structllm.structured.spec`: :class:`StructuredOutputs`, the
  request-side value (types layer: attrs only, no grammar library);
- :mod:`~structllm.structured.vocabulary`: :class:`GrammarVocabulary`, a
  model's tokens for llguidance, built once per model;
- :mod:`~structllm.structured.compiler`: :class:`GrammarCompiler` (LRU cache
  by ``(kind, canonical spec)``) and :class:`CompiledGrammar`;
- :mod:`~structllm.structured.matcher`: :class:`GrammarMatcher`, one per
  request, and the batched bitmask functions;
- :mod:`~structllm.structured.bitmask`: :func:`apply_bitmask` (numpy only,
  for the sampler).

Only :class:`StructuredOutputs` is imported eagerly; the rest (which load
llguidance) on first use, so the types layer stays light.
"""

from typing import TYPE_CHECKING

from structllm._lazy import lazy_getattr
from structllm.structured.spec import StructuredOutputs

if TYPE_CHECKING:
    from structllm.structured.bitmask import apply_bitmask
    from structllm.structured.compiler import (
        CompiledGrammar,
        CompilerStatistics,
        GrammarCompiler,
    )
    from structllm.structured.matcher import (
        GrammarMatcher,
        allocate_bitmask,
        fill_bitmasks,
    )
    from structllm.structured.vocabulary import GrammarVocabulary

__all__ = [
    "CompiledGrammar",
    "CompilerStatistics",
    "GrammarCompiler",
    "GrammarMatcher",
    "GrammarVocabulary",
    "StructuredOutputs",
    "allocate_bitmask",
    "apply_bitmask",
    "fill_bitmasks",
]

_LAZY = {
    "CompiledGrammar": "structllm.structured.compiler",
    "CompilerStatistics": "structllm.structured.compiler",
    "GrammarCompiler": "structllm.structured.compiler",
    "GrammarMatcher": "structllm.structured.matcher",
    "allocate_bitmask": "structllm.structured.matcher",
    "apply_bitmask": "structllm.structured.bitmask",
    "fill_bitmasks": "structllm.structured.matcher",
    "GrammarVocabulary": "structllm.structured.vocabulary",
}


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
