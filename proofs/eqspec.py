"""Proof obligations of the EQSPEC realignment (contiguous profile).

The symbolic situation (``EqBatch``), for a batch of ``B`` rows that stay after a verify
step: ``k >= 0`` drafts (unbounded; the verify covers ``k + 1`` tokens), old width ``W``,
row ``b`` with ``n[b]`` real tokens, ``1 <= n[b] <= W`` (rows that finished this step only
make ``W`` larger, so any ``W >= max n`` is reachable), its own draft length
``0 <= kb[b] <= k``, committing ``m[b]`` tokens with ``1 <= m[b] <= kb[b] + 1``.
Every integer is unbounded; only ``B`` is bounded. The new width ``W'`` and the plan are
computed by ``specdec.layout.new_width`` and ``specdec.layout.realign_plan`` themselves,
evaluated on z3 terms (``proofs.ops``), at a symbolic destination slot ``j`` (and ``j2``
for the two-slot obligations). The properties are stated independently of the layout
functions (the specification is DESIGN.md's invariants written as arithmetic).

Extended row (DESIGN/layout.py): token slots ``0 .. W + k`` (old slots, then ``y_0 ..
y_k``), cache slots ``0 .. W + k - 1`` (old cached slots, pending, ``d_1 .. d_k``); row b
keeps tokens in extended slots ``W - n .. W + m - 1`` and computed KV in ``W - n .. W + m
- 2``. A token at extended slot ``s`` has position ``s - (W - n)``.
"""

from __future__ import annotations

import z3

from specdec import layout

from .core import Obligation, Query, any_row, symbolic, val
from .ops import Z3, Z3_NOCLAMP, cell, column, scalar

STRATEGY = "eqspec"
SCOPE = "n,m,k,W unbounded"


class EqBatch:
    """A symbolic EQSPEC batch of ``B`` kept rows, planned by ``specdec.layout``."""

    def __init__(self, B: int, slots: tuple = ("j",)):
        self.B = B
        self.k = z3.Int("k")
        self.W = z3.Int("W")
        self.n = [z3.Int(f"n{b}") for b in range(B)]
        self.m = [z3.Int(f"m{b}") for b in range(B)]
        self.kb = [z3.Int(f"kb{b}") for b in range(B)]  # the row's own draft length
        self.Wn = z3.Int("W_new")
        self.assumptions = [self.k >= 0, self.W >= 1]
        for n, m, kb in zip(self.n, self.m, self.kb):
            self.assumptions += [n >= 1, n <= self.W, m >= 1, kb >= 0, kb <= self.k,
                                 m <= kb + 1]
        n_col, m_col = column(self.n), column(self.m)
        keep = column([True] * B)
        # W' by definition (a named term keeps the formulas small)
        self.assumptions.append(self.Wn == cell(layout.new_width(Z3, n_col, m_col, keep), 0, 0))
        self.slots = {s: z3.Int(s) for s in slots}
        self.plan, self.raw = {}, {}
        for s, j in self.slots.items():
            args = (scalar(j), n_col, m_col, scalar(self.W), scalar(self.Wn), scalar(self.k))
            self.plan[s] = layout.realign_plan(Z3, *args)
            self.raw[s] = layout.realign_plan(Z3_NOCLAMP, *args)
        self.sizes = [self.k, self.W] + self.n + self.m + self.kb

    # per-row accessors (z3 terms) ------------------------------------------------------
    def n_new(self, b):
        return self.n[b] + self.m[b]  # spec: the row grows by its committed tokens

    def get(self, field: str, b: int, slot: str = "j", raw: bool = False):
        plan = (self.raw if raw else self.plan)[slot]
        return cell(getattr(plan, field), b, 0)

    def in_width(self, slot: str = "j"):
        j = self.slots[slot]
        return z3.And(j >= 0, j < self.Wn)

    def in_cache(self, slot: str = "j"):
        j = self.slots[slot]
        return z3.And(j >= 0, j < self.Wn - 1)

    def witness(self, model, violation_rows=None) -> dict:
        rows = [{"n": val(model, n), "m": val(model, m), "k_b": val(model, kb)}
                for n, m, kb in zip(self.n, self.m, self.kb)]
        out = {
            "strategy": STRATEGY, "batch_size": self.B, "k": val(model, self.k),
            "old_width": val(model, self.W), "new_width": val(model, self.Wn), "rows": rows,
            "slots": {s: val(model, j) for s, j in self.slots.items()},
        }
        if violation_rows is not None:
            out["violating_rows"] = [b for b, v in enumerate(violation_rows)
                                     if val(model, v) is True]
        return out


#: ``symbolic_batch(B, slots)``: ``EqBatch(B, slots)``, built once per layout
symbolic_batch = symbolic(EqBatch)


def per_row(slots: tuple, row_violation):
    """Obligation builder: the property must hold in every row at every slot."""

    def build(B: int) -> Query:
        bt = symbolic_batch(B, slots)
        rows = [row_violation(bt, b) for b in range(B)]
        return Query(bt.assumptions, any_row(rows), lambda mdl: bt.witness(mdl, rows),
                     bt.sizes + [bt.slots[s] for s in slots])

    return build


def batch_level(slots: tuple, violation):
    def build(B: int) -> Query:
        bt = symbolic_batch(B, slots)
        return Query(bt.assumptions, violation(bt), bt.witness, bt.sizes + list(bt.slots.values()))

    return build


# -- obligations ---------------------------------------------------------------------------

def _width_minimal(bt: EqBatch):
    # W' = max n_new: no row is longer than W', and some row fills it (min padding 0)
    too_short = any_row(bt.Wn < bt.n_new(b) for b in range(bt.B))
    nobody_fills = z3.And(*[bt.Wn != bt.n_new(b) for b in range(bt.B)])
    return z3.Or(too_short, nobody_fills)


def _cache_width(bt: EqBatch):
    cw = layout.cache_width(bt.Wn)
    return z3.Or(cw != bt.Wn - 1, cw < 0)


def _valid_profile(bt: EqBatch, b: int):
    # valid[b] = 0^(W' - n_new) 1^(n_new)
    j = bt.slots["j"]
    spec = j >= bt.Wn - bt.n_new(b)
    return z3.And(bt.in_width(), bt.get("valid", b) != spec)


def _positions(bt: EqBatch, b: int):
    # I3: at a valid slot, position = number of valid slots before it, which for the
    # profile 0^pad 1^n_new is j - pad; positions therefore read 0 .. n_new - 1.
    j = bt.slots["j"]
    spec = j - (bt.Wn - bt.n_new(b))
    return z3.And(bt.in_width(), bt.get("valid", b), bt.get("positions", b) != spec)


def _token_order(bt: EqBatch, b: int):
    # slot j holds the row's token whose position is positions[b, j]
    pos_of_source = bt.get("src_tokens", b) - (bt.W - bt.n[b])
    return z3.And(bt.in_width(), bt.get("valid", b), pos_of_source != bt.get("positions", b))


def _no_padding_read(bt: EqBatch, b: int):
    return z3.And(bt.in_width(), bt.get("valid", b), bt.get("src_tokens", b) < bt.W - bt.n[b])


def _rejected_dropped(bt: EqBatch, b: int):
    return z3.And(bt.in_width(), bt.get("valid", b),
                  bt.get("src_tokens", b) > bt.W + bt.m[b] - 1)


def _injective(bt: EqBatch, b: int):
    j, j2 = bt.slots["j"], bt.slots["j2"]
    return z3.And(bt.in_width("j"), bt.in_width("j2"), j < j2,
                  bt.get("valid", b, "j"), bt.get("valid", b, "j2"),
                  bt.get("src_tokens", b, "j") == bt.get("src_tokens", b, "j2"))


def _onto(bt: EqBatch, b: int):
    # every kept extended slot s = W - n + p (the token at position p) is read by a valid
    # destination slot, namely by the slot of position p, W' - n_new + p. (A witness slot
    # instead of a quantifier keeps the query quantifier-free; proved, it shows the map is
    # onto the kept slots. Together with "at most once" it is a bijection.)
    p = bt.slots["j"]  # the position of the kept token
    witness = bt.slots["j2"]
    return z3.And(p >= 0, p <= bt.n_new(b) - 1, witness == bt.Wn - bt.n_new(b) + p,
                  z3.Or(z3.Not(bt.in_width("j2")), z3.Not(bt.get("valid", b, "j2")),
                        bt.get("src_tokens", b, "j2") != bt.W - bt.n[b] + p))


def _cache_computed(bt: EqBatch, b: int):
    # a valid cache slot reads a computed KV slot of this row: W - n .. W + m - 2
    src = bt.get("src_cache", b)
    return z3.And(bt.in_cache(), bt.get("valid", b),
                  z3.Or(src < bt.W - bt.n[b], src > bt.W + bt.m[b] - 2))


def _cache_not_past_own_drafts(bt: EqBatch, b: int):
    # per-row draft lengths: the verify computed KV for k drafts in every row, but row b
    # drafted k_b; a valid cache slot never keeps the KV of a filler draft d_(k_b+1) ..
    # d_k (extended KV slots W + k_b .. W + k - 1)
    return z3.And(bt.in_cache(), bt.get("valid", b), bt.get("src_cache", b) >= bt.W + bt.kb[b])


def _identity(bt: EqBatch):
    # the host's fast path (strategies/eqspec.after_step): when every row has source shift
    # 0 (layout.realign_is_identity), the cache gather is replaced by a crop to
    # cache_width(W'), so every valid cache slot must read its own slot
    shift0 = [layout.realign_is_identity(bt.W, bt.Wn, m) for m in bt.m]
    moved = any_row(z3.And(bt.in_cache(), bt.get("valid", b), bt.get("src_cache", b) != bt.slots["j"])
                    for b in range(bt.B))
    return z3.And(*shift0, moved)


def _identity_when_uniform(bt: EqBatch):
    # ... and the fast path is taken in the common case: every row committed the same
    # count and the longest row filled the old width (min padding 0, I2)
    same = [m == bt.m[0] for m in bt.m[1:]]
    fills = z3.Or(*[n == bt.W for n in bt.n])
    shift0 = z3.And(*[layout.realign_is_identity(bt.W, bt.Wn, m) for m in bt.m])
    return z3.And(*same, fills, z3.Not(shift0))


def _cache_matches_token(bt: EqBatch, b: int):
    # cache slot j holds the KV of the token in slot j (extended KV slot s = token slot s)
    return z3.And(bt.in_cache(), bt.get("valid", b),
                  bt.get("src_cache", b) != bt.get("src_tokens", b))


def _in_range(bt: EqBatch, b: int):
    t, c = bt.get("src_tokens", b), bt.get("src_cache", b)
    bad_t = z3.And(bt.in_width(), z3.Or(t < 0, t > bt.W + bt.k))        # W + k + 1 slots
    bad_c = z3.And(bt.in_cache(), z3.Or(c < 0, c > bt.W + bt.k - 1))    # W + k slots
    return z3.Or(bad_t, bad_c)


def _clamp_identity(bt: EqBatch, b: int):
    # on valid slots the clamp of source_slot receives an in-range index (changes nothing)
    t_changed = bt.get("src_tokens", b) != bt.get("src_tokens", b, raw=True)
    c_changed = bt.get("src_cache", b) != bt.get("src_cache", b, raw=True)
    return z3.Or(z3.And(bt.in_width(), bt.get("valid", b), t_changed),
                 z3.And(bt.in_cache(), bt.get("valid", b), c_changed))


def _verify_positions(bt: EqBatch, b: int):
    # before the verify step the pending token (slot W - 1) has position n - 1 and verify
    # input i (0 = pending, 1..k = drafts) gets n - 1 + i: positions continue the row
    i = bt.slots["j"]
    n = bt.n[b]
    old_pad = cell(layout.new_padding(scalar(bt.W), column(bt.n)), b, 0)
    pending_pos = cell(layout.slot_position(Z3, scalar(bt.W - 1), scalar(old_pad)), 0, 0)
    pending_valid = cell(layout.slot_valid(scalar(bt.W - 1), scalar(old_pad)), 0, 0)
    vpos = cell(layout.verify_position(column(bt.n), scalar(i)), b, 0)
    return z3.Or(z3.Not(pending_valid), pending_pos != n - 1,
                 z3.And(i >= 0, i <= bt.k, vpos != n - 1 + i))


def _new_width_ignores_finished(B: int) -> Query:
    # B rows, any subset finished (at least one stays): W' = max n_new over the kept rows
    n = [z3.Int(f"n{b}") for b in range(B)]
    m = [z3.Int(f"m{b}") for b in range(B)]
    keep = [z3.Bool(f"keep{b}") for b in range(B)]
    k = z3.Int("k")
    wn = cell(layout.new_width(Z3, column(n), column(m), column(keep)), 0, 0)
    assume = [k >= 0, z3.Or(*keep)]
    for nb, mb in zip(n, m):
        assume += [nb >= 1, mb >= 1, mb <= k + 1]
    too_short = z3.Or(*[z3.And(keep[b], wn < n[b] + m[b]) for b in range(B)])
    nobody = z3.And(*[z3.Or(z3.Not(keep[b]), wn != n[b] + m[b]) for b in range(B)])

    def witness(mdl):
        return {"strategy": STRATEGY, "batch_size": B, "k": val(mdl, k), "new_width": val(mdl, wn),
                "rows": [{"n": val(mdl, n[b]), "m": val(mdl, m[b]), "kept": val(mdl, keep[b])}
                         for b in range(B)]}

    return Query(assume, z3.Or(too_short, nobody), witness, [k] + n + m)


def obligations() -> list[Obligation]:
    P = f"{STRATEGY}/"
    return [
        Obligation(P + "I1 new width = max n_new (min padding 0)",
                   "W' is the longest kept row: no row overflows and some row has padding 0",
                   batch_level(("j",), _width_minimal), scope=SCOPE),
        Obligation(P + "I1 width ignores finished rows",
                   "with any subset of rows finished, W' = max n_new over the rows that stay",
                   _new_width_ignores_finished, scope="n,m,k unbounded"),
        Obligation(P + "I1 cache width = W' - 1",
                   "the realigned cache has width W' - 1 >= 0 (every pending token uncached)",
                   batch_level(("j",), _cache_width), scope=SCOPE),
        Obligation(P + "I2 valid = 0^pad 1^n_new",
                   "valid[b, j] holds exactly for j >= W' - n_new[b]",
                   per_row(("j",), _valid_profile), scope=SCOPE),
        Obligation(P + "I3 positions contiguous",
                   "at a valid slot, position = number of valid slots before it",
                   per_row(("j",), _positions), scope=SCOPE),
        Obligation(P + "I3 verify positions continue",
                   "pending token at W-1 has position n-1; verify input i gets n-1+i",
                   per_row(("j",), _verify_positions), scope=SCOPE),
        Obligation(P + "I6 slot holds token of its position",
                   "destination slot j reads the row's token at position positions[b, j]",
                   per_row(("j",), _token_order), scope=SCOPE),
        Obligation(P + "I6 no padding read",
                   "a valid destination slot never reads an old padding slot (< W - n)",
                   per_row(("j",), _no_padding_read), scope=SCOPE),
        Obligation(P + "I6 rejected drafts dropped",
                   "a valid destination slot never reads past the newest committed token",
                   per_row(("j",), _rejected_dropped), scope=SCOPE),
        Obligation(P + "I6 kept tokens mapped at most once",
                   "two valid destination slots never read the same source slot",
                   per_row(("j", "j2"), _injective), scope=SCOPE),
        Obligation(P + "I6 kept tokens mapped at least once",
                   "every kept slot W-n .. W+m-1 is read by some valid destination slot",
                   per_row(("j", "j2"), _onto), scope=SCOPE),
        Obligation(P + "I1 cache reads computed KV only",
                   "a valid cache slot reads extended KV slot W-n .. W+m-2 of its row",
                   per_row(("j",), _cache_computed), scope=SCOPE),
        Obligation(P + "I5 no KV of a draft past k_b kept",
                   "a valid cache slot never reads KV slot W+k_b .. W+k-1 (a shorter row's filler)",
                   per_row(("j",), _cache_not_past_own_drafts), scope=SCOPE),
        Obligation(P + "crop fast path: shift 0 => identity",
                   "when every kept row has source shift 0, every valid cache slot reads its own "
                   "slot (the gather is a crop to W'-1)", batch_level(("j",), _identity), scope=SCOPE),
        Obligation(P + "crop fast path taken on equal commits",
                   "every row committing the same count with min padding 0 has source shift 0",
                   batch_level(("j",), _identity_when_uniform), scope=SCOPE),
        Obligation(P + "I5 cache slot = token slot",
                   "cache slot j holds the KV of the token in slot j",
                   per_row(("j",), _cache_matches_token), scope=SCOPE),
        Obligation(P + "source indices in range",
                   "every source slot (also on padding) lies in the extended row",
                   per_row(("j",), _in_range), scope=SCOPE),
        Obligation(P + "clamp is identity on valid slots",
                   "source_slot's clamp never changes the index of a valid slot",
                   per_row(("j",), _clamp_identity), scope=SCOPE),
    ]
