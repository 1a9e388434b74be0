"""z3 proofs of the realignment index math, run on the very functions the engine executes.

``specdec.layout`` writes every index formula once over an ops interface; ``proofs.ops``
evaluates those functions on z3 integer terms, and the obligation modules (one per
strategy, plus ``acceptance`` and ``pool``; see ``proofs.registry``) state DESIGN.md's
invariants over them for every length and every batch size up to a bound.

    python -m proofs                      # every obligation, B <= 16
    python -m proofs --mutant positions_from_slot --save-trace cex.json
    specdec replay cex.json               # replays it on the engine (specdec.forensics)

``run`` is the programmatic entry point. From the engine package this package imports
``specdec.layout`` (the index math), ``specdec.mutants`` (the mutant catalogue) and the
strategy registry ``specdec.strategies`` (names and proof modules; it loads no strategy);
never the engine: replaying a counterexample on the engine is forensics
(``specdec.forensics.counterexample``).
"""

from __future__ import annotations

import contextlib

from .core import Obligation, Query, Result, check

__all__ = ["run", "clear_caches", "Obligation", "Query", "Result", "check", "DEFAULT_MAX_BATCH"]

DEFAULT_MAX_BATCH = 16


def clear_caches() -> None:
    """Forget the symbolic batches built so far (each module memoises its encodings per
    size and layout; a fresh run then pays for building them again, as a new process does)."""
    from .core import clear_symbolic

    clear_symbolic()


def run(max_batch: int = DEFAULT_MAX_BATCH, *, mutant: str | None = None, groups=None,
        only: str | None = None, max_requests: int | None = None, k_max: int | None = None,
        timeout_ms: int = 60_000, on_result=None) -> list[Result]:
    """Check every obligation (``only``: those whose name contains the string) for batch
    sizes ``1 .. max_batch`` (pool: ``1 .. max_requests``, default ``max_batch``), with the
    layout mutated by ``mutant`` (a name of ``specdec.mutants.CATALOGUE``) if given.

    ``on_result(result)`` is called after each obligation (for streaming output).
    """
    from specdec import mutants

    from . import registry

    options = {} if k_max is None else {"k_max": k_max}
    ctx = mutants.apply(mutant) if mutant else contextlib.nullcontext()
    results = []
    with ctx:
        for ob in registry.obligations(groups, **options):
            if only and only not in ob.name:
                continue
            bound = max_batch if ob.size_name == "B" else (max_requests or max_batch)
            r = check(ob, bound, timeout_ms)
            results.append(r)
            if on_result is not None:
                on_result(r)
    return results
