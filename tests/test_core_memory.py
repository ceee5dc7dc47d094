"""The engine core's memory is bounded by construction (docs/operations.md).

What tools/core_memory.py measures, as properties that need no clock and no
RSS: an idle core holds nothing of the requests it served, and the one
cache that grows with distinct requests, the grammar cache, keeps to its
entry and byte bounds however large the grammars. And two that read RSS: a
reserved KV cache is not resident until used, and an idle core gives
malloc's kept memory back.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
from collections.abc import Callable

import attrs
import pytest

from structllm.config import EngineConfig
from structllm.core.engine_core import EngineCore
from structllm.core.request import CoreRequest, Request, StepOutput
from structllm.engine.child import TRIM_AFTER_TOKENS, trims_after
from structllm.engine.core_process import loop
from structllm.engine.protocol import Heartbeat, Message, Ready
from structllm.structured import compiler as compiler_module
from structllm.structured.compiler import (
    GrammarCompiler,
    estimate_grammar_bytes,
    is_validated,
    validate,
)
from structllm.structured.spec import StructuredOutputs
from structllm.structured.vocabulary import GrammarVocabulary
from structllm.text.byte_tokenizer import ByteTokenizer
from tests.test_core_process import CONFIG, GREEDY, core_loop, finished
from tests.tool_modules import load_tool

#: room for a prompt of TRIM_AFTER_TOKENS + 1 in one step
CONFIG_LONG = attrs.evolve(CONFIG, max_model_len=512, num_blocks=64)


def _choice(k: int, n: int) -> StructuredOutputs:
    """A spec never seen before; the same length for every ``k`` < 1000."""
    return StructuredOutputs(choice=tuple(f"w{k:03d}_{i}" for i in range(n)))


@pytest.fixture(scope="module")
def vocabulary() -> GrammarVocabulary:
    return GrammarVocabulary.from_tokenizer(ByteTokenizer())


def test_grammar_cache_keeps_its_byte_budget(vocabulary: GrammarVocabulary) -> None:
    one = estimate_grammar_bytes(
        GrammarCompiler(vocabulary).compile(_choice(0, 200)).llguidance_grammar
    )
    compiler = GrammarCompiler(vocabulary, cache_size=100, cache_bytes=3 * one)
    for k in range(12):
        newest = compiler.compile(_choice(k, 200))
        stats = compiler.statistics()
        assert stats.estimated_bytes <= stats.capacity_bytes == 3 * one
        assert stats.size <= 3
        assert compiler.cached(_choice(k, 200)) is newest  # the newest stays
    assert compiler.cached(_choice(0, 200)) is None  # the oldest went first
    # the budget binds, not the count: 12 specs, 3 kept
    assert compiler.statistics().size == 3
    compiler.clear_cache()
    assert compiler.statistics().estimated_bytes == 0


def test_grammar_larger_than_the_budget_is_kept_alone(
    vocabulary: GrammarVocabulary,
) -> None:
    compiler = GrammarCompiler(vocabulary, cache_bytes=1)
    small = compiler.compile(StructuredOutputs(regex="a+"))
    big = compiler.compile(_choice(1, 50))
    assert compiler.cached(_choice(1, 50)) is big
    assert compiler.cached(StructuredOutputs(regex="a+")) is None
    stats = compiler.statistics()
    assert (stats.size, stats.estimated_bytes) == (1, big.estimated_bytes)
    assert small.estimated_bytes < big.estimated_bytes


def test_grammar_cache_count_bound(vocabulary: GrammarVocabulary) -> None:
    compiler = GrammarCompiler(vocabulary, cache_size=4)
    grammars = [compiler.compile(StructuredOutputs(regex=f"x{k}")) for k in range(9)]
    stats = compiler.statistics()
    assert stats.size == 4
    assert stats.estimated_bytes == sum(g.estimated_bytes for g in grammars[-4:])


def test_validated_specs_keep_a_digest_not_the_spec() -> None:
    """The front end's record of validated specs: 1,024 entries of 16 bytes,
    however long the schemas (a key itself holds the whole spec)."""
    big = [
        StructuredOutputs(json={"enum": [f"value {k} {i}" for i in range(2000)]})
        for k in range(3)
    ]
    for spec in big:
        validate(spec)
        assert is_validated(spec)
    assert not is_validated(StructuredOutputs(json={"enum": ["never validated"]}))
    for k in range(1030):
        validate(StructuredOutputs(regex=f"v{k}"))
    valid = compiler_module._VALID
    assert len(valid) == 1024
    assert all(len(key) == 16 for key in valid)
    assert not is_validated(big[0])  # the oldest went first


def test_idle_core_after_mixed_requests_keeps_nothing_of_them() -> None:
    """Prefix hits, n > 1, stop ids, logprobs, grammars (new and cached) and
    aborts: once idle, no request, block or compile job is left, and every
    cache is within its bound."""
    tool = load_tool("core_memory")
    core = EngineCore(EngineConfig(model="tiny-random", **tool.ENGINE))
    try:
        mixed = tool.Mixed(3, core.vocab_size, core.max_model_len)
        step_sizes: set[int] = set()
        outcomes = tool.run_round(core, mixed, 30, 12, step_sizes)
        assert sum(outcomes.values()) == 30
        assert outcomes["aborted"] and outcomes["length"]
        sizes = tool.structures(core, step_sizes)
        assert sizes["scheduler.requests"] == 0
        assert sizes["scheduler.waiting"] == sizes["scheduler.running"] == 0
        assert sizes["grammars_compiling"] == 0
        assert 0 < sizes["grammar_cache"] <= 256
        assert 0 < sizes["prefix_cache_blocks"] <= core.pool.num_blocks
        assert core.pool.num_used == 0
        gc.collect()
        # type(), not isinstance(): a dead weakref.proxy (numba leaves some)
        # raises on the latter
        assert not [o for o in gc.get_objects() if issubclass(type(o), Request)]
    finally:
        core.close()


def test_the_stages_report_commits_the_kv_cache_as_it_is_used() -> None:
    """``--stages`` on a 128 MiB cache: reserving it adds next to nothing to
    the resident memory; 16 requests touch only the blocks they used."""
    tool = load_tool("core_memory")
    ns = argparse.Namespace(model="tiny-random", model_backend="auto", seed=0)
    engine = {"max_model_len": 512, "num_blocks": 16384, "max_num_seqs": 16}
    rows = {r["stage"]: r for r in tool.stages(ns, engine)["stages"]}
    loaded = rows["model loaded, KV cache reserved"]
    reserved = loaded["kv_reserved_mib"]
    assert reserved >= 100
    assert loaded["anon"] - rows["paddle"]["anon"] < reserved / 4
    served = rows["16 requests of 256 + 64 tokens at once"]
    assert 0 < served["kv_touched_mib"] < reserved / 8
    assert list(rows)[-1] == "after malloc_trim(0)"


def test_an_idle_core_gives_mallocs_kept_memory_back_once_a_spell(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After the warm-up and after each burst, once, a heartbeat interval
    idle: a busy core keeps its pages."""
    calls: list[int] = []
    monkeypatch.setattr(loop, "release_kept_memory", lambda: calls.append(1))

    def beats(n: int) -> Callable[[Message], bool]:
        seen = [0]

        def beat(m: Message) -> bool:
            seen[0] += isinstance(m, Heartbeat)
            return seen[0] == n

        return beat

    with core_loop(heartbeat_interval=0.05) as (peer, _):
        peer.until(lambda m: isinstance(m, Ready))
        loaded = len(calls)  # the warm-up's own, after the kernels load
        assert loaded == 2
        peer.until(beats(4))
        assert len(calls) == loaded + 1
        peer.send(CoreRequest(request_id="a", prompt_token_ids=(1, 2), params=GREEDY))
        peer.until(finished("a"))
        peer.until(beats(4))
        assert len(calls) == loaded + 2


def test_a_step_of_many_prompt_tokens_gives_mallocs_kept_memory_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Right after a step that ran a long prompt chunk, while busy; not
    after a short prompt's step nor after decode steps (the heartbeat
    interval is too long for an idle spell's release to come)."""
    calls: list[int] = []
    monkeypatch.setattr(loop, "release_kept_memory", lambda: calls.append(1))
    long = tuple(range(3, 3 + TRIM_AFTER_TOKENS + 1))
    with core_loop(CONFIG_LONG, heartbeat_interval=3600) as (peer, _):
        peer.until(lambda m: isinstance(m, Ready))
        del calls[:]  # the warm-up's own
        peer.send(CoreRequest(request_id="a", prompt_token_ids=(1, 2), params=GREEDY))
        peer.until(finished("a"))
        assert calls == []
        peer.send(CoreRequest(request_id="b", prompt_token_ids=long, params=GREEDY))
        got = peer.until(finished("b"))
        assert calls == [1]  # the prompt's step; not its 3 decode steps
        steps = [m for m in got if isinstance(m, StepOutput)]
        assert [m.num_batched_tokens for m in steps] == [len(long), 1, 1, 1]


def test_which_steps_give_mallocs_kept_memory_back() -> None:
    """The same rule on rank 0 and a tensor-parallel follower: tokens beyond
    one a sequence (prompt chunks, drafts), never a decode step's batch."""
    assert not trims_after(64, 64)  # a decode step of 64 sequences
    assert not trims_after(16 * 5, 16)  # 16 sequences verifying 4 drafts each
    assert trims_after(15 + TRIM_AFTER_TOKENS + 1, 16)  # 15 decodes and a prompt
    assert not trims_after(TRIM_AFTER_TOKENS, 1)  # a prompt one token short


def test_releasing_kept_memory_shrinks_the_heap() -> None:
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    # 64 MiB of 16 KiB blocks (below the mmap threshold: in the heap), all
    # freed but the last, which pins the heap's top: free() cannot shrink it
    blocks = [libc.malloc(16 << 10) for _ in range(4096)]
    for b in blocks:
        ctypes.memset(b, 1, 16 << 10)
    for b in blocks[:-1]:
        libc.free(b)
    kept = _rss_anon()
    loop.release_kept_memory()
    assert kept - _rss_anon() > 32 << 20
    libc.free(blocks[-1])


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        line = next(ln for ln in f if ln.startswith("RssAnon:"))
    return 1024 * int(line.split()[1])
