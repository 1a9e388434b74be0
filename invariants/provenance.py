"""KV provenance (I5's cheap form, "I5-lite"): every cached K/V stays what a forward wrote
for its request and position, through every realignment, row drop and pool copy.

Deep mode recomputes each row's K/V with a clean prefill (I5 proper): exact in meaning,
a full prefill per check. This rule runs in fast and strict mode at the cost of a few
reductions over two layers per phase, and sees the faults that keep every width right
while moving the wrong K/V: a gather shifted by one slot, a row drop that copies in the
wrong direction, a pool written back one slot off, a crop that keeps the wrong slots.

The fingerprint of a cache slot (``fingerprint``): the bit patterns of layer 0's K vector
and of the last layer's V vector at that slot, read as integers (``float32`` as
``int32``, ``bfloat16`` and ``float16`` as ``int16``), multiplied by fixed weights (one
per head and head dimension, below ``2**20``, made on the device by a fill kernel and
integer arithmetic) and summed over heads and head dimensions in ``int64``. Integer sums
are exact in any order, so the fingerprint of a slot depends only on its bits: a copy
(which moves bits, ``cache.as_wide_elements``) keeps it in every dtype, and it is
compared exactly. Layer 0's K tells the token and position, the last layer's V the
context before it.

The rule, per cache (the target's and, for a drafter that keeps one, the drafter's):

- recorded when a forward writes: the target's slots written by the view's ``forward``
  (prefill and verify: columns ``cache_width .. cache_width + q - 1``, at the forward's
  positions, where its mask is set); the drafter's slots at the prefill view (its
  prefill wrote every slot) and at the draft view (the slots past ``W - 1``: the
  pending token and every draft, at positions ``n - 1 + i``). A table keyed by request
  id (``row_ids``) and position keeps the latest record of each (the newest
  ``capacity`` requests, like the monitor's other per-request state);
- checked at every ``realign`` view (after realignment, row drops, compaction, or
  EXSPEC's load from its pool): each valid slot ``j < W - 1`` holding position
  ``positions[b, j]`` must carry the fingerprint recorded for (``row_ids[b]``, that
  position). A position with no record (a view that never showed its forward) is not
  checked.

The drafter's cache lag is verified, not trusted (``lag_rule``): one realignment plan
serves both caches, so at the prefill, verify, commit and realign views the drafter's
cache must cover exactly the target cache's slots (equal widths: its declared
``draft_cache_lag`` is then the target's, ``k + 1`` at verify and commit, 0 at prefill
and realign); its positions and contents are then held to the records above.

Cost: no host read, upload or data-dependent shape (the table grows to widths the host
knows); per realign view one fingerprint of ``W - 1`` slots per cache, a gather and a
compare; per verify (and draft) view one fingerprint of the ``k + 1`` new slots and one
scatter. What it cannot see: a slot a forward claims to have written but did not (its
stale contents are recorded as written); the drafter-equals-target property
(tests/test_self_draft.py) covers that.
"""

from __future__ import annotations

import torch

from . import predicates as P
from .checker import Entry
from .rules import Rule
from .view import StepView

#: "no record" in a table (a real fingerprint equals it with probability about 2**-64)
NONE = torch.iinfo(torch.int64).min

#: integer views of each float dtype's bits
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
         torch.float64: torch.int64}

#: the rule as a trace states it; ``{cache}`` is "target" or "draft"
RULE = Rule(
    "I5.provenance", "I5",
    "every valid slot of the {cache} cache holding position p carries the KV fingerprint "
    "recorded when a forward wrote (its request, p): sum over heads and head dims of "
    "bits(K of layer 0) * w_K + bits(V of the last layer) * w_V in int64, fixed weights; "
    "compared exactly (realignment, row drops and pool copies only copy)",
    ("cache_tensors", "draft_cache_tensors", "positions", "valid", "row_ids"),
    columns="slots")

LAG_RULE = Rule(
    "I1.draft_cache_lag", "I1",
    "the draft cache covers exactly the target cache's slots at the prefill, verify, commit "
    "and realign views (one realignment plan serves both), so its declared lag is the "
    "target's: draft widths {draft} = target widths {target}, declared lag {lag}",
    ("cache_widths", "draft_cache_widths", "draft_cache_lag"))

#: phases at which the drafter's cache must have the target cache's width
LAG_PHASES = ("prefill", "verify", "commit", "realign")


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its own width (no copy); integer tensors as they are."""
    as_int = _BITS.get(t.dtype)
    return t if as_int is None else t.view(as_int)


def weights(h: int, d: int, salt: int, device) -> torch.Tensor:
    """[1, h, 1, d] long: fixed pseudo-random weights in [1, 2**20), one per head and
    head dimension, from ``salt`` (a fill kernel and integer arithmetic: no upload)."""
    i = torch.arange(h * d, device=device, dtype=torch.long)
    w = (i * 2654435761 + salt * 40503 + 12345) % 1048573 + 1
    return w.view(1, h, 1, d)


def fingerprint(k: torch.Tensor, v: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor
                ) -> torch.Tensor:
    """[B, q] long: the fingerprint of every slot of ``k`` (layer 0's keys) and ``v`` (the
    last layer's values), both ``[B, H, q, D]``; see the module docstring."""
    return (bits(k) * wk).sum(dim=(1, 3)) + (bits(v) * wv).sum(dim=(1, 3))


class Table:
    """The latest fingerprint recorded for each (request, position) of one cache.

    ``ids`` [R] long: request ids, newest first; ``fp`` [R, P + 1] long: the record at
    each position (``NONE``: none), column ``P`` a trash column scatters send unwanted
    writes to."""

    def __init__(self, device):
        self.ids = torch.zeros(0, dtype=torch.long, device=device)
        self.fp = torch.full((0, 1), NONE, dtype=torch.long, device=device)

    @property
    def width(self) -> int:
        """Positions the table holds (``P``)."""
        return self.fp.shape[1] - 1

    def admit(self, row_ids: torch.Tensor, capacity: int) -> None:
        """Start fresh records for ``row_ids`` ([B] long) and keep the newest ``capacity``
        requests (``predicates.remember_newest``; fixed sizes, no read)."""
        ids = row_ids.long()
        fresh = self.fp.new_full((ids.shape[0], self.fp.shape[1]), NONE)
        keep = P.remember_newest(ids, self.ids, capacity)
        self.ids = torch.cat([ids, self.ids]).index_select(0, keep)
        self.fp = torch.cat([fresh, self.fp]).index_select(0, keep)

    def grow(self, positions: int) -> None:
        """Hold at least ``positions`` positions (a host count: widths the host knows)."""
        if positions > self.width:
            r = self.fp.shape[0]
            more = self.fp.new_full((r, positions - self.width), NONE)
            self.fp = torch.cat([self.fp[:, :-1], more, self.fp[:, -1:]], dim=1)

    def record(self, row_ids: torch.Tensor, fp: torch.Tensor, pos: torch.Tensor,
               written: torch.Tensor) -> None:
        """Record ``fp`` [B, q] at (``row_ids[b]``, ``pos[b, i]``) where ``written`` [B, q];
        other entries go to the trash column."""
        idx, found = P.match_rows(row_ids.long(), self.ids)
        trash = self.width
        ok = written & found[:, None] & (pos >= 0) & (pos < trash)
        cols = torch.where(ok, pos, trash)
        self.fp.index_put_((idx[:, None].expand_as(cols), cols), fp)

    def mismatches(self, row_ids, fp, pos, valid) -> torch.Tensor:
        """[B, C] bool: valid slots whose fingerprint differs from a record."""
        idx, found = P.match_rows(row_ids.long(), self.ids)
        trash = self.width
        inside = valid & found[:, None] & (pos >= 0) & (pos < trash)
        got = self.fp.index_select(0, idx).gather(1, torch.where(inside, pos, trash))
        return inside & (got != NONE) & (got != fp)


def slot_layout(view: StepView, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions [B, c] long, valid [B, c] bool) of a cache of width ``c`` in ``view``:
    slot ``j < W - 1`` holds the token of slot ``j``; the slots from ``W - 1`` on hold the
    pending token and the drafts, at positions ``n - 1 + i``."""
    w = view.width
    head = min(c, w - 1)
    pos, valid = view.positions[:, :head].long(), view.valid[:, :head].bool()
    if c > head:
        i = torch.arange(c - head, device=view.device)[None, :]
        pos = torch.cat([pos, view.lengths.long()[:, None] - 1 + i], dim=1)
        valid = torch.cat([valid, torch.ones(view.batch_size, c - head, dtype=torch.bool,
                                             device=view.device)], dim=1)
    return pos, valid


class KVProvenance:
    """The monitor's per-run state of this rule (``Monitor`` calls it after every phase):
    ``__call__(view)`` records or checks and returns an ``Entry`` with one ``[B]`` mask
    (rows with a slot that lost its provenance), or one with a host failure (the lag
    rule), or None."""

    def __init__(self, capacity: int, *, provenance: bool = True, lag: bool = True):
        self.capacity = capacity
        self.check_provenance, self.check_lag = provenance, lag
        self.tables: dict = {}  # "target" | "draft" -> Table
        self._weights: dict = {}

    def _sources(self, view: StepView):
        """(name, list of (K, V) per layer) of every cache the view exposes."""
        out = []
        for name, get in (("target", view.cache_tensors), ("draft", view.draft_cache_tensors)):
            if get is None:
                continue
            layers = get()
            if layers:
                out.append((name, layers))
        return out

    def _fingerprint(self, layers, first: int, last: int | None) -> torch.Tensor:
        k, v = layers[0][0], layers[-1][1]
        k, v = k[:, :, first:last], v[:, :, first:last]
        key = (k.device, k.shape[1], k.shape[3], v.shape[1], v.shape[3])
        w = self._weights.get(key)
        if w is None:
            w = self._weights[key] = (weights(k.shape[1], k.shape[3], 1, k.device),
                                      weights(v.shape[1], v.shape[3], 2, v.device))
        return fingerprint(k, v, *w)

    def _table(self, name: str, view: StepView) -> Table:
        t = self.tables.get(name)
        if t is None:
            t = self.tables[name] = Table(view.device)
        t.grow(view.width + view.k + 1)  # every position a forward of this step can write
        return t

    def __call__(self, view: StepView) -> Entry | None:
        lag = self.check_lag and self._lag_broken(view)
        bad = None
        if self.check_provenance:
            try:
                bad = self._provenance(view)
            except (RuntimeError, IndexError, ValueError, AttributeError, TypeError):
                bad = None  # a cache of the wrong shape: I1 says why
        if not lag and bad is None:
            return None
        masks = [] if bad is None else [torch.stack([b.any(dim=1) for _, b in bad]).any(dim=0)]
        return Entry(masks, bool(lag), {"view": view, "provenance": bad or [],
                                        "lag": lag})

    # -- the lag ------------------------------------------------------------------------
    @staticmethod
    def _lag_broken(view: StepView) -> bool:
        dws, tws = view.draft_cache_widths, view.cache_widths
        return bool(dws) and bool(tws) and view.phase in LAG_PHASES \
            and any(d != tws[0] for d in dws)

    # -- records and checks ---------------------------------------------------------------
    def _provenance(self, view: StepView):
        phase, w = view.phase, view.width
        if phase == "prefill":
            for name, _ in self._sources(view):
                self._table(name, view).admit(view.row_ids, self.capacity)
        bad = []
        for name, layers in self._sources(view):
            table = self._table(name, view)
            c = layers[0][0].shape[2]
            if phase == "realign":
                n = min(c, w - 1)
                if n <= 0:
                    continue
                pos, valid = slot_layout(view, n)
                fp = self._fingerprint(layers, 0, n)
                bad.append((name, table.mismatches(view.row_ids, fp, pos, valid)))
            elif name == "target" and phase in ("prefill", "verify") and view.forward is not None:
                f = view.forward
                q = f.input_ids.shape[1]
                first = f.cache_width
                if q == 0 or first + q > c:
                    continue
                pos = f.positions.long().expand(view.batch_size, q)
                written = f.attention_mask[:, first : first + q].bool()
                table.record(view.row_ids, self._fingerprint(layers, first, first + q), pos,
                             written)
            elif name == "draft" and phase in ("prefill", "draft"):
                first = 0 if phase == "prefill" else min(c, w - 1)
                if c <= first:
                    continue
                pos, valid = slot_layout(view, c)
                table.record(view.row_ids, self._fingerprint(layers, first, c),
                             pos[:, first:], valid[:, first:])
        return bad or None


def describe(entry: Entry, rows: list, limit: int = 4):
    """Host side, on a failure: (invariant, rows, slots per row, sentences) of the entry's
    first failing rule, or None."""
    ctx = entry.context
    view = ctx["view"]
    if ctx.get("lag"):
        text = LAG_RULE.text(None, draft=list(view.draft_cache_widths),
                             target=list(view.cache_widths), lag=view.draft_cache_lag)
        return "I1", list(range(view.batch_size)), [[] for _ in range(view.batch_size)], \
            [f"{LAG_RULE.id}: {text}"]
    flagged = [b for b, x in enumerate(rows[0]) if x] if rows else []
    if not flagged:
        return None
    ids = view.row_ids.tolist()
    for name, bad in ctx["provenance"]:
        host = bad.tolist()
        mine = [b for b in flagged if any(host[b])]
        if not mine:
            continue
        slots = [[j for j, x in enumerate(host[b]) if x] for b in mine]
        pos = view.positions.tolist()
        detail = "; ".join(
            f"row {b} (req {ids[b]}): slots {s[:6]} at positions {[pos[b][j] for j in s[:6]]}"
            for b, s in list(zip(mine, slots))[:limit])
        text = RULE.sentence.format(cache=name)
        return "I5", mine, slots, [f"{RULE.id}: {text}; broken at {detail}"]
    return None
