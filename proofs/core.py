"""Obligations, how they are checked, and what a failure looks like.

An ``Obligation`` is a property that must hold for every size up to a bound (batch size
for the layout, number of requests for the pool). For one size, ``build(size)`` returns a
``Query``: the assumptions (the symbolic situation: lengths, committed counts, widths) and
the violation (the negated property). The obligation is proved at that size when
``assumptions + violation`` is unsatisfiable (``build`` may return several queries, all
of which must be); a model of it is a counterexample, which
``Query.witness`` turns into a concrete, JSON-able dict (a small batch: n, m, W per row).

``check`` walks the sizes from the smallest, stops at the first counterexample (after
shrinking it: it asks again with every "size" term of the query bounded by 2, 4, 8, ...
and keeps the first that is still satisfiable) and reports the time spent. Before the first question on a new set of assumptions it
checks that the assumptions are satisfiable (status "vacuous" otherwise), so no
obligation is "proved" from an impossible situation.

Strategy modules (``proofs/eqspec.py``, ``holes.py``, ``exspec.py``) and the others
(``acceptance``, ``sizing``, ``pool``) each expose ``obligations() -> list[Obligation]``;
the list of modules is ``proofs.registry.modules()``.

Two helpers serve every module: ``symbolic`` memoises the symbolic models (z3 terms are
built once per size and per layout, and shared by the obligations that read them), and
``row_independent`` settles a per-row property at ``B > 1`` from its proof at ``B = 1``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import z3

from specdec import layout


@dataclass
class Query:
    """One satisfiability question: is there a situation that violates the property?"""

    # the symbolic situation (constraints every real batch satisfies)
    assumptions: list
    # the negated property (a z3 Bool)
    violation: object
    # model -> concrete counterexample (JSON-able dict)
    witness: Callable[[z3.ModelRef], dict]
    # integer terms bounded while shrinking a counterexample (lengths, k, widths)
    sizes: list = field(default_factory=list)
    # extra constraints of one case of a case split (queries of one build that share
    # the same ``assumptions`` object are asked on one solver, case by case)
    case: list = field(default_factory=list)


@dataclass
class Obligation:
    name: str           # short name printed in the report, e.g. "eqspec/I2 valid profile"
    doc: str            # the property in one sentence
    # size -> the queries that must all be unsatisfiable (a Query or a list of them; an
    # empty list when the size was settled otherwise, e.g. reduced to a smaller one)
    build: Callable[[int], "Query | list[Query]"]
    size_name: str = "B"  # what the size is ("B" batch size, "N" requests)
    min_size: int = 1
    # a fixed description of the other bounds (e.g. "n,m,k unbounded")
    scope: str = ""
    # True when build() ignores the size (checked once; the report says so)
    size_free: bool = False


@dataclass
class Result:
    name: str
    bound: str
    status: str          # "proved" | "counterexample" | "unknown" | "vacuous"
    seconds: float
    size: int | None = None           # size of the counterexample
    counterexample: dict | None = None
    doc: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "proved"


SHRINK_BOUNDS = (2, 3, 4, 6, 8, 12, 16, 32, 64)


def _shrunk_model(solver: z3.Solver, sizes: list) -> z3.ModelRef:
    """A model with small sizes when one exists (solver is sat on entry)."""
    if sizes:
        for bound in SHRINK_BOUNDS:
            solver.push()
            solver.add(*[s <= bound for s in sizes])
            if solver.check() == z3.sat:
                model = solver.model()
                solver.pop()
                return model
            solver.pop()
        solver.check()
    return solver.model()


def solve(query: Query, timeout_ms: int = 60_000, solver: z3.Solver | None = None):
    """('proved', None) or ('counterexample', dict) or ('unknown', reason).

    With ``solver`` (already holding ``query.assumptions``) the question is asked in a
    push/pop scope of it, so queries that share their assumptions share the work."""
    if solver is None:
        solver = new_solver(query, timeout_ms)
    solver.push()
    try:
        solver.add(*query.case)
        solver.add(query.violation)
        r = solver.check()
        if r == z3.unsat:
            return "proved", None
        if r == z3.unknown:
            return "unknown", {"reason": solver.reason_unknown()}
        model = _shrunk_model(solver, query.sizes)
        return "counterexample", query.witness(model)
    finally:
        solver.pop()


def new_solver(query: Query, timeout_ms: int) -> z3.Solver:
    solver = z3.Solver()
    solver.set("timeout", timeout_ms)
    solver.add(*query.assumptions)
    return solver


def check(ob: Obligation, max_size: int, timeout_ms: int = 60_000) -> Result:
    """Check ``ob`` for every size ``min_size .. max_size`` (once when ``size_free``)."""
    t0 = time.perf_counter()
    sizes: Iterable[int] = [max_size] if ob.size_free else range(ob.min_size, max_size + 1)
    bound = (f"{ob.size_name}<={max_size}" if not ob.size_free else "any " + ob.size_name)
    if ob.scope:
        bound += ", " + ob.scope
    for size in sizes:
        queries = ob.build(size)
        solver, shared = None, None
        for query in [queries] if isinstance(queries, Query) else queries:
            if solver is None or query.assumptions is not shared:  # a new situation
                solver, shared = new_solver(query, timeout_ms), query.assumptions
                if solver.check() != z3.sat:  # a proof from impossible assumptions is void
                    return Result(ob.name, bound, "vacuous", time.perf_counter() - t0, size,
                                  {"reason": "the assumptions are unsatisfiable"}, ob.doc)
            status, info = solve(query, timeout_ms, solver)
            if status != "proved":
                return Result(ob.name, bound, status, time.perf_counter() - t0, size, info, ob.doc)
    return Result(ob.name, bound, "proved", time.perf_counter() - t0, doc=ob.doc)


def val(model: z3.ModelRef, t) -> int | bool:
    """Concrete value of a term in a model (0/False for unconstrained terms)."""
    v = model.eval(t, model_completion=True)
    if z3.is_true(v):
        return True
    if z3.is_false(v):
        return False
    return v.as_long()


def any_row(per_row: Iterable) -> object:
    """Disjunction over rows (a violation in some row)."""
    terms = list(per_row)
    return z3.Or(*terms) if terms else z3.BoolVal(False)


# ---------------------------------------------------------------------------------------
# Shared by the obligation modules
# ---------------------------------------------------------------------------------------

_MEMOS: list = []


def _layout_key() -> tuple:
    """The layout functions as they are now (a mutant patches one: a fresh model)."""
    return tuple(v for _, v in sorted(vars(layout).items()) if callable(v))


def symbolic(build: Callable, limit: int = 256) -> Callable:
    """``build(*key)`` memoised per key and per layout: a symbolic model is built once and
    shared by every obligation that reads it, and a patched layout function (as under a
    mutant) gets a fresh one. ``clear_symbolic`` forgets every memo."""
    memo: dict = {}
    _MEMOS.append(memo)

    def get(*key):
        full = (key, _layout_key())
        if full not in memo:
            if len(memo) > limit:
                memo.clear()
            memo[full] = build(*key)
        return memo[full]

    return get


def clear_symbolic() -> None:
    """Forget every symbolic model built so far (a fresh run pays for building them
    again, as a new process does)."""
    for memo in _MEMOS:
        memo.clear()


class VerifyRows:
    """``B`` rows of a verify step with ``k >= 0`` drafts (the verify covers ``k + 1``
    tokens per row) from old width ``W``: row ``b`` drafts its own ``0 <= kb[b] <= k``
    tokens (``k`` is at least the largest: ``layout.draft_width`` over the rows of the
    step, finished ones included), has ``1 <= n[b] <= W`` real tokens, accepted
    ``a[b] <= kb[b]`` drafts and commits ``1 <= m[b] <= a[b] + 1`` tokens. The base of the
    strategies' symbolic batches, which add their own terms and assumptions."""

    def __init__(self, B: int):
        self.B = B
        self.k, self.W = z3.Int("k"), z3.Int("W")
        self.n = [z3.Int(f"n{b}") for b in range(B)]
        self.m = [z3.Int(f"m{b}") for b in range(B)]
        self.a = [z3.Int(f"a{b}") for b in range(B)]  # accepted drafts
        self.kb = [z3.Int(f"kb{b}") for b in range(B)]  # the row's own draft length
        self.assumptions = [self.k >= 0]
        for n, m, a, kb in zip(self.n, self.m, self.a, self.kb):
            self.assumptions += [n >= 1, n <= self.W, m >= 1, kb >= 0, kb <= self.k,
                                 a >= m - 1, a <= kb]
        self.sizes = [self.k, self.W] + self.n + self.m + self.a + self.kb


def row_independent(bt, one) -> bool:
    """Whether every row of the symbolic batch ``bt`` computes, syntactically, the terms
    of the batch-1 model ``one`` over its own variables: each output term of row ``b``
    (``bt.outputs(b)``), with row ``b``'s variables (``bt.row_vars(b)``) renamed to row
    0's of ``one``, is the very same z3 term as ``one.outputs(0)``; shared variables
    (``W``, ``k``, ...) keep their names.

    True is a proof that a per-row property proved at B = 1 holds in every row at this
    batch size (a row's assumptions are the batch-1 ones renamed, and the property reads
    only the row's own inputs and outputs). Cached in ``bt.independent``.
    """
    if bt.independent is None:
        bt.independent = all(
            (z3.substitute(got, *zip(bt.row_vars(b), one.row_vars(0))) if b else got).eq(want)
            for b in range(bt.B) for got, want in zip(bt.outputs(b), one.outputs(0)))
    return bt.independent
