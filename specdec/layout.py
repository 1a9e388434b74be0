"""Index math of every realignment strategy, written once over a small ops interface.

Every function here is an element-wise expression. With ``TORCH`` the arguments are
tensors that broadcast (rows as ``[B, 1]``, slots as ``[1, W]``); with the z3 ops of
``proofs/`` they are z3 integer terms for one (row, slot) pair. The engine executes these
functions; the proofs prove properties of the very same functions. Do not restate any of
these formulas elsewhere: import them.

Layout vocabulary (see DESIGN.md): a row of the rectangular batch has width ``W``; its ``n``
real tokens are right-aligned (left padding ``W - n``) and its pending token sits in slot
``W - 1``. The target cache holds slots ``0 .. W - 2`` (width ``C = W - 1``).

After a verify step over ``pending ++ k drafts`` the extended row has width ``W + k + 1``
for tokens (old slots, then the ``k + 1`` target predictions ``y_0 .. y_k``) and ``W + k``
for the cache (old slots, then pending, then drafts ``d_1 .. d_k``). A row that commits
``m`` tokens (``1 <= m <= k + 1``: accepted drafts then the correction or bonus) keeps
tokens in extended slots ``W - n .. W + m - 1``; those committed tokens equal
``y_0 .. y_{m-1}`` because an accepted draft equals the target's prediction.
"""

from __future__ import annotations

from typing import Any, Protocol


class Ops(Protocol):
    """What the index math needs from a backend: a conditional and a clamp."""

    def where(self, cond: Any, a: Any, b: Any) -> Any: ...
    def clamp(self, x: Any, lo: Any, hi: Any) -> Any: ...


class _TorchOps:
    def where(self, cond, a, b):
        import torch

        return torch.where(cond, a, b)

    def clamp(self, x, lo, hi):
        import torch

        return torch.clamp(x, min=lo, max=hi)


TORCH: Ops = _TorchOps()


# ---------------------------------------------------------------------------------------
# Contiguous profile (EQSPEC): left padding, gather to a new minimal width.
# ---------------------------------------------------------------------------------------

def new_length(n, committed):
    """Real tokens of a row after it commits ``committed`` tokens."""
    return n + committed


def new_padding(new_width, n_new):
    """Left padding of a row of ``n_new`` real tokens in a batch of width ``new_width``.

    ``new_width`` is the maximum of ``n_new`` over the rows that stay in the batch, so the
    minimum padding is 0 (I2, minimal width).
    """
    return new_width - n_new


def source_shift(old_width, new_width, committed):
    """Offset from a destination slot to its source slot in the extended row.

    Destination slot ``j`` (``j >= new padding``) takes extended slot ``j + shift``:
    the last destination slot ``new_width - 1`` maps to ``old_width + committed - 1``,
    the slot of the newest committed token (the new pending token).
    """
    return old_width - new_width + committed


def source_slot(ops: Ops, j, pad_new, shift, ext_width):
    """Source slot in the extended row for destination slot ``j``.

    Valid destination slots map to ``j + shift``; padding slots read slot 0 (any in-range
    slot would do: they are masked). The result is clamped into ``[0, ext_width - 1]`` so
    the gather never reads out of range; for valid slots the clamp is the identity (proved
    in ``proofs/``).
    """
    raw = ops.where(j >= pad_new, j + shift, 0 * j)
    return ops.clamp(raw, 0, ext_width - 1)


def slot_valid(j, pad):
    """valid[b, j] of the contiguous profile: ``0^pad 1^(W - pad)``."""
    return j >= pad


def slot_position(ops: Ops, j, pad):
    """Position id of slot ``j`` in a row with left padding ``pad`` (0 on padding slots)."""
    return ops.where(j >= pad, j - pad, 0 * j)


def cache_width(width):
    """Cache width of a batch of token width ``width``: every pending token is uncached."""
    return width - 1


# ---------------------------------------------------------------------------------------
# Verify step: where the pending token and the drafts sit.
# ---------------------------------------------------------------------------------------

def verify_position(n, i):
    """Position id of verify input ``i`` (0 = pending, 1..k = drafts) of a row of ``n`` tokens."""
    return n - 1 + i


def draft_limit(ops: Ops, k, remaining):
    """Drafts a row may use: ``min(k, remaining - 1)`` (the last budgeted token is always
    the target's own), never below 0."""
    return ops.clamp(remaining - 1, 0, k)
