"""Adversarial properties: forced acceptance patterns, forced per-row draft lengths, mixed
prompts, budgets and stops.

Each test states one property over ``cases()`` (tests/hyp_inputs.py); the engine runs with
a ForcingDrafter (the accepted counts) and a ForcedPolicy (every row's draft length k_b at
every step) under a strict Monitor. Cases decode greedily or by coupled sampling (drawn; the
reference is then plain coupled sampling): every property holds for both. Profiles:
HYPOTHESIS_PROFILE=ci|dev|thorough.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, note, settings

from conftest import real
from harness import outcome_failures, run_case
from hyp_inputs import cases

CASES = cases(sampled=True)


def explain(case, outcome):
    note(f"case: {case}")
    note(f"steps: {outcome.steps()}, first violation: "
         f"{outcome.violations[0] if outcome.violations else None}")


@given(CASES)
def test_invariants_hold_at_every_phase(case):
    o = run_case(case)
    explain(case, o)
    assert not o.violations, str(o.violations[0])


@given(CASES)
def test_ids_equal_the_batch_1_reference(case):
    o = run_case(case)
    explain(case, o)
    assert o.sequences == o.reference


@given(CASES)
def test_accepted_counts_equal_the_forced_pattern(case):
    o = run_case(case)
    explain(case, o)
    for (rows, limit, accepted, _), forced in zip(o.commits, o.forced):
        assert accepted == [min(f, lim) for f, lim in zip(forced, limit)]


@given(CASES)
def test_one_to_k_plus_one_tokens_committed_per_row_and_step(case):
    o = run_case(case)
    explain(case, o)
    for _, _, _, committed in o.commits:
        assert all(1 <= c <= case.k + 1 for c in committed)


@given(CASES)
def test_a_row_commits_at_most_its_own_draft_length_plus_one(case):
    o = run_case(case)
    explain(case, o)
    for kb, (_, _, _, committed) in zip(o.draft_lengths, o.commits):
        assert all(c <= k_b + 1 for c, k_b in zip(committed, kb))


@given(CASES)
def test_verify_width_is_the_longest_draft_length_plus_one(case):
    o = run_case(case)
    explain(case, o)
    assert len(o.widths) == len(o.draft_lengths) == o.steps()
    for kb, width in zip(o.draft_lengths, o.widths):
        assert width == max(kb)  # so a step where no row drafts is a plain step (width 1)


@given(CASES)
def test_draft_limit_is_own_length_cut_by_the_budget(case):
    o = run_case(case)
    explain(case, o)
    for kb, (_, limit, _, _), rem in zip(o.draft_lengths, o.commits, o.remaining):
        assert limit == [max(0, min(k_b, r - 1)) for k_b, r in zip(kb, rem)]


@given(CASES)
def test_budgets_and_stop_tokens_are_respected(case):
    o = run_case(case)
    explain(case, o)
    for seq in o.sequences:
        assert 1 <= len(seq) <= case.budget
        assert not any(t in o.stops for t in seq[:-1])
        assert len(seq) == case.budget or seq[-1] in o.stops


REAL_CASES = cases(families=("llama",), max_rows=4, max_budget=8, context=200, ks=(2, 4))
REAL_SETTINGS = settings(deadline=None, derandomize=True, database=None,
                         suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                HealthCheck.too_slow])


@pytest.mark.real
@pytest.mark.xdist_group("smollm2-135m-instruct")
@settings(REAL_SETTINGS, max_examples=3)
@given(REAL_CASES)
def test_every_property_holds_on_the_real_model(real_model, case):
    """The same properties over SmolLM2-135M-Instruct (loaded once per session)."""
    o = run_case(case, target=real_model[0])
    explain(case, o)
    assert not outcome_failures(o), outcome_failures(o)


#: Gemma 3 270M: every prompt past its 512-token sliding window, ids from its whole vocabulary
GEMMA3_CASES = cases(families=("gemma3-270m",), max_rows=3, max_budget=6, context=600,
                     ks=(2, 4), shortest=513, vocab=262144)


@pytest.mark.real
@pytest.mark.campaign
@pytest.mark.xdist_group("gemma3-270m")
@settings(REAL_SETTINGS, max_examples=2)
@given(GEMMA3_CASES)
def test_every_property_holds_on_gemma3_past_its_window(case):
    """The same properties over Gemma 3 270M, the hybrid sliding/full attention model."""
    o = run_case(case, target=real("gemma3-270m")[0])
    explain(case, o)
    assert not outcome_failures(o), outcome_failures(o)
