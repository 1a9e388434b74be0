"""KV provenance (I5's cheap form, "I5-lite"): every cached K/V stays what a forward wrote
for its request and position, through every realignment, row drop and pool copy.

Deep mode recomputes each row's K/V with a clean prefill (I5 proper): exact in meaning,
a full prefill per check. This rule runs in fast and strict mode at the cost of a few
reductions over two layers per phase, and sees the faults that keep every width right
while moving the wrong K/V: a gather shifted by one slot, a row drop that copies in the
wrong direction, a pool written back one slot off, a crop that keeps the wrong slots.

The fingerprint of a cache slot (``fingerprint``): the bit patterns of layer 0's K
vector and of the last layer's V vector at that slot, read as 64-bit integers
(``words``), summed over heads and head dimensions in ``int64``. Integer sums (modulo
``2**64``) are exact in any order, so the fingerprint of a slot depends only on its bits:
a copy (which moves bits, ``cache.as_wide_elements``) keeps it in every dtype, and it is
compared exactly. Layer 0's K tells the token and position, the last layer's V the
context before it; a slot moved from elsewhere (another slot, row or position) has other
bits, and two different vectors share a sum with probability about ``2**-64``.

The rule, per cache (the target's and, for a drafter that keeps one, the drafter's):

- recorded when a forward writes: the target's slots written by the view's ``forward``
  (prefill and verify: columns ``cache_width .. cache_width + q - 1``, at the forward's
  positions, where its mask is set); the drafter's slots at the prefill view (its
  prefill wrote every slot) and at the draft view (the slots past ``W - 1``: the
  pending token and every draft, at positions ``n - 1 + i``). A table keyed by request
  id (``row_ids``) and position keeps the latest record of each (the newest
  ``capacity`` requests, like the monitor's other per-request state);
- checked when the next forward's view shows the cache again (the target's at the
  verify view, a drafter's at the draft view: the cache as every realignment, row drop,
  compaction or EXSPEC pool load since the last forward left it, before the forward's
  own slots, which are then recorded): each valid slot ``j < W - 1`` holding position
  ``positions[b, j]`` must carry the fingerprint recorded for (``row_ids[b]``, that
  position). A position with no record (a view that never showed its forward) is not
  checked. Every realignment is followed by a forward (a row that stays is verified
  again), so one fingerprint per cache and step records and checks at once.

The drafter's cache lag is verified, not trusted (``LAG_RULE``, ``I1.draft_cache_lag``):
one realignment plan serves both caches, so at the prefill, verify, commit and realign
views the drafter's cache must cover exactly the target cache's slots (equal widths: its declared
``draft_cache_lag`` is then the target's, ``k + 1`` at verify and commit, 0 at prefill
and realign); its positions and contents are then held to the records above.

Cost: no host read, upload or data-dependent shape inside a hook (the table grows to
widths the host knows). Strict (and deep) mode: per forward view one fingerprint of the
cache's ``W + k`` slots (two copies' worth of work: a stack and a sum), a lookup and
compare of the old slots, and a scatter of the new ones: 21 aten ops at a target's
verify view, nothing at the other phases.

Fast mode (the Monitor's ``defer``) reads once per run, so the target cache's lookups
and records wait for ``check()`` and are done for every forward of the run at once
(``detect``): the hook takes the fingerprints (the cache changes in place) and one copy
of what the check reads (positions, valid, the forward's positions and mask, lengths,
request ids: one ``cat``; the engine may write its view's tensors in place after the
hook), 10 aten ops at a verify view. At the read, the records' keys (request, position,
time) are sorted once and each checked slot finds the latest record before it by a
binary search; about 25 ops for the run, plus two index tensors laid out on the host
(at ``check()``, not in a hook) and two ops per forward over fewer rows than the most
(its rows padded). ``detect`` flags a superset of the rows the
table would flag (it forgets nothing and needs no admission); only a flagged view is
replayed through the table in order (``exact``), so a report, and the first failing
step and phase, are the hooks' own. Past ``MAX_DEFERRED`` forwards a run is replayed
into the table and checked in the hooks from then on (bounded memory). The drafter's
cache is checked in its hooks as in strict mode.

What it cannot see: a slot a forward claims to have written but did not (its
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

#: the rule as a trace states it; ``{cache}`` is "target" or "draft"
RULE = Rule(
    "I5.provenance", "I5",
    "every valid slot of the {cache} cache holding position p carries the KV fingerprint "
    "recorded when a forward wrote (its request, p): the int64 sum of the bits of layer "
    "0's K and the last layer's V at the slot, read as 64-bit words over heads and head "
    "dims; compared exactly (realignment, row drops and pool copies only copy)",
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

#: fast mode: a run's target forwards whose checks wait for ``settle`` (the read); past
#: this many, the run is replayed into the table and checked in the hooks again
MAX_DEFERRED = 512


def words(t: torch.Tensor) -> torch.Tensor:
    """A contiguous ``t`` ``[..., D]`` viewed as integers of its last dimension's bytes:
    64-bit words where ``D`` times the element size allows, else integers of the element's
    own width (no copy)."""
    size = t.shape[-1] * t.element_size()
    for as_int, width in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if size % width == 0 and t.element_size() <= width:
            return t.view(as_int)
    return t.view(torch.uint8)


def fingerprint(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[B, q] long: the fingerprint of every slot of ``k`` (layer 0's keys) and ``v`` (the
    last layer's values), both head-major ``[B, H, q, D]`` as caches hold them: the sum,
    over heads and head dims, of their bits read as integers (``words``), in int64.
    Integer sums wrap modulo 2**64, which is exact and independent of the order of the
    additions. One copy (the two side by side along heads) and two sums: three kernels.
    The heads are summed first, then the words: a sum over a short last dimension of
    int64 (8 words of a head) runs element by element on a CPU (8.5 us at a tiny Llama's
    [8, 8, 38, 8], one thread, against 3.6 us for the heads' sum), so reducing the heads
    first takes the fingerprint from 16.4 us to 12.0 (same order-free integer sums, so
    the same values)."""
    return words(torch.cat([k, v], dim=1)).sum(dim=1).sum(dim=-1)


def cache_ends(get, first: int = 0, last: int | None = None):
    """(K of layer 0, V of the last layer), each head-major ``[B, H, q, D]``, over slots
    ``first .. last - 1`` of the cache ``get()`` returns (a view's ``cache_tensors``; None
    when it has no layer): what KV provenance fingerprints. A cache may give them itself
    (``ends(first, last)``), in fewer view ops."""
    layers = get()
    ends = getattr(layers, "ends", None)
    if ends is not None:
        return ends(first, last)
    if not layers:
        return None
    return layers[0][0][:, :, first:last], layers[-1][1][:, :, first:last]


class Table:
    """The latest fingerprint recorded for each (request, position) of one cache.

    ``ids`` [R] long: request ids, newest first; ``fp`` [R + 2, P + 2] long: the record
    at each position (``NONE``: none); row ``R`` and column ``P`` take the writes a
    scatter discards, row ``R + 1`` and column ``P + 1`` stay ``NONE`` (where lookups of
    what is not judged go)."""

    def __init__(self, device):
        self.ids = torch.zeros(0, dtype=torch.long, device=device)
        # two rows past the requests': writes of unknown requests land in the first,
        # lookups of unknown requests read the second (always NONE)
        self.fp = torch.full((2, 2), NONE, dtype=torch.long, device=device)
        self._match = None  # (row_ids, version, ids, write rows [B], read rows [B])
        self._cols = None  # (width, discard column, NONE column)

    @property
    def width(self) -> int:
        """Positions the table holds (``P``)."""
        return self.fp.shape[1] - 2

    def admit(self, row_ids: torch.Tensor, capacity: int) -> None:
        """Start fresh records for ``row_ids`` ([B] long) and keep the newest ``capacity``
        requests (``predicates.remember_newest``; fixed sizes, no read)."""
        ids = row_ids.long()
        fresh = self.fp.new_full((ids.shape[0], self.fp.shape[1]), NONE)
        keep = P.remember_newest(ids, self.ids, capacity)
        self.ids = torch.cat([ids, self.ids]).index_select(0, keep)
        spare = self.fp.new_full((2, self.fp.shape[1]), NONE)
        self.fp = torch.cat([torch.cat([fresh, self.fp[:-2]]).index_select(0, keep), spare])

    def grow(self, positions: int) -> None:
        """Hold at least ``positions`` positions (a host count: widths the host knows)."""
        if positions > self.width:
            more = self.fp.new_full((self.fp.shape[0], positions - self.width + 16), NONE)
            self.fp = torch.cat([self.fp[:, :-2], more, self.fp[:, -2:]], dim=1)

    def rows(self, row_ids: torch.Tensor):
        """(write rows [B, 1], read rows [B]) long: each row's request in the table
        (``predicates.match_rows``), an unknown one sent to the discard row (writes) or
        the NONE row (reads); reused while ``row_ids`` and the table's ids are the same
        tensors, unmodified (engines hand the same row ids to every phase of a step)."""
        m = self._match
        try:
            version = row_ids._version
        except RuntimeError:  # inference mode: no version counter, look up every time
            version = None
        if m is not None and m[0] is row_ids and m[1] == version and version is not None \
                and m[2] is self.ids:
            return m[3], m[4]
        idx, found = P.match_rows(row_ids.long(), self.ids)
        r = self.ids.shape[0]
        write, read = torch.where(found, idx, r)[:, None], torch.where(found, idx, r + 1)
        self._match = (row_ids, version, self.ids, write, read)
        return write, read

    def _columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        """0-dim long tensors: the discard column and the NONE column (made at ``grow``)."""
        c = self._cols
        if c is None or c[0] != self.width:
            dev = self.fp.device
            c = self._cols = (self.width, torch.full((), self.width, dtype=torch.long, device=dev),
                              torch.full((), self.width + 1, dtype=torch.long, device=dev))
        return c[1], c[2]

    def record(self, row_ids: torch.Tensor, fp: torch.Tensor, pos: torch.Tensor,
               written: torch.Tensor) -> None:
        """Record ``fp`` [B, q] at (``row_ids[b]``, ``pos[b, i]``) where ``written`` [B, q];
        the other entries go to the discard column. Positions must lie below ``width``
        (``grow``; an index past it raises)."""
        write, _ = self.rows(row_ids)
        cols = torch.where(written, pos, self._columns()[0])
        self.fp.index_put_((write, cols), fp)  # (write [B, 1] broadcasts over cols [B, q])

    def mismatches(self, row_ids, fp, pos, valid) -> torch.Tensor:
        """[B, C] bool: valid slots whose fingerprint differs from a record (a position
        with no record, or a request the table lacks, is not judged)."""
        _, read = self.rows(row_ids)
        got = self.fp.index_select(0, read).gather(1, torch.where(valid, pos, self._columns()[1]))
        return (got != fp) & (got != NONE)


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

    def __init__(self, capacity: int, *, provenance: bool = True, lag: bool = True,
                 defer: bool = False):
        self.capacity = capacity
        self.check_provenance, self.check_lag = provenance, lag
        self.tables: dict = {}  # "target" | "draft" -> Table
        #: forwards recorded, and views whose old slots were checked, per cache (host counts)
        self.recorded = {"target": 0, "draft": 0}
        self.checked = {"target": 0, "draft": 0}
        #: fast mode: the target cache's records and checks wait for ``settle`` (see
        #: "Fast mode" in the module docstring); False once a run passed MAX_DEFERRED
        self.defer = defer
        self._items: list = []  # the run's target-cache events, in order (_Admit, _Forward)
        self._forwards = 0
        self._replay = None  # (Table, items replayed, {id(item): [B, C] mismatches or None})

    def _table(self, name: str, view: StepView) -> Table:
        t = self.tables.get(name)
        if t is None:
            t = self.tables[name] = Table(view.device)
        t.grow(view.width + view.k + 1)  # every position a forward of this step can write
        return t

    def __call__(self, view: StepView) -> Entry | None:
        lag = self.check_lag and self._lag_broken(view)
        bad, waiting = None, None
        if self.check_provenance:
            try:
                bad, waiting = self._provenance(view)
            except (RuntimeError, IndexError, ValueError, AttributeError, TypeError):
                bad, waiting = None, None  # a cache of the wrong shape: I1 says why
        if not lag and bad is None and waiting is None:
            return None
        masks = []
        rows = None
        if bad is not None:
            rows = bad[0][1].any(dim=1)
            for _, more in bad[1:]:
                rows = rows | more.any(dim=1)
        if waiting is not None:  # filled by ``settle``, before the read
            waiting.rows, waiting.index = rows, len(masks)
            masks.append(None)
        elif rows is not None:
            masks.append(rows)
        entry = Entry(masks, bool(lag), {"view": view, "provenance": bad or [], "lag": lag})
        if waiting is not None:
            waiting.entry = entry
            entry.context["deferred"] = (self, waiting)
        return entry

    # -- the lag ------------------------------------------------------------------------
    @staticmethod
    def _lag_broken(view: StepView) -> bool:
        dws, tws = view.draft_cache_widths, view.cache_widths
        return bool(dws) and bool(tws) and view.phase in LAG_PHASES \
            and any(d != tws[0] for d in dws)

    # -- records and checks ---------------------------------------------------------------
    def _provenance(self, view: StepView):
        """Check the slots a phase's forward found in a cache, then record what it wrote:
        (``[(cache name, [B, C] bool mismatches)]`` or None, the target forward whose
        check waits (fast mode) or None)."""
        phase = view.phase
        target, draft = view.cache_tensors, view.draft_cache_tensors
        bad, waiting = [], None
        if phase == "prefill":
            for name, get in (("target", target), ("draft", draft)):
                if get is not None:
                    if name == "target" and self.defer:
                        self._items.append(_Admit(view))
                    else:
                        self._table(name, view).admit(view.row_ids, self.capacity)
        f = view.forward
        if phase in ("prefill", "verify") and target is not None and f is not None:
            first, q = f.cache_width, f.input_ids.shape[1]
            kv = cache_ends(target, 0, first + q)
            if kv is not None and kv[0].shape[2] == first + q and q > 0:
                fp = fingerprint(*kv)  # [B, first + q]: what the forward found, what it wrote
                if self.defer:  # only the fingerprint now: the cache changes in place
                    waiting = _Forward(view, fp, first, q)
                    self._items.append(waiting)
                    self._forwards += 1
                    self.checked["target"] += bool(first)
                else:
                    b = _forward(self._table("target", view), view, fp, first, q)
                    if first:
                        self.checked["target"] += 1
                        bad.append(("target", b))
                self.recorded["target"] += 1
        if phase in ("prefill", "draft") and draft is not None:
            first = 0 if phase == "prefill" else view.width - 1
            kv = cache_ends(draft, 0)
            c = kv[0].shape[2] if kv is not None else 0
            if c > first:
                table = self._table("draft", view)
                fp = fingerprint(*kv)
                if first:
                    bad.append(("draft", self._check("draft", table, view, fp[:, :first])))
                pos, valid = slot_layout(view, c)
                table.record(view.row_ids, fp[:, first:], pos[:, first:], valid[:, first:])
                self.recorded["draft"] += 1
        if waiting is not None and self._forwards >= MAX_DEFERRED:
            self._stop_deferring()
        return bad or None, waiting

    def _check(self, name: str, table: Table, view: StepView, fp: torch.Tensor) -> torch.Tensor:
        """[B, C] bool: the slots of ``fp`` (a cache's first ``C <= W - 1`` slots, as the
        last realignment left them) whose fingerprint differs from the record of the
        position the view says they hold."""
        pos, valid = slot_layout(view, fp.shape[1])
        self.checked[name] += 1
        return table.mismatches(view.row_ids, fp, pos, valid)

    # -- fast mode: the target cache's records and checks, once per run --------------------
    def settle(self) -> None:
        """Fill the mask of every target forward still waiting (fast mode, before the
        read): the rows ``detect`` flags, or'ed with the hook's draft-cache rows."""
        waiting = [it for it in self._items
                   if type(it) is _Forward and it.entry.masks[it.index] is None]
        if not waiting:
            return
        flags = detect([it for it in self._items if type(it) is _Forward])
        for it in waiting:
            m = flags[id(it)]
            it.entry.masks[it.index] = m if it.rows is None else m | it.rows

    def exact(self, item) -> torch.Tensor | None:
        """[B, C] bool mismatches of a waiting target forward (None: nothing checked), as
        the hook would have found them: the run's events replayed in order into a fresh
        table, up to ``item`` (on a flagged row only: host side of a report)."""
        if self._replay is None:
            self._replay = (Table(item.view.device), 0, {})
        table, done, found = self._replay
        for it in self._items[done:]:
            if type(it) is _Admit:
                table.grow(it.view.width + it.view.k + 1)
                table.admit(it.view.row_ids, self.capacity)
            else:
                table.grow(it.view.width + it.view.k + 1)
                try:
                    found[id(it)] = _forward(table, it.shown(), it.fp, it.first, it.q)
                except (RuntimeError, IndexError, ValueError, AttributeError, TypeError):
                    found[id(it)] = None  # the hook's exception: nothing checked
            done += 1
            if it is item:
                break
        self._replay = (table, done, found)
        return found.get(id(item))

    def _stop_deferring(self) -> None:
        """A run past ``MAX_DEFERRED`` target forwards: replay its events into the table
        (which the hooks use from now on) and check in the hooks again, so the memory a
        run keeps stays bounded."""
        if self._items:
            self.exact(self._items[-1])
            self.tables["target"] = self._replay[0]
        self.defer = False


def _forward(table: Table, view: StepView, fp: torch.Tensor, first: int, q: int):
    """A target forward: check the ``first`` slots it found (``[B, first]`` mismatches, or
    None when ``first`` is 0), then record the ``q`` slots it wrote."""
    table.grow(view.width + view.k + 1)
    f = view.forward
    bad = None
    if first:
        pos, valid = slot_layout(view, first)
        bad = table.mismatches(view.row_ids, fp[:, :first], pos, valid)
    pos = f.positions if f.positions.shape[0] == view.batch_size \
        else f.positions.expand(view.batch_size, q)
    table.record(view.row_ids, fp[:, first:], pos, f.attention_mask[:, first:].bool())
    return bad


class _Admit:
    """A prefill that started fresh records for its rows (fast mode: replayed on a flag)."""

    __slots__ = ("view",)

    def __init__(self, view):
        self.view = view


class _Forward:
    """A target forward whose records and checks wait (fast mode): the fingerprints
    ``fp`` [B, first + q] and a copy of what the check reads (the engine may write its
    view's tensors in place after the hook; the copy is what the view showed), one
    ``cat``: ``copy`` [B, W + W + q + (first + q) + 2] long, the view's positions and
    valid, the forward's positions and mask, the row lengths and the request ids."""

    __slots__ = ("view", "fp", "first", "q", "copy", "widths", "entry", "index", "rows")

    def __init__(self, view: StepView, fp: torch.Tensor, first: int, q: int):
        self.view, self.fp, self.first, self.q = view, fp, first, q
        f = view.forward
        b = fp.shape[0]
        fpos = f.positions if f.positions.shape[0] == b else f.positions.expand(b, q)
        parts = (view.positions, view.valid, fpos, f.attention_mask)
        self.widths = tuple(t.shape[1] for t in parts)
        # (lengths are read only for slots past W - 1: a malformed one, which I1 reports,
        # must not stop the check)
        n = view.lengths if view.lengths.shape == (b,) else fp.new_zeros(b)
        self.copy = torch.cat(parts + (n[:, None], view.row_ids[:, None]), 1)
        self.entry = self.index = self.rows = None

    def parts(self) -> tuple:
        """(positions [B, W], valid [B, W], forward positions [B, q], forward mask
        [B, C + q], lengths [B], request ids [B]) as the hook saw them (views of
        ``copy``)."""
        c, out, at = self.copy, [], 0
        for w in self.widths:
            out.append(c[:, at : at + w])
            at += w
        return (*out, c[:, at], c[:, at + 1])

    def shown(self):
        """The view as the hook saw it, for ``_forward``: the view's host facts, its
        tensors from ``copy``."""
        pos, valid, fpos, mask, lengths, rid = self.parts()
        v = self.view
        forward = _Shown(positions=fpos, attention_mask=mask != 0)
        return _Shown(positions=pos, valid=valid != 0, lengths=lengths, row_ids=rid,
                      forward=forward, width=v.width, k=v.k, batch_size=v.batch_size,
                      device=v.device)

    def fits(self) -> bool:
        """The layout ``detect`` reads: ``first`` old slots within the view's slots, a
        mask of ``first + q`` columns (else ``exact`` judges every row)."""
        wp, wv, wq, wm = self.widths
        return self.first <= min(wp, wv) - 1 and wm == self.first + self.q and wq == self.q \
            and self.fp.shape[1] == self.first + self.q


class _Shown:
    """Attributes given by name (a view as a hook saw it)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


#: ``detect``'s keys: (request id << 42) | (position << 21) | (2 * forward + 1 if a record
#: else 2 * forward), each part below 2**21 (else every row is flagged for ``exact``)
BITS = 21
#: a record not written (sorted past every key)
UNWRITTEN = torch.iinfo(torch.int64).max


def detect(forwards: list) -> dict:
    """{id(forward): [B] bool}: rows of each target forward (a ``_Forward``, in run
    order) with a valid slot whose fingerprint differs from the latest earlier record of
    (its request, its position), every forward at once: the records' keys (request,
    position, time) sorted once, and one binary search per checked slot for the latest
    record before it. Where each slot's fields sit in the forwards' copies is laid out
    on the host and uploaded, one small index tensor per kind (this runs at ``check()``,
    outside the hooks), so that no op runs per forward, but for a forward over fewer
    rows than the most, whose copies get zero rows (two ops).

    It flags every row the table of the hooks flags (``exact``): that table holds the
    same latest records, less those of requests it forgot (capacity) or started afresh
    (a new prefill), and judges no position without a record. A row flagged here that
    the table would not flag is reported by no one (``describe`` reads ``exact``). A
    position outside what the table holds (negative, or past ``W + k`` of its forward,
    where the table's own indexing would wrap or raise), a request id or a run past the
    keys flags every row of every forward, for ``exact`` to judge; so do two writes of
    one (request, position) by one forward (which the table keeps is not defined), and
    a forward of a shape it does not expect."""
    out = {}
    # every forward in one block of the most rows: a forward over fewer rows (its batch
    # lost rows as they finished) gets zero rows, which flag, check and record nothing
    # (their valid and mask columns are 0); its flags are its own rows'
    b = max(f.fp.shape[0] for f in forwards)
    anywhere = []
    qparts, rparts = [], []
    fits = [(n, it) for n, it in enumerate(forwards) if it.fits()]
    # host-side layout, per forward and kind (its checked slots, its written slots):
    # how many, where their positions, flags (valid, or the mask) and fingerprints
    # start in the copies and fingerprints side by side, where its request id sits,
    # its time (2 x forward, + 1 for the writes) and the least position the table
    # cannot hold (``W + k + 1``: the table's own width is at least that)
    layout = ([], [])
    at_copy = at_fp = 0
    for index, it in fits:
        c, q = it.first, it.q
        wp, wv, wq, wm = it.widths
        limit = it.view.width + it.view.k + 1
        rid = at_copy + wp + wv + wq + wm + 1
        layout[0].append((c, at_copy, at_copy + wp, rid, at_fp, 2 * index, limit))
        layout[1].append((q, at_copy + wp + wv, at_copy + wp + wv + wq + c, rid, at_fp + c,
                          2 * index + 1, limit))
        at_copy += wp + wv + wq + wm + 2
        at_fp += c + q
    if fits:
        copy = torch.cat([_rows(it.copy, b) for _, it in fits], 1)
        fp = torch.cat([_rows(it.fp, b) for _, it in fits], 1)
        dev = fp.device
        for rows, into in zip(layout, (qparts, rparts)):
            desc = torch.tensor(rows, dtype=torch.long, device=dev)  # [forwards, 7]
            total = sum(r[0] for r in rows)
            item = torch.repeat_interleave(torch.arange(len(rows), device=dev), desc[:, 0],
                                           output_size=total)
            first = desc[:, 0].cumsum(0) - desc[:, 0]
            local = torch.arange(total, device=dev) - first[item]
            cols = desc.index_select(0, item)  # [slots, 7]
            pos = copy.index_select(1, cols[:, 1] + local).long()
            flag = copy.index_select(1, cols[:, 2] + local) != 0
            rid = copy.index_select(1, cols[:, 3]).long()
            # what the table (or the keys) cannot hold: ``exact`` judges every row
            anywhere.append((flag & ((pos < 0) | (pos >= cols[:, 6]) | (rid < 0)
                                     | (rid >= 1 << BITS))).any())
            key = (rid << 2 * BITS) | (pos << BITS) | cols[:, 5]
            into.append((key, fp.index_select(1, cols[:, 4] + local), flag, item, fits, b))
    anywhere = torch.stack(anywhere).any() if anywhere else None
    if max(f.view.width + f.view.k + 1 for f in forwards) >= 1 << BITS \
            or 2 * len(forwards) + 2 >= 1 << BITS:  # positions or times past the keys
        anywhere = torch.ones((), dtype=torch.bool, device=forwards[0].fp.device)
    if rparts:
        rkey = torch.cat([torch.where(flag, key, UNWRITTEN).reshape(-1)
                          for key, _, flag, *_ in rparts])
        rfp = torch.cat([fp.reshape(-1) for _, fp, *_ in rparts])
        rsorted, order = torch.sort(rkey)
        rfp = rfp[order]
        # one forward writing one (request, position) twice: which write the table
        # keeps is not defined
        anywhere = anywhere | ((rsorted[1:] == rsorted[:-1]) & (rsorted[1:] != UNWRITTEN)).any()
    for key, fp, flag, item, fits, b in qparts:
        if rparts and key.shape[1]:
            at = torch.searchsorted(rsorted, key) - 1  # the latest record before the check
            found = at.clamp(min=0)
            bad = flag & (at >= 0) & ((rsorted[found] >> BITS) == (key >> BITS)) \
                & (rfp[found] != fp)
            rows = torch.zeros(b, len(fits), dtype=torch.long, device=fp.device) \
                .index_add_(1, item, bad.long()) != 0
        else:
            rows = torch.zeros(b, len(fits), dtype=torch.bool, device=fp.device)
        if anywhere is not None:
            rows = rows | anywhere
        for (_, it), r in zip(fits, rows.unbind(1)):
            out[id(it)] = r if it.fp.shape[0] == b else r[: it.fp.shape[0]]
    for it in forwards:
        if id(it) not in out:  # a layout ``detect`` does not read: ``exact`` judges
            out[id(it)] = torch.ones(it.fp.shape[0], dtype=torch.bool, device=it.fp.device)
    return out


def _rows(t: torch.Tensor, b: int) -> torch.Tensor:
    """``t`` [B', X] with zero rows appended up to ``b`` (``detect``'s block)."""
    return t if t.shape[0] == b else torch.cat([t, t.new_zeros(b - t.shape[0], t.shape[1])])


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
    found = ctx["provenance"]
    if "deferred" in ctx:  # fast mode: the hook's own check, replayed (see ``exact``)
        kv, item = ctx["deferred"]
        target = kv.exact(item)
        found = ([("target", target)] if target is not None else []) + list(found)
    ids = view.row_ids.tolist()
    for name, bad in found:
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
