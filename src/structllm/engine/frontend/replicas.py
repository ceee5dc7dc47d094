"""Data parallelism: ``data_parallel_size`` engine cores behind one front end.

:class:`ReplicaSet` holds one :class:`~structllm.engine.frontend.core_client.CoreClient`
per replica (each its own core process, supervised and restarted on its
own) and shows ``AsyncLLM`` the surface of one engine, so the front end has
a single code path whatever the size (1 by default). It is also the one
relay of the cores' events (:class:`~structllm.engine.frontend.core_client.Relay`):
a client hands it each step output tagged with its replica, and the set
delivers it to the :class:`~structllm.engine.frontend.output_processor.OutputProcessor`
(which fills each request's mailbox), sends the aborts that returns, and
keeps its books.

- **Routing.** A new request goes where
  :class:`~structllm.engine.frontend.routing.PrefixRouter` ranks it first: the
  ready replica holding the longest prefix of its prompt, within a bound
  on its extra load, else the least-loaded (see
  :mod:`structllm.engine.frontend.routing`). The load is the set's own count of
  live requests placed on each replica.
- **Placement.** The set remembers which replica each core request id lives
  on, routes its aborts there, and forgets it when the request ends: the
  core finishes it, refuses it, or the front end aborts it (a stop string,
  a failure, a release). An abort for an id already forgotten (the front
  end re-aborting an id a step still carried) goes to every replica; core
  ids are unique per submission, so it cannot touch another request.
- **Failure.** When replica k's core dies, only the requests placed on k
  fail (EngineDeadError); k restarts under its own ``max_restarts`` budget
  while the others serve on. The engine admits while any replica is ready
  and is dead only when every replica is dead for good; admission
  (``check_admitting``, ``wait_ready``, shutdown) is decided here alone.
- **Statistics.** Counts are summed over replicas; ``replicas`` carries each
  one's own snapshot (its pid, its live requests).
"""

from __future__ import annotations

import anyio
import anyio.abc
import attrs

from structllm.config import EngineConfig, FrontendConfig
from structllm.core.block_pool import BlockHash
from structllm.core.request import CoreRequest, StepOutput
from structllm.engine.frontend.core_client import CoreClient
from structllm.engine.frontend.core_connection import encode_request
from structllm.engine.frontend.output_processor import OutputProcessor
from structllm.engine.frontend.routing import PrefixRouter, affinity_slack
from structllm.engine.protocol import (
    AbortRequests,
    AddFailed,
    AddLoRA,
    CoreState,
    LoRAAdded,
    LoRARemoved,
    Message,
    Ready,
    RemoveLoRA,
)
from structllm.engine.statistics import EngineStatistics
from structllm.errors import (
    EngineConfigError,
    EngineDeadError,
    InvalidRequestError,
    dead_error,
    unwrap_group,
)
from structllm.lora_request import LoRARequest

__all__ = [
    "ReplicaSet",
    "replica_config",
]


def replica_config(engine: EngineConfig, replicas: int) -> EngineConfig:
    """``engine`` for one of ``replicas`` cores: unless ``num_threads`` is set,
    each rank of each replica gets its share of this machine's cores."""
    if replicas == 1 or engine.num_threads is not None:
        return engine
    return attrs.evolve(engine, num_threads=engine.cpu_threads(replicas))


@attrs.define(eq=False)
class ReplicaSet:
    """N supervised engine cores seen as one; see the module docstring."""

    engine_config: EngineConfig
    config: FrontendConfig
    #: the live requests, whose mailboxes the step outputs fill
    processor: OutputProcessor
    clients: list[CoreClient] = attrs.field(init=False)
    #: core request id -> the index of the replica it was submitted to
    placement: dict[str, int] = attrs.Factory(dict)
    #: live requests placed on each replica
    load: list[int] = attrs.field(init=False)
    #: pin (its core id) -> the replica that holds it
    pins: dict[str, int] = attrs.Factory(dict)
    router: PrefixRouter = attrs.field(init=False)
    closing: bool = False
    #: what waiters of a change wait on; made by the first of them (a step
    #: that nobody waits on costs no event)
    _changed: anyio.Event | None = None
    #: set once every replica is dead for good (a wait that no step wakes)
    _dead: anyio.Event = attrs.Factory(anyio.Event)

    def __attrs_post_init__(self) -> None:
        n = self.config.data_parallel_size
        if n > 1 and self.engine_config.tensor_parallel_listen is not None:
            raise EngineConfigError(
                "tensor_parallel_listen is one address for one group of ranks: "
                f"it cannot serve data_parallel_size={n} replicas",
                field="tensor_parallel_listen",
            )
        engine = replica_config(self.engine_config, n)
        self.clients = [CoreClient(engine, self.config, self, k) for k in range(n)]
        self.load = [0] * n
        self.router = PrefixRouter(
            engine.block_size, affinity_slack(engine.max_num_seqs)
        )

    # --------------------------------------------------------------- state

    @property
    def ready(self) -> bool:
        """Some replica is up and accepts requests."""
        return any(c.ready for c in self.clients)

    @property
    def info(self) -> Ready | None:
        """A replica's handshake (every replica runs the same model)."""
        ready = [c.info for c in self.clients if c.ready and c.info is not None]
        known = ready or [c.info for c in self.clients if c.info is not None]
        return known[0] if known else None

    @property
    def dead(self) -> EngineDeadError | None:
        """Set once every replica is dead for good (the last replica's error)."""
        if all(c.dead is not None for c in self.clients):
            return self.clients[-1].dead
        return None

    @property
    def max_num_seqs(self) -> int:
        """Sequences one step of every replica runs: admission's queue starts
        beyond them (``max_queued_requests`` counts the whole engine's)."""
        return self.engine_config.max_num_seqs * len(self.clients)

    def new_dead_error(self) -> EngineDeadError:
        dead = self.dead
        assert dead is not None
        err = EngineDeadError(str(dead))
        err.__cause__ = dead.__cause__
        return err

    def check_admitting(self) -> None:
        if self.dead is not None:
            raise self.new_dead_error()
        if self.closing:
            raise EngineDeadError("the engine is shutting down")

    async def wait_ready(self, client: CoreClient | None = None) -> None:
        """Wait for a ready replica (or for ``client`` to be up); raise
        EngineDeadError if none will come (or ``client`` died for good)."""
        while not (self.ready if client is None else client.ready):
            self.check_admitting()
            if client is not None and client.dead is not None:
                raise dead_error("the engine core of this replica is dead", client.dead)
            await self.wait_changed()

    async def wait_changed(self) -> None:
        """Wait until a replica's readiness, liveness or counts change."""
        if self._changed is None:
            self._changed = anyio.Event()
        await self._changed.wait()

    async def wait_dead(self) -> None:
        """Wait until every replica is dead for good.

        Not a loop on :meth:`wait_changed`, which every step wakes: a
        server's watch on the engine would cost a wake-up and a snapshot a
        token.
        """
        await self._dead.wait()

    # ------------------------------------------------------ Relay (clients)

    def on_change(self) -> None:
        """A replica's readiness, liveness or counts changed."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None
        if self.dead is not None:
            self._dead.set()

    def on_step(self, replica: int, step: StepOutput) -> None:
        for no in step.rejected:  # a grammar only the core could refuse
            self.on_add_failed(replica, AddFailed(no.request_id, no.message, no.field))
        processed = self.processor.process_outputs(step.outputs)
        if processed.to_abort:
            self.send_nowait(AbortRequests(processed.to_abort))
        for out in step.outputs:
            if out.finish_reason is not None:
                self.forget(out.request_id)

    def on_add_failed(self, replica: int, msg: AddFailed) -> None:
        state = self.processor.pop(msg.request_id)
        if state is not None:
            state.mailbox.close(InvalidRequestError(msg.message, field=msg.field))
        self.forget(msg.request_id)

    def on_core_lost(self, replica: int, cause: BaseException) -> None:
        lost = [rid for rid, k in self.placement.items() if k == replica]
        for rid in lost:
            self.forget(rid)
        for pin in [p for p, k in self.pins.items() if k == replica]:
            del self.pins[pin]  # the core that held it is gone
        self.router.forget_replica(replica)
        what = "the engine core died"
        if len(self.clients) > 1:
            what = f"the engine core of replica {replica} died"
        self.processor.fail(lost, lambda: dead_error(what, cause))

    # ------------------------------------------------------------- senders

    def submit_nowait(self, request: CoreRequest) -> None:
        """Send ``request`` to the replica the router picks for its prompt
        (see the module docstring).

        Encoded here, before it is queued: a value the wire cannot carry
        fails this request (InvalidRequestError), never the writer that all
        share. EngineDeadError if no replica takes it (all restarting, or
        the chosen ones died a moment ago and their teardown has not run
        yet).
        """
        frame = encode_request(request)
        core_id = request.request_id
        hashes: list[BlockHash] = []
        if len(self.clients) > 1 and self.engine_config.enable_prefix_caching:
            lora = request.lora_request
            hashes = self.router.prefix_hashes(
                request.prompt_token_ids,
                request.cache_salt,
                0 if lora is None else lora.lora_int_id,
            )
        ready = [c.ready for c in self.clients]
        order = self.router.order(hashes, self.load, ready)
        error = EngineDeadError("the engine core is restarting")
        for k in order:
            try:
                self.clients[k].submit_nowait(frame)
            except EngineDeadError as exc:
                error = exc
                continue
            self.placement[core_id] = k
            self.load[k] += 1
            self.router.record(hashes, k)
            if request.pin:
                self.pins[core_id] = k
                self.router.pin(core_id, hashes, k)
            return
        raise error

    def abort_group_nowait(self, group: str, core_ids: list[str]) -> None:
        """End the race ``group``, whose live members are ``core_ids``: one
        message to each replica that holds one (to all, if none is known)."""
        places = {self.forget(rid) for rid in core_ids}
        targets = range(len(self.clients)) if None in places else places
        for k in sorted(k for k in targets if k is not None):
            self.clients[k].send_nowait(AbortRequests([], groups=[group]))

    def unpin_nowait(self, core_id: str) -> None:
        """Release the pin ``core_id`` (or abort its prefill) where it lives."""
        self.router.unpin(core_id)
        k = self.pins.pop(core_id, None)
        self.forget(core_id)  # still prefilling: no longer placed
        if k is None:  # its core is gone: any replica's abort is harmless
            self.send_nowait(AbortRequests([core_id]))
        else:
            self.clients[k].send_nowait(AbortRequests([core_id]))

    def send_nowait(self, msg: Message) -> None:
        """Aborts go where their requests live; other messages go to all."""
        if not isinstance(msg, AbortRequests):
            for client in self.clients:
                client.send_nowait(msg)
            return
        routed: list[list[str]] = [[] for _ in self.clients]
        for rid in msg.request_ids:
            k = self.forget(rid)
            for target in range(len(self.clients)) if k is None else [k]:
                routed[target].append(rid)
        for client, ids in zip(self.clients, routed, strict=True):
            if ids:
                client.send_nowait(AbortRequests(ids))

    def forget(self, core_id: str) -> int | None:
        """``core_id`` ended: drop its placement; return where it was."""
        k = self.placement.pop(core_id, None)
        if k is not None:
            self.load[k] -= 1
        return k

    def begin_shutdown(self) -> None:
        """Admit nothing more; wake submitters waiting for a restart."""
        self.closing = True
        self.on_change()

    def send_shutdown(self) -> None:
        for client in self.clients:
            client.send_shutdown()
        # the front end failed whatever was left: nothing lives anywhere now
        self.placement.clear()
        self.load = [0] * len(self.clients)

    async def reset_prefix_cache(self) -> int:
        """Reset every living replica's prefix cache; the blocks dropped in all."""
        await self.wait_ready()
        self.router.clear()
        total = 0
        for client in self.clients:
            if client.dead is None:
                await self.wait_ready(client)
                total += await client.reset_prefix_cache()
        return total

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Every living replica reads the adapter; True when one had not
        (a replica restarted later reads it again on its first request)."""
        await self.wait_ready()
        added = False
        for client in self.clients:
            if client.dead is None:
                await self.wait_ready(client)
                answer = await client.ask(AddLoRA(lora_request))
                assert isinstance(answer, LoRAAdded)
                added |= answer.result()
        return added

    async def remove_lora(self, lora_id: int) -> bool:
        """Unload the adapter from every living replica; True when one had it."""
        await self.wait_ready()
        removed = False
        for client in self.clients:
            if client.dead is None:
                await self.wait_ready(client)
                answer = await client.ask(RemoveLoRA(lora_id))
                assert isinstance(answer, LoRARemoved)
                removed |= answer.removed
        return removed

    async def inspect(self) -> tuple[CoreState | None, ...]:
        """Each replica's core record (None for one dead for good).

        Every running replica is asked at once, before any answer is awaited,
        so each question follows exactly the messages sent before the call;
        one restarting is waited for and asked then.
        """
        await self.wait_ready()
        asked = [c.inspect_nowait() if c.ready else None for c in self.clients]
        states: list[CoreState | None] = []
        for client, question in zip(self.clients, asked, strict=True):
            if client.dead is not None:
                states.append(None)
            elif question is None:
                await self.wait_ready(client)
                states.append(await client.inspect_nowait().wait_state())
            else:
                states.append(await question.wait_state())
        return tuple(states)

    def statistics(self, *, live_requests: int) -> EngineStatistics:
        """Counts summed over replicas; each replica's own in ``replicas``."""
        each = tuple(
            c.statistics(live_requests=n)
            for c, n in zip(self.clients, self.load, strict=True)
        )
        if len(each) == 1:
            return attrs.evolve(each[0], live_requests=live_requests, replicas=each)
        silences = [s.silent_for for s in each if s.silent_for is not None]
        first = each[0]
        return EngineStatistics(
            live_requests=live_requests,
            running=sum(s.running for s in each),
            waiting=sum(s.waiting for s in each),
            blocks_used=sum(s.blocks_used for s in each),
            num_blocks=sum(s.num_blocks for s in each),
            kv_cache_bytes=sum(s.kv_cache_bytes for s in each),
            core_peak_rss_bytes=sum(s.core_peak_rss_bytes for s in each),
            total_preemptions=sum(s.total_preemptions for s in each),
            restarts=sum(s.restarts for s in each),
            ready=any(s.ready for s in each),
            dead=all(s.dead for s in each),
            core_pid=first.core_pid,
            silent_for=min(silences) if silences else None,
            healthy=any(s.healthy for s in each),
            prefix_cache_queries=sum(s.prefix_cache_queries for s in each),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in each),
            spec_decode_num_drafts=sum(s.spec_decode_num_drafts for s in each),
            spec_decode_num_draft_tokens=sum(
                s.spec_decode_num_draft_tokens for s in each
            ),
            spec_decode_num_accepted_tokens=sum(
                s.spec_decode_num_accepted_tokens for s in each
            ),
            deadline_expired_requests=sum(s.deadline_expired_requests for s in each),
            deadline_skipped_tokens=sum(s.deadline_skipped_tokens for s in each),
            replicas=each,
        )

    # ---------------------------------------------------------- supervisor

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Run every replica's supervisor; ``started()`` once all are up.

        The replicas start together (a model loads N times in parallel); the
        first startup failure stops the others and raises unwrapped, as one
        client's would. Returns when every supervisor has returned.
        """
        failures: list[Exception] = []
        try:
            async with anyio.create_task_group() as tg:

                async def start(client: CoreClient) -> None:
                    try:
                        await tg.start(client.run)
                    except Exception as exc:
                        failures.append(exc)
                        tg.cancel_scope.cancel()

                async with anyio.create_task_group() as starting:
                    for client in self.clients:
                        starting.start_soon(start, client)
                if not failures:  # trio need not deliver the cancellation here
                    task_status.started()
        except BaseExceptionGroup as group:
            # one supervisor's own failure comes out as one client's would
            exc = unwrap_group(group, sole=True)
            if exc is group:
                raise
            exc.__suppress_context__ = True  # keeps its own __cause__
            raise exc  # noqa: B904 - the group is only a wrapper here
        if failures:
            raise failures[0]
