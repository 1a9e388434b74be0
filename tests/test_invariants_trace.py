"""Counterexample traces: fields, JSON round trip, a rendering that fits in a CI log."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from invariants import InvariantViolation, Monitor
from invariants.trace import MAX_GRID_ROWS, TRACE_VERSION, render
from toy_engine import toy_views

torch.set_num_threads(1)


def violation(prompts=((3, 4, 5), (6, 7, 8, 9, 10, 11, 12), (9,)), every_row=False, run=None):
    """The first violation of a toy run whose first realign has positions counting padding."""
    views = list(toy_views([list(p) for p in prompts], k=3, budget=8, seed=0))
    mon = Monitor("strict", raise_on_violation=False, run=run)
    for ph, v in views:
        if ph == "realign":
            p = v.positions.clone()
            if every_row:
                p = p + 1
            else:
                p[0, -1] += 1
            v = dataclasses.replace(v, positions=p)
        mon(ph, v)
    return mon.violations[0]


def test_a_violation_is_an_exception_with_its_coordinates():
    v = violation()
    assert isinstance(v, Exception)
    assert (v.invariant, v.phase) == ("I3", "realign")
    assert isinstance(v.step, int) and v.rows == [0] and v.row_ids == [0]
    assert v.slots == [[v.trace["width"] - 1]]


def test_the_trace_is_json_with_a_version():
    trace = violation().trace
    assert trace["version"] == TRACE_VERSION
    assert json.loads(json.dumps(trace)) == trace
    for key in ("invariant", "step", "phase", "rows", "slots", "rules", "grid",
                "accepted_history", "run", "info", "state"):
        assert key in trace


def test_to_json_and_from_json_round_trip():
    v = violation(run={"seed": 0, "prompts": [[3, 4, 5]]})
    back = InvariantViolation.from_json(v.to_json())
    assert back.trace == v.trace
    assert str(back) == str(v)
    assert (back.invariant, back.step, back.phase, back.rows, back.slots) == \
        (v.invariant, v.step, v.phase, v.rows, v.slots)


def test_save_and_load_a_trace_file(tmp_path):
    v = violation()
    path = tmp_path / "trace.json"
    v.save(path)
    assert InvariantViolation.load(path).trace == v.trace
    assert path.read_text().lstrip().startswith("{")  # JSON text, never pickle


def test_an_unknown_trace_version_is_refused():
    trace = violation().trace
    trace["version"] = TRACE_VERSION + 1
    with pytest.raises(ValueError, match="version"):
        InvariantViolation.from_json(json.dumps(trace))


def test_str_shows_the_rendered_trace():
    v = violation()
    text = str(v)
    assert text == render(v.trace)
    assert text.splitlines()[0].startswith("I3 position-id contiguity violated at step")
    assert "failed: at every valid slot j" in text
    assert "[" in text  # the offending cell is bracketed in the grid
    assert "accepted per step" in text


def test_the_grid_stays_small_for_many_rows_and_wide_batches():
    long = [list(range(3, 3 + n)) for n in (70, 40, 65, 5, 33)]
    v = violation(prompts=long, every_row=True)
    assert len(v.rows) == 5
    assert len(v.trace["grid"]) == MAX_GRID_ROWS
    grid_lines = [ln for ln in str(v).splitlines() if ln.startswith(("slot", "row ", " "))
                  and "failed" not in ln]
    assert len(grid_lines) <= 12
    assert max(len(ln) for ln in str(v).splitlines()) <= 160
