"""Per-row draft lengths (``specdec.policy``) and the n-gram drafter that feeds them.

The policies: every row's k_b is in 0..k, the verify width is max k_b + 1 (a step where
no row drafts is plain decoding), the fixed policy is the behaviour before per-row
lengths, the adaptive one drafts only where its expected tokens per unit of cost beat a
plain step and costs no host read. The n-gram drafter: longest match first, over every
suffix length, equal to a per-row Python statement of the rule, periodic continuation in
repetition loops, and the evidence it gives after a commit is what it would see at the
next draft. (Forced per-row patterns under the strict Monitor: tests/test_properties.py.)
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import invariants
import specdec
from conftest import tiny_pair
from harness import random_prompts
from invariants.testing import TransferLog, no_host_transfers
from specdec import drafters, models, phases, policy
from specdec.batch import left_pad

K = 4
NEW = 12


def repetitive_prompts():
    """Prompts that quote themselves (the n-gram drafter finds matches) and one that does not."""
    base = random_prompts((10,), models.TINY_VOCAB, seed=3)[0]
    return [base * 3, base[:4] * 5 + base, random_prompts((25,), models.TINY_VOCAB, seed=4)[0], [7, 8]]


class Widths:
    """Hook: per step, the verify's drafts (view.k at verify) and the rows' draft limits."""

    def __init__(self):
        self.steps = []

    def __call__(self, phase, view):
        if phase == "verify":
            self.steps.append((view.k, view.drafts.shape[1], view.forward.input_ids.shape[1],
                               view.draft_limit.tolist()))


# -- the engine with each policy -------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["eqspec", "exspec", "holes"])
@pytest.mark.parametrize("chosen", ["adaptive", "fixed"])
def test_every_policy_is_exact_under_the_strict_monitor(strategy, chosen):
    target, _ = tiny_pair("llama")
    prompts = repetitive_prompts()
    ref = specdec.reference_generate(target, prompts, max_new_tokens=NEW)
    mon = invariants.Monitor(mode="strict")
    rec = Widths()
    res = specdec.generate(target, prompts, k=K, batch_size=3, max_new_tokens=NEW,
                           strategy=strategy, policy=chosen, hooks=[mon, rec])
    assert mon.check() == []
    assert res.sequences == ref
    for k_view, drafts, inputs, limits in rec.steps:
        assert drafts == k_view and inputs == k_view + 1  # the verify covers draft_k + 1
        assert all(0 <= lim <= k_view for lim in limits)
    if chosen == "fixed":
        assert set(res.stats.widths) == {K + 1} and res.stats.mean_draft_length == K
    assert sum(res.stats.widths.values()) == res.stats.steps


def test_fixed_policy_is_the_behaviour_before_per_row_lengths():
    # every row drafts k: the same steps and acceptance as a forced pattern of all k
    target, _ = tiny_pair("qwen3")
    prompts = repetitive_prompts()
    runs = []
    for chosen in ("fixed", policy.ForcedPolicy([[K]] * len(prompts))):
        hist = []
        res = specdec.generate(target, prompts, k=K, batch_size=3, max_new_tokens=NEW,
                               policy=chosen, hooks=[lambda ph, v: hist.append(
                                   (v.draft_limit.tolist(), v.accepted.tolist())) if ph == "commit" else None])
        runs.append((res.sequences, hist, res.stats.steps))
    assert runs[0] == runs[1]


def test_a_step_where_no_row_drafts_is_a_plain_decode_step():
    target, _ = tiny_pair("llama")
    prompts = repetitive_prompts()
    ref = specdec.reference_generate(target, prompts, max_new_tokens=NEW)
    rec = Widths()
    res = specdec.generate(target, prompts, k=K, batch_size=4, max_new_tokens=NEW,
                           policy=policy.ForcedPolicy([[0]] * len(prompts)), hooks=[rec])
    assert res.sequences == ref
    assert res.stats.widths == {1: res.stats.steps} and res.stats.drafted == 0
    assert all(inputs == 1 for _, _, inputs, _ in rec.steps)


def test_one_drafting_row_sets_the_width_and_the_others_use_none():
    target, _ = tiny_pair("llama")
    prompts = repetitive_prompts()
    rec = Widths()
    specdec.generate(target, prompts, k=K, batch_size=4, max_new_tokens=NEW,
                     policy=policy.ForcedPolicy([[0, 3], [0], [0, 0, 2], [0]]), hooks=[rec])
    widths = [drafts for _, drafts, _, _ in rec.steps]
    assert widths[0] == 0 and widths[1] == 3 and widths[2] == 3
    assert rec.steps[1][3][1:] == [0, 0, 0]  # rows that do not draft may use nothing


def test_policies_are_checked_at_the_boundary():
    target, _ = tiny_pair("llama")
    with pytest.raises(ValueError, match=r"policy must be one of \('adaptive', 'fixed'\), "
                                         r"'adaptive:NAME=VALUE,..' or a DraftPolicy object"):
        specdec.generate(target, [[5, 6]], max_new_tokens=2, policy="greedy")
    with pytest.raises(ValueError, match="drain_margin takes a number, got 'lots'"):
        specdec.generate(target, [[5, 6]], max_new_tokens=2, policy="adaptive:drain_margin=lots")
    with pytest.raises(ValueError, match="AdaptivePolicy drain_margin"):
        specdec.generate(target, [[5, 6]], max_new_tokens=2, policy="adaptive:drain_margin=-1")
    with pytest.raises(TypeError, match="DraftPolicy methods .* without begin, admit"):
        specdec.generate(target, [[5, 6]], max_new_tokens=2, policy=object())
    with pytest.raises(ValueError, match="ForcedPolicy has 1 patterns for 2 prompts"):
        specdec.generate(target, [[5, 6], [7]], max_new_tokens=2, policy=policy.ForcedPolicy([[1]]))


def test_an_adaptive_policy_passed_again_keeps_what_it_learned():
    target, _ = tiny_pair("llama")
    prompts = repetitive_prompts()
    chosen = policy.AdaptivePolicy()
    specdec.generate(target, prompts, k=K, batch_size=4, max_new_tokens=NEW, policy=chosen)
    tries = chosen.tries.clone()
    measured = {b: dict(t) for b, t in chosen.costs.seconds.items()}
    specdec.generate(target, prompts, k=K, batch_size=4, max_new_tokens=NEW, policy=chosen)
    assert measured and chosen.tries.sum() >= tries.sum()
    assert set(chosen.costs.seconds) >= set(measured)



class Priced(policy.StepCosts):
    """Step costs fixed at r(w) = 1 + slope (w - 1) (nothing measured counts)."""

    def __init__(self, slope):
        super().__init__()
        self.fixed = slope

    def ratios(self, rows, widths):
        return [1.0 + self.fixed * w for w in range(widths)]


def test_adaptive_calls_on_one_model_share_its_calibration():
    # policy="adaptive" starts from what the earlier calls on the same model measured
    target, _ = tiny_pair("llama")
    cal = policy.calibration(target)
    assert policy.resolve("adaptive", target).calibration is cal
    assert policy.resolve("adaptive", tiny_pair("qwen3")[0]).calibration is not cal
    measured, cal.costs = cal.costs, Priced(0.05)  # cheap width: the call drafts
    try:
        specdec.generate(target, repetitive_prompts(), k=K, batch_size=4, max_new_tokens=NEW)
        assert cal.costs.seconds  # step costs measured by this call stay with the model
    finally:
        cal.costs = measured
    (key, (tries, hits)), = [(k, v) for k, v in cal.acceptance.items() if k[0] == "NGramDrafter" and k[2] == K]
    prior = policy.PRIOR_WEIGHT * len(drafters.NGramDrafter().evidence_prior) * K
    assert tries.sum() > prior  # and so does the acceptance it counted
    # a new call weighs what it inherits as at most MEMORY observations per (feature, slot)
    pol = policy.resolve("adaptive", target)
    pol.begin(K, 1, torch.device("cpu"))
    pol._prepare(drafters.NGramDrafter(), K, torch.device("cpu"))
    assert float(pol.tries.max()) <= policy.MEMORY and torch.allclose(
        pol.hits / pol.tries, hits / tries)


def test_forgetting_a_calibration_starts_the_next_call_from_the_priors():
    target, _ = tiny_pair("llama")
    other = tiny_pair("qwen3")[0]
    cal, kept = policy.calibration(target), policy.calibration(other)
    cal.acceptance["seen"] = "something learned"
    policy.forget_calibration(target)
    assert policy.calibration(target) is not cal and policy.calibration(target).acceptance == {}
    assert policy.calibration(other) is kept  # only that model's
    policy.forget_calibration()
    assert policy.calibration(other) is not kept


@pytest.mark.parametrize("slope, quoting, drafts", [
    (0.3, True, True),     # the prompts quote themselves: the first step drafts
    (0.3, False, False),   # no match in the prompts: the first step is plain decoding
    (5.0, True, False),    # width too dear for any evidence
])
def test_the_first_step_is_planned_from_the_prompts_evidence(slope, quoting, drafts):
    target, _ = tiny_pair("llama")
    base = list(range(3, 13))
    prompts = [base * 3, base[:5] * 4] if quoting else [list(range(3, 30)), list(range(40, 52))]
    rec = Widths()
    res = specdec.generate(target, prompts, k=K, batch_size=2, max_new_tokens=NEW, hooks=[rec],
                           policy=policy.AdaptivePolicy(costs=Priced(slope)))
    assert res.sequences == specdec.reference_generate(target, prompts, max_new_tokens=NEW)
    assert (rec.steps[0][0] > 0) == drafts, rec.steps[0]


def test_without_the_batch_admitted_rows_start_plain():
    pol = policy.AdaptivePolicy()
    pol.begin(K, 3, torch.device("cpu"))
    assert pol.admit([0, 2]) == [0, 0] and pol.next.tolist() == [0, 0, 0]

# -- the adaptive decision --------------------------------------------------------------------

def adaptive_at(acceptance: list[float], ratios, *, k: int = K, budget: int = 20, finished=None,
                generated=None, waiting: bool = True, seen: float = 1e6, features=None,
                standing: bool = False, refills: bool = True, **options):
    """(policy, batch, drafter) for rows whose per-slot acceptance is ``acceptance[f]`` for
    evidence feature ``f`` (row b's feature: ``features[b]``, default b), counted ``seen``
    times, with step costs ``ratios`` (r(w) = ratios[w - 1]); ``generated[b]``: tokens row b
    has committed (default 1 each); ``waiting``: whether requests still wait for a row
    (else every request was admitted); ``standing``: the drafter's ``standing_evidence``;
    ``refills``: the strategy's (whether a finished row's place goes to a waiting
    request); ``options``: ``AdaptivePolicy``'s."""
    rows = list(range(len(acceptance))) if features is None else list(features)
    b = len(rows)

    class OneFeaturePerRow:
        evidence_prior = tuple(acceptance)
        standing_evidence = standing

        def evidence(self, batch, predictions, committed, k):
            return torch.tensor(rows)[:, None].expand(b, k)

    costs = policy.StepCosts()
    costs.ratios = lambda rows, widths: list(ratios)[:widths]
    pol = policy.AdaptivePolicy(costs=costs, **options)
    pol.refills = refills
    pol.begin(k, b + waiting, torch.device("cpu"))
    pol.admit(list(range(b)))  # without the batch: planned below
    tokens, valid, positions, lengths = left_pad([[5, 6, 7]] * b)
    from specdec.batch import RaggedBatch
    from specdec.cache import SlabCache

    z = torch.zeros(b, dtype=torch.long)
    batch = RaggedBatch(tokens=tokens, valid=valid, positions=positions, lengths=lengths,
                        prompt_lengths=lengths.clone(), budgets=z + budget,
                        generated=z + 1 if generated is None else torch.tensor(generated),
                        finished=torch.tensor(finished or [False] * b), row_ids=torch.arange(b),
                        output=torch.zeros(b, budget + k + 1, dtype=torch.long),
                        target_cache=SlabCache(1, 8))
    drafter = OneFeaturePerRow()
    pol._prepare(drafter, k, batch.device)
    pol.tries = pol.tries * seen / policy.PRIOR_WEIGHT  # the prior is the measured
    pol.hits = pol.hits * seen / policy.PRIOR_WEIGHT  # acceptance (no learning here)
    return pol, batch, drafter


def step_result(batch, accepted: list[int], k_step: int):
    """A ``Spec`` of a step of ``k_step`` drafts per row (each usable) in which row b
    accepted ``accepted[b]`` of them."""
    b = batch.batch_size
    a = torch.tensor(accepted)
    z = torch.zeros(b, dtype=torch.long)
    return phases.Spec(drafts=torch.zeros(b, k_step, dtype=torch.long), limit=z + k_step,
                       predictions=torch.zeros(b, k_step + 1, dtype=torch.long), accepted=a,
                       committed=a + 1)


def plan_with(acceptance: list[float], ratios, **options):
    """The adaptive plan of ``adaptive_at(acceptance, ratios, **options)``'s rows after a
    plain step (nothing learned)."""
    pol, batch, drafter = adaptive_at(acceptance, ratios, **options)
    return pol.plan(batch, step_result(batch, [0] * batch.batch_size, 0), drafter, 0).tolist()


def test_rows_draft_only_where_their_expected_tokens_per_cost_beat_a_plain_step():
    cheap = [1.0, 1.1, 1.2, 1.3, 1.4]  # width is cheap: the step drafts k...
    # ...and the weak row rides along: its drafts cost nothing beyond the step's width
    assert plan_with([0.95, 0.02, 0.9], cheap) == [K, K, K]
    dear = [1.0, 2.5, 3.5, 4.5, 5.5]  # every extra token costs more than it can return
    assert plan_with([0.95, 0.9, 0.99], dear) == [0, 0, 0]


def test_a_finished_row_drafts_nothing():
    cheap = [1.0, 1.1, 1.2, 1.3, 1.4]
    assert plan_with([0.95, 0.9], cheap, finished=[False, True]) == [K, 0]


def test_the_width_is_chosen_for_the_whole_batch():
    # one good row cannot pay for a wide step of eight rows at CPU-like costs...
    cpu = [1.0, 1.7, 2.1, 2.4, 2.6]
    assert plan_with([0.99] + [0.01] * 7, cpu) == [0] * 8
    # ...eight of them can, and the width that pays best is taken
    assert plan_with([0.99] * 8, cpu) == [K] * 8
    # at a middling acceptance a narrower step pays best
    two = plan_with([0.6] * 8, [1.0, 1.05, 1.6, 2.4, 3.2])
    assert set(two) == {1}


def test_once_no_request_waits_the_rows_ahead_of_the_slowest_count_less():
    # the batch ends with its slowest row: seven rows near their end with long matches do
    # not pay for a wide step while the row furthest from its end has none
    cpu = [1.0, 1.48, 1.66, 1.94, 2.23]
    good, ahead = [0.95] * 7 + [0.02], [36] * 7 + [4]
    assert plan_with(good, cpu, budget=48, generated=ahead, waiting=False) == [0] * 8
    # while requests wait, a row that finishes frees its place: every row's tokens count
    assert plan_with(good, cpu, budget=48, generated=ahead, waiting=True) == [K] * 8
    # and so they do with drain=0 (the weighting off), or when the slowest row has matches too
    assert plan_with(good, cpu, budget=48, generated=ahead, waiting=False, drain=0) == [K] * 8
    assert plan_with([0.95] * 8, cpu, budget=48, generated=ahead, waiting=False) == [K] * 8


def test_with_the_harmonic_return_a_step_pays_through_most_rows_not_their_sum():
    # all at the same distance from their end, half the rows with long matches and half
    # with none: their summed tokens pay for a wide step, but the rows without matches
    # stay behind and end the batch, so the harmonic mean of the rows' expected tokens
    # (time per row) plans a plain step; with six rows of eight matching, a narrower one
    # (AdaptivePolicy(harmonic=True); the default, the weighted sum, drafts there)
    cpu = [1.0, 1.48, 1.66, 1.94, 2.23]
    half = [0.95] * 4 + [0.02] * 4
    assert plan_with(half, cpu, budget=48, waiting=False, harmonic=True) == [0] * 8
    assert plan_with(half, cpu, budget=48, waiting=False) == [K] * 8
    # a pool refills rows
    assert plan_with(half, cpu, budget=48, waiting=True, harmonic=True) == [K] * 8
    assert plan_with([0.95] * 6 + [0.02] * 2, cpu, budget=48, waiting=False,
                     harmonic=True) == [2] * 8
    # every row alike, or a single row: the harmonic mean is the sum's choice
    for acc in ([0.95] * 8, [0.6] * 8, [0.95], [0.3]):
        assert (plan_with(acc, cpu, budget=48, waiting=False, harmonic=True)
                == plan_with(acc, cpu, budget=48, waiting=False))


def test_evidence_seen_a_few_times_pays_less_than_the_same_acceptance_proven():
    # cautious: one standard error below the counted acceptance; 0.6 over 4 observations
    # is worth 0.6 - 0.24, which pays for no width at these costs; over 400, 0.6 - 0.02
    cpu = [1.0, 1.48, 1.66, 1.94, 2.23]
    assert set(plan_with([0.6] * 8, cpu, seen=4, cautious=True)) == {0}
    assert set(plan_with([0.6] * 8, cpu, seen=400, cautious=True)) == {2}
    assert set(plan_with([0.6] * 8, cpu, seen=4)) == {2}  # the default: the estimate itself


def plan_after_own_record(accepted: int, *, steps: int = 6, acceptance: float = 0.6, **options):
    """The plan of one row whose evidence class accepts ``acceptance`` per slot (proven over
    many observations), after ``steps`` steps of 2 drafts in which it accepted
    ``accepted`` of them each time."""
    cpu = [1.0, 1.48, 1.66, 1.94, 2.23]
    pol, batch, drafter = adaptive_at([acceptance], cpu, **options)
    pol.plan(batch, step_result(batch, [0], 0), drafter, 0)  # the evidence of the first step
    for _ in range(steps):
        nxt = pol.plan(batch, step_result(batch, [accepted], 2), drafter, 2)
    return nxt.tolist()


def test_a_row_whose_own_drafts_fail_drafts_less_than_its_class_suggests():
    # the class estimate (0.6 per slot) plans 2 drafts; with own=4 the row's own record
    # corrects it: always rejected -> a plain step; always accepted -> the widest step
    assert plan_after_own_record(0) == plan_after_own_record(2) == [2]  # default: no correction
    assert plan_after_own_record(0, own=4) == [0]
    assert plan_after_own_record(2, own=4) == [K]
    # a row whose drafts did as their class expects keeps the class estimate
    assert plan_after_own_record(1, acceptance=0.5, own=4) == plan_after_own_record(
        1, acceptance=0.5)
    # the prior weight: the more it is worth, the more of the row's record it takes
    assert plan_after_own_record(0, steps=1, own=1000) == [2]


def test_the_own_record_is_per_row_and_the_class_estimate_its_prior():
    # two rows with the same evidence class: the one whose drafts were accepted expects
    # more tokens from the same drafts than the one whose drafts were rejected
    cpu = [1.0, 1.48, 1.66, 1.94, 2.23]
    pol, batch, drafter = adaptive_at([0.6], cpu, features=[0, 0], own=4)
    pol.plan(batch, step_result(batch, [0, 0], 0), drafter, 0)
    assert pol.own_factor(batch).tolist() == [1.0, 1.0]  # no record: the class estimate
    for _ in range(3):
        pol.plan(batch, step_result(batch, [2, 0], 2), drafter, 2)
    # row 0 reached 6 slots (3.6 expected accepted, 6 accepted), row 1 reached 3 (1.8
    # expected, none accepted): (4 + 6) / (4 + 3.6) and 4 / (4 + 1.8)
    assert pol.own_factor(batch).tolist() == pytest.approx([10 / 7.6, 4 / 5.8])
    e = pol.expected(batch, drafter.evidence(batch, None, None, K))
    assert (e[0, 1:] > e[1, 1:]).all() and e[:, 0].tolist() == [1.0, 1.0]
    assert e[0, 1].item() == pytest.approx(1 + 0.6 * 10 / 7.6, rel=1e-3)
    # a new call starts every row without a record
    pol.begin(K, 3, torch.device("cpu"))
    assert pol.row_hits.tolist() == pol.row_expected.tolist() == [0.0] * 3


def test_the_call_record_corrects_every_row_and_is_the_prior_of_each_rows():
    # own_call: the drafts of every row of the call against their classes; a row that has
    # not drafted yet takes the call's factor, a row with a record shrinks toward it
    cpu = [1.0, 1.48, 1.66, 1.94, 2.23]
    pol, batch, drafter = adaptive_at([0.6], cpu, features=[0, 0], own_call=4)
    pol.plan(batch, step_result(batch, [0, 0], 0), drafter, 0)
    pol.plan(batch, step_result(batch, [0, 0], 2), drafter, 2)  # both reached 1 slot (0.6)
    assert pol.own_factor(batch).tolist() == pytest.approx([4 / 5.2] * 2)
    pol, batch, drafter = adaptive_at([0.6], cpu, features=[0, 0], own_call=4, own=4)
    pol.plan(batch, step_result(batch, [0, 0], 0), drafter, 0)
    pol.plan(batch, step_result(batch, [2, 0], 2), drafter, 2)  # 2 of 1.2 and 0 of 0.6
    call = (4 + 2) / (4 + 1.8)
    assert pol.own_factor(batch).tolist() == pytest.approx(
        [(4 * call + 2) / (4 + 1.2), (4 * call + 0) / (4 + 0.6)])


def test_with_shadow_a_plain_step_measures_its_rows_first_drafts():
    # shadow: at a plain step the policy still knows each row's would-be first draft (the
    # drafter's evidence_drafts) and the token the step committed; a first draft equal to
    # it counts as an accepted slot 0 of the row's class, a different one as a rejected one
    cpu = [1.0, 1.48, 1.66, 1.94, 2.23]

    def after_plain_steps(first: int, steps: int, **options):
        pol, batch, drafter = adaptive_at([0.6, 0.6], cpu, seen=8, **options)
        drafter.evidence_drafts = lambda batch, p, c, k: (
            drafter.evidence(batch, p, c, k), torch.tensor([first, 3]))
        plain = step_result(batch, [0, 0], 0)
        plain.predictions[:] = 3  # the token each plain step commits
        for _ in range(steps):
            nxt = pol.plan(batch, plain, drafter, 0)
        return (pytest.approx(pol.hits[0::K][:2].tolist()), pol.tries[0::K][:2].tolist(),
                nxt.tolist())

    # the rows' classes 0 and 1 start at 0.6 over 8 observations; the first plan only
    # records the would-be drafts, each later plain step counts one slot-0 observation
    assert after_plain_steps(3, 5, shadow=True)[:2] == ([8.8, 8.8], [12, 12])
    assert after_plain_steps(9, 5, shadow=True)[:2] == ([4.8, 8.8], [12, 12])
    # the default learns only from drafting steps
    assert after_plain_steps(9, 5)[:2] == ([4.8, 4.8], [8, 8])
    # both rows' drafts always rejected: their classes stop paying for width
    pol, batch, drafter = adaptive_at([0.6, 0.6], cpu, seen=8, shadow=True)
    drafter.evidence_drafts = lambda batch, p, c, k: (drafter.evidence(batch, p, c, k),
                                                      torch.tensor([9, 9]))
    plain = step_result(batch, [0, 0], 0)
    assert pol.plan(batch, plain, drafter, 0).tolist() == [2, 2]
    for _ in range(8):
        nxt = pol.plan(batch, plain, drafter, 0)
    assert nxt.tolist() == [0, 0]


def test_with_minority_a_width_most_rows_do_not_pay_for_must_beat_plain_by_more():
    # two rows of eight with long matches, six with weak ones: the summed tokens pay for
    # width 3 by the margin, but the rows that pay for it alone hold a quarter of the
    # weight, so with minority=0.3 the step must beat a plain step by 5% and 30% more
    cpu = [1.0, 1.48, 1.66, 1.94, 2.23]
    few = [0.9] * 2 + [0.45] * 6
    assert set(plan_with(few, cpu)) == {2}
    assert set(plan_with(few, cpu, minority=0.3)) == {0}
    # when most rows pay alone the margin is the usual one
    most = [0.9] * 6 + [0.1] * 2
    assert plan_with(most, cpu, minority=0.3) == plan_with(most, cpu)


def test_once_no_request_waits_a_step_over_several_rows_must_beat_plain_by_the_drain_margin():
    # 0.6 per slot on every row: 2 drafts return 1.96 tokens for 1.66 of cost, 18% more
    # than a plain step, which the default 5% margin takes. For a drafter whose evidence
    # stands without drafting (n-gram), drain_margin=0.4 lets that pay only while requests
    # wait (tokens then free rows) or with one row left (no slower row to wait for)
    cpu = [1.0, 1.48, 1.66, 1.94, 2.23]
    assert policy.AdaptivePolicy().drain_margin == policy.DRAIN_MARGIN == 0.4
    assert policy.AdaptivePolicy().margin == 0.05
    # with the drain margin equal to the margin, the step drafts as while requests wait
    assert set(plan_with([0.6] * 8, cpu, budget=48, waiting=False, standing=True,
                         drain_margin=0.05)) == {2}
    drain = dict(budget=48, standing=True)  # the default: DRAIN_MARGIN
    assert set(plan_with([0.6] * 8, cpu, waiting=False, **drain)) == {0}
    assert set(plan_with([0.6] * 8, cpu, waiting=True, **drain)) == {2}
    assert plan_with([0.6], cpu, waiting=False, **drain) == [2]
    # long matches on most rows still pay: 0.95 per slot returns 4.5 tokens for 2.23
    assert set(plan_with([0.95] * 8, cpu, waiting=False, **drain)) == {K}
    # a drafter whose evidence needs its drafts (a draft model's confidence) or that has
    # none (scripted drafts) keeps the 5% margin: stopping would stop it learning
    assert set(plan_with([0.6] * 8, cpu, budget=48, waiting=False, drain_margin=0.4)) == {2}


def test_fixed_batches_end_with_their_slowest_row_even_while_requests_wait():
    """EQSPEC and holes decode fixed batches: the next batch waits for the whole of this
    one, so a request that waits takes no finished row's place, and the drain (weights
    and margin) applies from the first batch on; EXSPEC's pool refills (``refills``)."""
    from specdec import strategies

    cpu = [1.0, 1.48, 1.66, 1.94, 2.23]
    drain = dict(budget=48, standing=True)
    assert set(plan_with([0.6] * 8, cpu, waiting=True, **drain)) == {2}
    assert set(plan_with([0.6] * 8, cpu, waiting=True, refills=False, **drain)) == {0}
    # the weights: rows ahead of the slowest count less only once no request takes a place
    ahead = dict(generated=[1] + [30] * 7, budget=48)
    for refills, waits in ((True, True), (False, False)):
        pol, batch, _ = adaptive_at([0.5] * 8, cpu, refills=refills, **ahead)
        assert pol.waits is waits
        w = pol.weights(batch)
        assert bool((w[1:] < 1).all()) is (not waits) and w[0] == 1
    assert [strategies.get(n).refills for n in ("eqspec", "holes", "exspec")] == [False, False, True]
    # generate tells the policy its strategy's
    target, _ = tiny_pair("llama")
    p = policy.AdaptivePolicy()
    for name in ("exspec", "eqspec"):
        specdec.generate(target, [[5, 6, 7]] * 3, k=2, batch_size=2, max_new_tokens=3,
                         strategy=name, policy=p)
        assert p.refills is strategies.get(name).refills


def test_a_policy_string_sets_adaptive_options_on_the_models_own_calibration():
    """``policy="adaptive:NAME=VALUE,.."`` (``specdec.policy.parse``, ``OPTIONS``): the
    adaptive policy with those options, learning into the model's calibration as
    ``"adaptive"`` does; what ``specdec audit`` asks for to keep drafting in a batch's tail."""
    target, _ = tiny_pair("llama")
    assert policy.parse("adaptive") == ("adaptive", {})
    assert policy.parse("adaptive:drain_margin=0.05,harmonic=1") == (
        "adaptive", {"drain_margin": 0.05, "harmonic": True})
    for bad, rule in (("greedy", "policy must be one of"), ("fixed:own=1", "only adaptive takes"),
                      ("adaptive:own", "NAME=VALUE"), ("adaptive:colour=2", "NAME=VALUE")):
        with pytest.raises(ValueError, match=rule):
            policy.parse(bad)
    p = policy.resolve("adaptive:drain_margin=0.05", target)
    assert isinstance(p, policy.AdaptivePolicy) and p.drain_margin == 0.05
    assert p.calibration is policy.calibration(target) is policy.resolve("adaptive", target).calibration
    assert isinstance(policy.resolve("fixed", target), policy.FixedPolicy)
    own = policy.Calibration()  # a calibration given takes the model's place
    assert policy.resolve("adaptive:own=3", target, calibration=own).calibration is own


def test_only_the_n_gram_drafter_declares_standing_evidence():
    from specdec import drafters

    assert drafters.NGramDrafter.standing_evidence is True
    for name in ("ModelDrafter", "ScriptedDrafter", "ForcingDrafter"):
        assert not getattr(getattr(drafters, name), "standing_evidence", False), name


def test_with_slowest_a_step_pays_through_the_drop_of_the_most_remaining_budget():
    # eight rows equally far from their end at 0.6 per slot: the most remaining budget
    # drops by more than one only if all eight accept, so a plain step (the weighted
    # sum drafts 2)...
    cpu = [1.0, 1.48, 1.66, 1.94, 2.23]
    assert set(plan_with([0.6] * 8, cpu, budget=48, waiting=False, slowest=True)) == {0}
    # ...while the slowest row alone, the others far ahead, is worth its own tokens
    ahead = dict(budget=48, generated=[1] + [12] * 7, waiting=False)
    assert set(plan_with([0.95] + [0.02] * 7, cpu, slowest=True, **ahead)) == {K}
    # a single row: its expected tokens
    assert plan_with([0.6], cpu, budget=48, waiting=False, slowest=True) == [2]


def load_throughput():
    """benchmarks/throughput.py as a module."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "throughput.py"
    spec = importlib.util.spec_from_file_location("throughput", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["throughput"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_benchmark_policy_variants_set_adaptive_options_and_learn_on_their_own(tmp_path):
    """``--policies adaptive:NAME=VALUE,..`` (benchmarks/throughput.py): an
    ``AdaptivePolicy`` with those options on the configuration's own calibration (variants
    never share what they learn), measured beside the others."""
    import json

    throughput = load_throughput()
    # the library's parser (specdec.policy.parse, tested above), its errors as exits
    assert throughput.policy_options("adaptive:own=4") == ("adaptive", {"own": 4.0})
    with pytest.raises(SystemExit, match="unknown policy: .*only adaptive takes options"):
        throughput.policy_options("fixed:own=1")
    a = throughput.Config("spec", 8, "ngram", "eqspec", "adaptive:own=4")
    b = throughput.Config("spec", 8, "ngram", "eqspec", "adaptive:own=4")
    pa, pb = throughput.make_policy(a), throughput.make_policy(b)
    assert pa.own == 4.0 and pa.calibration is not pb.calibration
    assert throughput.make_policy(a).calibration is pa.calibration  # kept across its calls
    assert throughput.make_policy(throughput.Config("spec", 8, "ngram", "eqspec", "fixed")) == "fixed"
    argv = ["--model", "tiny:llama", "--prompts", "4", "--max-new-tokens", "6", "--batch-sizes",
            "4", "--policies", "adaptive", "adaptive:own=4,own_call=8", "--k", "3",
            "--out", str(tmp_path)]
    assert throughput.main(argv) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    names = {r["engine"]: r for r in rows}
    assert set(names) >= {"eqspec/adaptive", "eqspec/adaptive:own=4,own_call=8"}
    assert all(r["exact_match"] == 1.0 for r in rows)


def test_the_budget_caps_the_expected_tokens():
    # one token left: no draft can be used, so drafting never pays
    assert plan_with([0.99, 0.99], [1.0, 1.01, 1.02, 1.03, 1.04], budget=2) == [0, 0]


def test_step_costs_interpolate_extrapolate_and_start_from_the_prior():
    c = policy.StepCosts(slope=0.2)
    assert c.ratios(8, 3) is None  # no plain step measured: no ratio (the policy plans one)
    c.observe(1, 8, 0.30)
    assert c.ratios(8, 3) == pytest.approx([1.0, 1.2, 1.4])  # only the base: the prior slope
    c.observe(3, 8, 0.60)
    r = c.ratios(8, 5)
    assert r[:3] == pytest.approx([1.0, 1.5, 2.0])  # width 2 interpolated
    assert r[3:] == pytest.approx([2.2, 2.4])  # beyond: the last slope, capped at the prior's
    c.observe(1, 8, 0.40)  # a moving average
    assert c.seconds[8][1] == pytest.approx(0.7 * 0.30 + 0.3 * 0.40)
    c.observe(3, 7, 0.5)
    # no plain step over 7 rows: the nearest larger batch size's ratios stand in (rows
    # leave one by one), else the nearest smaller one's
    assert c.ratios(7, 3) == c.ratios(8, 3)
    c.observe(1, 2, 0.1)
    c.observe(2, 2, 0.3)
    assert c.ratios(9, 2) == c.ratios(8, 2) and c.ratios(1, 2) == pytest.approx([1.0, 3.0])
    c.observe(1, 7, 0.25)  # its own base, once measured, with its own widths
    assert c.ratios(7, 3) == pytest.approx([1.0, 1.5, 2.0])


def test_a_batch_size_without_a_measured_plain_step_gets_one():
    # whatever the evidence, the policy plans a plain step until it has the base
    pol = policy.AdaptivePolicy()
    pol.begin(K, 2, torch.device("cpu"))
    ctx_batch = left_pad([[5, 6, 7, 5, 6, 7, 5, 6, 7]] * 2)
    from specdec.batch import RaggedBatch
    from specdec.cache import SlabCache

    tokens, valid, positions, lengths = ctx_batch
    z = torch.zeros(2, dtype=torch.long)
    batch = RaggedBatch(tokens=tokens, valid=valid, positions=positions, lengths=lengths,
                        prompt_lengths=lengths.clone(), budgets=z + 20, generated=z,
                        finished=torch.zeros(2, dtype=torch.bool), row_ids=torch.arange(2),
                        output=torch.zeros(2, 30, dtype=torch.long), target_cache=SlabCache(1, 8))
    d = drafters.NGramDrafter()
    assert pol.admit([0, 1], batch, d) == [0, 0]
    pol.observe(1, 2, 0.1)
    first = pol.admit([0, 1], batch, d)  # a 6-token match: the prior pays for drafting
    assert first[0] == first[1] > 0


def adaptive_step(**options):
    """(ctx, state, batch, spec) after the first step's commit, with an AdaptivePolicy
    (``options``: its own; with any, a plain step is priced first, width is cheap and
    the drain margin is the margin, so the policy drafts where the prompt quotes itself)."""
    target, _ = tiny_pair("llama")
    pol = policy.AdaptivePolicy(**({"drain_margin": 0.05, **options} if options else {}))
    if options:
        for w in range(1, K + 2):
            pol.observe(w, 2, 0.1 + 0.001 * w)
    pol.begin(K, 2, torch.device("cpu"))
    ctx = phases.Context(target=target, drafter=drafters.NGramDrafter(), k=K, hooks=(),
                         stop_ids=torch.tensor([2]), max_position=255, policy=pol)
    state = phases.State()
    with torch.no_grad():
        batch = phases.prefill(ctx, state, [[5, 6, 7, 5, 6], [9, 10]], [0, 1], [8, 8])
        spec = phases.speculate(ctx, state, batch)
    return ctx, state, batch, spec


@pytest.mark.parametrize("options", [{}, {"own": 4.0}, {"shadow": True, "minority": 0.3, "blend": 1.0}])
def test_the_adaptive_plan_reads_nothing_and_uploads_nothing(options):
    # (the forward of a plain step itself reads the mask on the host inside transformers
    # 5.24, masking_utils._ignore_causal_mask_sdpa at q_length 1; not the policy's doing)
    ctx, state, batch, spec = adaptive_step(**options)
    pol = ctx.policy
    with torch.no_grad():
        pol.plan(batch, spec, ctx.drafter, spec.k)  # the first plan sets up the statistics
        spec = phases.speculate(ctx, state, batch)
        assert spec.k > 0 or not options  # with own: a drafting step, so its record is kept
        with no_host_transfers():  # no read, no upload, no data-dependent shape
            pol.plan(batch, spec, ctx.drafter, spec.k)
            pol.lengths(batch, K)


@pytest.mark.parametrize("options", [{}, {"own": 4.0}])
def test_a_clean_adaptive_step_reads_the_host_once(options):
    ctx, state, batch, spec = adaptive_step(**options)
    with TransferLog(raise_on_transfer=False) as log:
        host = phases.sync(ctx, state, batch, spec)
    assert log.reads == 1, log.events
    assert len(host.next_lengths) == 2 and host.next_k == max(host.next_lengths)


# -- the n-gram drafter -----------------------------------------------------------------------

def lookup_rule(row: list[int], k: int, max_n: int, min_n: int = 1):
    """The drafter's rule for one row, stated directly: (drafts, match length, agreement)."""
    w = len(row)
    best, best_len = None, 0
    lengths = {}
    for s in range(1, w):
        n = 0
        while n < max_n and s - 1 - n >= 0 and row[s - 1 - n] == row[w - 1 - n]:
            n += 1
        lengths[s] = n if n >= min_n else 0
        if lengths[s] and lengths[s] >= best_len:
            best, best_len = s, lengths[s]
    if best is None:
        return [row[-1]] * k, 0, 0
    period = w - best
    drafts = [row[best + (j % period)] for j in range(k)]
    agree = sum(1 for s, n in lengths.items() if n >= best_len and row[s] == row[best])
    return drafts, best_len, agree


# token 0 is also the padding's fill (``PAD_FILL``): a short row of zeros beside a long row
# must not match its own padding
@given(st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=24), min_size=1, max_size=5),
       st.integers(0, 6), st.integers(1, 5), st.integers(1, 3))
@example([[0, 0], [3] * 9], 2, 5, 1)
def test_ngram_lookup_equals_the_rule_row_by_row(rows, k, max_n, min_n):
    min_n = min(min_n, max_n)
    tokens, valid, _, _ = left_pad(rows)
    d = drafters.NGramDrafter(max_n=max_n, min_n=min_n)
    drafts, length, agree = d.lookup(tokens, valid, k)
    for b, row in enumerate(rows):
        want = lookup_rule(row, k, max_n, min_n)
        assert (drafts[b].tolist(), int(length[b]), int(agree[b])) == want, (row, want)


def test_ngram_prefers_the_longest_match_to_the_latest():
    # the suffix "1 2 3" occurred once, followed by 9; "3" alone occurred later, followed by 4
    row = [1, 2, 3, 9, 8, 3, 4, 5, 1, 2, 3]
    tokens, valid, _, _ = left_pad([row])
    drafts, length, _ = drafters.NGramDrafter().lookup(tokens, valid, 3)
    assert drafts[0].tolist() == [9, 8, 3] and int(length[0]) == 3


def test_ngram_continues_a_repetition_loop_periodically():
    row = [7, 8, 5, 6, 5, 6, 5, 6]
    tokens, valid, _, _ = left_pad([row])
    drafts, _, agree = drafters.NGramDrafter().lookup(tokens, valid, 5)
    assert drafts[0].tolist() == [5, 6, 5, 6, 5]
    assert int(agree[0]) == 1  # the longest match (5 6 5 6 at slots 2..5) was seen once


def test_ngram_evidence_after_a_commit_is_what_the_next_draft_sees():
    # committed_context (before any realignment) equals the realigned batch's tokens, so
    # the evidence planned after step t describes the drafts proposed at step t + 1
    target, _ = tiny_pair("llama")
    prompts = repetitive_prompts()
    d = drafters.NGramDrafter()
    seen = {}

    class Spy(policy.ForcedPolicy):
        def plan(self, batch, spec, drafter, k_step):
            tokens, valid = batch.committed_context(spec.predictions, spec.committed)
            seen["next"] = {int(r): drafter.lookup(tokens, valid, K)[0][i].tolist()
                            for i, r in enumerate(batch.row_ids)}
            return super().plan(batch, spec, drafter, k_step)

    checked = []

    def at_draft(phase, view):
        if phase == "prefill":  # a new batch: its first drafts were planned by nobody
            seen.clear()
        if phase == "draft" and "next" in seen:
            for i, r in enumerate(view.row_ids.tolist()):
                checked.append(view.drafts[i].tolist() == seen["next"][r][: view.k])

    for strategy in ("eqspec", "holes"):
        specdec.generate(target, prompts, drafter=d, k=K, batch_size=4, max_new_tokens=NEW,
                         strategy=strategy, policy=Spy([[K]] * len(prompts)), hooks=[at_draft])
    assert checked and all(checked)
