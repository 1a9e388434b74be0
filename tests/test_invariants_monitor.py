"""The Monitor's modes and bookkeeping, as a specification (toy-engine views, no specdec)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from invariants import InvariantViolation, Monitor
from invariants.testing import no_host_transfers
from toy_engine import toy_views

torch.set_num_threads(1)

PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10, 11, 12], [9], [5, 6, 7, 8, 9]]
VIEWS = list(toy_views(PROMPTS, k=3, budget=8, seed=0))


def shifted(view, slot=-2):
    """The view with one position off by one in row 0 (an I3 mistake)."""
    p = view.positions.clone()
    p[0, slot] += 1
    return dataclasses.replace(view, positions=p)


def feed(monitor, views, bad=()):
    """Call the monitor on every view, breaking I3 at the indices in ``bad``."""
    for i, (ph, v) in enumerate(views):
        monitor(ph, shifted(v) if i in bad else v)


BAD = next(i for i, (ph, v) in enumerate(VIEWS) if ph == "realign")
LATER = next(i for i, (ph, v) in enumerate(VIEWS) if ph == "realign" and i > BAD)


def test_off_mode_checks_nothing():
    mon = Monitor("off")
    feed(mon, VIEWS, bad={BAD})
    assert mon.check() == [] and mon.calls == 0


def test_strict_raises_at_the_end_of_the_step_naming_the_failing_phase():
    mon = Monitor("strict")
    with pytest.raises(InvariantViolation) as err:
        feed(mon, VIEWS, bad={BAD})
    v = err.value
    assert (v.invariant, v.phase, v.step) == ("I3", "realign", VIEWS[BAD][1].step)
    assert v.rows == [0] and v.row_ids == [0]
    # the realign opens step s; the step's commit view ends it: the one read is there
    end = next(i for i, (ph, view) in enumerate(VIEWS)
               if ph == "commit" and view.step == VIEWS[BAD][1].step)
    assert mon.calls == end + 1


def test_strict_with_per_phase_reads_raises_at_the_failing_phase():
    mon = Monitor("strict", read="phase")
    with pytest.raises(InvariantViolation) as err:
        feed(mon, VIEWS, bad={BAD})
    assert (err.value.invariant, err.value.phase) == ("I3", "realign")
    assert mon.calls == BAD + 1  # nothing after the failing phase ran


def test_per_step_and_per_phase_reads_give_the_same_trace():
    traces = []
    for read in ("step", "phase"):
        mon = Monitor("strict", read=read)
        with pytest.raises(InvariantViolation) as err:
            feed(mon, VIEWS, bad={BAD, LATER})
        traces.append(err.value.trace)
    assert traces[0] == traces[1]


def test_a_step_without_a_commit_view_is_read_when_the_next_step_begins():
    mon = Monitor("strict")
    views = [(ph, v) for ph, v in VIEWS if ph != "commit"]
    bad = next(i for i, (ph, v) in enumerate(views) if ph == "realign")
    with pytest.raises(InvariantViolation) as err:
        feed(mon, views, bad={bad})
    assert err.value.phase == "realign"
    # raised while the first view of the next step came in, before it was checked
    assert views[mon.calls][1].step == views[bad][1].step + 1


def test_fast_never_raises_inside_the_hook():
    mon = Monitor("fast")
    feed(mon, VIEWS, bad={BAD})  # no exception here
    with pytest.raises(InvariantViolation) as err:
        mon.check()
    assert (err.value.invariant, err.value.phase) == ("I3", "realign")


def test_fast_reports_the_first_violation_of_the_run():
    mon = Monitor("fast")
    feed(mon, VIEWS, bad={BAD, LATER})
    with pytest.raises(InvariantViolation) as err:
        mon.finish()
    assert err.value.step == VIEWS[BAD][1].step


def test_fast_context_manager_raises_when_the_block_ends():
    with pytest.raises(InvariantViolation):
        with Monitor("fast") as mon:
            feed(mon, VIEWS, bad={BAD})


def test_context_manager_does_not_mask_the_block_s_own_exception():
    with pytest.raises(KeyError):
        with Monitor("fast") as mon:
            feed(mon, VIEWS, bad={BAD})
            raise KeyError("engine failure")


def test_fast_hook_reads_no_tensor_value_on_the_host():
    mon = Monitor("fast")
    with no_host_transfers():
        feed(mon, VIEWS, bad={BAD})
    with pytest.raises(InvariantViolation):
        mon.check()


def test_fast_check_reads_the_flags_of_a_whole_run_in_one_transfer(monkeypatch):
    mon = Monitor("fast")
    feed(mon, VIEWS)
    reads = []
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or original(t))
    assert mon.check() == []
    assert len(reads) == 1


def test_recording_mode_collects_violations_without_raising():
    mon = Monitor("strict", raise_on_violation=False)
    feed(mon, VIEWS, bad={BAD, LATER})
    found = mon.check()
    assert [v.step for v in found] == [VIEWS[BAD][1].step, VIEWS[LATER][1].step]
    assert mon.violations == found


def test_recording_fast_mode_collects_every_failing_phase():
    mon = Monitor("fast", raise_on_violation=False)
    feed(mon, VIEWS, bad={BAD, LATER})
    assert len(mon.check()) == 2


def test_recording_is_capped():
    mon = Monitor("strict", raise_on_violation=False, max_violations=1)
    feed(mon, VIEWS, bad={BAD, LATER})
    assert len(mon.violations) == 1


def test_accepted_counts_are_kept_per_step():
    mon = Monitor("strict")
    feed(mon, VIEWS)
    commits = [v for ph, v in VIEWS if ph == "commit"]
    assert mon.accepted_history == [
        {"step": v.step, "row_ids": v.row_ids.tolist(), "accepted": v.accepted.tolist()}
        for v in commits]


def test_trace_carries_the_history_that_led_to_the_violation():
    mon = Monitor("strict", raise_on_violation=False)
    feed(mon, VIEWS, bad={LATER})
    hist = mon.violations[0].trace["accepted_history"]
    assert [h["step"] for h in hist] == [v.step for i, (ph, v) in enumerate(VIEWS)
                                         if ph == "commit" and i < LATER]


def test_the_run_dict_goes_into_every_trace():
    run = {"engine": "toy", "prompts": PROMPTS, "k": 3}
    mon = Monitor("strict", raise_on_violation=False, run=run)
    feed(mon, VIEWS, bad={BAD})
    assert mon.violations[0].trace["run"] == run
    assert json.loads(mon.violations[0].to_json())["run"] == run


def test_the_run_dict_must_be_json():
    with pytest.raises(TypeError, match="JSON"):
        Monitor(run={"model": object()})


def test_a_new_run_starts_fresh():
    mon = Monitor("strict")
    feed(mon, VIEWS)
    feed(mon, list(toy_views([[7, 7], [4]], k=2, budget=5, seed=3)))
    assert mon.runs == 1 and mon.check() == []


def test_fast_mode_reports_a_finished_run_at_the_next_run_s_start():
    mon = Monitor("fast")
    feed(mon, VIEWS, bad={BAD})
    with pytest.raises(InvariantViolation):
        mon(*VIEWS[0])  # the next run's prefill


def test_invariants_can_be_chosen():
    mon = Monitor("strict", invariants=("I1", "I2"))
    feed(mon, VIEWS, bad={BAD})  # an I3 mistake goes unseen
    assert mon.check() == []


@pytest.mark.parametrize("kwargs, message", [
    (dict(mode="loud"), "mode must be one of"),
    (dict(invariants=("I9",)), "unknown invariants"),
])
def test_bad_configuration_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Monitor(**kwargs)


def test_an_unknown_phase_is_refused():
    with pytest.raises(ValueError, match="unknown phase"):
        Monitor("strict")("sample", VIEWS[0][1])


def test_reset_forgets_violations():
    mon = Monitor("strict", raise_on_violation=False)
    feed(mon, VIEWS, bad={BAD})
    mon.reset()
    assert mon.violations == [] and mon.calls == 0


def test_inputs_already_checked_are_not_checked_again_unless_modified():
    (_, prefill), (_, draft), (_, verify) = VIEWS[:3]
    same = {n: getattr(prefill, n).clone() for n in ("tokens", "valid", "positions")}
    prefill = dataclasses.replace(prefill, **same)  # private copies: VIEWS stays intact
    mon = Monitor("strict", raise_on_violation=False, read="phase")
    mon("prefill", prefill)
    mon("draft", dataclasses.replace(draft, **same))  # the very tensors checked at prefill
    assert mon.group_runs["I3.positions"] == 1
    prefill.positions[0, -1] += 1  # modified in place: its version changes
    mon("verify", dataclasses.replace(verify, **same))
    assert mon.group_runs["I3.positions"] == 2
    assert [(v.invariant, v.phase) for v in mon.violations] == [("I3", "verify")]


def test_a_malformed_view_is_reported_not_crashed_on():
    i = next(i for i, (ph, v) in enumerate(VIEWS) if ph == "commit")
    mon = Monitor("strict", raise_on_violation=False)
    for j, (ph, v) in enumerate(VIEWS[: i + 1]):
        if j == i:  # predictions one column short: I1, and I6 cannot even compare them
            v = dataclasses.replace(v, predictions=v.predictions[:, :-1])
        mon(ph, v)
    v = mon.violations[0]
    assert v.invariant == "I1" and any("predictions are [B, k+1]" in r for r in v.rules)
    assert "I6" in v.trace["also"]


def rows_of(view, rows):
    """The view restricted to batch rows ``rows`` (a scheduler serving one group of a pool)."""
    idx = torch.tensor(rows)
    b = view.batch_size
    pick = lambda x: x.index_select(0, idx) if torch.is_tensor(x) and x.dim() and x.shape[0] == b else x  # noqa: E731
    fields = {f.name: pick(getattr(view, f.name)) for f in dataclasses.fields(view)}
    if view.forward is not None:
        fields["forward"] = dataclasses.replace(
            view.forward, **{f.name: pick(getattr(view.forward, f.name))
                             for f in dataclasses.fields(view.forward)})
    return dataclasses.replace(view, **fields)


@pytest.mark.parametrize("remember_rows, caught", [(256, True), (0, False)])
def test_rows_absent_from_the_last_view_are_still_checked_for_retroactive_change(remember_rows, caught):
    # a pool scheduler commits a group without row 0; when row 0 is served again its
    # earlier output must still be what it was (remember_rows=0 keeps only the last view)
    commits = [i for i, (ph, _) in enumerate(VIEWS) if ph == "commit"]
    first, second = commits[0], commits[1]
    later = next(i for i, (ph, v) in enumerate(VIEWS) if i > second and ph == "realign")
    assert int(VIEWS[first][1].generated[0]) > 0 and not bool(VIEWS[second][1].finished[0])
    m = Monitor("strict", raise_on_violation=False, invariants=("I6",), remember_rows=remember_rows)
    for ph, v in VIEWS[: first + 1]:
        m(ph, v)
    m("commit", rows_of(VIEWS[second][1], [1, 2, 3]))  # row 0 not in this group
    ph, v = VIEWS[later]
    out = v.output.clone()
    out[0, 0] += 1
    m(ph, dataclasses.replace(v, output=out))
    rules = {r for viol in m.check() for r in viol.rules}
    assert ("output never changes retroactively" in rules) == caught
    assert all(viol.rows == [0] for viol in m.violations)


def test_remember_rows_is_validated():
    with pytest.raises(ValueError, match="remember_rows must be an integer >= 0"):
        Monitor(remember_rows=-1)
