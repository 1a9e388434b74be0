"""pytest plugin of the invariant checker (registered as the ``pytest11`` entry point).

Imports nothing heavy at module level: pytest loads it for every test session.
"""

from __future__ import annotations

MODES = ("off", "fast", "strict", "deep")


def pytest_addoption(parser):
    group = parser.getgroup("invariants", "batched-decoding invariant checks")
    group.addoption("--invariants", action="store", default="strict", choices=MODES,
                    help="mode of the invariants_monitor / guarded fixtures (default strict)")
