"""The invariants I1-I7 (DESIGN.md) as tensor predicates.

Every invariant ``In`` has two forms:

- ``iN_rules(view, ...) -> dict[rule, mask]``: one ``[B]`` bool mask per rule, True on the
  rows that break it; the rule is a sentence that states what must hold;
- ``iN_...(view, ...) -> mask``: the OR of its rules, ``[B]`` bool.

Masks live on the view's device. The cheap invariants (I1-I4, I6) are pure tensor ops:
no ``.item()``, no ``bool(tensor)``, no boolean indexing, no host copy, so a GPU engine can
run them every phase and reduce them to one flag (see ``Monitor``). Facts the host already
knows (shapes, cache widths) give whole-batch masks. The deep invariants (I5 KV
recompute, I7 reference comparison) run model forwards and read values on the host; they
are meant for ``mode="deep"``.

Tensor-level helpers (``position_slots``, ``forward_position_slots``,
``contiguous_layout_slots``) take plain tensors so that ``guard`` reuses them.

Slots of a violation: ``*_slots`` helpers give ``[B, W]`` masks over the view's slots (I2,
I3), over the forward's mask columns (I4) or over output indices (I6).
"""

from __future__ import annotations

import dataclasses
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


# ---------------------------------------------------------------------------------------
# State a monitor keeps between phases (device tensors)
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Snapshot:
    """Output state after the last prefill or commit, for I6 (no retroactive change)."""

    # [R] long
    row_ids: torch.Tensor
    # [R, T] long: a copy of the output
    output: torch.Tensor
    # [R] long
    generated: torch.Tensor
    # [R] bool
    finished: torch.Tensor

    @classmethod
    def of(cls, view: StepView) -> "Snapshot":
        return cls(view.row_ids.clone(), view.output.clone(), view.generated.clone(),
                   view.finished.clone())

    @classmethod
    def remember(cls, old: "Snapshot | None", view: StepView, capacity: int = 0) -> "Snapshot":
        """``old`` with the view's rows replacing their older entries; rows the view does
        not hold are remembered (a scheduler such as EXSPEC serves a different group each
        step). Keeps the ``max(capacity, B)`` newest entries (``remember_newest``)."""
        return _remembered(cls.of(view), old, capacity)


@dataclass(frozen=True)
class Prompts:
    """The prompt of every row at prefill, real tokens first, for I6 (prompt ++ output)."""

    # [R] long
    row_ids: torch.Tensor
    # [R, P] long: prompt tokens left-aligned (compact), garbage past lengths
    tokens: torch.Tensor
    # [R] long
    lengths: torch.Tensor

    @classmethod
    def of(cls, view: StepView) -> "Prompts":
        return cls(view.row_ids.clone(), compact(view.tokens, view.valid.bool()),
                   view.valid.long().sum(1))

    @classmethod
    def remember(cls, old: "Prompts | None", view: StepView, capacity: int = 0) -> "Prompts":
        """``old`` plus the rows the prefill ``view`` admits (replacing older entries of
        the same rows), keeping the ``max(capacity, B)`` newest (``remember_newest``)."""
        return _remembered(cls.of(view), old, capacity)


def _remembered(new, old, capacity: int):
    """Two row states (dataclasses whose first field is ``row_ids``; ``old`` may be None)
    merged: each field concatenated (2-D ones zero-padded to the wider) and cut to the
    entries ``remember_newest`` keeps."""
    if old is None:
        return new
    names = [f.name for f in dataclasses.fields(new)]
    keep = remember_newest(new.row_ids, old.row_ids, capacity)
    out = []
    for a, b in ((getattr(new, n), getattr(old, n)) for n in names):
        if a.dim() == 2:
            w = max(a.shape[1], b.shape[1])
            a, b = (torch.nn.functional.pad(x, (0, w - x.shape[1])) for x in (a, b))
        out.append(torch.cat([a, b]).index_select(0, keep))
    return type(new)(*out)


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


def _rows(view: StepView, flag: bool) -> torch.Tensor:
    """A whole-batch mask from a host fact (a fill kernel, no transfer)."""
    return torch.full((view.batch_size,), bool(flag), dtype=torch.bool, device=view.device)


def any_rule(rules: dict) -> torch.Tensor | None:
    masks = list(rules.values())
    if not masks:
        return None
    out = masks[0]
    for m in masks[1:]:
        out = out | m
    return out


def _or(rules: dict, view: StepView) -> torch.Tensor:
    out = any_rule(rules)
    return _rows(view, False) if out is None else out


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


# ---------------------------------------------------------------------------------------
# I1 rectangular alignment
# ---------------------------------------------------------------------------------------

def i1_failures(view: StepView) -> list[str]:
    """The I1 rules the view breaks: shapes and cache widths are host facts, so this reads
    nothing from the device and launches nothing."""
    b, w = view.batch_size, view.width
    want = view.expected_cache_width()
    r = {}
    r["tokens, valid and positions are [B, W]"] = not (
        tuple(view.valid.shape) == (b, w) and tuple(view.positions.shape) == (b, w))
    per_row = ("lengths", "prompt_lengths", "budgets", "generated", "finished", "row_ids")
    r["lengths, prompt_lengths, budgets, generated, finished, row_ids are [B]"] = (
        any(tuple(getattr(view, n).shape) != (b,) for n in per_row)
        or view.output.dim() != 2 or view.output.shape[0] != b)
    r[f"every target cache layer has width {want} ({view.phase}: "
      f"{'W + k' if view.phase in ('verify', 'commit') else 'W - 1'})"] = (
        len(view.cache_widths) == 0 or any(c != want for c in view.cache_widths))
    r[f"every target cache layer has batch size B = {b}"] = any(
        s != b and not (s <= 0 and c == 0)
        for s, c in zip(view.cache_batch_sizes, view.cache_widths))
    if view.draft_cache_widths:
        dw = w - 1 + view.draft_cache_lag
        r[f"every draft cache layer has width W - 1 + draft_cache_lag = {dw}"] = any(
            c != dw for c in view.draft_cache_widths)
    if view.drafts is not None:
        r[f"drafts are [B, k] = [{b}, {view.k}]"] = tuple(view.drafts.shape) != (b, view.k)
    if view.predictions is not None:
        r[f"predictions are [B, k+1] = [{b}, {view.k + 1}]"] = \
            tuple(view.predictions.shape) != (b, view.k + 1)
    f = view.forward
    if f is not None:
        q = f.input_ids.shape[-1]
        r["forward input_ids and positions are [B, q]"] = not (
            f.input_ids.shape[0] == b and tuple(f.positions.shape[-1:]) == (q,)
            and f.positions.shape[0] in (1, b))
    return [rule for rule, broken in r.items() if broken]


def i1_rules(view: StepView) -> dict[str, torch.Tensor]:
    """The broken I1 rules as whole-batch masks (only broken rules are listed)."""
    return {rule: _rows(view, True) for rule in i1_failures(view)}


def i1_alignment(view: StepView) -> torch.Tensor:
    return _or(i1_rules(view), view)


# ---------------------------------------------------------------------------------------
# I2 layout
# ---------------------------------------------------------------------------------------

def layout_slots(view: StepView) -> torch.Tensor:
    """[B, W] bool: slots that break the view's layout profile."""
    valid = view.valid.bool()
    if view.profile == "contiguous":
        return contiguous_layout_slots(valid, view.lengths)
    if view.profile == "grouped":
        return ~valid
    if view.profile == "holes":
        bad = torch.zeros_like(valid)
        bad[:, -1] = ~valid[:, -1] & ~view.finished.bool()
        return bad
    raise ValueError(f"unknown layout profile {view.profile!r}; expected one of {PROFILES}")


def i2_rules(view: StepView) -> dict[str, torch.Tensor]:
    valid, n, w = view.valid.bool(), view.lengths, view.width
    r = {"1 <= n[b] <= W": (n < 1) | (n > w)}
    if view.profile == "contiguous":
        r["valid[b] = 0^(W - n[b]) 1^(n[b]) (contiguous profile)"] = \
            contiguous_layout_slots(valid, n).any(dim=1)
        r["min over rows of the left padding W - n[b] is 0 (minimal width)"] = \
            ((w - n).min() != 0).expand(view.batch_size)
    elif view.profile == "holes":
        r["n[b] = number of valid slots"] = valid.long().sum(dim=1) != n
        r["the pending token of every active row sits in slot W - 1 (holes profile)"] = \
            ~valid[:, -1] & ~view.finished.bool()
    elif view.profile == "grouped":
        r["no padding: every slot is valid and n[b] = W (grouped profile)"] = \
            (~valid).any(dim=1) | (n != w)
    else:
        raise ValueError(f"unknown layout profile {view.profile!r}; expected one of {PROFILES}")
    return r


def i2_layout(view: StepView) -> torch.Tensor:
    return _or(i2_rules(view), view)


# ---------------------------------------------------------------------------------------
# I3 position-id contiguity
# ---------------------------------------------------------------------------------------

def _forward_checked_slots(view: StepView) -> torch.Tensor | None:
    """[B, q] bool: new tokens of the recorded forward whose position I3 checks (at verify,
    the pending token and the drafts a row may use; later drafts are never accepted and
    their positions may be clamped to the context)."""
    f = view.forward
    if f is None:
        return None
    q = f.input_ids.shape[-1]
    keep = torch.ones(view.batch_size, q, dtype=torch.bool, device=view.device)
    if view.phase in ("verify", "commit") and view.draft_limit is not None:
        i = torch.arange(q, device=view.device)[None, :]
        keep = i <= view.draft_limit[:, None]
    return keep


def forward_slots(view: StepView) -> torch.Tensor | None:
    """[B, q] bool: new tokens of the recorded forward at a wrong position."""
    f = view.forward
    if f is None or f.attention_mask.shape[-1] < f.cache_width + f.input_ids.shape[-1]:
        return None
    bad = forward_position_slots(f.attention_mask, f.positions, f.cache_width)
    return bad & _forward_checked_slots(view)


def i3_view_rules(view: StepView) -> dict[str, torch.Tensor]:
    return {"at every valid slot j, positions[b, j] = number of valid slots before j":
            position_slots(view.valid, view.positions).any(dim=1)}


def i3_forward_rules(view: StepView) -> dict[str, torch.Tensor]:
    fs = forward_slots(view)
    if fs is None:
        return {}
    return {"the forward's position of every new token = number of valid mask slots "
            "before it": fs.any(dim=1)}


def i3_rules(view: StepView) -> dict[str, torch.Tensor]:
    return {**i3_view_rules(view), **i3_forward_rules(view)}


def i3_positions(view: StepView) -> torch.Tensor:
    return _or(i3_rules(view), view)


# ---------------------------------------------------------------------------------------
# I4 mask coherence (the recorded forward)
# ---------------------------------------------------------------------------------------

def _extended(view: StepView):
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
    _, valid = _extended(view)
    span = f.cache_width + f.input_ids.shape[-1]
    mask = f.attention_mask
    if mask.dim() != 2 or mask.shape[1] != span or span > valid.shape[1] \
            or mask.shape[0] != view.batch_size:
        return None
    return mask.bool() != valid[:, :span]


def i4_rules(view: StepView) -> dict[str, torch.Tensor]:
    f = view.forward
    if f is None:
        return {}
    q = f.input_ids.shape[-1]
    c = f.cache_width
    tokens, valid = _extended(view)
    r = {}
    mask = f.attention_mask
    r[f"the mask is 2-D of width cache width + new tokens = {c} + {q}"] = _rows(
        view, mask.dim() != 2 or mask.shape[-1] != c + q or mask.shape[0] != view.batch_size)
    r[f"cache width before the forward + new tokens = the phase's cache width "
      f"{view.expected_cache_width()}"] = _rows(view, c + q != view.expected_cache_width())
    ms = mask_slots(view)
    if ms is not None:
        r["the mask over cache slots equals valid"] = ms[:, :c].any(dim=1)
        r["the mask over new tokens equals their validity (pending and drafts valid)"] = \
            ms[:, c:].any(dim=1)
        given = f.input_ids
        if given.shape == tokens[:, c : c + q].shape:
            r["the forward's inputs are the row's tokens at the new slots "
              "(pending ++ drafts at verify)"] = \
                ((given != tokens[:, c : c + q]) & valid[:, c : c + q]).any(dim=1)
    return r


def i4_mask(view: StepView) -> torch.Tensor:
    return _or(i4_rules(view), view)


# ---------------------------------------------------------------------------------------
# I6 token conservation
# ---------------------------------------------------------------------------------------

def _stop_mask(tokens: torch.Tensor, stops: torch.Tensor | None) -> torch.Tensor:
    if stops is None or stops.numel() == 0:
        return torch.zeros_like(tokens, dtype=torch.bool)
    return torch.isin(tokens, stops)


def stop_tensor(view: StepView) -> torch.Tensor:
    """The view's stop ids as a device tensor, written by fill kernels (a pageable
    host->device copy would synchronise the stream); cache it per run."""
    ids = [int(s) for s in view.stop_token_ids]
    if view.device.type == "cpu":
        return torch.tensor(ids, dtype=torch.long)
    out = torch.empty(len(ids), dtype=torch.long, device=view.device)
    for i, s in enumerate(ids):
        out[i] = s
    return out


def consumed(view: StepView) -> torch.Tensor:
    """[B] long: outputs already laid into the tokens (generated_before at commit, whose
    tokens are still those of before the commit)."""
    if view.phase == "commit":
        return view.generated_before if view.generated_before is not None else None
    return view.generated


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
    from_prompt = ptoks.gather(1, rank.clamp(0, ptoks.shape[1] - 1))
    t = max(view.output.shape[1], 1)
    out = view.output if view.output.shape[1] else view.output.new_zeros(view.batch_size, 1)
    from_output = out.gather(1, (rank - p).clamp(0, t - 1))
    want = torch.where(rank < p, from_prompt, from_output)
    in_range = rank < (p + used[:, None])
    return valid & found[:, None] & in_range & (view.tokens != want)


def output_slots(view: StepView, stops: torch.Tensor | None) -> torch.Tensor:
    """[B, T] bool: output indices holding a stop token before the row's last output."""
    t = view.output.shape[1]
    col = torch.arange(t, device=view.device)[None, :]
    g = view.generated[:, None]
    return _stop_mask(view.output, stops) & (col < g - 1)


def _last_stop(view: StepView, stops: torch.Tensor | None) -> torch.Tensor:
    """[B] bool: the row's last output token is a stop token."""
    g, t = view.generated, view.output.shape[1]
    if not t:
        return torch.zeros_like(g, dtype=torch.bool)
    last = view.output.gather(1, (g - 1).clamp(0, t - 1)[:, None])[:, 0]
    return _stop_mask(last, stops) & (g > 0)


def i6_state_rules(view: StepView, stops: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Budgets, stop tokens and finishing: a function of output, generated, finished."""
    g, budgets, fin = view.generated, view.budgets, view.finished.bool()
    last_stop = _last_stop(view, stops)
    at_budget = g >= budgets
    return {
        "0 <= generated[b] <= budget[b]": (g < 0) | (g > budgets),
        "generated[b] <= output width": g > view.output.shape[1],
        "nothing after the first stop token": output_slots(view, stops).any(dim=1),
        "a row whose output ends in a stop token is finished": last_stop & ~fin,
        "a row at its budget is finished": at_budget & ~fin,
        "a finished row ended on a stop token or its budget": fin & ~(last_stop | at_budget),
    }


def _active_before(view: StepView, prev: Snapshot | None) -> torch.Tensor:
    """[B] bool: rows not finished at the previous snapshot (unknown rows count active)."""
    if prev is None:
        return torch.ones(view.batch_size, dtype=torch.bool, device=view.device)
    idx, found = match_rows(view.row_ids, prev.row_ids)
    return ~(prev.finished.index_select(0, idx) & found)


def i6_history_rules(view: StepView, prev: Snapshot | None) -> dict[str, torch.Tensor]:
    """Against the last snapshot: no retroactive change, growth only at commit."""
    if prev is None:
        return {}
    r = {}
    idx, found = match_rows(view.row_ids, prev.row_ids)
    pg = prev.generated.index_select(0, idx)
    tt = min(view.output.shape[1], prev.output.shape[1])
    if tt:
        po = prev.output.index_select(0, idx)[:, :tt]
        col = torch.arange(tt, device=view.device)[None, :]
        changed = (view.output[:, :tt] != po) & (col < pg[:, None])
        r["output never changes retroactively"] = changed.any(dim=1) & found
    if view.phase == "commit" and view.generated_before is not None:
        r["generated_before = generated after the previous step"] = \
            found & (view.generated_before != pg)
    else:
        r["generated changes only at commit"] = found & (view.generated != pg)
    return r


def i6_commit_rules(view: StepView, stops: torch.Tensor | None,
                    prev: Snapshot | None) -> dict[str, torch.Tensor]:
    """The commit of this step: greedy acceptance and what it appends (commit only)."""
    if view.phase != "commit" or view.committed is None:
        return {}
    k, dev, t = view.k, view.device, view.output.shape[1]
    g, m = view.generated, view.committed
    active = _active_before(view, prev)
    before = view.generated_before if view.generated_before is not None else g - m
    r = {"generated = generated_before + committed": g != before + m,
         f"1 <= committed <= k + 1 = {k + 1} for a row active before the step":
             active & ((m < 1) | (m > k + 1))}
    if view.predictions is not None and t:
        i = torch.arange(k + 1, device=dev)[None, :]
        wrote = view.output.gather(1, (before[:, None] + i).clamp(0, t - 1))
        r["the committed tokens are the target's predictions y_0 .. y_(m-1)"] = \
            ((wrote != view.predictions) & (i < m[:, None])).any(dim=1)
    if view.accepted is not None:
        a = view.accepted
        cut = _last_stop(view, stops) | (g >= view.budgets)
        r["committed = accepted + 1, fewer only when cut at a stop token or the budget"] = \
            active & ((m > a + 1) | ((m < a + 1) & ~cut))
        if view.drafts is not None and view.predictions is not None and k:
            j = torch.arange(k, device=dev)[None, :]
            same = view.drafts == view.predictions[:, :k]
            r["accepted drafts equal the target's predictions"] = \
                ((~same) & (j < a[:, None])).any(dim=1)
            if view.draft_limit is not None:
                lim = view.draft_limit
                r["0 <= accepted <= draft_limit"] = (a < 0) | (a > lim)
                nxt = same.gather(1, a.clamp(0, k - 1)[:, None])[:, 0]
                r["accepted is the longest matching prefix of the drafts"] = (a < lim) & nxt
        elif k == 0:
            r["0 <= accepted <= draft_limit"] = a != 0
    return r


def i6_sequence_rules(view: StepView, prompts: Prompts | None) -> dict[str, torch.Tensor]:
    """The row's real tokens are prompt ++ output, and n[b] counts exactly those."""
    r = {}
    used = consumed(view)
    if used is not None:
        r["n[b] = prompt + committed output (prompt_lengths + generated)"] = \
            view.lengths != view.prompt_lengths + used
    seq = sequence_slots(view, prompts) if view.phase != "prefill" else None
    if seq is not None:
        r["the row's real tokens, read left to right, are prompt ++ output"] = seq.any(dim=1)
        idx, found = match_rows(view.row_ids, prompts.row_ids)
        r["prompt_lengths never change"] = found & (
            view.prompt_lengths != prompts.lengths.index_select(0, idx))
    return r


def i6_rules(view: StepView, *, stops: torch.Tensor | None = None,
             prev: Snapshot | None = None, prompts: Prompts | None = None
             ) -> dict[str, torch.Tensor]:
    if stops is None:
        stops = stop_tensor(view)
    return {**i6_state_rules(view, stops), **i6_history_rules(view, prev),
            **i6_commit_rules(view, stops, prev), **i6_sequence_rules(view, prompts)}


def i6_conservation(view: StepView, **state) -> torch.Tensor:
    return _or(i6_rules(view, **state), view)


# ---------------------------------------------------------------------------------------
# I5 KV coherence (deep: model forwards, host reads)
# ---------------------------------------------------------------------------------------

def kv_tolerance(dtype: torch.dtype, atol: float | None = None, rtol: float | None = None):
    da, dr = KV_TOLERANCE.get(dtype, (1e-2, 1e-2))
    return (da if atol is None else atol), (dr if rtol is None else rtol)


def cached_slots(view: StepView) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, valid) of the cache slots, [B, C]: the view's slots, then at verify/commit
    the pending token and the drafts (only those a row may use count as valid)."""
    tokens, valid = _extended(view)
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
        return _rows(view, False), slots_out
    layers = view.cache_tensors()
    if not layers or layers[0][0] is None:
        return _rows(view, False), slots_out
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
    "INVARIANTS", "CHEAP", "DEEP", "KV_TOLERANCE", "Snapshot", "Prompts", "compact",
    "match_rows", "valid_before", "position_slots", "forward_position_slots",
    "contiguous_layout_slots", "layout_slots", "forward_slots", "mask_slots",
    "sequence_slots", "output_slots", "i1_failures", "i1_rules", "i1_alignment", "i2_rules",
    "i2_layout", "i3_view_rules", "i3_forward_rules", "i3_rules", "i3_positions", "i4_rules",
    "i4_mask", "i6_state_rules", "i6_history_rules", "i6_commit_rules", "i6_sequence_rules",
    "i6_rules", "i6_conservation",
    "kv_tolerance", "cached_slots", "kv_mismatches", "stop_tensor",
    "any_rule",
]
