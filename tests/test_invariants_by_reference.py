"""Fast mode keeps what a deferred check reads by reference (``rules.Refs``), as a
specification: an engine that never writes its views' tensors in place after the hook
is checked from the views themselves at the read (after a probation of copies), with
the reports of before; one that does is checked from copies when its writes show on
probation, and otherwise still reported (never checked silently from changed tensors),
and the monitor copies from then on."""

from __future__ import annotations

import dataclasses
import statistics

import pytest
import torch

from invariants import InvariantViolation, Monitor
from invariants import rules as R
from toy_engine import toy_views

torch.set_num_threads(1)

PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10, 11, 12], [9], [5, 6, 7, 8, 9]]
VIEWS = list(toy_views(PROMPTS, k=3, budget=8, seed=0))
REALIGNS = [i for i, (ph, _) in enumerate(VIEWS) if ph == "realign"]


def owned(view):
    """The view with its own copies of the tensors the realign fusion reads (so that
    writing them in place touches nothing else)."""
    return dataclasses.replace(view, tokens=view.tokens.clone(),
                               positions=view.positions.clone(), valid=view.valid.clone())


def shifted(view, slot=-2):
    p = view.positions.clone()
    p[0, slot] += 1
    return dataclasses.replace(view, positions=p)


def test_a_clean_run_copies_on_probation_then_waits_by_reference_and_finds_nothing():
    """The monitor's first ``PROBATION_STEPS`` steps copy what their checks read (and
    watch the versions of what they would have referenced); from then on, with no
    in-place write seen, every deferred check waits by reference."""
    from invariants.monitor import PROBATION_STEPS

    mon = Monitor("fast")
    for ph, v in VIEWS:
        mon(ph, v)
    waiting = [(entry.context["view"].step, e) for entry, *_, e in mon._deferred]
    early = [e for step, e in waiting if step < PROBATION_STEPS]
    late = [e for step, e in waiting if step >= PROBATION_STEPS]
    assert early and not any(isinstance(e, R.Refs) for e in early), "probation copies"
    assert late and all(isinstance(e, R.Refs) for e in late), "then waits by reference"
    assert mon.check() == [] and mon._by_reference and mon.unchecked == []


@pytest.mark.parametrize("at", [0, 1, -1])
def test_a_fault_seen_by_reference_is_reported_at_its_step_and_phase(at):
    bad = REALIGNS[at]
    mon = Monitor("fast")
    for i, (ph, v) in enumerate(VIEWS):
        mon(ph, shifted(v) if i == bad else v)
    with pytest.raises(InvariantViolation) as err:
        mon.check()
    v = err.value
    assert (v.invariant, v.phase, v.step, v.rows) == ("I3", "realign", VIEWS[bad][1].step, [0])
    strict = Monitor("strict", raise_on_violation=False)
    for i, (ph, view) in enumerate(VIEWS):
        strict(ph, shifted(view) if i == bad else view)
    assert strict.violations[0].trace == v.trace  # the trace strict mode gives


def test_a_view_written_in_place_after_its_hook_is_listed_unchecked_never_silently():
    """A hook after the monitor's corrects a wrong position in place: the references no
    longer show what the hook saw, so the view is not judged on them. It is listed in
    ``unchecked`` (its step, phase and groups) with a warning, and later hooks copy."""
    bad = REALIGNS[1]
    mon = Monitor("fast", raise_on_violation=False)
    for i, (ph, v) in enumerate(VIEWS):
        if i != bad:
            mon(ph, v)
            continue
        v = owned(shifted(v))
        mon(ph, v)
        v.positions.copy_(VIEWS[bad][1].positions)  # in place, after the hook
    assert not mon._by_reference  # seen at the next hook: copies from then on
    with pytest.warns(RuntimeWarning, match="written in place after its hook"):
        assert mon.check() == []
    [u] = mon.unchecked
    assert (u["step"], u["phase"]) == (VIEWS[bad][1].step, "realign")
    assert "I3.positions" in u["groups"]


def test_an_in_place_write_seen_on_probation_loses_nothing_and_the_monitor_keeps_copying():
    """An engine that writes a view's tensors in place after the hook within the first
    steps: that view was copied (probation), so its fault is still reported at its step
    and phase, nothing is listed unchecked, and every later view is copied too (a later
    fault is caught as well)."""
    first, later = REALIGNS[0], REALIGNS[-1]
    assert VIEWS[first][1].step < 2
    mon = Monitor("fast", raise_on_violation=False)
    for i, (ph, v) in enumerate(VIEWS):
        if i == first:
            v = owned(shifted(v))
            mon(ph, v)
            v.positions.copy_(VIEWS[first][1].positions)  # in place, after the hook
            continue
        mon(ph, shifted(v) if i == later else v)
    assert mon._by_reference is False
    assert not any(isinstance(e, R.Refs) for *_, e in mon._deferred)
    found = [(v.invariant, v.phase, v.step) for v in mon.check()]
    # (reported at its step and phase; the rule is named by re-running the view's groups
    # on its tensors as they are at the read, which the engine changed)
    assert found[0][1:] == ("realign", VIEWS[first][1].step)
    assert ("I3", "realign", VIEWS[later][1].step) in found
    assert mon.unchecked == []


def test_after_an_in_place_write_the_monitor_copies_and_still_catches_a_later_fault():
    """Past probation: a view written in place after its hook is listed unchecked (with
    a warning), and the monitor copies from then on, so a later fault is caught."""
    first, later = REALIGNS[2], REALIGNS[-1]
    mon = Monitor("fast")
    for i, (ph, v) in enumerate(VIEWS):
        if i == first:
            v = owned(v)
            mon(ph, v)
            v.tokens.add_(0)  # a write that changes nothing still bumps the version
            continue
        mon(ph, shifted(v) if i == later else v)
    assert mon._by_reference is False
    assert not any(isinstance(e, R.Refs) for *_, e in mon._deferred[-3:])
    with pytest.warns(RuntimeWarning), pytest.raises(InvariantViolation) as err:
        mon.check()
    v = err.value
    assert (v.invariant, v.phase, v.step) == ("I3", "realign", VIEWS[later][1].step)


class _Ops:
    """Counts the aten ops dispatched inside a block."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.n += 1
                return func(*args, **(kwargs or {}))

        self.n, self.mode = 0, Mode


@pytest.mark.engine
@pytest.mark.parametrize("strategy", ["eqspec", "holes"])
def test_a_fast_hook_dispatches_few_ops_and_no_transfer(strategy):
    """The cheap setting's engine (tiny Llama, batch 8, k = 4, n-gram drafter): past the
    prefill, a typical fast hook (the median of its phase) dispatches the verify's KV
    fingerprints and their copy (10 ops), the commit's snapshot (at most 9), nearly
    nothing at a realign or draft (a step whose batch lost rows looks its rows up
    again: some 16 ops at that realign); no hook reads the host, uploads or makes a
    data-dependent shape, and past probation the checks wait by reference. (A hook in
    which ``MAX_WAITING`` views waited checks them all, once per that many views.)"""
    import specdec
    from invariants.testing import watch_hook
    from specdec import drafters, models

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, models.TINY_VOCAB, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 31, (16,), generator=g)]
    from invariants.monitor import MAX_WAITING, PROBATION_STEPS

    mon = Monitor("fast")
    watched = watch_hook(mon)
    ops = _Ops()
    seen, waited = {}, []

    settled = []

    def hook(phase, view):
        ops.n = 0
        waiting = len(mon._deferred)
        with ops.mode():
            watched(phase, view)
        if len(mon._deferred) < waiting:  # MAX_WAITING views waited: checked in this hook
            settled.append(ops.n)
        elif phase != "prefill":
            seen.setdefault(phase, []).append(ops.n)
        if view.step >= PROBATION_STEPS:
            waited.extend(e for entry, *_, e in mon._deferred[-2:]
                          if entry.context["view"] is view)

    specdec.generate(models.tiny("llama"), prompts, drafter=drafters.NGramDrafter(), k=4,
                     batch_size=8, max_new_tokens=32, strategy=strategy, policy="fixed",
                     hooks=[hook])
    assert mon.check() == []
    assert watched.total() == {"read": 0, "upload": 0, "dynamic_shape": 0}
    median = {phase: statistics.median(n) for phase, n in seen.items()}
    assert median["verify"] <= 10 and median["commit"] <= 9 and median["realign"] <= 1 \
        and median["draft"] <= 1, median
    assert sum(map(sum, seen.values())) / sum(map(len, seen.values())) <= 8, median
    assert waited and all(isinstance(e, R.Refs) for e in waited)
    views = sum(map(len, seen.values())) + len(settled)
    assert len(settled) <= views // MAX_WAITING, settled  # (the views' batched check)


@pytest.mark.engine
@pytest.mark.parametrize("mutant", [None, "cache_gather_shifted"])
def test_a_static_shapes_run_is_checked_by_reference_as_strict_mode_checks_it(mutant):
    """With ``static_shapes=True`` the engine writes its forward input buffers in place
    every step, but the views record copies of them: nothing a view shows changes after
    its hook, so fast mode keeps waiting by reference, lists nothing unchecked, and
    reports what strict mode reports (clean, or a KV fault at the same step and phase)."""
    import contextlib

    import specdec
    from specdec import drafters, models, mutants

    target = models.tiny("llama")
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16], [3] * 9, [20, 21, 22]]
    found = {}
    for mode in ("strict", "fast"):
        mon = Monitor(mode, raise_on_violation=False)
        with mutants.apply(mutant) if mutant else contextlib.nullcontext():
            specdec.generate(target, prompts, drafter=drafters.NGramDrafter(), k=3,
                             batch_size=4, max_new_tokens=12, policy="fixed",
                             stop_token_ids=[], static_shapes=True, hooks=[mon])
        found[mode] = [(v.invariant, v.step, v.phase, v.rows) for v in mon.check()]
        if mode == "fast":
            assert mon._by_reference and mon.unchecked == []
    assert found["fast"] == found["strict"]
    assert bool(found["fast"]) == (mutant is not None)


@pytest.mark.parametrize("mode", ["strict", "fast"])
def test_a_trace_says_when_its_views_tensors_changed_before_the_read(mode):
    """A loop that rewrites a flagged view's tensors in place after the hook, before the
    read (a static buffer reused by the next phase): the violation keeps the step and
    phase the check saw, and its trace says that the rules, slots and grid it shows are
    read from the tensors as they are now; read at every phase, strict names them as the
    hook saw them, with no such note. (Fast mode: a write seen on probation, so that the
    view was checked from copies; past probation it is listed unchecked instead.)"""
    from invariants.monitor import IN_PLACE_NOTE

    bad = REALIGNS[0] if mode == "fast" else REALIGNS[1]

    def run(monitor):
        for i, (ph, v) in enumerate(VIEWS):
            if i != bad:
                monitor(ph, v)
                continue
            v = owned(shifted(v, slot=-2))
            monitor(ph, v)
            v.positions.copy_(shifted(VIEWS[bad][1], slot=-3).positions)  # another slot
        return monitor.check()

    [v, *_] = run(Monitor(mode, raise_on_violation=False))
    assert (v.invariant, v.phase, v.step) == ("I3", "realign", VIEWS[bad][1].step)
    assert v.trace["rules"][-1] == IN_PLACE_NOTE
    [exact, *_] = run(Monitor("strict", raise_on_violation=False, read="phase"))
    assert (exact.invariant, exact.phase, exact.step) == ("I3", "realign", VIEWS[bad][1].step)
    assert IN_PLACE_NOTE not in exact.trace["rules"]
    assert exact.trace["slots"] != v.trace["slots"]  # what the hook saw: slot -2, not -3



def test_the_read_calls_each_waiting_kind_once_per_shared_row_count_and_once_for_the_rest():
    """Views that waited by reference are checked in few calls: a row count shared by
    ``SIDE_BY_SIDE`` views or more is laid side by side in one call; the views of rarer
    row counts (a batch losing rows as they finish) share one more call; a row-wise check
    (``Fusion.rowwise``) takes them all in one. Every view is in exactly one call."""
    from types import SimpleNamespace

    from invariants.monitor import SIDE_BY_SIDE, _by_row_count

    sizes = [8] * SIDE_BY_SIDE + [7, 7] + [8] + [3] + [5] * SIDE_BY_SIDE
    members = [(f"entry {i}", 0, SimpleNamespace(size=n)) for i, n in enumerate(sizes)]
    calls = _by_row_count(members, rowwise=False)
    assert sorted(m[0] for call in calls for m in call) == sorted(m[0] for m in members)
    assert sorted(sorted({m[2].size for m in call}) for call in calls) == [[3, 7], [5], [8]]
    assert sorted(m[2].size for m in calls[-1]) == [3, 7, 7]  # (the rare ones, stacked)
    assert _by_row_count(members, rowwise=True) == [members]
    same = members[:SIDE_BY_SIDE - 1]  # one row count, however few: side by side
    assert _by_row_count(same, rowwise=False) == [same]
