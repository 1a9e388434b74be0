"""The invariants I1-I7 (DESIGN.md) as tensor predicates: helpers, state, per-invariant API.

The rules themselves are records in ``rules.py`` (id, invariant, sentence, the tensors
they read, mask and slots functions); this module holds what they are built from and the
per-invariant API over them:

- ``iN_rules(view, ...) -> dict[sentence, mask]``: one ``[B]`` bool mask per rule that
  applies to the view, True on the rows that break it (host-fact rules, such as I1's
  shapes, are listed only when broken);
- ``iN_...(view, ...) -> mask``: the OR of its rules, ``[B]`` bool.

Masks live on the view's device. The cheap invariants (I1-I4, I6) are pure tensor ops:
no ``.item()``, no ``bool(tensor)``, no boolean indexing, no host copy or upload, so a GPU
engine can run them every phase (see ``Monitor``; ``invariants.testing`` proves it on a
CPU). Facts the host already knows (shapes, cache widths) are compared on the host. The
deep invariants (I5 KV recompute, I7 reference comparison) run model forwards and read
values on the host; they are meant for ``mode="deep"``.

Tensor-level helpers (``position_slots``, ``forward_position_slots``,
``contiguous_layout_slots``) take plain tensors so that ``guard`` reuses them.

Slots of a violation: ``*_slots`` helpers give ``[B, X]`` masks over the view's slots (I2,
I3), over the forward's mask columns (I4) or over output indices (I6).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .view import PROFILES, StepView

#: default tolerances of I5 (KV recompute) per cache dtype: (atol, rtol) for allclose
KV_TOLERANCE = {
    torch.float32: (1e-4, 1e-3),
    torch.float64: (1e-8, 1e-6),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (5e-2, 5e-2),
}

INVARIANTS = ("I1", "I2", "I3", "I4", "I5", "I6", "I7")
#: the invariants that are tensor ops only (cheap, no host transfer)
CHEAP = ("I1", "I2", "I3", "I4", "I6")
#: the invariants that recompute with the model (deep mode)
DEEP = ("I5", "I7")
#: more stop ids than this are matched with ``isin`` against a device tensor
STOP_COMPARES = 4


# ---------------------------------------------------------------------------------------
# State a monitor keeps between phases (device tensors, one packed table each)
# ---------------------------------------------------------------------------------------

def _long(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.long else t.long()


def _source(row_ids: torch.Tensor):
    """(tensor, version) identifying the rows a table was built from; None for tensors
    without a version counter (inference mode): they never match."""
    try:
        return (row_ids, row_ids._version)
    except RuntimeError:
        return None


def same_rows(source, row_ids: torch.Tensor) -> bool:
    """True when ``row_ids`` is the very tensor ``source`` recorded, unmodified since."""
    if source is None or source[0] is not row_ids:
        return False
    try:
        return row_ids._version == source[1]
    except RuntimeError:
        return False


def _merged(cls, new, old, capacity: int):
    """``new`` (a view's rows) before ``old``'s entries, cut to ``max(capacity, B)``.

    When the view holds the very rows ``old``'s newest entries came from (same request-id
    tensor, unmodified), those entries are simply replaced (two ops); otherwise
    ``remember_newest`` orders the entries (no host sync either way)."""
    if old is None:
        return new
    a, b = new.table, old.table
    if a.shape[1] != b.shape[1]:  # rows of different output (prompt) widths: zero-pad
        w = max(a.shape[1], b.shape[1])
        a, b = (torch.nn.functional.pad(x, (0, w - x.shape[1])) for x in (a, b))
    n = a.shape[0]
    cut = max(capacity, n)
    if old.newest == n and old.source is not None and new.source is not None \
            and old.source[0] is new.source[0] and old.source[1] == new.source[1]:
        table = torch.cat([a, b[n:]]) if b.shape[0] > n else a
        if table.shape[0] > cut:
            table = table[:cut]
    else:
        keep = remember_newest(a[:, 0], b[:, 0], capacity)
        table = torch.cat([a, b]).index_select(0, keep)
    return cls(table, new.source, n)


@dataclass(frozen=True)
class _RowTable:
    """Per-request state a monitor remembers, one long row per request, newest first
    (column 0: the request id). ``source``/``newest``: the first ``newest`` entries are
    the rows of the view whose ``row_ids`` tensor (and its version) ``source`` holds, in
    order, so a later view with that very tensor finds its rows without a search."""

    # [R, X] long
    table: torch.Tensor
    # (row_ids tensor, version) of the view the newest entries came from, or None
    source: tuple | None
    # entries that came from that view
    newest: int

    @property
    def row_ids(self) -> torch.Tensor:  # [R] long
        return self.table[:, 0]

    @classmethod
    def of(cls, view: StepView):  # pragma: no cover - abstract
        raise NotImplementedError

    @classmethod
    def remember(cls, old, view: StepView, capacity: int = 0, now=None):
        """``old`` with the view's rows replacing their older entries; rows the view does
        not hold are remembered (a scheduler such as EXSPEC serves a different group each
        step). Keeps the ``max(capacity, B)`` newest entries (``remember_newest``).
        ``now``: ``cls.of(view)`` when the caller built it already."""
        return _merged(cls, cls.of(view) if now is None else now, old, capacity)


@dataclass(frozen=True)
class Snapshot(_RowTable):
    """Output state after the last prefill or commit, for I6 (no retroactive change):
    columns request id, generated, finished (0/1), then the output ``[R, 3 + T]``."""

    @property
    def generated(self) -> torch.Tensor:  # [R] long
        return self.table[:, 1]

    @property
    def finished(self) -> torch.Tensor:  # [R] bool
        return self.table[:, 2] != 0

    @property
    def output(self) -> torch.Tensor:  # [R, T] long
        return self.table[:, 3:]

    @classmethod
    def of(cls, view: StepView) -> "Snapshot":
        head = torch.stack([_long(view.row_ids), _long(view.generated),
                            _long(view.finished)], dim=1)
        return cls(torch.cat([head, _long(view.output)], dim=1), _source(view.row_ids),
                   view.batch_size)


@dataclass(frozen=True)
class Prompts(_RowTable):
    """The prompt of every row at prefill, for I6 (prompt ++ output): columns request
    id, prompt length, then the prompt tokens left-aligned (compact; zeros past the
    length) ``[R, 2 + P]``."""

    @property
    def lengths(self) -> torch.Tensor:  # [R] long
        return self.table[:, 1]

    @property
    def tokens(self) -> torch.Tensor:  # [R, P] long
        return self.table[:, 2:]

    @classmethod
    def of(cls, view: StepView) -> "Prompts":
        valid = view.valid if view.valid.dtype == torch.bool else view.valid.bool()
        head = torch.stack([_long(view.row_ids), valid.sum(dim=1)], dim=1)
        return cls(torch.cat([head, _long(compact(view.tokens, valid))], dim=1),
                   _source(view.row_ids), view.batch_size)


def remember_newest(newer: torch.Tensor, older: torch.Tensor, capacity: int) -> torch.Tensor:
    """Which entries of ``cat([newer, older])`` (request ids, [N] and [M]) a monitor keeps:
    all of ``newer``, then the entries of ``older`` whose id ``newer`` lacks, in their
    order (newest first), then the superseded ones, cut at ``max(capacity, N)`` entries.
    Fixed sizes, no host sync: a superseded entry that survives the cut sits behind its
    replacement, and ``match_rows`` returns the first match."""
    n, m = newer.shape[0], older.shape[0]
    stale = (older[:, None] == newer[None, :]).any(dim=1) if n and m else \
        torch.zeros(m, dtype=torch.bool, device=older.device)
    rank = torch.cat([torch.zeros(n, dtype=torch.long, device=older.device), 1 + stale.long()])
    return torch.argsort(rank, stable=True)[: max(capacity, n)]


def compact(tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, W] -> [B, W]: each row's valid tokens moved to the front, order kept (zeros
    after them). A scatter by rank, no sort: invalid slots land in a dropped column."""
    b, w = tokens.shape
    dest = torch.where(valid, valid_before(valid), w)
    out = tokens.new_zeros(b, w + 1)
    out.scatter_(1, dest, tokens)
    return out[:, :w]


def match_rows(row_ids: torch.Tensor, known: torch.Tensor):
    """Where each current row sits in an earlier state, by request id (no host sync).

    Returns (index [B] long, found [B] bool); index is 0 where not found.
    """
    eq = row_ids[:, None] == known[None, :]
    if eq.shape[1] == 0:
        z = torch.zeros_like(row_ids)
        return z, torch.zeros_like(row_ids, dtype=torch.bool)
    return eq.long().argmax(dim=1), eq.any(dim=1)


def any_rule(rules: dict) -> torch.Tensor | None:
    masks = list(rules.values())
    if not masks:
        return None
    out = masks[0]
    for m in masks[1:]:
        out = out | m
    return out


def or_rows(rules: dict, view: StepView) -> torch.Tensor:
    """The OR of a rule dict's [B] masks (all False when it is empty)."""
    out = any_rule(rules)
    if out is None:
        return torch.zeros(view.batch_size, dtype=torch.bool, device=view.device)
    return out


# ---------------------------------------------------------------------------------------
# Tensor-level helpers (shared with guard)
# ---------------------------------------------------------------------------------------

def valid_before(valid: torch.Tensor) -> torch.Tensor:
    """[B, W] long: number of valid slots strictly before each slot."""
    v = valid.long()
    return v.cumsum(dim=1) - v


def position_slots(valid: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """I3 over slots: [B, W] bool, True at valid slots whose position is not the number of
    valid slots before them."""
    valid = valid.bool()
    return valid & (positions != valid_before(valid))


def forward_position_slots(mask: torch.Tensor, positions: torch.Tensor,
                           cache_width: int) -> torch.Tensor:
    """I3 for the new tokens of a forward: [B, q] bool, True where new token ``i`` (mask
    column ``cache_width + i``) is valid but its position is not the number of valid
    mask columns before it. ``positions`` may be [1, q] (broadcast)."""
    mask = mask.bool()
    q = positions.shape[-1]
    want = valid_before(mask)[:, cache_width : cache_width + q]
    new_valid = mask[:, cache_width : cache_width + q]
    return new_valid & (positions != want)


def contiguous_layout_slots(valid: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """I2 contiguous over slots: [B, W] bool, True where valid differs from 0^(W-n) 1^n."""
    w = valid.shape[1]
    j = torch.arange(w, device=valid.device)[None, :]
    return valid.bool() != (j >= (w - lengths)[:, None])


def stop_mask(tokens: torch.Tensor, stops) -> torch.Tensor:
    """[...] bool: which of ``tokens`` are stop ids. ``stops``: host ints (each compared
    as a kernel argument: no upload) or a device tensor of ids (``isin``)."""
    if isinstance(stops, torch.Tensor):
        if stops.numel() == 0:
            return torch.zeros_like(tokens, dtype=torch.bool)
        return torch.isin(tokens, stops)
    stops = tuple(stops or ())
    if not stops:
        return torch.zeros_like(tokens, dtype=torch.bool)
    out = tokens == stops[0]
    for s in stops[1:]:
        out = out | (tokens == s)
    return out


def stop_tensor(view: StepView) -> torch.Tensor:
    """The view's stop ids as a device tensor built by fill kernels (``torch.full``), not
    from a host list (a pageable host->device copy would synchronise the stream)."""
    ids = [int(s) for s in view.stop_token_ids]
    if not ids:
        return torch.empty(0, dtype=torch.long, device=view.device)
    return torch.cat([torch.full((1,), s, dtype=torch.long, device=view.device) for s in ids])


def stop_ids(view: StepView, stops=None):
    """What ``stop_mask`` compares with: ``stops`` when given (a tensor or host ints);
    else the view's host ids, or a device tensor (``stop_tensor``) past
    ``STOP_COMPARES`` ids."""
    if stops is not None:
        return stops
    ids = tuple(int(s) for s in view.stop_token_ids)
    return stop_tensor(view) if len(ids) > STOP_COMPARES else ids


def consumed(view: StepView) -> torch.Tensor | None:
    """[B] long: outputs already laid into the tokens (generated_before at commit, whose
    tokens are still those of before the commit)."""
    if view.phase == "commit":
        return view.generated_before if view.generated_before is not None else None
    return view.generated


# ---------------------------------------------------------------------------------------
# Offending slots of a view ([B, X] bool), the "slots" of the rule records
# ---------------------------------------------------------------------------------------

def layout_slots(view: StepView) -> torch.Tensor:
    """[B, W] bool: slots that break the view's layout profile."""
    valid = view.valid.bool()
    if view.profile == "contiguous":
        return contiguous_layout_slots(valid, view.lengths)
    if view.profile == "grouped":
        return ~valid
    if view.profile == "holes":
        j = torch.arange(view.width, device=view.device)[None, :]
        return (j == view.width - 1) & (~valid[:, -1:] & ~view.finished.bool()[:, None])
    raise ValueError(f"unknown layout profile {view.profile!r}; expected one of {PROFILES}")


def forward_checked_slots(view: StepView) -> torch.Tensor | None:
    """[B, q] bool: new tokens of the recorded forward whose position I3 checks (at verify,
    the pending token and the drafts a row may use; later drafts are never accepted and
    their positions may be clamped to the context)."""
    f = view.forward
    if f is None:
        return None
    q = f.input_ids.shape[-1]
    if view.phase in ("verify", "commit") and view.draft_limit is not None:
        i = torch.arange(q, device=view.device)[None, :]
        return i <= view.draft_limit[:, None]
    return torch.ones(view.batch_size, q, dtype=torch.bool, device=view.device)


def forward_slots(view: StepView) -> torch.Tensor | None:
    """[B, q] bool: new tokens of the recorded forward at a wrong position (None when the
    mask is narrower than the forward: I4 reports that)."""
    f = view.forward
    if f is None or f.attention_mask.shape[-1] < f.cache_width + f.input_ids.shape[-1]:
        return None
    bad = forward_position_slots(f.attention_mask, f.positions, f.cache_width)
    return bad & forward_checked_slots(view)


def extended(view: StepView):
    """tokens and valid extended by the drafts (valid), [B, W + k] at verify/commit."""
    tokens, valid = view.tokens, view.valid.bool()
    if view.drafts is not None and view.phase in ("verify", "commit"):
        tokens = torch.cat([tokens, view.drafts], dim=1)
        valid = torch.cat([valid, torch.ones_like(view.drafts, dtype=torch.bool)], dim=1)
    return tokens, valid


def mask_slots(view: StepView) -> torch.Tensor | None:
    """[B, C + q] bool: mask columns of the recorded forward that differ from the slot
    validity they stand for (cache slots: valid; new tokens: valid, drafts always valid).
    None when the widths do not even match (a whole-row I4 failure)."""
    f = view.forward
    if f is None:
        return None
    _, valid = extended(view)
    span = f.cache_width + f.input_ids.shape[-1]
    mask = f.attention_mask
    if mask.dim() != 2 or mask.shape[1] != span or span > valid.shape[1] \
            or mask.shape[0] != view.batch_size:
        return None
    return mask.bool() != valid[:, :span]


def sequence_slots(view: StepView, prompts: Prompts | None) -> torch.Tensor | None:
    """[B, W] bool: valid slots whose token is not the row's prompt ++ output at that
    rank (None without a prompt snapshot)."""
    if prompts is None:
        return None
    used = consumed(view)
    if used is None:
        return None
    valid = view.valid.bool()
    idx, found = match_rows(view.row_ids, prompts.row_ids)
    rank = valid_before(valid)
    p = view.prompt_lengths[:, None]
    ptoks = prompts.tokens.index_select(0, idx)
    from_prompt = ptoks.gather(1, rank.clamp(0, max(ptoks.shape[1] - 1, 0)))
    t = max(view.output.shape[1], 1)
    out = view.output if view.output.shape[1] else view.output.new_zeros(view.batch_size, 1)
    from_output = out.gather(1, (rank - p).clamp(0, t - 1))
    want = torch.where(rank < p, from_prompt, from_output)
    in_range = rank < (p + used[:, None])
    return valid & found[:, None] & in_range & (view.tokens != want)


def output_slots(view: StepView, stops=None) -> torch.Tensor:
    """[B, T] bool: output indices holding a stop token before the row's last output."""
    t = view.output.shape[1]
    col = torch.arange(t, device=view.device)[None, :]
    g = view.generated[:, None]
    return stop_mask(view.output, stop_ids(view, stops)) & (col < g - 1)


# ---------------------------------------------------------------------------------------
# I5 KV coherence (deep: model forwards, host reads)
# ---------------------------------------------------------------------------------------

def kv_tolerance(dtype: torch.dtype, atol: float | None = None, rtol: float | None = None):
    da, dr = KV_TOLERANCE.get(dtype, (1e-2, 1e-2))
    return (da if atol is None else atol), (dr if rtol is None else rtol)


def cached_slots(view: StepView) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, valid) of the cache slots, [B, C]: the view's slots, then at verify/commit
    the pending token and the drafts (only those a row may use count as valid)."""
    tokens, valid = extended(view)
    c = view.expected_cache_width()
    tokens, valid = tokens[:, :c], valid[:, :c]
    if view.phase in ("verify", "commit") and view.draft_limit is not None:
        j = torch.arange(c, device=view.device)[None, :]
        valid = valid & (j < view.width + view.draft_limit[:, None])
    return tokens, valid


@torch.no_grad()
def kv_mismatches(view: StepView, *, atol: float | None = None, rtol: float | None = None):
    """I5: per row, the cache slots whose K or V differ (beyond allclose) from a clean
    batch-1 prefill of the row's real tokens. Returns (mask [B] bool, slots per row)."""
    from ._hf import clean_prefill

    b = view.batch_size
    slots_out: list[list[int]] = [[] for _ in range(b)]
    if view.model is None or view.cache_tensors is None:
        return torch.zeros(view.batch_size, dtype=torch.bool, device=view.device), slots_out
    layers = view.cache_tensors()
    if not layers or layers[0][0] is None:
        return torch.zeros(view.batch_size, dtype=torch.bool, device=view.device), slots_out
    a, r = kv_tolerance(layers[0][0].dtype, atol, rtol)
    tokens, valid = cached_slots(view)
    c = min(tokens.shape[1], layers[0][0].shape[2])
    for row in range(b):  # deep mode: one clean prefill per row
        cols = torch.nonzero(valid[row, :c]).squeeze(1)
        if cols.numel() == 0:
            continue
        clean = clean_prefill(view.model, tokens[row, cols])
        bad = torch.zeros(cols.numel(), dtype=torch.bool, device=cols.device)
        for (ke, ve), (kc, vc) in zip(layers, clean):
            for eng, ref in ((ke[row][:, cols].to(kc.dtype), kc), (ve[row][:, cols].to(vc.dtype), vc)):
                close = torch.isclose(eng, ref, atol=a, rtol=r).all(dim=-1).all(dim=0)
                bad |= ~close
        slots_out[row] = cols[bad].tolist()
    mask = torch.tensor([bool(s) for s in slots_out], dtype=torch.bool, device=view.device)
    return mask, slots_out


__all__ = [
    "INVARIANTS", "CHEAP", "DEEP", "KV_TOLERANCE", "STOP_COMPARES", "Snapshot", "Prompts",
    "compact", "match_rows", "remember_newest", "same_rows", "valid_before", "position_slots",
    "forward_position_slots", "contiguous_layout_slots", "stop_mask", "stop_tensor",
    "stop_ids", "consumed", "layout_slots", "forward_checked_slots", "forward_slots",
    "extended", "mask_slots", "sequence_slots", "output_slots",
    "i3_rules",
    "i6_history_rules",
    "kv_tolerance",
    "cached_slots", "kv_mismatches", "any_rule", "or_rows",
]
