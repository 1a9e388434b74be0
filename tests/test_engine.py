"""Specification of the EQSPEC engine: its output equals the target's greedy decoding."""

from __future__ import annotations

import pytest
import torch

import specdec
from specdec import drafters, models
from harness import MIXED_LENGTHS, make_drafter, random_prompts
from oracle import hf_greedy
from conftest import tiny_pair

NEW = 24  # new tokens per row in the equivalence grid
_REF: dict = {}


def reference(family: str, prompts_key: str = "mixed"):
    """Batch-1 greedy ids of the family's target on the mixed-length prompts."""
    if (family, prompts_key) not in _REF:
        target, _ = tiny_pair(family)
        prompts = random_prompts(MIXED_LENGTHS, models.TINY_VOCAB, seed=1)
        _REF[family, prompts_key] = (prompts, specdec.reference_generate(target, prompts, max_new_tokens=NEW))
    return _REF[family, prompts_key]


def grid_drafter(kind: str, family: str, ref):
    return make_drafter(kind, tiny_pair(family)[1], ref, models.TINY_VOCAB)


def test_reference_equals_hugging_face_generate_at_batch_1(family):
    target, _ = tiny_pair(family)
    prompts, ref = reference(family)
    stops = models.stop_token_ids(target)
    assert ref == [hf_greedy(target, p, NEW, stops) for p in prompts]


def test_left_padded_reference_equals_batch_1(family):
    target, _ = tiny_pair(family)
    prompts, ref = reference(family)
    assert specdec.reference_generate(target, prompts, max_new_tokens=NEW, batch_size=8) == ref


@pytest.mark.parametrize("drafter_kind", ["ngram", "model", "scripted"])
@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_eqspec_equals_batch_1_greedy(family, batch_size, k, drafter_kind):
    target, _ = tiny_pair(family)
    prompts, ref = reference(family)
    res = specdec.generate(target, prompts, drafter=grid_drafter(drafter_kind, family, ref),
                           k=k, batch_size=batch_size, max_new_tokens=NEW)
    for i, (got, want) in enumerate(zip(res.sequences, ref)):
        assert got == want, f"row {i} (prompt length {len(prompts[i])}) diverges"


def test_partial_acceptance_is_exercised(family):
    """The grid above is only meaningful if drafts are sometimes accepted and sometimes not.
    (Every draft verified: policy="fixed"; the default policy drafts by what earlier calls
    on the model measured, so how much it drafts here depends on the tests before.)"""
    target, _ = tiny_pair(family)
    prompts, ref = reference(family)
    for kind in ("model", "scripted"):
        res = specdec.generate(target, prompts, drafter=grid_drafter(kind, family, ref), k=4,
                               batch_size=8, max_new_tokens=NEW, policy="fixed")
        assert 0.0 < res.stats.acceptance < 1.0, (kind, res.stats.acceptance)


class AcceptedRecorder:
    """A hook that records (draft limit, accepted) per step at the commit phase."""

    def __init__(self):
        self.steps = []

    def __call__(self, phase, view):
        if phase == "commit":
            self.steps.append((view.draft_limit.clone(), view.accepted.clone(), view.committed.clone()))


@pytest.mark.parametrize("strategy", ["eqspec", "exspec", "holes"])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_draft_equal_to_target_accepts_every_draft(family, k, strategy):
    # under every strategy: a draft model's cache kept one slot off (EXSPEC's pool written
    # back late) keeps the outputs exact and shows only here, as drafts rejected
    target, _ = tiny_pair(family)
    prompts, ref = reference(family)
    for drafter in (drafters.ScriptedDrafter(ref), drafters.ModelDrafter(target)):
        rec = AcceptedRecorder()
        res = specdec.generate(target, prompts, drafter=drafter, k=k, batch_size=8,
                               max_new_tokens=NEW, hooks=[rec], strategy=strategy)
        assert res.sequences == ref
        assert rec.steps
        for limit, accepted, committed in rec.steps:
            assert torch.equal(accepted, limit), (type(drafter).__name__, limit, accepted)
            assert bool(((committed >= 1) & (committed <= k + 1)).all())


def test_exspec_draft_pool_written_back_one_slot_late_is_seen_as_rejected_drafts(monkeypatch):
    # the fault keeps every output exact; only a drafter equal to the target, which must
    # accept every draft, shows it
    from specdec.strategies import exspec

    target = models.tiny("llama")
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16], [3], [4, 4, 5]]
    ref = specdec.reference_generate(target, prompts, max_new_tokens=12, stop_token_ids=[])
    orig = exspec.write_back

    class Late:
        def __init__(self, real):
            self.real = real

        def write_back(self, rows, cache, first, dest):
            self.real.write_back(rows, cache, first, dest + 1)

    def write_back(ctx, state, pool, *rest):
        real = pool.draft_kv
        pool.draft_kv = Late(real)
        try:
            return orig(ctx, state, pool, *rest)
        finally:
            pool.draft_kv = real

    def run():
        return specdec.generate(target, prompts, drafter=drafters.ModelDrafter(target),
                                strategy="exspec", k=4, batch_size=2, max_new_tokens=12,
                                stop_token_ids=[])

    res = run()
    assert res.sequences == ref and res.stats.accepted == res.stats.drafted
    monkeypatch.setattr(exspec, "write_back", write_back)
    res = run()
    assert res.sequences == ref and res.stats.accepted < res.stats.drafted


def test_committed_tokens_per_step_are_between_1_and_k_plus_1(family):
    target, _ = tiny_pair(family)
    prompts, ref = reference(family)
    rec = AcceptedRecorder()
    specdec.generate(target, prompts, drafter=grid_drafter("model", family, ref), k=4,
                     batch_size=8, max_new_tokens=NEW, hooks=[rec])
    for limit, accepted, committed in rec.steps:
        assert bool(((committed >= 1) & (committed <= 5) & (accepted <= limit)).all())


def test_hooks_see_every_phase_in_order():
    target, _ = tiny_pair("llama")
    prompts, _ = reference("llama")
    phases = []
    specdec.generate(target, prompts[:3], k=2, batch_size=3, max_new_tokens=5,
                     hooks=[lambda phase, view: phases.append(phase)])
    assert phases[0] == "prefill"
    body = phases[1:]
    for i in range(0, len(body) - 4, 4):
        if body[i] == "prefill":
            break
        assert body[i : i + 3] == ["draft", "verify", "commit"]
        assert body[i + 3] in ("realign", "prefill", "draft") or i + 3 == len(body)


# -- edge cases (tests/test_strategies.py runs them for every strategy) ------------------

def test_eos_inside_prompt_reference_equals_hugging_face():
    target, _ = tiny_pair("qwen3")
    stop = models.stop_token_ids(target)[0]
    prompts = random_prompts((9, 3, 20), models.TINY_VOCAB, seed=5)
    prompts[0][3] = stop  # eos inside a prompt must neither stop nor pad anything
    prompts[1] = [stop] + prompts[1]  # and at its start
    ref = specdec.reference_generate(target, prompts, max_new_tokens=16)
    assert [hf_greedy(target, p, 16, [stop]) for p in prompts] == ref


def test_budget_never_exceeded_and_draft_length_clipped_per_row():
    target, _ = tiny_pair("llama")
    prompts, ref = reference("llama")
    rec = AcceptedRecorder()
    limits = []
    res = specdec.generate(target, prompts, drafter=drafters.ScriptedDrafter(ref), k=8,
                           batch_size=8, max_new_tokens=NEW, policy="fixed",
                           hooks=[rec, lambda ph, v: limits.append((v.draft_limit.clone(), v.budgets - v.generated)) if ph == "draft" else None])
    assert all(len(s) <= NEW for s in res.sequences)
    for limit, remaining in limits:  # every row drafts k = 8 (fixed): min(8, remaining - 1)
        assert torch.equal(limit, torch.clamp(remaining - 1, 0, 8))


def test_sliding_window_family_is_exercised_beyond_its_window():
    target, _ = tiny_pair(models.SLIDING_FAMILY)
    assert target.config.sliding_window < max(MIXED_LENGTHS)


@pytest.mark.parametrize("b", range(1, 13))
def test_rows_leaving_keeps_every_staying_row_once_and_moves_only_the_tail(b):
    # every finished pattern of b rows (all 2^b, the all-finished one aside)
    from specdec.batch import rows_leaving

    bits = (torch.arange(2**b)[:, None] >> torch.arange(b)) & 1
    assert rows_leaving(torch.zeros(b, dtype=torch.bool), [False] * b) is None
    for pattern in bits[1:-1].bool():
        host = pattern.tolist()
        lv = rows_leaving(pattern, host)
        live = [i for i, f in enumerate(host) if not f]
        assert lv.kept == len(live)
        assert sorted(lv.order.tolist()) == live  # a permutation of the staying rows
        order = lv.order.tolist()
        assert all(order[j] == j for j in range(lv.kept) if not host[j])  # head rows stay
        assert lv.moved_to.tolist() == [j for j in range(lv.kept) if host[j]]
        assert lv.moved_from.tolist() == [order[j] for j in lv.moved_to.tolist()]
        assert all(i >= lv.kept for i in lv.moved_from.tolist())
