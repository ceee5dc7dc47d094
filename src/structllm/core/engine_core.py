"""The engine core: requests in, one batch per :meth:`EngineCore.step`, tokens out.

Synchronous and single-threaded; it does no I/O beyond loading the model.
The async front end (``structllm.engine``) drives it in a core process (or a
thread) over a socket; the offline :class:`~structllm.llm.LLM` drives it
directly. Both pass it the same :class:`CoreRequest` and read the same
:class:`StepOutput`.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

import attrs

from structllm.config import EngineConfig
from structllm.core.admission import check_pin, check_prompt, use_lora
from structllm.core.block_pool import BlockPool
from structllm.core.engine_setup import (
    engine_scheduler_config,
    kv_cache_touch_limit,
    load_engine_model,
    size_kv_cache,
)
from structllm.core.lora_manager import (
    LoRAFollowers,
    LoRAInfo,
    LoRAManager,
    enable_model_lora,
)
from structllm.core.pooling import PoolingConfig, read_pooling_config
from structllm.core.request import (
    CoreRequest,
    Request,
    RequestStepOutput,
    StepOutput,
)
from structllm.core.scheduler import (
    Scheduler,
    SchedulerOutput,
    SchedulerStatistics,
)
from structllm.core.speculative import NgramProposer
from structllm.core.step_outputs import (
    add_pooled,
    embedding_output,
    step_output,
    take_prompt_logprobs,
)
from structllm.core.structured import (
    RejectedRequest,
    StructuredOutputManager,
    grammar_vocabulary,
)
from structllm.errors import EngineConfigError, InvalidRequestError
from structllm.lora_request import LoRARequest
from structllm.model.config import ModelConfig
from structllm.model.sampler import make_generator
from structllm.models import resolve_model
from structllm.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    # Paddle loads with the model, never before: the front end (AsyncLLM,
    # the server) imports this module for the structs of the wire
    from structllm.core.draft import DraftProposer
    from structllm.core.runner import ModelInput
    from structllm.model.loader import LoadProgress

__all__ = [
    "EngineCore",
    "RejectedRequest",
    "RequestStepOutput",
    "StepOutput",
    "TensorParallelGroup",
]

#: when only grammar compiles are pending, a step waits this long for one
#: (bounds how late an abort that arrives meanwhile is read)
GRAMMAR_WAIT_S = 0.02


class TensorParallelGroup(LoRAFollowers, Protocol):
    """The other ranks of a tensor-parallel core, as rank 0 drives them.

    The process group is up and each follower is loading its shard; the
    core allocates the followers' KV caches once it has sized its own, then
    hands each step's model input to :meth:`broadcast` before its forward
    (with LoRA, then its adapters' part to ``send_lora``).
    (``structllm.engine.rank_group`` starts them; nothing here does I/O.)
    """

    @property
    def size(self) -> int: ...

    def allocate(self, num_blocks: int) -> None: ...

    def broadcast(self, step: ModelInput) -> None: ...


@attrs.frozen
class EngineCoreStatistics:
    scheduler: SchedulerStatistics
    max_model_len: int
    steps: int


class EngineCore:
    """``tokenizer`` (an object, or a path loaded on first use; default: the
    model's) is what structured-output grammars are compiled against.

    With ``config.tensor_parallel_size > 1`` this is rank 0 of the group
    ``tp_group`` (started by the core process): it loads rank 0's shard,
    schedules and samples; the other ranks only run the forward.
    ``kv_cache_memory`` is then per rank.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        on_progress: Callable[[LoadProgress], None] | None = None,
        tokenizer: Tokenizer | str | None = None,
        tp_group: TensorParallelGroup | None = None,
    ) -> None:
        self.config = config
        tp = config.tensor_parallel_size
        from structllm.core.runner import ModelRunner
        from structllm.model._paddle import eager_mode_here, set_num_threads

        eager_mode_here()  # this thread steps the model (an inline core's own)
        set_num_threads(config.cpu_threads())  # ranks of one machine share its cores
        if tp > 1 and (tp_group is None or tp_group.size != tp):
            raise EngineConfigError(
                f"tensor_parallel_size={tp} runs in the engine's core process, "
                "which starts the other ranks: use AsyncLLM (executor='process') "
                "or `structllm serve`, not LLM or executor='inline'",
                field="tensor_parallel_size",
            )
        loaded = load_engine_model(config, 0, on_progress)
        self.model_config: ModelConfig = loaded.config
        self.max_model_len, num_blocks = size_kv_cache(config, loaded)
        touch = kv_cache_touch_limit(config, loaded, num_blocks)
        self.pool = BlockPool(num_blocks, config.block_size, touch_limit=touch)
        #: the KV cache's bytes, over every layer and every rank's heads
        self.kv_cache_bytes = loaded.model.kv_cache_bytes_per_block() * num_blocks * tp
        spec = config.speculative_config
        scheduler_config = engine_scheduler_config(config, self.max_model_len)
        #: speculative_config's draft model ("draft_model"), beside the target
        self.draft: DraftProposer | None = None
        if spec is not None and spec.method == "draft_model":
            from structllm.core.draft import load_draft_proposer

            self.draft = load_draft_proposer(
                config,
                max_model_len=self.max_model_len,
                vocab_size=self.vocab_size,
                tokenizer=tokenizer,
                on_progress=on_progress,
            )
        self.scheduler = Scheduler(
            scheduler_config,
            self.pool,
            proposer=self.draft
            or (None if spec is None else NgramProposer.from_config(spec)),
        )
        self.structured = StructuredOutputManager(
            functools.partial(
                grammar_vocabulary,
                tokenizer,
                config.model,
                frozenset(self.model_config.eos_token_ids),
            )
        )
        if tp_group is not None:
            tp_group.allocate(num_blocks)
        #: LoRA adapters (enable_lora), shared by the scheduler and the runner
        self.lora: LoRAManager | None = None
        if config.enable_lora:
            self.lora = enable_model_lora(loaded.model, config, tp_group)
            self.scheduler.lora = self.lora
        self.runner = ModelRunner(
            loaded.model,
            num_blocks,
            self.structured,
            broadcast=None if tp_group is None else tp_group.broadcast,
            lora=self.lora,
        )
        #: how embedding requests pool by default (the checkpoint's
        #: sentence-transformers config, or its GGUF metadata)
        self.pooling_config: PoolingConfig = read_pooling_config(
            resolve_model(config.model)
        )
        self._sequence = itertools.count()
        self.steps = 0

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def add_request(self, request: CoreRequest) -> None:
        """Queue ``request`` or raise InvalidRequestError; nothing else changes.

        A request with ``structured_outputs`` waits while its grammar
        compiles (in a thread); a grammar the compiler refuses drops it in
        a later step, reported in :attr:`StepOutput.rejected`.
        """
        req = self._admit(request)
        if request.lora_request is not None:
            use_lora(self.lora, req, request.lora_request)
        if req.params.structured_outputs is not None:
            self.structured.start(req)
        self.scheduler.add_request(req)
        if self.lora is not None and req.lora_id:
            self.lora.acquire(req.request_id, req.lora_id)  # known: just added

    def add_lora(self, lora: LoRARequest) -> bool:
        """Read ``lora``'s adapter ahead of the requests that name it (see
        ``LoRAManager.add``); ModelLoadError naming the file and tensor."""
        if self.lora is None:
            raise InvalidRequestError(
                "LoRA is not enabled on this engine (enable_lora)",
                field="lora_request",
            )
        return self.lora.add(lora)

    def remove_lora(self, lora_id: int) -> bool:
        """Unload adapter ``lora_id``: requests running with it finish with
        it (``LoRAManager.remove``); False when it is not loaded."""
        return self.lora is not None and self.lora.remove(lora_id)

    def list_loras(self) -> tuple[LoRAInfo, ...]:
        return () if self.lora is None else self.lora.adapters()

    def _admit(self, r: CoreRequest) -> Request:
        if not isinstance(r.request_id, str) or not r.request_id:
            raise InvalidRequestError(
                "request_id must be a non-empty string", field="request_id"
            )
        if r.request_id in self.scheduler.requests:
            raise InvalidRequestError(
                f"request_id {r.request_id!r} is already in use by a live request",
                field="request_id",
            )
        if r.cache_salt is not None and (
            not isinstance(r.cache_salt, str) or not r.cache_salt
        ):
            raise InvalidRequestError(
                "cache_salt must be a non-empty string or None", field="cache_salt"
            )
        prompt = r.prompt_token_ids
        check_prompt(
            prompt, vocab_size=self.vocab_size, max_model_len=self.max_model_len
        )
        if r.pin:
            check_pin(r, self.config, self.pool, self.scheduler.requests.values())
        # No separate "fits in the pool" check: __init__ refuses a pool that
        # cannot hold one max_model_len sequence, and check_prompt refuses
        # prompts of max_model_len tokens, so every admitted prompt fits.
        room = self.max_model_len - len(prompt)
        max_new = min(r.params.max_tokens or room, room)
        pooling = None
        if r.pooling is not None:
            pooling = self.pooling_config.resolve(
                r.pooling, self.model_config.hidden_size
            )
            max_new = 0  # it generates nothing
        return Request(
            request_id=r.request_id,
            prompt_token_ids=tuple(prompt),
            params=r.params,
            eos_token_ids=r.eos_token_ids or frozenset(self.model_config.eos_token_ids),
            priority=r.priority,
            arrival_time=r.arrival_time or time.monotonic(),
            sequence_number=next(self._sequence),
            max_new_tokens=max_new,
            generator=make_generator(r.params.seed),
            cache_salt=r.cache_salt,
            deadline=r.deadline,
            group=r.group,
            pin=r.pin,
            pooling=pooling,
        )

    def abort_requests(
        self, request_ids: Iterable[str], groups: Iterable[str] = ()
    ) -> list[str]:
        """Abort in any state, freeing blocks now, and release the pins
        named; ``groups``: every member of these races too. Unknown ids
        are ignored."""
        ids = list(request_ids)
        names = set(groups)
        if names:
            ids += [r for r, q in self.scheduler.requests.items() if q.group in names]
        self.structured.forget(ids)
        aborted = [r.request_id for r in self.scheduler.abort_requests(ids)]
        if self.draft is not None:
            self.draft.release_stopped()
        return aborted

    def close(self) -> None:
        """Stop the grammar compile threads; the core takes no more steps."""
        self.structured.close()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block; return how many were forgotten.

        Safe at any time: running requests keep their blocks (no longer
        shareable), later requests recompute what they need. Pinned
        prefixes stay cached (see :meth:`BlockPool.pin`).
        """
        return self.scheduler.reset_prefix_cache()

    def step(self) -> StepOutput:
        """Schedule and run one batch; return each scheduled request's news."""
        start = time.perf_counter()
        rejected = self._collect_grammars()
        sched = self.scheduler.schedule()
        now = time.monotonic()
        for chunk in sched.chunks:
            if chunk.request.first_scheduled_time is None:
                chunk.request.first_scheduled_time = now
        schedule_s = time.perf_counter() - start
        self.structured.forget([r.request_id for r in sched.expired])
        expired = tuple(
            RequestStepOutput(r.request_id, (), finish_reason="abort")
            for r in sched.expired
        )
        if sched.is_empty:
            return self._step_output(
                expired, sched, start, schedule_s, rejected=rejected
            )
        by_id = {c.request.request_id: c.request for c in sched.chunks}
        ran = self.runner.execute(sched)
        for rid, (first, stop, rows) in ran.pooled.items():
            add_pooled(by_id[rid], first, stop, rows)
        before = {rid: len(by_id[rid].output_token_ids) for rid in ran.sampled}
        finished = {
            r.request_id: r
            for r in self.scheduler.update_from_output(sched, ran.sampled)
        }
        self.steps += 1
        for rid, (first, entries) in ran.prompt_logprobs.items():
            req = by_id[rid]
            if first == len(req.prompt_logprobs) + 1:  # the next ones, in order
                req.prompt_logprobs += entries
        outputs = [
            embedding_output(req)
            for req in finished.values()
            if req.pooling is not None and req.finish_reason == "stop"
        ]
        for rid in ran.sampled:
            fin = finished.get(rid)
            req = by_id[rid]
            # what the scheduler took: up to a stop inside an accepted run
            new = tuple(req.output_token_ids[before[rid] :])
            lp = ran.logprobs.get(rid)
            queue_s = cached = None
            if before[rid] == 0:
                cached = req.num_cached_tokens
                if req.first_scheduled_time is not None:
                    queue_s = req.first_scheduled_time - req.arrival_time
            outputs.append(
                RequestStepOutput(
                    request_id=rid,
                    new_token_ids=new,
                    logprobs=None if lp is None else lp[: len(new)],
                    finish_reason=None if fin is None else fin.finish_reason,
                    stop_reason=None if fin is None else fin.stop_reason,
                    queue_s=queue_s,
                    num_cached_tokens=cached,
                    prompt_logprobs=take_prompt_logprobs(req),
                )
            )
        return self._step_output(
            (*expired, *outputs),
            sched,
            start,
            schedule_s,
            ran.forward_s,
            ran.sample_s,
            rejected=rejected,
        )

    def _collect_grammars(self) -> tuple[RejectedRequest, ...]:
        """Ready grammars to their requests; drop the refused ones.

        When nothing but compiles is pending, wait for one (briefly) rather
        than spin: the callers step back to back while work is unfinished.
        """
        if not self.structured.num_compiling:
            return ()
        s = self.scheduler
        if not s.running and all(r.waiting_for_grammar for r in s.waiting):
            self.structured.wait(GRAMMAR_WAIT_S)
        refused = self.structured.collect()
        s.abort_requests(r.request_id for r in refused)
        return tuple(refused)

    def _step_output(
        self,
        outputs: tuple[RequestStepOutput, ...],
        sched: SchedulerOutput,
        start: float,
        schedule_s: float,
        forward_s: float = 0.0,
        sample_s: float = 0.0,
        *,
        rejected: tuple[RejectedRequest, ...] = (),
    ) -> StepOutput:
        if self.draft is not None:  # every step's exit: whatever ended in it
            self.draft.release_stopped()
        timings = (start, schedule_s, forward_s, sample_s)
        return step_output(self.scheduler, outputs, sched, *timings, rejected=rejected)

    def statistics(self) -> EngineCoreStatistics:
        return EngineCoreStatistics(
            self.scheduler.statistics(), self.max_model_len, self.steps
        )
