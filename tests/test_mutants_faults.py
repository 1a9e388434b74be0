"""``specdec.mutants.FAULTS``: single-point faults outside the index math, applied like
the catalogue's mutants. Each patches one function of its module, and every ``specdec``
module that imported it by name, only inside the ``with`` block; each names what
catches it. The tests that catch them: tests/test_ngram_contract.py (the n-gram drafter),
tests/test_invariants_stats.py and tests/test_benchmarks.py (the stats), and
tests/test_self_draft.py (EXSPEC's draft pool)."""

from __future__ import annotations

import importlib

import pytest

from specdec import mutants, phases
from specdec.strategies import exspec


@pytest.mark.parametrize("name", list(mutants.FAULTS))
def test_a_fault_patches_its_function_and_restores_it(name):
    fault = mutants.FAULTS[name]
    home = importlib.import_module(f"specdec.{fault.module}")
    orig = getattr(home, fault.target)
    with pytest.raises(RuntimeError, match="boom"):
        with mutants.apply(name) as m:
            assert m is fault and getattr(home, fault.target) is not orig
            raise RuntimeError("boom")
    assert getattr(home, fault.target) is orig
    assert fault.caught_by and fault.description


def test_a_module_that_imported_the_function_by_name_is_patched_too():
    with mutants.apply("stats_accepted_from_committed"):
        assert exspec.sync is phases.sync  # EXSPEC's own binding runs the fault too
        assert phases.sync.__qualname__.startswith("_accepted_from_committed")
    assert exspec.sync is phases.sync and phases.sync.__qualname__ == "sync"


def test_faults_are_not_index_math_mutants():
    assert not set(mutants.FAULTS) & set(mutants.NAMES)  # no proof obligation covers them
    assert set(mutants.ALL) == set(mutants.NAMES) | set(mutants.FAULTS)
    with pytest.raises(ValueError, match="unknown mutant"):
        with mutants.apply("no_such_fault"):
            pass
