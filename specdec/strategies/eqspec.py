"""EQSPEC realignment: after every verify step, gather each row's kept tokens so that rows
are right-aligned again at the new minimal width.

Layout before (``W`` slots, row b with ``n`` real tokens and ``m`` committed this step):
tokens extended by the ``k + 1`` predictions (width ``W + k + 1``), cache extended by the
verify forward (width ``W + k``). After: width ``W' = max(n + m)`` over the rows that stay,
row b right-aligned with ``n + m`` real tokens, cache width ``W' - 1``. The index plan is
``specdec.layout`` (the single source proved in ``proofs/``); this module only applies it:
one gather for tokens, one gather per cache (all layers at once), no loop over rows.
"""

from __future__ import annotations

import torch

from .. import layout
from ..batch import PAD_FILL, RaggedBatch, RowsLeaving, rows_leaving
from . import FixedBatches


def plan(lengths: torch.Tensor, committed: torch.Tensor, old_width: int, new_width: int,
         k: int):
    """The realignment plan for the rows that stay.

    lengths, committed: [B'] long (kept rows)
    Returns (src_tokens [B', W'] long, src_cache [B', W'-1] long, valid [B', W'] bool,
    positions [B', W'] long).
    """
    j = torch.arange(new_width, device=lengths.device)[None, :]
    p = layout.realign_plan(layout.TORCH, j, lengths[:, None], committed[:, None], old_width,
                            new_width, k)
    shape = (lengths.shape[0], new_width)
    cw = layout.cache_width(new_width)
    return (p.src_tokens.expand(shape), p.src_cache.expand(shape)[:, :cw],
            p.valid.expand(shape), p.positions.expand(shape))


def realign(batch: RaggedBatch, predictions: torch.Tensor, committed: torch.Tensor,
            leaving: RowsLeaving | None, new_width: int, k: int,
            identity: bool = False) -> RaggedBatch:
    """Drop the finished rows (``leaving``: their renumbering, None when none finished)
    and right-align the rest at ``new_width``.

    predictions: [B, k+1] long; committed: [B] long. ``identity``: the host knows that
    every row that stays has source shift 0 (``layout.realign_is_identity``), so each
    cache is cropped instead of gathered (the plan keeps every slot where it is).
    Mutates the caches in place and returns the new batch (``B'`` rows, in
    ``leaving.order``).
    """
    order = None if leaving is None else leaving.order
    kept = batch.select(order)
    if order is not None:
        predictions, committed = predictions.index_select(0, order), committed.index_select(0, order)
    src_tokens, src_cache, valid, positions = plan(kept.lengths, committed, batch.width,
                                                   new_width, k)
    ext = torch.cat([kept.tokens, predictions], dim=1)
    tokens = torch.where(valid, ext.gather(1, src_tokens), PAD_FILL)
    for c in (batch.target_cache, batch.draft_cache):
        if c is None:
            continue
        if leaving is not None:  # finished rows leave: only the rows filling their places move
            c.keep_rows(leaving.moved_to, leaving.moved_from, leaving.kept)
        if identity:
            c.crop(src_cache.shape[1])
        else:
            c.gather_slots(src_cache)
    return kept.replace(tokens=tokens, valid=valid, positions=positions,
                        lengths=layout.new_length(kept.lengths, committed))


class EqSpec(FixedBatches):
    """Realign every step: finished rows leave, the rest right-aligned at the new minimal
    width (contiguous profile, DESIGN.md I2)."""

    name = "eqspec"
    profile = "contiguous"

    def capacity(self, ctx, width: int, max_budget: int) -> int:
        return layout.contiguous_capacity(width, max_budget, ctx.k)

    def after_step(self, ctx, state, batch: RaggedBatch, spec, host) -> RaggedBatch:
        """Drop the finished rows and right-align the rest at the new minimal width."""
        leaving = rows_leaving(batch.finished, host.finished)
        identity = all(layout.realign_is_identity(batch.width, host.max_n, m)
                       for m, f in zip(host.committed, host.finished) if not f)
        return realign(batch, spec.predictions, spec.committed, leaving, host.max_n, spec.k,
                       identity)


STRATEGY = EqSpec()
