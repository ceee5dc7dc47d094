"""Properties of the batched sampler (structllm.model.sampler)."""

from __future__ import annotations

import math
from collections import Counter

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from structllm.model.sampler import (
    Sampler,
    SamplingRow,
    _top_ids,
    make_generator,
    process_logits,
)
from structllm.params import SamplingParams

SAMPLER = Sampler()
settings.register_profile("sampler", max_examples=60, deadline=None)
settings.load_profile("sampler")

# Few distinct values, so ties are common; some -inf.
logit_values = st.sampled_from([-math.inf, -3.0, -1.0, 0.0, 0.5, 1.0, 2.0, 4.0])


@st.composite
def logit_rows(draw: st.DrawFn, vocab: int | None = None) -> np.ndarray:
    v = vocab or draw(st.integers(1, 40))
    row = draw(st.lists(logit_values, min_size=v, max_size=v))
    row[draw(st.integers(0, v - 1))] = draw(st.sampled_from([0.0, 3.0]))
    return np.array(row, dtype=np.float32)


random_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.3, 0.7, 1.0, 2.0]),
    top_k=st.sampled_from([0, 0, 2, 3, 10]),
    top_p=st.sampled_from([1.0, 1.0, 0.3, 0.8, 0.95]),
    min_p=st.sampled_from([0.0, 0.0, 0.05, 0.5]),
    seed=st.integers(0, 2**32),
)
#: also with logit_bias and allowed_token_ids (they change the distribution)
biased_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.3, 0.7, 1.0, 2.0]),
    top_k=st.sampled_from([0, 0, 2, 3, 10]),
    top_p=st.sampled_from([1.0, 1.0, 0.3, 0.8, 0.95]),
    min_p=st.sampled_from([0.0, 0.0, 0.05, 0.5]),
    seed=st.integers(0, 2**32),
    logit_bias=st.dictionaries(st.integers(0, 4), st.floats(-100, 100), max_size=3),
    allowed_token_ids=st.none() | st.lists(st.integers(0, 4), min_size=1, max_size=4),
)


def row(params: SamplingParams, **kw: object) -> SamplingRow:
    return SamplingRow(params, make_generator(params.seed), **kw)  # type: ignore[arg-type]


def order(x: np.ndarray) -> list[int]:
    """Token ids by (value desc, id asc)."""
    return sorted(range(len(x)), key=lambda i: (-float(x[i]), i))


def scaled(x: np.ndarray, t: float) -> np.ndarray:
    out: np.ndarray = (x - x.max()) / np.float32(t)
    return out


def softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x.astype(np.float64) - x.max())
    out: np.ndarray = z / z.sum()
    return out


def sample1(x: np.ndarray, r: SamplingRow) -> int:
    return int(SAMPLER.sample(x[None, :], [r]).token_ids[0])


@given(logit_rows(), st.sampled_from([0.0, 0.5]), st.integers(0, 2**32))
def test_greedy_is_argmax_and_draws_nothing(x: np.ndarray, t: float, seed: int) -> None:
    params = SamplingParams(temperature=t, top_k=1, seed=seed)
    r = row(params)
    before = r.generator.bit_generator.state
    assert sample1(x, r) == int(np.argmax(x))  # argmax ties to the lowest id
    assert r.generator.bit_generator.state == before


@given(logit_rows(), random_params)
def test_random_rows_draw_exactly_once(x: np.ndarray, params: SamplingParams) -> None:
    r = row(params)
    twin = make_generator(params.seed)
    sample1(x, r)
    twin.random()
    assert r.generator.bit_generator.state == twin.bit_generator.state


@given(logit_rows(), random_params)
def test_sampled_token_survives_every_filter(
    x: np.ndarray, params: SamplingParams
) -> None:
    tok = sample1(x, row(params))
    s = scaled(x, params.temperature)
    ranked = order(s)
    kept = ranked[: params.top_k] if params.top_k else ranked
    p = softmax(s[kept])
    assert p[kept.index(tok)] > 0
    if params.top_p < 1.0:
        # the nucleus, a hair wider to absorb rounding at its edge
        m = int(np.searchsorted(np.cumsum(p), params.top_p + 1e-9)) + 1
        assert kept.index(tok) < m
    assert p[kept.index(tok)] >= params.min_p * p.max() * (1 - 1e-6)


@given(logit_rows(), st.integers(0, 2**32), st.sampled_from([0, 5]))
def test_tiny_top_p_gives_the_argmax(x: np.ndarray, seed: int, k: int) -> None:
    params = SamplingParams(top_p=1e-9, top_k=k, temperature=1.5, seed=seed)
    assert sample1(x, row(params)) == int(np.argmax(x))


@settings(max_examples=25)
@given(
    logit_seed=st.integers(0, 2**32),
    vocab=st.sampled_from([5, 300, 3001]),
    target=biased_params,
    others=st.lists(biased_params, max_size=5),
    where=st.integers(0, 5),
    candidates=st.sampled_from([1, 7, 1024]),
)
def test_seeded_row_ignores_its_batch(
    logit_seed: int,
    vocab: int,
    target: SamplingParams,
    others: list[SamplingParams],
    where: int,
    candidates: int,
) -> None:
    """Same seed and logits give the same tokens in any batch, at any width."""
    rng = np.random.default_rng(logit_seed)
    # rounded to halves: many ties
    steps = [
        np.round(rng.standard_normal(vocab) * 6).astype(np.float32) / 2
        for _ in range(4)
    ]
    alone = Sampler()
    r = row(target)
    expected = [int(alone.sample(s[None, :], [r]).token_ids[0]) for s in steps]
    batch_rows = [row(p) for p in others]
    pos = min(where, len(batch_rows))
    r = row(target)
    batch_rows.insert(pos, r)
    got = []
    for s in steps:
        noise = rng.standard_normal((len(batch_rows), vocab)).astype(np.float32)
        noise[pos] = s
        got.append(int(Sampler(candidates).sample(noise, batch_rows).token_ids[pos]))
    assert got == expected


@settings(max_examples=40)
@given(
    logit_seed=st.integers(0, 2**32),
    # random_params: process_logits returns the logits themselves
    batch=st.lists(random_params | biased_params, min_size=1, max_size=4),
    logprobs=st.lists(st.sampled_from([None, 0, 3]), min_size=4, max_size=4),
)
def test_overwrite_changes_nothing_but_the_logits_given_up(
    logit_seed: int, batch: list[SamplingParams], logprobs: list[int | None]
) -> None:
    """The sampler scales logits in place where nothing reads them after
    (``overwrite``, no row's logprobs): the same tokens and logprobs as
    sampling a copy, and without ``overwrite`` the caller's array is as
    it was."""
    rng = np.random.default_rng(logit_seed)
    logits = (rng.standard_normal((len(batch), 300)) * 3).astype(np.float32)
    params = [
        attrs.evolve(p, logprobs=lp) for p, lp in zip(batch, logprobs, strict=False)
    ]
    kept = logits.copy()
    a = SAMPLER.sample(logits, [row(p) for p in params])
    np.testing.assert_array_equal(logits, kept)
    b = SAMPLER.sample(logits.copy(), [row(p) for p in params], overwrite=True)
    assert a.token_ids.tolist() == b.token_ids.tolist()
    assert a.logprobs == b.logprobs


def _rows_for_top_ids(vocab: int) -> np.ndarray:
    rng = np.random.default_rng(vocab)
    plain = rng.standard_normal(vocab).astype(np.float32)
    ties = np.round(rng.standard_normal(vocab) * 2).astype(np.float32)
    masked = plain.copy()
    masked[rng.random(vocab) < 0.9] = -np.inf  # a grammar's mask
    # the large values only where the strided sample looks (every 8th):
    # fewer than c of the row reach its bound, so the row goes whole
    strided = np.full(vocab, -5.0, dtype=np.float32)
    strided[::8] = rng.standard_normal(strided[::8].size)
    return np.stack([plain, ties, masked, strided])


@pytest.mark.parametrize(
    ("vocab", "c"), [(49152, 1024), (3001, 51), (300, 7), (300, 40)]
)
def test_top_ids_are_the_largest_values(vocab: int, c: int) -> None:
    values = _rows_for_top_ids(vocab)
    ids = _top_ids(values, c)
    assert ids.shape == (4, c) and ids.dtype == np.int64
    for row, got in zip(values, ids, strict=True):
        assert np.unique(got).size == c
        # the c largest values (which of the tied ones is free)
        np.testing.assert_array_equal(np.sort(row[got]), np.sort(row)[-c:])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.8),
    ],
)
def test_distribution_matches_softmax(params: SamplingParams) -> None:
    """Chi-squared on 20k seeded draws against the filtered softmax."""
    x = np.array([1.0, 0.2, -0.5, 2.0, 0.0, -1.0], dtype=np.float32)
    s = scaled(x, params.temperature)
    ranked = order(s)
    kept = ranked[: params.top_k] if params.top_k else ranked
    p = softmax(s[kept])
    if params.top_p < 1.0:
        kept = kept[: int(np.searchsorted(np.cumsum(p), params.top_p)) + 1]
        p = softmax(s[kept])
    rows = [SamplingRow(params, make_generator(i)) for i in range(2000)]
    batch = np.broadcast_to(x, (len(rows), x.size))
    counts: Counter[int] = Counter()
    for _ in range(10):
        counts.update(SAMPLER.sample(batch, rows).token_ids.tolist())
    assert set(counts) <= set(kept)
    n = sum(counts.values())
    chi2 = sum((counts[t] - n * q) ** 2 / (n * q) for t, q in zip(kept, p, strict=True))
    assert chi2 < 20.5  # p = 0.001 at 5 degrees of freedom


def reference_penalties(x: np.ndarray, r: SamplingRow) -> list[float]:
    out = [float(v) for v in x]
    p = r.params
    seen = set(r.prompt_token_ids) | set(r.output_token_ids)
    counts = Counter(r.output_token_ids)
    for t in range(len(out)):
        if t in seen:
            v = out[t]
            out[t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        c = counts[t]
        out[t] -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
    return out


@given(
    xs=st.lists(logit_rows(vocab=12), min_size=1, max_size=4),
    data=st.data(),
)
def test_penalties_match_reference(xs: list[np.ndarray], data: st.DataObject) -> None:
    tokens = st.lists(st.integers(0, 11), max_size=8)
    rows = [
        row(
            data.draw(
                st.builds(
                    SamplingParams,
                    repetition_penalty=st.sampled_from([1.0, 0.8, 1.3]),
                    presence_penalty=st.sampled_from([0.0, -0.5, 1.0]),
                    frequency_penalty=st.sampled_from([0.0, 0.25, -1.0]),
                )
            ),
            prompt_token_ids=data.draw(tokens),
            output_token_ids=data.draw(tokens),
        )
        for _ in xs
    ]
    batch = np.stack(xs)
    original = batch.copy()
    got = process_logits(batch, rows)
    np.testing.assert_array_equal(batch, original)  # input untouched
    for i, r in enumerate(rows):
        np.testing.assert_allclose(got[i], reference_penalties(xs[i], r), rtol=1e-6)


@given(logit_rows(), st.one_of(st.none(), st.integers(0, 5)), random_params)
def test_logprobs_are_raw_log_softmax(
    x: np.ndarray, n: int | None, params: SamplingParams
) -> None:
    params = SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        logprobs=n,
        repetition_penalty=1.5,
        seed=params.seed,
    )
    r = row(params, prompt_token_ids=[0])
    out = SAMPLER.sample(x[None, :], [r])
    lp = out.logprobs[0]
    if n is None:
        assert lp is None
        return
    assert lp is not None
    with np.errstate(divide="ignore"):
        ref = np.log(softmax(x))
    tok = int(out.token_ids[0])
    assert lp.sampled_logprob == pytest.approx(ref[tok], abs=1e-5)
    assert lp.sampled_rank == 1 + int((x > x[tok]).sum())
    assert list(lp.top_ids) == order(x)[: min(n, x.size)]
    np.testing.assert_allclose(lp.top_logprobs, ref[list(lp.top_ids)], atol=1e-5)
    assert list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)


@given(st.sampled_from([0.0, 1.0]), st.integers(0, 4))
def test_min_tokens_masks_eos_and_stop_ids(t: float, done: int) -> None:
    x = np.array([0.0, 1.0, 9.0, 8.0, 2.0], dtype=np.float32)
    params = SamplingParams(temperature=t, min_tokens=3, stop_token_ids=[3], seed=1)
    rows = [
        row(params, output_token_ids=[4] * done, eos_token_ids=frozenset({2}))
        for _ in range(50)
    ]
    tokens = set(SAMPLER.sample(np.tile(x, (50, 1)), rows).token_ids.tolist())
    if done < 3:
        assert not tokens & {2, 3}
    elif t == 0.0:
        assert tokens == {2}


def test_fully_masked_row_falls_back_to_raw_argmax() -> None:
    x = np.array([[1.0, 5.0, -math.inf]], dtype=np.float32)
    for t in (0.0, 1.0):
        params = SamplingParams(temperature=t, min_tokens=1, stop_token_ids=[0])
        r = row(params, eos_token_ids=frozenset({1}))
        assert SAMPLER.sample(x, [r]).token_ids.tolist() == [1]


def test_all_neg_inf_row_does_not_crash() -> None:
    x = np.full((2, 4), -math.inf, dtype=np.float32)
    rows = [row(SamplingParams(logprobs=2)), row(SamplingParams(temperature=0))]
    out = SAMPLER.sample(x, rows)
    assert out.token_ids.tolist() == [0, 0]


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nan_or_inf_logits_name_the_row(bad: float) -> None:
    x = np.zeros((3, 4), dtype=np.float32)
    x[2, 1] = bad
    with pytest.raises(ValueError, match="row 2"):
        SAMPLER.sample(x, [row(SamplingParams()) for _ in range(3)])


def test_shape_and_token_id_errors() -> None:
    with pytest.raises(ValueError, match="shape"):
        SAMPLER.sample(np.zeros((2, 4), np.float32), [row(SamplingParams())])
    r = row(SamplingParams(presence_penalty=1.0), output_token_ids=[7])
    with pytest.raises(ValueError, match="row 0"):
        SAMPLER.sample(np.zeros((1, 4), np.float32), [r])


def test_empty_batch() -> None:
    out = SAMPLER.sample(np.zeros((0, 8), np.float32), [])
    assert out.token_ids.shape == (0,)
    assert out.logprobs == []


def test_make_generator() -> None:
    a, b = make_generator(-1), make_generator(2**64 - 1)
    assert a.random() == b.random()
    assert make_generator(5).random() == make_generator(5).random()
    assert make_generator(None).random() != make_generator(None).random()


@given(
    x=logit_rows(vocab=12),
    allowed=st.lists(st.integers(0, 11), min_size=1, max_size=5),
    t=st.sampled_from([0.0, 0.7, 1.5]),
    seed=st.integers(0, 2**32),
)
def test_allowed_token_ids_are_the_only_choices(
    x: np.ndarray, allowed: list[int], t: float, seed: int
) -> None:
    p = SamplingParams(temperature=t, seed=seed, allowed_token_ids=allowed)
    got = sample1(x, row(p))
    if (x[allowed] > -math.inf).any():
        assert got in allowed
    keep = process_logits(x[None, :], [row(p)])[0]
    assert all(keep[i] == -math.inf for i in range(12) if i not in allowed)
    assert all(keep[i] == x[i] for i in allowed)


@given(x=logit_rows(vocab=12), token=st.integers(0, 11))
def test_logit_bias_moves_the_argmax(x: np.ndarray, token: int) -> None:
    x = np.maximum(x, np.float32(-3.0))  # finite, so a bias of 100 dominates
    up = SamplingParams(temperature=0, logit_bias={token: 100.0})
    assert sample1(x, row(up)) == token
    biased = process_logits(x[None, :], [row(up)])[0]
    assert (
        biased[token] == np.float32(x[token] + 100)
        and (np.delete(biased, token) == np.delete(x, token)).all()
    )
    down = SamplingParams(temperature=0, logit_bias={str(token): -100})
    assert sample1(x, row(down)) != token
