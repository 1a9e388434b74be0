"""I4.window: on a sliding-window model each query attends exactly the valid keys within
the window, measured in positions, not in slots (issue 13, point 5).

The rule is specified first on forwards given as explicit tensors (``invariants.window``),
against a plain-Python statement of the window over holes layouts drawn by hypothesis:
the right mask is silent in every form an engine may hand over (a 4-D bool or additive
mask, a dict per layer type), the model's own slot window is flagged exactly when holes
make it drop a key, and one flipped entry is flagged exactly when its query's output is
read. Then on the engine: the sliding families stay silent under every strategy with
keys past the window, the fault ``holes_flag_inverted`` (``specdec.mutants.FAULTS``) is
caught by the Monitor alone (strict: at the verify forward; fast: at ``check()``, with no
host transfer inside a hook), shrunk by hypothesis and printed as a trace, and the naive
known-bad loop's slot window is caught at its first forward that drops a key.
"""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

import invariants
from invariants import rules as R
from invariants import window as W
from invariants.view import ForwardRecord

torch.set_num_threads(1)

# -- the rule on explicit tensors ---------------------------------------------------------


@st.composite
def holes_forwards(draw, max_rows: int = 4):
    """A forward over a holes layout: per row left padding, then valid slots and masked
    holes in any order (cache columns), then q new tokens, all valid; a sliding window
    of 1 .. 12 positions; per row a draft limit 0 .. q - 1."""
    q = draw(st.integers(1, 4))
    c = draw(st.integers(0, 20))
    rows = draw(st.integers(1, max_rows))
    cache = [draw(st.lists(st.booleans(), min_size=c, max_size=c)) for _ in range(rows)]
    valid = torch.tensor([row + [True] * q for row in cache], dtype=torch.bool).reshape(rows, c + q)
    window = draw(st.integers(1, 12))
    limit = torch.tensor([draw(st.integers(0, q - 1)) for _ in range(rows)], dtype=torch.long)
    return valid, c, q, window, limit


def reads(valid, c, q, limit, b, i) -> bool:
    """Whether new token i of row b has its output read (valid, within the draft limit)."""
    return bool(valid[b, c + i]) and (limit is None or i <= int(limit[b]))


def must_attend(valid, c, q, window, b, i, j) -> bool:
    """The statement: a valid key j, not after the query, whose position (valid slots
    before it) lies within ``window`` positions of the query's."""
    s = c + i
    if not valid[b, j] or j > s:
        return False
    distance = int(valid[b, j + 1 : s + 1].sum())  # pos(query) - pos(key)
    return window is None or distance < window


def right_mask(valid, c, q, window) -> torch.Tensor:
    """[B, 1, q, C + q] bool: ``must_attend`` everywhere (every query, read or not)."""
    b = valid.shape[0]
    return torch.tensor([[[[must_attend(valid, c, q, window, r, i, j) for j in range(c + q)]
                           for i in range(q)]] for r in range(b)], dtype=torch.bool)


def record(valid, c, q, window, model_mask=None) -> ForwardRecord:
    b = valid.shape[0]
    ids = torch.full((b, q), 5, dtype=torch.long)
    pos = valid.long().cumsum(1)[:, c:] - 1
    return ForwardRecord(ids, pos, valid, c, window=window, model_mask=model_mask)


def slot_window_drops_a_key(valid, c, q, window, limit, b) -> bool:
    """The model's own window over slots (``slot(key) > slot(query) - window``) differs
    from the statement at a read query of row b."""
    for i in range(q):
        if not reads(valid, c, q, limit, b, i):
            continue
        for j in range(c + q):
            slot_window = bool(valid[b, j]) and j <= c + i and j > c + i - window
            if slot_window != must_attend(valid, c, q, window, b, i, j):
                return True
    return False


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


@SETTINGS
@given(holes_forwards())
def test_the_right_mask_is_silent_in_every_form_an_engine_hands_over(fw):
    valid, c, q, window, limit = fw
    right = right_mask(valid, c, q, window)
    full = right_mask(valid, c, q, None)
    additive = torch.where(right, 0.0, torch.finfo(torch.float32).min)
    for given_mask in (right, right.expand(-1, 3, -1, -1), additive,
                       {"sliding_attention": right, "full_attention": full}):
        assert not W.flags(record(valid, c, q, window, given_mask), limit).any()
        assert not W.flags(record(valid, c, q, window, given_mask)).any()


@SETTINGS
@given(holes_forwards())
def test_the_models_slot_window_is_flagged_exactly_when_holes_make_it_drop_a_key(fw):
    valid, c, q, window, limit = fw
    got = W.flags(record(valid, c, q, window), limit).tolist()
    assert got == [slot_window_drops_a_key(valid, c, q, window, limit, b)
                   for b in range(valid.shape[0])]


@SETTINGS
@given(holes_forwards(), st.data())
def test_one_flipped_entry_is_flagged_exactly_when_its_query_is_read(fw, data):
    valid, c, q, window, limit = fw
    right = right_mask(valid, c, q, window)
    b = data.draw(st.integers(0, valid.shape[0] - 1))
    i = data.draw(st.integers(0, q - 1))
    j = data.draw(st.integers(0, c + q - 1))
    wrong = right.clone()
    wrong[b, 0, i, j] = ~wrong[b, 0, i, j]
    flags = W.flags(record(valid, c, q, window, wrong), limit).tolist()
    assert flags == [r == b and reads(valid, c, q, limit, b, i) for r in range(valid.shape[0])]
    slots = W.key_slots(record(valid, c, q, window, wrong), limit)
    assert slots[b, j].item() == flags[b] and int(slots.sum()) == int(flags[b])


@SETTINGS
@given(holes_forwards())
def test_a_dict_holds_only_the_sliding_layers_to_the_window(fw):
    valid, c, q, window, limit = fw
    right, full = right_mask(valid, c, q, window), right_mask(valid, c, q, None)
    swapped = W.flags(record(valid, c, q, window,
                             {"sliding_attention": full, "full_attention": right}), limit)
    want = [any(reads(valid, c, q, limit, b, i) and bool((right[b, 0, i] != full[b, 0, i]).any())
                for i in range(q)) for b in range(valid.shape[0])]
    assert swapped.tolist() == want


def test_the_engines_position_mask_obeys_the_rule():
    """``specdec.cache.position_masks``: the masks the holes strategy hands a sliding
    model (one for every layer, or one per layer type), over a layout with holes."""
    from specdec import cache

    valid = torch.tensor([[False, True, True, False, False, True, True, False, True, True, True],
                          [True, False, True, True, True, True, False, False, True, True, True]])
    c, q = 8, 3
    pos = valid.long().cumsum(1) - 1
    for types_ in (None, ["sliding_attention", "full_attention"]):
        model = types.SimpleNamespace(config=types.SimpleNamespace(
            _attn_implementation="sdpa", sliding_window=3, layer_types=types_))
        given_mask = cache.position_masks(model, valid, pos, pos[:, c:], 3)
        fw = record(valid, c, q, 3, given_mask)
        assert not W.flags(fw).any()
        assert W.flags(record(valid, c, q, 3)).all()  # the model's own slot window would not


def test_a_malformed_given_mask_is_a_whole_batch_i4_violation():
    valid = torch.ones(2, 6, dtype=torch.bool)
    fw = record(valid, 4, 2, 3, torch.ones(2, 1, 2, 5, dtype=torch.bool))  # one key short
    assert W.malformed(fw, 2)
    view = types.SimpleNamespace(forward=fw, batch_size=2)
    rule = R.RULES_BY_ID["I4.window_shape"]
    assert rule.applies(view) and rule.host(view)


def test_a_window_must_be_a_positive_number_of_positions():
    valid = torch.ones(1, 3, dtype=torch.bool)
    for bad in (0, -2, 2.5, "8"):
        with pytest.raises(ValueError, match="sliding window is a positive number"):
            record(valid, 2, 1, bad)


# -- on the engine ------------------------------------------------------------------------

#: rows past the 24-position window of the tiny sliding families, of different lengths
PROMPTS_LENGTHS = (30, 3, 41, 12)
BUDGET = 16


def workload(family):
    import specdec
    from specdec import models
    from harness import random_prompts, tiny_target

    target = tiny_target(family)
    prompts = random_prompts(PROMPTS_LENGTHS, models.TINY_VOCAB, seed=1)
    ref = specdec.reference_generate(target, prompts, max_new_tokens=BUDGET, stop_token_ids=[])
    return target, prompts, ref


def run(family, strategy, mode, mutant=None, hooks=()):
    """The n-gram drafter, k = 4, fixed policy (rows reject at different offsets: holes
    open in the holes layout), every row past the window by its end."""
    import contextlib

    import specdec
    from specdec import drafters, mutants

    target, prompts, ref = workload(family)
    mon = invariants.Monitor(mode, raise_on_violation=False)
    with mutants.apply(mutant) if mutant else contextlib.nullcontext():
        res = specdec.generate(target, prompts, drafter=drafters.NGramDrafter(), strategy=strategy,
                               k=4, batch_size=4, max_new_tokens=BUDGET, stop_token_ids=[],
                               hooks=[mon, *hooks], policy="fixed")
    return mon, res, ref


@pytest.mark.engine
@pytest.mark.parametrize("mode", ["strict", "fast"])
@pytest.mark.parametrize("strategy", ["eqspec", "exspec", "holes"])
@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_the_sliding_families_are_silent_past_the_window(family, strategy, mode):
    mon, res, ref = run(family, strategy, mode)
    assert mon.check() == [] and res.sequences == ref
    assert mon.group_runs["I4.window"] > 0


@pytest.mark.engine
@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_the_inverted_holes_flag_is_caught_by_the_monitor_alone(family):
    """Strict: at the first verify forward whose slot window drops a key; fast: nothing
    inside the engine, the same violation at ``check()``; the correct engine on the same
    workload is silent (above), so the rule bites where slots and positions part."""
    strict, _, _ = run(family, "holes", "strict", "holes_flag_inverted")
    fast, res, ref = run(family, "holes", "fast", "holes_flag_inverted")
    found = fast.check()
    assert strict.violations and found
    for v in (strict.violations[0], found[0]):
        assert (v.invariant, v.phase) == ("I4", "verify")
        assert any("sliding window" in r for r in v.trace["rules"])
    assert (found[0].step, found[0].rows) == (strict.violations[0].step, strict.violations[0].rows)
    print(strict.violations[0])


@pytest.mark.engine
def test_the_fault_touches_no_full_attention_model():
    mon, res, ref = run("llama", "holes", "strict", "holes_flag_inverted")
    assert mon.check() == [] and res.sequences == ref


@pytest.mark.engine
def test_fast_mode_checks_the_window_without_a_host_transfer():
    """The holes layout past the window (4-D position masks) under the transfer detector:
    fast mode nothing inside a hook, strict mode one read per step."""
    from invariants.testing import watch_hook

    fast, strict = watch_hook(invariants.Monitor("fast")), watch_hook(invariants.Monitor("strict"))
    mon, res, ref = run("mistral", "holes", "strict", hooks=[fast, strict])
    assert fast.hook.check() == [] and strict.hook.check() == [] and res.sequences == ref
    assert fast.total() == {"read": 0, "upload": 0, "dynamic_shape": 0}, fast.events()[:3]
    per_step = strict.per_step()
    assert all(c["read"] <= 1 and c["upload"] == 0 and c["dynamic_shape"] == 0
               for c in per_step.values())


@pytest.mark.engine
def test_the_inverted_holes_flag_is_found_and_shrunk_by_hypothesis():
    """Hypothesis searches holes-layout workloads on the sliding family for one where the
    Monitor alone (strict, recording) reports I4, and shrinks it; printed as a trace."""
    from harness import once_per_case, run_case
    from hyp_inputs import cases

    space = cases(families=("mistral",), max_rows=3, max_budget=8, context=64, ks=(1, 2, 4),
                  strategies=("holes",), shortest=20)
    calls = {"n": 0}

    def caught(case):
        calls["n"] += 1
        out = run_case(case, mutant="holes_flag_inverted")
        return any(v.invariant == "I4" for v in out.violations)

    case = find(space, once_per_case(caught), settings=settings(max_examples=40, derandomize=True, deadline=None,
                                                 database=None,
                                                 suppress_health_check=list(HealthCheck)))
    outcome = run_case(case, mutant="holes_flag_inverted")
    v = outcome.violations[0]
    print(f"\nholes_flag_inverted: {calls['n']} runs; shrunk to {case.rows} rows, "
          f"lengths={case.lengths} budget={case.budget} k={case.k} pattern={case.pattern}")
    print(v)
    assert v.invariant == "I4" and v.phase == "verify"
    assert case.rows == 1 and v.step <= 2
