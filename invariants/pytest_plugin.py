"""pytest plugin of the invariant checker (registered as the ``pytest11`` entry point
``invariants``, so every pytest session of this project loads it).

- ``--invariants=off|fast|strict|deep`` (default ``strict``; the environment variable
  ``INVARIANTS_MODE`` sets the default too) chooses the mode of the fixtures below;
  ``--invariants-trace-dir=DIR`` also writes the JSON trace of every failing test there
  (``specdec replay DIR/<test>.json`` re-runs it).
- fixture ``invariants_mode``: the chosen mode (a string).
- fixture ``invariants_monitor``: a fresh ``Monitor`` in that mode, for ``hooks=[...]``;
  after the test body returns its pending checks run (fast mode's one host sync), so a
  violation fails the test itself.
- fixture ``guarded``: a function ``guarded(model) -> model`` that guards ``model`` with
  ``guard_model`` in that mode until the test ends (fast mode: checked after the body).
- when a test fails with an ``InvariantViolation`` (raised, chained, or recorded by the
  fixtures' objects), the report gets an "invariants trace" section with the rendered trace.

This module imports nothing heavy at import time: pytest loads it for every session.
"""

from __future__ import annotations

import os
import re

import pytest

from .modes import MODES
_KEY = "_invariants_objects"


def pytest_addoption(parser):
    group = parser.getgroup("invariants", "batched-decoding invariant checks")
    group.addoption("--invariants", action="store", default=None, choices=MODES,
                    help="mode of the invariants_monitor / guarded fixtures: off, fast, "
                         "strict (default, or $INVARIANTS_MODE) or deep")
    group.addoption("--invariants-trace-dir", action="store", default=None,
                    help="write the JSON trace of every invariant failure to this directory")


def _mode(config) -> str:
    mode = config.getoption("--invariants", default=None) or os.environ.get("INVARIANTS_MODE")
    mode = mode or "strict"
    if mode not in MODES:
        raise pytest.UsageError(f"INVARIANTS_MODE must be one of {MODES}, got {mode!r}")
    return mode


def _remember(node, obj) -> None:
    """Keep the test's monitors and guards on its node (checked after the body)."""
    if not hasattr(node, _KEY):
        setattr(node, _KEY, [])
    getattr(node, _KEY).append(obj)


@pytest.fixture
def invariants_mode(request) -> str:
    return _mode(request.config)


@pytest.fixture
def invariants_monitor(request, invariants_mode):
    from invariants.monitor import Monitor

    monitor = Monitor(invariants_mode, run={"test": request.node.nodeid})
    _remember(request.node, monitor)
    yield monitor


@pytest.fixture
def guarded(request, invariants_mode):
    from invariants.guard import Guard

    guards = []

    def guard(model):
        g = Guard(model, invariants_mode, run={"test": request.node.nodeid}).install()
        guards.append(g)
        _remember(request.node, g)
        return model

    yield guard
    for g in guards:
        g.remove()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield  # raises when the test body failed: then nothing more to check
    for obj in getattr(item, _KEY, []):
        obj.check()  # fast mode: the run's one host sync; raises the first violation
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.excinfo is None or report.passed:
        return report
    violation = _find_violation(call.excinfo.value)
    if violation is None:
        for obj in getattr(item, _KEY, []):
            if getattr(obj, "violations", None):
                violation = obj.violations[0]
                break
    if violation is not None:
        report.sections.append(("invariants trace", str(violation)))
        out = item.config.getoption("--invariants-trace-dir", default=None)
        if out:
            os.makedirs(out, exist_ok=True)
            name = re.sub(r"[^A-Za-z0-9_.-]+", "_", item.nodeid)[:150] + ".json"
            path = os.path.join(out, name)
            violation.save(path)
            report.sections.append(("invariants trace file", path))
    return report


def _find_violation(exc):
    """The InvariantViolation raised, or one in the exception's cause/context chain."""
    from invariants.trace import InvariantViolation

    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, InvariantViolation):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None
