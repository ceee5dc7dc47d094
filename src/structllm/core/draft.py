"""A draft model's proposals: speculative decoding's ``"draft_model"`` method.

A smaller model with the target's tokenizer guesses, greedily, the tokens
the target will generate; the scheduler verifies them like any proposal
(:mod:`structllm.core.speculative`), so the output is the target's whatever
the draft says: a bad draft costs time, never a different token.

The draft runs here, in the core, beside the target: same thread, same
step, before the target's forward (the scheduler asks for proposals while it
builds the step). It has its own paged KV cache and :class:`BlockPool`, so
it reuses the model layer's forward and attention unchanged (a contiguous
per-request cache would need a second attention path in every model); the
pool is small, :func:`draft_cache_sequences` full sequences, and a request
that needs room evicts the least recently proposing one, which catches up
when it next proposes.

Per request, :meth:`DraftProposer.propose`:

1. keeps the cached prefix that is still the request's: every token it held
   the last time (its prompt and outputs then) and those of its own
   proposals that the target accepted (the tokens that followed equal them);
   the blocks past that are the rejected proposals' and are reused;
2. catches up on the tokens it has not seen (the first time: the prompt;
   then the accepted proposals and the target's token after them) in one
   forward, and takes the argmax at the last position;
3. runs each guess through the draft to guess the next, ``k`` in all.

So the rollback to the accepted length after a verification needs no call:
the next proposal finds it. :meth:`DraftProposer.warm_up` (at load) runs
one catch-up and the guesses after it on scratch blocks, as the target's
load warm-up runs a short request, so the first real proposal builds no
kernels. The engine core calls
:meth:`DraftProposer.release_stopped` after every step and abort, which
frees the state of every request that is no longer running (finished,
aborted, expired, preempted: a preempted request catches up again later).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs
import numpy as np

from structllm.core.block_pool import BlockPool
from structllm.core.request import Request, RequestStatus
from structllm.core.runner import ModelInput, run_forward
from structllm.errors import EngineConfigError
from structllm.model.protocol import CausalLM
from structllm.text.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from structllm.config import EngineConfig
    from structllm.model.loader import LoadProgress

__all__ = [
    "DRAFT_FIELD",
    "DraftProposer",
    "check_same_tokenizer",
    "draft_cache_sequences",
    "load_draft_proposer",
]

#: the setting a draft refusal names
DRAFT_FIELD = "speculative_config.model"

#: ids compared between the two tokenizers, spread evenly over the vocabulary
#: (plus every special id of the target's)
TOKENIZER_SAMPLE_IDS = 256

#: the catch-up forward's length in :meth:`DraftProposer.warm_up`: the
#: target's load warm-up prompt (engine/core_process/loop.py)
WARM_UP_TOKENS = 8

#: text both tokenizers must encode to the same ids
TOKENIZER_SAMPLE_TEXT = (
    "Hello, world! The quick brown fox jumps over 13 lazy dogs.\n"
    "def add(a, b):\n    return a + b  # ünïcödé, 日本語, emoji 🙂\n"
)


def draft_cache_sequences(max_num_seqs: int, disable_by_batch_size: int | None) -> int:
    """Full sequences the draft's cache holds: as many as may speculate at
    once (``disable_by_batch_size``), at most 4 when nothing bounds it
    (more requests share it, the least recent making room)."""
    return max(1, min(max_num_seqs, disable_by_batch_size or 4))


@attrs.define(eq=False)
class _DraftSequence:
    """One request's slice of the draft's cache."""

    request: Request
    block_ids: list[int] = attrs.Factory(list)
    #: leading tokens of the request (prompt + outputs) whose keys and
    #: values the cache holds, as of the last proposal
    num_seen: int = 0
    #: the proposals written after them (all but the last proposed)
    written: list[int] = attrs.Factory(list)


class DraftProposer:
    """Greedy proposals of ``model`` over its own paged KV cache.

    ``max_len``: the longest sequence it computes (the engine's
    ``max_model_len``, or the draft's context if shorter): past it, it
    proposes nothing. ``vocab_size``: the target's; the draft proposes
    only ids below it (a model's vocabulary may be padded).
    ``max_chunk``: the most tokens one catch-up forward takes.
    """

    def __init__(
        self,
        model: CausalLM,
        *,
        num_blocks: int,
        block_size: int,
        max_len: int,
        vocab_size: int,
        max_chunk: int,
    ) -> None:
        self.model = model
        self.pool = BlockPool(num_blocks, block_size)
        self.kv_caches = model.allocate_kv_cache(num_blocks)
        self.max_len = max_len
        self.vocab_size = vocab_size
        self.max_chunk = max(1, max_chunk)
        #: by request id, least recently proposing first
        self._seqs: OrderedDict[str, _DraftSequence] = OrderedDict()
        #: forwards run, tokens they computed (catch-up and guesses), and
        #: requests' caches dropped to make room for another's
        self.num_forwards = 0
        self.num_tokens = 0
        self.num_evictions = 0

    @property
    def num_requests(self) -> int:
        """Requests whose tokens the draft's cache holds."""
        return len(self._seqs)

    def propose(self, request: Request, k: int) -> list[int]:
        """Up to ``k`` greedy guesses to follow ``request``'s tokens."""
        tokens = [*request.prompt_token_ids, *request.output_token_ids]  # (L,)
        size = len(tokens)
        # the last guess is read at position size + k - 2
        k = min(k, self.max_len - size + 1)
        if k < 1:
            return []
        seq = self._seqs.get(request.request_id)
        if seq is None or seq.request is not request:
            if seq is not None:  # an id reused before the sweep: start over
                self.release(request.request_id)
            seq = self._seqs[request.request_id] = _DraftSequence(request)
        self._seqs.move_to_end(request.request_id)
        # the cache's prefix that is still this request's: its tokens of
        # last time, and the guesses the target accepted since
        seen = seq.num_seen
        for guess, token in zip(seq.written, tokens[seen:], strict=False):
            if guess != token:
                break
            seen += 1
        seen = min(seen, size - 1)  # the last token's logits are needed
        if not self._hold(seq, size + k - 1):
            self.release(request.request_id)
            return []
        seq.num_seen, seq.written = seen, []  # true at every point below
        drafts: list[int] = []
        for start in range(seen, size, self.max_chunk):  # catch up
            stop = min(size, start + self.max_chunk)
            guess = self._forward(seq.block_ids, tokens[start:stop], start)
            seq.num_seen = stop
        drafts.append(guess)
        while len(drafts) < k:  # each guess through the draft, for the next
            guess = self._forward(seq.block_ids, drafts[-1:], size + len(drafts) - 1)
            seq.written.append(drafts[-1])
            drafts.append(guess)
        return drafts

    def warm_up(self, k: int) -> None:
        """A proposal's forwards on scratch blocks, then freed: a catch-up of
        :data:`WARM_UP_TOKENS` and ``k - 1`` guesses after it, so that the
        first real proposal builds no kernels (the first forward of a shape
        costs several times a later one). Leaves the counts at 0."""
        n = max(1, min(WARM_UP_TOKENS, self.max_len - k, self.max_chunk))
        need = self.pool.blocks_for(n + k - 1)
        if need > self.pool.num_free:  # a pool too small to propose at all
            return
        blocks = self.pool.allocate(need)
        try:
            guess = self._forward(blocks, [0] * n, 0)
            for i in range(k - 1):
                guess = self._forward(blocks, [guess], n + i)
        finally:
            self.pool.free(reversed(blocks))
        self.num_forwards = self.num_tokens = 0

    def release(self, request_id: str) -> None:
        """Forget ``request_id``'s cache (no-op if it holds none)."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.pool.free(reversed(seq.block_ids))

    def release_stopped(self) -> None:
        """Forget every request that is no longer running: finished, aborted,
        expired or preempted (the engine core calls this after each step and
        each abort)."""
        stopped = [
            rid
            for rid, seq in self._seqs.items()
            if seq.request.status is not RequestStatus.RUNNING
        ]
        for rid in stopped:
            self.release(rid)

    def _hold(self, seq: _DraftSequence, num_tokens: int) -> bool:
        """Give ``seq`` exactly the blocks for ``num_tokens`` positions,
        evicting the least recently proposing requests if need be; False
        when even the whole pool is too small."""
        pool = self.pool
        need = pool.blocks_for(num_tokens)
        if need < len(seq.block_ids):
            pool.free(reversed(seq.block_ids[need:]))
            del seq.block_ids[need:]
        more = need - len(seq.block_ids)
        if more > pool.num_blocks - len(seq.block_ids):
            return False
        while more > pool.num_free:
            victim = next(iter(self._seqs))  # seq itself is the most recent
            self.release(victim)
            self.num_evictions += 1
        seq.block_ids += pool.allocate(more)
        return True

    def _forward(self, block_ids: list[int], tokens: Sequence[int], start: int) -> int:
        """Compute ``tokens`` at positions ``start`` on, into the cache's
        ``block_ids``; return the argmax after the last."""
        n = len(tokens)
        step = ModelInput(
            np.asarray(tokens, dtype=np.int64).tobytes(),
            np.arange(start, start + n, dtype=np.int64).tobytes(),
            ((start, n, tuple(block_ids)),),
        )
        hidden = run_forward(self.model, self.kv_caches, step)  # (n, H)
        logits = self.model.compute_logits(hidden[n - 1 :]).numpy()  # (1, V)
        self.num_forwards += 1
        self.num_tokens += n
        return int(np.argmax(logits[0, : self.vocab_size]))


def check_same_tokenizer(target: Tokenizer, draft: Tokenizer, draft_ref: str) -> None:
    """Refuse, naming ``speculative_config.model``, a draft whose tokenizer
    is not the target's: the same vocabulary size, the same pieces for a
    sample of ids spread over it and for every special id, the same BOS,
    and the same ids for a sample text."""

    def refuse(what: str) -> EngineConfigError:
        return EngineConfigError(
            f"{DRAFT_FIELD}: the draft model {draft_ref!r} does not share the "
            f"target's tokenizer ({what})",
            field=DRAFT_FIELD,
        )

    size = target.vocab_size
    if draft.vocab_size != size:
        raise refuse(f"vocabulary of {draft.vocab_size} tokens, not {size}")
    if draft.bos_token_id != target.bos_token_id:
        raise refuse(f"BOS id {draft.bos_token_id}, not {target.bos_token_id}")
    stride = max(1, size // TOKENIZER_SAMPLE_IDS)
    ids = sorted({*range(0, size, stride), size - 1, *target.all_special_ids})
    for i in ids:
        if draft.id_to_piece(i) != target.id_to_piece(i):
            raise refuse(
                f"id {i} is {draft.id_to_piece(i)!r}, not {target.id_to_piece(i)!r}"
            )
    text = TOKENIZER_SAMPLE_TEXT
    if draft.encode(text, add_special_tokens=False) != target.encode(
        text, add_special_tokens=False
    ):
        raise refuse("a sample text encodes to other ids")


def load_draft_proposer(
    config: EngineConfig,
    *,
    max_model_len: int,
    vocab_size: int,
    tokenizer: Tokenizer | str | None = None,
    on_progress: Callable[[LoadProgress], None] | None = None,
) -> DraftProposer:
    """The draft model of ``config.speculative_config``, its tokenizer
    checked against the target's (``tokenizer``, an object or a path;
    default: ``config.model``'s), with a cache for
    :func:`draft_cache_sequences` sequences of ``max_model_len`` tokens,
    warmed up (:meth:`DraftProposer.warm_up`). The draft's load progress is
    reported as the stage ``"draft weights"``."""
    from structllm.model.loader import LoadProgress, load_model

    spec = config.speculative_config
    assert spec is not None and spec.model is not None
    ref = spec.model
    if not isinstance(tokenizer, Tokenizer):
        tokenizer = load_tokenizer(tokenizer or config.model)
    check_same_tokenizer(tokenizer, load_tokenizer(ref), ref)

    def progress(event: LoadProgress) -> None:
        if on_progress is not None:
            on_progress(LoadProgress(f"draft {event.stage}", event.done, event.total))

    loaded = load_model(
        ref,
        dtype=config.dtype,
        block_size=config.block_size,
        max_model_len=max_model_len,
        seed=config.seed,
        backend=config.model_backend,
        num_threads=config.cpu_threads(),
        on_progress=progress,
    )
    loaded.model.set_kv_cache_dtype(config.kv_cache_dtype)
    max_len = min(max_model_len, loaded.config.max_context_len)
    per_seq = -(-max_len // config.block_size)
    seqs = draft_cache_sequences(config.max_num_seqs, spec.disable_by_batch_size)
    proposer = DraftProposer(
        loaded.model,
        num_blocks=per_seq * seqs,
        block_size=config.block_size,
        max_len=max_len,
        vocab_size=min(vocab_size, loaded.config.vocab_size),
        max_chunk=config.max_num_batched_tokens,
    )
    proposer.warm_up(spec.num_speculative_tokens)
    return proposer
