"""invariants: checks that a batched (speculative) decoding loop keeps its tensors aligned.

This package never imports ``specdec``: any engine builds a ``StepView`` and calls hooks.

Public names: ``Monitor`` (a step hook checking I1-I7), ``guard_model`` (checks every
forward of a Hugging Face causal LM), ``InvariantViolation`` (the counterexample trace),
``compare_outputs`` (the output-equivalence oracle), ``StepView``/``ForwardRecord`` (what
an engine hands over), ``MODES``, ``Coverage``/``TRIGGERS`` (which triggers a run
exercised). Submodules: ``rules`` (the rules as records),
``testing`` (``no_host_transfers``: a CPU detector of host reads, uploads and
data-dependent shapes, for proving a step hook GPU-safe).

Names are resolved lazily (PEP 562): ``import invariants`` stays cheap (no torch import),
which the pytest plugin relies on, since pytest loads it for every session.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "StepView": "view", "ForwardRecord": "view", "PHASES": "view", "PROFILES": "view",
    "Monitor": "monitor", "MODES": "modes", "READS": "modes",
    "guard_model": "guard", "Guard": "guard",
    "InvariantViolation": "trace", "TRACE_VERSION": "trace",
    "compare_outputs": "equivalence", "Comparison": "equivalence",
    "RowComparison": "equivalence", "DEFAULT_TOLERANCE": "equivalence",
    "Coverage": "coverage", "TRIGGERS": "coverage",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'invariants' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
