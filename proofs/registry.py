"""Which modules hold obligations, in report order.

One module per realignment strategy (``STRATEGIES``), then the strategy-independent ones. A
module only has to expose ``obligations(**options) -> list[proofs.core.Obligation]``
(options it does not take are not passed) and, for replayable counterexamples, put
``"strategy"``, ``"k"``, ``"old_width"`` and per-row ``"n"``/``"m"`` in its witnesses.
"""

from __future__ import annotations

import importlib
import inspect

STRATEGIES = {
    "eqspec": "proofs.eqspec",
    "holes": "proofs.holes",
    "exspec": "proofs.exspec",
}

OTHERS = {
    "acceptance": "proofs.acceptance",
    "pool": "proofs.pool",
}


def modules() -> dict:
    return {**STRATEGIES, **OTHERS}


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
