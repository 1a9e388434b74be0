"""The rules of I1-I6 as records: what the Monitor, the per-invariant API and the trace
renderer dispatch on.

A ``Rule`` carries its ``id``, its ``invariant``, its ``sentence`` (a template filled
with the view's host facts, ``text(view)``), the view fields it ``reads``, and either

- ``mask(facts) -> [B] bool`` (a device rule: True on the rows that break it; None when
  it does not apply to this view), or
- ``host(view) -> bool`` (a host-fact rule: shapes and cache widths; broken or not, no
  kernel),

plus ``slots(facts) -> [B, X] bool`` (the offending slots a trace shows) and ``columns``,
what those slots index: ``"slots"`` (the view's slots), ``"forward"`` (columns of the
recorded forward's mask) or ``"output"`` (output indices).

Rules that read the same tensors form a ``Group``. A group also has ``fused(facts)``:
one tensor expression equal to the OR of its device rules' masks, row by row (tested on
adversarial views in ``tests/test_invariants_rules.py``). The Monitor evaluates the fused
expression on the hot path and, only when it flags a row, re-evaluates the rules one by
one to name them. ``reads`` is what the Monitor compares between phases: a group whose
inputs are the very tensors (same ``_version``) it checked last time is not run again.

Groups that always run together at one phase form a ``Fusion``: one expression for all of
their rules, written on explicit tensors (``commit_flags``, ``forward_flags``,
``realign_flags``) and row-wise, so that fast mode can keep a view's inputs by
reference (``Fusion.refer``, ``Refs``; or copy them, ``Fusion.defer``, once an engine
writes its views in place) and check the views of one kind together at the read
(``Fusion.batch_refs``, ``Fusion.batch``). The expressions are written for few, cheap kernels on a CPU too:
reductions by ``sum``, stacks of dense inputs of one dtype.

``Facts`` holds one view, the monitor's state (stop ids, output snapshot, prompts) and
the intermediate tensors several rules share (computed once per view, on demand).
Nothing here reads a tensor's values on the host, uploads host data or produces a
data-dependent shape.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import predicates as P
from . import window as W
from .view import StepView

#: what a rule's slots index (the trace renderer's grid dispatches on it)
COLUMNS = ("slots", "forward", "output")


@dataclass(frozen=True)
class Rule:
    # stable identifier, "I6.commit.predictions"
    id: str
    # "I1" .. "I7"
    invariant: str
    # what must hold; "{name}" fields are filled by ``words(view)``
    sentence: str
    # the view fields (and monitor state: "prev", "prompts", "stops") it reads
    reads: tuple
    # device rule: facts -> [B] bool, True on rows that break it (None: not applicable)
    mask: Callable | None = None
    # host rule: view -> True when broken
    host: Callable | None = None
    # facts -> [B, X] bool offending slots (None: no slots)
    slots: Callable | None = None
    # what the slots index: one of COLUMNS, or None
    columns: str | None = None
    # among a violation's failing rules, the one with the highest priority picks the slots
    slot_priority: int = 0
    # the grid lines a trace draws for it: "valid", "pos", "want", "token" over the view's
    # slots; "mask", "valid", "pos", "want" over the forward's mask columns
    lines: tuple = ("valid", "pos")
    # view -> whether the rule applies at all (host condition)
    applies: Callable = field(default=lambda view: True)
    # (view, row) -> {line name: cells over the forward's mask columns}: extra grid lines
    # a trace draws for this rule (host side, only on a violation); None: none
    grid: Callable | None = None

    def text(self, view: StepView | None = None, **extra) -> str:
        """The sentence filled with the view's host facts (``words``) and ``extra``."""
        if "{" not in self.sentence:
            return self.sentence
        return self.sentence.format(**({} if view is None else words(view)), **extra)


@dataclass(frozen=True)
class Group:
    # "I6.state"
    name: str
    invariant: str
    rules: tuple
    # names resolved by ``Facts.dep`` to compare between phases; None: always run
    reads: tuple | None
    # view -> whether the group runs at this phase/profile (host condition)
    applies: Callable = field(default=lambda view: True)
    # facts -> [B] bool, the OR of the device rules (None when none applies)
    fused: Callable | None = None
    # view -> True when no host rule can be broken (a quick test; None: test each rule)
    host_ok: Callable | None = None

    @property
    def host_rules(self) -> tuple:
        return tuple(r for r in self.rules if r.host is not None)

    @property
    def device_rules(self) -> tuple:
        return tuple(r for r in self.rules if r.mask is not None)


def words(view: StepView) -> dict:
    """The host facts rule sentences are filled with."""
    b, w, k = view.batch_size, view.width, view.k
    f = view.forward
    return {
        "B": b, "W": w, "k": k, "k1": k + 1, "phase": view.phase,
        "want": view.expected_cache_width(),
        "which": "W + k" if view.phase in ("verify", "commit") else "W - 1",
        "dw": w - 1 + view.draft_cache_lag,
        "c": f.cache_width if f is not None else 0,
        "q": f.input_ids.shape[-1] if f is not None else 0,
        "window": f.window if f is not None else None,
    }


# ---------------------------------------------------------------------------------------
# Facts: one view, the monitor's state, shared intermediates
# ---------------------------------------------------------------------------------------

class cached_property:  # noqa: N801 - the functools name, without its lock
    """A computed attribute stored on the instance at its first read (functools'
    ``cached_property`` takes a lock on every first read in Python 3.11: a cost per hook)."""

    def __init__(self, func):
        self.func = func
        self.__doc__ = func.__doc__

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.func(obj)
        return value


class Constants:
    """Device constants reused across views (``arange`` rows, ``ones``): built once per
    size and device by fill kernels, never uploaded."""

    def __init__(self):
        self._cache: dict = {}

    def row(self, n: int, device) -> torch.Tensor:
        """[1, n] long: 0 .. n-1."""
        key = ("row", n, device)
        t = self._cache.get(key)
        if t is None:
            t = self._cache[key] = torch.arange(n, device=device)[None, :]
        return t

    def count(self, value: int, b: int, device) -> torch.Tensor:
        """[b] long, all ``value``."""
        key = ("count", value, b, device)
        t = self._cache.get(key)
        if t is None:
            t = self._cache[key] = torch.full((b,), value, dtype=torch.long, device=device)
        return t

    def scalar(self, value: int, device) -> torch.Tensor:
        """[] long, ``value`` (a 0-dim operand: cheaper per op than a Python number)."""
        key = ("scalar", value, device)
        t = self._cache.get(key)
        if t is None:
            t = self._cache[key] = torch.full((), value, dtype=torch.long, device=device)
        return t

    def zeros(self, b: int, device) -> torch.Tensor:
        """[b] bool, all False."""
        key = ("zeros", b, device)
        t = self._cache.get(key)
        if t is None:
            t = self._cache[key] = torch.zeros(b, dtype=torch.bool, device=device)
        return t

    def ones(self, b: int, n: int, device) -> torch.Tensor:
        """[b, n] bool, all True."""
        key = ("ones", b, n, device)
        t = self._cache.get(key)
        if t is None:
            t = self._cache[key] = torch.ones(b, n, dtype=torch.bool, device=device)
        return t


class Facts:
    """A view with the monitor's state, and the tensors several rules share."""

    def __init__(self, view: StepView, *, stops=None, prev: P.Snapshot | None = None,
                 prompts: P.Prompts | None = None, consts: Constants | None = None,
                 lookups: dict | None = None, device: torch.device | None = None):
        self.view = view
        self.stops = P.stop_ids(view, stops)
        self.prev = prev
        self.prompts = prompts
        self.consts = consts if consts is not None else Constants()
        self._lookups = lookups if lookups is not None else {}
        self.B = view.batch_size
        self.device = view.device if device is None else device  # the view's

    def dep(self, name: str):
        """What ``reads`` names: a view field, or monitor state."""
        if name == "prev":
            return self.prev
        if name == "prompts":
            return self.prompts
        if name == "stops":
            return self.stops
        if name == "is_commit":
            return self.view.phase == "commit"
        if name == "is_prefill":
            return self.view.phase == "prefill"
        return getattr(self.view, name)

    # -- slots --------------------------------------------------------------------------
    @cached_property
    def valid(self) -> torch.Tensor:  # [B, W] bool
        v = self.view.valid
        return v if v.dtype == torch.bool else v.bool()

    @cached_property
    def counted(self) -> torch.Tensor:  # [B, W] long: valid slots up to and including j
        return self.valid.cumsum(dim=1)

    @cached_property
    def rank(self) -> torch.Tensor:
        """[B, W] long: valid slots before j, exact at valid slots (the only ones read)."""
        return self.counted - 1

    # -- output -------------------------------------------------------------------------
    @cached_property
    def stop_out(self) -> torch.Tensor:  # [B, T] bool
        return P.stop_mask(self.view.output, self.stops)

    @cached_property
    def last_index(self) -> torch.Tensor:  # [B, 1] long: the last output's index, clamped
        t = self.view.output.shape[1]
        return (self.view.generated - 1).clamp(0, max(t - 1, 0))[:, None]

    @cached_property
    def last_stop(self) -> torch.Tensor:  # [B] bool: the last output is a stop token
        g, t = self.view.generated, self.view.output.shape[1]
        if not t:
            return torch.zeros_like(g, dtype=torch.bool)
        return self.stop_out.gather(1, self.last_index)[:, 0] & (g > 0)

    @cached_property
    def after_stop(self) -> torch.Tensor:  # [B, T] bool: a stop token before the last output
        t = self.view.output.shape[1]
        return self.stop_out & (self.consts.row(t, self.device) < (self.view.generated - 1)[:, None])

    @cached_property
    def at_budget(self) -> torch.Tensor:  # [B] bool
        return self.view.generated >= self.view.budgets

    @cached_property
    def finished(self) -> torch.Tensor:  # [B] bool
        f = self.view.finished
        return f if f.dtype == torch.bool else f.bool()

    # -- earlier state, by request id -----------------------------------------------------
    def _rows_of(self, table_state):
        """(rows [B, X] of ``table_state.table`` for the view's requests, found [B] bool or
        None when every row is known): the newest block directly when the view holds the
        very rows it came from, else a search by request id (cached per row-id tensor)."""
        v = self.view
        if table_state.newest == self.B and P.same_rows(table_state.source, v.row_ids):
            t = table_state.table
            return (t if t.shape[0] == self.B else t[: self.B]), None
        key = (id(v.row_ids), id(table_state))
        hit = self._lookups.get(key)
        if hit is not None and hit[0] is v.row_ids and hit[1] is table_state \
                and P.same_rows(hit[2], v.row_ids):
            return hit[3]
        idx, found = P.match_rows(v.row_ids, table_state.row_ids)
        out = (table_state.table.index_select(0, idx), found)
        self._lookups[key] = (v.row_ids, table_state, P._source(v.row_ids), out)
        return out

    @cached_property
    def prev_rows(self):
        """(generated [B], finished [B] bool, output [B, T'], found [B] bool | None) of the
        previous snapshot, for the view's rows."""
        rows, found = self._rows_of(self.prev)
        return rows[:, 1], rows[:, 2] != 0, rows[:, 3:], found

    @cached_property
    def prompt_rows(self):
        """(prompt lengths [B], prompt tokens [B, P], found [B] bool | None)."""
        rows, found = self._rows_of(self.prompts)
        return rows[:, 1], rows[:, 2:], found

    @cached_property
    def active_before(self) -> torch.Tensor:
        """[B] bool: rows not finished at the previous snapshot (unknown rows count active)."""
        if self.prev is None:
            return self.consts.ones(1, self.B, self.device)[0]
        _, pfin, _, found = self.prev_rows
        return ~pfin if found is None else ~(pfin & found)

    # -- the recorded forward -------------------------------------------------------------
    @cached_property
    def fmask(self) -> torch.Tensor:  # [B, C + q] bool
        m = self.view.forward.attention_mask
        return m if m.dtype == torch.bool else m.bool()

    @cached_property
    def extended(self):
        """(tokens, valid) [B, W + k] at verify/commit (drafts appended, valid), else the
        view's own."""
        v = self.view
        if v.drafts is not None and v.phase in ("verify", "commit"):
            return torch.cat([v.tokens, v.drafts], dim=1), self.extended_valid
        return v.tokens, self.valid

    @cached_property
    def extended_valid(self) -> torch.Tensor:
        """[B, W + k] bool: ``extended``'s valid alone (without its tokens' copy)."""
        v = self.view
        if v.drafts is not None and v.phase in ("verify", "commit"):
            return torch.cat([self.valid, self.consts.ones(*v.drafts.shape, self.device)], dim=1)
        return self.valid


def _found(mask: torch.Tensor, found: torch.Tensor | None) -> torch.Tensor:
    return mask if found is None else mask & found


# ---------------------------------------------------------------------------------------
# I1 rectangular alignment (host facts)
# ---------------------------------------------------------------------------------------

_PER_ROW = ("lengths", "prompt_lengths", "budgets", "generated", "finished", "row_ids")

I1_RULES = (
    Rule("I1.token_shapes", "I1", "tokens, valid and positions are [B, W]",
         ("tokens", "valid", "positions"),
         host=lambda v: not (tuple(v.valid.shape) == (v.batch_size, v.width)
                             and tuple(v.positions.shape) == (v.batch_size, v.width))),
    Rule("I1.row_shapes", "I1",
         "lengths, prompt_lengths, budgets, generated, finished, row_ids are [B]",
         _PER_ROW + ("output",),
         host=lambda v: any(tuple(getattr(v, n).shape) != (v.batch_size,) for n in _PER_ROW)
         or v.output.dim() != 2 or v.output.shape[0] != v.batch_size),
    Rule("I1.cache_width", "I1", "every target cache layer has width {want} ({phase}: {which})",
         ("cache_widths",),
         host=lambda v: len(v.cache_widths) == 0
         or any(c != v.expected_cache_width() for c in v.cache_widths)),
    Rule("I1.cache_batch", "I1", "every target cache layer has batch size B = {B}",
         ("cache_batch_sizes", "cache_widths"),
         host=lambda v: any(s != v.batch_size and not (s <= 0 and c == 0)
                            for s, c in zip(v.cache_batch_sizes, v.cache_widths))),
    Rule("I1.draft_cache_width", "I1",
         "every draft cache layer has width W - 1 + draft_cache_lag = {dw}",
         ("draft_cache_widths", "draft_cache_lag"),
         host=lambda v: any(c != v.width - 1 + v.draft_cache_lag for c in v.draft_cache_widths),
         applies=lambda v: bool(v.draft_cache_widths)),
    Rule("I1.drafts_shape", "I1", "drafts are [B, k] = [{B}, {k}]", ("drafts",),
         host=lambda v: tuple(v.drafts.shape) != (v.batch_size, v.k),
         applies=lambda v: v.drafts is not None),
    Rule("I1.predictions_shape", "I1", "predictions are [B, k+1] = [{B}, {k1}]",
         ("predictions",),
         host=lambda v: tuple(v.predictions.shape) != (v.batch_size, v.k + 1),
         applies=lambda v: v.predictions is not None),
    Rule("I1.forward_shapes", "I1", "forward input_ids and positions are [B, q]", ("forward",),
         host=lambda v: not (v.forward.input_ids.shape[0] == v.batch_size
                             and tuple(v.forward.positions.shape[-1:])
                             == (v.forward.input_ids.shape[-1],)
                             and v.forward.positions.shape[0] in (1, v.batch_size)),
         applies=lambda v: v.forward is not None),
)



def _all(seq, x) -> bool:
    """Every entry of ``seq`` equals ``x`` (a C-level count for tuples and lists)."""
    try:
        return seq.count(x) == len(seq)
    except (AttributeError, TypeError):
        return all(c == x for c in seq)


def _i1_ok(v: StepView) -> bool:
    """No I1 rule is broken (one pass over the host facts; the rules say which is)."""
    shape = v.tokens.shape
    if len(shape) != 2 or v.valid.shape != shape or v.positions.shape != shape:
        return False
    b, w = shape
    row = (b,)
    for t in (v.lengths, v.prompt_lengths, v.budgets, v.generated, v.finished, v.row_ids):
        if t.shape != row:
            return False
    if v.output.dim() != 2 or v.output.shape[0] != b:
        return False
    want = w + v.k if v.phase in ("verify", "commit") else w - 1  # expected_cache_width()
    widths = v.cache_widths
    if not widths or not _all(widths, want):
        return False
    sizes = v.cache_batch_sizes
    if not _all(sizes, b) and any(
            s != b and not (s <= 0 and c == 0) for s, c in zip(sizes, widths)):
        return False
    dws = v.draft_cache_widths
    if dws and not _all(dws, w - 1 + v.draft_cache_lag):
        return False
    if v.drafts is not None and v.drafts.shape != (b, v.k):
        return False
    if v.predictions is not None and v.predictions.shape != (b, v.k + 1):
        return False
    f = v.forward
    if f is not None:
        q = f.input_ids.shape[-1]
        if not (f.input_ids.shape[0] == b and f.positions.shape[-1:] == (q,)
                and f.positions.shape[0] in (1, b)):
            return False
    return True


# ---------------------------------------------------------------------------------------
# I2 layout
# ---------------------------------------------------------------------------------------

def _layout(f: Facts):
    return P.layout_slots(f.view)


R_N_RANGE = Rule("I2.n_range", "I2", "1 <= n[b] <= W", ("lengths",),
                 mask=lambda f: (f.view.lengths < 1) | (f.view.lengths > f.view.width),
                 slots=_layout, columns="slots")
R_CONTIGUOUS = Rule(
    "I2.contiguous", "I2", "valid[b] = 0^(W - n[b]) 1^(n[b]) (contiguous profile)",
    ("valid", "lengths"),
    mask=lambda f: P.contiguous_layout_slots(f.valid, f.view.lengths).any(dim=1),
    slots=_layout, columns="slots")
R_MINIMAL = Rule(
    "I2.minimal_width", "I2", "min over rows of the left padding W - n[b] is 0 (minimal width)",
    ("lengths",),
    mask=lambda f: ((f.view.width - f.view.lengths).min() != 0).expand(f.B),
    slots=_layout, columns="slots")
R_HOLES_COUNT = Rule("I2.holes_count", "I2", "n[b] = number of valid slots", ("valid", "lengths"),
                     mask=lambda f: f.valid.sum(dim=1) != f.view.lengths,
                     slots=_layout, columns="slots")
R_HOLES_PENDING = Rule(
    "I2.holes_pending", "I2",
    "the pending token of every active row sits in slot W - 1 (holes profile)",
    ("valid", "finished"),
    mask=lambda f: ~f.valid[:, -1] & ~f.finished, slots=_layout, columns="slots")
R_GROUPED = Rule(
    "I2.grouped", "I2", "no padding: every slot is valid and n[b] = W (grouped profile)",
    ("valid", "lengths"),
    mask=lambda f: (~f.valid).any(dim=1) | (f.view.lengths != f.view.width),
    slots=_layout, columns="slots")


def _fused_contiguous(f: Facts) -> torch.Tensor:
    v, n = f.view, f.view.lengths
    # n > W needs no term of its own: it makes max(n) != W, which flags every row
    lay = (f.valid != (f.consts.row(v.width, f.device) >= (v.width - n)[:, None])).any(dim=1)
    return lay | (n < 1) | (n.max() != v.width)


def _fused_holes(f: Facts) -> torch.Tensor:
    n = f.view.lengths
    # n > W cannot equal a count of at most W valid slots
    return (n < 1) | (f.valid.sum(dim=1) != n)


def _fused_holes_pending(f: Facts) -> torch.Tensor:
    return ~(f.valid[:, -1] | f.finished)


def _fused_grouped(f: Facts) -> torch.Tensor:
    n = f.view.lengths
    return ~f.valid.all(dim=1) | (n != f.view.width) | (n < 1)


# ---------------------------------------------------------------------------------------
# I3 position-id contiguity
# ---------------------------------------------------------------------------------------

R_POSITIONS = Rule(
    "I3.positions", "I3", "at every valid slot j, positions[b, j] = number of valid slots before j",
    ("valid", "positions"),
    mask=lambda f: P.position_slots(f.valid, f.view.positions).any(dim=1),
    slots=lambda f: P.position_slots(f.valid, f.view.positions), columns="slots",
    lines=("valid", "pos", "want"))


def _forward_rule_mask(f: Facts):
    fs = P.forward_slots(f.view)
    return None if fs is None else fs.any(dim=1)


def _forward_rule_slots(f: Facts):
    """[B, C + q] bool over the forward's mask columns (cache columns never offend)."""
    fs = P.forward_slots(f.view)
    if fs is None:
        return None
    c = f.view.forward.cache_width
    return torch.cat([torch.zeros(fs.shape[0], c, dtype=torch.bool, device=fs.device), fs], dim=1)


R_FORWARD_POSITIONS = Rule(
    "I3.forward_positions", "I3",
    "the forward's position of every new token = number of valid mask slots before it",
    ("forward", "draft_limit", "phase"),
    mask=_forward_rule_mask, slots=_forward_rule_slots, columns="forward",
    lines=("mask", "pos", "want"))


def _fused_positions(f: Facts) -> torch.Tensor:
    # counted - 1 is the number of valid slots before j at every valid slot
    return (f.valid & (f.view.positions + 1 != f.counted)).any(dim=1)


def _fused_forward_positions(f: Facts):
    v, fw = f.view, f.view.forward
    c, q = fw.cache_width, fw.input_ids.shape[-1]
    m = f.fmask
    if m.shape[-1] < c + q:
        return None
    counted = m.cumsum(dim=1)[:, c : c + q]
    bad = m[:, c : c + q] & (fw.positions + 1 != counted)
    if v.phase in ("verify", "commit") and v.draft_limit is not None:
        bad = bad & (f.consts.row(q, f.device) <= v.draft_limit[:, None])
    return bad.any(dim=1)


# ---------------------------------------------------------------------------------------
# I4 mask coherence (the recorded forward)
# ---------------------------------------------------------------------------------------

def _mask_slots(f: Facts):
    return P.mask_slots(f.view)


def _mask_part(f: Facts, cache: bool):
    ms = P.mask_slots(f.view)
    if ms is None:
        return None
    c = f.view.forward.cache_width
    return (ms[:, :c] if cache else ms[:, c:]).any(dim=1)


def _inputs_rule(f: Facts):
    fw = f.view.forward
    c, q = fw.cache_width, fw.input_ids.shape[-1]
    if P.mask_slots(f.view) is None:
        return None
    tokens, valid = f.extended
    if fw.input_ids.shape != tokens[:, c : c + q].shape:
        return None
    return ((fw.input_ids != tokens[:, c : c + q]) & valid[:, c : c + q]).any(dim=1)


def _mask_malformed(v: StepView) -> bool:
    fw = v.forward
    m = fw.attention_mask
    return m.dim() != 2 or m.shape[-1] != fw.cache_width + fw.input_ids.shape[-1] \
        or m.shape[0] != v.batch_size


I4_RULES = (
    Rule("I4.mask_shape", "I4", "the mask is 2-D of width cache width + new tokens = {c} + {q}",
         ("forward",), host=_mask_malformed, slots=_mask_slots, columns="forward",
         lines=("mask", "valid")),
    Rule("I4.forward_width", "I4",
         "cache width before the forward + new tokens = the phase's cache width {want}",
         ("forward",),
         host=lambda v: v.forward.cache_width + v.forward.input_ids.shape[-1]
         != v.expected_cache_width(), slots=_mask_slots, columns="forward",
         lines=("mask", "valid")),
    Rule("I4.mask_cache", "I4", "the mask over cache slots equals valid",
         ("forward", "valid", "drafts", "phase"),
         mask=lambda f: _mask_part(f, True), slots=_mask_slots, columns="forward",
         lines=("mask", "valid")),
    Rule("I4.mask_new", "I4",
         "the mask over new tokens equals their validity (pending and drafts valid)",
         ("forward", "valid", "drafts", "phase"),
         mask=lambda f: _mask_part(f, False), slots=_mask_slots, columns="forward",
         lines=("mask", "valid")),
    Rule("I4.inputs", "I4",
         "the forward's inputs are the row's tokens at the new slots (pending ++ drafts at verify)",
         ("forward", "tokens", "valid", "drafts", "phase"),
         mask=_inputs_rule, slots=_mask_slots, columns="forward",
         lines=("mask", "valid")),
)


def _fused_mask(f: Facts):
    v, fw = f.view, f.view.forward
    c, q = fw.cache_width, fw.input_ids.shape[-1]
    span = c + q
    tokens, valid = f.extended
    m = fw.attention_mask
    if m.dim() != 2 or m.shape[1] != span or span > valid.shape[1] or m.shape[0] != v.batch_size:
        return None
    bad = (f.fmask != valid[:, :span]).any(dim=1)
    if fw.input_ids.shape == tokens[:, c:span].shape:
        bad = bad | ((fw.input_ids != tokens[:, c:span]) & valid[:, c:span]).any(dim=1)
    return bad


# ---------------------------------------------------------------------------------------
# I4.window: a sliding window counts positions, not slots (the tensor math: window.py)
# ---------------------------------------------------------------------------------------

def _window_limit(v: StepView):
    return v.draft_limit if v.phase in ("verify", "commit") else None


def _window_mask(f: Facts):
    fw = f.view.forward
    if not W.checked(fw) or W.malformed(fw, f.B) or _mask_malformed(f.view):
        return None
    return W.flags(fw, _window_limit(f.view))


def _window_slots(f: Facts):
    fw = f.view.forward
    if not W.checked(fw) or W.malformed(fw, f.B) or _mask_malformed(f.view):
        return None
    return W.key_slots(fw, _window_limit(f.view))


I4_WINDOW_RULES = (
    Rule("I4.window_shape", "I4",
         "the mask given to the model stands for every row: 4-D [B or 1, H or 1, q, C + q] = "
         "[{B} or 1, H or 1, {q}, {c} + {q}] (or a dict of such masks per layer type)",
         ("forward",), host=lambda v: W.malformed(v.forward, v.batch_size),
         applies=lambda v: v.forward is not None and W.checked(v.forward),
         slots=_mask_slots, columns="forward", lines=("mask", "valid")),
    Rule("I4.window", "I4",
         "each query at position p attends exactly the valid keys at positions "
         "p - {window} + 1 .. p (a sliding window of {window} counts positions, not slots; "
         "a full-attention layer: every valid key up to p)",
         ("forward", "draft_limit", "phase"), mask=_window_mask, slots=_window_slots,
         columns="forward", lines=("mask",), slot_priority=1,
         grid=lambda v, b: W.grid_lines(v.forward, b, _window_limit(v))),
)

# ---------------------------------------------------------------------------------------
# I6 token conservation
# ---------------------------------------------------------------------------------------

def _output_slots(f: Facts):
    return f.after_stop


_TOKEN_LINES = ("valid", "pos", "token")


def _i6(id_: str, sentence: str, reads: tuple, mask) -> Rule:
    """An I6 rule whose offending slots are output indices (stop tokens before the end)."""
    return Rule(id_, "I6", sentence, reads, mask=mask, slots=_output_slots, columns="output",
                lines=_TOKEN_LINES)


_STATE = ("output", "generated", "budgets", "finished", "stops")

I6_STATE_RULES = (
    _i6("I6.generated_range", "0 <= generated[b] <= budget[b]", ("generated", "budgets"),
        lambda f: (f.view.generated < 0) | (f.view.generated > f.view.budgets)),
    _i6("I6.output_width", "generated[b] <= output width", ("generated", "output"),
        lambda f: f.view.generated > f.view.output.shape[1]),
    _i6("I6.after_stop", "nothing after the first stop token", ("output", "generated", "stops"),
        lambda f: f.after_stop.any(dim=1)),
    _i6("I6.stop_finishes", "a row whose output ends in a stop token is finished", _STATE,
        lambda f: f.last_stop & ~f.finished),
    _i6("I6.budget_finishes", "a row at its budget is finished", _STATE,
        lambda f: f.at_budget & ~f.finished),
    _i6("I6.finished_why", "a finished row ended on a stop token or its budget", _STATE,
        lambda f: f.finished & ~(f.last_stop | f.at_budget)),
)


def _fused_state(f: Facts) -> torch.Tensor:
    v = f.view
    g = v.generated
    t = v.output.shape[1]
    # the three finishing rules together: finished exactly when it ends on a stop or budget
    return (g < 0) | (g > v.budgets.clamp(max=t)) | f.after_stop.any(dim=1) \
        | (f.finished != (f.last_stop | f.at_budget))


def _retro(f: Facts):
    v = f.view
    pg, _, pout, found = f.prev_rows
    tt = min(v.output.shape[1], pout.shape[1])
    if not tt:
        return None
    changed = (v.output[:, :tt] != pout[:, :tt]) & (f.consts.row(tt, f.device) < pg[:, None])
    return _found(changed.any(dim=1), found)


def _generated_before_rule(f: Facts):
    v = f.view
    if not (v.phase == "commit" and v.generated_before is not None):
        return None
    pg, _, _, found = f.prev_rows
    return _found(v.generated_before != pg, found)


def _generated_only_at_commit(f: Facts):
    v = f.view
    if v.phase == "commit" and v.generated_before is not None:
        return None
    pg, _, _, found = f.prev_rows
    return _found(v.generated != pg, found)


_HISTORY = ("output", "generated", "generated_before", "row_ids", "prev", "is_commit")

I6_HISTORY_RULES = (
    _i6("I6.retroactive", "output never changes retroactively", _HISTORY, _retro),
    _i6("I6.generated_before", "generated_before = generated after the previous step",
        _HISTORY, _generated_before_rule),
    _i6("I6.generated_at_commit", "generated changes only at commit", _HISTORY,
        _generated_only_at_commit),
)


def _fused_history(f: Facts):
    v = f.view
    pg, _, pout, found = f.prev_rows
    if v.phase == "commit" and v.generated_before is not None:
        bad = v.generated_before != pg
    else:
        bad = v.generated != pg
    tt = min(v.output.shape[1], pout.shape[1])
    if tt:
        changed = (v.output[:, :tt] != pout[:, :tt]) & (f.consts.row(tt, f.device) < pg[:, None])
        bad = bad | changed.any(dim=1)
    return _found(bad, found)


def _before(f: Facts) -> torch.Tensor:
    v = f.view
    return v.generated_before if v.generated_before is not None else v.generated - v.committed


def _committed_tokens(f: Facts):
    v = f.view
    t = v.output.shape[1]
    if v.predictions is None or not t:
        return None
    i = f.consts.row(v.k + 1, f.device)
    wrote = v.output.gather(1, (_before(f)[:, None] + i).clamp(0, t - 1))
    return ((wrote != v.predictions) & (i < v.committed[:, None])).any(dim=1)


def _accepted_rule(f: Facts):
    v = f.view
    if v.accepted is None:
        return None
    a, m = v.accepted, v.committed
    cut = f.last_stop | f.at_budget
    return f.active_before & ((m > a + 1) | ((m < a + 1) & ~cut))


def _same(f: Facts) -> torch.Tensor:
    return f.view.drafts == f.view.predictions[:, : f.view.k]


def _has_drafts(v: StepView) -> bool:
    return v.accepted is not None and v.drafts is not None and v.predictions is not None and v.k > 0


def _drafts_equal(f: Facts):
    v = f.view
    if not _has_drafts(v):
        return None
    j = f.consts.row(v.k, f.device)
    return ((~_same(f)) & (j < v.accepted[:, None])).any(dim=1)


def _accepted_range(f: Facts):
    v = f.view
    if _has_drafts(v) and v.draft_limit is not None:
        return (v.accepted < 0) | (v.accepted > v.draft_limit)
    if v.accepted is not None and v.k == 0 and not _has_drafts(v):
        return v.accepted != 0
    return None


def _draft_limit_bound(f: Facts) -> torch.Tensor:
    """[B] long: the most drafts a row may use, min(k, remaining - 1) with remaining the
    budget left before the step; 0 for a row with no budget left."""
    v = f.view
    return (v.budgets - _before(f) - 1).clamp(0, v.k)


def _draft_limit_rule(f: Facts):
    v = f.view
    if v.draft_limit is None or v.committed is None:
        return None
    return (v.draft_limit < 0) | (v.draft_limit > _draft_limit_bound(f))


def _longest_prefix(f: Facts):
    v = f.view
    if not (_has_drafts(v) and v.draft_limit is not None):
        return None
    a = v.accepted
    nxt = _same(f).gather(1, a.clamp(0, v.k - 1)[:, None])[:, 0]
    return (a < v.draft_limit) & nxt


_COMMIT = ("generated", "committed", "generated_before", "predictions", "accepted", "drafts",
           "draft_limit", "output", "budgets", "prev", "stops")

I6_COMMIT_RULES = (
    _i6("I6.generated_sum", "generated = generated_before + committed", _COMMIT,
        lambda f: f.view.generated != _before(f) + f.view.committed),
    _i6("I6.committed_range", "1 <= committed <= k + 1 = {k1} for a row active before the step",
        _COMMIT, lambda f: f.active_before & ((f.view.committed < 1)
                                              | (f.view.committed > f.view.k + 1))),
    _i6("I6.committed_tokens", "the committed tokens are the target's predictions y_0 .. y_(m-1)",
        _COMMIT, _committed_tokens),
    _i6("I6.committed_accepted",
        "committed = accepted + 1, fewer only when cut at a stop token or the budget", _COMMIT,
        _accepted_rule),
    _i6("I6.drafts_equal", "accepted drafts equal the target's predictions", _COMMIT,
        _drafts_equal),
    _i6("I6.draft_limit", "0 <= draft_limit <= min(k, remaining - 1) with k = {k} and "
        "remaining = budget - generated_before: the last budgeted token is never a draft, "
        "a row with no budget left drafts nothing", _COMMIT, _draft_limit_rule),
    _i6("I6.accepted_range", "0 <= accepted <= draft_limit", _COMMIT, _accepted_range),
    _i6("I6.longest_prefix", "accepted is the longest matching prefix of the drafts", _COMMIT,
        _longest_prefix),
)


def _fused_commit(f: Facts) -> torch.Tensor:
    v = f.view
    m, k = v.committed, v.k
    bad = v.generated != _before(f) + m
    wrong = (m < 1) | (m > k + 1)
    if v.accepted is not None:
        a1 = v.accepted + 1
        wrong = wrong | (m > a1) | ((m < a1) & ~(f.last_stop | f.at_budget))
    bad = bad | (f.active_before & wrong)
    for rule in (_committed_tokens, _drafts_equal, _draft_limit_rule, _accepted_range,
                 _longest_prefix):
        r = rule(f)
        if r is not None:
            bad = bad | r
    return bad


def _sequence_applies(f: Facts) -> bool:
    return f.view.phase != "prefill" and f.prompts is not None and P.consumed(f.view) is not None


def _wanted(f: Facts, rank: torch.Tensor):
    """(want [B, W]: the row's prompt ++ output at each slot's rank, the prompt lengths
    remembered at prefill [B], found [B] bool or None)."""
    v = f.view
    plen, ptoks, found = f.prompt_rows
    pl = v.prompt_lengths[:, None]
    t = v.output.shape[1]
    out = v.output if t else v.output.new_zeros(f.B, 1)
    want = torch.where(rank < pl, ptoks.gather(1, rank.clamp(0, max(ptoks.shape[1] - 1, 0))),
                       out.gather(1, (rank - pl).clamp(0, max(t - 1, 0))))
    return want, plen, found


def _sequence_slots(f: Facts):
    if not _sequence_applies(f):
        return None
    v = f.view
    want, _, found = _wanted(f, f.rank)
    in_range = f.rank < v.prompt_lengths[:, None] + P.consumed(v)[:, None]
    bad = f.valid & in_range & (v.tokens != want)
    return bad if found is None else bad & found[:, None]


def _lengths_rule(f: Facts):
    used = P.consumed(f.view)
    if used is None:
        return None
    return f.view.lengths != f.view.prompt_lengths + used


def _sequence_rule(f: Facts):
    s = _sequence_slots(f)
    return None if s is None else s.any(dim=1)


def _prompt_lengths_rule(f: Facts):
    if not _sequence_applies(f):
        return None
    plen, _, found = f.prompt_rows
    return _found(f.view.prompt_lengths != plen, found)


_SEQUENCE = ("tokens", "valid", "output", "generated", "lengths", "prompt_lengths", "row_ids",
             "prompts", "is_prefill")

I6_SEQUENCE_RULES = (
    _i6("I6.lengths", "n[b] = prompt + committed output (prompt_lengths + generated)",
        ("lengths", "prompt_lengths", "generated", "generated_before"), _lengths_rule),
    Rule("I6.sequence", "I6", "the row's real tokens, read left to right, are prompt ++ output",
         _SEQUENCE, mask=_sequence_rule, slots=_sequence_slots, columns="slots",
         slot_priority=1, lines=_TOKEN_LINES),
    _i6("I6.prompt_lengths", "prompt_lengths never change", ("prompt_lengths", "prompts"),
        _prompt_lengths_rule),
)


def _fused_sequence(f: Facts):
    v = f.view
    used = P.consumed(v)
    if used is None:
        return None
    bad = v.lengths != v.prompt_lengths + used
    if not _sequence_applies(f):
        return bad
    want, plen, found = _wanted(f, f.rank)
    # rank < n[b] stands for rank < prompt + output: where the two differ, the first
    # term flags the row anyway
    seq = (f.valid & (f.rank < v.lengths[:, None]) & (v.tokens != want)).any(dim=1) \
        | (v.prompt_lengths != plen)
    return bad | _found(seq, found)


# ---------------------------------------------------------------------------------------
# I5, I7 (deep mode: computed by model forwards in the Monitor, host side)
# ---------------------------------------------------------------------------------------

R_KV = Rule("I5.kv", "I5",
            "cached K/V at every valid slot equals a clean batch-1 prefill of the row's real "
            "tokens (allclose atol={atol:g}, rtol={rtol:g})",
            ("model", "cache_tensors", "tokens", "valid", "drafts", "draft_limit"),
            columns="slots")
R_REFERENCE = Rule("I7.reference", "I7",
                   "output equals the target's {what}: {detail} ({oracle})",
                   ("model", "output", "generated", "finished", "budgets", "row_ids"),
                   columns="output", lines=_TOKEN_LINES)



# ---------------------------------------------------------------------------------------
# Fusions: the groups that run together at one phase, as one expression
# ---------------------------------------------------------------------------------------
# At commit the state, history and commit rules always run together, at a realign the
# layout, position and sequence rules, at a verify the forward's position and mask rules.
# A fusion computes, row by row, the OR of every rule of its groups in one expression,
# using what one rule guarantees to simplify another (positions = slot - padding in a
# contiguous row, g = generated_before + committed, mask = the validity it stands for):
# where that guarantee fails, the rule that states it flags the row anyway. It returns
# None for a view outside what it was written for; the groups then run one by one.

@dataclass(frozen=True)
class Fusion:
    # group names it stands for, in GROUPS order; it applies when all of them run
    groups: tuple
    # facts -> [B] bool (the OR of every rule of the groups), or None: run them one by one
    fused: Callable
    # fast mode: (facts, snapshot table) -> (key, evidence) when the check can wait until
    # the read, or None; ``batch(key, [evidence], consts, stops)`` then checks every
    # waiting view of one key at once ([sum of B] bool, in order)
    defer: Callable | None = None
    batch: Callable | None = None
    # ``defer`` reads the view's snapshot table (else it is given None: a monitor builds
    # the table only for the views whose check needs it)
    snapshot: bool = False
    # fast mode by reference (``Refs``): (facts, snapshot table) -> (key, Refs) or None,
    # and ``batch_refs(key, [Refs], consts, stops)`` -> per Refs its [B] bool flags
    refer: Callable | None = None
    batch_refs: Callable | None = None
    # ``batch_refs`` checks row by row (its fields ``cat`` along the rows): views of any
    # row counts share one call (else views are laid side by side, one call per row count)
    rowwise: bool = False


#: a coefficient that switches a constraint off (any count in a view is far below it)
BIG = 1 << 40

#: the row quantities of a commit, in the order ``_fused_commit_phase`` stacks them:
#: counts first, then 0/1 flags
COMMIT_VARIABLES = ("g", "gb", "m", "a", "lim", "budgets", "moved", "lead", "one",
                    "first_stop", "room", "stale", "wrote",
                    "inactive", "unknown", "fin", "last", "atb", "at_limit")
#: the commit's row rules as linear constraints: each {variable: coefficient} must be
#: >= 0 (T and k + 1 are coefficients of "one"; BIG switches a rule off for a row).
#: ``moved`` is generated_before - the previous generated; ``room`` is budget -
#: generated_before clamped to [1, k + 1] (the draft limit's bound plus one); ``stale``
#: and ``wrote`` count offending output slots. The prefix rules
#: compare ``lead`` (leading drafts equal to the predictions) with the accepted count
#: itself, not clamped to k: where a > k (or, at a row not at its limit, a >= k) the
#: draft limit or the accepted range flags the row anyway.
COMMIT_CONSTRAINTS = (
    {"g": 1},                                               # g >= 0
    {"budgets": 1, "g": -1},                                # g <= budget
    {"one": "T", "g": -1},                                  # g <= output width
    {"fin": 1, "last": -1},                                 # ends on a stop -> finished
    {"fin": 1, "atb": -1},                                  # at its budget -> finished
    {"last": 1, "atb": 1, "fin": -1},                       # finished -> stop or budget
    {"moved": 1, "unknown": BIG},                           # generated_before = previous
    {"moved": -1, "unknown": BIG},                          #   generated (known rows)
    {"g": 1, "gb": -1, "m": -1},                            # generated = before + committed
    {"gb": 1, "m": 1, "g": -1},
    {"m": 1, "one": -1, "inactive": BIG},                   # 1 <= committed (active rows)
    {"one": "k1", "m": -1, "inactive": BIG},                # committed <= k + 1
    {"a": 1, "one": 1, "m": -1, "inactive": BIG},           # committed <= accepted + 1
    {"m": 1, "a": -1, "one": -1, "inactive": BIG, "last": BIG, "atb": BIG},  # = unless cut
    {"lim": 1},                                             # 0 <= draft_limit
    {"room": 1, "one": -1, "lim": -1},                      # draft_limit <= min(k, rem - 1)
    {"a": 1},                                               # 0 <= accepted
    {"lim": 1, "a": -1},                                    # accepted <= draft_limit
    {"lead": 1, "a": -1},                                   # drafts before it all match
    {"a": 1, "lead": -1, "at_limit": BIG},                  # the next one does not match
    {"first_stop": 1, "g": -1, "one": 1},                   # no stop before the last output
    {"stale": -1},                                          # the old output is unchanged
    {"wrote": -1},                                          # the committed tokens are y_i
)
#: how many of COMMIT_VARIABLES are counts (the rest are flags)
_COMMIT_COUNTS = COMMIT_VARIABLES.index("inactive")


#: COMMIT_CONSTRAINTS' matrices per (T, k, device, dtype), shared by every monitor (a
#: new monitor per run would otherwise write them again: some 50 small kernels each)
_COEFFICIENTS: dict = {}


def _commit_coefficients(consts: Constants, device, t: int, k: int, dtype) -> torch.Tensor:
    """[constraints, variables] of COMMIT_CONSTRAINTS on ``device``, written by fill
    kernels (no host->device copy) once per (T, k, device, dtype) in the process."""
    key = (t, k, device, dtype)
    c = _COEFFICIENTS.get(key)
    if c is None:
        index = {n: i for i, n in enumerate(COMMIT_VARIABLES)}
        c = torch.zeros(len(COMMIT_CONSTRAINTS), len(COMMIT_VARIABLES), dtype=dtype,
                        device=device)
        for j, terms in enumerate(COMMIT_CONSTRAINTS):
            for name, w in terms.items():
                w = {"T": t, "k1": k + 1}.get(w, w)
                c[j, index[name] : index[name] + 1].fill_(w)
        if len(_COEFFICIENTS) >= 1024:
            _COEFFICIENTS.clear()
        _COEFFICIENTS[key] = c
    return c


def _commit_ready(f: Facts) -> bool:
    """The host facts the commit fusion needs (else its groups run one by one)."""
    v = f.view
    t, k = v.output.shape[1], v.k
    return not (v.generated_before is None or v.accepted is None or v.draft_limit is None
                or v.predictions is None or v.drafts is None or f.prev is None or not t
                or v.predictions.shape[1] != k + 1 or v.drafts.shape[1] != k
                or f.prev.table.shape[1] != t + 3)


def commit_flags(out, g, fin, m, gb, a, lim, budgets, preds, drafts, rows, found, *, k: int,
                 stops, consts: Constants, device) -> torch.Tensor:
    """[N] bool: the OR of the I6 state, history and commit rules, row by row, of commit
    rows given as explicit tensors: ``out`` [N, T], ``g``/``m``/``gb``/``a``/``lim``/
    ``budgets`` [N] long, ``fin`` [N] bool, ``preds`` [N, k + 1], ``drafts`` [N, k], the
    previous snapshot's ``rows`` [N, 3 + T] and ``found`` [N] bool (or None: every row
    known). Row-wise only, so rows of several commits of one (k, T) can be checked at
    once (``commit_batch``). The output-wide rules are a few [N, T] and [N, k + 1]
    expressions, every row rule is an integer linear constraint (``COMMIT_CONSTRAINTS``:
    one stack of counts, one of flags, one product); written for few, cheap kernels
    (reductions by ``sum``, stacks along dim 0 with one dtype each)."""
    t, n = out.shape[1], out.shape[0]
    i = consts.row(k + 1, device)
    col = consts.row(t, device)
    # the index of each row's first stop token (T when none): a stop before the last
    # output is first_stop < g - 1; the last output is one when first_stop = g - 1 (exact
    # when g <= T and no stop comes before it, which other constraints check)
    first_stop = torch.where(P.stop_mask(out, stops), col, consts.scalar(t, device)).amin(dim=1)
    # output indices: unchanged below the previous generated (history), the committed
    # tokens are the predictions
    stale = (out != rows[:, 3:]) & (col < rows[:, 1:2])
    if found is not None:
        stale = stale & found[:, None]
    wrote = (out.gather(1, (gb.unsqueeze(1) + i).clamp(0, t - 1)) != preds) & (i < m.unsqueeze(1))
    # the longest matching prefix of the drafts
    lead = (drafts == preds[:, :k]).cumprod(dim=1).sum(dim=1) if k else consts.count(0, n, device)
    # (the table's columns are strided: each enters through an op with a dense result,
    # so that both stacks take the contiguous path)
    inactive = rows[:, 2] != 0
    unknown = consts.zeros(n, device)
    if found is not None:
        inactive, unknown = inactive & found, ~found
    counts = torch.stack([g, gb, m, a, lim, budgets, gb - rows[:, 1], lead,
                          consts.count(1, n, device), first_stop,
                          (budgets - gb).clamp(1, k + 1), stale.sum(dim=1), wrote.sum(dim=1)])
    flags = torch.stack([inactive, unknown, fin, first_stop + 1 == g, g >= budgets, a >= lim])
    # int64 products on the CPU; float64 elsewhere (exact for counts below 2^52)
    exact = torch.long if device.type == "cpu" else torch.float64
    x = torch.cat([counts.to(exact), flags.to(exact)])  # [variables, N]
    return (_commit_coefficients(consts, device, t, k, exact) @ x < 0).any(dim=0)


def _fused_commit_phase(f: Facts):
    """I6 state + history + commit rules at a commit view (k = 0 included):
    ``commit_flags`` of the view's rows."""
    if not _commit_ready(f):
        return None
    v = f.view
    rows, found = f._rows_of(f.prev)
    return commit_flags(v.output, v.generated, f.finished, v.committed, v.generated_before,
                        v.accepted, v.draft_limit, v.budgets, v.predictions, v.drafts, rows,
                        found, k=v.k, stops=f.stops, consts=f.consts, device=f.device)


@dataclass(frozen=True)
class CommitEvidence:
    """What ``commit_flags`` reads of one commit view, copied when the view is seen (so
    that a later in-place write by the engine cannot change it): the view's snapshot
    table [B, 3 + T] (request id, generated, finished, output), its counts [5, B] long
    (committed, generated_before, accepted, draft_limit, budgets), predictions ++ drafts
    [B, 2k + 1], and the previous snapshot's rows [B, 3 + T] with ``found`` [B] or None
    (the monitor's own tables, never written in place)."""

    # [B, 3 + T] long
    table: torch.Tensor
    # [5, B] long
    counts: torch.Tensor
    # [B, 2k + 1] long
    choices: torch.Tensor
    # [B, 3 + T] long
    rows: torch.Tensor
    # [B] bool or None
    found: torch.Tensor | None

    @property
    def size(self) -> int:
        return self.table.shape[0]


def _commit_wait(f: Facts, table: torch.Tensor):
    """(key, the five [B] long row fields, previous rows, found) of a commit view whose
    check can wait, or None (see ``commit_evidence``)."""
    if not _commit_ready(f):
        return None
    v = f.view
    b, row = f.B, (f.B,)
    fields = (v.committed, v.generated_before, v.accepted, v.draft_limit, v.budgets)
    if any(x.shape != row or x.dtype != torch.long for x in fields) \
            or v.predictions.shape[0] != b or v.drafts.shape[0] != b or table.shape[0] != b:
        return None
    rows, found = f._rows_of(f.prev)
    key = (v.k, v.output.shape[1], f.stops if not isinstance(f.stops, torch.Tensor)
           else id(f.stops), f.device, found is None)
    return key, fields, rows, found


def commit_evidence(f: Facts, table: torch.Tensor):
    """(key, CommitEvidence) of a commit view whose check can wait (``commit_batch``
    checks the evidence of every commit of one key at once), or None when the commit
    fusion must run now: it does not apply, or the view's extra row fields are not [B]
    long (only well-formed views wait; the others run one by one at once, as before).
    ``table``: the view's ``Snapshot.of`` table."""
    wait = _commit_wait(f, table)
    if wait is None:
        return None
    key, fields, rows, found = wait
    v = f.view
    return key, CommitEvidence(table, torch.stack(fields), torch.cat([v.predictions, v.drafts], 1),
                               rows, found)


def commit_batch(key, evidence: list, consts: Constants, stops=None) -> torch.Tensor:
    """[sum of B] bool: ``commit_flags`` of the rows of every commit in ``evidence`` (one
    key: same k, T, stops, device), concatenated in order: one evaluation for them all."""
    k, t, ids, device, _ = key
    if stops is None:  # the key holds host ids themselves (a tensor of ids: its identity)
        stops = ids
    if len(evidence) == 1:
        e = evidence[0]
        table, counts, choices, rows, found = e.table, e.counts, e.choices, e.rows, e.found
    else:
        table = torch.cat([e.table for e in evidence])
        counts = torch.cat([e.counts for e in evidence], dim=1)
        choices = torch.cat([e.choices for e in evidence])
        rows = torch.cat([e.rows for e in evidence])
        found = None if evidence[0].found is None else torch.cat([e.found for e in evidence])
    m, gb, a, lim, budgets = counts
    return commit_flags(table[:, 3:], table[:, 1], table[:, 2] != 0, m, gb, a, lim, budgets,
                        choices[:, : k + 1], choices[:, k + 1 :], rows, found, k=k, stops=stops,
                        consts=consts, device=device)


# -- I6 state + history at a view that is not a commit (a pool's other group) --------------

def state_history_flags(out, g, fin, budgets, rows, found, *, stops, consts: Constants,
                        device) -> torch.Tensor:
    """[N] bool: the OR of the I6 state rules and the I6 history rules of rows that are
    not at a commit (``_fused_state | _fused_history`` there), rows given as explicit
    tensors: ``out`` [N, T] (T > 0), ``g``/``budgets`` [N] long, ``fin`` [N] bool, the
    previous snapshot's ``rows`` [N, 3 + T'] and ``found`` [N] bool (or None: every row
    known). Row-wise only, so rows of several views of one (T, T') are checked at once."""
    t = out.shape[1]
    stop_out = P.stop_mask(out, stops)
    last = (g - 1).clamp(0, t - 1)[:, None]
    last_stop = stop_out.gather(1, last)[:, 0] & (g > 0)
    after = (stop_out & (consts.row(t, device) < (g - 1)[:, None])).any(dim=1)
    state = (g < 0) | (g > budgets.clamp(max=t)) | after | (fin != (last_stop | (g >= budgets)))
    pg, pout = rows[:, 1], rows[:, 3:]
    bad = g != pg
    tt = min(t, pout.shape[1])
    if tt:
        changed = (out[:, :tt] != pout[:, :tt]) & (consts.row(tt, device) < pg[:, None])
        bad = bad | changed.any(dim=1)
    return state | _found(bad, found)


def _state_wait(f: Facts):
    """(key, previous rows, found) of a view whose I6 state + history check fuses (a
    realign: the view a scheduler that serves another group of its pool shows after
    the commit), or None: another phase, no previous snapshot, fields not [B]."""
    v = f.view
    if v.phase != "realign" or f.prev is None:
        return None
    b, row = f.B, (f.B,)
    t = v.output.shape[1] if v.output.dim() == 2 else 0
    if not t or v.output.shape[0] != b or f.prev.table.shape[1] < 3 \
            or any(x.shape != row for x in (v.generated, v.finished, v.budgets)):
        return None
    rows, found = f._rows_of(f.prev)
    key = (t, rows.shape[1], f.stops if not isinstance(f.stops, torch.Tensor)
           else id(f.stops), f.device, found is None)
    return key, rows, found


def _fused_realign_state(f: Facts):
    """I6 state + history rules at a realign view: ``state_history_flags``."""
    wait = _state_wait(f)
    if wait is None:
        return None
    v = f.view
    _, rows, found = wait
    return state_history_flags(v.output, v.generated, f.finished, v.budgets, rows, found,
                               stops=f.stops, consts=f.consts, device=f.device)


@dataclass(frozen=True)
class StateEvidence:
    """What ``state_history_flags`` reads of one view, copied when the view is seen:
    output ++ generated, finished (0/1), budgets [B, T + 3] long, and the previous
    snapshot's rows [B, 3 + T'] with ``found`` (the monitor's own, never written in
    place)."""

    # [B, T + 3] long
    table: torch.Tensor
    # [B, 3 + T'] long
    rows: torch.Tensor
    # [B] bool or None
    found: torch.Tensor | None

    @property
    def size(self) -> int:
        return self.table.shape[0]


def state_evidence(f: Facts, table=None):
    """(key, StateEvidence) of a view whose I6 state + history check can wait, or None."""
    wait = _state_wait(f)
    if wait is None:
        return None
    key, rows, found = wait
    v = f.view
    counts = torch.stack([P._long(v.generated), P._long(f.finished), P._long(v.budgets)], 1)
    return key, StateEvidence(torch.cat([P._long(v.output), counts], 1), rows, found)


def state_batch(key, evidence: list, consts: Constants, stops=None) -> torch.Tensor:
    """[sum of B] bool: ``state_history_flags`` of every view in ``evidence`` (one key),
    in order."""
    t, _, ids, device, _ = key
    table = _cat([e.table for e in evidence])
    found = None if evidence[0].found is None else _cat([e.found for e in evidence])
    return state_history_flags(table[:, :t], table[:, t], table[:, t + 1] != 0, table[:, t + 2],
                               _cat([e.rows for e in evidence]), found,
                               stops=ids if stops is None else stops, consts=consts,
                               device=device)


def state_refer(f: Facts, table=None):
    """``state_evidence`` by reference: (key, Refs) or None."""
    wait = _state_wait(f)
    if wait is None:
        return None
    key, rows, found = wait
    v = f.view
    refs = _refs((v.output, v.generated, v.finished, v.budgets), (rows, found), (), f.B)
    return None if refs is None else (key, refs)


def state_batch_refs(key, refs: list, consts: Constants, stops=None) -> list:
    """Per ref, [B] bool: ``state_history_flags`` of its rows, every view of one key at
    once (one ``cat`` per field)."""
    t, _, ids, device, _ = key
    out, g, fin, budgets = (_cat([r.tensors[i] for r in refs]) for i in range(4))
    rows = _cat([r.own[0] for r in refs])
    found = None if refs[0].own[1] is None else _cat([r.own[1] for r in refs])
    flags = state_history_flags(P._long(out), P._long(g), fin if fin.dtype == torch.bool
                                else fin.bool(), P._long(budgets), rows, found,
                                stops=ids if stops is None else stops, consts=consts,
                                device=device)
    return _split_back(flags, refs, list(range(len(refs))))


def _realign_ready(f: Facts) -> bool:
    v = f.view
    return v.phase != "prefill" and v.phase != "commit" and f.prompts is not None \
        and v.output.shape[1] > 0 and v.width > 0 and f.prompts.table.shape[1] > 2


def _slots_wrong(holes: bool, tokens, want, valid, positions, rank, in_row, found):
    """[B, S] bool: the slots ``realign_flags`` flags: a valid slot whose position is not
    its rank among the row's valid slots or whose token is not the row's token of that
    rank (``want``; holes: only ranks inside the row, ``in_row``; only rows ``found``, when
    given), and, contiguous, a slot valid where it should not be or invalid where it should."""
    tok = tokens != want
    if holes:
        tok = tok & in_row
    if found is not None:
        tok = tok & found
    if holes:
        return valid & ((positions != rank) | tok)
    return (valid != (rank >= 0)) | (valid & ((positions != rank) | tok))


def realign_flags(holes: bool, tokens, valid, positions, n, pl, g, out, prow, found, extra, *,
                  consts: Constants, device) -> torch.Tensor:
    """[N] bool: the OR of the I2 layout (``holes``: the holes profile, else contiguous),
    I3 position and I6 sequence rules, row by row, of views given as explicit tensors:
    ``tokens``, ``positions`` [N, S] long and ``valid`` [N, S] bool; ``n`` (lengths),
    ``pl`` (prompt lengths), ``g`` (generated) [N] long; ``out`` [N, T] the output;
    ``prow`` [N, 2 + P] the remembered prompt rows with ``found`` [N] (None: every row
    known); ``extra``: holes, the rows' finished flags [N]; contiguous, the minimal-width
    rule's flag (a 0-dim tensor for one view, or per row); grouped (the contiguous layout
    with no padding), n != W per row (``_realign_extra``). Row-wise otherwise, and
    unchanged by slots on the left that are invalid with token and position 0, so views
    of one kind can be checked at once (``realign_batch``)."""
    s = valid.shape[1]
    plen, ptoks = prow[:, 1], prow[:, 2:]
    if holes:
        counted = valid.cumsum(dim=1)
        rank = counted - 1
    else:  # the rank of a valid slot, if contiguous
        rank = consts.row(s, device) - (s - n)[:, None]
    pl1 = pl[:, None]
    t = out.shape[1]
    want = torch.where(rank < pl1, ptoks.gather(1, rank.clamp(0, max(ptoks.shape[1] - 1, 0))),
                       out.gather(1, (rank - pl1).clamp(0, max(t - 1, 0))))
    bad = _slots_wrong(holes, tokens, want, valid, positions, rank, rank < n[:, None],
                       None if found is None else found[:, None])
    seq = pl != plen if found is None else (pl != plen) & found
    rows = [bad.any(dim=1), n < 1, n != pl + g, seq]
    if holes:
        rows += [counted[:, -1] != n, ~(valid[:, -1] | extra)]
        return torch.stack(rows).any(dim=0)
    # (the minimal-width flag is or-ed after the stack, whose inputs then are all dense)
    return torch.stack(rows).any(dim=0) | extra


def _realign_extra(profile: str, n, w, finished):
    """``realign_flags``' extra flag: holes, the rows' finished flags; contiguous, the
    minimal-width rule (max(n) != W, one for the view); grouped, n != W per row (with
    the contiguous layout, that is the grouped profile's no-padding rule)."""
    if profile == "holes":
        return finished
    return n.max() != w if profile == "contiguous" else n != w


def _realign_fusion(f: Facts, profile: str):
    if not _realign_ready(f):
        return None
    v = f.view
    holes = profile == "holes"
    rows, found = f._rows_of(f.prompts)
    extra = _realign_extra(profile, v.lengths, v.width, f.finished)
    return realign_flags(holes, v.tokens, f.valid, v.positions, v.lengths, v.prompt_lengths,
                         v.generated, v.output, rows, found, extra, consts=f.consts,
                         device=f.device)


def _fused_contiguous_realign(f: Facts):
    """I2 (contiguous) + I3 positions + I6 sequence rules at a view with new slots."""
    return _realign_fusion(f, "contiguous")


def _fused_holes_realign(f: Facts):
    """I2 (holes) + I3 positions + I6 sequence rules at a view with new slots."""
    return _realign_fusion(f, "holes")


def _fused_grouped_realign(f: Facts):
    """I2 (grouped) + I3 positions + I6 sequence rules at a view with new slots (a pool's
    group: no padding, every row n = W)."""
    if f.view.profile != "grouped":
        return None
    return _realign_fusion(f, "grouped")


@dataclass(frozen=True)
class RealignEvidence:
    """What ``realign_flags`` reads of one realign view, copied when the view is seen:
    tokens, positions and valid (as 0/1) stacked [B, 3, W] long, and output ++ lengths,
    prompt lengths, generated, the extra column (nonzero where its flag
    holds) [B, T + 4] long; the remembered prompt rows
    [B, 2 + P] and ``found`` (the monitor's own tables, never written in place)."""

    # [B, 3, W] long
    slots: torch.Tensor
    # [B, T + 4] long
    rows: torch.Tensor
    # [B, 2 + P] long
    prompts: torch.Tensor
    # [B] bool or None
    found: torch.Tensor | None

    @property
    def size(self) -> int:
        return self.slots.shape[0]


def _realign_wait(f: Facts, profile: str):
    """(profile, the remembered prompt rows, found) of a realign view of ``profile`` whose
    check can wait, or None (see ``realign_evidence``)."""
    v = f.view
    if v.phase != "realign" or v.profile != profile or not _realign_ready(f):
        return None
    b, row = f.B, (f.B,)
    if v.valid.shape != v.tokens.shape or v.positions.shape != v.tokens.shape \
            or v.output.dim() != 2 or v.output.shape[0] != b \
            or any(x.shape != row for x in (v.lengths, v.prompt_lengths, v.generated, v.finished)):
        return None
    prompts, found = f._rows_of(f.prompts)
    return profile, prompts, found


def realign_evidence(f: Facts, table=None, *, profile: str = "contiguous"):
    """(key, RealignEvidence) of a realign view of ``profile`` whose check can wait
    (``realign_batch``), or None when its fusion must run now (another phase or profile,
    a shape it does not expect)."""
    wait = _realign_wait(f, profile)
    if wait is None:
        return None
    v, b, w = f.view, f.B, f.view.width
    profile, prompts, found = wait
    # the extra column: 1 where the flag holds
    extra = P._long(_realign_extra(profile, v.lengths, w, f.finished)).expand(b)
    slots = torch.stack([v.tokens, v.positions, f.valid.long()], 1)
    rows = torch.cat([v.output, torch.stack([v.lengths, v.prompt_lengths, v.generated,
                                             extra], 1)], 1)
    key = (profile, prompts.shape[1], v.output.shape[1], f.device, found is None)
    return key, RealignEvidence(slots, rows, prompts, found)


def realign_batch(key, evidence: list, consts: Constants, stops=None) -> torch.Tensor:
    """[sum of B] bool: ``realign_flags`` of every realign view in ``evidence`` (one key),
    in order; views of different widths are padded on the left with invalid slots."""
    profile, _, t, device, _ = key
    holes = profile == "holes"
    if len(evidence) == 1:
        e = evidence[0]
        slots, rows, prompts, found = e.slots, e.rows, e.prompts, e.found
    else:
        w = max(e.slots.shape[2] for e in evidence)
        slots = torch.cat([e.slots if e.slots.shape[2] == w
                           else torch.nn.functional.pad(e.slots, (w - e.slots.shape[2], 0))
                           for e in evidence])
        rows = torch.cat([e.rows for e in evidence])
        prompts = torch.cat([e.prompts for e in evidence])
        found = None if evidence[0].found is None else torch.cat([e.found for e in evidence])
    return realign_flags(holes, slots[:, 0], slots[:, 2] != 0, slots[:, 1], rows[:, t],
                         rows[:, t + 1], rows[:, t + 2], rows[:, :t], prompts, found,
                         rows[:, t + 3] != 0, consts=consts, device=device)


def forward_flags(mask, valid, ids, pos, toks, lim, *, consts: Constants, device) -> torch.Tensor:
    """[N] bool: the OR of the I3 forward-position and I4 mask rules, row by row, of
    forwards given as explicit tensors: ``mask`` and ``valid`` [N, S] bool (the mask, and
    the validity its columns stand for; the new tokens are the last q columns), ``ids``
    and ``toks`` [N, q] (the forward's inputs, the row's tokens at the new slots), ``pos``
    [N or 1, q], ``lim`` [N] (the drafts a row may use; None: every new token counts).
    Where the mask equals the validity (else I4 flags the row), its new columns are the
    valid's and its running count is the valid's: the position rule reads those. Row-wise
    only, and unchanged by columns that are False in both on the left, so forwards of one
    q can be checked at once (``forward_batch``)."""
    q = ids.shape[-1]
    c = valid.shape[1] - q
    new = pos + 1 != valid.cumsum(dim=1)[:, c:]
    if lim is not None:
        new = new & (consts.row(q, device) <= lim[:, None])
    new = (new | (ids != toks)) & valid[:, c:]
    return (mask != valid).any(dim=1) | new.any(dim=1)


def _fused_forward_phase(f: Facts):
    """I3 forward positions + I4 mask at a view with a recorded forward
    (``forward_flags`` over the mask's columns)."""
    v, fw = f.view, f.view.forward
    c, q = fw.cache_width, fw.input_ids.shape[-1]
    span = c + q
    tokens, valid = f.extended
    m = fw.attention_mask
    if m.dim() != 2 or m.shape[1] != span or span > valid.shape[1] or m.shape[0] != f.B \
            or fw.input_ids.shape != tokens[:, c:span].shape:
        return None
    if span < valid.shape[1]:
        tokens, valid = tokens[:, :span], valid[:, :span]
    lim = v.draft_limit if v.phase in ("verify", "commit") else None
    return forward_flags(f.fmask, valid, fw.input_ids, fw.positions, tokens[:, c:], lim,
                         consts=f.consts, device=f.device)


@dataclass(frozen=True)
class ForwardEvidence:
    """What ``forward_flags`` reads of one verify view, copied when the view is seen:
    inputs ++ positions ++ the row's new tokens ++ draft limit [B, 3q + 1] long, and the
    mask stacked with the validity it stands for [B, 2, C + q] bool."""

    # [B, 3q + 1] long
    ints: torch.Tensor
    # [B, 2, C + q] bool
    flags: torch.Tensor

    @property
    def size(self) -> int:
        return self.ints.shape[0]


def forward_evidence(f: Facts, table=None):
    """(key, ForwardEvidence) of a verify view whose forward check can wait
    (``forward_batch``), or None when ``_fused_forward_phase`` must run now (another
    phase, or any shape it does not expect)."""
    v, fw = f.view, f.view.forward
    if fw is None or v.phase != "verify" or v.draft_limit is None or v.drafts is None:
        return None
    b, c, q = f.B, fw.cache_width, fw.input_ids.shape[-1]
    span = c + q
    valid = f.extended_valid
    m, pos = fw.attention_mask, fw.positions
    if m.dim() != 2 or tuple(m.shape) != (b, span) or tuple(valid.shape) != (b, span) \
            or tuple(fw.input_ids.shape) != (b, q) or pos.dim() != 2 \
            or pos.shape[0] not in (1, b) or pos.shape[1] != q \
            or tuple(v.draft_limit.shape) != (b,) or c < 0:
        return None
    # the row's tokens at the new slots, ``extended``'s tokens[:, c:], without copying
    # the whole extended row first
    w = v.tokens.shape[1]
    new = [v.tokens[:, c:], v.drafts] if c <= w else [v.drafts[:, c - w:]]
    ints = torch.cat([fw.input_ids, pos if pos.shape[0] == b else pos.expand(b, q), *new,
                      v.draft_limit[:, None]], 1)
    return (q, f.device), ForwardEvidence(ints, torch.stack([f.fmask, valid], 1))


def forward_batch(key, evidence: list, consts: Constants, stops=None) -> torch.Tensor:
    """[sum of B] bool: ``forward_flags`` of every forward in ``evidence`` (one q), in
    order; masks of different widths are padded on the left with columns False in both
    mask and validity (which changes no row's flags)."""
    q, device = key
    if len(evidence) == 1:
        ints, flags = evidence[0].ints, evidence[0].flags
    else:
        s = max(e.flags.shape[2] for e in evidence)
        flags = torch.cat([e.flags if e.flags.shape[2] == s
                           else torch.nn.functional.pad(e.flags, (s - e.flags.shape[2], 0))
                           for e in evidence])
        ints = torch.cat([e.ints for e in evidence])
    return forward_flags(flags[:, 0], flags[:, 1], ints[:, :q], ints[:, q : 2 * q],
                         ints[:, 2 * q : 3 * q], ints[:, 3 * q], consts=consts, device=device)


# -- fast mode by reference: the hook keeps the view's tensors, the read copies them -------
# An engine that never writes a view's tensors in place after its hook (this project's:
# ``_version`` unchanged, tested) lets the check wait with references instead of copies:
# ``refer`` keeps the tensors a fusion reads and their versions (no aten op), and
# ``batch_refs`` builds the fused expression's inputs at the read for every waiting view
# at once, one ``cat`` per field over the views of one width (views of other widths
# padded on the left, as ``*_batch`` does). A view whose tensors changed since the hook
# (``Refs.intact``) cannot be checked from them: the Monitor flags it (its report says
# the tensors were modified in place) and copies in later hooks (``defer``).

@dataclass(frozen=True)
class Refs:
    """What a deferred fusion reads of one view, by reference: the view's ``tensors``
    with their ``versions`` at the hook, the monitor's own tensors ``own`` (copies it
    made, never written in place), and host facts ``facts`` (widths)."""

    tensors: tuple
    versions: tuple
    own: tuple
    facts: tuple
    size: int

    def intact(self) -> bool:
        """Every tensor is unmodified since the hook (same ``_version``)."""
        return tuple([t._version for t in self.tensors]) == self.versions


def held_bytes(evidence) -> int:
    """Bytes of the tensors a waiting check keeps alive: a ``Refs``' view tensors and the
    monitor's own, or an evidence copy's fields (``numel * element_size`` each: a tensor
    that views a larger storage counts as its view)."""
    parts = evidence.tensors + evidence.own if isinstance(evidence, Refs) \
        else tuple(vars(evidence).values())
    return sum([t.nbytes for t in parts if isinstance(t, torch.Tensor)])


def _refs(tensors: tuple, own: tuple, facts: tuple, size: int) -> Refs | None:
    try:  # an inference-mode tensor has no version counter: it waits as a copy
        return Refs(tensors, tuple([t._version for t in tensors]), own, facts, size)
    except RuntimeError:
        return None


def _cat(ts: list) -> torch.Tensor:
    return ts[0] if len(ts) == 1 else torch.cat(ts)


def _split_back(flags: torch.Tensor, ordered: list, where: list) -> list:
    """Per original ref, its [B] slice of ``flags`` (rows in ``ordered``'s order)."""
    parts = flags.split([r.size for r in ordered]) if len(ordered) > 1 else (flags,)
    return [parts[w] for w in where]


def commit_refer(f: Facts, table: torch.Tensor):
    """``commit_evidence`` by reference: (key, Refs) or None."""
    wait = _commit_wait(f, table)
    if wait is None:
        return None
    key, fields, rows, found = wait
    v = f.view
    refs = _refs(fields + (v.predictions, v.drafts), (table, rows, found), (), f.B)
    return None if refs is None else (key, refs)


def commit_batch_refs(key, refs: list, consts: Constants, stops=None) -> list:
    """Per ref, [B] bool: ``commit_flags`` of its rows, every commit of one key in one
    evaluation (one ``cat`` per field)."""
    k, t, ids, device, _ = key
    if stops is None:
        stops = ids
    col = [_cat([r.tensors[i] for r in refs]) for i in range(7)]
    table = _cat([r.own[0] for r in refs])
    rows = _cat([r.own[1] for r in refs])
    found = None if refs[0].own[2] is None else _cat([r.own[2] for r in refs])
    m, gb, a, lim, budgets, preds, drafts = col
    flags = commit_flags(table[:, 3:], table[:, 1], table[:, 2] != 0, m, gb, a, lim, budgets,
                         preds, drafts, rows, found, k=k, stops=stops, consts=consts,
                         device=device)
    return _split_back(flags, refs, list(range(len(refs))))


def realign_refer(f: Facts, table=None, *, profile: str = "contiguous"):
    """``realign_evidence`` by reference: (key, Refs) or None."""
    wait = _realign_wait(f, profile)
    if wait is None:
        return None
    v, b = f.view, f.B
    profile, prompts, found = wait
    key = (profile, prompts.shape[1], v.output.shape[1], f.device, found is None)
    refs = _refs((v.tokens, v.positions, v.valid, v.output, v.lengths, v.prompt_lengths,
                  v.generated, v.finished), (prompts, found), (v.width,), b)
    return None if refs is None else (key, refs)


def _per_view(refs: list, x: torch.Tensor, reduce) -> torch.Tensor:
    """[N]: ``reduce`` of ``x`` [N] over each view's rows, repeated on its rows (one
    reshape when every view has the same row count)."""
    sizes = [r.size for r in refs]
    if sizes.count(sizes[0]) == len(sizes):
        v, b = len(sizes), sizes[0]
        return reduce(x.view(v, b))[:, None].expand(v, b).reshape(-1)
    return torch.cat([reduce(p[None])[0].expand(p.shape[0]) for p in x.split(sizes)])


def _side_by_side(widths: list, consts: Constants, device):
    """Where each column of views laid side by side (``cat`` along dim 1) comes from:
    (view index [S], the view's first column [V], its end [V], widths [V]), long; no
    upload (the widths are stacked from cached 0-dim constants: a monitor past
    ``MAX_WAITING`` or ``MAX_WAITING_BYTES`` settles inside a hook)."""
    wt = torch.stack([consts.scalar(w, device) for w in widths])
    total = sum(widths)
    cv = torch.repeat_interleave(torch.arange(len(widths), device=device), wt,
                                 output_size=total)
    ends = wt.cumsum(0)
    return cv, ends - wt, ends, wt


def _segment_any(x: torch.Tensor, cv: torch.Tensor, v: int) -> torch.Tensor:
    """[B, V] bool: per row, whether ``x`` [B, S] is True in any column of view ``v``."""
    return torch.zeros(x.shape[0], v, dtype=torch.long, device=x.device) \
        .index_add_(1, cv, x.long()) != 0


def _realign_side_by_side(profile: str, refs: list, consts: Constants, device) -> torch.Tensor:
    """[B, V]: ``realign_flags`` of views of one row count laid side by side (no op per
    view): slots ``cat`` along dim 1, row quantities stacked [B, V], each slot reading
    its view's through the column's view index."""
    holes = profile == "holes"
    v, b = len(refs), refs[0].size
    cv, start, ends, wt = _side_by_side([r.facts[0] for r in refs], consts, device)
    tokens = torch.cat([r.tensors[0] for r in refs], 1)
    positions = torch.cat([r.tensors[1] for r in refs], 1)
    valid = torch.cat([r.tensors[2] for r in refs], 1)
    valid = valid if valid.dtype == torch.bool else valid.bool()
    n, pl, g = (torch.stack([r.tensors[i] for r in refs], 1) for i in (4, 5, 6))
    t = refs[0].tensors[3].shape[1]
    out = torch.stack([r.tensors[3] for r in refs], 1).reshape(b, v * t)
    prow = torch.stack([r.own[0] for r in refs], 1)  # [B, V, 2 + P]
    p = prow.shape[2] - 2
    ptoks = prow[:, :, 2:].reshape(b, v * p)
    found = None if refs[0].own[1] is None else torch.stack([r.own[1] for r in refs], 1)
    n_s, pl_s = n[:, cv], pl[:, cv]
    if holes:
        cs = valid.cumsum(dim=1)
        base = torch.nn.functional.pad(cs, (1, 0))[:, start]  # [B, V]: valid before the view
        rank = cs - base[:, cv] - 1
    else:  # the rank of a valid slot, if contiguous
        rank = (torch.arange(cv.shape[0], device=device) - ends[cv])[None, :] + n_s
    want = torch.where(rank < pl_s, ptoks.gather(1, cv * p + rank.clamp(0, p - 1)),
                       out.gather(1, cv * t + (rank - pl_s).clamp(0, t - 1)))
    bad = _slots_wrong(holes, tokens, want, valid, positions, rank, rank < n_s,
                       None if found is None else found[:, cv])
    plen = prow[:, :, 1]
    seq = pl != plen if found is None else (pl != plen) & found
    rows = [_segment_any(bad, cv, v), n < 1, n != pl + g, seq]
    if holes:
        last = ends - 1
        fin = torch.stack([r.tensors[7] for r in refs], 1)
        rows += [cs[:, last] - base != n, ~(valid[:, last] | (fin if fin.dtype == torch.bool
                                                              else fin.bool()))]
        return torch.stack(rows).any(dim=0)
    # contiguous: the minimal width, per view; grouped: n = W, per row
    return torch.stack(rows).any(dim=0) | (
        (n.amax(dim=0) if profile == "contiguous" else n) != wt)


def _forward_side_by_side(refs: list, q: int, consts: Constants, device) -> torch.Tensor:
    """[B, V]: ``forward_flags`` of forwards of one row count laid side by side (no op
    per forward): masks, validity (the drafts' columns valid) and tokens ++ drafts
    ``cat`` along dim 1, the new columns of each picked by one index."""
    v, b = len(refs), refs[0].size
    cv, start, ends, wt = _side_by_side([r.facts[0] for r in refs], consts, device)
    mask = torch.cat([r.tensors[5] for r in refs], 1)
    mask = mask if mask.dtype == torch.bool else mask.bool()
    parts, toks = [], []
    for r in refs:
        span, c, w = r.facts
        valid = r.tensors[6]
        parts += [valid if valid.dtype == torch.bool else valid.bool(),
                  consts.ones(b, span - w, device)]
        toks += [r.tensors[2], r.tensors[3]]
    valid = torch.cat(parts, 1)
    toks = torch.cat(toks, 1)
    cs = valid.cumsum(dim=1)
    base = torch.nn.functional.pad(cs, (1, 0))[:, start]  # [B, V]
    j = consts.row(q, device)  # [1, q]
    cols = ((ends - q)[:, None] + j).reshape(-1)  # [V q]: the new columns of each view
    vq = torch.arange(v, device=device).repeat_interleave(q, output_size=v * q)
    ids = torch.stack([r.tensors[0] for r in refs], 1)  # [B, V, q]
    pos = torch.stack([r.tensors[1] if r.tensors[1].shape[0] == b
                       else r.tensors[1].expand(b, q) for r in refs], 1)
    lim = torch.stack([r.tensors[4] for r in refs], 1)  # [B, V]
    counted = (cs[:, cols] - base[:, vq]).view(b, v, q)
    new = (pos + 1 != counted) & (j[None] <= lim[:, :, None])
    new = (new | (ids != toks[:, cols].view(b, v, q))) & valid[:, cols].view(b, v, q)
    return _segment_any(mask != valid, cv, v) | new.any(dim=2)


def realign_batch_refs(key, refs: list, consts: Constants, stops=None) -> list:
    """Per ref, [B] bool: ``realign_flags`` of its rows, every view of one key at once
    (views of other widths padded on the left with invalid slots)."""
    profile, _, t, device, _ = key
    holes = profile == "holes"
    if len(refs) > 1 and all(r.size == refs[0].size for r in refs):
        return list(_realign_side_by_side(profile, refs, consts, device).unbind(1))
    w = max(r.facts[0] for r in refs)
    # [N, 3, W]: tokens, positions, valid (1/0; -1 on the padding: no slot of the view)
    slots = _cat([torch.nn.functional.pad(x, (w - x.shape[2], 0), value=-1)
                  if x.shape[2] != w else x
                  for x in (torch.stack([r.tensors[0], r.tensors[1], r.tensors[2].long()], 1)
                            for r in refs)])
    out = _cat([r.tensors[3] for r in refs])
    n, pl, g = (_cat([r.tensors[i] for r in refs]) for i in (4, 5, 6))
    if holes:
        extra = _cat([r.tensors[7] for r in refs]).bool()
    else:  # the minimal-width rule: max(lengths) = W, per view (W: its real slots); grouped,
        width = (slots[:, 2] >= 0).sum(dim=1)  # n = W per row
        extra = (_per_view(refs, n, lambda x: x.amax(dim=1)) if profile == "contiguous"
                 else n) != width
    prompts = _cat([r.own[0] for r in refs])
    found = None if refs[0].own[1] is None else _cat([r.own[1] for r in refs])
    flags = realign_flags(holes, slots[:, 0], slots[:, 2] == 1, slots[:, 1], n, pl, g, out,
                          prompts, found, extra, consts=consts, device=device)
    return _split_back(flags, refs, list(range(len(refs))))


def forward_refer(f: Facts, table=None):
    """``forward_evidence`` by reference: (key, Refs) or None."""
    v, fw = f.view, f.view.forward
    if fw is None or v.phase != "verify" or v.draft_limit is None or v.drafts is None:
        return None
    b, c, q = f.B, fw.cache_width, fw.input_ids.shape[-1]
    span = c + q
    w = v.tokens.shape[1]
    m, pos = fw.attention_mask, fw.positions
    ds = v.drafts.shape  # (torch.Size equals the tuple of its sizes)
    if m.shape != (b, span) or v.valid.shape != (b, w) or len(ds) != 2 or ds[0] != b \
            or span != w + ds[1] or fw.input_ids.shape != (b, q) or pos.dim() != 2 \
            or pos.shape[0] not in (1, b) or pos.shape[1] != q \
            or v.draft_limit.shape != (b,) or c < 0 or c > w:
        return None
    refs = _refs((fw.input_ids, pos, v.tokens, v.drafts, v.draft_limit, m, v.valid), (),
                 (span, c, w), b)
    return None if refs is None else ((q, f.device), refs)


def forward_batch_refs(key, refs: list, consts: Constants, stops=None) -> list:
    """Per ref, [B] bool: ``forward_flags`` of its rows, every forward of one q at once
    (masks of other widths padded on the left with columns False in mask and valid)."""
    q, device = key
    if len(refs) > 1 and all(r.size == refs[0].size for r in refs):
        return list(_forward_side_by_side(refs, q, consts, device).unbind(1))
    s_max = max(r.facts[0] for r in refs)
    flags, new = [], []
    for r in refs:
        span, c, w = r.facts
        mask, valid = r.tensors[5], r.tensors[6]
        part = torch.stack([mask if mask.dtype == torch.bool else mask.bool(), torch.cat(
            [valid if valid.dtype == torch.bool else valid.bool(),
             consts.ones(r.size, span - w, device)], 1)], 1)
        flags.append(part if span == s_max
                     else torch.nn.functional.pad(part, (s_max - span, 0)))
        new.append(r.tensors[2][:, c:])
    flags = _cat(flags)
    ids = _cat([r.tensors[0] for r in refs])
    pos = _cat([r.tensors[1] if r.tensors[1].shape[0] == r.size
                else r.tensors[1].expand(r.size, q) for r in refs])
    toks = torch.cat([_cat(new), _cat([r.tensors[3] for r in refs])], 1) \
        if all(r.tensors[2].shape[1] - r.facts[1] == new[0].shape[1] for r in refs) \
        else _cat([torch.cat([x, r.tensors[3]], 1) for x, r in zip(new, refs)])
    lim = _cat([r.tensors[4] for r in refs])
    got = forward_flags(flags[:, 0], flags[:, 1], ids, pos, toks, lim, consts=consts,
                        device=device)
    return _split_back(got, refs, list(range(len(refs))))

FUSIONS = (
    Fusion(("I3.forward", "I4.mask"), _fused_forward_phase, forward_evidence, forward_batch,
           refer=forward_refer, batch_refs=forward_batch_refs),
    Fusion(("I6.state", "I6.history", "I6.commit"), _fused_commit_phase, commit_evidence,
           commit_batch, snapshot=True, refer=commit_refer, batch_refs=commit_batch_refs,
           rowwise=True),
    Fusion(("I6.state", "I6.history"), _fused_realign_state, state_evidence, state_batch,
           refer=state_refer, batch_refs=state_batch_refs, rowwise=True),
    Fusion(("I2.contiguous", "I3.positions", "I6.sequence"), _fused_contiguous_realign,
           realign_evidence, realign_batch, refer=realign_refer,
           batch_refs=realign_batch_refs),
    Fusion(("I2.holes", "I2.holes_pending", "I3.positions", "I6.sequence"), _fused_holes_realign,
           functools.partial(realign_evidence, profile="holes"), realign_batch,
           refer=functools.partial(realign_refer, profile="holes"),
           batch_refs=realign_batch_refs),
    Fusion(("I2.grouped", "I3.positions", "I6.sequence"), _fused_grouped_realign,
           functools.partial(realign_evidence, profile="grouped"), realign_batch,
           refer=functools.partial(realign_refer, profile="grouped"),
           batch_refs=realign_batch_refs),
)

# ---------------------------------------------------------------------------------------
# The groups, in the order the Monitor checks them
# ---------------------------------------------------------------------------------------

GROUPS = (
    Group("I1.shapes", "I1", I1_RULES, None, host_ok=_i1_ok),
    Group("I2.contiguous", "I2", (R_N_RANGE, R_CONTIGUOUS, R_MINIMAL),
          ("profile", "valid", "lengths"), lambda v: v.profile == "contiguous", _fused_contiguous),
    Group("I2.holes", "I2", (R_N_RANGE, R_HOLES_COUNT), ("profile", "valid", "lengths"),
          lambda v: v.profile == "holes", _fused_holes),
    # its own group: a commit brings new finished flags, and only this rule reads them
    Group("I2.holes_pending", "I2", (R_HOLES_PENDING,), ("profile", "valid", "finished"),
          lambda v: v.profile == "holes", _fused_holes_pending),
    Group("I2.grouped", "I2", (R_N_RANGE, R_GROUPED), ("profile", "valid", "lengths"),
          lambda v: v.profile == "grouped", _fused_grouped),
    Group("I3.positions", "I3", (R_POSITIONS,), ("valid", "positions"), fused=_fused_positions),
    Group("I3.forward", "I3", (R_FORWARD_POSITIONS,), ("forward", "draft_limit", "phase"),
          lambda v: v.forward is not None, _fused_forward_positions),
    Group("I4.mask", "I4", I4_RULES, ("forward", "tokens", "valid", "drafts", "phase"),
          lambda v: v.forward is not None, _fused_mask),
    Group("I4.window", "I4", I4_WINDOW_RULES, ("forward", "draft_limit", "phase"),
          lambda v: v.forward is not None, _window_mask),
    Group("I6.state", "I6", I6_STATE_RULES, _STATE, fused=_fused_state),
    Group("I6.history", "I6", I6_HISTORY_RULES, _HISTORY, fused=_fused_history),
    Group("I6.commit", "I6", I6_COMMIT_RULES, None,
          lambda v: v.phase == "commit" and v.committed is not None, _fused_commit),
    # at commit the tokens are still those of before it (checked then); what the commit
    # appends is checked by the commit rules, the tokens at realign
    Group("I6.sequence", "I6", I6_SEQUENCE_RULES, _SEQUENCE, lambda v: v.phase != "commit",
          _fused_sequence),
)

# ---------------------------------------------------------------------------------------
# guard_model: the rules of one forward (I1 cache, I3 positions, I4 mask)
# ---------------------------------------------------------------------------------------

@dataclass
class ForwardFacts:
    """One guarded forward as the guard sees it before it runs."""

    # rows and new tokens of the inputs
    b: int
    q: int
    # cache length of every layer before the forward (host ints), C = the first
    lengths: list
    # batch size of every initialised cache layer (host ints)
    sizes: list
    # [B or 1, q] or [q] long: an explicit cache_position, or None
    cache_position: torch.Tensor | None
    # the attention mask as given (any shape, or not a tensor), or None
    mask: object
    # [B, C + q] the 2-D mask when its shape fits (its first C + q columns, when it is wider),
    # else None
    mask2d: torch.Tensor | None
    # [B or 1, q] long: the positions the model uses (explicit, or its own default), or
    # None when they are not interpreted (3-D rope, odd shapes)
    positions: torch.Tensor | None
    implicit: bool
    device: torch.device
    # the model's positions are relative (RoPE, ALiBi) and the guard was not asked for
    # exact positions: implicit positions then only need a constant offset per row
    relative: bool = False
    # [B, K - C - q] the columns of a 2-D mask wider than C + q (a bucketed key width,
    # specdec's static shapes: the cache attends K >= C + q slots), else None
    tail: torch.Tensor | None = None

    @property
    def c(self) -> int:
        return self.lengths[0] if self.lengths else 0

    def words(self) -> dict:
        m = self.mask if isinstance(self.mask, torch.Tensor) and self.mask.dim() else None
        return {"lengths": self.lengths, "b": self.b, "sizes": sorted(set(self.sizes)),
                "c": self.c, "q": self.q, "cq": self.c + self.q,
                "mw": None if m is None else m.shape[-1], "mb": None if m is None else m.shape[0]}

    def arange(self, device) -> torch.Tensor:  # [q] long: C .. C + q - 1
        return torch.arange(self.q, device=device) + self.c


def _cache_position_mask(ff: ForwardFacts):
    cp = ff.cache_position
    if cp is None or cp.shape[-1] != ff.q:
        return None
    return (cp.reshape(-1, ff.q) != ff.arange(cp.device)).any(dim=1).expand(ff.b)


def _guard_position_slots(ff: ForwardFacts):
    """[B, C + q] bool over the mask's columns: new tokens at a wrong position."""
    if ff.mask2d is None or ff.positions is None:
        return None
    bad = P.forward_position_slots(ff.mask2d, ff.positions, ff.c)
    return torch.cat([torch.zeros(bad.shape[0], ff.c, dtype=torch.bool, device=bad.device), bad],
                     dim=1)


def _guard_positions(implicit: bool):
    def mask(ff: ForwardFacts):
        if ff.mask2d is None or ff.positions is None or ff.implicit != implicit \
                or (implicit and ff.relative):
            return None
        return P.forward_position_slots(ff.mask2d, ff.positions, ff.c).any(dim=1)
    return mask


def _shifted_slots(ff: ForwardFacts):
    """[B, C + q] bool: valid new tokens whose implicit position (its slot) minus the
    valid slots before it differs from that of the row's first valid slot: a hole or
    padding between valid slots changes relative distances."""
    if ff.mask2d is None or not ff.implicit or not ff.relative:
        return None
    valid = ff.mask2d.bool()
    s = valid.shape[1]
    offset = torch.arange(s, device=valid.device)[None, :] - P.valid_before(valid)
    first = torch.where(valid, offset, s).amin(dim=1, keepdim=True)
    bad = valid[:, ff.c:] & (offset[:, ff.c:] != first)
    return torch.cat([torch.zeros(bad.shape[0], ff.c, dtype=torch.bool, device=bad.device), bad],
                     dim=1)


def _guard_shifted(ff: ForwardFacts):
    bad = _shifted_slots(ff)
    return None if bad is None else bad.any(dim=1)


def _guard_positions_no_mask(ff: ForwardFacts):
    if ff.positions is None or ff.mask is not None or ff.implicit:
        return None
    return (ff.positions != ff.arange(ff.positions.device)).any(dim=1).expand(ff.b)


_GUARD_LINES = ("mask", "pos", "want")

GUARD_RULES = (
    Rule("guard.cache_lengths", "I1", "every cache layer has the same length (layer lengths {lengths})",
         ("cache",), host=lambda ff: len(set(ff.lengths)) > 1,
         slots=_guard_position_slots, columns="forward", lines=_GUARD_LINES),
    Rule("guard.cache_batch", "I1",
         "every cache layer has the batch size of the inputs ({b}; layers have {sizes})",
         ("cache", "input_ids"), host=lambda ff: any(s != ff.b for s in ff.sizes),
         slots=_guard_position_slots, columns="forward", lines=_GUARD_LINES),
    Rule("guard.cache_position", "I1", "cache_position = cache length + arange(new tokens)",
         ("cache_position", "cache"),
         host=lambda ff: ff.cache_position is not None and ff.cache_position.shape[-1] != ff.q,
         mask=_cache_position_mask, slots=_guard_position_slots, columns="forward",
         lines=_GUARD_LINES),
    Rule("guard.mask_width", "I4",
         "the 2-D attention mask has width cache length + new tokens (or more, see "
         "guard.mask_tail): got {mw}, cache length {c} + {q} new tokens = {cq}",
         ("attention_mask", "cache"),
         host=lambda ff: isinstance(ff.mask, torch.Tensor) and ff.mask.dim() == 2
         and ff.mask.shape[1] < ff.c + ff.q,
         slots=_guard_position_slots, columns="forward", lines=_GUARD_LINES),
    Rule("guard.mask_batch", "I4", "the attention mask has one row per input row: {mb} rows for {b}",
         ("attention_mask", "input_ids"),
         host=lambda ff: isinstance(ff.mask, torch.Tensor) and ff.mask.dim() == 2
         and ff.mask.shape[1] >= ff.c + ff.q and ff.mask.shape[0] != ff.b,
         slots=_guard_position_slots, columns="forward", lines=_GUARD_LINES),
    Rule("guard.positions_explicit", "I3",
         "the position_ids of every valid new token = number of valid mask slots before it",
         ("position_ids", "attention_mask", "cache"), mask=_guard_positions(False),
         slots=_guard_position_slots, columns="forward", lines=_GUARD_LINES),
    Rule("guard.positions_implicit", "I3",
         "positions left implicit: the model uses cache length + arange(new tokens), which "
         "must equal the number of valid mask slots before each new token (it does not with "
         "padding or holes: pass position_ids)", ("attention_mask", "cache"),
         mask=_guard_positions(True), slots=_guard_position_slots, columns="forward",
         lines=_GUARD_LINES),
    Rule("guard.positions_relative", "I3",
         "positions left implicit on a relative-position model: every valid slot of a row "
         "must keep the same offset between its slot and the valid slots before it (a hole "
         "or padding before a new token changes relative distances: pass position_ids)",
         ("attention_mask", "cache"), mask=_guard_shifted, slots=_shifted_slots,
         columns="forward", lines=_GUARD_LINES, slot_priority=1),
    Rule("guard.positions_no_mask", "I3",
         "without an attention mask every slot is valid, so position_ids must be cache "
         "length + arange(new tokens)", ("position_ids", "cache"),
         mask=_guard_positions_no_mask, slots=_guard_position_slots, columns="forward",
         lines=_GUARD_LINES),
    Rule("guard.mask_tail", "I4",
         "a 2-D attention mask wider than cache length + new tokens (a bucketed key width: "
         "the cache attends that many slots) masks every column past them: every column "
         "from {cq} on (width {mw}) must be 0", ("attention_mask", "cache"),
         mask=lambda ff: None if ff.tail is None else ff.tail.bool().any(dim=1),
         slots=_guard_position_slots, columns="forward", lines=_GUARD_LINES),
)

GROUPS_BY_NAME = {g.name: g for g in GROUPS}
#: groups that need monitor state: they run only when it exists
NEEDS = {"I6.history": "prev"}

#: every rule record: the Monitor's groups, the deep rules, then guard_model's
RULES = tuple(dict.fromkeys([r for g in GROUPS for r in g.rules] + [R_KV, R_REFERENCE]
                            + list(GUARD_RULES)))
RULES_BY_ID = {r.id: r for r in RULES}
INVARIANT_RULES = {inv: tuple(r for r in RULES if r.invariant == inv and r not in GUARD_RULES)
                   for inv in ("I1", "I2", "I3", "I4", "I5", "I6", "I7")}


def group_applies(group: Group, facts: Facts) -> bool:
    need = NEEDS.get(group.name)
    return group.applies(facts.view) and (need is None or facts.dep(need) is not None)


def rule_masks(group: Group, facts: Facts) -> list:
    """[(rule, [B] bool mask)] of the group's rules that apply, in order (host rules:
    only when broken, as a whole-batch mask)."""
    out = []
    v = facts.view
    for r in group.rules:
        if not r.applies(v):
            continue
        if r.host is not None:
            if r.host(v):
                out.append((r, torch.ones(facts.B, dtype=torch.bool, device=facts.device)))
            continue
        m = r.mask(facts)
        if m is not None:
            out.append((r, m))
    return out


def evaluate(view: StepView, invariants=("I1", "I2", "I3", "I4", "I6"), *, groups=None,
             stops=None, prev=None, prompts=None) -> dict:
    """{sentence: [B] bool mask} of every rule of ``invariants`` (or of the named
    ``groups``) that applies to ``view``, definitional (rule by rule)."""
    facts = Facts(view, stops=stops, prev=prev, prompts=prompts)
    out = {}
    for g in GROUPS:
        if g.invariant not in invariants or (groups is not None and g.name not in groups):
            continue
        if not group_applies(g, facts):
            continue
        for r, m in rule_masks(g, facts):
            out[r.text(view)] = m
    return out


def slot_rule(rules) -> Rule | None:
    """The rule whose slots a violation shows: the highest ``slot_priority`` among the
    failing rules that have slots, the first in order on a tie."""
    best = None
    for r in rules:
        if r.slots is not None and (best is None or r.slot_priority > best.slot_priority):
            best = r
    return best


__all__ = ["COLUMNS", "Rule", "Group", "Fusion", "FUSIONS", "Facts", "Constants", "GROUPS", "GROUPS_BY_NAME",
           "commit_flags", "commit_evidence", "commit_batch", "CommitEvidence", "forward_flags",
           "forward_evidence", "forward_batch", "ForwardEvidence", "realign_flags",
           "realign_evidence", "realign_batch", "RealignEvidence",
           "RULES", "RULES_BY_ID", "INVARIANT_RULES", "R_KV", "R_REFERENCE", "GUARD_RULES",
           "ForwardFacts", "evaluate",
           "rule_masks", "slot_rule", "group_applies", "words"]


# ---------------------------------------------------------------------------------------
# Per-invariant API over the rule records
# ---------------------------------------------------------------------------------------

def _rules_of(view: StepView, invariant: str, **state) -> dict[str, torch.Tensor]:
    return evaluate(view, (invariant,), **state)


def i1_failures(view: StepView) -> list[str]:
    """The I1 rules the view breaks: shapes and cache widths are host facts, so this reads
    nothing from the device and launches nothing."""
    return [r.text(view) for r in INVARIANT_RULES["I1"] if r.applies(view) and r.host(view)]


def i1_rules(view: StepView) -> dict[str, torch.Tensor]:
    """The broken I1 rules as whole-batch masks (only broken rules are listed)."""
    return _rules_of(view, "I1")


def i1_alignment(view: StepView) -> torch.Tensor:
    return P.or_rows(i1_rules(view), view)


def i2_rules(view: StepView) -> dict[str, torch.Tensor]:
    if view.profile not in P.PROFILES:
        raise ValueError(f"unknown layout profile {view.profile!r}; expected one of {P.PROFILES}")
    return _rules_of(view, "I2")


def i2_layout(view: StepView) -> torch.Tensor:
    return P.or_rows(i2_rules(view), view)


def i3_view_rules(view: StepView) -> dict[str, torch.Tensor]:
    return evaluate(view, ("I3",), groups=("I3.positions",))


def i3_forward_rules(view: StepView) -> dict[str, torch.Tensor]:
    return evaluate(view, ("I3",), groups=("I3.forward",))


def i3_rules(view: StepView) -> dict[str, torch.Tensor]:
    return _rules_of(view, "I3")


def i3_positions(view: StepView) -> torch.Tensor:
    return P.or_rows(i3_rules(view), view)


def i4_rules(view: StepView) -> dict[str, torch.Tensor]:
    return _rules_of(view, "I4")


def i4_mask(view: StepView) -> torch.Tensor:
    return P.or_rows(i4_rules(view), view)


def _i6(view: StepView, group: str, stops=None, prev=None, prompts=None):
    return evaluate(view, ("I6",), groups=(group,), stops=stops, prev=prev, prompts=prompts)


def i6_state_rules(view: StepView, stops=None) -> dict[str, torch.Tensor]:
    """Budgets, stop tokens and finishing: a function of output, generated, finished."""
    return _i6(view, "I6.state", stops=stops)


def i6_history_rules(view: StepView, prev: P.Snapshot | None) -> dict[str, torch.Tensor]:
    """Against the last snapshot: no retroactive change, growth only at commit."""
    return _i6(view, "I6.history", prev=prev)


def i6_commit_rules(view: StepView, stops=None, prev: P.Snapshot | None = None
                    ) -> dict[str, torch.Tensor]:
    """The commit of this step: greedy acceptance and what it appends (commit only)."""
    return _i6(view, "I6.commit", stops=stops, prev=prev)


def i6_sequence_rules(view: StepView, prompts: P.Prompts | None) -> dict[str, torch.Tensor]:
    """The row's real tokens are prompt ++ output, and n[b] counts exactly those."""
    return _i6(view, "I6.sequence", prompts=prompts)


def i6_rules(view: StepView, *, stops=None, prev: P.Snapshot | None = None,
             prompts: P.Prompts | None = None) -> dict[str, torch.Tensor]:
    return _rules_of(view, "I6", stops=stops, prev=prev, prompts=prompts)


def i6_conservation(view: StepView, **state) -> torch.Tensor:
    return P.or_rows(i6_rules(view, **state), view)
