"""Which modules hold obligations, in report order.

One module per realignment strategy, named by the strategy registry
(``specdec.strategies.proof_modules()``: the one place strategy names come from), then the
strategy-independent ones (``OTHERS``). A module only has to expose
``obligations(**options) -> list[proofs.core.Obligation]`` (options it does not take are
not passed) and, for replayable counterexamples, put ``"strategy"``, ``"k"``,
``"old_width"`` and per-row ``"n"``/``"m"`` in its witnesses.
"""

from __future__ import annotations

import importlib
import inspect

from specdec import strategies

OTHERS = {
    "acceptance": "proofs.acceptance",
    "sizing": "proofs.sizing",
    "pool": "proofs.pool",
}


def modules() -> dict:
    return {**strategies.proof_modules(), **OTHERS}


def obligations(groups=None, **options) -> list:
    """All obligations of ``groups`` (default: every module), in report order."""
    out = []
    for group, modname in modules().items():
        if groups and group not in groups:
            continue
        fn = importlib.import_module(modname).obligations
        accepted = inspect.signature(fn).parameters
        out += fn(**{k: v for k, v in options.items() if k in accepted})
    return out
