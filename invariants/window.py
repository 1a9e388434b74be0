"""I4 over a sliding window: each query attends exactly the valid keys within the window,
the window measured in positions, not in slots (the rule ``I4.window``).

A sliding-window model with window ``w`` lets a query at position ``p`` attend the keys
at positions ``p - w + 1 .. p``. Positions are what I3 states: a valid slot's position
is the number of valid slots before it in its row. Slots and positions part as soon as
a row has holes (profile ``"holes"``: rejected drafts stay in place, masked): the slot
distance of two tokens then exceeds their position distance by the holes between them,
and a window counted in slots drops keys the model must attend.

The forward's record (``ForwardRecord``) carries the window and what the model was
given (``model_mask``); what the model attends with is read from it:

- ``model_mask`` None (the model got the 2-D mask): the model builds its causal mask and
  its window over slot indices, ``slot(key) > slot(query) - w`` (transformers 5.24's
  ``sliding_window_overlay``), on top of the 2-D mask;
- a 4-D mask ``[B or 1, H or 1, q, C + q]``: used as given (bool: True attends; float:
  additive, a key is attended where its entry is above the dtype's lowest value);
- a dict from layer type to such a mask (a model mixing full and sliding layers):
  ``"sliding_attention"`` is held to the window, every other entry to full attention.

The mask it must be: key slot ``j`` valid (the 2-D mask's column, which ``I4.mask``
holds to the slot validity), ``j`` not after the query's slot, and ``0 <= pos(query) -
pos(key) < w``, both positions counted over the 2-D mask's valid columns. Only the
queries whose output is read are checked: valid new tokens, and at verify those up to
the row's draft limit (a draft past it is never accepted, as in ``I3.forward``).

Pure tensor ops on the mask's device: no host read, no upload, no data-dependent shape.
"""

from __future__ import annotations

import torch

#: the layer type of a per-type mask dict that the window applies to
SLIDING = "sliding_attention"


def given_masks(record) -> list:
    """[(mask, window)]: every mask the model was given with the window it must obey;
    a plain 2-D mask is ``(None, window)``."""
    m = record.model_mask
    if m is None:
        return [(None, record.window)]
    if isinstance(m, dict):
        return [(v, record.window if t == SLIDING else None) for t, v in m.items()]
    return [(m, record.window)]


def malformed(record, b: int) -> bool:
    """True when a given mask cannot stand for ``b`` rows of ``q`` queries over ``C + q``
    keys (a host fact: shapes only)."""
    q = record.input_ids.shape[-1]
    span = record.cache_width + q
    for m, _ in given_masks(record):
        if m is None:
            continue
        if not isinstance(m, torch.Tensor) or m.dim() != 4 or m.shape[0] not in (1, b) \
                or tuple(m.shape[2:]) != (q, span):
            return True
    return False


def checked(record) -> bool:
    """Whether the record has anything for ``I4.window`` to check (a window, or a mask
    other than the 2-D one)."""
    return record.window is not None or record.model_mask is not None


def expected(valid: torch.Tensor, q: int, window: int | None) -> torch.Tensor:
    """[B, q, C + q] bool: what each new token must attend: valid keys not after it,
    within ``window`` positions (positions counted over ``valid`` [B, C + q] bool)."""
    span = valid.shape[1]
    dev = valid.device
    kslot = torch.arange(span, device=dev)[None, None, :]
    qslot = (span - q + torch.arange(q, device=dev))[None, :, None]
    allowed = valid[:, None, :] & (kslot <= qslot)
    if window is not None:
        count = valid.long().cumsum(dim=1)  # [B, C + q]: valid slots up to and including j
        distance = count[:, span - q:, None] - count[:, None, :]  # pos(query) - pos(key)
        allowed = allowed & (distance < window)
    return allowed


def attended(mask: torch.Tensor | None, valid2d: torch.Tensor, q: int,
             window: int | None) -> torch.Tensor:
    """[B or 1, H or 1, q, C + q] bool: what the model attends with ``mask`` (see the
    module docstring; None: the 2-D ``valid2d`` with causality and window over slots)."""
    if mask is None:
        span = valid2d.shape[1]
        dev = valid2d.device
        kslot = torch.arange(span, device=dev)[None, :]
        qslot = (span - q + torch.arange(q, device=dev))[:, None]
        near = kslot <= qslot
        if window is not None:
            near = near & (kslot > qslot - window)
        return (valid2d[:, None, :] & near[None])[:, None]
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min if mask.is_floating_point() else mask != 0


def queries(valid: torch.Tensor, q: int, limit: torch.Tensor | None) -> torch.Tensor:
    """[B, q] bool: the new tokens whose output is read (valid, and within the draft limit
    when ``limit`` [B] is given: new token i is the pending token (0) or draft i)."""
    read = valid[:, valid.shape[1] - q:]
    if limit is not None:
        i = torch.arange(q, device=valid.device)[None, :]
        read = read & (i <= limit[:, None])
    return read


def wrong(record, limit: torch.Tensor | None = None) -> torch.Tensor:
    """[B, q, C + q] bool: query/key pairs where what the model attends differs from what
    it must attend, at the queries whose output is read; every given mask counts."""
    valid = record.attention_mask
    valid = valid if valid.dtype == torch.bool else valid.bool()
    q = record.input_ids.shape[-1]
    read = queries(valid, q, limit)[:, :, None]
    out = None
    for m, window in given_masks(record):
        diff = (attended(m, valid, q, window) != expected(valid, q, window)[:, None]).any(dim=1)
        out = diff if out is None else out | diff
    return out & read


def flags(record, limit: torch.Tensor | None = None) -> torch.Tensor:
    """[B] bool: rows with a query that attends a key it must not, or misses one."""
    return wrong(record, limit).flatten(1).any(dim=1)


def key_slots(record, limit: torch.Tensor | None = None) -> torch.Tensor:
    """[B, C + q] bool: the keys some read query attends wrongly (the trace's slots)."""
    return wrong(record, limit).any(dim=1)


def grid_lines(record, b: int, limit: torch.Tensor | None = None) -> dict:
    """Host lines of a trace for row ``b`` (run only on a violation): every valid mask
    column's position (``kpos``), and over the keys, what the first wrongly masked query
    (position p) attends and what it must attend."""
    valid = record.attention_mask.bool()
    q = record.input_ids.shape[-1]
    span = valid.shape[1]
    bad = wrong(record, limit)[b]  # [q, C + q]
    rows = bad.any(dim=1).nonzero().flatten().tolist()
    count = valid[b].long().cumsum(0).tolist()
    vrow = valid[b].tolist()
    lines = {"kpos": [c - 1 if v else None for c, v in zip(count, vrow)]}
    if not rows:
        return lines
    i = rows[0]
    p = count[span - q + i] - 1
    got = None
    for m, window in given_masks(record):
        a = attended(m, valid, q, window).any(dim=1)  # [B or 1, q, C + q]
        e = expected(valid, q, window)
        if bool((a[min(b, a.shape[0] - 1), i] != e[b, i]).any()):
            got, want = a[min(b, a.shape[0] - 1), i].tolist(), e[b, i].tolist()
            break
    if got is not None:
        lines[f"attends(p={p})"] = ["#" if x else "." for x in got]
        lines[f"must(p={p})"] = ["#" if x else "." for x in want]
    return lines
