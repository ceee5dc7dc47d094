"""The scheduler's side of speculative decoding: which decode chunks take
proposals this step, and how many each request's next ones may be.

:class:`~structllm.core.scheduler.Scheduler` adds proposals once running and
admitted requests have their chunks (so speculation never preempts or delays
a request), from the token budget and the blocks left over
(:func:`add_drafts`), and after each verification sizes the request's next
window by how its proposals fared (:func:`adapt`). The proposals themselves
come from a :class:`~structllm.core.speculative.Proposer`. A structured-output
request proposes the tokens its grammar forces, where it forces some (field
names, punctuation: what no proposer sees coming when the prompt spells them
otherwise), else the proposer's, cut at the first its grammar would refuse,
so no position is verified that the grammar's mask rules out.
"""

from __future__ import annotations

import attrs

from structllm.core.block_pool import BlockPool
from structllm.core.request import Request
from structllm.core.scheduler_types import ScheduledChunk, SchedulerConfig
from structllm.core.speculative import Proposer

__all__ = ["MAX_SPEC_SKIP", "adapt", "add_drafts", "speculating"]


def speculating(config: SchedulerConfig, num_running: int) -> bool:
    """Whether this step speculates: proposals asked for, and at most
    ``disable_by_batch_size`` requests running."""
    limit = config.disable_by_batch_size
    return config.num_speculative_tokens > 0 and (limit is None or num_running <= limit)


def add_drafts(
    chunks: list[ScheduledChunk],
    budget: int,
    pool: BlockPool,
    proposer: Proposer,
    num_speculative_tokens: int,
) -> None:
    """Give decode chunks proposals, in order, from what is left over."""
    bs = pool.block_size
    for i, chunk in enumerate(chunks):
        req = chunk.request
        if budget <= 0:
            return
        if (
            chunk.num_tokens != 1
            or not chunk.samples
            or (req.params.structured_outputs is not None and req.grammar is None)
            or req.needs_prompt_logits
            or req.pooling is not None
        ):
            continue
        drafts = _propose(req, budget, proposer, num_speculative_tokens)
        # positions context_len + 1 ... in blocks already held or free
        held = (len(req.block_ids) + pool.num_free) * bs
        drafts = drafts[: max(0, held - chunk.context_len - 1)]
        if not drafts:
            continue
        need = pool.blocks_for(chunk.context_len + 1 + len(drafts))
        req.block_ids += pool.allocate(need - len(req.block_ids))
        chunks[i] = attrs.evolve(
            chunk, num_tokens=1 + len(drafts), draft_token_ids=drafts
        )
        budget -= len(drafts)


def _propose(
    req: Request, budget: int, proposer: Proposer, num_speculative_tokens: int
) -> tuple[int, ...]:
    """``req``'s proposals this step, within ``budget`` tokens.

    A constrained request proposes the tokens its grammar forces, if any:
    near-certain, so even while backing off and up to the configured
    number. Otherwise the proposer's, in the adapted window, cut at the
    first the grammar refuses.
    """
    # every accepted token and the one after them must be allowed
    room = min(req.max_new_tokens - len(req.output_token_ids) - 1, budget)
    grammar = req.grammar
    if grammar is not None and room > 0:
        forced = grammar.forced_tokens()[: min(num_speculative_tokens, room)]
        if forced:
            return tuple(forced[: grammar.validate_tokens(forced)])
    if req.spec_skip > 0:  # backing off after proposals that failed
        req.spec_skip -= 1
        return ()
    k = min(req.spec_window or num_speculative_tokens, room)
    if k <= 0:
        return ()
    drafts = tuple(proposer.propose(req, k))[:k]
    if grammar is not None:  # none past the first the grammar refuses
        drafts = drafts[: grammar.validate_tokens(drafts)]
    return drafts


#: the longest back-off, in decode steps, after proposals accepted nothing
MAX_SPEC_SKIP = 16


def adapt(req: Request, accepted: int, proposed: int, most: int) -> None:
    """Size ``req``'s next proposals by how its last ones fared.

    A verification step costs more than a plain decode step (every query
    position past the first, and on CPUs the jump from the one-token path),
    so proposals that keep failing are costly: all accepted, propose twice
    as many next; some, one more than were accepted; none, propose nothing
    for 1, 2, 4 ... (at most :data:`MAX_SPEC_SKIP`) decode steps.
    """
    if accepted == 0:
        req.spec_misses += 1
        req.spec_skip = min(MAX_SPEC_SKIP, 2 ** (req.spec_misses - 1))
        req.spec_window = max(1, proposed // 2)
        return
    req.spec_misses = 0
    req.spec_window = min(most, 2 * proposed if accepted == proposed else accepted + 1)
