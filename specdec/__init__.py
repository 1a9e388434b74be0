"""specdec: batched speculative decoding that stays exactly equal to greedy decoding (and
to plain sampling, token for token, in coupled sampling mode).

Public names: ``generate``, ``reference_generate``, ``Sampling``, ``models``, ``drafters``.

Names are resolved lazily (PEP 562): ``import specdec.layout`` (the index math, which
``proofs/`` evaluates on z3 terms) does not import torch, transformers or the engine.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "generate": "engine", "Result": "engine", "Stats": "phases",
    "reference_generate": "reference", "Sampling": "sampling",
}
_SUBMODULES = ("drafters", "models")

__all__ = ["generate", "reference_generate", "Sampling", "models", "drafters", "Result", "Stats"]


def __getattr__(name: str):
    if name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    else:
        raise AttributeError(f"module 'specdec' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
