"""What ``Monitor`` and ``guard_model`` share: the mode, recording or raising violations,
and the flags that wait on the device until one host read reports them.

A check appends an ``Entry`` (its ``[B]`` bool masks stay on the device; failures known
on the host, such as a wrong shape, are kept as such); ``read()`` moves the masks of every
pending entry to the host in one transfer and lets the checker report each entry that has
a flagged row, in order, through ``report(entry, rows)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .modes import MODES, check_mode
from .trace import InvariantViolation


@dataclass
class Entry:
    """One checked phase (or forward): device masks plus what the report needs."""

    # [B] bool device masks, True on rows that break something
    masks: list
    # something is known broken on the host already (no read needed to know)
    host_failure: bool = False
    # checker-specific context for the report (view, state, records ...)
    context: dict = field(default_factory=dict)


class Checker:
    """Mode, violations, raising, the pending device flags and their one read."""

    def __init__(self, mode: str = "strict", *, raise_on_violation: bool = True,
                 run: dict | None = None, max_violations: int = 100):
        self.mode = check_mode(mode)
        self.raise_on_violation = raise_on_violation
        self.run = dict(run or {})
        self.max_violations = max_violations
        self.violations: list[InvariantViolation] = []
        self._pending: list[Entry] = []
        self._reported = 0

    def report(self, entry: Entry, rows: list) -> None:  # pragma: no cover - abstract
        """Report the violation of ``entry``; ``rows[i]`` is ``entry.masks[i]`` as host
        bools."""
        raise NotImplementedError

    def _emit(self, violation: InvariantViolation) -> None:
        if len(self.violations) < self.max_violations:
            self.violations.append(violation)
        if self.raise_on_violation:
            self._reported = len(self.violations)
            raise violation

    def read(self) -> None:
        """Move every pending mask to the host in one transfer and report the entries
        that have a flagged row (or a host failure), in order."""
        pending, self._pending = self._pending, []
        masks = [m for e in pending for m in e.masks]
        flat = torch.cat(masks).tolist() if masks else []  # the one host read
        if not any(flat) and not any(e.host_failure for e in pending):
            return  # nothing flagged (the common case): no entry to walk
        at = 0
        for e in pending:
            rows = []
            for m in e.masks:
                n = m.shape[0]
                rows.append(flat[at : at + n])
                at += n
            if e.host_failure or any(any(r) for r in rows):
                self.report(e, rows)
                if len(self.violations) >= self.max_violations:
                    return

    def check(self) -> list[InvariantViolation]:
        """Read the pending flags (one host transfer) and raise the first violation not
        raised yet; with ``raise_on_violation=False`` return every violation."""
        if self.raise_on_violation:
            try:
                self.read()
            finally:
                self._pending = []
            if self._reported < len(self.violations):  # pragma: no cover - _emit raises
                v = self.violations[self._reported]
                self._reported = len(self.violations)
                raise v
        else:
            self.read()
        return list(self.violations)


__all__ = ["MODES", "Entry", "Checker"]
