"""Proof obligations of the sizing formulas: every write of a step lands inside its buffer.

The engine sizes its buffers once per batch (or per pool) with ``specdec.layout``'s
sizing functions; a buffer too small would raise ("cache capacity exceeded") or, for an
index that is clamped or scattered, corrupt a neighbouring slot. These obligations
evaluate the same functions on z3 integers.

The situation (``Sizing``), every quantity unbounded: a batch whose prompts have width
``W0 >= 1`` and budgets ``<= max_budget`` (``>= 1``), sized for ``k >= 0`` drafts, stepping
with ``0 <= ks <= k`` drafts (a step's verify covers ``max k_b + 1 <= k + 1`` tokens per
row; ``ks`` may differ from step to step). A row that takes
part in a step has a prompt of ``plen`` tokens (``1 <= plen <= W0``), a budget
``1 <= budget <= max_budget`` and ``generated < budget`` tokens so far (rows at their budget
have left: ``layout.row_finished``), so ``n = plen + generated`` real tokens. Each
obligation names the widest batch its strategy can step from; the row above is the one
that makes it that wide (a width is the longest row's length, or for HOLES without
compaction the prompt width plus ``k + 1`` per step run).

HOLES also keeps a runtime guard: before a step that would not fit it compacts. The
obligations prove that the compacted batch always fits, and that below the widest batch
the threshold lets through (``layout.widest_before_compaction``, any value here) the
threshold, not the capacity, is what triggers compaction.
"""

from __future__ import annotations

import z3

from specdec import layout

from .core import Obligation, Query, val
from .ops import Z3, term

SCOPE = "W0,budget,k,n unbounded"


class Sizing:
    """One stepping row of a batch (see the module docstring); ``i`` is a verify input."""

    def __init__(self):
        self.W0, self.max_budget, self.k = z3.Ints("W0 max_budget k")
        self.plen, self.budget, self.generated = z3.Ints("plen budget generated")
        self.i, self.steps, self.widest = z3.Ints("i steps widest")
        self.ks, self.grown = z3.Ints("ks grown")  # this step's drafts; growth so far
        self.n = self.plen + self.generated
        self.assumptions = [self.W0 >= 1, self.max_budget >= 1, self.k >= 0,
                            self.ks >= 0, self.ks <= self.k,
                            self.plen >= 1, self.plen <= self.W0,
                            self.budget >= 1, self.budget <= self.max_budget,
                            self.generated >= 0, self.generated < self.budget,
                            self.i >= 0, self.i <= self.ks]
        self.sizes = [self.W0, self.max_budget, self.k, self.ks, self.plen, self.budget,
                      self.generated]

    def witness(self, model) -> dict:
        names = ("W0", "max_budget", "k", "ks", "plen", "budget", "generated", "i", "steps",
                 "grown", "widest")
        return {"model": "sizing", **{x: val(model, getattr(self, x)) for x in names}}


def _query(violation, extra=lambda s: []) -> Query:
    s = Sizing()
    return Query(s.assumptions + extra(s), violation(s), s.witness, s.sizes)


def _obligation(name: str, doc: str, violation, extra=lambda s: []) -> Obligation:
    return Obligation(f"sizing/{name}", doc, lambda _size: _query(violation, extra),
                      scope=SCOPE, size_free=True)


# -- every strategy ------------------------------------------------------------------------

def _output_column(s: Sizing):
    # a step writes output columns generated + i, i = 0 .. ks (committed tokens, then 0)
    return s.generated + s.i >= layout.output_width(s.max_budget, s.k)


# -- EQSPEC (and every contiguous batch: EXSPEC's admission prefill, the reference) --------

def _contiguous_verify(s: Sizing):
    # the batch steps from width W = the longest row's n; the verify writes slots up to
    # W + ks - 1
    return z3.Not(layout.verify_fits(s.n, s.ks, layout.contiguous_capacity(s.W0, s.max_budget, s.k)))


def _reference_step(s: Sizing):
    # batch-1 / batched standard decoding (specdec.reference): the prompt's W0 slots, then
    # one slot per new token but the last (k = 0)
    return s.W0 + s.budget - 1 > layout.contiguous_capacity(s.W0, s.max_budget, 0)


# -- HOLES -----------------------------------------------------------------------------

def _holes_capacity(s: Sizing, never: bool):
    return term(layout.holes_capacity(Z3, s.W0, s.max_budget, s.k, None if never else s.widest))


def _holes_compacted(never: bool):
    def violation(s: Sizing):
        # a compaction leaves the width of the longest staying row
        return z3.Not(layout.verify_fits(s.n, s.ks, _holes_capacity(s, never)))
    return violation


def _holes_uncompacted(never: bool):
    def violation(s: Sizing):
        # without compaction the width grows by ks_t + 1 per step t from W0 (``grown``:
        # between 1 and k + 1 per step); a row still steps after `steps` steps only if
        # each committed >= 1 token: steps <= generated
        return z3.Not(layout.verify_fits(s.W0 + s.grown, s.ks, _holes_capacity(s, never)))
    return violation


def _holes_uncompacted_assumptions(never: bool):
    def extra(s: Sizing):
        out = [s.steps >= 0, s.steps <= s.generated, s.grown >= s.steps,
               s.grown <= s.steps * layout.holes_width(0, s.k)]
        if not never:  # below the widest batch the threshold lets through
            out += [s.widest >= 0, s.W0 + s.grown <= s.widest]
        return out
    return extra


# -- EXSPEC pool -----------------------------------------------------------------------

def _pool_assumptions(s: Sizing):
    # the pool is sized for its longest request (``widest`` here): plen + budget <= it
    return [s.widest >= s.plen + s.budget]


def _pool_writes(s: Sizing):
    # write-back: the KV of verify input i to pool slot n - 1 + i, prediction y_i to n + i;
    # both must stay below the trash slot (capacity - 1), for the longest request too
    trash = layout.pool_capacity(s.widest, s.k) - 1
    return z3.Or(layout.verify_position(s.n, s.i) >= trash,
                 layout.verify_position(s.n, s.i + 1) >= trash)


def _pool_compute(s: Sizing):
    # the compute batch steps from the width of its longest row, at most n
    return z3.Not(layout.verify_fits(s.n, s.ks, layout.pool_compute_capacity(s.widest, s.k)))


def obligations() -> list[Obligation]:
    return [
        _obligation("output width", "every output column a step writes (generated + i, "
                    "i <= k) is inside output_width(max_budget, k)", _output_column),
        _obligation("eqspec capacity", "a verify from the widest width a contiguous batch "
                    "steps from fits contiguous_capacity", _contiguous_verify),
        _obligation("reference capacity", "standard decoding's cache (prompt, then one slot "
                    "per new token) fits contiguous_capacity with k = 0", _reference_step),
        _obligation("holes capacity after compaction", "a compacted batch (width = its "
                    "longest row) always fits holes_capacity, for any threshold",
                    _holes_compacted(False)),
        _obligation("holes capacity, never compacting", "with threshold 1 a compacted batch "
                    "fits too", _holes_compacted(True)),
        _obligation("holes threshold triggers first", "below the widest batch the threshold "
                    "lets through, an uncompacted batch fits holes_capacity",
                    _holes_uncompacted(False), _holes_uncompacted_assumptions(False)),
        _obligation("holes never compacting fits", "with threshold 1 an uncompacted batch "
                    "always fits holes_capacity", _holes_uncompacted(True),
                    _holes_uncompacted_assumptions(True)),
        _obligation("exspec pool writes", "every pool slot a write-back touches lies below "
                    "the trash slot of pool_capacity", _pool_writes, _pool_assumptions),
        _obligation("exspec compute capacity", "a verify of a compute batch fits "
                    "pool_compute_capacity", _pool_compute, _pool_assumptions),
    ]
