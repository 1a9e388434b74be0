"""Known-bad engines: each is caught at its first wrong step, with the right invariant."""

from __future__ import annotations

import functools
import random

import pytest
import torch

import invariants
import specdec
from specdec import drafters, models
from specdec.forensics.known_bad import (DESYNCS, EXPECTED_INVARIANT, GUARD_VISIBLE, KNOWN_BAD,
                                         generate_known_bad)
from harness import random_prompts
from conftest import tiny_pair

NEW = 16
FULL_ATTENTION = ("llama", "qwen3", "glm4", "gpt2")


@functools.lru_cache(maxsize=None)
def workload(family: str, fault):
    """(target, prompts, stop ids, reference, scripted drafter) for one fault."""
    target, _ = tiny_pair(family)
    prompts = random_prompts((3, 9, 20, 5), models.TINY_VOCAB, seed=1)
    free = specdec.reference_generate(target, prompts, max_new_tokens=NEW, stop_token_ids=[])
    stops = [free[0][6]] if fault == "keep_after_stop" else models.stop_token_ids(target)
    ref = specdec.reference_generate(target, prompts, max_new_tokens=NEW, stop_token_ids=stops)
    if fault == "drop_bonus":
        script = ref  # every draft accepted: the bonus case
    else:  # rows reject at different offsets (seeded), so accepted counts differ per row
        rng = random.Random(0)
        script = [[(t + 1) % models.TINY_VOCAB if rng.random() < 0.3 else t for t in s] for s in free]
    return target, prompts, stops, ref, drafters.ScriptedDrafter(script)


def run(family, fault, hooks=()):
    target, prompts, stops, ref, drafter = workload(family, fault)
    seqs, _ = generate_known_bad(fault, target, prompts, drafter=drafter, k=4,
                                 max_new_tokens=NEW, stop_token_ids=stops, hooks=hooks)
    return seqs, ref


@pytest.mark.parametrize("family", FULL_ATTENTION)
def test_naive_engine_without_fault_is_exact_and_clean(family):
    mon = invariants.Monitor(mode="strict")
    seqs, ref = run(family, None, hooks=[mon])
    mon.check()
    assert seqs == ref


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("fault", list(KNOWN_BAD))
def test_monitor_names_the_broken_invariant_at_the_first_wrong_step(family, fault):
    mon = invariants.Monitor(mode="strict")
    with pytest.raises(invariants.InvariantViolation) as err:
        run(family, fault, hooks=[mon])
    v = err.value
    first = {v.invariant, *v.trace.get("also", [])}
    assert EXPECTED_INVARIANT[fault] in first, str(v)
    # strict mode raised at the first phase that went wrong: a recording monitor agrees
    rec = invariants.Monitor(mode="strict", raise_on_violation=False)
    run(family, fault, hooks=[rec])
    assert (rec.violations[0].step, rec.violations[0].phase) == (v.step, v.phase)


@pytest.mark.parametrize("fault", list(KNOWN_BAD))
def test_desyncs_change_tokens_and_the_others_do_not(fault):
    seqs, ref = run("llama", fault)
    if fault in DESYNCS:
        assert seqs != ref
    elif fault == "drop_bonus":
        assert seqs == ref  # slower, not wrong
    else:  # keep_after_stop: the reference is a strict prefix of the output
        assert seqs != ref
        assert all(s[: len(r)] == r for s, r in zip(seqs, ref))


@pytest.mark.parametrize("fault", GUARD_VISIBLE)
def test_guard_model_flags_the_faults_that_reach_the_forward(fault):
    target, _ = tiny_pair("llama")
    with pytest.raises(invariants.InvariantViolation):
        with invariants.guard_model(target, mode="strict"):
            run("llama", fault)


def test_guard_model_is_silent_on_the_exact_naive_engine():
    target, _ = tiny_pair("llama")
    with invariants.guard_model(target, mode="strict") as guard:
        seqs, ref = run("llama", None)
    assert seqs == ref and not guard.violations


@pytest.mark.parametrize("family", [models.SLIDING_FAMILY, models.HYBRID_FAMILY])
def test_the_naive_loops_slot_window_is_caught_by_i4_window(family):
    """The naive holes loop hands a sliding-window model a 2-D mask: the model's window
    then counts slots, and holes make it drop keys within the window in positions. The
    strict Monitor names I4.window at or before the first wrong step (the naive grid
    above is exact only on full attention)."""
    seqs, ref = run(family, None)
    assert seqs != ref
    rec = invariants.Monitor(mode="strict", raise_on_violation=False)
    run(family, None, hooks=[rec])
    v = rec.violations[0]
    assert v.invariant == "I4" and any("sliding window" in r for r in v.trace["rules"]), str(v)
    first_wrong = min(next(i for i, (a, b) in enumerate(zip(s + [None], r + [None])) if a != b)
                      for s, r in zip(seqs, ref) if s != r)
    assert v.step <= first_wrong  # a step commits >= 1 token per row: never after it


def test_unknown_fault_is_refused():
    target, _ = tiny_pair("llama")
    with pytest.raises(ValueError, match="unknown known-bad engine"):
        generate_known_bad("nope", target, [[5]], drafter=drafters.NGramDrafter())
