"""The output-equivalence oracle (I7) as a specification, on a tiny Llama (no specdec)."""

from __future__ import annotations

import inspect

import pytest
import torch

from invariants import DEFAULT_TOLERANCE, compare_outputs
from invariants.equivalence import divergence_margin, greedy_reference
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


def test_the_default_tolerance_is_stated_and_used():
    assert DEFAULT_TOLERANCE == 1e-3
    assert inspect.signature(compare_outputs).parameters["tolerance"].default == DEFAULT_TOLERANCE


def test_the_reference_is_hugging_face_greedy_decoding(model, refs):
    for p, r in zip(PROMPTS, refs):
        out = model.generate(torch.tensor([p]), max_new_tokens=BUDGET, do_sample=False,
                             eos_token_id=2, pad_token_id=2)[0, len(p):].tolist()
        cut = next((i + 1 for i, t in enumerate(out) if t == 2), len(out))
        assert r == out[:cut]


def test_identical_outputs_are_equal(model, refs):
    res = compare_outputs(model, PROMPTS, refs, max_new_tokens=BUDGET, stop_token_ids=[2])
    assert res.ok and [r.classification for r in res.rows] == ["equal"] * 3


def test_a_clear_winner_not_chosen_is_a_desync(model, refs):
    d = 3
    ref = refs[0]
    wrong = ref[:d] + [(ref[d] + 1) % 64] + ref[d + 1:]
    res = compare_outputs(model, PROMPTS[:1], [wrong], [ref])
    row = res.rows[0]
    assert (row.classification, row.first_divergence, row.expected, row.actual) == \
        ("desync", d, ref[d], wrong[d])
    assert row.margin > DEFAULT_TOLERANCE
    margin, _ = divergence_margin(model, PROMPTS[0], ref[:d], None)
    assert row.margin == pytest.approx(margin)


def test_a_flip_to_the_runner_up_is_a_near_tie_only_within_the_tolerance(model, refs):
    d, ref, prompt = 2, refs[1], PROMPTS[1]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ref[:d]])).logits[0, -1]
    runner_up = int(logits.topk(2).indices[1])
    out = ref[:d] + [runner_up]
    margin = float(logits.topk(2).values[0] - logits.topk(2).values[1])
    loose = compare_outputs(model, [prompt], [out], [ref[: d + 1]], tolerance=2 * margin)
    tight = compare_outputs(model, [prompt], [out], [ref[: d + 1]], tolerance=margin / 2)
    assert loose.rows[0].classification == "near-tie"
    assert tight.rows[0].classification == "desync"
    assert loose.rows[0].margin == pytest.approx(margin, rel=1e-4)


def test_an_exact_tie_is_a_near_tie(refs):
    model = hf_tiny_llama(seed=1)
    prompt, ref = PROMPTS[0], refs[0]
    d = 1
    t = ref[d]
    u = next(x for x in range(3, 64) if x not in prompt + ref)
    with torch.no_grad():  # token u gets the same output row as t: their logits tie exactly
        model.lm_head.weight[u] = model.lm_head.weight[t]
    tied = greedy_reference(model, prompt, BUDGET, [2])[0]
    i = next(i for i, x in enumerate(tied) if x in (t, u))
    out = tied[:i] + [u if tied[i] == t else t]
    row = compare_outputs(model, [prompt], [out], [tied[: i + 1]]).rows[0]
    assert row.classification == "near-tie" and row.margin <= DEFAULT_TOLERANCE


def test_an_output_that_stops_early_is_a_desync(model, refs):
    row = compare_outputs(model, PROMPTS[:1], [refs[0][:4]], [refs[0]]).rows[0]
    assert (row.classification, row.first_divergence, row.actual) == ("desync", 4, None)


def test_an_output_longer_than_the_reference_is_a_desync(model, refs):
    row = compare_outputs(model, PROMPTS[:1], [refs[0] + [7]], [refs[0]]).rows[0]
    assert (row.classification, row.expected, row.margin) == ("desync", None, None)


def test_without_references_the_budget_is_required(model):
    with pytest.raises(ValueError, match="max_new_tokens"):
        compare_outputs(model, PROMPTS, [[1]] * 3)


def test_one_output_per_prompt_is_required(model, refs):
    with pytest.raises(ValueError, match="one output per prompt"):
        compare_outputs(model, PROMPTS, refs[:2], refs)


def test_the_summary_names_every_divergent_row(model, refs):
    wrong = [refs[0], refs[1][:1] + [(refs[1][1] + 1) % 64], refs[2]]
    text = str(compare_outputs(model, PROMPTS, wrong, refs))
    assert text.splitlines()[0].startswith("3 rows: 2 equal, 0 near-tie, 1 desync")
    assert "row 1: desync at output index 1" in text
