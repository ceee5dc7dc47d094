"""Continuous batching: which tokens of which requests run in the next step.

Pure and synchronous: :meth:`Scheduler.schedule` returns the work for one
step, :meth:`Scheduler.update_from_output` takes the sampled tokens back.
Between the two nothing else may touch the scheduler.

Policy, in order, each step:

1. Running requests, highest priority (lowest number) and oldest first, each
   get their pending tokens (one for a decode; a chunk of the prompt for a
   chunked prefill) within ``max_num_batched_tokens``. When the pool has too
   few blocks, the lowest-priority, newest running request is preempted: its
   blocks are freed and it goes back to the waiting queue, to be recomputed
   (prompt plus the tokens it has already generated) later.
2. If nothing was preempted, waiting requests are admitted in priority order
   while there is token budget, a free sequence slot and blocks for their
   first chunk. The queue is strict: a request that does not fit blocks those
   behind it, so large prompts cannot starve. A request whose grammar is
   still compiling (``waiting_for_grammar``, structured output) is passed
   over, keeping its place, until its grammar is ready.

3. Speculative decoding (a ``proposer``, ``num_speculative_tokens`` > 0),
   while at most ``disable_by_batch_size`` requests run: each decoding
   request's one-token chunk takes up to ``num_speculative_tokens`` proposed
   tokens as extra query positions (never more than it may still generate,
   minus one), within the token budget left and the blocks free after 1.
   and 2. (speculation never preempts or delays a request). The runner
   verifies them in the same forward; :meth:`Scheduler.update_from_output`
   takes the 1 + accepted tokens, moves ``num_computed_tokens`` back over
   the rejected positions and frees the blocks that held only those. A
   request still owed prompt logprobs does not speculate; a structured-output
   request's proposals are its grammar's forced tokens, or the proposer's
   cut at the first its grammar refuses. Each request's proposals adapt to how its last ones fared
   (:func:`~structllm.core.scheduler_speculative.adapt`): output that does
   not repeat its context soon stops paying for verification. Those steps
   live in :mod:`structllm.core.scheduler_speculative`.

Within a priority, requests rank by due time (``scheduling_order="edf"``:
the deadline, else arrival plus ``deadline_starvation_s``, so deadlines never
starve the others; ``"fcfs"``: arrival). Each step first drops (``"abort"``)
every request past its deadline, in any state. A pin request that finishes
pins its prompt's cached full blocks under its id until an abort names it.

An embedding request (``Request.pooling``) is prefilled like any prompt,
chunked if long, and finished (``"stop"``) in the step that computes its
last prompt token: nothing is sampled, and its blocks go back to the pool
at once (cached full ones stay findable). Last-token pooling takes prefix
cache hits like any prompt (the last token is always computed).

A request with a LoRA adapter (``Request.lora_id``) is admitted once its
adapter is in one of the model's slots (``LoRAManager.slot_for``: a free
one, or an idle adapter's); while running requests keep every slot busy it
is passed over, keeping its place. Its blocks hash under its adapter's key.
The wait is bounded (new requests with the resident adapters could keep
their slots busy for ever): once a request has been passed over for a slot
in ``max_slot_wait_steps`` steps its adapter is *starved*, and until every
starved request is admitted, requests with other adapters that rank after
it are held (those without one need no slot; those ranking before it, by
priority and due time, go first as ever): the running ones drain and a
freed slot goes to a starved adapter. A held request counts no wait, so
it cannot starve the starved one in turn.

Prefix caching (``enable_prefix_caching``): a request admitted takes the
longest chain of cached full blocks matching its tokens (prompt, and for a
preempted request its outputs too) and computes only the rest; at least its
last token is always computed, so the sample has logits. A request that
asks for prompt logprobs looks nothing up until they are sent (each prompt
position needs its logits), nor does a mean-pooling embedding request (a
cached block has no hidden states to average), but both offer their blocks
like any other. Every
block that a step fills is registered in the pool as soon as the step's
tokens are recorded, so requests running together share blocks too. A waiting request
whose next uncached block is being computed by a running request (its
sibling with the same prompt, say) waits for it rather than compute it a
second time; that wait is bounded by the running request's prefill, which
progresses every step the waiting one could have been admitted.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import attrs

from structllm.core.block_pool import (
    BlockHash,
    BlockPool,
    hash_block_tokens,
    root_hash,
)
from structllm.core.lora_manager import NO_LORA, LoRAManager
from structllm.core.request import Request, RequestStatus
from structllm.core.scheduler_speculative import adapt, add_drafts, speculating
from structllm.core.scheduler_types import (
    ScheduledChunk,
    SchedulerConfig,
    SchedulerOutput,
    SchedulerStatistics,
    hit_rate,
)
from structllm.core.speculative import Proposer
from structllm.outputs import FinishReason

__all__ = [
    "ScheduledChunk",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStatistics",
    "hit_rate",
]


@attrs.define(eq=False)
class Scheduler:
    config: SchedulerConfig
    pool: BlockPool
    #: every unfinished request by id
    requests: dict[str, Request] = attrs.Factory(dict)
    #: both kept sorted by Request.sort_key
    waiting: list[Request] = attrs.Factory(list)
    running: list[Request] = attrs.Factory(list)
    total_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    #: speculative decoding's proposals (None: no speculation)
    proposer: Proposer | None = None
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    #: what deadlines are compared with (time.monotonic; tests pass their own)
    clock: Callable[[], float] = time.monotonic
    num_expired: int = 0
    expired_tokens_skipped: int = 0
    #: LoRA adapters' slots and users (None: LoRA not enabled)
    lora: LoRAManager | None = None
    #: steps a request is passed over for want of a LoRA slot before its
    #: adapter is starved (see the module docstring)
    max_slot_wait_steps: int = 64
    #: waiting request id -> the steps it has been passed over for a slot
    _slot_waits: dict[str, int] = attrs.field(init=False, factory=dict)

    def add_request(self, request: Request) -> None:
        """Queue ``request``; the caller has validated it (see EngineCore)."""
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already live")
        if self.pool.is_pinned(request.request_id):
            raise ValueError(f"{request.request_id!r} names a held pin")
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        if self.config.scheduling_order == "edf":
            wait = request.arrival_time + self.config.deadline_starvation_s
            request.due = wait if request.deadline is None else request.deadline
        if self.config.enable_prefix_caching:
            self._extend_hashes(request)
        bisect.insort(self.waiting, request, key=_key)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (see :meth:`BlockPool.reset_prefix_cache`)."""
        return self.pool.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        expired = self._drop_expired()
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_pending_tokens, budget)
            need = self.pool.blocks_for(req.num_computed_tokens + n) - len(
                req.block_ids
            )
            while need > self.pool.num_free:
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            req.block_ids += self.pool.allocate(need)
            chunks.append(
                ScheduledChunk(
                    req, req.num_computed_tokens, n, n == req.num_pending_tokens
                )
            )
            budget -= n
            i += 1

        caching = self.config.enable_prefix_caching
        # hashes of blocks that running requests have yet to compute
        in_flight: set[BlockHash] | None = None
        bound = self.max_slot_wait_steps  # waiting too long for a slot: starved
        starved = [self.requests[r] for r, n in self._slot_waits.items() if n >= bound]
        j = 0  # the queue position looked at: requests compiling a grammar wait
        while (
            not preempted
            and j < len(self.waiting)
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self.waiting[j]
            if req.waiting_for_grammar or not self._adapter_resident(req, starved):
                j += 1  # it keeps its place
                continue
            hit: list[int] = []
            # prompt logprobs and mean pooling need every prompt position
            if caching and not req.needs_every_position:
                # at most num_tokens - 1 cached: the last token must be computed
                usable = (req.num_tokens - 1) // self.pool.block_size
                hit = self.pool.lookup(req.block_hashes[:usable])
                if len(hit) < usable:
                    if in_flight is None:
                        in_flight = {
                            h
                            for r in self.running
                            for h in r.block_hashes[r.num_cached_blocks :]
                        }
                    if req.block_hashes[len(hit)] in in_flight:
                        break  # wait for it rather than compute it twice
            computed = len(hit) * self.pool.block_size
            pending = req.num_tokens - computed
            n = min(pending, budget)
            if n < pending and not self.config.enable_chunked_prefill:
                break
            need = self.pool.blocks_for(computed + n) - len(hit)
            # hits on free-cached blocks take them off the free list too
            revived = sum(self.pool.ref_count(b) == 0 for b in hit)
            if need + revived > self.pool.num_free:
                break
            del self.waiting[j]
            self._slot_waits.pop(req.request_id, None)
            self.pool.incref(hit)  # before allocate, which could evict them
            req.block_ids = hit + self.pool.allocate(need)
            req.num_computed_tokens = computed
            req.num_cached_blocks = len(hit)
            if caching and not req.needs_every_position:
                self.prefix_cache_queries += req.num_tokens
                self.prefix_cache_hits += computed
            if in_flight is not None:
                in_flight.update(req.block_hashes[len(hit) :])
            if req.num_cached_tokens is None:
                req.num_cached_tokens = min(computed, len(req.prompt_token_ids))
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=_key)
            chunks.append(ScheduledChunk(req, computed, n, n == pending))
            budget -= n
        if self.proposer is not None and speculating(self.config, len(self.running)):
            k = self.config.num_speculative_tokens
            add_drafts(chunks, budget, self.pool, self.proposer, k)
        return SchedulerOutput(tuple(chunks), tuple(preempted), expired)

    def _adapter_resident(self, req: Request, starved: list[Request]) -> bool:
        """Its LoRA adapter is in a slot, or is put in one now (evicting an
        idle one): False while every slot is busy with running requests (a
        step of wait counted), or while it ranks after ``starved`` ones."""
        if req.lora_id == NO_LORA or self.lora is None:
            return True
        if any(r.lora_id != req.lora_id and _key(r) < _key(req) for r in starved):
            return False  # held: the slots drain for a starved adapter
        busy = {r.lora_id for r in self.running}
        if self.lora.slot_for(req.lora_id, busy) is not None:
            return True
        rid = req.request_id
        self._slot_waits[rid] = self._slot_waits.get(rid, 0) + 1
        return False

    def _drop_expired(self) -> tuple[Request, ...]:
        """Finish (``"abort"``) every request whose deadline has passed."""
        now = self.clock()
        expired = tuple(r for r in self.requests.values() if r.past_deadline(now))
        for req in expired:
            self.num_expired += 1
            self.expired_tokens_skipped += req.num_tokens_left
            self._finish(req, "abort", None)
        return expired

    def update_from_output(
        self, output: SchedulerOutput, sampled: Mapping[str, Sequence[int]]
    ) -> list[Request]:
        """Record a step's results; return the requests that finished in it.

        ``sampled`` holds, for each chunk that samples, the tokens sampled
        for its request: the accepted proposals, then the model's own token
        (so 1 + accepted). They are taken in order up to the first that
        ends the request (stop token, EOS, length): none after it.
        """
        finished = []
        for chunk in output.chunks:
            req = chunk.request
            if req.status is not RequestStatus.RUNNING:
                continue
            if req.pooling is not None:  # an embedding: done with its prefill
                req.num_computed_tokens = chunk.context_len + chunk.num_tokens
                if self.config.enable_prefix_caching:
                    self._cache_computed_blocks(req)
                if chunk.samples:
                    self._finish(req, "stop", None)
                    finished.append(req)
                continue
            drafts = chunk.draft_token_ids
            tokens = sampled[req.request_id] if chunk.samples else ()
            if chunk.samples and not 1 <= len(tokens) <= 1 + len(drafts):
                raise ValueError(
                    f"{len(tokens)} tokens sampled for {req.request_id!r}, "
                    f"which proposed {len(drafts)}"
                )
            accepted = max(0, len(tokens) - 1)
            if list(tokens[:accepted]) != list(drafts[:accepted]):
                raise ValueError(f"tokens accepted for {req.request_id!r} differ")
            if drafts:
                self.num_drafts += 1
                self.num_draft_tokens += len(drafts)
                self.num_accepted_tokens += accepted
                adapt(req, accepted, len(drafts), self.config.num_speculative_tokens)
            # the chunk's own tokens and the accepted proposals are computed
            computed = chunk.context_len + chunk.num_tokens - len(drafts) + accepted
            stop = error = None
            for token in tokens:
                req.output_token_ids.append(token)
                if req.grammar is not None and not req.grammar.accept_token(token):
                    # only a sampler fallback can get here (a broken matcher)
                    error = True
                    break
                stop = req.check_stop(token)
                if stop is not None:
                    break
            # (a stop inside an accepted run leaves the rest uncounted)
            req.num_computed_tokens = min(computed, req.num_tokens)
            if drafts:
                self._roll_back(req)
            if self.config.enable_prefix_caching:
                self._cache_computed_blocks(req)
            if error:
                self._finish(req, "error", None)
                finished.append(req)
            elif stop is not None:
                self._finish(req, *stop)
                finished.append(req)
        return finished

    def _roll_back(self, req: Request) -> None:
        """Free the blocks past ``req``'s computed tokens (rejected proposals).

        Never a cached block: a block is registered only once every slot of
        it is computed, and the computed count never drops below that.
        """
        keep = self.pool.blocks_for(req.num_computed_tokens)
        extra = req.block_ids[keep:]
        if extra:
            self.pool.free(reversed(extra))
            del req.block_ids[keep:]

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Abort in any state, and release the pins named; unknown or
        finished ids are ignored."""
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req, "abort", None)
                aborted.append(req)
            self.pool.unpin(rid)
        return aborted

    def statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preempted=sum(
                r.status is RequestStatus.PREEMPTED for r in self.waiting
            ),
            total_preemptions=self.total_preemptions,
            blocks=self.pool.statistics(),
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_drafts=self.num_drafts,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            num_expired=self.num_expired,
            expired_tokens_skipped=self.expired_tokens_skipped,
        )

    def _extend_hashes(self, req: Request) -> None:
        """Hash every full block of ``req``'s known tokens not hashed yet."""
        bs = self.pool.block_size
        hashes = req.block_hashes
        parent = hashes[-1] if hashes else root_hash(req.cache_salt, req.lora_key)
        for i in range(len(hashes), req.num_tokens // bs):
            parent = hash_block_tokens(parent, req.token_slice(i * bs, (i + 1) * bs))
            hashes.append(parent)

    def _cache_computed_blocks(self, req: Request) -> None:
        """Offer the blocks ``req`` has filled with computed tokens to the cache."""
        self._extend_hashes(req)
        full = req.num_computed_tokens // self.pool.block_size
        for i in range(req.num_cached_blocks, full):
            self.pool.cache_block(req.block_ids[i], req.block_hashes[i])
        req.num_cached_blocks = max(req.num_cached_blocks, full)

    def _release(self, req: Request) -> None:
        # tail first: the pool then evicts a sequence's tail before its head
        self.pool.free(reversed(req.block_ids))
        req.block_ids = []
        req.num_cached_blocks = 0

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.total_preemptions += 1
        bisect.insort(self.waiting, req, key=_key)

    def _finish(
        self, req: Request, reason: FinishReason, stop_reason: int | str | None
    ) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        if req.pin and reason in ("stop", "length"):
            # the prompt's full blocks as later lookups find them
            full = len(req.prompt_token_ids) // self.pool.block_size
            self.pool.pin(req.request_id, req.block_hashes[:full])
        self._release(req)
        self._slot_waits.pop(req.request_id, None)
        if self.lora is not None:
            self.lora.release([req.request_id])
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        del self.requests[req.request_id]


def _key(req: Request) -> tuple[int, float, int]:
    return req.sort_key
