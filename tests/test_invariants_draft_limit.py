"""I6.draft_limit: each row drafts at most min(k, remaining - 1), a row with no budget left
drafts nothing (issue 13, point 3).

A drafter clipped to ``clamp(remaining, 0, k)`` keeps every output right (the last budgeted
token is the target's own prediction either way) and so escapes every token rule; the rule
on the view's ``draft_limit`` is what the Monitor alone catches it by.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import invariants
import specdec
from specdec import drafters, models, mutants
from toy_engine import toy_views

torch.set_num_threads(1)

PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10, 11, 12], [9], [5, 6, 7, 8, 9]]


def rules_of(violations) -> set:
    return {r.split(":")[0] for v in violations for r in v.rules}


def test_a_draft_limit_above_remaining_minus_one_is_flagged_at_commit():
    views = list(toy_views(PROMPTS, k=3, budget=8, seed=0))
    i = next(i for i, (ph, v) in enumerate(views) if ph == "commit")
    ph, v = views[i]
    lim = v.draft_limit.clone()
    lim[1] = (v.budgets[1] - v.generated_before[1]).clamp(max=v.k + 1)  # one draft too many
    mon = invariants.Monitor("strict", raise_on_violation=False)
    for j, (p, w) in enumerate(views[: i + 1]):
        mon(p, dataclasses.replace(w, draft_limit=lim) if j == i else w)
    found = mon.check()
    assert found and found[0].invariant == "I6" and found[0].rows == [1]
    assert any("draft_limit <= min(k, remaining - 1)" in r for r in found[0].rules)


def test_a_row_with_no_budget_left_drafts_nothing():
    views = list(toy_views(PROMPTS, k=3, budget=8, seed=0))
    i = next(i for i, (ph, v) in enumerate(views) if ph == "commit")
    ph, v = views[i]
    spent = dataclasses.replace(v, budgets=v.generated_before.clone(),
                                draft_limit=torch.ones_like(v.draft_limit))
    from invariants.rules import Facts, _draft_limit_rule
    assert _draft_limit_rule(Facts(spent)).all()
    ok = dataclasses.replace(spent, draft_limit=torch.zeros_like(v.draft_limit))
    assert not _draft_limit_rule(Facts(ok)).any()


def test_the_correct_engine_keeps_its_draft_limits():
    views = list(toy_views(PROMPTS, k=3, budget=8, seed=0))
    mon = invariants.Monitor("strict", raise_on_violation=False)
    for ph, v in views:
        mon(ph, v)
    assert mon.check() == []


@pytest.mark.engine
@pytest.mark.parametrize("mode", ["strict", "fast"])
@pytest.mark.parametrize("strategy", ["eqspec", "exspec", "holes"])
def test_the_unclipped_draft_limit_mutant_is_caught_by_the_monitor_alone(strategy, mode):
    target = models.tiny("llama")
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]
    drafter = drafters.NGramDrafter()
    mon = invariants.Monitor(mode, raise_on_violation=False)
    with mutants.apply("draft_limit_unclipped"):
        specdec.generate(target, prompts, drafter=drafter, strategy=strategy, k=4,
                         policy="fixed", max_new_tokens=3, stop_token_ids=[], hooks=[mon])
    found = mon.check()
    assert found, f"{strategy}/{mode}: the unclipped draft limit went unnoticed"
    assert any("draft_limit <= min(k, remaining - 1)" in r for v in found for r in v.rules)
    print(found[0])
