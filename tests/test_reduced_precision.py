"""Exactness in bfloat16 and float16, judged by the calibrated oracle, on tiny models.

In reduced precision a batched loop legitimately differs from batch-1 greedy decoding where
two logits are nearly tied, so the claim is: every correct engine gives no desync (near-
ties allowed), every known-bad engine is still flagged (by a desync or an invariant), and
a broken loop's divergence is a desync the calibrated rule does not excuse. The first two
over random batch compositions (hypothesis), on every tiny family, in bf16 and fp16.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

import invariants
import specdec
from specdec import models
from specdec.forensics.known_bad import KNOWN_BAD
from specdec.reference import hf_generate
from broken_loop import BROKEN_LOOPS, broken_greedy
from harness import NAIVE, random_prompts, run_case
from hyp_inputs import Case, cases

pytestmark = pytest.mark.engine

DTYPES = ("bfloat16", "float16")
SPECULATIVE = ("eqspec", "exspec", "holes")


@functools.lru_cache(maxsize=None)
def target(family: str, dtype: str):
    return models.tiny(family, dtype=dtype)


def oracle(model, prompts, seqs, ref, case: Case, stops, chunk):
    res = invariants.compare_outputs(model, prompts, seqs, ref, max_new_tokens=case.budget,
                                     stop_token_ids=stops, batch_size=case.batch_size,
                                     chunk=chunk)
    for row in res.rows:
        if not row.equal:
            note(row.describe())
    return res


def test_tiny_models_load_in_every_dtype():
    for dtype in ("float32",) + DTYPES:
        m = models.tiny("llama", dtype=dtype)
        assert {p.dtype for p in m.parameters()} == {models.DTYPES[dtype]}
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16"):
        models.tiny("llama", dtype="int8")


@given(case=cases(max_rows=10, max_budget=10, context=128), dtype=st.sampled_from(DTYPES))
def test_correct_engines_give_no_desync(case, dtype):
    model = target(case.family, dtype)
    for strategy in SPECULATIVE:  # under a strict Monitor, forced acceptance patterns
        o = run_case(case, strategy=strategy, target=model)
        assert o.violations == [], o.violations[0]
        res = oracle(model, _prompts(case), o.sequences, o.reference, case, o.stops,
                     case.k + 1)
        assert res.desyncs == [], f"{strategy} ({dtype}):\n{res}"
    prompts = _prompts(case)
    plain = {"standard": specdec.reference_generate(model, prompts, max_new_tokens=case.budget,
                                                    batch_size=case.batch_size,
                                                    stop_token_ids=o.stops),
             "hf_generate": hf_generate(model, prompts, max_new_tokens=case.budget,
                                        batch_size=case.batch_size, stop_token_ids=o.stops)}
    for name, seqs in plain.items():
        res = oracle(model, prompts, seqs, o.reference, case, o.stops, 1)
        assert res.desyncs == [], f"{name} ({dtype}):\n{res}"


def _prompts(case: Case):
    return random_prompts(case.lengths, models.TINY_VOCAB, seed=case.seed)


@st.composite
def bad_compositions(draw):
    """A batch composition under which every defect shows: at least two rows per batch,
    rows that accept all drafts next to rows that reject (alternating), and enough
    budget for a full step."""
    k = draw(st.integers(1, 4))
    budget = draw(st.integers(k + 2, 10))
    lengths = draw(st.lists(st.integers(1, 40), min_size=2, max_size=8))
    batch_size = min(draw(st.integers(2, 8)), len(lengths))
    pattern = [[k if (r + s) % 2 else 0 for s in range(budget)] for r in range(len(lengths))]
    family = draw(st.sampled_from(("llama", "qwen3", "glm4", "gpt2")))
    return Case(family, lengths, budget, k, batch_size, pattern, None,
                seed=draw(st.integers(0, 3)))


@pytest.mark.parametrize("fault", list(KNOWN_BAD))
@given(case=bad_compositions(), dtype=st.sampled_from(DTYPES))
def test_known_bad_engines_are_still_flagged(fault, case, dtype):
    """Flagged by an invariant or a desync whenever the defect acted, that is whenever the
    run differs from the same loop without the defect (in bf16 a legitimate flip may steer
    a row away from what triggers a defect, e.g. from the stop token it would have met)."""
    model = target(case.family, dtype)
    if fault == "keep_after_stop":  # the first row's reference meets a stop token early
        case = dataclasses.replace(case, stop=(0, 1))
    o = run_case(case, strategy="holes", known_bad=fault, target=model)
    res = oracle(model, _prompts(case), o.sequences, o.reference, case, o.stops, case.k + 1)
    note(f"violations: {[v.invariant for v in o.violations]}, {res.counts()}")
    if o.violations or res.desyncs:
        return
    exact = run_case(case, strategy="holes", known_bad=NAIVE, target=model)
    assert (o.sequences, o.commits) == (exact.sequences, exact.commits), \
        f"{fault} acted without being flagged"


@pytest.mark.parametrize("bug", BROKEN_LOOPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_broken_loop_is_a_desync_not_a_near_tie(family, dtype, bug):
    """A batched greedy loop with a masking bug computes other logits: every row it
    changes is a desync, its gap beyond the measured spread."""
    model = target(family, dtype)
    prompts = random_prompts((3, 9, 20, 5, 14, 2), models.TINY_VOCAB, seed=1)
    ref = specdec.reference_generate(model, prompts, max_new_tokens=8)
    broken = broken_greedy(model, prompts, max_new_tokens=8, bug=bug)
    res = invariants.compare_outputs(model, prompts, broken, ref, max_new_tokens=8,
                                     batch_size=len(prompts))
    changed = [i for i, (a, b) in enumerate(zip(broken, ref)) if a != b]
    assert len(changed) >= 4, res
    assert [r.row for r in res.desyncs] == changed, res
    for row in res.desyncs:
        assert row.desync.gap > row.desync.threshold, row.describe()
