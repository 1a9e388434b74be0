"""The ragged batch: one dataclass that documents the layout every strategy works on.

Rows are right-aligned: row ``b`` holds its ``n[b] = lengths[b]`` real tokens (prompt then
committed output) in slots ``W - n[b] .. W - 1`` and padding before them (contiguous
profile). ``valid`` is the attention mask over slots; padding is never inferred from token
ids. The newest committed token of a row (its pending token) sits in slot ``W - 1``; its
key/value are computed by the next forward, so every cache has width ``W - 1``.

Hole profile (``strategy="holes"``, ``holes=True``): rejected drafts leave invalid slots
between valid ones; positions still count valid slots (``positions[b, j]`` = valid slots
before j) and the pending token still sits in slot ``W - 1``. ``contiguous_tokens``
gives the contiguous view of such a batch (an int gather) for drafters that read tokens.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field

import torch

from invariants.view import StepView, build_view

from . import layout
from .cache import SlabCache

#: token id written into padding slots; never read as data (valid says what is real)
PAD_FILL = 0

#: the per-row fields of a request (they travel with the row; a layout change leaves them
#: as they are), and with the layout fields every ``[batch_size, ...]`` tensor of a batch
REQUEST_FIELDS = ("prompt_lengths", "budgets", "generated", "finished", "row_ids", "output")
ROW_FIELDS = ("tokens", "valid", "positions", "lengths") + REQUEST_FIELDS
_row_fields = operator.attrgetter(*ROW_FIELDS)


def take_rows(source, order: torch.Tensor, names=REQUEST_FIELDS) -> dict:
    """``{name: rows order of source.name}`` for each of ``names``: one ``index_select``
    per field of a batch (or of any object with the same ``[rows, ...]`` fields, such as
    EXSPEC's pool). order: [B'] long."""
    return {name: getattr(source, name).index_select(0, order) for name in names}


@dataclass
class RaggedBatch:
    # [batch_size, width] long: token id of every slot (PAD_FILL on padding slots)
    tokens: torch.Tensor
    # [batch_size, width] bool: slot holds a real token (the attention mask over slots)
    valid: torch.Tensor
    # [batch_size, width] long: position id of every slot (0 on padding slots)
    positions: torch.Tensor
    # [batch_size] long: n[b], real tokens of the row (prompt + committed output)
    lengths: torch.Tensor
    # [batch_size] long: prompt tokens of the row
    prompt_lengths: torch.Tensor
    # [batch_size] long: most new tokens the row may commit
    budgets: torch.Tensor
    # [batch_size] long: new tokens committed so far
    generated: torch.Tensor
    # [batch_size] bool: the row hit a stop token or its budget
    finished: torch.Tensor
    # [batch_size] long: index of the request (prompt) the row serves
    row_ids: torch.Tensor
    # [batch_size, max_budget] long: committed output; output[b, :generated[b]] is real
    output: torch.Tensor
    # the target's cache: width cache_width(width) outside a step
    target_cache: SlabCache
    # the drafter's cache (ModelDrafter only), same layout as the target's
    draft_cache: SlabCache | None = None
    # host flag: the layout may have holes (valid slots not contiguous); see module docstring
    holes: bool = False
    # derived in __post_init__
    batch_size: int = field(init=False)
    width: int = field(init=False)

    def __post_init__(self):
        self.batch_size, self.width = self.tokens.shape
        b, w = self.batch_size, self.width
        for name in ("valid", "positions"):
            t = getattr(self, name)
            if tuple(t.shape) != (b, w):
                raise ValueError(f"{name} must be [batch_size, width] = [{b}, {w}], got {list(t.shape)}")
        for name in ("lengths", "prompt_lengths", "budgets", "generated", "finished", "row_ids"):
            t = getattr(self, name)
            if tuple(t.shape) != (b,):
                raise ValueError(f"{name} must be [batch_size] = [{b}], got {list(t.shape)}")
        if self.output.shape[0] != b:
            raise ValueError(f"output must have batch_size {b} rows, got {self.output.shape[0]}")

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    @property
    def remaining(self) -> torch.Tensor:
        """[batch_size] long: tokens the row may still commit."""
        return self.budgets - self.generated

    def replace(self, **fields) -> "RaggedBatch":
        """A new batch with ``fields`` replaced (shapes checked again); the rest shared."""
        return dataclasses.replace(self, **fields)

    def select(self, order: torch.Tensor | None, **fields) -> "RaggedBatch":
        """The batch of rows ``order`` ([B'] long; None: every row, unchanged) of every
        per-row tensor (``ROW_FIELDS``), with ``fields`` replaced afterwards. The caches
        are shared, not selected: the caller moves their rows (``SlabCache.keep_rows``)."""
        if order is not None:
            fields = {**take_rows(self, order, [n for n in ROW_FIELDS if n not in fields]),
                      **fields}
        return self.replace(**fields) if fields else self

    def view(self, *, step: int, phase: str, profile: str, k: int, stop_token_ids: tuple,
             model=None, info: dict | None = None, draft_cache_lag: int = 0, cache_widths=None,
             cache_batch_sizes=None, cache_tensors=None, **extra) -> StepView:
        """The read-only ``StepView`` hooks receive: this batch's tensors (not copied) and
        the step's facts. The cache facts default to the batch's ``SlabCache``s (an engine
        with another cache passes its own); ``extra``: the phase-specific fields
        (``drafts``, ``forward``, ...), or a row field to show instead of the batch's own
        (a known-bad engine shows the positions its model used). ``info`` is taken over,
        not copied: pass a new dict per view."""
        tc, dc = self.target_cache, self.draft_cache
        if cache_widths is None:
            cache_widths = tuple(tc.layer_widths())
            cache_batch_sizes = (tc.batch_size,) * len(tc.layers)
            cache_tensors = tc.layer_tensors
        fields = dict(zip(ROW_FIELDS, _row_fields(self)))
        fields.update(
            step=step, phase=phase, profile=profile, k=k, stop_token_ids=stop_token_ids,
            cache_widths=cache_widths, cache_batch_sizes=cache_batch_sizes,
            draft_cache_widths=tuple(dc.layer_widths()) if dc is not None else (),
            draft_cache_lag=draft_cache_lag, model=model, cache_tensors=cache_tensors,
            draft_cache_tensors=dc.layer_tensors if dc is not None else None,
            info={} if info is None else info, **extra)  # extra: may replace a row field
        return build_view(fields)  # StepView(**fields), without its per-field setattr

    def stores(self) -> tuple:
        """(name, tensor) of the cache storage a view exposes through ``cache_tensors``
        (``validation.HookWatch`` watches it for a hook's writes)."""
        out = [("target cache", self.target_cache.slab.store)]
        if self.draft_cache is not None:
            out.append(("draft cache", self.draft_cache.slab.store))
        return tuple(out)

    def committed_context(self, predictions: torch.Tensor, committed: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, valid) [B, W + q] in the contiguous profile after a commit, before any
        realignment: each row's real tokens, its ``committed`` new ones (``predictions
        [:, :committed]``, [B, q] and [B]) included, right-aligned in order, so the newest
        committed token (the next pending token) is last. What a drafter reads to plan the
        next step (an int scatter and gather, ``compact_tokens``). After a plain step
        (``q = 1``: every row commits its one prediction) that is the batch with the
        predictions appended as one more column, built so without the scatter."""
        q = predictions.shape[1]
        if q == 1 and not self.holes:  # right-aligned already: one more valid column each
            return (torch.cat([self.tokens, predictions], dim=1),
                    torch.cat([self.valid, torch.ones_like(self.valid[:, :1])], dim=1))
        i = torch.arange(q, device=self.device)[None, :]
        n = self.lengths[:, None]
        tokens = torch.cat([self.tokens, predictions], dim=1)
        valid = torch.cat([self.valid, i < committed[:, None]], dim=1)
        positions = torch.cat([self.positions, layout.verify_position(n, i + 1)], dim=1)
        return compact_tokens(tokens, valid, positions, layout.new_length(self.lengths, committed),
                              self.width + q)

    def contiguous_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, valid) [B, W] in the contiguous profile: each row's real tokens
        right-aligned, in order (the batch's own tensors when it has no holes)."""
        if not self.holes:
            return self.tokens, self.valid
        return compact_tokens(self.tokens, self.valid, self.positions, self.lengths, self.width)


def left_pad(prompts: list[list[int]], device=None):
    """Right-align ``prompts`` in a rectangle of width max(len).

    Returns tokens [B, W] long, valid [B, W] bool, positions [B, W] long, lengths [B] long.
    """
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)
    width = int(max(len(p) for p in prompts))
    # the rectangle is built on the host and uploaded once (not one copy per row)
    tokens = torch.tensor([[PAD_FILL] * (width - len(p)) + list(p) for p in prompts],
                          dtype=torch.long, device=device).reshape(len(prompts), width)
    j = torch.arange(width, device=device)[None, :]
    pad = layout.new_padding(width, lengths)[:, None]
    valid = layout.slot_valid(j, pad)
    positions = layout.slot_position(layout.TORCH, j, pad)
    return tokens, valid, positions, lengths


def rows_where(mask: torch.Tensor, count: int) -> torch.Tensor:
    """[count] long: indices of the True entries of ``mask`` ([B] bool), in order, when the
    host already knows how many there are (a stable sort instead of ``nonzero``, which
    would read the device)."""
    return torch.argsort((~mask).to(torch.int8), stable=True)[:count]


@dataclass(frozen=True)
class RowsLeaving:
    """How the rows that stay are renumbered when finished rows leave, moving as few rows
    as possible: a staying row in the first ``kept`` positions keeps its index; the
    finished rows among them are replaced, in order, by the staying rows at index
    ``>= kept``; everything from ``kept`` on is dropped. ``B`` rows before, ``B'`` after.
    """

    # [B'] long: the current index of each row of the new batch
    order: torch.Tensor
    # [M] long: positions < B' of finished rows, ascending (M = finished rows among them)
    moved_to: torch.Tensor
    # [M] long: the staying rows at index >= B' that fill them, ascending
    moved_from: torch.Tensor

    @property
    def kept(self) -> int:
        return self.order.shape[0]


def rows_leaving(finished: torch.Tensor, finished_host: list) -> RowsLeaving | None:
    """The renumbering of ``RowsLeaving`` for ``finished`` ([B] bool on the device), whose
    values the host already holds (``finished_host``, from the step's one sync), so every
    size is known without reading the device; None when no row finished. The number of
    finished rows among the first ``B'`` equals the number of staying rows after them, so
    the moves pair up exactly (tests/test_engine.py checks every pattern up to B = 12)."""
    if not any(finished_host):
        return None
    kept = finished_host.count(False)
    moved = sum(finished_host[:kept])
    to = rows_where(finished[:kept], moved)
    frm = kept + rows_where(~finished[kept:], moved)
    order = torch.arange(kept, device=finished.device).index_copy(0, to, frm)
    return RowsLeaving(order, to, frm)


def host_rows(rows: list, device) -> torch.Tensor:
    """A host list of row indices on ``device``, copied without waiting for the stream."""
    return torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)


def compact_sources(valid: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor,
                    width: int) -> torch.Tensor:
    """Source slot of every slot of the contiguous layout at ``width`` (0 on padding).

    valid, positions: [B, S]; lengths: [B] (valid slots per row, ``<= width``).
    Returns [B, width] long. Built by one int scatter of ``layout.compact_dest_slot``
    (destination ``pad + position`` of each valid source slot, invalid ones to a trash
    column that is dropped); callers then gather with it.
    """
    b, s = valid.shape
    pad = layout.new_padding(width, lengths)[:, None]
    dest = layout.compact_dest_slot(layout.TORCH, valid.bool(), positions, pad, width)
    src = torch.zeros(b, width + 1, dtype=torch.long, device=valid.device)
    src.scatter_(1, dest, torch.arange(s, device=valid.device).expand(b, s))
    return src[:, :width]


def compact_tokens(tokens, valid, positions, lengths, width):
    """(tokens, valid) of the contiguous layout at ``width`` (see ``compact_sources``)."""
    src = compact_sources(valid, positions, lengths, width)
    j = torch.arange(width, device=tokens.device)[None, :]
    new_valid = layout.slot_valid(j, layout.new_padding(width, lengths)[:, None])
    return torch.where(new_valid, tokens.gather(1, src), PAD_FILL), new_valid


def dummy(batch_size: int = 2, width: int = 5, max_budget: int = 4) -> RaggedBatch:
    """A small consistent batch for tests: row b has width - b real tokens (min 1)."""
    prompts = [list(range(3, 3 + max(1, width - b))) for b in range(batch_size)]
    tokens, valid, positions, lengths = left_pad(prompts)
    z = torch.zeros(batch_size, dtype=torch.long)
    return RaggedBatch(
        tokens=tokens, valid=valid, positions=positions, lengths=lengths,
        prompt_lengths=lengths.clone(), budgets=z + max_budget, generated=z.clone(),
        finished=torch.zeros(batch_size, dtype=torch.bool), row_ids=torch.arange(batch_size),
        output=torch.zeros(batch_size, max_budget, dtype=torch.long),
        target_cache=SlabCache(1, width + 16),
    )
