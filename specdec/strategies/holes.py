"""HOLES: no copy after a step; rejected drafts become holes; compaction past a threshold.

Layout (profile ``holes``, DESIGN.md I2). A verify step over ``pending ++ d_1 .. d_k``
writes the KV of the pending token and of every draft into cache slots ``W - 1 .. W + k
- 1`` of every row. HOLES keeps them where they are: the batch grows to width ``W' = W +
k + 1`` for every row, extended slot ``W + i`` holds draft ``d_{i+1}`` (valid iff
accepted: ``i < m - 1``), slot ``W + k`` the new pending token ``y_{m-1}`` (position
``n + m - 1``, uncached), and the cache simply keeps its width ``W + k = W' - 1``. A step
costs a mask update and a token write (small int tensors), no KV copy and no gather.
Positions stay contiguous over valid slots (``positions[b, j]`` = valid slots before
``j``); verify positions are ``n - 1 + i`` as in EQSPEC. The formulas are
``specdec.layout.holes_*``.

Compaction. Every step widens the batch by ``k + 1`` slots, so attention work grows with
the holes. When the reclaimable share of the width passes ``hole_threshold``
(``layout.compaction_due``: ``W' - max n > threshold * W'``), the batch is compacted to the
contiguous profile at width ``max n`` with one gather over all layers (the EQSPEC
right-alignment; its source map is built by a scatter of ``layout.compact_dest_slot``:
destination ``pad + position`` of each valid slot). The measure counts the slots that
compaction can remove; the left padding of shorter rows is not counted, since no
compaction removes it (counting it would compact every step on mixed prompt lengths, or
never be reached on equal ones). It is a host decision: ``max n`` is in the one host sync
of the step. The cache is sized so that the threshold, not the capacity, triggers
compaction (``capacity``); a batch that would overflow compacts anyway.

Default threshold ``DEFAULT_THRESHOLD = 0.5``, measured with ``benchmarks/throughput.py``
on the tiny llama (CPU, one thread, interleaved runs, median over runs of the tokens/s
ratio to EQSPEC at the same batch size; a shared 2-core machine, so single figures are
only good to about +-15%):

- ``--prompts 16 --max-new-tokens 48 --batch-sizes 4 8 --drafters scripted:0.3
  scripted:0.7 model`` (5 runs): thresholds 0 / 0.1 / 0.25 / 0.5 / 0.75 / 1 gave
  0.92 / 0.96 / 0.99 / 0.99 / 0.95 / 1.02 (mean over drafters and batch sizes);
- ``--prompts 16 --max-new-tokens 128 --batch-sizes 8 16 --drafters ngram scripted:0.5``
  (4 runs, widths grow further): 1.00 / 1.11 / 1.05 / 1.10 / 1.01 / 0.98.

Threshold 0 (compact nearly every step: EQSPEC plus the hole bookkeeping) is at best
even with EQSPEC; never compacting (1) falls behind once widths grow (second sweep);
0.1 to 0.5 is a plateau within the noise, where 0.5 has the best mean. A cost model
agrees: a compaction moves the KV once (read and write, about two attention reads of
it), slack grows by ``r ~ (k + 1 - m) / W`` of the width per step, so the traffic per
step, ``h / 2 + 2 r / h`` attention reads, is minimal at ``h = 2 sqrt(r)``: with ``k = 4``
and ``m ~ 2``, 0.3 to 0.5 for the tiny benchmark's widths (50 to 130), about 0.2 for
widths of a few hundred. Above 0.5 the width and the cache (``capacity``: ``1 / (1 - h)``
of EQSPEC's) grow fast. On a tiny CPU model per-op overhead dominates both the gather
and the attention, so these figures bound the effect rather than rank the plateau;
rerun the sweep on the target hardware (``--strategies holes:H ...``) to tune it.

Checked again on the real model after realignment became ~10x cheaper (double-buffered
wide-element gathers, ``cache.py``): ``--prompts 16 --max-new-tokens 64 --batch-sizes 8
--strategies holes:0.1 holes:0.25 holes:0.5 holes:0.75 eqspec --drafters ngram
scripted:0.6`` (SmolLM2-135M, 2 CPU cores, one run) gave 20.7 / 21.9 / 21.9 / 21.4
tokens/s (EQSPEC 19.3) with the n-gram drafter and 32.2 / 31.0 / 34.2 / 29.5 (EQSPEC
30.3) at acceptance 0.6; realign 1.1-2.1% of decode time for every threshold (EQSPEC
4.9-5.7%). Still a plateau, 0.5 at its top: the default stays.

Finished rows leave the batch by moving only the staying rows that fill their places
(``batch.rows_leaving``, ``SlabCache.keep_rows``: usually one or two rows, not the whole
cache); row order is not kept (``row_ids`` says which request each row serves).

Sliding-window models. Transformers builds the sliding mask over slot indices, which
over-restricts the window once holes separate slots from positions. With holes the
engine and ``ModelDrafter`` pass the position of every mask column
(``cache.forward(key_positions=...)``) and ``cache.position_masks`` builds the 4-D mask
from positions (sdpa: bool, eager: additive float; other attention implementations are
refused up front by ``check_model``). A model mixing full and sliding layers (Gemma 3)
gets one such mask per layer type, the full layers' without the window. Every layer
keeps every slot (``SlabCache`` has no ring buffer), so compaction after the window has
slid past a hole moves the same slots as on a full-attention model.

Drafters. ``NGramDrafter`` matches on ``RaggedBatch.contiguous_tokens()`` (an int gather
with the same compaction formula), so no suffix spans a hole. ``ModelDrafter``'s cache has
the target's layout (its k + 1 one-token forwards fill the same slots), so the same mask
and the same compaction apply to it.
"""

from __future__ import annotations

import torch

from .. import cache as cache_mod
from .. import layout, validation
from ..batch import PAD_FILL, RaggedBatch, compact_sources, rows_leaving
from . import FixedBatches, Option

#: default ``hole_threshold`` (measured: see the module docstring)
DEFAULT_THRESHOLD = 0.5


def check_model(model: torch.nn.Module) -> None:
    """Refuse a sliding-window model whose position-based mask cannot be built."""
    if cache_mod.sliding_window(model) is None:
        return
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl not in ("sdpa", "eager"):
        raise NotImplementedError(
            f"strategy 'holes' on a sliding-window model needs sdpa or eager attention (a "
            f"4-D position-based mask), got {impl!r}; use strategy='eqspec'"
        )


def after_step(ctx, state, batch: RaggedBatch, spec, host) -> RaggedBatch:
    """Append the step's slots (drafts kept or holed, the new pending token); drop the
    finished rows; compact when the slack passes the threshold or the cache is full."""
    k, dev = spec.k, batch.device  # this step's drafts (max k_b)
    w = batch.width
    n, m = batch.lengths, spec.committed
    i = torch.arange(k + 1, device=dev)[None, :]
    ext_valid = layout.holes_slot_valid(i, k, m[:, None])
    ext_pos = layout.holes_slot_position(layout.TORCH, i, k, n[:, None], m[:, None])
    pending = spec.predictions.gather(1, (m - 1).clamp(min=0)[:, None])
    ext_tok = torch.where(ext_valid, torch.cat([spec.drafts, pending], dim=1), PAD_FILL)
    leaving = rows_leaving(batch.finished, host.finished)
    kept = batch.replace(tokens=torch.cat([batch.tokens, ext_tok], dim=1),
                         valid=torch.cat([batch.valid, ext_valid], dim=1),
                         positions=torch.cat([batch.positions, ext_pos], dim=1),
                         lengths=layout.new_length(n, m)).select(
                             None if leaving is None else leaving.order)

    wide = layout.holes_width(w, k)
    caches = [c for c in (batch.target_cache, batch.draft_cache) if c is not None]
    if leaving is not None:  # finished rows leave: only the rows filling their places move
        for c in caches:
            c.keep_rows(leaving.moved_to, leaving.moved_from, leaving.kept)
    threshold = ctx.options["hole_threshold"]
    due = layout.compaction_due(wide, host.max_n, threshold) or not layout.verify_fits(
        wide, k, batch.target_cache.slab.capacity)
    if not due:
        return kept.replace(holes=True)
    wc = host.max_n
    src = compact_sources(kept.valid, kept.positions, kept.lengths, wc)
    j = torch.arange(wc, device=dev)[None, :]
    pad = layout.new_padding(wc, kept.lengths)[:, None]
    valid = layout.slot_valid(j, pad)
    tokens = torch.where(valid, kept.tokens.gather(1, src), PAD_FILL)
    src_cache = src[:, : layout.cache_width(wc)]
    for c in caches:
        c.gather_slots(src_cache)
    state.stats.compactions += 1
    return kept.replace(tokens=tokens, valid=valid, holes=False,
                        positions=layout.slot_position(layout.TORCH, j, pad).expand_as(tokens))


class Holes(FixedBatches):
    """No copy after a step; rejected drafts become holes; compaction past a threshold."""

    name = "holes"
    profile = "holes"
    options = (Option("hole_threshold", float,
                      f"compact when the reclaimable share of the width passes this "
                      f"(0..1, default {DEFAULT_THRESHOLD})"),)

    def check_options(self, options: dict, *, batch_size: int) -> dict:
        return {"hole_threshold": validation.number(options.get("hole_threshold", DEFAULT_THRESHOLD),
                                         "hole_threshold", 0, 1)}

    def check_models(self, target, drafter) -> None:
        """Refuse sliding-window setups a position mask cannot serve."""
        check_model(target)
        if hasattr(drafter, "model"):
            check_model(drafter.model)

    def capacity(self, ctx, width: int, max_budget: int) -> int:
        """Cache slots of a batch whose prompts have width ``width``: below the widest
        batch the threshold lets through, a verify must fit (``layout.holes_capacity``;
        with threshold ``h`` about ``(width + max_budget) / (1 - h) + k + 1``)."""
        widest = layout.widest_before_compaction(width + max_budget, ctx.options["hole_threshold"])
        return layout.holes_capacity(layout.HOST, width, max_budget, ctx.k, widest)

    def after_step(self, ctx, state, batch, spec, host) -> RaggedBatch:
        return after_step(ctx, state, batch, spec, host)

    def run(self, ctx, state, ids, *, batch_size, max_new_tokens, done):
        state.stats.compactions = 0
        super().run(ctx, state, ids, batch_size=batch_size, max_new_tokens=max_new_tokens,
                    done=done)


STRATEGY = Holes()
