"""Sampler: greedy rows, seeded determinism across batches, and draws that follow the filtered softmax."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from loraplex.engine.sampler import Sampler, exp_from_uniform, make_generator
from loraplex.engine.sampling_params import SamplingParams


def _random_logits(n: int, vocab: int, scale: float = 3.0) -> torch.Tensor:  # [n, vocab]
    return torch.randn(n, vocab) * scale


def _reference_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:  # [V] float64
    """Independent float64 version of temperature -> top-k -> top-p on one row."""
    z = logits.astype(np.float64) / params.temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(len(z), dtype=bool)
    k = params.top_k if 0 < params.top_k < len(z) else len(z)
    keep[order[:k]] = True
    p = np.exp(z - z.max()) * keep
    p /= p.sum()
    if params.top_p < 1.0:
        mass_before = 0.0
        for i in order[:k]:
            if mass_before >= params.top_p:
                keep[i] = False
            mass_before += p[i]
        p = p * keep
        p /= p.sum()
    return p


def _assert_matches(counts: np.ndarray, probs: np.ndarray) -> None:
    """Counts of n draws follow probs: nothing outside the support, each token within 5 sigma."""
    n = counts.sum()
    assert counts[probs == 0].sum() == 0, "a token outside top-k / the nucleus was drawn"
    expected = n * probs
    sigma = np.sqrt(n * probs * (1 - probs))
    assert np.all(np.abs(counts - expected) <= 5 * sigma + 1), (counts, expected.round(1))
    support = probs > 0
    chi2 = float((((counts - expected) ** 2)[support] / expected[support]).sum())
    df = max(int(support.sum()) - 1, 1)
    assert chi2 < df + 8 * math.sqrt(2 * df) + 10, (chi2, df)


def _pick_top_p(logits: np.ndarray, params_kw: dict, low: float = 0.3, high: float = 0.95) -> float:
    """A top_p whose nucleus boundary is not within float32 rounding of a cumulative mass."""
    while True:
        top_p = random.uniform(low, high)
        probs = _reference_probs(logits, SamplingParams(**params_kw))
        cum = np.cumsum(np.sort(probs)[::-1])
        if np.min(np.abs(cum - top_p)) > 1e-3:
            return top_p


def test_greedy_rows_equal_argmax_in_a_mixed_batch():
    n, vocab = 13, 517
    logits = _random_logits(n, vocab)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, top_k=i % 4, seed=i if i % 3 else None) for i in range(n)]
    gens = [make_generator(p.seed) if p.seed is not None else None for p in params]
    out = Sampler().sample(logits.clone(), params, gens)
    assert out.shape == (n,) and out.dtype == torch.int64
    greedy = torch.tensor([p.is_greedy for p in params])
    assert torch.equal(out[greedy], logits.argmax(-1)[greedy])
    assert bool(((out >= 0) & (out < vocab)).all())


def test_all_greedy_batch_and_caller_logits_untouched():
    logits = _random_logits(9, 300)
    before = logits.clone()
    params = [SamplingParams(temperature=0)] * 9
    assert torch.equal(Sampler().sample(logits, params, [None] * 9), before.argmax(-1))
    mixed = [SamplingParams(temperature=0.7, top_k=5, top_p=0.8)] * 9
    Sampler().sample(logits, mixed, [None] * 9)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("seeded", [False, True])
def test_top_k_one_equals_greedy(seeded):
    n, vocab = 32, 1001
    logits = _random_logits(n, vocab)
    params = [SamplingParams(temperature=random.uniform(0.1, 5.0), top_k=1, top_p=random.uniform(0.05, 1.0)) for _ in range(n)]
    gens = [make_generator(random.randrange(2**63)) if seeded else None for _ in range(n)]
    assert torch.equal(Sampler().sample(logits, params, gens), logits.argmax(-1))


def test_tiny_top_p_equals_greedy():
    logits = _random_logits(16, 400)
    params = [SamplingParams(temperature=random.uniform(0.5, 2.0), top_p=1e-6)] * 16
    assert torch.equal(Sampler().sample(logits, params, [None] * 16), logits.argmax(-1))


def _run_target_in_batch(target_logits, target_params, seed, steps, batch_size, position, vocab):
    """Tokens of one seeded row over several steps, inside a batch of random other rows."""
    gen = make_generator(seed)
    sampler = Sampler()
    neighbour_kinds = [
        lambda: (SamplingParams(temperature=0), None),
        lambda: (SamplingParams(temperature=1.3, top_p=0.7), None),
        lambda: (SamplingParams(temperature=0.6, top_k=7, seed=5), make_generator(random.randrange(1000))),
        lambda: (SamplingParams(top_k=3, top_p=0.5), None),
    ]
    tokens = []
    for step in range(steps):
        logits = _random_logits(batch_size, vocab)
        logits[position] = target_logits[step]
        params, gens = [], []
        for _ in range(batch_size):
            p, g = random.choice(neighbour_kinds)()
            params.append(p)
            gens.append(g)
        params[position], gens[position] = target_params, gen
        tokens.append(int(sampler.sample(logits, params, gens)[position]))
    return tokens


@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.7, top_k=20), dict(temperature=1.5, top_p=0.9, top_k=50)])
def test_seeded_row_is_independent_of_batch_neighbours_and_position(kw):
    vocab, steps = 257, 25
    seed = random.randrange(-(2**40), 2**40)
    target_params = SamplingParams(seed=seed, **kw)
    target_logits = _random_logits(steps, vocab, scale=1.0)  # flat enough that draws really vary
    a = _run_target_in_batch(target_logits, target_params, seed, steps, batch_size=1, position=0, vocab=vocab)
    b = _run_target_in_batch(target_logits, target_params, seed, steps, batch_size=6, position=4, vocab=vocab)
    c = _run_target_in_batch(target_logits, target_params, seed, steps, batch_size=11, position=2, vocab=vocab)
    assert a == b == c
    other = _run_target_in_batch(target_logits, target_params, seed + 1, steps, batch_size=3, position=1, vocab=vocab)
    assert other != a  # 25 draws from ~flat distributions over 257 tokens: a collision is negligible


def test_sampler_seed_makes_unseeded_rows_reproducible():
    logits = _random_logits(20, 300, scale=1.0)
    params = [SamplingParams(temperature=1.0)] * 20
    s = random.randrange(2**31)
    assert torch.equal(Sampler(seed=s).sample(logits, params, [None] * 20), Sampler(seed=s).sample(logits, params, [None] * 20))


DISTRIBUTION_CASES = [
    dict(temperature=1.0),
    dict(temperature=0.5),
    dict(temperature=2.5),
    dict(temperature=1.0, top_k=3),
    dict(temperature=0.8, top_p="random"),
    dict(temperature=1.7, top_k=5, top_p="random"),
]


@pytest.mark.parametrize("kw", DISTRIBUTION_CASES)
@pytest.mark.parametrize("seeded", [False, True])
def test_draws_follow_the_filtered_softmax(kw, seeded):
    vocab = 10
    row = _random_logits(1, vocab, scale=1.5)[0]
    kw = dict(kw)
    if kw.get("top_p") == "random":
        kw["top_p"] = _pick_top_p(row.numpy(), {**kw, "top_p": 1.0})
    params = SamplingParams(**kw)
    n = 4000 if seeded else 40000  # seeded rows each draw from their own generator (slower path)
    gens = [make_generator(random.randrange(2**62)) for _ in range(n)] if seeded else [None] * n
    out = Sampler().sample(row.expand(n, vocab).contiguous(), [params] * n, gens)
    counts = np.bincount(out.numpy(), minlength=vocab)
    _assert_matches(counts, _reference_probs(row.numpy(), params))


def test_rows_with_different_params_in_one_batch_each_follow_their_own_distribution():
    vocab, per_group = 12, 15000
    kws = [dict(temperature=0.7), dict(temperature=1.2, top_k=4), dict(temperature=1.0, top_p=None), dict(top_k=6, top_p=None)]
    rows = _random_logits(len(kws), vocab, scale=1.5)
    params = []
    for kw, row in zip(kws, rows):
        if "top_p" in kw:
            kw = {**kw, "top_p": _pick_top_p(row.numpy(), {**kw, "top_p": 1.0})}
        params.append(SamplingParams(**kw))
    # Interleave the groups so each vectorised pass mixes all of them.
    order = torch.arange(len(kws)).repeat(per_group)
    perm = torch.randperm(len(order))
    order = order[perm]
    out = Sampler().sample(rows[order], [params[i] for i in order.tolist()], [None] * len(order))
    for g in range(len(kws)):
        counts = np.bincount(out[order == g].numpy(), minlength=vocab)
        _assert_matches(counts, _reference_probs(rows[g].numpy(), params[g]))


def test_masked_logits_are_never_drawn():
    # Logits of -inf (e.g. tokens an adapter or grammar forbids) must stay impossible.
    vocab, n = 50, 3000
    logits = _random_logits(n, vocab)
    banned = torch.rand(n, vocab) < 0.5
    banned[:, 0] = False
    logits[banned] = float("-inf")
    out = Sampler().sample(logits, [SamplingParams(temperature=2.0, top_p=0.99)] * n, [None] * n)
    assert not bool(banned[torch.arange(n), out].any())


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="rows"):
        Sampler().sample(torch.zeros(3, 5), [SamplingParams()] * 2, [None] * 3)
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        Sampler().sample(torch.zeros(5), [SamplingParams()] * 5, [None] * 5)
    assert Sampler().sample(torch.zeros(0, 5), [], []).shape == (0,)


def test_exponentials_are_finite_and_positive_at_the_uniform_extremes():
    # u = 0 once gave q = inf: the row's only kept token then scored 0 and lost the argmax to token 0.
    top = 1.0 - 2.0**-24  # the largest float32 below 1
    u = torch.tensor([0.0, 2.0**-24, 0.5, top], dtype=torch.float32)
    q = exp_from_uniform(u.clone())
    assert bool(torch.isfinite(q).all()) and bool((q > 0).all())
    assert q[2].item() == pytest.approx(math.log(2.0), rel=1e-6)
    probs = torch.tensor([0.0, 1.0, 0.0])  # one kept token; whatever its q, it must win
    for qk in q:
        scores = probs / torch.tensor([1.0, qk.item(), 1.0])
        assert int(scores.argmax()) == 1
