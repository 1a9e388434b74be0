"""``Coverage``: which triggers a run exercised, so that a fault that never fired is not
reported as clean.

A rule that holds on a run proves nothing about a fault whose situation never arose: a
known-bad engine that keeps tokens after a stop token looks exact on prompts where no
row reaches one. ``Coverage`` is a step hook (``hook(phase, view)``, next to a
``Monitor``, or inside one with ``Monitor(coverage=True)``) that counts, from the same
``StepView`` objects, how often each trigger occurred (``TRIGGERS``):

==================  =========================================================  ========
trigger             what occurred                                              counted
==================  =========================================================  ========
all_accepted        a row accepted every draft of the step (``accepted == k``,    row-steps
                    ``k > 0``): its commit ends with the bonus token
draft_rejected      a row rejected a draft it could use                       row-steps
                    (``accepted < draft_limit``)
stop_reached        a row's commit holds a stop token (``stop_token_ids``)    row-steps
ragged_finish       rows finished at different steps: some rows of the batch  steps
                    finished at this commit while others go on
ragged_realign      a realignment with differing lengths: the rows that go    steps
                    on committed different counts at this step
row_drop            a realignment dropped rows: the ``realign`` view has       steps
                    fewer rows than the commit before it
compaction          the hole layout was compacted: a ``realign`` view of       steps
                    profile ``holes`` narrower than the commit's ``W + k + 1``
                    with no hole left (every row's valid is 0s then 1s)
==================  =========================================================  ========

Cost: a few tensor ops per commit view (and per narrowed holes realign), accumulated into
one device counter (``[6]`` long); nothing is read back, uploaded or sized by data inside
the hook (row_drop compares view shapes, host facts). ``counts()`` reads the
counter once (one host read); call it after the run.
"""

from __future__ import annotations

import torch

from . import predicates as P
from .view import StepView

#: the triggers, in report order
TRIGGERS = ("all_accepted", "draft_rejected", "stop_reached", "ragged_finish",
            "ragged_realign", "row_drop", "compaction")
#: the triggers counted on the device (row_drop compares view shapes on the host)
_DEVICE = tuple(t for t in TRIGGERS if t != "row_drop")


class Coverage:
    """Counts the triggers of ``TRIGGERS`` over every view it is called with (see the
    module docstring); ``counts()`` -> {trigger: count}, one host read."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self._device = None  # [6] long on the views' device, or None before any commit
        self._row_drops = 0
        self._last_commit = None  # (rows, width, k, profile) of the latest commit view

    def __call__(self, phase: str, view: StepView) -> None:
        if phase == "commit":
            self._commit(view)
        elif phase == "realign" and self._last_commit is not None:
            rows, width, k, profile = self._last_commit
            if view.batch_size < rows:
                self._row_drops += 1
            if profile == "holes" and view.profile == "holes" and view.width < width + k + 1:
                # narrower than the holes append: a compaction if no row has holes left
                # (valid is 0s then 1s in every row); a mere crop keeps its holes
                flat = (view.valid.long().diff(dim=1) >= 0).all() if view.width > 1 \
                    else view.valid.new_ones((), dtype=torch.bool)
                self._add("compaction", flat.long())
            self._last_commit = None

    def _add(self, trigger: str, value: torch.Tensor) -> None:
        """Add the device count ``value`` (0-d long) to ``trigger`` (no host read)."""
        step = torch.zeros(len(_DEVICE), dtype=torch.long, device=value.device)
        step[_DEVICE.index(trigger)] = value
        self._device = step if self._device is None else self._device + step

    def _commit(self, view: StepView) -> None:
        self._last_commit = (view.batch_size, view.width, view.k, view.profile)
        acc, lim, com = view.accepted, view.draft_limit, view.committed
        if acc is None or lim is None or com is None or view.generated_before is None:
            return
        stepped = com > 0  # rows that took part in the step
        all_acc = (stepped & (acc == view.k)).sum() if view.k > 0 else acc.new_zeros(())
        rejected = (stepped & (acc < lim)).sum()
        # the tokens this commit wrote: output[b, generated_before : generated_before + com]
        j = torch.arange(view.output.shape[1], device=view.device)[None, :]
        start = view.generated_before[:, None]
        new = (j >= start) & (j < start + com[:, None])
        stops = (new & P.stop_mask(view.output, P.stop_ids(view))).any(dim=1).sum()
        fin = view.finished.bool()
        goes_on = ~fin & stepped
        ragged_finish = (fin & stepped).any() & goes_on.any()
        big = torch.iinfo(torch.long).max
        hi = torch.where(goes_on, com, -1).max() if com.numel() else com.new_zeros(())
        lo = torch.where(goes_on, com, big).min() if com.numel() else com.new_zeros(())
        ragged = (goes_on.sum() > 1) & (hi != lo)
        step = torch.stack([all_acc, rejected, stops, ragged_finish.long(), ragged.long(),
                            torch.zeros_like(all_acc)])  # in _DEVICE's order, no compaction
        self._device = step if self._device is None else self._device + step

    def counts(self) -> dict:
        """{trigger: count} over every view seen since the last ``reset`` (one host read)."""
        dev = self._device.tolist() if self._device is not None else [0] * len(_DEVICE)
        got = {**dict(zip(_DEVICE, (int(x) for x in dev))), "row_drop": self._row_drops}
        return {t: got[t] for t in TRIGGERS}
