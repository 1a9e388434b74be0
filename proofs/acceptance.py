"""Proof obligations of greedy acceptance and the per-row budget.

The symbolic situation (``AccBatch``) for a batch of ``B`` rows in a verify step with
``k`` drafts: row ``b`` drafts its own ``0 <= kb[b] <= k`` (symbolic; the verify covers
``k + 1`` tokens), has a budget ``budget[b] >= 1`` and has generated
``generated[b] < budget[b]`` tokens (rows that reach their budget leave the batch, see
"rows in a step have budget"), so ``remaining = budget - generated >= 1`` (unbounded);
draft ``i`` matches the target's prediction (``match[b][i]``, ``d_{i+1} == y_i``) and
prediction ``i`` is a stop token (``stop[b][i]``) arbitrarily: every pattern of
equalities is realisable by some tokens. The engine's formulas are evaluated on these
terms: ``specdec.layout.draft_limit``, ``accepted_from_matches``,
``committed_from_accepted`` and ``row_finished`` (``specdec/acceptance.py`` and
``phases.speculate`` call exactly these). ``k`` sets tensor shapes, so it is concrete: every
``k`` in ``0 .. K`` is checked (``K`` defaults to 8), and every ``B`` up to the bound:
solved at ``B = 1``, and for ``B > 1`` reduced to ``B = 1`` by a syntactic proof that each
row computes the batch-1 formulas over its own inputs (``row_independent``; the
acceptance formulas reduce over drafts, never over rows), or solved directly where that
reduction does not hold.
"""

from __future__ import annotations

import z3

from specdec import layout

from .core import Obligation, Query, any_row, row_independent, symbolic, val
from .ops import Z3, cell, column, row, zt

K_MAX = 8


class AccBatch:
    def __init__(self, B: int, k: int):
        self.B, self.k = B, k
        self.budget = [z3.Int(f"budget{b}") for b in range(B)]
        self.generated = [z3.Int(f"generated{b}") for b in range(B)]
        self.kb = [z3.Int(f"kb{b}") for b in range(B)]  # the row's own draft length
        self.match = [[z3.Bool(f"match{b}_{i}") for i in range(k)] for b in range(B)]
        self.stop = [[z3.Bool(f"stop{b}_{i}") for i in range(k + 1)] for b in range(B)]
        self.assumptions = []
        for bu, g, kb in zip(self.budget, self.generated, self.kb):
            self.assumptions += [bu >= 1, g >= 0, g < bu, kb >= 0, kb <= k]
        self.remaining = [bu - g for bu, g in zip(self.budget, self.generated)]
        rem = column(self.remaining)
        self.limit = layout.draft_limit(Z3, column(self.kb), rem)
        # [B, k] match bits against draft index [1, k] (shapes [B, 0] and [1, 0] when k = 0)
        self.accepted = layout.accepted_from_matches(Z3, zt(self.match), row(range(k)),
                                                     self.limit)
        self.committed, self.stopped = layout.committed_from_accepted(
            Z3, zt(self.stop), row(range(k + 1)), self.accepted, rem)
        gen_after = column(self.generated) + self.committed
        self.finished = layout.row_finished(column([False] * B), self.stopped, gen_after,
                                            column(self.budget))
        self.sizes = self.budget + self.generated + self.kb
        self.independent = None  # cached result of row_independent

    def get(self, name: str, b: int):
        return cell(getattr(self, name), b, 0)

    def row_vars(self, b: int) -> list:
        """Row ``b``'s own variables (``core.row_independent`` renames them)."""
        return [self.budget[b], self.generated[b], self.kb[b], *self.match[b], *self.stop[b]]

    def outputs(self, b: int) -> list:
        """Row ``b``'s output terms."""
        return [self.get(name, b) for name in OUTPUTS]

    def witness(self, model, rows=None) -> dict:
        out = {"k": self.k, "batch_size": self.B, "rows": []}
        for b in range(self.B):
            out["rows"].append({
                "budget": val(model, self.budget[b]), "generated": val(model, self.generated[b]),
                "k_b": val(model, self.kb[b]),
                "match": [val(model, x) for x in self.match[b]],
                "stop": [val(model, x) for x in self.stop[b]],
                "limit": val(model, self.get("limit", b)),
                "accepted": val(model, self.get("accepted", b)),
                "committed": val(model, self.get("committed", b)),
            })
        if rows is not None:
            out["violating_rows"] = [b for b, v in enumerate(rows) if val(model, v) is True]
        return out


symbolic_batch = symbolic(AccBatch, limit=512)

OUTPUTS = ("limit", "accepted", "committed", "stopped", "finished")


def per_row(row_violation, k_max: int = K_MAX):
    """Holds in every row, for every k in 0..k_max: one query per k at B = 1; a larger B
    is settled by ``row_independent`` when it holds and solved directly otherwise."""

    def build(B: int) -> list[Query]:
        queries = []
        for k in range(k_max + 1):
            bt = symbolic_batch(B, k)
            if B > 1 and row_independent(bt, symbolic_batch(1, k)):
                continue
            rows = [row_violation(bt, b) for b in range(B)]
            queries.append(Query(bt.assumptions, any_row(rows),
                                 (lambda t, r: lambda mdl: t.witness(mdl, r))(bt, rows),
                                 bt.sizes))
        return queries

    return build


# -- obligations ---------------------------------------------------------------------------

def _limit(bt: AccBatch, b: int):
    lim, rem, kb = bt.get("limit", b), bt.remaining[b], bt.kb[b]
    exact = z3.If(kb <= rem - 1, kb, z3.If(rem - 1 >= 0, rem - 1, 0))
    return z3.Or(lim < 0, lim > bt.k, lim != exact)


def _accepted_prefix(bt: AccBatch, b: int):
    # a = max{i <= limit : d_1..d_i == y_0..y_(i-1)}
    a, lim, match = bt.get("accepted", b), bt.get("limit", b), bt.match[b]
    prefix = z3.And(*[z3.Implies(i < a, match[i]) for i in range(bt.k)])
    maximal = z3.Or(a == lim, *[z3.And(a == i, z3.Not(match[i])) for i in range(bt.k)])
    return z3.Not(z3.And(a >= 0, a <= lim, prefix, maximal))


def _committed_bounds(bt: AccBatch, b: int):
    c = bt.get("committed", b)
    return z3.Or(c < 1, c > bt.kb[b] + 1, c > bt.k + 1)


def _budget(bt: AccBatch, b: int):
    return bt.get("committed", b) > bt.remaining[b]


def _commit_spec(bt: AccBatch, b: int):
    # commit y_0 .. y_(c-1): c <= min(a + 1, remaining); no stop before the last one; it
    # ends at min(a + 1, remaining) or on a stop token; stopped says which
    a, c, stopped = bt.get("accepted", b), bt.get("committed", b), bt.get("stopped", b)
    stop, rem = bt.stop[b], bt.remaining[b]
    upto = z3.If(a + 1 <= rem, a + 1, rem)
    last_is_stop = z3.Or(*[z3.And(c - 1 == i, stop[i]) for i in range(bt.k + 1)])
    ok = z3.And(c >= 1, c <= upto,
                *[z3.Implies(i <= c - 2, z3.Not(stop[i])) for i in range(bt.k + 1)],
                z3.Or(c == upto, last_is_stop),
                stopped == last_is_stop)
    return z3.Not(ok)


def _stays_with_budget(bt: AccBatch, b: int):
    # after the commit a row stays only with budget left (so the next step's
    # remaining >= 1 assumption holds), and it never overshoots its budget
    gen = bt.generated[b] + bt.get("committed", b)
    fin = bt.get("finished", b)
    return z3.Or(gen > bt.budget[b], z3.And(z3.Not(fin), bt.budget[b] - gen < 1),
                 z3.And(fin, z3.Not(bt.get("stopped", b)), gen < bt.budget[b]))


def _plain_commit(bt: AccBatch, b: int):
    # a plain step (k = 0) commits as committed_plain says: the same counts as the general
    # formula, which phases.speculate then skips
    if bt.k:
        return z3.BoolVal(False)
    committed, stopped = layout.committed_plain(Z3, zt([[bt.stop[b][0]]]),
                                                column([bt.remaining[b]]))
    return z3.Or(cell(committed, 0, 0) != bt.get("committed", b),
                 cell(stopped, 0, 0) != bt.get("stopped", b))


def obligations(k_max: int = K_MAX) -> list[Obligation]:
    P = "acceptance/"
    scope = f"k<={k_max}, budget unbounded, B>1 row-indep"
    mk = lambda f: per_row(f, k_max)  # noqa: E731
    return [
        Obligation(P + "draft limit = min(k_b, remaining-1) >= 0",
                   "a row may use its own k_b <= k drafts and leaves its last budgeted token "
                   "to the target", mk(_limit), scope=scope),
        Obligation(P + "accepted = longest matching prefix",
                   "accepted drafts are the longest prefix d_1..d_a equal to y_0..y_(a-1), a <= limit",
                   mk(_accepted_prefix), scope=scope),
        Obligation(P + "1 <= committed <= k_b+1 <= k+1",
                   "every row commits at least one and at most its own k_b + 1 tokens per step",
                   mk(_committed_bounds), scope=scope),
        Obligation(P + "committed <= remaining budget",
                   "a row never commits beyond its remaining budget",
                   mk(_budget), scope=scope),
        Obligation(P + "commit = accepted + 1, cut at stop/budget",
                   "commit y_0..y_a cut at the remaining budget and after the first stop token",
                   mk(_commit_spec), scope=scope),
        Obligation(P + "plain commit = commit at k = 0",
                   "committed_plain gives a plain step's committed count and stop flag as "
                   "committed_from_accepted does with no draft",
                   mk(_plain_commit), scope=scope),
        Obligation(P + "rows in a step have budget",
                   "a row that stays has budget left; a row ends exactly at budget or on a stop",
                   mk(_stays_with_budget), scope=scope),
        Obligation(P + "verify width = max k_b + 1",
                   "draft_width is the largest k_b of the rows in the step (0: none drafts, "
                   "a plain step of width 1); rows outside it do not count",
                   _draft_width, scope="k_b unbounded"),
    ]


# -- the verify width of a step --------------------------------------------------------------

def _draft_width(B: int) -> Query:
    kb = [z3.Int(f"kb{b}") for b in range(B)]
    keep = [z3.Bool(f"keep{b}") for b in range(B)]
    w = cell(layout.draft_width(Z3, column(kb), column(keep)), 0, 0)
    below = any_row(z3.And(keep[b], kb[b] > w) for b in range(B))
    attained = z3.Or(*[z3.And(keep[b], kb[b] == w) for b in range(B)])
    violation = z3.Or(below, w < 0, z3.And(w > 0, z3.Not(attained)))

    def witness(mdl):
        return {"model": "draft width", "batch_size": B, "width": val(mdl, w),
                "rows": [{"k_b": val(mdl, kb[b]), "in step": val(mdl, keep[b])} for b in range(B)]}

    return Query([x >= 0 for x in kb], violation, witness, kb)
