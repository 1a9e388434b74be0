"""The output-equivalence oracle (I7) as a specification, on a tiny Llama (no specdec)."""

from __future__ import annotations

import inspect

import pytest
import torch

from invariants import DEFAULT_TOLERANCE, Monitor, compare_outputs
from invariants._hf import shaped_logits
from invariants.equivalence import (FLOOR_ULPS, EngineShape, check_row, divergence_margin,
                                    greedy_reference, recomputations, ulp)
from toy_engine import hf_tiny_llama

torch.set_num_threads(1)

PROMPTS = [[5, 9, 13, 4], [7, 3], [11, 12, 13, 14, 15, 16]]
BUDGET = 10


@pytest.fixture(scope="module")
def model():
    return hf_tiny_llama(seed=1)


@pytest.fixture(scope="module")
def refs(model):
    return [greedy_reference(model, p, BUDGET, [2])[0] for p in PROMPTS]


def tied_model(prompt, ref, d=1):
    """A private copy of the tiny Llama where a fresh token ``u`` ties exactly with
    ``ref[d]`` at every position (same output row) but is a different input (its own
    embedding): its greedy reference and the two tied tokens."""
    model = hf_tiny_llama(seed=1)
    t = ref[d]
    u = next(x for x in range(3, 64) if x not in prompt + ref)
    with torch.no_grad():
        model.lm_head.weight[u] = model.lm_head.weight[t]
    tied = greedy_reference(model, prompt, BUDGET, [2])[0]
    return model, tied, t, u


def test_the_default_rule_is_calibrated_everywhere():
    assert DEFAULT_TOLERANCE is None
    for fn in (compare_outputs, check_row):
        assert inspect.signature(fn).parameters["tolerance"].default is None
    assert inspect.signature(Monitor).parameters["near_tie_tolerance"].default is None


def test_the_reference_is_hugging_face_greedy_decoding(model, refs):
    for p, r in zip(PROMPTS, refs):
        out = model.generate(torch.tensor([p]), max_new_tokens=BUDGET, do_sample=False,
                             eos_token_id=2, pad_token_id=2)[0, len(p):].tolist()
        cut = next((i + 1 for i, t in enumerate(out) if t == 2), len(out))
        assert r == out[:cut]


def test_identical_outputs_are_equal(model, refs):
    res = compare_outputs(model, PROMPTS, refs, max_new_tokens=BUDGET, stop_token_ids=[2])
    assert res.ok and [r.classification for r in res.rows] == ["equal"] * 3
    assert res.counts() == {"equal": 3, "near-tie": 0, "desync": 0}


def test_ulp_is_the_dtype_resolution_at_the_magnitude():
    assert ulp(20.0, torch.bfloat16) == 0.125 and ulp(-20.0, torch.bfloat16) == 0.125
    assert ulp(40.0, torch.bfloat16) == 0.25 and ulp(1.0, torch.bfloat16) == 2 ** -7
    assert ulp(20.0, torch.float16) == 2 ** -6
    assert ulp(20.0, torch.float32) == 16 * 2 ** -23


def test_every_recomputation_computes_the_same_function(model):
    """The spread may only come from rounding: in fp32 every recomputation's logits agree
    with a plain forward to 1e-4 (a wrong mask or position would move them by far more
    and would excuse real desyncs)."""
    x = PROMPTS[2] + [20, 21, 22, 23, 24, 25, 26, 27]
    base = shaped_logits(model, x)
    shapes = recomputations(len(PROMPTS[2]), len(x), EngineShape(batch_size=3, padding=4, chunk=3))
    assert {"batch", "padding"} <= {k for kw in shapes for k in kw}
    for kw in shapes:
        assert torch.allclose(shaped_logits(model, x, **kw), base, atol=1e-4), kw


def test_a_clear_winner_not_chosen_is_a_desync(model, refs):
    d = 3
    ref = refs[0]
    wrong = ref[:d] + [(ref[d] + 1) % 64] + ref[d + 1:]
    row = compare_outputs(model, PROMPTS[:1], [wrong], [ref]).rows[0]
    bad = row.desync
    assert (row.classification, bad.index, bad.expected, bad.actual) == \
        ("desync", d, ref[d], wrong[d])
    assert bad.gap > bad.threshold >= bad.spread and bad.recomputations > 5
    margin, gap = divergence_margin(model, PROMPTS[0], ref[:d], wrong[d])
    assert (bad.margin, bad.gap) == (pytest.approx(margin), pytest.approx(gap))
    assert bad.threshold == pytest.approx(max(bad.spread, FLOOR_ULPS * bad.ulp))


def test_the_absolute_rule_excuses_a_runner_up_only_within_the_tolerance(model, refs):
    d, ref, prompt = 2, refs[1], PROMPTS[1]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ref[:d]])).logits[0, -1]
    runner_up = int(logits.topk(2).indices[1])
    out = ref[:d] + [runner_up]
    margin = float(logits.topk(2).values[0] - logits.topk(2).values[1])
    loose = compare_outputs(model, [prompt], [out], [ref[: d + 1]], tolerance=2 * margin)
    tight = compare_outputs(model, [prompt], [out], [ref[: d + 1]], tolerance=margin / 2)
    calibrated = compare_outputs(model, [prompt], [out], [ref[: d + 1]])
    assert loose.rows[0].classification == "near-tie"
    assert tight.rows[0].classification == "desync"
    assert loose.rows[0].margin == pytest.approx(margin, rel=1e-4)
    assert calibrated.rows[0].classification == "desync"  # fp32 noise is far below margin
    assert "absolute" in loose.rule and "calibrated" in calibrated.rule


def test_an_exact_tie_is_a_near_tie(refs):
    model, tied, t, u = tied_model(PROMPTS[0], refs[0])
    i = next(i for i, x in enumerate(tied) if x in (t, u))
    out = tied[:i] + [u if tied[i] == t else t]
    row = compare_outputs(model, [PROMPTS[0]], [out], [tied[: i + 1]]).rows[0]
    assert row.classification == "near-tie" and row.margin == 0 and row.gap == 0


@pytest.fixture(scope="module")
def flipped(refs):
    """(tied model, its reference, index i, a row that takes the other tied token at i and
    then follows the model's greedy choice after its own prefix)."""
    prompt = PROMPTS[0]
    model, tied, t, u = tied_model(prompt, refs[0])
    i = next(i for i, x in enumerate(tied) if x in (t, u))
    flip = u if tied[i] == t else t
    rest = greedy_reference(model, prompt + tied[:i] + [flip], BUDGET - i - 1, [2])[0]
    return model, tied, i, tied[:i] + [flip] + rest


def test_after_a_near_tie_the_row_follows_its_own_prefix(flipped):
    """The tied flip changes the input, so the legitimate continuation leaves the batch-1
    reference; it is checked against the greedy choice after the row's own prefix."""
    model, tied, i, out = flipped
    assert out[i + 1:] != tied[i + 1:]  # the batch-1 reference no longer applies
    row = compare_outputs(model, PROMPTS[:1], [out], [tied], max_new_tokens=BUDGET).rows[0]
    assert row.classification == "near-tie"
    assert [(d.index, d.reference) for d in row.near_ties] == [(i, "batch-1 greedy")]
    assert row.desync is None


def test_a_desync_after_a_near_tie_is_still_found(flipped):
    model, tied, i, out = flipped
    j = i + 2
    assert j < len(out)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPTS[0] + out[:j]])).logits[0, -1]
    wrong = out[:j] + [int(logits.argmin())] + out[j + 1:]  # a clear loser, after the tie
    row = compare_outputs(model, PROMPTS[:1], [wrong], [tied], max_new_tokens=BUDGET).rows[0]
    assert row.classification == "desync"
    assert [(d.index, d.classification) for d in row.divergences] == \
        [(i, "near-tie"), (j, "desync")]
    assert row.desync.reference == "teacher-forced" and row.desync.expected == out[j]


def test_after_a_near_tie_the_length_is_still_checked(flipped):
    model, tied, i, out = flipped
    short = compare_outputs(model, PROMPTS[:1], [out[:-1]], [tied], max_new_tokens=BUDGET)
    bad = short.rows[0].desync
    assert (bad.index, bad.expected, bad.actual) == (len(out) - 1, out[-1], None)


def test_an_output_that_stops_early_is_a_desync(model, refs):
    row = compare_outputs(model, PROMPTS[:1], [refs[0][:4]], [refs[0]]).rows[0]
    assert (row.classification, row.first_divergence, row.actual) == ("desync", 4, None)


def test_an_output_longer_than_the_reference_is_a_desync(model, refs):
    row = compare_outputs(model, PROMPTS[:1], [refs[0] + [7]], [refs[0]]).rows[0]
    assert (row.classification, row.expected, row.margin) == ("desync", None, None)


def test_the_engine_shape_adds_a_recomputation(model, refs):
    d = 3
    wrong = refs[0][:d] + [(refs[0][d] + 1) % 64] + refs[0][d + 1:]
    outs = [wrong] + refs[1:]  # row 0 sits in a batch of 3, left-padded by 2 (6 - 4)
    plain = compare_outputs(model, PROMPTS, outs, refs).rows[0].desync
    shaped = compare_outputs(model, PROMPTS, outs, refs, batch_size=8, chunk=3).rows[0].desync
    assert shaped.recomputations == plain.recomputations + 1


def test_evidence_is_reported_in_logits_and_ulps(model, refs):
    wrong = refs[0][:3] + [(refs[0][3] + 1) % 64]
    d = compare_outputs(model, PROMPTS[:1], [wrong], [refs[0][:4]]).rows[0].desync.as_dict()
    for k in ("margin", "gap", "reference_gap", "spread", "threshold"):
        assert d[k + "_ulps"] == pytest.approx(d[k] / d["ulp"])
    assert d["index"] == 3 and d["recomputations"] > 1


def test_without_references_the_budget_is_required(model):
    with pytest.raises(ValueError, match="max_new_tokens"):
        compare_outputs(model, PROMPTS, [[1]] * 3)


def test_one_output_per_prompt_is_required(model, refs):
    with pytest.raises(ValueError, match="one output per prompt"):
        compare_outputs(model, PROMPTS, refs[:2], refs)


def test_a_tolerance_is_none_or_a_number_of_logits(model, refs):
    with pytest.raises(ValueError, match="tolerance must be None"):
        compare_outputs(model, PROMPTS, refs, refs, tolerance=-1.0)


def test_the_summary_names_every_divergent_row_and_the_rule(model, refs):
    wrong = [refs[0], refs[1][:1] + [(refs[1][1] + 1) % 64], refs[2]]
    text = str(compare_outputs(model, PROMPTS, wrong, refs))
    head = text.splitlines()[0]
    assert head.startswith("3 rows: 2 equal, 0 near-tie, 1 desync (float32; calibrated")
    assert "row 1: desync\n  desync at output index 1" in text
