"""``specdec.sampling``: the counter-based noise, the candidate set, the samplers, the
parameters. One test per property; the engine-level properties are in
test_sampling_engine.py."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import specdec
from specdec import models, sampling as S
from specdec.sampling import Sampling
from invariants.testing import no_host_transfers

U32 = st.integers(0, 2**32 - 1)
SEEDS = st.integers(0, 2**64 - 1)
#: request indices and output positions the engine can produce (below 2**31)
INDICES = st.integers(0, 2**31 - 1)


def chi2_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's chi-square p-value (expected counts all >= 5)."""
    stat = float(((observed.double() - expected) ** 2 / expected).sum())
    df = observed.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def many_keys(n: int):
    """(row_ids, t) of n distinct (request, position) pairs."""
    i = torch.arange(n)
    return i // 64, i % 64


# -- the noise: exact integer arithmetic, independent of batch and device --------------

@given(st.lists(U32, min_size=1, max_size=16))
def test_mix_on_int64_tensors_equals_mix_on_python_ints(xs):
    """No product overflows: the int64 tensor ops give the mathematically exact bits."""
    assert S.mix(torch.tensor(xs, dtype=torch.long)).tolist() == [S.mix(x) for x in xs]


@given(SEEDS, st.lists(st.tuples(INDICES, INDICES), min_size=1, max_size=8),
       st.sampled_from((S.COUPLED, S.DRAFT, S.ACCEPT, S.RESAMPLE)))
def test_keys_and_token_bits_equal_exact_integer_arithmetic(seed, pairs, stream):
    rows = torch.tensor([r for r, _ in pairs])
    t = torch.tensor([p for _, p in pairs])
    k0, k1 = S.keys(seed, rows, t, stream)
    vocab = torch.tensor([0, 1, 7, 2**17 - 1])
    bits = S.token_bits(k0, k1, vocab)
    for j, (r, p) in enumerate(pairs):
        e0, e1 = S.keys(seed, r, p, stream)
        assert (int(k0[j]), int(k1[j])) == (e0, e1)
        assert bits[j].tolist() == [S.mix(S.mix(e0 ^ v) ^ e1) for v in vocab.tolist()]


def test_every_bit_value_stays_below_2_to_the_32():
    x = torch.tensor([0, 1, 2**31, 2**32 - 1])
    assert bool((S.mix(x) >= 0).all() and (S.mix(x) < 2**32).all())
    assert max(S.MUL) < 2**31 and all(m % 2 for m in S.MUL)  # odd: mix is a bijection


def test_noise_of_a_request_does_not_depend_on_the_batch_or_its_order():
    seed, rows, t = 12345, torch.tensor([0, 5, 3, 9, 2, 7, 1, 4]), torch.tensor([0, 3, 9, 1, 4, 2, 8, 5])
    ids = torch.arange(50)
    together = S.gumbel(seed, rows, t, ids)
    alone = torch.stack([S.gumbel(seed, rows[i : i + 1], t[i : i + 1], ids)[0] for i in range(8)])
    order = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    shuffled = S.gumbel(seed, rows[order], t[order], ids)
    some = torch.tensor([[7, 3, 41]]).expand(8, -1)  # noise at a few ids = those ids' columns
    assert torch.equal(together, alone) and torch.equal(together[order], shuffled)
    assert torch.equal(S.gumbel(seed, rows, t, some), together[:, [7, 3, 41]])


def test_token_bits_never_collide_within_a_position():
    k0, k1 = S.keys(7, torch.tensor([3]), torch.tensor([11]), S.COUPLED)
    bits = S.token_bits(k0, k1, torch.arange(50_000))
    assert bits.unique().numel() == 50_000  # a bijection of the token id


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


RNG_WORDS = ("rand", "random", "uniform", "normal", "bernoulli", "multinomial", "exponential",
             "poisson", "geometric", "cauchy", "lift_fresh")


@pytest.mark.parametrize("mode", S.MODES)
def test_choices_use_no_device_rng_no_upload_and_no_host_read(mode):
    """Noise comes from integer hashing only; nothing is uploaded or read back, with a
    draft model's logits or with a point-mass drafter's (None)."""
    s = Sampling(temperature=0.7, top_k=5, top_p=0.9, seed=3, mode=mode)
    logits, drafts = torch.randn(4, 3, 32), torch.randint(0, 32, (4, 2))
    rows, t = torch.arange(4), torch.arange(3)[None, :] + torch.tensor([[0], [4], [1], [9]])
    draft_logits = torch.randn(4, 3, 32)
    log = OpLog()
    with no_host_transfers(), log:
        S.choose(logits, s, rows, t, drafts, draft_logits)
        S.choose(logits, s, rows, t, drafts, None)
        S.draft_choice(logits[:, 0], s, rows, t[:, 0])
    assert log.ops and not [o for o in log.ops if any(w in o for w in RNG_WORDS)], log.ops


# -- uniformity --------------------------------------------------------------------------

def test_uniforms_fill_64_equal_bins_evenly():
    """Over 20 seeds: pooled, one chi-square at alpha 1e-3; per seed, p-values spread as
    uniform ones do (at most 2 of 20 below 0.01, where 0.2 are expected)."""
    rows, t = many_keys(16_000)
    us = [S.uniform(*S.keys(seed, rows, t, S.ACCEPT)) for seed in range(20)]
    expected = torch.full((64,), 250.0, dtype=torch.float64)
    per_seed = [chi2_p(torch.bincount((u * 64).long(), minlength=64), expected) for u in us]
    u = torch.cat(us)
    assert bool(((u > 0) & (u < 1)).all())
    assert chi2_p(torch.bincount((u * 64).long(), minlength=64), expected * 20) > 1e-3
    assert sum(p < 0.01 for p in per_seed) <= 2, per_seed


def test_uniforms_of_neighbouring_positions_and_streams_are_uncorrelated():
    rows, t = many_keys(40_000)
    a = S.uniform(*S.keys(5, rows, t, S.ACCEPT))
    for other in (S.uniform(*S.keys(5, rows, t + 1, S.ACCEPT)),
                  S.uniform(*S.keys(5, rows, t, S.RESAMPLE)),
                  S.uniform(*S.keys(6, rows, t, S.ACCEPT))):
        r = torch.corrcoef(torch.stack([a, other]))[0, 1]
        assert abs(float(r)) < 4 / math.sqrt(40_000)  # 4 standard errors


def test_gumbel_noise_has_the_gumbel_mean_and_variance():
    rows, t = many_keys(2_000)
    g = S.gumbel(1, rows, t, torch.arange(64)).double().flatten()  # 128000 values
    euler = 0.5772156649
    assert abs(float(g.mean()) - euler) < 0.02 and abs(float(g.var()) - math.pi**2 / 6) < 0.05


@pytest.mark.parametrize("s", [Sampling(temperature=1.0), Sampling(temperature=0.5, top_k=4),
                               Sampling(temperature=1.3, top_p=0.7)])
def test_coupled_choices_over_many_keys_follow_the_distribution(s):
    """Gumbel-max over the candidate set samples p (chi-square, alpha 1e-3)."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.4, 0.3, 0.0, -0.5, -1.0])
    rows, t = many_keys(30_000)
    picks = S.coupled_choice(logits.expand(30_000, -1), s, rows, t)
    p = S.distribution(logits, s)
    keep = p * 30_000 >= 5
    counts = torch.bincount(picks, minlength=8)
    assert int(counts[~keep].sum()) <= 30_000 * float(p[~keep].sum()) * 3 + 5
    assert int(counts[p == 0].sum()) == 0
    assert chi2_p(counts[keep], 30_000 * p[keep] / float(p[keep].sum()) * float(counts[keep].sum()) / 30_000) > 1e-3


def test_inverse_cdf_samples_follow_the_distribution():
    p = torch.tensor([0.1, 0.0, 0.35, 0.05, 0.5], dtype=torch.float64)
    rows, t = many_keys(40_000)
    picks = S.sample_cdf(p.expand(40_000, -1), S.uniform(*S.keys(3, rows, t, S.RESAMPLE)))
    counts = torch.bincount(picks, minlength=5)
    assert int(counts[1]) == 0
    assert chi2_p(counts[p > 0], 40_000 * p[p > 0]) > 1e-3


@given(st.lists(st.floats(0, 1), min_size=2, max_size=12), st.floats(0, 1, exclude_max=True))
def test_inverse_cdf_never_picks_a_token_of_probability_zero(weights, u):
    p = torch.tensor(weights, dtype=torch.float64)
    if float(p.sum()) == 0:
        p[0] = 1.0
    p = p / p.sum()
    for v in (u, 1 - 2**-53, 2**-54):
        pick = int(S.sample_cdf(p[None], torch.tensor([v], dtype=torch.float64))[0])
        assert p[pick] > 0


# -- the candidate set ---------------------------------------------------------------------

def test_top_k_keeps_exactly_k_and_breaks_ties_toward_smaller_ids():
    x = torch.tensor([2.0, 1.0, 3.0, 2.0, 2.0, 0.0])
    for k, want in ((1, [2]), (2, [0, 2]), (3, [0, 2, 3]), (4, [0, 2, 3, 4]), (5, [0, 1, 2, 3, 4])):
        kept = S.scaled(x, Sampling(top_k=k)) > -math.inf
        assert kept.nonzero().flatten().tolist() == want, k
    x = torch.tensor([-math.inf, 1.0, -math.inf, -math.inf])  # fewer finite values than k
    assert (S.distribution(x, Sampling(top_k=2)) > 0).tolist() == [False, True, False, False]


def test_top_p_keeps_the_shortest_prefix_reaching_the_mass():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    for top_p, want in ((0.5, 1), (0.51, 2), (0.8, 2), (0.81, 3), (1.0, 4)):
        kept = S.scaled(probs.log(), Sampling(top_p=top_p)) > -math.inf
        assert int(kept.sum()) == want and bool(kept[:want].all()), top_p


def test_top_p_keeps_equal_probabilities_together():
    x = torch.tensor([1.0, 0.0, 0.0, 0.0, -5.0])
    kept = S.scaled(x, Sampling(top_p=0.75)) > -math.inf  # the three tied tokens stay or go
    assert kept.tolist() == [True, True, True, True, False]


@settings(max_examples=30)
@given(st.lists(st.floats(-8, 8), min_size=2, max_size=16, unique=True), st.integers(0, 6),
       st.floats(0.05, 1.0), st.randoms(use_true_random=False))
def test_the_set_does_not_depend_on_the_order_of_the_vocabulary(values, top_k, top_p, rnd):
    """(Distinct values: among equal ones top-k prefers smaller ids, by definition.)"""
    x = torch.tensor(values)
    s = Sampling(top_k=top_k, top_p=top_p)
    perm = list(range(len(values)))
    rnd.shuffle(perm)
    perm = torch.tensor(perm)
    assert torch.equal(S.scaled(x, s)[perm], S.scaled(x[perm], s))
    assert bool((S.scaled(x, s) > -math.inf)[x.argmax()])  # the top token always stays


# -- rejection sampling's choice -----------------------------------------------------------

@settings(max_examples=40)
@given(st.integers(1, 4), st.integers(0, 10_000), st.booleans())
def test_a_rejected_draft_is_never_the_choice_at_its_position(k, seed, point_mass):
    """So the greedy acceptance rule over the choices gives the accepted count."""
    g = torch.Generator().manual_seed(seed)
    logits, dl = torch.randn(16, k + 1, 6, generator=g), torch.randn(16, k + 1, 6, generator=g)
    s = Sampling(temperature=0.9, top_k=4, seed=seed, mode="rejection")
    draft_logits = None if point_mass else dl
    drafts = torch.randint(0, 6, (16, k), generator=g) if point_mass else \
        S.sample_cdf(S.distribution(dl[:, :k], s), torch.rand(16, k, generator=g, dtype=torch.float64))
    rows, t = torch.arange(16), torch.arange(k + 1).expand(16, -1)
    out = S.rejection_choices(logits, s, rows, t, drafts, draft_logits)
    p = S.distribution(logits[:, :k], s)
    q = S.draft_distribution(drafts, draft_logits, s, 6)
    u = S.uniform(*S.keys(seed, rows[:, None], t[:, :k], S.ACCEPT))
    accepted = S.accept_draft(p, q, drafts, u)
    assert torch.equal(out[:, :k] == drafts, accepted)
    assert bool((S.distribution(logits, s).gather(-1, out[..., None]) > 0).all())  # in p's set


def test_k_zero_rejection_sampling_is_plain_sampling_of_p():
    logits = torch.randn(8, 1, 10, generator=torch.Generator().manual_seed(1))
    s = Sampling(seed=4, mode="rejection")
    rows, t = torch.arange(8), torch.zeros(8, 1, dtype=torch.long)
    out = S.choose(logits, s, rows, t, torch.zeros(8, 0, dtype=torch.long))
    want = S.sample_cdf(S.distribution(logits, s), S.uniform(*S.keys(4, rows[:, None], t, S.RESAMPLE)))
    assert torch.equal(out, want)


# -- parameters ----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, words", [
    ({"temperature": 0}, ValueError, "temperature must be a finite number > 0"),
    ({"temperature": -1.0}, ValueError, "sampling=None"),
    ({"temperature": float("inf")}, ValueError, "finite number > 0"),
    ({"temperature": float("nan")}, ValueError, "finite number > 0"),
    ({"temperature": "hot"}, TypeError, "temperature must be a finite number"),
    ({"temperature": True}, TypeError, "bool"),
    ({"top_k": -1}, ValueError, "top_k must be an integer >= 0, got -1"),
    ({"top_k": 2.5}, TypeError, "top_k must be an integer"),
    ({"top_p": 0}, ValueError, "top_p must be a number in (0, 1]"),
    ({"top_p": 1.5}, ValueError, "top_p must be a number in (0, 1]"),
    ({"top_p": None}, TypeError, "top_p must be a number"),
    ({"seed": -3}, ValueError, "seed must be an integer in [0, 18446744073709551615], got -3"),
    ({"seed": 2**64}, ValueError, "seed must be an integer in"),
    ({"seed": 1.0}, TypeError, "seed must be an integer"),
    ({"mode": "greedy"}, ValueError, "sampling mode must be one of coupled, rejection; got 'greedy'"),
])
def test_bad_parameters_are_refused_with_the_rule(kwargs, error, words):
    with pytest.raises(error) as e:
        Sampling(**kwargs)
    assert words in str(e.value)


def test_generate_and_reference_refuse_a_sampling_that_is_not_a_sampling():
    target = models.tiny("llama")
    for call in (lambda: specdec.generate(target, [[3, 4]], max_new_tokens=2, sampling={"temperature": 1}),
                 lambda: specdec.reference_generate(target, [[3, 4]], max_new_tokens=2, sampling=0.7)):
        with pytest.raises(TypeError, match=r"sampling must be a specdec.Sampling\(.*\) or None"):
            call()


def test_margins_are_refused_in_rejection_mode():
    with pytest.raises(ValueError, match="return_margins needs greedy decoding or coupled"):
        specdec.reference_generate(models.tiny("llama"), [[3, 4]], max_new_tokens=2,
                                   return_margins=True, sampling=Sampling(mode="rejection"))


def test_numpy_and_torch_integers_are_integers():
    import numpy as np

    s = Sampling(top_k=np.int64(3), seed=torch.tensor(5), temperature=np.float32(0.5))
    assert (s.top_k, s.seed, type(s.top_k), type(s.seed)) == (3, 5, int, int)


@settings(max_examples=40)
@given(st.integers(0, 10_000), st.sampled_from((0, 1, 2, 5, 31, 32, 40)),
       st.sampled_from((1.0, 0.9, 0.4)), st.booleans())
def test_the_top_k_shortcut_chooses_as_the_whole_vocabulary_would(seed, top_k, top_p, ties):
    """The coupled choice over the k candidates equals the argmax of the full-vocabulary
    scores, and ``distribution`` is their softmax (ties in the logits included)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 3, 32, generator=g)
    if ties:
        logits = logits.round()
    s = Sampling(temperature=0.8, top_k=top_k, top_p=top_p, seed=seed)
    rows, t = torch.arange(6)[:, None], torch.arange(3)[None, :] + 5
    full = S.coupled_scores(logits, s, rows, t)
    assert torch.equal(S.coupled_choice(logits, s, rows, t), full.argmax(dim=-1))
    assert int((full > -math.inf).sum(dim=-1).max()) <= (top_k or 32)
    p = S.distribution(logits, s)
    assert torch.allclose(p, torch.softmax(S.scaled(logits, s).double(), dim=-1))
