"""A drafter equal to the target accepts every draft (issue 13, point 2, last bullet).

A ``ModelDrafter`` whose draft model is the target itself proposes, at each step, the
target's own greedy (or coupled) choices after the row's committed tokens; the verify
forward must then accept all of them: ``Stats.accepted == Stats.drafted``, under every
strategy and every tiny family (fixed policy, so every row drafts ``k`` while its budget
allows). The draft model's cache is realigned, dropped, pooled and loaded like the
target's; any fault in that bookkeeping feeds the draft model a wrong context and shows
here as a rejected draft, while the outputs stay exact (the target verifies every draft);
the Monitor sees what moves the draft cache's K/V (KV provenance of the draft cache,
``invariants/provenance.py``), not a slot the draft model never computed.

The mutant ``exspec_draft_pool_late`` (``specdec.mutants.FAULTS``: EXSPEC writes the draft
model's new KV back into its pool one slot late) is caught by this property and by the
draft cache's KV provenance; every other rule holds.
"""

from __future__ import annotations

import pytest
import torch

import invariants
import specdec
from specdec import Sampling, drafters, models, mutants

pytestmark = pytest.mark.engine  # every test runs specdec's engine

torch.set_num_threads(1)

STRATEGIES = ("eqspec", "exspec", "holes")
_G = torch.Generator().manual_seed(1)
#: mixed lengths, more prompts than the batch (EXSPEC's pool refills, rows drop)
PROMPTS = [torch.randint(3, models.TINY_VOCAB, (n,), generator=_G).tolist()
           for n in (3, 9, 5, 12, 2, 7)]
NEW = 10


def self_drafted(target, strategy, hooks=(), sampling=None):
    return specdec.generate(target, PROMPTS, drafter=drafters.ModelDrafter(target),
                            strategy=strategy, k=3, batch_size=3, max_new_tokens=NEW,
                            policy="fixed", stop_token_ids=[], hooks=hooks, sampling=sampling)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_drafter_equal_to_the_target_accepts_every_draft(family, strategy):
    target = models.tiny(family)
    res = self_drafted(target, strategy)
    assert res.stats.drafted > 0
    assert res.stats.accepted == res.stats.drafted, (family, strategy, res.stats.as_dict())
    ref = specdec.reference_generate(target, PROMPTS, max_new_tokens=NEW, stop_token_ids=[])
    assert res.sequences == ref


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_drafter_equal_to_the_target_accepts_every_coupled_draft(strategy):
    """Coupled sampling: the draft model's coupled choice (the same noise per request and
    position) is the target's."""
    target = models.tiny("llama")
    res = self_drafted(target, strategy, sampling=Sampling(temperature=0.8, seed=3,
                                                           mode="coupled"))
    assert res.stats.drafted > 0 and res.stats.accepted == res.stats.drafted


def test_the_late_draft_pool_mutant_is_caught_by_the_self_draft_property_and_provenance():
    target = models.tiny("llama")
    mon = invariants.Monitor("strict", raise_on_violation=False)
    with mutants.apply("exspec_draft_pool_late"):
        res = self_drafted(target, "exspec", hooks=[mon])
    stats = res.stats
    print(f"exspec_draft_pool_late: accepted {stats.accepted} of {stats.drafted} drafts, "
          f"{stats.steps} steps")
    assert stats.accepted < stats.drafted  # the property catches it
    # what nothing else sees: the outputs stay exact and every view is right
    assert res.sequences == specdec.reference_generate(target, PROMPTS, max_new_tokens=NEW,
                                                       stop_token_ids=[])
    found = mon.check()
    assert found and {v.invariant for v in found} == {"I5"}
    assert all("I5.provenance" in v.rules[0] and "draft cache" in v.rules[0] for v in found)
    assert mon.check_stats(stats, res.sequences) == []
    clean = self_drafted(target, "exspec")
    assert clean.stats.accepted == clean.stats.drafted and clean.stats.steps < stats.steps
