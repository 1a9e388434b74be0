"""Proof obligations of the EXSPEC index math: pool rows are left-aligned (slot =
position), compute batches right-aligned (contiguous profile) or grouped (no padding).

The symbolic situation (``ExBatch``): a compute batch of ``B`` pool rows with ``n[b] >= 1``
tokens (unbounded), width ``W = max n`` (``strategies/exspec.build`` takes the maximum on
the host), ``k >= 0`` drafts, row ``b`` commits ``m[b]`` tokens (``1 <= m <= k + 1``)
after accepting ``a[b] >= m[b] - 1`` drafts, at symbolic slots ``j``, ``j2`` and verify
input ``i``. The functions are ``specdec.layout``'s, evaluated on z3 terms: ``grouped``,
``new_padding``/``slot_valid``/``slot_position`` (the load: destination slot ``j`` reads
pool slot ``slot_position(j, W - n)``), ``verify_position`` (the write-back of a verify
step), ``compact_dest_slot`` with padding 0 (storing a prefill in the pool),
``cache_width``/``ext_cache_width``/``new_length`` (reusing a group's compute cache).

The request pool itself (waiting/active/finished, outputs once and in order) is the
abstract model of ``proofs.pool``; ``tests/test_proofs.py`` ties it to the real EXSPEC
pool by checking the model's invariant, and that each change is a sequence of the
model's moves, on every view of a run.
"""

from __future__ import annotations

import z3

from specdec import layout

from .core import Obligation, Query, VerifyRows, any_row, symbolic, val
from .ops import Z3, cell, column, scalar

STRATEGY = "exspec"
SCOPE = "n,m,k unbounded"


class ExBatch(VerifyRows):
    def __init__(self, B: int):
        super().__init__(B)
        self.j, self.j2, self.i = z3.Int("j"), z3.Int("j2"), z3.Int("i")
        self.trash = z3.Int("trash")
        self.assumptions += [self.trash >= self.W, z3.Or(*[self.W == n for n in self.n])]
        n_col, W = column(self.n), scalar(self.W)
        self.grouped = cell(layout.grouped(Z3, n_col), 0)
        self.pad = layout.new_padding(W, n_col)
        self.plan = {}
        for name, j in (("j", self.j), ("j2", self.j2)):
            valid = layout.slot_valid(scalar(j), self.pad)
            src = layout.slot_position(Z3, scalar(j), self.pad)  # pool slot read by slot j
            # storing a prefill batch of this layout into the pool (admit)
            store = layout.compact_dest_slot(Z3, valid, src, 0, scalar(self.trash))
            self.plan[name] = {"valid": valid, "src": src, "store": store}
        self.kv_dest = layout.verify_position(n_col, scalar(self.i))       # pending, drafts
        self.tok_dest = layout.verify_position(n_col, scalar(self.i) + 1)  # y_0 .. y_k

    def get(self, field: str, b: int, slot: str = "j"):
        return cell(self.plan[slot][field], b, 0)

    def in_width(self, slot: str = "j"):
        j = self.j if slot == "j" else self.j2
        return z3.And(j >= 0, j < self.W)

    def witness(self, model, rows=None) -> dict:
        out = {"model": "exspec", "batch_size": self.B, "k": val(model, self.k),
               "W": val(model, self.W), "grouped": val(model, self.grouped),
               "j": val(model, self.j), "j2": val(model, self.j2), "i": val(model, self.i),
               "rows": [{"n": val(model, n), "m": val(model, m), "accepted": val(model, a),
                         "k_b": val(model, self.kb[b]), "pad": val(model, cell(self.pad, b, 0)),
                         "src(j)": val(model, self.get("src", b))}
                        for b, (n, m, a) in enumerate(zip(self.n, self.m, self.a))]}
        if rows is not None:
            out["violating_rows"] = [b for b, v in enumerate(rows) if val(model, v) is True]
        return out


symbolic_batch = symbolic(ExBatch)


def per_row(row_violation, extra=lambda bt: []):
    def build(B: int) -> Query:
        bt = symbolic_batch(B)
        rows = [row_violation(bt, b) for b in range(B)]
        return Query(bt.assumptions + extra(bt), any_row(rows), lambda mdl: bt.witness(mdl, rows),
                     bt.sizes + [bt.j, bt.j2, bt.i])
    return build


def batch_level(violation):
    def build(B: int) -> Query:
        bt = symbolic_batch(B)
        return Query(bt.assumptions, violation(bt), bt.witness, bt.sizes + [bt.j])
    return build


# -- grouped profile --------------------------------------------------------------------

def _grouped_no_padding(bt: ExBatch, b: int):
    # a group (grouped(n)) has pad 0 in every row: every slot valid, position = slot
    j = bt.j
    return z3.And(bt.grouped, z3.Or(cell(bt.pad, b, 0) != 0,
                                    z3.And(bt.in_width(), z3.Or(z3.Not(bt.get("valid", b)),
                                                                bt.get("src", b) != j))))


def _padding_only_if_not_grouped(bt: ExBatch):
    # grouped is exact: a batch that is not a group has a padded row
    return z3.And(z3.Not(bt.grouped), *[cell(bt.pad, b, 0) == 0 for b in range(bt.B)])


# -- load: pool rows (left-aligned) -> compute rows (right-aligned) ---------------------

def _load_position(bt: ExBatch, b: int):
    # every slot reads an existing pool slot (0 .. n-1; padding reads slot 0, masked); a
    # valid slot j reads the token at its position j - (W - n)
    src, n = bt.get("src", b), bt.n[b]
    return z3.And(bt.in_width(), z3.Or(src < 0, src > n - 1,
                                       z3.And(bt.get("valid", b), src != bt.j - (bt.W - n))))


def _load_injective(bt: ExBatch, b: int):
    return z3.And(bt.in_width("j"), bt.in_width("j2"), bt.j < bt.j2,
                  bt.get("valid", b, "j"), bt.get("valid", b, "j2"),
                  bt.get("src", b, "j") == bt.get("src", b, "j2"))


def _load_onto(bt: ExBatch, b: int):
    # every pool position p = 0 .. n-1 is read by a valid compute slot, namely W - n + p
    p, n = bt.j, bt.n[b]
    return z3.And(p >= 0, p <= n - 1, bt.j2 == bt.W - n + p,
                  z3.Or(z3.Not(bt.in_width("j2")), z3.Not(bt.get("valid", b, "j2")),
                        bt.get("src", b, "j2") != p))


def _load_cache_computed(bt: ExBatch, b: int):
    # a valid compute cache slot (j < cache_width(W)) reads computed pool KV (<= n - 2)
    return z3.And(bt.j >= 0, bt.j < layout.cache_width(bt.W), bt.get("valid", b),
                  bt.get("src", b) > bt.n[b] - 2)


# -- storing a prefill (admit) ------------------------------------------------------------

def _store_position(bt: ExBatch, b: int):
    # prefill slot j goes to pool slot = its position (valid), the trash slot (padding)
    d, n = bt.get("store", b), bt.n[b]
    valid = bt.get("valid", b)
    return z3.And(bt.in_width(), z3.If(valid, z3.Or(d != bt.j - (bt.W - n), d < 0, d > n - 1),
                                       d != bt.trash))


def _store_injective(bt: ExBatch, b: int):
    return z3.And(bt.in_width("j"), bt.in_width("j2"), bt.j < bt.j2,
                  bt.get("valid", b, "j"), bt.get("valid", b, "j2"),
                  bt.get("store", b, "j") == bt.get("store", b, "j2"))


def _store_cache_computed(bt: ExBatch, b: int):
    # the stored prefill KV (cache slots j < cache_width(W)) fills pool slots 0 .. n-2:
    # the pending token's slot n - 1 is left for the first verify step
    return z3.And(bt.j >= 0, bt.j < layout.cache_width(bt.W), bt.get("valid", b),
                  z3.Or(bt.get("store", b) > bt.n[b] - 2, bt.get("store", b) == bt.trash))


# -- write-back of a verify step -----------------------------------------------------------

def _write_back_positions(bt: ExBatch, b: int):
    # verify input i (0 = pending, 1..k = drafts) is the token at position n - 1 + i: its
    # KV goes to that pool slot; prediction y_i (the (i+1)-th committed token if any) to
    # n + i; nothing outside n - 1 .. n + k is written
    i, n = bt.i, bt.n[b]
    kv, tok = cell(bt.kv_dest, b, 0), cell(bt.tok_dest, b, 0)
    return z3.And(i >= 0, i <= bt.k, z3.Or(kv != n - 1 + i, tok != n + i,
                                           kv < n - 1, tok > n + bt.k))


def _write_back_covers(bt: ExBatch, b: int):
    # after the step the row's computed KV is 0 .. n'-2: each new slot q = n-1 .. n'-2 is
    # written by a committed input (pending or an accepted draft: i <= m - 1 <= a)
    q, n, m = bt.j, bt.n[b], bt.m[b]
    n_new = layout.new_length(n, m)
    return z3.And(q >= n - 1, q <= n_new - 2, bt.i == q - (n - 1),
                  z3.Or(cell(bt.kv_dest, b, 0) != q, bt.i > m - 1, bt.i > bt.a[b]))


# -- reusing a group's compute cache ----------------------------------------------------

def _same_commit(bt: ExBatch):
    # (strategies/exspec.run: a group is reused when every row committed the same count
    # and none finished) -- plus the grouped hypothesis, by the layout's own predicate
    return [bt.grouped] + [m == bt.m[0] for m in bt.m[1:]]


def _reuse_still_grouped(bt: ExBatch):
    n_new = column([layout.new_length(n, m) for n, m in zip(bt.n, bt.m)])
    return z3.Not(cell(layout.grouped(Z3, n_new), 0))


def _reuse_cache(bt: ExBatch, b: int):
    # the verify left W + k cache slots (old 0 .. W-2, then verify inputs); cropping to
    # cache_width(W') with W' = max n' keeps exactly the slots of committed tokens, slot q
    # holding the KV of position q (the group has no padding)
    q, n, m = bt.j, bt.n[b], bt.m[b]
    w_new = layout.new_length(bt.W, m)  # every row has n = W (grouped) and commits m
    crop = layout.cache_width(w_new)
    ext = cell(layout.ext_cache_width(scalar(bt.W), scalar(bt.k)), 0, 0)
    cw = layout.cache_width(bt.W)
    i = q - cw  # the verify input in cache slot q >= cw
    old_bad = z3.And(q < cw, z3.Or(z3.Not(bt.get("valid", b)), bt.get("src", b) != q))
    kv_pos = cell(layout.verify_position(column(bt.n), scalar(i)), b, 0)
    new_bad = z3.And(q >= cw, z3.Or(kv_pos != q, i > m - 1, i > bt.a[b]))
    return z3.Or(crop > ext, crop < cw,
                 z3.And(q >= 0, q < crop, z3.Or(old_bad, new_bad)),
                 n + m != w_new)


def obligations() -> list[Obligation]:
    P = f"{STRATEGY}/"
    return [
        Obligation(P + "I2 grouped => no padding",
                   "in a group every row has pad 0: all slots valid, position = slot",
                   per_row(_grouped_no_padding), scope=SCOPE),
        Obligation(P + "I2 not grouped => some padding",
                   "grouped is exact: a batch that is not a group pads some row",
                   batch_level(_padding_only_if_not_grouped), scope=SCOPE),
        Obligation(P + "load reads pool slot = position",
                   "compute slot j reads pool slot j - (W - n) (its position), in 0..n-1",
                   per_row(_load_position), scope=SCOPE),
        Obligation(P + "load reads each position at most once",
                   "two valid compute slots never read the same pool slot",
                   per_row(_load_injective), scope=SCOPE),
        Obligation(P + "load reads each position at least once",
                   "every pool position 0..n-1 is read by a valid compute slot",
                   per_row(_load_onto), scope=SCOPE),
        Obligation(P + "load cache reads computed KV",
                   "a valid compute cache slot reads pool KV at a position <= n-2",
                   per_row(_load_cache_computed), scope=SCOPE),
        Obligation(P + "prefill stored at slot = position",
                   "compact_dest_slot(pad 0): valid prefill slot -> its position, padding -> trash",
                   per_row(_store_position), scope=SCOPE),
        Obligation(P + "prefill store is one-to-one",
                   "two valid prefill slots never land in the same pool slot",
                   per_row(_store_injective), scope=SCOPE),
        Obligation(P + "prefill KV stored to 0..n-2",
                   "stored prefill KV fills pool slots 0..n-2 (the pending slot is not stored)",
                   per_row(_store_cache_computed), scope=SCOPE),
        Obligation(P + "write-back at the tokens' positions",
                   "verify input i -> pool slot n-1+i, y_i -> n+i, nothing outside n-1..n+k",
                   per_row(_write_back_positions), scope=SCOPE),
        Obligation(P + "write-back covers the new KV",
                   "pool slots n-1..n'-2 receive the KV of committed inputs",
                   per_row(_write_back_covers), scope=SCOPE),
        Obligation(P + "reused group stays grouped",
                   "a group whose rows all commit the same count is still a group",
                   batch_level(lambda bt: z3.And(*_same_commit(bt), _reuse_still_grouped(bt))),
                   scope=SCOPE),
        Obligation(P + "reused group cache: crop keeps committed KV",
                   "crop to cache_width(W') <= W+k; cache slot q holds committed position q",
                   per_row(_reuse_cache, _same_commit), scope=SCOPE),
    ]
