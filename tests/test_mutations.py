"""Mutation check: hypothesis must find, and shrink, a failure for every known bug.

Each single-point mutation of the realignment index math (specdec/mutants.py) and each
known-bad engine (specdec/forensics/known_bad.py) runs over ``cases()``; ``hypothesis.find``
searches for a case where some property breaks and shrinks it. The shrunk case must be
small (at most 2 rows and 2 steps where the bug allows) and prints as a trace.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, find, settings
from hypothesis.errors import NoSuchExample

from specdec import mutants
from specdec.forensics.known_bad import KNOWN_BAD
from harness import once_per_case, outcome_failures, run_case
from hyp_inputs import cases

SEARCH = settings(max_examples=60, derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
SMALL = cases(families=("llama",), max_rows=4, max_budget=6, context=64, ks=(1, 2, 4),
              strategies=("eqspec",))
#: the sliding-window family, holes included (rows past its 24-position window: I4.window)
SLIDING = cases(families=("mistral",), max_rows=4, max_budget=6, context=64, ks=(1, 2, 4),
                strategies=("eqspec", "holes"))
#: bugs that need more than 2 steps or rows to show
LARGER = {
    # HOLES compacts only once the slack passes the threshold (0.5 by default): with the
    # smallest k that takes two steps, so the corrupted compaction shows in the third
    "compact_dest_off_by_one": (2, 3),
}


def shrink(run):
    """``find``'s shrunk failing case, and after how many examples the first failure came
    (each distinct case runs once: ``harness.once_per_case``)."""
    calls = {"n": 0, "first": None}
    verdict = once_per_case(lambda case: bool(outcome_failures(run(case))))

    def fails(case):
        calls["n"] += 1
        bad = verdict(case)
        if bad and calls["first"] is None:
            calls["first"] = calls["n"]
        return bad

    case = find(SMALL, fails, settings=SEARCH)
    return case, calls["first"]


def report(name, case, first, outcome):
    print(f"\n{name}: first failure after {first} examples; shrunk to {case.rows} rows, "
          f"{outcome.steps_to_failure()} steps: lengths={case.lengths} budget={case.budget} k={case.k} "
          f"batch_size={case.batch_size} pattern={case.pattern} stop={case.stop}")
    print("  broken:", "; ".join(sorted(set(outcome_failures(outcome)))[:4]))
    if outcome.violations:
        print(str(outcome.violations[0]))


@pytest.mark.parametrize("name", mutants.NAMES)
def test_every_index_math_mutant_is_found_and_shrunk(name):
    def run(case):  # the engine of the strategy whose index math the mutant breaks
        return run_case(case, mutant=name, strategy=mutants.CATALOGUE[name].strategy)

    case, first = shrink(run)
    outcome = run(case)
    report(name, case, first, outcome)
    rows, steps = LARGER.get(name, (2, 2))
    assert case.rows <= rows and outcome.steps_to_failure() <= steps


@pytest.mark.parametrize("fault", list(KNOWN_BAD))
def test_every_known_bad_engine_is_found_and_shrunk(fault):
    def run(case):
        return run_case(case, known_bad=fault)

    case, first = shrink(run)
    outcome = run(case)
    report(fault, case, first, outcome)
    rows, steps = LARGER.get(fault, (2, 2))
    assert case.rows <= rows and outcome.steps_to_failure() <= steps


@pytest.mark.parametrize("space", [SMALL, SLIDING], ids=["llama", "mistral"])
def test_the_correct_engine_survives_the_same_search(space):
    with pytest.raises(NoSuchExample):
        find(space, lambda c: bool(outcome_failures(run_case(c))),
             settings=settings(SEARCH, max_examples=40))
