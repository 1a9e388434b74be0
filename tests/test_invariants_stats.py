"""I6.stats: the engine's counters are the sums of what the Monitor saw (issue 13, point 4).

``Stats.conservation(outputs)`` states what the counters obey against the outputs alone
(committed = total output length, 1 to accepted + 1 tokens per row and step, accepted <=
drafted <= planned); ``Monitor.check_stats(stats, outputs)`` states: ``Stats.steps`` = the commit views,
``drafted`` = the sum of their draft limits, ``accepted`` and ``committed`` = the sums of
their counts, and ``committed`` = the total output length. A fault that touches only the
bookkeeping (``accepted`` counted as the sum of ``committed - 1``) keeps every output
exact and every view right; only this rule sees it.
"""

from __future__ import annotations

import types

import pytest
import torch

import invariants
import specdec
from specdec import drafters, models, mutants

pytestmark = pytest.mark.engine  # every test runs specdec's engine

torch.set_num_threads(1)

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16], [3]]
STRATEGIES = ("eqspec", "exspec", "holes")


def run(strategy, mode="strict", family="llama", **kw):
    """Every draft right (forced from the batch-1 reference), and a stop token at row 0's
    second output: row 0 commits fewer tokens than accepted + 1 at its first step (every
    row drafts k from the first step: policy="fixed" unless given)."""
    kw.setdefault("policy", "fixed")
    target = models.tiny(family)
    ref = specdec.reference_generate(target, PROMPTS, max_new_tokens=6, stop_token_ids=[])
    drafter = drafters.ForcingDrafter(ref, [[] for _ in PROMPTS], models.vocab_size(target))
    mon = invariants.Monitor(mode, raise_on_violation=False)
    res = specdec.generate(target, PROMPTS, drafter=drafter, strategy=strategy, k=3,
                           max_new_tokens=6, stop_token_ids=[ref[0][1]], hooks=[mon], **kw)
    return mon, res


@pytest.mark.parametrize("family", ["llama", models.SLIDING_FAMILY])
@pytest.mark.parametrize("mode", ["strict", "fast"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_correct_engine_s_stats_are_the_sums_of_its_views(strategy, mode, family):
    mon, res = run(strategy, mode, family, batch_size=3)
    assert mon.check() == []
    assert mon.check_stats(res.stats, res.sequences) == []
    assert res.stats.committed == sum(map(len, res.sequences)) > 0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_accepted_counted_from_committed_is_caught(strategy):
    """The mutant ``stats_accepted_from_committed`` (specdec.mutants.FAULTS); a stop
    token cuts row 0's first commit, the only place the wrong sum differs."""
    with mutants.apply("stats_accepted_from_committed"):
        mon, res = run(strategy)
    assert res.stats.conservation(res.sequences) == []  # the outputs alone cannot tell
    assert mon.check() == []  # every view is right: only the counters are wrong
    found = mon.check_stats(res.stats, res.sequences)
    assert found and found[0].invariant == "I6"
    assert [r.split(" =")[0] for r in found[0].rules] == ["I6.stats: Stats.accepted"]
    print(found[0])


@pytest.mark.parametrize("field", ["steps", "drafted", "committed"])
def test_each_counter_is_checked(field):
    mon, res = run("eqspec")
    stats = types.SimpleNamespace(**{n: getattr(res.stats, n) for n in
                                     ("steps", "drafted", "accepted", "committed")})
    setattr(stats, field, getattr(stats, field) + 1)
    found = mon.check_stats(stats)
    assert found and any(r.startswith(f"I6.stats: Stats.{field} =") for r in found[0].rules)


def test_committed_must_equal_the_total_output_length():
    mon, res = run("eqspec")
    short = [s[:-1] if s else s for s in res.sequences]
    found = mon.check_stats(res.stats, short)
    assert found and "the outputs hold" in found[0].rules[0]


def test_strict_raises_the_stats_violation():
    mon = invariants.Monitor("strict")
    res = specdec.generate(models.tiny("llama"), PROMPTS, drafter=drafters.NGramDrafter(),
                           k=3, max_new_tokens=6, hooks=[mon])
    res.stats.accepted += 1
    with pytest.raises(invariants.InvariantViolation, match="I6"):
        mon.check_stats(res.stats, res.sequences)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_correct_engine_s_stats_obey_conservation_against_the_outputs(strategy):
    _, res = run(strategy, batch_size=3)
    assert res.stats.conservation(res.sequences) == []


@pytest.mark.parametrize("field, delta, rule", [
    ("committed", 1, "committed = total output length"),
    ("accepted", 100, "accepted <= drafted"),
    ("drafted", 100, "drafted <= planned"),
    ("row_steps", 100, "each row commits >= 1 token per step"),
    ("steps", 1, "the widths count every step"),
])
def test_each_conservation_rule_is_checked(field, delta, rule):
    _, res = run("eqspec")
    setattr(res.stats, field, getattr(res.stats, field) + delta)
    broken = res.stats.conservation(res.sequences)
    assert any(rule in b for b in broken), broken
