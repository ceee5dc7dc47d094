"""Structured output in the engine core: a grammar matcher per constrained request.

:class:`StructuredOutputManager` owns the model's grammar compiler and the
requests whose grammar is being compiled. It follows vLLM v1's design
(``v1/structured_output``): compilation runs in a thread pool, never on the
step loop, and a request waits in the scheduler's queue (flagged
``waiting_for_grammar``, which the scheduler skips) until its grammar is
ready, while every other request keeps stepping.

- :meth:`~StructuredOutputManager.start` (at ``add_request``): a grammar in
  the compiler's cache gives the request its matcher at once; otherwise a
  compile job is queued.
- :meth:`~StructuredOutputManager.collect` (at the top of each step): the
  finished jobs hand their requests a matcher, or a refusal
  (:class:`RejectedRequest`, reported in the step's output).
- :meth:`~StructuredOutputManager.fill_bitmask` (each step): the bitmask
  rows of the constrained requests that sample, for the sampler; with
  speculative proposals, one row per verified position.
- :meth:`~StructuredOutputManager.forget` (abort): the job is cancelled or
  its result dropped when it arrives; nothing of the request stays.

The vocabulary is built on first use, in a compile thread (0.1-1 s for a
large tokenizer: not at model load, and not on the step loop), from the
tokenizer the core was given. Compiled grammars are cached by ``(kind,
canonical spec)`` (:class:`~structllm.structured.GrammarCompiler`), at most
:data:`GRAMMAR_CACHE_SIZE` of them and :data:`GRAMMAR_CACHE_BYTES`
(estimated): the engine's one cache that grows with distinct requests
(docs/operations.md).
Threads: a compile thread exists only while jobs are queued
(:class:`_CompilePool`); llguidance compiles with the GIL released. The
manager is used by the step loop only; the compile threads touch nothing
but the compiler (thread-safe).
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import numpy.typing as npt

from structllm.core.request import RejectedRequest, Request
from structllm.errors import InvalidRequestError
from structllm.structured.compiler import CompiledGrammar, GrammarCompiler
from structllm.structured.matcher import allocate_bitmask, fill_bitmasks
from structllm.structured.spec import StructuredOutputs
from structllm.structured.vocabulary import GrammarVocabulary
from structllm.text.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "COMPILE_THREADS",
    "GRAMMAR_CACHE_BYTES",
    "GRAMMAR_CACHE_SIZE",
    "RejectedRequest",
    "StructuredOutputManager",
    "grammar_vocabulary",
]

#: compile threads: grammars cost ~1-3 ms each with llguidance, so one
#: thread keeps up; more would only compete with the model for the cores
COMPILE_THREADS = 1
#: compiled grammars kept (LRU by spec)
GRAMMAR_CACHE_SIZE = 256
#: and their memory, as the compiler estimates it: 256 short specs take
#: ~8-33 MiB, so the count binds for them; large schemas (MiBs each) meet this
GRAMMAR_CACHE_BYTES = 64 * 2**20


def grammar_vocabulary(
    tokenizer: Tokenizer | str | None,
    model: str,
    model_eos_token_ids: Iterable[int] = (),
) -> GrammarVocabulary:
    """The grammar vocabulary of ``tokenizer`` (an object, a path, or None:
    ``model``'s), ending on its EOS tokens and the model's; run in a compile
    thread, once per core."""
    if not isinstance(tokenizer, Tokenizer):
        tokenizer = load_tokenizer(tokenizer or model)
    return GrammarVocabulary.from_tokenizer(
        tokenizer, model_eos_token_ids=model_eos_token_ids
    )


class StructuredOutputManager:
    """Compiles requests' grammars off the step loop and fills their masks."""

    def __init__(
        self,
        vocabulary: Callable[[], GrammarVocabulary],
        *,
        threads: int = COMPILE_THREADS,
        cache_size: int = GRAMMAR_CACHE_SIZE,
        cache_bytes: int = GRAMMAR_CACHE_BYTES,
    ) -> None:
        self._make_vocabulary = vocabulary
        self._cache_size = cache_size
        self._cache_bytes = cache_bytes
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._pool = _CompilePool(threads)
        #: request id -> the request and its compile job
        self._compiling: dict[
            str, tuple[Request, concurrent.futures.Future[CompiledGrammar]]
        ] = {}
        self._bitmask: npt.NDArray[np.int32] | None = None

    @property
    def num_compiling(self) -> int:
        """Requests whose grammar is being compiled (waiting for it)."""
        return len(self._compiling)

    @property
    def compiler(self) -> GrammarCompiler | None:
        """The compiler, once the first grammar made it (for statistics)."""
        return self._compiler

    def start(self, request: Request) -> None:
        """Give ``request`` its matcher now if cached, else queue a compile."""
        constraint = request.params.structured_outputs
        assert constraint is not None
        compiler = self._compiler
        hit = None if compiler is None else compiler.cached(constraint)
        if hit is not None:
            request.grammar = hit.matcher()
            return
        request.waiting_for_grammar = True
        job = self._pool.submit(self._compile, constraint)
        self._compiling[request.request_id] = (request, job)

    def wait(self, timeout: float) -> None:
        """Block until a compile job finishes, at most ``timeout`` seconds."""
        jobs = [job for _, job in self._compiling.values()]
        if jobs:
            concurrent.futures.wait(
                jobs, timeout, return_when=concurrent.futures.FIRST_COMPLETED
            )

    def collect(self) -> list[RejectedRequest]:
        """Hand finished grammars to their requests; return the refused ones.

        A refused request keeps ``waiting_for_grammar`` false and no
        grammar; the caller removes it from the scheduler.
        """
        refused = []
        for rid, (request, job) in list(self._compiling.items()):
            if not job.done():
                continue
            del self._compiling[rid]
            request.waiting_for_grammar = False
            try:
                compiled = job.result()
            except InvalidRequestError as exc:
                refused.append(RejectedRequest(rid, str(exc), exc.field))
                continue
            except Exception as exc:  # the vocabulary could not be built, ...
                constraint = request.params.structured_outputs
                assert constraint is not None
                refused.append(
                    RejectedRequest(
                        rid,
                        f"{constraint.field}: cannot compile: "
                        f"{type(exc).__name__}: {exc}",
                        constraint.field,
                    )
                )
                continue
            request.grammar = compiled.matcher()
        return refused

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop the compile jobs of aborted requests (cancelled if not begun)."""
        for rid in request_ids:
            entry = self._compiling.pop(rid, None)
            if entry is not None:
                entry[1].cancel()

    def fill_bitmask(
        self,
        requests: Sequence[Request],
        drafts: Sequence[Sequence[int]] | None = None,
    ) -> tuple[npt.NDArray[np.int32], list[int]] | None:
        """The bitmask rows of the constrained ones among ``requests``.

        Returns ``(bitmask, rows)``: the constrained requests
        ``requests[rows[0]]``, ``requests[rows[1]]``, ... in order, each
        with one bitmask row per position it samples, consecutive: one, or
        with proposals ``drafts[i]`` (speculative decoding) ``1 +
        len(drafts[i])``, the position of its newest token and of each
        proposal (:meth:`~structllm.structured.GrammarMatcher.fill_draft_bitmask`).
        None when no request is constrained.
        """
        rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        if not rows:
            return None
        proposals = [() if drafts is None else drafts[i] for i in rows]
        size = sum(1 + len(d) for d in proposals)
        matchers = [requests[i].grammar for i in rows]
        vocabulary = matchers[0].vocabulary  # type: ignore[union-attr]
        buffer = self._bitmask
        if buffer is None or buffer.shape[0] < size:
            buffer = allocate_bitmask(max(size, 16), vocabulary)
            self._bitmask = buffer
        bitmask = buffer[:size]
        if size == len(rows):  # nothing proposed: one row each
            fill_bitmasks(matchers, bitmask)
            return bitmask, rows
        row = 0
        for matcher, draft in zip(matchers, proposals, strict=True):
            assert matcher is not None
            matcher.fill_draft_bitmask(draft, bitmask, row)
            row += 1 + len(draft)
        return bitmask, rows

    def close(self) -> None:
        """Stop the compile threads: queued jobs are cancelled, a running one
        is waited for (one compile, milliseconds), so no thread is left."""
        self._compiling.clear()
        self._pool.close()

    def _compile(self, constraint: StructuredOutputs) -> CompiledGrammar:
        """In a compile thread: the grammar (and the vocabulary, the first time)."""
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(
                    self._make_vocabulary(),
                    cache_size=self._cache_size,
                    cache_bytes=self._cache_bytes,
                )
            compiler = self._compiler
        return compiler.compile(constraint)


class _CompilePool:
    """At most ``threads`` compile threads, alive only while jobs are queued.

    Unlike a ``ThreadPoolExecutor``, whose idle threads live as long as it
    does, a worker here exits when the queue is empty: an engine that is not
    compiling has no grammar thread, whoever holds it and for however long.
    A thread costs ~0.1 ms to start; a compile 1-3 ms.
    """

    def __init__(self, threads: int) -> None:
        self._threads = threads
        self._lock = threading.Lock()
        self._queue: collections.deque[_Job] = collections.deque()
        self._workers: list[threading.Thread] = []
        self._started = 0

    def submit(
        self, fn: Callable[[StructuredOutputs], CompiledGrammar], arg: StructuredOutputs
    ) -> concurrent.futures.Future[CompiledGrammar]:
        future: concurrent.futures.Future[CompiledGrammar] = concurrent.futures.Future()
        with self._lock:
            self._queue.append((future, fn, arg))
            if len(self._workers) < self._threads:
                self._started += 1
                worker = threading.Thread(
                    target=self._work,
                    name=f"structllm-grammar-{self._started}",
                    daemon=True,
                )
                self._workers.append(worker)
                worker.start()
        return future

    def close(self) -> None:
        """Cancel the queued jobs and wait for the running ones to end."""
        with self._lock:
            for future, _, _ in self._queue:
                future.cancel()
            self._queue.clear()
            workers = list(self._workers)
        for worker in workers:
            worker.join()

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            with self._lock:
                if not self._queue:
                    self._workers.remove(me)
                    return
                future, fn, arg = self._queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue  # cancelled (its request was aborted)
            try:
                future.set_result(fn(arg))
            except BaseException as exc:  # handed to the step loop
                future.set_exception(exc)


_Job = tuple[
    concurrent.futures.Future[CompiledGrammar],
    Callable[[StructuredOutputs], CompiledGrammar],
    StructuredOutputs,
]
