"""The batched sampler: one token per row from a batch of logits.

Works on numpy ``float32`` logits already copied off the device; no Paddle.
Per step, for every row (vLLM-compatible semantics):

1. logprobs, if asked for, from ``log_softmax`` of the *raw* logits;
   then the grammar bitmask of constrained rows (structured output): every
   token the row's grammar forbids to ``-inf``, before anything below;
2. ``allowed_token_ids`` (every other token to ``-inf``), then ``logit_bias``
   added to the logits;
3. penalties: repetition (HF-style, over prompt + output tokens), then
   frequency and presence (OpenAI-style, over output tokens);
4. while ``len(output_token_ids) < min_tokens``, EOS and stop token ids are
   set to ``-inf``;
5. greedy rows take the argmax (ties to the lowest id) and draw nothing;
6. other rows divide by the temperature, keep the top-k, then the nucleus
   (top-p), then drop tokens under ``min_p * max_prob``, and choose by inverse
   CDF with exactly one uniform from the row's own generator.

Step 5 uses a deterministic order: rows without top-k / top-p walk the CDF
in token-id order; rows with them walk it in the order (probability
descending, id ascending) that also defines which tokens top-k and top-p
keep. Every row's result depends only on its own logits, parameters and
generator, so a seeded request gives the same tokens whatever else is in its
batch.

Speculative decoding (:meth:`Sampler.verify`): a request that proposed
``k`` tokens has ``k + 1`` rows of logits, the positions of its newest token
and of each proposal. Row ``j`` is sampled exactly as above, as if the
first ``j`` proposals had been generated (penalties and ``min_tokens`` see
them), with the ``j``-th next uniform of the request's generator; proposal
``j`` is accepted while it equals the token so sampled, and the request
takes the sampled tokens up to the first mismatch, that one included (all
``k + 1`` if every proposal is accepted), then its generator is left as if
it had drawn one uniform per token taken. Every token taken is therefore
the one the same request would sample without speculation: greedy rows
give the same tokens, and seeded rows too. For a proposer that is
deterministic (its proposal ``x`` a point mass) this is rejection sampling:
``x`` is accepted with probability ``p(x)``, and a rejected row's token is
distributed as ``p`` without ``x``, renormalised, so the output follows the
target distribution exactly. A constrained request has a grammar mask per
row, its grammar's state after the first ``j`` proposals, so row ``j`` is
the masked distribution it would sample without speculation.

A row that every token is masked out of (``allowed_token_ids`` disjoint
from what its grammar allows, say) takes the argmax of its grammar-masked
logits, or of the raw ones if it has no grammar: a constrained row never
samples a token its grammar forbids.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt

from structllm.model.logits import process_logits
from structllm.model.logprobs import TokenLogprobs
from structllm.params import SamplingParams
from structllm.structured.bitmask import apply_bitmask

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingRow",
    "TokenLogprobs",
    "VerifiedOutput",
    "make_generator",
    "process_logits",
    "token_logprobs",
]

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
Bool = npt.NDArray[np.bool_]

#: CDF block width for rows sampled in id order (two-level inverse CDF).
_BLOCK = 256
_LOW32 = np.int64(0xFFFFFFFF)


def make_generator(seed: int | None) -> np.random.Generator:
    """A request's generator: seeded from ``seed``, or from OS entropy if None.

    Seeds are taken modulo 2**64, so negative seeds work as their two's
    complement (``-1`` and ``2**64 - 1`` give the same stream).
    """
    if seed is None:
        return np.random.default_rng()
    return np.random.default_rng(seed % 2**64)


@attrs.frozen
class SamplingRow:
    """One request's row in the batch.

    ``generator`` belongs to the request and is advanced only by its draws.
    ``eos_token_ids`` (with ``params.stop_token_ids``) are masked while fewer
    than ``params.min_tokens`` tokens were generated; ``ignore_eos`` is the
    caller's business.
    """

    params: SamplingParams
    generator: np.random.Generator
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    eos_token_ids: frozenset[int] = frozenset()


@attrs.frozen
class SamplerOutput:
    """One step's result for a batch of N rows."""

    token_ids: I64  # (N,)
    #: per row; None where ``params.logprobs`` is None
    logprobs: list[TokenLogprobs | None]


@attrs.frozen
class VerifiedOutput:
    """One step's result for a batch of requests with proposals."""

    #: per request: the accepted proposals, then the model's own token
    token_ids: list[tuple[int, ...]]
    #: per request, one per token; None where ``params.logprobs`` is None
    logprobs: list[tuple[TokenLogprobs, ...] | None]


@attrs.frozen
class Sampler:
    """Samples one token per row; stateless apart from a tuning knob.

    ``candidates`` is how many of the most likely tokens are sorted first for
    top-p rows; a row whose nucleus is wider is re-sorted over the whole
    vocabulary. It changes speed only, never the result.
    """

    candidates: int = attrs.field(default=1024, validator=attrs.validators.ge(1))

    def sample(
        self,
        logits: npt.ArrayLike,
        rows: Sequence[SamplingRow],
        *,
        bitmask: npt.NDArray[np.int32] | None = None,
        bitmask_rows: Sequence[int] | None = None,
        overwrite: bool = False,
    ) -> SamplerOutput:
        """Choose one token per row of ``logits`` (N, V).

        ``bitmask`` (K, ceil(V / 32)) int32 constrains rows ``bitmask_rows``
        (K distinct row indices; all N rows in order when None) to the
        tokens whose bits are set (:mod:`structllm.structured.bitmask`); a
        row of the bitmask with no bit set (a broken matcher) is ignored.
        With ``overwrite`` the caller gives up ``logits`` (its own float32
        copy), and the mask goes into it unless a row asks for logprobs
        (which come from the raw logits): a fresh (N, V) array costs more
        in page faults than the copy itself (5 ms at 16 x 152k).
        """
        raw, best = _checked_argmax(logits, len(rows))  # (N, V) float32, (N,)
        wants_logprobs = any(r.params.logprobs is not None for r in rows)
        n = raw.shape[0]
        base = raw  # the raw logits, grammar-masked where a row has a grammar
        if bitmask is not None:
            masked = list(range(len(rows)) if bitmask_rows is None else bitmask_rows)
            live: Bool = np.count_nonzero(bitmask[: len(masked)], axis=1) > 0
            if not live.all():
                bitmask = bitmask[: len(masked)][live]
                masked = [
                    r for r, keep in zip(masked, live.tolist(), strict=True) if keep
                ]
            keep_raw = not overwrite or wants_logprobs
            base = raw.copy() if keep_raw else raw
            apply_bitmask(base, bitmask, masked)
        params = [r.params for r in rows]
        # Draw first: exactly one uniform per non-greedy row, whatever happens.
        rand = np.array([not p.greedy for p in params], dtype=np.bool_)
        u = np.array([r.generator.random() for r in rows if not r.params.greedy])

        x = process_logits(base, rows)  # (N, V)
        if bitmask is not None or x is not raw:  # raw's argmax is not x's
            best = x.argmax(axis=1)
        # one pass over the logits for the greedy rows, not three and a copy
        # (0.5-1 ms a step at 16 x 49152)
        dead = ~(x[np.arange(n), best] > -np.inf)  # all -inf after masking
        tokens = np.zeros(n, dtype=np.int64)
        if dead.any():  # the grammar's best, if the row has one
            tokens[dead] = base[dead].argmax(axis=1)
        greedy = ~rand & ~dead
        if greedy.any():
            tokens[greedy] = best[greedy]
        live = rand & ~dead
        if live.any():
            u_live = u[live[rand]]
            params_live = [p for p, m in zip(params, live, strict=True) if m]
            x_live = x if live.all() else x[live]
            # scaled in place where nothing reads it after: a copy of some
            # rows, process_logits' own copy, or logits the caller gave up
            # that no row's logprobs read (a fresh (N, V) array faults in its
            # pages: 1-2 ms a step at 16 x 49152)
            own = x_live is not raw or (overwrite and not wants_logprobs)
            tokens[live] = self._sample_random(x_live, params_live, u_live, own=own)
        # raw is intact whenever a row asks for logprobs (see overwrite)
        logprobs = _logprobs(raw, params, tokens)
        return SamplerOutput(token_ids=tokens, logprobs=logprobs)

    def verify(
        self,
        logits: npt.ArrayLike,
        rows: Sequence[SamplingRow],
        drafts: Sequence[Sequence[int]],
        *,
        bitmask: npt.NDArray[np.int32] | None = None,
        bitmask_rows: Sequence[int] | None = None,
        overwrite: bool = False,
    ) -> VerifiedOutput:
        """Sample each request's tokens and verify its proposals against them.

        ``logits`` (sum(1 + len(d) for d in drafts), V) holds, request after
        request, the rows of its newest token and of each of its proposals
        ``drafts[i]`` (none: one row, as :meth:`sample`). ``bitmask_rows``
        names requests (all of them in order when None); ``bitmask`` holds,
        for each of them in turn, one row per position: ``1 +
        len(drafts[i])`` rows, the grammar's state after the request's
        tokens and after each of its proposals. See the module docstring
        for the rule.
        """
        if len(drafts) != len(rows):
            raise ValueError(f"{len(drafts)} proposals for {len(rows)} rows")
        starts = np.cumsum([0, *(1 + len(d) for d in drafts)]).tolist()
        masked = list(range(len(rows)) if bitmask_rows is None else bitmask_rows)
        # the masked requests' positions, as rows of the expanded batch
        positions = [j for i in masked for j in range(starts[i], starts[i + 1])]
        if bitmask is not None and len(positions) > bitmask.shape[0]:
            raise ValueError(
                f"{len(positions)} positions to mask, bitmask has "
                f"{bitmask.shape[0]} rows"
            )
        expanded: list[SamplingRow] = []
        states: dict[int, dict[str, object]] = {}
        for i, (row, draft) in enumerate(zip(rows, drafts, strict=True)):
            expanded.append(row)
            if not draft:
                continue
            if not row.params.greedy:
                states[i] = dict(row.generator.bit_generator.state)
            outputs = list(row.output_token_ids)
            for token in draft:
                outputs.append(int(token))
                expanded.append(attrs.evolve(row, output_token_ids=tuple(outputs)))
        out = self.sample(
            logits,
            expanded,
            bitmask=bitmask,
            bitmask_rows=None if bitmask is None else positions,
            overwrite=overwrite,
        )
        tokens = out.token_ids.tolist()
        result: list[tuple[int, ...]] = []
        logprobs: list[tuple[TokenLogprobs, ...] | None] = []
        for i, (row, draft) in enumerate(zip(rows, drafts, strict=True)):
            sampled = tokens[starts[i] : starts[i + 1]]
            m = 0  # accepted proposals
            while m < len(draft) and sampled[m] == draft[m]:
                m += 1
            result.append(tuple(sampled[: m + 1]))
            lps = out.logprobs[starts[i] : starts[i] + m + 1]
            logprobs.append(None if lps[0] is None else tuple(lps))  # type: ignore[arg-type]
            state = states.get(i)
            if state is not None:  # as if it had drawn once per token taken
                row.generator.bit_generator.state = state
                row.generator.random(m + 1)
        return VerifiedOutput(result, logprobs)

    def _sample_random(
        self, x: F32, params: list[SamplingParams], u: F64, *, own: bool = False
    ) -> I64:
        """Temperature, top-k, top-p, min-p and one inverse-CDF draw per row;
        with ``own``, ``x`` is scaled in place."""
        b, vocab = x.shape
        temp = np.array([p.temperature for p in params], dtype=np.float32)
        top_k = np.array(
            [p.top_k if 0 < p.top_k < vocab else 0 for p in params], dtype=np.int64
        )
        top_p = np.array([p.top_p for p in params], dtype=np.float64)
        min_p = np.array([p.min_p for p in params], dtype=np.float64)
        # Subtracting the max first keeps tiny temperatures from overflowing;
        # each row's max becomes exactly 0, so its weight exp(0) is exactly 1.
        scaled = np.subtract(x, x.max(axis=1, keepdims=True), out=x if own else None)
        scaled /= temp[:, None]  # (b, V)
        tokens = np.empty(b, dtype=np.int64)
        by_rank = (top_k > 0) | (top_p < 1.0)
        by_id = ~by_rank
        if by_id.any():
            w = scaled if by_id.all() else scaled[by_id]
            w = np.exp(w, out=w)  # (b_id, V) unnormalised probabilities
            if (min_p[by_id] > 0).any():  # else no weight is below it
                w[w < min_p[by_id, None]] = 0.0
            tokens[by_id] = _draw_by_id(w, u[by_id])
        if by_rank.any():
            rows = np.flatnonzero(by_rank)
            c = int(top_k[rows].max()) + 1
            if (top_p[rows] < 1.0).any():
                c = max(c, self.candidates)
            c = min(vocab, c)
            tokens[rows] = _draw_by_rank(
                scaled if by_rank.all() else scaled[rows],  # no (b, V) copy
                top_k[rows],
                top_p[rows],
                min_p[rows],
                u[rows],
                c,
            )
        return tokens


def _check_logits(logits: npt.ArrayLike, n: int) -> F32:
    """Validate shape and values; NaN or +inf raises naming the first bad row."""
    return _checked_argmax(logits, n)[0]


def _checked_argmax(logits: npt.ArrayLike, n: int) -> tuple[F32, I64]:
    """:func:`_check_logits`, and each row's argmax from the same pass."""
    x = np.asarray(logits, dtype=np.float32)
    if x.ndim != 2 or x.shape[0] != n:
        raise ValueError(f"logits must have shape ({n}, vocab), got {x.shape}")
    if x.shape[1] == 0:
        raise ValueError("logits must have a non-empty vocabulary")
    best: I64 = x.argmax(axis=1)  # (N,) a NaN, if any, else the first +inf
    top = x[np.arange(n), best]
    bad = np.flatnonzero(np.isnan(top) | (top == np.inf))
    if bad.size:
        i = int(bad[0])
        what = "NaN" if np.isnan(x[i]).any() else "+inf"
        raise ValueError(f"logits row {i} contains {what}")
    return x, best


def _order_keys(values: F32, ids: I64) -> I64:
    """int64 keys that order entries by (value ascending, id descending).

    Float32 bits are mapped to order-preserving int32 in the high half; the
    low half holds ``0xFFFFFFFF - id``. Keys are unique within a row, so any
    sort of them is deterministic.
    """
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.int32)
    ordered = bits ^ ((bits >> 31) & np.int32(0x7FFFFFFF))
    return (ordered.astype(np.int64) << 32) | (_LOW32 - ids)


def _top_sorted(values: F32, c: int, *, ignore_neg_inf: bool) -> tuple[I64, I64]:
    """The ``c`` largest entries per row, ordered (value desc, id asc).

    Returns ``ids`` (b, c) and ``exact`` (b,): how many leading positions of
    each row are certainly that row's true order. Entries tied with the c-th
    value may be missing; with ``ignore_neg_inf`` a ``-inf`` tie counts as
    exact (such tokens have zero probability, so their order is irrelevant).
    """
    b, vocab = values.shape
    if c >= vocab:
        ids = np.broadcast_to(np.arange(vocab, dtype=np.int64), (b, vocab))
        exact = np.full(b, vocab, dtype=np.int64)
    else:
        ids = _top_ids(values, c)  # (b, c)
    vals = np.take_along_axis(values, ids, axis=1)  # (b, c)
    keys = np.sort(_order_keys(vals, ids), axis=1)[:, ::-1]  # (b, c) descending
    if c < vocab:
        edge = vals.min(axis=1)  # (b,) the c-th largest value
        exact = (vals > edge[:, None]).sum(axis=1)
        if ignore_neg_inf:
            exact[edge == -np.inf] = c
    return _LOW32 - (keys & _LOW32), exact


#: :func:`_top_ids` bounds a row by every SAMPLE_STEP-th of its values
_SAMPLE_STEP = 8


def _top_ids(values: F32, c: int) -> I64:
    """Ids of each row's ``c`` largest values (b, c), in no order; of the
    entries tied with the c-th value, any may be there.

    A row's strided sample (every :data:`_SAMPLE_STEP`-th value) gives a
    bound that about ``2c`` of its values reach, and the selection runs
    over those rather than the whole row: ``argpartition`` over SmolLM2's
    49152 logits took 0.4 ms a row, a 16-row top-p step 6 ms. A row where
    fewer than ``c`` values reach the bound is partitioned whole.
    """
    b, vocab = values.shape
    if vocab < 16 * c:  # the sample would bound little
        ids = np.argpartition(values, vocab - c, axis=1)[:, vocab - c :]
        return ids.astype(np.int64, copy=False)
    sample = values[:, ::_SAMPLE_STEP]
    k = -(-2 * c // _SAMPLE_STEP)  # the sample's k-th largest: ~2c of the row
    bound = np.partition(sample, sample.shape[1] - k, axis=1)[:, sample.shape[1] - k]
    out = np.empty((b, c), dtype=np.int64)
    for r in range(b):
        row = values[r]
        found = np.flatnonzero(row >= bound[r])
        if found.size < c:
            found = np.arange(vocab)
        part = np.argpartition(row[found], found.size - c)[found.size - c :]
        out[r] = found[part]
    return out


def _draw_by_rank(
    scaled: F32, top_k: I64, top_p: F64, min_p: F64, u: F64, c: int
) -> I64:
    """Top-k, top-p and min-p over the (prob desc, id asc) order, then draw.

    ``scaled`` (b, V) are logits over temperature with each row's max at 0.
    Rows whose kept set reaches past the ``c`` sorted candidates are redone
    over 8 times as many (sorting all of SmolLM2's 49152 took 2.5 ms a
    row, and 8% of a top-p 0.95 run's rows had nuclei of 1024-4125
    tokens), up to the whole vocabulary; the result is the same, only
    slower.
    """
    b, vocab = scaled.shape
    ids, exact = _top_sorted(scaled, c, ignore_neg_inf=True)  # (b, c), (b,)
    c = ids.shape[1]
    w = np.exp(np.take_along_axis(scaled, ids, axis=1).astype(np.float64))  # (b, c)
    pos = np.arange(c)
    k = np.where(top_k > 0, top_k, c)  # top_k < c here (c > max top_k)
    w[pos >= k[:, None]] = 0.0
    cum = np.cumsum(w, axis=1)  # (b, c)
    cut = k.copy()  # tokens kept: the first `cut` positions
    nucleus = top_p < 1.0
    if nucleus.any():
        has_k = top_k > 0
        z = np.where(has_k, cum[np.arange(b), k - 1], 0.0)  # (b,) total mass
        full = nucleus & ~has_k
        if full.any():
            # a row at a time: no (b, V) array of weights
            z[full] = [
                _block_sums(np.exp(scaled[r][None])).astype(np.float64).sum()
                for r in np.flatnonzero(full)
            ]
        reached = (cum / z[:, None]) >= top_p[:, None]  # (b, c)
        first = np.where(reached.any(axis=1), reached.argmax(axis=1) + 1, vocab + 1)
        cut = np.where(nucleus, np.minimum(cut, first), cut)
    redo = (cut > exact) & (c < vocab)  # the kept set reaches unsorted tokens
    w[pos >= cut[:, None]] = 0.0
    w[w < min_p[:, None]] = 0.0
    tokens = np.take_along_axis(ids, _inverse_cdf(w, u)[:, None], axis=1)[:, 0]
    if redo.any():  # 8 times the candidates, up to the whole vocabulary
        tokens[redo] = _draw_by_rank(
            scaled[redo], top_k[redo], top_p[redo], min_p[redo], u[redo], 8 * c
        )
    return tokens


def _draw_by_id(w: F32, u: F64) -> I64:
    """Inverse CDF over token ids of weights ``w`` (b, V), in two levels.

    Float32 block sums locate a block, a float64 cumulative sum inside it the
    token. Each row's answer depends only on that row.
    """
    b, vocab = w.shape
    blocks = _block_sums(w).astype(np.float64)  # (b, nb)
    block = _inverse_cdf(blocks, u)  # (b,)
    before = np.cumsum(blocks, axis=1)  # (b, nb)
    prior = np.where(block > 0, before[np.arange(b), np.maximum(block - 1, 0)], 0.0)
    target = u * before[:, -1] - prior  # (b,) offset inside the chosen block
    start = block * _BLOCK  # (b,)
    cols = start[:, None] + np.arange(_BLOCK)  # (b, BLOCK)
    seg = w[np.arange(b)[:, None], np.minimum(cols, vocab - 1)].astype(np.float64)
    seg[cols >= vocab] = 0.0
    return start + _inverse_cdf(seg, target, absolute=True)


def _block_sums(w: F32) -> F32:
    """Per-row sums (b, ceil(V / BLOCK)) of consecutive token blocks.

    No dtype cast, so numpy reduces each block on its own and a row's sums do
    not depend on the other rows.
    """
    offsets = np.arange(0, w.shape[1], _BLOCK)
    sums: F32 = np.add.reduceat(w, offsets, axis=1)
    return sums


def _inverse_cdf(w: F64, u: F64, *, absolute: bool = False) -> I64:
    """Index per row where the cumulative weight first exceeds the target.

    The target is ``u * total`` (or ``u`` itself with ``absolute``); the answer
    is clamped to the last positive weight, so zero weights are never chosen
    as long as the row has some weight.
    """
    cdf = np.cumsum(w, axis=1)  # (b, n)
    total = cdf[:, -1]
    target = u if absolute else u * total
    idx = (cdf <= target[:, None]).sum(axis=1)
    last = (cdf < total[:, None]).sum(axis=1)  # first index reaching the total
    chosen: I64 = np.minimum(idx, last).astype(np.int64)
    return chosen


def _logprobs(
    raw: F32, params: Sequence[SamplingParams], tokens: I64
) -> list[TokenLogprobs | None]:
    """Logprobs of the sampled tokens and the top-n, from the raw logits."""
    out: list[TokenLogprobs | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return out
    want = [params[i].logprobs or 0 for i in rows]
    for i, lp in zip(rows, token_logprobs(raw[rows], tokens[rows], want), strict=True):
        out[i] = lp
    return out


def token_logprobs(
    x: F32, tokens: npt.ArrayLike, num_top: Sequence[int]
) -> list[TokenLogprobs]:
    """Per row of raw logits ``x`` (L, V): the logprob and rank of
    ``tokens[row]`` and the ``num_top[row]`` most likely tokens, all from
    ``log_softmax`` of the row (the prompt logprobs use this too)."""
    toks = np.asarray(tokens, dtype=np.int64)  # (L,)
    n_rows = x.shape[0]
    top = x.max(axis=1)  # (L,)
    top[top == -np.inf] = 0.0  # an all -inf row: every logprob is -inf
    # a row at a time: no (L, V) arrays, whose pages fault in every step
    mass = np.array(
        [np.exp(x[j] - top[j]).sum() for j in range(n_rows)], dtype=np.float32
    )  # (L,)
    with np.errstate(divide="ignore"):
        lse = top.astype(np.float64) + np.log(mass.astype(np.float64))
    lse[lse == -np.inf] = 0.0
    picked = x[np.arange(n_rows), toks]  # (L,)
    chosen = picked - lse
    # logprob = logit - lse is monotone, so ranks can compare raw logits.
    above = [np.count_nonzero(x[j] > picked[j]) for j in range(n_rows)]
    rank = np.array(above, dtype=np.int64) + 1
    want = np.asarray(num_top, dtype=np.int64).reshape(n_rows)
    n_max = int(want.max(initial=0))
    if n_max:
        ids, exact = _top_sorted(x, n_max + 1, ignore_neg_inf=False)
        redo = exact < want
        if redo.any():
            full, _ = _top_sorted(x[redo], x.shape[1], ignore_neg_inf=False)
            ids = ids.copy()
            ids[redo] = full[:, : ids.shape[1]]
    out = []
    for j in range(n_rows):
        n = int(want[j])
        top_ids = [int(t) for t in ids[j, :n]] if n else []
        out.append(
            TokenLogprobs(
                sampled_logprob=float(chosen[j]),
                sampled_rank=int(rank[j]),
                top_ids=tuple(top_ids),
                top_logprobs=tuple(float(x[j, t] - lse[j]) for t in top_ids),
            )
        )
    return out
