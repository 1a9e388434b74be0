"""A prefill computes no padding it can leave out (``specdec.cache.prefill``).

Left-padded prompts of mixed lengths spend most of a batched prefill on padding (the
built-in prompts: 44-63% of the tokens a batch of 8 computes). The prefill of the engine
and of the plain batched loop splits the rows, sorted by length, into the forwards that
``prefill_groups`` chooses (``split_cost``: per device type, at least a forward's
dispatch), each over the last columns its longest row needs, and copies their caches into
the batch's. Specified here:

- the split is optimal: no partition of the rows into forwards costs less (tokens
  computed plus the cost of a forward), against every partition of small batches;
- a row alone in its forward gets exactly (bit for bit) the logits and K/V of a batch-1
  prefill, and every row of a shared forward what that forward computes; valid slots
  sit where a one-forward prefill puts them, and every other slot holds a finite value;
- off a CPU, where no split pays, or where the model is so small that a forward's
  dispatch outweighs the padding, the prefill is one forward, as before;
- decoding is unchanged: every strategy and the plain loop, on every tiny family, with
  every prefill split as finely as it goes, equal batch-1 greedy decoding; and the
  strict Monitor and ``guard_model`` (with its content rules) find nothing to report.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import transformers
from hypothesis import given, settings, strategies as st

import specdec
from conftest import tiny_pair
from invariants import Monitor, guard_model
from specdec import cache as cache_mod
from specdec import drafters, models
from specdec.batch import left_pad
from specdec.strategies import names as strategy_names

torch.set_num_threads(1)
transformers.logging.set_verbosity_error()

#: distinct lengths (so that with no cost per forward every row is alone in its forward)
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
           [3], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37, 38],
           [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57]]


def cost(groups, counts, per_forward):
    return sum((e - a) * counts[e - 1] + per_forward for a, e in groups)


def partitions(first: int, n: int):
    """Every split of rows first..n-1 into contiguous ranges."""
    for cuts in itertools.product((False, True), repeat=max(n - first - 1, 0)):
        bounds = [first] + [first + 1 + i for i, c in enumerate(cuts) if c] + [n]
        yield list(zip(bounds, bounds[1:])) if n > first else []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=8), st.sampled_from([0, 1, 8, 64, 1e9]))
def test_the_split_is_the_cheapest_partition(counts, per_forward):
    counts = sorted(counts)
    groups = cache_mod.prefill_groups(counts, per_forward)
    first = next((i for i, c in enumerate(counts) if c > 0), len(counts))
    # every row with a valid token in exactly one range, in order; rows with none in none
    assert [i for a, e in groups for i in range(a, e)] == list(range(first, len(counts)))
    best = min(cost(p, counts, per_forward) for p in partitions(first, len(counts)))
    assert cost(groups, counts, per_forward) == best
    if per_forward >= 1e9 and first < len(counts):
        assert groups == [(first, len(counts))]


def force_split(monkeypatch, table):
    """Split costs ``table`` (per device type, in tokens), with no floor for dispatch: the
    tiny models' forwards are dispatch-bound, so by default their prefills rarely split."""
    monkeypatch.setattr(cache_mod, "SPLIT_FORWARD_TOKENS", table)
    monkeypatch.setattr(cache_mod, "FORWARD_DISPATCH_FLOPS", 0.0)


def prefill_both(target, prompts, per_forward, monkeypatch):
    """(split cache, its logits, one-forward cache, its logits, valid) of one prefill."""
    tokens, valid, positions, _ = left_pad(prompts)
    counts = [len(p) for p in prompts]
    caches, logits = [], []
    for split in (per_forward, None):
        force_split(monkeypatch, {} if split is None else {"cpu": split})
        c = cache_mod.new_cache(target, tokens.shape[1] + 4)
        logits.append(cache_mod.prefill(target, tokens, positions, valid, c, counts))
        caches.append(c)
    return caches[0], logits[0], caches[1], logits[1], valid


@pytest.mark.engine
def test_a_row_alone_in_its_forward_gets_a_batch_1_prefill_exactly(family, monkeypatch):
    target, _ = tiny_pair(family)
    split, got, whole, one, valid = prefill_both(target, PROMPTS, 0, monkeypatch)
    assert split.width == whole.width == valid.shape[1]
    kv = split.slab.kv
    assert torch.isfinite(kv).all()
    width = valid.shape[1]
    for b, p in enumerate(PROMPTS):
        alone = cache_mod.new_cache(target, len(p))
        t, v, pos, _ = left_pad([p])
        ref = cache_mod.forward(target, t, pos, v, alone, last_logits=True)
        assert torch.equal(got[b], ref[0]), b
        # its slots: the last len(p) of the batch's width, bit for bit the batch-1 cache's
        assert torch.equal(kv[:, :, b, :, width - len(p) : width], alone.slab.kv[:, :, 0, :, : len(p)]), b
        # and the one-forward prefill puts the same states there (up to rounding)
        mine = slice(width - len(p), width)
        assert torch.allclose(kv[:, :, b, :, mine], whole.slab.kv[:, :, b, :, mine],
                              atol=1e-5, rtol=1e-4), b
    assert torch.allclose(got, one, atol=1e-4, rtol=1e-4)


@pytest.mark.engine
def test_rows_sharing_a_forward_get_that_forward(monkeypatch):
    target, _ = tiny_pair("llama")
    prompts = [[5, 6, 7], [8, 9, 10, 11], [3] * 20, [4] * 19]  # two pairs, far apart
    assert cache_mod.prefill_groups(sorted(len(p) for p in prompts), 8) == [(0, 2), (2, 4)]
    split, got, whole, one, valid = prefill_both(target, prompts, 8, monkeypatch)
    width = valid.shape[1]
    for pair in ([0, 1], [2, 3]):
        ps = [prompts[i] for i in pair]
        own = cache_mod.new_cache(target, 20)
        t, v, pos, _ = left_pad(ps)
        ref = cache_mod.forward(target, t, pos, v, own, last_logits=True)
        m = t.shape[1]
        assert torch.equal(got[pair], ref)
        assert torch.equal(split.slab.kv[:, :, pair, :, width - m : width], own.slab.kv[:, :, :, :, :m])
    assert torch.allclose(got, one, atol=1e-4, rtol=1e-4)


def count_forwards(target):
    calls = []
    handle = target.register_forward_pre_hook(lambda m, a, k: calls.append(k["input_ids"].shape),
                                              with_kwargs=True)
    return calls, handle


@pytest.mark.engine
def test_one_forward_where_no_split_pays_or_off_the_listed_devices(monkeypatch):
    target, _ = tiny_pair("llama")
    tokens, valid, positions, _ = left_pad(PROMPTS)
    counts = [len(p) for p in PROMPTS]
    for table in ({"cpu": 1e9}, {"cuda": 0}, {}):
        force_split(monkeypatch, table)
        calls, handle = count_forwards(target)
        try:
            cache_mod.prefill(target, tokens, positions, valid, cache_mod.new_cache(target, 30), counts)
        finally:
            handle.remove()
        assert calls == [tokens.shape], table
    force_split(monkeypatch, {"cpu": 0})
    calls, handle = count_forwards(target)
    try:
        cache_mod.prefill(target, tokens, positions, valid, cache_mod.new_cache(target, 30), counts)
    finally:
        handle.remove()
    assert sorted(calls) == sorted(torch.Size([1, n]) for n in counts)


@pytest.mark.engine
def test_a_dispatch_bound_model_is_not_split():
    """A forward costs at least its dispatch: on the tiny models (90k parameters) that is
    worth some 200 tokens of prefill, more than a split of short prompts saves."""
    target, _ = tiny_pair("llama")
    params = sum(p.numel() for p in target.parameters())
    cpu = torch.device("cpu")
    assert cache_mod.split_cost(target, cpu) == cache_mod.FORWARD_DISPATCH_FLOPS / (2 * params) > 200
    assert cache_mod.split_cost(target, torch.device("meta")) is None  # not a listed device
    tokens, valid, positions, _ = left_pad(PROMPTS)
    calls, handle = count_forwards(target)
    try:
        cache_mod.prefill(target, tokens, positions, valid, cache_mod.new_cache(target, 30),
                          [len(p) for p in PROMPTS])
    finally:
        handle.remove()
    assert calls == [tokens.shape]


@pytest.mark.engine
def test_decoding_after_a_split_prefill_is_batch_1_greedy(family, monkeypatch):
    """Every prefill split as finely as it goes (no cost per forward): the plain batched
    loop and every strategy equal batch-1 greedy decoding, with the strict Monitor on."""
    target, draft = tiny_pair(family)
    expected = specdec.reference_generate(target, PROMPTS, max_new_tokens=12, stop_token_ids=[])
    force_split(monkeypatch, {"cpu": 0})
    calls, handle = count_forwards(target)
    try:
        assert specdec.reference_generate(target, PROMPTS, max_new_tokens=12, stop_token_ids=[],
                                          batch_size=4) == expected
        drafter = drafters.ModelDrafter(draft) if family in ("llama", "mistral") \
            else drafters.NGramDrafter()
        for strategy in strategy_names():
            mon = Monitor("strict")
            try:
                res = specdec.generate(target, PROMPTS, drafter=drafter, strategy=strategy, k=3,
                                       batch_size=4, max_new_tokens=12, stop_token_ids=[],
                                       policy="fixed", hooks=[mon])
            except NotImplementedError:  # a strategy this model cannot serve
                continue
            assert res.sequences == expected, strategy
    finally:
        handle.remove()
    assert any(shape[0] == 1 for shape in calls)  # the split did happen


@pytest.mark.engine
@pytest.mark.parametrize("strategy", ["eqspec", "holes"])
def test_the_guard_and_its_content_rules_follow_a_split_prefill(strategy, monkeypatch):
    """guard_model sees the split's forwards, each into a cache of its own, and then the
    batch's cache, filled by copies it never saw written: its content rules find every
    slot by fingerprint, and nothing is flagged or left unknown."""
    target, _ = tiny_pair("llama")
    force_split(monkeypatch, {"cpu": 0})
    with guard_model(target, mode="strict", prompts=PROMPTS, max_new_tokens=12,
                     stop_token_ids=[]) as guard:
        res = specdec.generate(target, PROMPTS, drafter=drafters.NGramDrafter(), strategy=strategy,
                               k=3, batch_size=4, max_new_tokens=12, stop_token_ids=[],
                               policy="fixed")
        guard.check_outputs(res.sequences)
    assert guard.content.unknown == 0 and guard.forwards > 4
    assert res.sequences == specdec.reference_generate(target, PROMPTS, max_new_tokens=12,
                                                       stop_token_ids=[])
