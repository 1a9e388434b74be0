"""Each invariant rule, as a specification: a correct run passes, and one precise mistake
made at one phase is caught by exactly the rule that forbids it, in strict and fast mode.

Views come from the model-free toy engine in ``tests/toy_engine.py`` (invariants must not
depend on specdec); the engine integration is in ``test_invariants_integration.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from invariants import ForwardRecord, Monitor
from invariants import predicates as P
from invariants import rules as R
from toy_engine import TOY_STOP, toy_views

torch.set_num_threads(1)

PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10, 11, 12], [9], [5, 6, 7, 8, 9]]
VIEWS = list(toy_views(PROMPTS, k=3, budget=8, seed=0))


def first(phase, where=lambda v: True, min_step=1) -> int:
    """Index in VIEWS of the first view of ``phase`` (step >= min_step) satisfying where."""
    for i, (ph, v) in enumerate(VIEWS):
        if ph == phase and v.step >= min_step and where(v):
            return i
    raise LookupError(f"no {phase} view with that property in the toy run")


def run(index, mutate, mode, only):
    mon = Monitor(mode, raise_on_violation=False, invariants=(only,))
    for i, (ph, v) in enumerate(VIEWS[: index + 1]):
        mon(ph, mutate(v) if i == index else v)
    return mon.check()


def assert_caught(index, mutate, inv, rule):
    """The mutated view at ``index`` breaks ``rule`` of ``inv`` (strict and fast mode)."""
    for mode in ("strict", "fast"):
        found = run(index, mutate, mode, inv)
        assert found, f"{mode}: {inv} did not catch the mistake"
        v = found[0]
        ph, view = VIEWS[index]
        assert (v.invariant, v.step, v.phase) == (inv, view.step, ph), str(v)
        assert any(rule in r for r in v.rules), f"{rule!r} not in {v.rules}"
    return v


def replace(**fields):
    return lambda v: dataclasses.replace(v, **{k: f(v) for k, f in fields.items()})


def edit(tensor, index, value):
    t = tensor.clone()
    t[index] = value
    return t


def padded_row(v) -> int:
    """A row with left padding (its first slot is not valid)."""
    return int(torch.nonzero(~v.valid[:, 0])[0])


# -- a correct run ---------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["fast", "strict"])
def test_a_correct_run_satisfies_every_cheap_invariant(mode):
    mon = Monitor(mode)
    for ph, v in VIEWS:
        mon(ph, v)
    assert mon.check() == []


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5),
       k=st.integers(0, 4), budget=st.integers(1, 9), seed=st.integers(0, 10_000),
       accept_p=st.sampled_from([0.0, 0.5, 1.0]))
def test_no_false_alarm_on_any_correct_run(lengths, k, budget, seed, accept_p):
    prompts = [[3 + (seed + 7 * i + j) % 13 for j in range(n)] for i, n in enumerate(lengths)]
    mon = Monitor("strict")
    for ph, v in toy_views(prompts, k=k, budget=budget, seed=seed, accept_p=accept_p):
        mon(ph, v)


# -- I1 rectangular alignment ----------------------------------------------------------

def test_i1_cache_one_slot_short_after_realign():
    i = first("realign")
    assert_caught(i, replace(cache_widths=lambda v: tuple(c - 1 for c in v.cache_widths)),
                  "I1", "every target cache layer has width")


def test_i1_cache_layers_of_different_widths():
    i = first("draft")
    assert_caught(i, replace(cache_widths=lambda v: (v.width - 1, v.width - 2)),
                  "I1", "every target cache layer has width")


def test_i1_cache_not_extended_by_the_verify_forward():
    i = first("verify")
    assert_caught(i, replace(cache_widths=lambda v: (v.width - 1,) * 2),
                  "I1", "every target cache layer has width")


def test_i1_cache_batch_differs_from_the_rows():
    i = first("realign", lambda v: v.batch_size < len(PROMPTS))
    assert_caught(i, replace(cache_batch_sizes=lambda v: (len(PROMPTS),) * 2),
                  "I1", "batch size B")


def test_i1_draft_cache_breaks_its_stated_lag():
    i = first("draft")
    assert_caught(i, replace(draft_cache_widths=lambda v: (v.width - 1,) * 2,
                             draft_cache_lag=lambda v: v.k + 1),
                  "I1", "draft cache layer has width W - 1 + draft_cache_lag")


def test_i1_tensors_of_different_widths():
    i = first("draft")
    assert_caught(i, replace(positions=lambda v: v.positions[:, 1:]),
                  "I1", "tokens, valid and positions are [B, W]")


# -- I2 layout ---------------------------------------------------------------------------

def test_i2_hole_in_a_contiguous_row():
    i = first("realign")
    v = VIEWS[i][1]
    b = padded_row(v)
    first_real = v.width - int(v.lengths[b])
    assert_caught(i, replace(valid=lambda v: edit(v.valid, (b, first_real), False)),
                  "I2", "0^(W - n[b]) 1^(n[b])")


def test_i2_width_not_minimal():
    i = first("realign")

    def pad_one_column(v):
        col = lambda t, x: torch.cat([torch.full_like(t[:, :1], x), t], dim=1)  # noqa: E731
        return dataclasses.replace(v, tokens=col(v.tokens, 0), valid=col(v.valid, False),
                                   positions=col(v.positions, 0),
                                   cache_widths=tuple(c + 1 for c in v.cache_widths))
    assert_caught(i, pad_one_column, "I2", "min over rows of the left padding")


def test_i2_more_real_tokens_than_slots():
    i = first("draft")
    assert_caught(i, replace(lengths=lambda v: edit(v.lengths, 0, v.width + 1)),
                  "I2", "1 <= n[b] <= W")


def test_i2_holes_profile_needs_the_pending_token_in_the_last_slot():
    i = first("draft")
    assert_caught(i, replace(profile=lambda v: "holes",
                             valid=lambda v: edit(v.valid, (0, -1), False)),
                  "I2", "pending token of every active row sits in slot W - 1")


def test_i2_holes_profile_allows_holes_before_the_pending_token():
    _, v = VIEWS[first("draft")]
    b = padded_row(v)
    holed = dataclasses.replace(v, profile="holes")
    assert not R.i2_layout(holed).any()
    v2 = dataclasses.replace(holed, valid=edit(v.valid, (b, v.width - 2), False),
                             lengths=edit(v.lengths, b, int(v.lengths[b]) - 1))
    assert not R.i2_layout(v2).any()


def test_i2_grouped_profile_forbids_padding():
    i = first("draft", lambda v: bool((~v.valid).any()))
    assert_caught(i, replace(profile=lambda v: "grouped"), "I2", "no padding")


# -- I3 position-id contiguity -------------------------------------------------------------

def test_i3_position_off_by_one():
    i = first("realign")
    assert_caught(i, replace(positions=lambda v: edit(v.positions, (0, -2), v.positions[0, -2] + 1)),
                  "I3", "positions[b, j] = number of valid slots before j")


def test_i3_positions_that_count_padding():
    i = first("realign")
    v = VIEWS[i][1]
    found = assert_caught(i, replace(positions=lambda v: torch.arange(v.width).expand(v.batch_size, -1)),
                          "I3", "number of valid slots before j")
    b = padded_row(v)
    assert b in found.rows
    assert found.slots[found.rows.index(b)][0] == v.width - int(v.lengths[b])


def test_i3_verify_forward_positions_skip_one():
    i = first("verify")

    def shift(v):
        f = v.forward
        return dataclasses.replace(v, forward=dataclasses.replace(f, positions=f.positions + 1))
    assert_caught(i, shift, "I3", "the forward's position of every new token")


def test_i3_ignores_positions_of_drafts_a_row_may_not_use():
    _, v = VIEWS[first("verify")]
    f = v.forward
    limit = torch.zeros_like(v.draft_limit)  # no draft usable: only the pending token counts
    late = f.positions.clone()
    late[:, 1:] = 10_000  # e.g. clamped to the context length
    v2 = dataclasses.replace(v, draft_limit=limit, forward=dataclasses.replace(f, positions=late))
    assert not R.i3_positions(v2).any()


# -- I4 mask coherence -------------------------------------------------------------------

def _with_forward(**changes):
    def go(v):
        return dataclasses.replace(v, forward=dataclasses.replace(v.forward, **{
            k: f(v.forward, v) for k, f in changes.items()}))
    return go


def test_i4_mask_not_extended_for_the_new_tokens():
    i = first("verify")
    assert_caught(i, _with_forward(attention_mask=lambda f, v: f.attention_mask[:, : f.cache_width]),
                  "I4", "width cache width + new tokens")


def test_i4_mask_attends_padding():
    i = first("verify")
    assert_caught(i, _with_forward(attention_mask=lambda f, v: torch.ones_like(f.attention_mask)),
                  "I4", "the mask over cache slots equals valid")


def test_i4_a_draft_masked_out():
    i = first("verify")
    assert_caught(i, _with_forward(
        attention_mask=lambda f, v: edit(f.attention_mask, (0, f.cache_width + 1), False)),
        "I4", "the mask over new tokens equals their validity")


def test_i4_wrong_pending_token_fed():
    i = first("verify")
    assert_caught(i, _with_forward(
        input_ids=lambda f, v: edit(f.input_ids, (0, 0), (f.input_ids[0, 0] + 1) % 16)),
        "I4", "the forward's inputs are the row's tokens")


def test_i4_forward_from_a_stale_cache_width():
    i = first("verify")
    assert_caught(i, _with_forward(cache_width=lambda f, v: f.cache_width - 1),
                  "I4", "cache width before the forward + new tokens")


def test_i4_prefill_mask_equals_valid():
    i = first("prefill", min_step=0)
    assert_caught(i, _with_forward(attention_mask=lambda f, v: torch.ones_like(f.attention_mask)),
                  "I4", "the mask over new tokens equals their validity")


# -- I6 token conservation ----------------------------------------------------------------

def _commit_row(pred):
    """(index of the first commit view with a row satisfying pred(a, limit), that row)."""
    for i, (ph, v) in enumerate(VIEWS):
        if ph == "commit":
            for b in range(v.batch_size):
                if pred(int(v.accepted[b]), int(v.draft_limit[b])):
                    return i, b
    raise LookupError("no such commit in the toy run")


def test_i6_output_never_changes_retroactively():
    i = first("realign", min_step=2)
    assert_caught(i, replace(output=lambda v: edit(v.output, (0, 0), (v.output[0, 0] + 1) % 16)),
                  "I6", "output never changes retroactively")


def test_i6_generated_never_exceeds_the_budget():
    i = first("commit")
    assert_caught(i, replace(generated=lambda v: edit(v.generated, 0, v.budgets[0] + 1)),
                  "I6", "0 <= generated[b] <= budget[b]")


def test_i6_every_active_row_commits_at_least_one_token():
    i = first("commit")
    assert_caught(i, replace(committed=lambda v: edit(v.committed, 0, 0),
                             generated=lambda v: edit(v.generated, 0, v.generated_before[0])),
                  "I6", "1 <= committed <= k + 1")


def test_i6_no_row_commits_more_than_k_plus_one():
    i = first("commit")
    assert_caught(i, replace(committed=lambda v: edit(v.committed, 0, v.k + 2)),
                  "I6", "1 <= committed <= k + 1")


def test_i6_committed_tokens_are_the_target_predictions():
    i = first("commit")
    assert_caught(i, replace(output=lambda v: edit(
        v.output, (0, v.generated_before[0]), (v.predictions[0, 0] + 1) % 16)),
        "I6", "the committed tokens are the target's predictions")


def test_i6_a_rejected_draft_is_never_accepted():
    i, b = _commit_row(lambda a, lim: a < lim)
    assert_caught(i, replace(accepted=lambda v: edit(v.accepted, b, v.accepted[b] + 1)),
                  "I6", "accepted drafts equal the target's predictions")


def test_i6_acceptance_takes_the_longest_matching_prefix():
    i, b = _commit_row(lambda a, lim: a >= 1)
    assert_caught(i, replace(accepted=lambda v: edit(v.accepted, b, v.accepted[b] - 1)),
                  "I6", "longest matching prefix")


def test_i6_nothing_after_the_first_stop_token():
    i = first("realign", lambda v: bool((v.generated >= 2).any()))
    v = VIEWS[i][1]
    b = int(torch.nonzero(v.generated >= 2)[0])
    assert_caught(i, replace(output=lambda v: edit(v.output, (b, 0), TOY_STOP)),
                  "I6", "nothing after the first stop token")


def test_i6_a_row_ending_in_a_stop_token_is_finished():
    i = first("commit")
    v = VIEWS[i][1]
    b = int(torch.nonzero(~v.finished)[0])
    g = int(v.generated[b])
    assert_caught(i, replace(output=lambda v: edit(v.output, (b, g - 1), TOY_STOP)),
                  "I6", "a row whose output ends in a stop token is finished")


def test_i6_a_row_finishes_only_at_a_stop_token_or_its_budget():
    i = first("commit")
    v = VIEWS[i][1]
    b = int(torch.nonzero(~v.finished)[0])
    assert_caught(i, replace(finished=lambda v: edit(v.finished, b, True)),
                  "I6", "a finished row ended on a stop token or its budget")


def test_i6_real_tokens_are_prompt_then_output():
    i = first("realign")
    assert_caught(i, replace(tokens=lambda v: edit(v.tokens, (0, -1), (v.tokens[0, -1] + 1) % 16)),
                  "I6", "prompt ++ output")


def test_i6_lengths_count_prompt_and_output():
    i = first("draft")
    assert_caught(i, replace(lengths=lambda v: edit(v.lengths, 0, v.lengths[0] + 1)),
                  "I6", "n[b] = prompt + committed output")


def test_i6_generated_changes_only_at_commit():
    i = first("realign")
    assert_caught(i, replace(generated=lambda v: edit(v.generated, 0, v.generated[0] - 1)),
                  "I6", "generated changes only at commit")


# -- tensor-level helpers (shared with guard) -----------------------------------------------

def test_position_slots_accept_holes_when_positions_skip_them():
    valid = torch.tensor([[False, True, False, True, True]])
    good = torch.tensor([[0, 0, 0, 1, 2]])
    assert not P.position_slots(valid, good).any()
    bad = torch.tensor([[0, 0, 0, 2, 3]])  # counts the hole
    assert P.position_slots(valid, bad).tolist() == [[False, False, False, True, True]]


def test_forward_position_slots_check_only_valid_new_tokens():
    mask = torch.tensor([[0, 1, 1, 0, 1]])  # cache 3 slots, 2 new tokens (first is padding)
    assert not P.forward_position_slots(mask, torch.tensor([[99, 2]]), 3).any()
    assert P.forward_position_slots(mask, torch.tensor([[0, 3]]), 3).tolist() == [[False, True]]


def test_masks_stay_on_the_device_of_the_view():
    _, v = VIEWS[first("commit")]
    for mask in (R.i1_alignment(v), R.i2_layout(v), R.i3_positions(v), R.i4_mask(v),
                 R.i6_conservation(v)):
        assert mask.shape == (v.batch_size,) and mask.dtype == torch.bool
        assert mask.device == v.device


def test_forward_record_of_the_toy_engine_is_well_formed():
    _, v = VIEWS[first("verify")]
    assert isinstance(v.forward, ForwardRecord)
    assert v.forward.attention_mask.shape[1] == v.forward.cache_width + v.k + 1


def test_build_view_builds_the_dataclass_view_and_refuses_what_init_refuses():
    """``view.build_view`` (what engines call after every phase, without the frozen
    dataclass's per-field setattr) makes the view ``StepView(**fields)`` makes, and raises
    TypeError on an unknown or a missing field, as ``__init__`` does."""
    from invariants.view import StepView, build_view

    for _, v in VIEWS[:6]:
        fields = {f.name: getattr(v, f.name) for f in dataclasses.fields(StepView)}
        built = build_view(dict(fields))
        assert type(built) is StepView and built == StepView(**fields)
        fields.pop("info")  # a default factory: a new dict per view
        assert build_view(dict(fields)).info == {}
        with pytest.raises(TypeError, match="unexpected fields \\['nope'\\]"):
            build_view({**fields, "nope": 1})
        missing = {n: x for n, x in fields.items() if n != "tokens"}
        with pytest.raises(TypeError, match="missing required fields \\['tokens'\\]"):
            build_view(missing)
