"""Proof obligations of the HOLES strategy (hole profile): the no-copy step, compaction,
and the compaction trigger.

Three symbolic situations, each evaluating ``specdec.layout``'s own functions on z3 terms
(``proofs.ops``), for every batch size ``B`` up to the bound:

``HoleStep`` (unbounded: ``n, m, k, W`` and the extended slot ``i`` are unbounded
integers). A verify step over ``pending ++ d_1 .. d_k`` on rows of width ``W`` that
already satisfy the hole profile (precondition: the ``n`` valid slots carry positions
``0 .. n-1`` in slot order, the pending token in slot ``W - 1`` at position ``n - 1``).
The strategy appends the ``k + 1`` extended slots ``W + i`` (``i = 0 .. k``) with
``layout.holes_slot_valid`` / ``holes_slot_position``; row ``b`` commits ``m[b]`` tokens
(``1 <= m <= k + 1``) after accepting ``a[b] >= m[b] - 1`` drafts. The old slots are not
touched, so the row's positions are ``0 .. n'-1`` in slot order (I3) iff the valid new
slots carry ``n .. n'-1``, increasing with the slot, each once (``n' = n + m``): three
obligations that need no counting, so they hold for unbounded ``k``.

``HoleRows`` (bounded, the literal I3): every slot of the old row has its own symbolic
valid bit (old width ``W <= MAX_WIDTH`` symbolic, ``k <= MAX_K`` symbolic), positions are
the I3 counts of the precondition, and after the step each slot's position is compared
with the number of valid slots before it, counted over the whole extended row (old slots
included), and the valid slots are counted (``n + m``).

``CompactRows`` (bounded, the scatter of ``layout.compact_dest_slot`` as
``batch.compact_sources`` runs it): a source row of ``COMPACT_WIDTH`` slots with a
symbolic valid bit per slot, I3 positions and the pending token in the last slot (any
narrower row is such a row with leading invalid slots, which compaction sends to the
trash: ``compact_dest_slot`` never reads the slot index); target width ``W_c`` any
integer ``>= max n`` (``layout.new_width`` is one, and is minimal: proved unbounded);
``pad' = layout.new_padding(W_c, n)``, trash slot ``W_c`` (the dropped column).

For ``HoleRows`` and ``CompactRows`` a batch size ``B > 1`` is settled by a syntactic
check that every row computes the batch-1 terms over its own variables (as in
``proofs.acceptance``), and solved directly when that check fails (a formula that mixes
rows). The compaction trigger (``compaction_due``, ``verify_fits``) is scalar arithmetic,
unbounded, with a real threshold.

Counterexamples carry ``"model": "holes"`` (printed as a grid by ``python -m proofs``);
they are not replayable on the engine (``specdec.forensics.counterexample`` rebuilds
EQSPEC steps only).
"""

from __future__ import annotations

import z3

from specdec import layout

from .core import Obligation, Query, VerifyRows, any_row, row_independent, symbolic, val
from .ops import Z3, cell, column, row, scalar, zt

STRATEGY = "holes"
SCOPE = "n,m,k,W unbounded"
#: bounds of the bit-level models (slots with their own symbolic valid bit)
MAX_WIDTH = 8       # old width W <= 8
MAX_K = 4           # drafts k <= 4 (extended row <= 13 slots)
COMPACT_WIDTH = 12  # source slots of a compaction
BITS_SCOPE = f"W<={MAX_WIDTH}, k<={MAX_K}, bit/slot, B>1 row-indep"
COMPACT_SCOPE = f"S<={COMPACT_WIDTH} bit/slot, Wc>=max n, B>1 row-indep"

_cached = symbolic(lambda cls, B: cls(B))


def _count(bits) -> object:
    return z3.Sum([z3.If(x, 1, 0) for x in bits]) if bits else z3.IntVal(0)


def _bits(model, xs) -> str:
    return "".join("1" if val(model, x) else "0" for x in xs)


# ---------------------------------------------------------------------------------------
# The step, unbounded
# ---------------------------------------------------------------------------------------

class HoleStep(VerifyRows):
    """B rows of a holes step; extended slot ``W + i`` at symbolic ``i`` (and ``i2``)."""

    def __init__(self, B: int):
        super().__init__(B)
        self.assumptions.append(self.W >= 1)
        self.i, self.i2 = z3.Int("i"), z3.Int("i2")
        n_col, m_col, k = column(self.n), column(self.m), scalar(self.k)
        self.valid, self.pos = {}, {}
        for name, i in (("i", self.i), ("i2", self.i2)):
            self.valid[name] = layout.holes_slot_valid(scalar(i), k, m_col)
            self.pos[name] = layout.holes_slot_position(Z3, scalar(i), k, n_col, m_col)
        self.Wn = cell(layout.holes_width(scalar(self.W), k), 0, 0)

    def get(self, field: str, b: int, slot: str = "i"):
        return cell(getattr(self, field)[slot], b, 0)

    def in_ext(self, slot: str = "i"):
        i = self.i if slot == "i" else self.i2
        return z3.And(i >= 0, i <= self.k)

    def witness(self, model, rows=None) -> dict:
        out = {"model": "holes", "situation": "step", "batch_size": self.B,
               "k": val(model, self.k), "W": val(model, self.W), "W'": val(model, self.Wn),
               "i": val(model, self.i), "i2": val(model, self.i2),
               "rows": [{"n": val(model, n), "m": val(model, m), "accepted": val(model, a),
                         "k_b": val(model, self.kb[b]),
                         "valid(i)": val(model, self.get("valid", b)),
                         "pos(i)": val(model, self.get("pos", b))}
                        for b, (n, m, a) in enumerate(zip(self.n, self.m, self.a))]}
        if rows is not None:
            out["violating_rows"] = [b for b, v in enumerate(rows) if val(model, v) is True]
        return out


def step_row(row_violation):
    def build(B: int) -> Query:
        st = _cached(HoleStep, B)
        rows = [row_violation(st, b) for b in range(B)]
        return Query(st.assumptions, any_row(rows), lambda mdl: st.witness(mdl, rows),
                     st.sizes + [st.i, st.i2])
    return build


def _width(st: HoleStep):
    # every row grows to W + k + 1 slots (the strategy appends k + 1 columns), and the
    # cache the verify forward left (W + k slots) is the new layout's cache: no crop
    cw = layout.cache_width(st.Wn)
    return z3.Or(st.Wn != st.W + st.k + 1, cw != st.W + st.k,
                 cw != cell(layout.ext_cache_width(scalar(st.W), scalar(st.k)), 0, 0))


def _pending_last(st: HoleStep, b: int):
    # the new pending token y_(m-1) sits in slot W' - 1 (extended index k), valid, at
    # position n' - 1, and is not cached (slot W' - 1 >= cache width)
    n_new = st.n[b] + st.m[b]
    return z3.And(st.i == st.Wn - 1 - st.W,
                  z3.Or(z3.Not(st.get("valid", b)), st.get("pos", b) != n_new - 1,
                        st.Wn - 1 < layout.cache_width(st.Wn)))


def _rejected_holes(st: HoleStep, b: int):
    # I6: draft d_(i+1) (i < k) stays valid iff it was committed (i < m - 1); a rejected
    # (or accepted but cut by stop/budget) draft becomes a hole
    i = st.i
    return z3.And(i >= 0, i < st.k, st.get("valid", b) != (i < st.m[b] - 1))


def _past_own_drafts(st: HoleStep, b: int):
    # per-row draft lengths: the verify covers k + 1 slots for every row, but row b drafted
    # only k_b of them; slots W + i for k_b <= i < k (filler) are never valid
    i = st.i
    return z3.And(i >= st.kb[b], i < st.k, st.get("valid", b))


def _kept_are_committed(st: HoleStep, b: int):
    # I6: a valid new slot holds a committed token at that token's position: slot W + i
    # (i < k) holds d_(i+1), which equals y_i only when accepted (i < a), at position
    # n + i; slot W + k holds y_(m-1) at n + m - 1
    i, n, m = st.i, st.n[b], st.m[b]
    pos = st.get("pos", b)
    bad_draft = z3.And(i < st.k, z3.Or(i >= st.a[b], i >= m - 1, pos != n + i))
    bad_pending = z3.And(i == st.k, pos != n + m - 1)
    return z3.And(st.in_ext(), st.get("valid", b), z3.Or(bad_draft, bad_pending))


def _new_positions_in_range(st: HoleStep, b: int):
    # I3 (with the precondition on the old slots): valid new slots carry n .. n'-1
    pos = st.get("pos", b)
    return z3.And(st.in_ext(), st.get("valid", b),
                  z3.Or(pos < st.n[b], pos > st.n[b] + st.m[b] - 1))


def _new_positions_increase(st: HoleStep, b: int):
    # I3: positions strictly increase with the slot over the valid new slots (so each once)
    return z3.And(st.in_ext("i"), st.in_ext("i2"), st.i < st.i2,
                  st.get("valid", b, "i"), st.get("valid", b, "i2"),
                  st.get("pos", b, "i") >= st.get("pos", b, "i2"))


def _new_positions_onto(st: HoleStep, b: int):
    # I3: every position n + c (c = 0 .. m-1) is carried by a valid new slot, namely by
    # i = c (an accepted draft) or i = k (the pending token) for c = m - 1. A witness slot
    # instead of a quantifier keeps the query quantifier-free.
    c = st.i2
    n, m = st.n[b], st.m[b]
    return z3.And(c >= 0, c <= m - 1, st.i == z3.If(c == m - 1, st.k, c),
                  z3.Or(z3.Not(st.get("valid", b)), st.get("pos", b) != n + c))


def _kv_position(st: HoleStep, b: int):
    # I5: the verify forward wrote input i + 1 (draft d_(i+1)) into cache slot
    # cache_width(W) + i + 1 at position verify_position(n, i + 1); a kept draft must sit
    # in that very token slot W + i with that position
    i = st.i
    cache_slot = layout.cache_width(st.W) + i + 1
    kv_pos = cell(layout.verify_position(column(st.n), scalar(i + 1)), b, 0)
    return z3.And(i >= 0, i < st.k, st.get("valid", b),
                  z3.Or(cache_slot != st.W + i, kv_pos != st.get("pos", b)))


# ---------------------------------------------------------------------------------------
# The step, one valid bit per slot (bounded): the literal I3 over the whole row
# ---------------------------------------------------------------------------------------

class HoleRows:
    """B rows of width ``W <= MAX_WIDTH`` in the hole profile, a bit per slot, then a
    holes step with ``k <= MAX_K`` drafts."""

    E = MAX_WIDTH + MAX_K + 1  # extended slots

    def __init__(self, B: int):
        self.B = B
        W, k = self.W, self.k = z3.Int("W"), z3.Int("k")
        self.assumptions = [W >= 1, W <= MAX_WIDTH, k >= 0, k <= MAX_K]
        self.v = [[z3.Bool(f"v{b}_{s}") for s in range(MAX_WIDTH)] for b in range(B)]
        self.m = [z3.Int(f"m{b}") for b in range(B)]
        self.kb = [z3.Int(f"kb{b}") for b in range(B)]  # the row's own draft length
        self.n, self.pos_old = [], []
        for b in range(B):
            v = self.v[b]
            # precondition (hole profile): slots exist below W; the pending token in slot
            # W - 1 is valid; positions are the I3 counts
            self.assumptions += [z3.Implies(s >= W, z3.Not(v[s])) for s in range(MAX_WIDTH)]
            self.assumptions += [z3.Implies(W - 1 == s, v[s]) for s in range(MAX_WIDTH)]
            self.assumptions += [self.kb[b] >= 0, self.kb[b] <= k, self.m[b] >= 1,
                                 self.m[b] <= self.kb[b] + 1]
            self.pos_old.append([z3.If(v[s], _count(v[:s]), 0) for s in range(MAX_WIDTH)])
            self.n.append(_count(v))
        i = row([e - W for e in range(self.E)])  # extended index of slot e (e >= W)
        ext_valid = layout.holes_slot_valid(i, scalar(k), column(self.m))
        ext_pos = layout.holes_slot_position(Z3, i, scalar(k), column(self.n), column(self.m))
        self.valid, self.pos = [], []
        for b in range(B):
            old = lambda s, xs: xs[s] if s < MAX_WIDTH else z3.BoolVal(False)  # noqa: E731
            self.valid.append([z3.If(e < W, old(e, self.v[b]),
                                     z3.And(e - W <= k, cell(ext_valid, b, e)))
                               for e in range(self.E)])
            self.pos.append([z3.If(e < W, self.pos_old[b][e] if e < MAX_WIDTH else 0,
                                   cell(ext_pos, b, e)) for e in range(self.E)])
        self.Wn = layout.holes_width(W, k)
        self.sizes = [W, k] + self.m + self.kb
        self.independent = None

    def row_vars(self, b):
        return self.v[b] + [self.m[b], self.kb[b]]

    def outputs(self, b):
        return self.valid[b] + self.pos[b]

    def witness(self, model, rows=None) -> dict:
        W, E = val(model, self.W), val(model, self.W) + val(model, self.k) + 1
        out = {"model": "holes", "situation": "step (bit per slot)", "batch_size": self.B,
               "k": val(model, self.k), "W": W, "W'": val(model, self.Wn), "rows": []}
        for b in range(self.B):
            out["rows"].append({
                "n": val(model, self.n[b]), "m": val(model, self.m[b]),
                "k_b": val(model, self.kb[b]), "valid_before": _bits(model, self.v[b][:W]),
                "valid_after": _bits(model, self.valid[b][:E]),
                "positions_after": [val(model, p) for p in self.pos[b][:E]]})
        if rows is not None:
            out["violating_rows"] = [b for b, v in enumerate(rows) if val(model, v) is True]
        return out


def bits_row(cls, row_violation):
    """Per-row property of a bit-level model: solved at B = 1; B > 1 settled by
    ``core.row_independent`` when it holds, solved directly otherwise."""

    def build(B: int) -> list[Query]:
        bt = _cached(cls, B)
        if B > 1 and row_independent(bt, _cached(cls, 1)):
            return []
        rows = [row_violation(bt, b) for b in range(B)]
        return [Query(bt.assumptions, any_row(rows), lambda mdl: bt.witness(mdl, rows), bt.sizes)]

    return build


def _i3_literal(bt: HoleRows, b: int):
    # I3: at every valid slot of the extended row, position = valid slots before it
    valid, pos = bt.valid[b], bt.pos[b]
    return z3.Or(*[z3.And(valid[e], pos[e] != _count(valid[:e])) for e in range(bt.E)])


def _count_and_pending(bt: HoleRows, b: int):
    # I2/I6: the row holds n + m valid slots, the last of which is the pending token in
    # slot W' - 1 (with position n' - 1); no valid slot lies past it
    valid, pos = bt.valid[b], bt.pos[b]
    n_new = bt.n[b] + bt.m[b]
    last = [z3.And(e == bt.Wn - 1, z3.Or(z3.Not(valid[e]), pos[e] != n_new - 1))
            for e in range(bt.E)]
    beyond = [z3.And(e >= bt.Wn, valid[e]) for e in range(bt.E)]
    return z3.Or(_count(valid) != n_new, *last, *beyond)


class ContiguousRows:
    """B rows of the contiguous profile at width ``W <= MAX_WIDTH + MAX_K + 1`` (as
    prefill and compaction leave them): the induction base of the hole profile."""

    def __init__(self, B: int):
        self.B = B
        S = MAX_WIDTH + MAX_K + 1
        self.W = z3.Int("W")
        self.n = [z3.Int(f"n{b}") for b in range(B)]
        self.assumptions = [self.W >= 1, self.W <= S]
        self.assumptions += [z3.And(n >= 1, n <= self.W) for n in self.n]
        pad = layout.new_padding(scalar(self.W), column(self.n))
        j = row(range(S))
        valid = layout.slot_valid(j, pad)
        pos = layout.slot_position(Z3, j, pad)
        self.valid = [[z3.And(s < self.W, cell(valid, b, s)) for s in range(S)]
                      for b in range(B)]
        self.pos = [[cell(pos, b, s) for s in range(S)] for b in range(B)]
        self.sizes = [self.W] + self.n
        self.independent = None

    def row_vars(self, b):
        return [self.n[b]]

    def outputs(self, b):
        return self.valid[b] + self.pos[b]

    def witness(self, model, rows=None) -> dict:
        W = val(model, self.W)
        out = {"model": "holes", "situation": "contiguous profile", "batch_size": self.B,
               "W": W, "rows": [{"n": val(model, self.n[b]),
                                 "valid": _bits(model, self.valid[b][:W]),
                                 "positions": [val(model, p) for p in self.pos[b][:W]]}
                                for b in range(self.B)]}
        if rows is not None:
            out["violating_rows"] = [b for b, v in enumerate(rows) if val(model, v) is True]
        return out


def _base_case(bt: ContiguousRows, b: int):
    # the hole-profile precondition: I3 counts, n valid slots, pending valid in slot W - 1
    valid, pos = bt.valid[b], bt.pos[b]
    S = len(valid)
    i3 = [z3.And(valid[s], pos[s] != _count(valid[:s])) for s in range(S)]
    pending = [z3.And(s == bt.W - 1, z3.Not(valid[s])) for s in range(S)]
    return z3.Or(_count(valid) != bt.n[b], *i3, *pending)


# ---------------------------------------------------------------------------------------
# Compaction (compact_dest_slot as a scatter), one valid bit per source slot
# ---------------------------------------------------------------------------------------

class CompactRows:
    """B hole-profile rows of ``COMPACT_WIDTH`` source slots compacted to width ``W_c``."""

    S = COMPACT_WIDTH

    def __init__(self, B: int):
        self.B, S = B, self.S
        self.Wc = z3.Int("W_c")
        self.v = [[z3.Bool(f"v{b}_{s}") for s in range(S)] for b in range(B)]
        self.assumptions = [self.Wc >= 1]
        self.n, self.pos = [], []
        for b in range(B):
            v = self.v[b]
            self.assumptions.append(v[S - 1])  # the pending token in the last slot
            self.pos.append([z3.If(v[s], _count(v[:s]), 0) for s in range(S)])
            self.n.append(_count(v))
            self.assumptions.append(self.Wc >= self.n[b])
        self.pad = layout.new_padding(scalar(self.Wc), column(self.n))
        # batch.compact_sources: trash = the compaction width (a column that is dropped)
        self.dest = layout.compact_dest_slot(Z3, zt(self.v), zt(self.pos), self.pad,
                                             scalar(self.Wc))
        self.j = z3.Int("d")  # a symbolic destination slot
        self.sizes = [self.Wc]
        self.independent = None

    def row_vars(self, b):
        return self.v[b]

    def outputs(self, b):
        return [cell(self.pad, b, 0)] + [cell(self.dest, b, s) for s in range(self.S)]

    def get_pad(self, b):
        return cell(self.pad, b, 0)

    def get_dest(self, b, s):
        return cell(self.dest, b, s)

    def witness(self, model, rows=None) -> dict:
        out = {"model": "holes", "situation": "compaction", "batch_size": self.B,
               "W_c": val(model, self.Wc), "trash": val(model, self.Wc), "d": val(model, self.j),
               "rows": [{"n": val(model, self.n[b]), "pad'": val(model, self.get_pad(b)),
                         "valid": _bits(model, self.v[b]),
                         "positions": [val(model, p) for p in self.pos[b]],
                         "dest": [val(model, self.get_dest(b, s)) for s in range(self.S)]}
                        for b in range(self.B)]}
        if rows is not None:
            out["violating_rows"] = [b for b, v in enumerate(rows) if val(model, v) is True]
        return out


def _dest_in_range(ct: CompactRows, b: int):
    pad = ct.get_pad(b)
    return z3.Or(*[z3.And(ct.v[b][s], z3.Or(ct.get_dest(b, s) < pad, ct.get_dest(b, s) > ct.Wc - 1))
                   for s in range(ct.S)])


def _dest_order(ct: CompactRows, b: int):
    # two valid sources s < t land in destinations d(s) < d(t): distinct, order kept
    v, S = ct.v[b], ct.S
    return z3.Or(*[z3.And(v[s], v[t], ct.get_dest(b, s) >= ct.get_dest(b, t))
                   for s in range(S) for t in range(s + 1, S)])


def _dest_onto(ct: CompactRows, b: int):
    # every destination slot pad' .. W_c - 1 receives a valid source (so with "in range"
    # and "order": a bijection onto the contiguous profile at width W_c)
    d, pad = ct.j, ct.get_pad(b)
    missed = z3.And(*[z3.Or(z3.Not(ct.v[b][s]), ct.get_dest(b, s) != d) for s in range(ct.S)])
    return z3.And(d >= pad, d <= ct.Wc - 1, missed)


def _dest_position(ct: CompactRows, b: int):
    # a valid source lands where the contiguous profile the strategy writes after the
    # compaction (slot_valid / slot_position at pad') is valid with the source's position
    pad = ct.get_pad(b)
    bad = []
    for s in range(ct.S):
        d = ct.get_dest(b, s)
        ok_valid = cell(layout.slot_valid(scalar(d), scalar(pad)), 0, 0)
        ok_pos = cell(layout.slot_position(Z3, scalar(d), scalar(pad)), 0, 0)
        bad.append(z3.And(ct.v[b][s], z3.Or(z3.Not(ok_valid),
                                           ok_pos != ct.pos[b][s], d - pad != ct.pos[b][s])))
    return z3.Or(*bad)


def _pending_right_aligned(ct: CompactRows, b: int):
    return ct.get_dest(b, ct.S - 1) != ct.Wc - 1


def _trash(ct: CompactRows, b: int):
    # invalid sources (holes, padding) go to the trash column W_c and valid ones never do
    # (a scatter with a hole on a kept column would clobber a real token)
    return z3.Or(*[z3.If(ct.v[b][s], ct.get_dest(b, s) >= ct.Wc, ct.get_dest(b, s) != ct.Wc)
                   for s in range(ct.S)])


def _cache_computed(ct: CompactRows, b: int):
    # a valid destination cache slot (d < cache_width(W_c)) reads a source slot whose KV
    # was computed (s < cache_width(S): the source's pending token is not cached)
    cw, cw_src = layout.cache_width(ct.Wc), layout.cache_width(ct.S)
    return z3.Or(*[z3.And(ct.v[b][s], ct.get_dest(b, s) < cw, s >= cw_src)
                   for s in range(ct.S)])


# ---------------------------------------------------------------------------------------
# Compaction width and trigger (unbounded scalars)
# ---------------------------------------------------------------------------------------

def _compaction_width(B: int) -> Query:
    # W_c = new_width over the rows that stay (as phases.sync computes max_n): every kept
    # row has pad' = new_padding(W_c, new_length(n, m)) >= 0 and some kept row pad' = 0
    n = [z3.Int(f"n{b}") for b in range(B)]
    m = [z3.Int(f"m{b}") for b in range(B)]
    keep = [z3.Bool(f"keep{b}") for b in range(B)]
    wc = cell(layout.new_width(Z3, column(n), column(m), column(keep)), 0, 0)
    lengths = layout.new_length(column(n), column(m))
    pad = layout.new_padding(scalar(wc), lengths)
    assume = [z3.Or(*keep)] + [z3.And(nb >= 1, mb >= 1) for nb, mb in zip(n, m)]
    negative = z3.Or(*[z3.And(keep[b], cell(pad, b, 0) < 0) for b in range(B)])
    nobody = z3.And(*[z3.Or(z3.Not(keep[b]), cell(pad, b, 0) != 0) for b in range(B)])

    def witness(mdl):
        return {"model": "holes", "situation": "compaction width", "batch_size": B,
                "W_c": val(mdl, wc), "rows": [{"n": val(mdl, n[b]), "m": val(mdl, m[b]),
                                               "kept": val(mdl, keep[b])} for b in range(B)]}

    return Query(assume, z3.Or(negative, nobody), witness, n + m)


def _next_width(wide, max_n, k, threshold, capacity):
    """The width after a holes step's compaction decision, as ``strategies/holes.after_step``
    decides it: compact to ``max_n`` when due or when the next verify would not fit."""
    due = z3.Or(layout.compaction_due(wide, max_n, threshold),
                z3.Not(layout.verify_fits(wide, k, capacity)))
    return z3.If(due, max_n, wide)


class Trigger:
    def __init__(self):
        self.W, self.max_n, self.k, self.cap = (z3.Int(x) for x in ("W", "max_n", "k", "capacity"))
        self.h = z3.Real("threshold")
        self.assumptions = [self.k >= 0, self.max_n >= 1, self.max_n <= self.W,
                            self.h >= 0, self.h <= 1]
        self.sizes = [self.W, self.max_n, self.k, self.cap]

    def witness(self, model) -> dict:
        h = model.eval(self.h, model_completion=True)
        return {"model": "holes", "situation": "compaction trigger", "W": val(model, self.W),
                "max_n": val(model, self.max_n), "k": val(model, self.k),
                "capacity": val(model, self.cap), "threshold": str(h)}


def trigger(violation, extra=lambda t: []):
    def build(B: int) -> Query:
        t = Trigger()
        return Query(t.assumptions + extra(t), violation(t), t.witness, t.sizes)
    return build


def _fits_spec(t: Trigger):
    # verify_fits <=> the verify's highest cache write, cache_width(W) + k, is a slot of
    # the cache (< capacity), i.e. the extended cache (W + k slots) fits
    highest = layout.cache_width(t.W) + t.k
    ext = cell(layout.ext_cache_width(scalar(t.W), scalar(t.k)), 0, 0)
    fits = layout.verify_fits(t.W, t.k, t.cap)
    return z3.Or(fits != (highest <= t.cap - 1), fits != (ext <= t.cap))


def _not_due_after_compaction(t: Trigger):
    # right after compacting to max_n there is nothing to reclaim: no compaction loop
    return z3.Or(layout.slack(t.max_n, t.max_n) != 0,
                 layout.compaction_due(t.max_n, t.max_n, t.h))


def _room_for_next_verify(t: Trigger):
    # with a capacity of at least max_n + k (holes.capacity gives longest + k + 1, and a
    # row that stays has n' <= longest - 1) the width after the decision always leaves
    # room for the next verify step
    # room for the next verify step (stated without verify_fits, which the decision uses):
    # its last cache write, cache_width(w) + k, is a slot of the cache
    w = _next_width(t.W, t.max_n, t.k, t.h, t.cap)
    return layout.cache_width(w) + t.k > t.cap - 1


def _slack_bounded(t: Trigger):
    # without compaction the slack share stays <= threshold: W (1 - h) <= max_n, the
    # bound holes.capacity sizes the cache with (W < longest / (1 - h))
    return z3.And(z3.Not(layout.compaction_due(t.W, t.max_n, t.h)),
                  z3.ToReal(t.W) * (1 - t.h) > z3.ToReal(t.max_n))


# ---------------------------------------------------------------------------------------

def obligations() -> list[Obligation]:
    P = f"{STRATEGY}/"
    return [
        Obligation(P + "I1 width W+k+1, cache = verify cache",
                   "every row grows to W' = W+k+1 slots; cache width W'-1 = W+k, no crop",
                   step_row(lambda st, b: _width(st)), scope=SCOPE),
        Obligation(P + "I2 pending in slot W'-1",
                   "the new pending token sits in slot W'-1 of every row, valid, at n'-1, uncached",
                   step_row(_pending_last), scope=SCOPE),
        Obligation(P + "I6 rejected drafts are holes",
                   "draft slot W+i (i<k) is valid iff the draft was committed (i < m-1)",
                   step_row(_rejected_holes), scope=SCOPE),
        Obligation(P + "I6 slots past the row's k_b are holes",
                   "a draft slot W+i with k_b <= i < k (filler of a shorter row) is never valid",
                   step_row(_past_own_drafts), scope=SCOPE),
        Obligation(P + "I6 valid new slots hold committed tokens",
                   "a valid new slot holds an accepted draft (= y_i) at n+i, or y_(m-1) at n'-1",
                   step_row(_kept_are_committed), scope=SCOPE),
        Obligation(P + "I3 new positions in n..n'-1",
                   "the valid new slots carry positions n .. n'-1 only",
                   step_row(_new_positions_in_range), scope=SCOPE),
        Obligation(P + "I3 new positions increase",
                   "over the valid new slots, positions strictly increase with the slot",
                   step_row(_new_positions_increase), scope=SCOPE),
        Obligation(P + "I3 new positions each held",
                   "every position n .. n'-1 is carried by a valid new slot",
                   step_row(_new_positions_onto), scope=SCOPE),
        Obligation(P + "I5 kept draft at its KV slot and position",
                   "a kept draft's token slot is the cache slot the verify wrote, same position",
                   step_row(_kv_position), scope=SCOPE),
        Obligation(P + "I3 literal: position = valid slots before",
                   "after a step, every valid slot's position = number of valid slots before it",
                   bits_row(HoleRows, _i3_literal), scope=BITS_SCOPE),
        Obligation(P + "I2 n' valid slots, pending last",
                   "after a step a row has n+m valid slots, the last in slot W'-1 at n'-1",
                   bits_row(HoleRows, _count_and_pending), scope=BITS_SCOPE),
        Obligation(P + "I3 induction base: contiguous rows",
                   "prefill/compaction output (contiguous profile) satisfies the hole profile",
                   bits_row(ContiguousRows, _base_case),
                   scope=f"W<={MAX_WIDTH + MAX_K + 1}, n symbolic, B>1 row-indep"),
        Obligation(P + "compaction dest in [pad', W_c-1]",
                   "every valid source slot lands in pad' .. W_c-1",
                   bits_row(CompactRows, _dest_in_range), scope=COMPACT_SCOPE),
        Obligation(P + "compaction keeps order (distinct)",
                   "valid sources s < t land in destinations d(s) < d(t)",
                   bits_row(CompactRows, _dest_order), scope=COMPACT_SCOPE),
        Obligation(P + "compaction fills pad'..W_c-1",
                   "every destination pad' .. W_c-1 receives a valid source",
                   bits_row(CompactRows, _dest_onto), scope=COMPACT_SCOPE),
        Obligation(P + "compaction keeps positions",
                   "dest - pad' = position; slot_valid/slot_position at dest agree",
                   bits_row(CompactRows, _dest_position), scope=COMPACT_SCOPE),
        Obligation(P + "compaction: pending to W_c-1",
                   "the pending token (last source slot) lands in slot W_c-1 (right-aligned)",
                   bits_row(CompactRows, _pending_right_aligned), scope=COMPACT_SCOPE),
        Obligation(P + "compaction: trash only for invalid",
                   "invalid sources go to the trash column W_c, valid ones never",
                   bits_row(CompactRows, _trash), scope=COMPACT_SCOPE),
        Obligation(P + "compaction cache reads computed KV",
                   "a valid destination cache slot reads a cached source slot (not the pending)",
                   bits_row(CompactRows, _cache_computed), scope=COMPACT_SCOPE),
        Obligation(P + "I1 compaction width = max n' (minimal)",
                   "W_c = new_width over kept rows: every pad' >= 0, some kept row pad' = 0",
                   _compaction_width, scope="n,m unbounded"),
        Obligation(P + "verify_fits = extended cache fits",
                   "verify_fits(W,k,cap) iff the verify's last cache write W+k-1 < cap",
                   trigger(_fits_spec), size_free=True, scope="W,k,capacity unbounded"),
        Obligation(P + "no compaction due right after one",
                   "after compacting to max n, slack = 0 and compaction_due is false (any h>=0)",
                   trigger(_not_due_after_compaction), size_free=True,
                   scope="n unbounded, real threshold"),
        Obligation(P + "room for the next verify",
                   "after the compaction decision the next verify fits (capacity >= max n + k)",
                   trigger(_room_for_next_verify, lambda t: [t.cap >= t.max_n + t.k]),
                   size_free=True, scope="W,k,capacity unbounded, real threshold"),
        Obligation(P + "no compaction => slack <= threshold",
                   "when compaction is not due, W (1 - h) <= max n (the bound capacity uses)",
                   trigger(_slack_bounded), size_free=True, scope="W,n unbounded, real threshold"),
    ]
