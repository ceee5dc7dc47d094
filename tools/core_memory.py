"""Where the engine core's memory goes under mixed requests, and whether it stops.

    python tools/core_memory.py [--model tiny-random] [--requests 8000]
        [--every 250] [--concurrency 128] [--model-backend auto] [--trace]

Drives an :class:`~structllm.core.engine_core.EngineCore` in this process,
as the core process does (its warm-up, then requests added and aborted
between steps), with the engine flags of ``tools/soak.py`` (``--max-model-len
2048 --num-blocks 1024 --max-num-seqs 64``), and mixed requests: prompts of
1-1,900 tokens (30% behind one of 8 shared prefixes: prefix-cache hits),
``max_tokens`` 1-200, ``n`` 1, 2 or 4 (as the server fans them out: one core
request per sample), stop token ids, greedy and sampled, seeds, penalties,
logprobs and prompt logprobs, cache salts, structured output (10%: half
from 6 fixed specs, half a spec never seen before) and aborts (10%, after
0-30 steps). They go in rounds of ``--every`` requests, ``--concurrency`` at
a time; after each round the core is idle and the tool records:

- RSS, and glibc's view (``mallinfo2``): ``used``, bytes malloc handed out
  from its arenas and not freed; ``mmapped``, the blocks it mapped on their
  own (large ones: their size, touched or not, so not all resident);
  ``kept``, bytes freed but held in its arenas;
- the size of every structure that can grow, with its bound;
- with ``--trace``: Python's traced memory (tracemalloc, from after the
  warm-up), and at the end its top growers from the first round to the
  last, by line.

At the end each bounded cache is released in turn (the grammar cache, the
prefix cache) and the live bytes it gave back are measured, then
``malloc_trim(0)`` shows what the allocator kept. Prints one JSON object
(``rounds``, ``attribution``) and, on stderr, a table per round.

    python tools/core_memory.py --stages [--model PATH.gguf]

instead measures what each stage of a core process's startup adds to its
resident memory (``VmRSS``, split into ``RssAnon``: heap, stacks, copied
pages; and ``RssFile``: libraries and files mapped), in this fresh
process: numba, Paddle, the model and its KV cache, the compiled kernels
loaded, the first steps (oneDNN and MKL), then 16 requests of 256 tokens and
64 generated at once, with ``bench serve``'s engine flags for the real model
(``STAGE_ENGINE``). Run it with the environment a core process would have
(``MALLOC_ARENA_MAX``...) to see what a setting changes.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import sys
import time
import tracemalloc
from collections import Counter
from typing import Any

from structllm.config import EngineConfig
from structllm.core.engine_core import EngineCore
from structllm.core.request import CoreRequest
from structllm.params import SamplingParams
from structllm.structured.spec import StructuredOutputs

#: tools/soak.py's engine flags
ENGINE = {"max_model_len": 2048, "num_blocks": 1024, "max_num_seqs": 64}

#: bench serve's engine flags against llama.cpp (tools/bench_peers.py)
STAGE_ENGINE = {
    "max_model_len": 4096,
    "num_blocks": 512,
    "max_num_seqs": 16,
    "num_threads": 2,
}

#: structured outputs that recur (the grammar cache hits them)
FIXED_SPECS = (
    StructuredOutputs(choice=("yes", "no", "maybe")),
    StructuredOutputs(regex=r"[a-z]{1,8}"),
    StructuredOutputs(regex=r"\d{3}-\d{4}"),
    StructuredOutputs(json_object=True),
    StructuredOutputs(
        json={"type": "object", "properties": {"a": {"type": "integer"}}}
    ),
    StructuredOutputs(json={"type": "array", "items": {"type": "string"}}),
)


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


_libc = ctypes.CDLL(None)


def malloc_mib() -> dict[str, float]:
    """glibc's view, MiB: ``used`` (allocated from the arenas, not freed),
    ``mmapped`` (large blocks mapped on their own, not freed), ``kept``
    (freed, held in the arenas)."""
    _libc.mallinfo2.restype = MallInfo2
    m = _libc.mallinfo2()
    return {
        "used": round(m.uordblks / 2**20, 2),
        "mmapped": round(m.hblkhd / 2**20, 2),
        "kept": round(m.fordblks / 2**20, 2),
    }


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return round(int(f.read().split()[1]) * os.sysconf("SC_PAGESIZE") / 2**20, 1)


def status_mib() -> dict[str, float]:
    """This process's resident memory, MiB: ``rss`` (VmRSS), ``anon``
    (RssAnon), ``file`` (RssFile), ``peak`` (VmHWM)."""
    keys = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "VmHWM": "peak"}
    out: dict[str, float] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in keys:
                out[keys[key]] = round(int(value.split()[0]) / 1024, 1)
    return out


def numba_specialisations() -> int:
    """Compiled signatures over every numba dispatcher structllm has made."""
    total = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("structllm."):
            continue
        for value in vars(module).values():
            overloads = getattr(value, "overloads", None)
            if isinstance(overloads, dict) and hasattr(value, "py_func"):
                total += len(overloads)
    return total


def step_buffers(core: EngineCore) -> dict[str, float]:
    """The attention layers' kept host buffers: StepBuffers (the last 4
    batch sizes' decode buffers) and the gather scratch (largest use), MiB."""
    from structllm.model.attention import StepBuffers, _Scratch

    sizes = {"step_buffer_sets": 0.0, "step_buffers_mib": 0.0, "scratch_mib": 0.0}
    for obj in gc.get_objects():
        if isinstance(obj, StepBuffers):
            by_rows = obj._by_rows
            sizes["step_buffer_sets"] += len(by_rows)
            sizes["step_buffers_mib"] += (
                sum(view.nbytes for e in by_rows.values() for _, view in e.values())
                / 2**20
            )
        elif isinstance(obj, _Scratch):
            sizes["scratch_mib"] += obj._buf.nbytes / 2**20
    return {k: round(v, 2) for k, v in sizes.items()}


def structures(core: EngineCore, step_sizes: set[int]) -> dict[str, int]:
    """Every structure of the core that can grow (per-request ones are 0
    once the core is idle)."""
    from structllm.structured import compiler as compiler_module

    compiler = core.structured.compiler
    return {
        "scheduler.requests": len(core.scheduler.requests),
        "scheduler.waiting": len(core.scheduler.waiting),
        "scheduler.running": len(core.scheduler.running),
        "grammars_compiling": core.structured.num_compiling,
        "prefix_cache_blocks": len(core.pool._cached),
        "grammar_cache": 0 if compiler is None else compiler.statistics().size,
        "validated_specs": len(compiler_module._VALID),
        "numba_specialisations": numba_specialisations(),
        "distinct_step_sizes": len(step_sizes),
    }


def bounds(core: EngineCore) -> dict[str, str]:
    """What limits each structure, by construction."""
    from structllm.core.structured import GRAMMAR_CACHE_BYTES, GRAMMAR_CACHE_SIZE

    blocks = core.pool.num_blocks
    return {
        "scheduler.requests": "live requests only: removed when finished or aborted",
        "grammars_compiling": "live requests only: collected or forgotten",
        "prefix_cache_blocks": f"one hash per KV block: num_blocks = {blocks}",
        "grammar_cache": f"LRU: GRAMMAR_CACHE_SIZE = {GRAMMAR_CACHE_SIZE} specs and "
        f"GRAMMAR_CACHE_BYTES = {GRAMMAR_CACHE_BYTES >> 20} MiB (estimated)",
        "validated_specs": "1,024 keys (structured.compiler._VALID; front end only)",
        "numba_specialisations": "one per kernel and argument types (dtypes, layouts)",
        "distinct_step_sizes": "max_num_batched_tokens values; the oneDNN backend "
        "runs them padded to step_bucket sizes (48 up to 2,048 rows) and caches "
        "every bucket (model/compiled.py), eager caches none",
        "step_buffer_sets": "StepBuffers keeps the last 4 batch sizes per layer",
        "scratch_mib": "the largest gather: max_num_batched_tokens keys' slots",
    }


class Mixed:
    """Mixed requests from a seeded generator (see the module docstring)."""

    def __init__(self, seed: int, vocab_size: int, max_model_len: int) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab_size
        self.max_model_len = max_model_len
        self.prefixes = [
            self._tokens(self.rng.choice([64, 128, 256, 512])) for _ in range(8)
        ]
        self.count = 0

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def _prompt(self) -> tuple[int, ...]:
        rng = self.rng
        u = rng.random()
        n = (
            rng.randint(1, 200)
            if u < 0.7
            else rng.randint(200, 1000)
            if u < 0.95
            else rng.randint(1000, 1900)
        )
        prefix = rng.choice(self.prefixes) if rng.random() < 0.3 else []
        tail = self._tokens(max(1, n - len(prefix)))
        return tuple([*prefix, *tail][: self.max_model_len - 2])

    def _structured(self) -> StructuredOutputs | None:
        rng = self.rng
        if rng.random() >= 0.1:
            return None
        if rng.random() < 0.5:
            return rng.choice(FIXED_SPECS)
        k = self.count
        return rng.choice(
            [
                StructuredOutputs(choice=(f"a{k}", f"b{k}", f"c{k}")),
                StructuredOutputs(regex=rf"x{k}[a-z]{{1,4}}"),
                StructuredOutputs(json={"type": "object", "properties": {f"k{k}": {}}}),
            ]
        )

    def next(self) -> tuple[list[CoreRequest], int | None]:
        """One user request: its core requests (``n`` samples) and, for an
        abort, after how many steps."""
        rng = self.rng
        self.count += 1
        sampled = rng.random() < 0.7
        params = SamplingParams(
            max_tokens=rng.randint(1, 200),
            temperature=rng.uniform(0.5, 1.2) if sampled else 0.0,
            top_p=rng.choice([1.0, 0.9]) if sampled else 1.0,
            top_k=rng.choice([0, 0, 20]) if sampled else 0,
            seed=rng.randrange(2**31) if rng.random() < 0.3 else None,
            stop_token_ids=self._tokens(rng.randint(1, 3))
            if rng.random() < 0.2
            else (),
            ignore_eos=rng.random() < 0.5,
            repetition_penalty=1.1 if rng.random() < 0.1 else 1.0,
            presence_penalty=0.5 if rng.random() < 0.1 else 0.0,
            logprobs=rng.randint(0, 5) if rng.random() < 0.2 else None,
            prompt_logprobs=rng.randint(0, 2) if rng.random() < 0.05 else None,
            structured_outputs=self._structured(),
        )
        prompt = self._prompt()
        salt = f"tenant-{rng.randrange(4)}" if rng.random() < 0.05 else None
        n = rng.choices([1, 2, 4], [0.8, 0.15, 0.05])[0]
        requests = [
            CoreRequest(
                request_id=f"r{self.count}-{i}",
                prompt_token_ids=prompt,
                params=params,
                cache_salt=salt,
            )
            for i in range(n)
        ]
        abort = rng.randint(0, 30) if rng.random() < 0.1 else None
        return requests, abort


def run_round(
    core: EngineCore, mixed: Mixed, count: int, concurrency: int, step_sizes: set[int]
) -> Counter[str]:
    """``count`` user requests, ``concurrency`` live at a time, to idle."""
    live: dict[str, int] = {}  # core request id -> its user request's number
    remaining: dict[int, int] = {}  # user request -> samples not finished
    aborts: dict[int, list[str]] = {}  # core step -> ids to abort then
    outcomes: Counter[str] = Counter()
    submitted = 0

    def finish(rid: str, how: str) -> None:
        user = live.pop(rid)
        remaining[user] -= 1
        if not remaining[user]:
            del remaining[user]
            outcomes[how] += 1

    while submitted < count or live:
        while submitted < count and len(remaining) < concurrency:
            requests, abort = mixed.next()
            submitted += 1
            remaining[mixed.count] = len(requests)
            for r in requests:
                core.add_request(r)
                live[r.request_id] = mixed.count
            if abort is not None:
                aborts.setdefault(core.steps + abort, []).extend(
                    r.request_id for r in requests
                )
        for rid in aborts.pop(core.steps, ()):
            if rid in live:
                core.abort_requests([rid])
                finish(rid, "aborted")
        if not core.has_unfinished_requests():
            continue
        out = core.step()
        if out.num_batched_tokens:
            step_sizes.add(out.num_batched_tokens)
        for rejected in out.rejected:
            finish(rejected.request_id, "rejected")
        for o in out.outputs:
            if o.finish_reason is not None:
                finish(o.request_id, o.finish_reason)
    return outcomes


def top_growers(
    snapshots: list[tracemalloc.Snapshot], top: int = 12
) -> list[dict[str, Any]]:
    """The lines whose traced memory grew most from the first round's end to
    the last's (what the first round allocates once is not counted), each
    with its KiB after every round: growth that stops, or not."""
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__)]
    snaps = [s.filter_traces(ignore) for s in snapshots]
    diff = snaps[-1].compare_to(snaps[1], "lineno")
    per_round = [
        {st.traceback[0]: st.size for st in s.statistics("lineno")} for s in snaps
    ]
    return [
        {
            "kib": round(d.size_diff / 1024, 1),
            "blocks": d.count_diff,
            "at": f"{d.traceback[0].filename}:{d.traceback[0].lineno}",
            "kib_per_round": [
                round(r.get(d.traceback[0], 0) / 1024, 1) for r in per_round
            ],
        }
        for d in diff[:top]
        if d.size_diff > 0
    ]


def released(what: str, release: Any) -> dict[str, float]:
    """Bytes (MiB) malloc got back from ``release()`` (arenas and mmapped)."""

    def live() -> float:
        m = malloc_mib()
        return m["used"] + m["mmapped"]

    gc.collect()
    before = live()
    release()
    gc.collect()
    return {what: round(before - live(), 2)}


def measure(ns: argparse.Namespace) -> dict[str, Any]:
    from structllm.engine.core_process.loop import _warm_up

    config = EngineConfig(model=ns.model, model_backend=ns.model_backend, **ENGINE)
    core = EngineCore(config)
    _warm_up(core, lambda _: None)
    mixed = Mixed(ns.seed, core.vocab_size, core.max_model_len)
    step_sizes: set[int] = set()
    if ns.trace:
        tracemalloc.start(1)
    rounds: list[dict[str, Any]] = []
    snapshots: list[tracemalloc.Snapshot] = []
    outcomes: Counter[str] = Counter()
    start = time.monotonic()
    print(
        f"{'requests':>8} {'rss':>7} {'used':>7} {'mmapped':>7} {'kept':>6} "
        f"{'traced':>7} "
        f"{'prefix':>6} {'grammars':>8} {'sizes':>5} {'numba':>5} {'idle':>5}",
        file=sys.stderr,
    )
    for r in range(ns.requests // ns.every + 1):
        if r:  # row 0: after the warm-up, before any request
            outcomes += run_round(core, mixed, ns.every, ns.concurrency, step_sizes)
        gc.collect()
        row: dict[str, Any] = {
            "requests": r * ns.every,
            "steps": core.steps,
            "seconds": round(time.monotonic() - start, 1),
            "rss_mib": rss_mib(),
            "malloc_mib": malloc_mib(),
            "structures": structures(core, step_sizes),
        }
        if ns.trace:
            row["traced_mib"] = round(tracemalloc.get_traced_memory()[0] / 2**20, 2)
            snap = tracemalloc.take_snapshot()
            snapshots.append(snap)
        rounds.append(row)
        s = row["structures"]
        idle = s["scheduler.requests"] == 0 and s["grammars_compiling"] == 0
        m = row["malloc_mib"]
        print(
            f"{row['requests']:>8} {row['rss_mib']:>7} {m['used']:>7} "
            f"{m['mmapped']:>7} {m['kept']:>6} {row.get('traced_mib', '-'):>7} "
            f"{s['prefix_cache_blocks']:>6} {s['grammar_cache']:>8} "
            f"{s['distinct_step_sizes']:>5} {s['numba_specialisations']:>5} "
            f"{'yes' if idle else 'NO':>5}",
            file=sys.stderr,
        )
    buffers = step_buffers(core)
    end: dict[str, Any] = {"rss_mib": rss_mib(), "malloc_mib": malloc_mib()}
    compiler = core.structured.compiler
    freed: dict[str, float] = {}
    per_entry: dict[str, float] = {}
    last = rounds[-1]["structures"]
    if compiler is not None:
        freed |= released("grammar_cache", compiler.clear_cache)
        if last["grammar_cache"]:
            per_entry["grammar_cache_kib"] = round(
                1024 * freed["grammar_cache"] / last["grammar_cache"], 1
            )
    freed |= released("prefix_cache", core.reset_prefix_cache)
    _libc.malloc_trim(0)
    trimmed = {"rss_mib": rss_mib(), "malloc_mib": malloc_mib()}
    result: dict[str, Any] = {
        "model": ns.model,
        "backend": type(core.runner.model).__name__,
        "outcomes": dict(outcomes),
        "rounds": rounds,
        "attribution": {
            "bounds": bounds(core),
            "buffers": buffers,
            "released_live_mib": freed,
            "per_entry": per_entry,
            "end": end,
            "after_malloc_trim": trimmed,
            "allocator_kept_mib": round(end["rss_mib"] - trimmed["rss_mib"], 1),
        },
    }
    if len(snapshots) > 2:
        result["attribution"]["traced_growers"] = top_growers(snapshots)
    core.close()
    return result


def stages(ns: argparse.Namespace, engine: dict[str, Any]) -> dict[str, Any]:
    """Resident memory after each stage of a core's startup, then under load.

    Imports first (this module imports only the core's pure-Python side),
    so run it in a fresh interpreter for the import stages to mean anything.
    """
    rows: list[dict[str, Any]] = []

    def mark(stage: str, **extra: Any) -> None:
        gc.collect()
        rows.append({"stage": stage, **status_mib(), **extra})
        r = rows[-1]
        print(
            f"{stage:<44} {r['rss']:>7} {r['anon']:>7} {r['file']:>7} {r['peak']:>7}",
            file=sys.stderr,
        )

    head = ("stage (MiB)", "rss", "anon", "file", "peak")
    print(f"{head[0]:<44} " + " ".join(f"{h:>7}" for h in head[1:]), file=sys.stderr)
    mark("python, structllm's core modules")
    import numba  # noqa: F401

    mark("numba (llvmlite, LLVM)")
    from structllm.model import _paddle, kernels

    mark("paddle")
    from structllm.engine.core_process.loop import _warm_up

    config = EngineConfig(model=ns.model, model_backend=ns.model_backend, **engine)
    core = EngineCore(config)
    per_block = core.runner.model.kv_cache_bytes_per_block()

    def kv() -> dict[str, float]:
        return {
            "kv_reserved_mib": round(core.kv_cache_bytes / 2**20, 1),
            "kv_touched_mib": round(core.pool.num_touched * per_block / 2**20, 1),
        }

    mark("model loaded, KV cache reserved", **kv())
    kernels.warm_up(config.kv_cache_dtype)
    mark("compiled kernels loaded (numba)")
    _warm_up(core, lambda _: None)
    mark("first steps (oneDNN, MKL, quantized kernels)", **kv())
    rng = random.Random(ns.seed)
    vocab = min(1000, core.vocab_size)
    for i in range(16):
        core.add_request(
            CoreRequest(
                request_id=f"s{i}",
                prompt_token_ids=tuple(rng.randrange(3, vocab) for _ in range(256)),
                params=SamplingParams(max_tokens=64, ignore_eos=True),
            )
        )
    while core.has_unfinished_requests():
        core.step()
    mark("16 requests of 256 + 64 tokens at once", **kv())
    _libc.malloc_trim(0)
    mark("after malloc_trim(0)")
    del _paddle
    core.close()
    return {"model": ns.model, "engine": engine, "stages": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--model-backend", default="auto")
    parser.add_argument("--requests", type=int, default=8000)
    parser.add_argument("--every", type=int, default=250)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--trace", action="store_true", help="tracemalloc from after the warm-up (slow)"
    )
    parser.add_argument(
        "--stages",
        action="store_true",
        help="resident memory at each stage of a core's startup (STAGE_ENGINE)",
    )
    ns = parser.parse_args()
    result = stages(ns, STAGE_ENGINE) if ns.stages else measure(ns)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
