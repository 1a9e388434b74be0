"""Draft-length policies: how many drafts each row verifies at each step.

Every step, row ``b`` drafts ``k_b`` tokens, ``0 <= k_b <= k``; the verify forward covers
``max k_b + 1`` tokens per row (``layout.draft_width``), so a step where no row drafts is a
plain decode step of width 1, and a row uses at most ``min(k_b, remaining - 1)`` drafts
(``layout.draft_limit``, the view's ``draft_limit``).

The interface (``DraftPolicy``), called by the shared phases (``specdec/phases.py``) and
never reading the device itself: the verify width is a host fact, so a policy decides
every row's next ``k_b`` on the device right after the commit (``plan``), and the engine
reads those lengths with the step's one host read (``phases.sync``). The next step's
width is then the maximum over the rows that take part in it (for a pool, the rows the
scheduler picks).

- ``begin(k, requests, device)``: a ``generate`` call starts (``k``: the most drafts per
  row; ``requests``: how many prompts, indexed by ``row_ids``);
- ``admit(row_ids) -> list[int]``: rows enter (prefill); their ``k_b`` for their first
  step, as host integers (the device table holds the same values);
- ``lengths(batch, k_step) -> [B] long``: this step's ``k_b`` of the batch's rows (device,
  each ``<= k_step``, the step's drafts);
- ``plan(batch, spec, drafter, k_step) -> [B] long``: after the commit, every row's
  ``k_b`` for its next step (device, ``0 .. k``; finished rows 0);
- ``observe(width, rows, seconds)``: the wall time of one step of verify width ``width``
  over ``rows`` rows, measured from one host read to the next (host floats only).

Policies: ``FixedPolicy`` (``policy="fixed"``: every row drafts ``k``, the behaviour
before per-row lengths), ``AdaptivePolicy`` (the default, ``policy="adaptive"``) and
``ForcedPolicy`` (given lengths per request and step: tests force per-row patterns).

``AdaptivePolicy`` chooses for goodput (committed tokens per second) from two inputs:

- the drafter's evidence: ``drafter.evidence(batch, predictions, committed, k)`` gives a
  feature id per row and draft slot (``NGramDrafter``: the match length and how many
  equally long matches agree on the continuation; ``ModelDrafter``: its own probability
  for each draft); a drafter without ``evidence`` gives one feature. The policy learns,
  online and on the device, the probability that the draft in slot ``j`` is accepted
  given the drafts before it were: per (feature, slot), accepted / reached, starting from
  the drafter's prior (``evidence_prior``, worth ``PRIOR_WEIGHT`` observations);
- the cost of verify width on this machine: ``StepCosts``, calibrated online from the
  step timings the engine records (``observe``), as the ratio ``r(w)`` of a step of width
  ``w`` to a plain step over as many rows.

From them: ``E_b(j)``, the expected tokens row ``b`` commits with ``j`` drafts
(``1 + sum_i prod_{l<i} p_l``, capped by its budget). A row drafts only where its own
best ``E_b(j) / r(j + 1)`` beats a plain step (``> 1``); the step's width ``w`` maximises
the batch's ``sum_b E_b / r(w)`` (rows that draft use ``w - 1`` drafts, the others none),
and must beat plain decoding by ``margin``; otherwise every row drafts 0.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from . import layout

#: observations the drafter's prior acceptance is worth before data takes over
PRIOR_WEIGHT = 2.0
#: StepCosts' assumed extra cost of each verify column before any measurement (relative to
#: a plain step): optimistic for a CPU, so that wider steps get tried and measured
PRIOR_SLOPE = 0.15
#: weight of the newest timing in StepCosts' moving averages
COST_DECAY = 0.3


class DraftPolicy(Protocol):
    """The interface (see the module docstring)."""

    def begin(self, k: int, requests: int, device) -> None: ...
    def admit(self, row_ids: Sequence[int]) -> list[int]: ...
    def lengths(self, batch, k_step: int) -> torch.Tensor: ...
    def plan(self, batch, spec, drafter, k_step: int) -> torch.Tensor: ...
    def observe(self, width: int, rows: int, seconds: float) -> None: ...


class FixedPolicy:
    """Every row drafts ``k`` every step (verify width ``k + 1``): today's behaviour."""

    name = "fixed"

    def begin(self, k: int, requests: int, device) -> None:
        self.k = k

    def admit(self, row_ids) -> list[int]:
        return [self.k] * len(row_ids)

    def lengths(self, batch, k_step: int) -> torch.Tensor:
        return torch.full_like(batch.lengths, k_step)

    def plan(self, batch, spec, drafter, k_step: int) -> torch.Tensor:
        return torch.full_like(batch.lengths, self.k)

    def observe(self, width: int, rows: int, seconds: float) -> None:
        pass


class _PerRequest:
    """A device table of every request's next draft length (indexed by ``row_ids``)."""

    def begin(self, k: int, requests: int, device) -> None:
        self.k = k
        self.next = torch.zeros(requests, dtype=torch.long, device=device)  # [N]

    def lengths(self, batch, k_step: int) -> torch.Tensor:
        return self.next.index_select(0, batch.row_ids).clamp(max=k_step)

    def _admit_as(self, row_ids, values: list[int]) -> list[int]:
        """Set the admitted rows' next lengths (one upload per prefill)."""
        if row_ids:
            rows = torch.tensor(list(row_ids), dtype=torch.long).to(self.next.device)
            self.next.index_copy_(0, rows, torch.tensor(values, dtype=torch.long).to(self.next.device))
        return values


class ForcedPolicy(_PerRequest):
    """Given draft lengths: ``pattern[r][s]`` is request r's ``k_b`` at its s-th step (past
    the end: its last value; empty: ``k``), clamped to ``k``. Tests force per-row
    patterns with it."""

    name = "forced"

    def __init__(self, pattern: Sequence[Sequence[int]]):
        from . import validation

        if isinstance(pattern, (str, bytes)) or not isinstance(pattern, (list, tuple)):
            raise TypeError(f"ForcedPolicy pattern must be a list of draft-length lists, got "
                            f"{validation.describe(pattern)}")
        self.pattern = [validation.token_ids(p, f"ForcedPolicy pattern {r}") for r, p in enumerate(pattern)]
        for r, p in enumerate(self.pattern):
            if any(x < 0 for x in p):
                raise ValueError(f"ForcedPolicy pattern {r} has a negative draft length: {p}")

    def begin(self, k: int, requests: int, device) -> None:
        if requests > len(self.pattern):
            raise ValueError(f"ForcedPolicy has {len(self.pattern)} patterns for {requests} "
                             "prompts: give one per prompt")
        super().begin(k, requests, device)
        steps = max(1, max(len(p) for p in self.pattern))
        table = torch.full((len(self.pattern), steps), k, dtype=torch.long)
        for r, p in enumerate(self.pattern):  # host-side, once per call
            if p:
                table[r, : len(p)] = torch.tensor(p).clamp(max=k)
                table[r, len(p):] = min(p[-1], k)
        self.table = table.to(device)
        self.taken = torch.zeros(requests, dtype=torch.long, device=device)  # steps per request

    def admit(self, row_ids) -> list[int]:
        values = [min(self.pattern[r][0], self.k) if self.pattern[r] else self.k for r in row_ids]
        return self._admit_as(row_ids, values)

    def plan(self, batch, spec, drafter, k_step: int) -> torch.Tensor:
        rows = batch.row_ids
        taken = self.taken.index_select(0, rows) + 1
        self.taken.index_copy_(0, rows, taken)
        col = taken.clamp(max=self.table.shape[1] - 1)
        nxt = self.table.index_select(0, rows).gather(1, col[:, None])[:, 0]
        nxt = torch.where(batch.finished, 0, nxt)
        self.next.index_copy_(0, rows, nxt)
        return nxt

    def observe(self, width: int, rows: int, seconds: float) -> None:
        pass


class StepCosts:
    """The cost of verify width on this machine, from measured step times (host floats).

    ``observe(width, rows, seconds)`` keeps a moving average (``COST_DECAY``) of the
    seconds per step for each (rows, width). ``ratios(rows, widths)`` gives ``r(w)``, a
    step of width ``w`` over the cost of a plain step (``r(1) = 1``), from the nearest
    batch size that has a plain step measured: measured widths as measured, others
    interpolated linearly in ``w`` between measured ones, and past the widest measured
    extrapolated with the slope of the last two measured widths but at most ``slope``
    (``PRIOR_SLOPE``: optimism, so that a wider step is tried and measured once the
    evidence favours it); with no measurement beyond width 1, ``1 + slope (w - 1)``.
    """

    def __init__(self, slope: float = PRIOR_SLOPE, decay: float = COST_DECAY):
        self.slope, self.decay = slope, decay
        self.seconds: dict = {}  # rows -> {width: moving average of seconds per step}

    def observe(self, width: int, rows: int, seconds: float) -> None:
        if seconds <= 0 or rows <= 0:
            return
        table = self.seconds.setdefault(rows, {})
        old = table.get(width)
        table[width] = seconds if old is None else (1 - self.decay) * old + self.decay * seconds

    def ratios(self, rows: int, widths: int) -> list[float]:
        """``[r(1), .., r(widths)]`` for a step over ``rows`` rows."""
        based = [b for b, t in self.seconds.items() if 1 in t]
        points = {1: 1.0}
        if based:
            t = self.seconds[min(based, key=lambda b: (abs(b - rows), -b))]
            points.update({w: s / t[1] for w, s in t.items()})
        known = sorted(points)
        out = []
        for w in range(1, widths + 1):
            if w in points:
                out.append(points[w])
                continue
            lo = max((x for x in known if x < w), default=None)
            hi = min((x for x in known if x > w), default=None)
            if hi is not None:  # between two measured widths
                out.append(points[lo] + (points[hi] - points[lo]) * (w - lo) / (hi - lo))
            elif len(known) >= 2:  # past the widest measured: the last slope, at most the
                a, b = known[-2], known[-1]  # prior's (so that a wider step gets measured)
                slope = min(self.slope, max(0.0, (points[b] - points[a]) / (b - a)))
                out.append(points[b] + slope * (w - b))
            else:
                out.append(1.0 + self.slope * (w - 1))
        return out


class AdaptivePolicy(_PerRequest):
    """Per-row draft lengths for goodput (see the module docstring).

    ``margin``: how much a drafting step's expected goodput must beat a plain step's
    (0.05: by 5%); ``costs``: a ``StepCosts`` (kept across ``generate`` calls when the
    same policy object is passed again, as is the learned acceptance).
    """

    name = "adaptive"

    def __init__(self, margin: float = 0.05, costs: StepCosts | None = None):
        from . import validation

        self.margin = validation.number(margin, "AdaptivePolicy margin", 0, 10)
        self.costs = costs if costs is not None else StepCosts()
        self._stats_key = None

    def begin(self, k: int, requests: int, device) -> None:
        super().begin(k, requests, device)
        # [N, k] long: evidence bucket of every slot of the request's next step
        self.bucket = torch.zeros(requests, max(k, 1), dtype=torch.long, device=device)

    def _prepare(self, drafter, k: int, device) -> None:
        """Acceptance statistics per (feature, slot), kept while the drafter's features
        and ``k`` stay the same."""
        prior = list(getattr(drafter, "evidence_prior", None) or [0.5])
        key = (tuple(prior), k, str(device))
        if key == self._stats_key:
            return
        self._stats_key = key
        p0 = torch.tensor(prior, dtype=torch.float32).repeat_interleave(max(k, 1)).to(device)
        self.tries = torch.full_like(p0, PRIOR_WEIGHT)  # [F * k]
        self.hits = p0 * PRIOR_WEIGHT                   # [F * k]

    def admit(self, row_ids) -> list[int]:
        return self._admit_as(row_ids, [0] * len(row_ids))

    def learn(self, batch, spec, k_step: int) -> None:
        """Count, per (feature, slot) of this step's drafts, the slots reached (every
        earlier draft accepted, within the row's limit) and accepted."""
        if k_step == 0:
            return
        bucket = self.bucket.index_select(0, batch.row_ids)[:, :k_step]  # [B, ks]
        j = torch.arange(k_step, device=bucket.device)[None, :]
        a = spec.accepted[:, None]
        reached = (j < spec.limit[:, None]) & (j <= a)
        self.tries.index_add_(0, bucket.flatten(), reached.flatten().float())
        self.hits.index_add_(0, bucket.flatten(), (j < a).flatten().float())

    def expected(self, batch, features: torch.Tensor) -> torch.Tensor:
        """[B, k+1] float: ``E_b(j)``, expected tokens committed with ``j`` drafts (capped
        at the row's budget after this step's commit)."""
        k = self.k
        j = torch.arange(k, device=features.device)[None, :]
        bucket = features * k + j  # [B, k]
        self.bucket.index_copy_(0, batch.row_ids, bucket)
        p = self.hits[bucket] / self.tries[bucket]
        reach = torch.cumprod(p, dim=1)
        e = torch.cat([torch.ones_like(reach[:, :1]), 1 + torch.cumsum(reach, dim=1)], dim=1)
        usable = layout.draft_limit(layout.TORCH, k, batch.remaining)  # [B]
        return e.gather(1, torch.minimum(torch.arange(k + 1, device=e.device)[None, :], usable[:, None]))

    def plan(self, batch, spec, drafter, k_step: int) -> torch.Tensor:
        k = self.k
        self._prepare(drafter, k, batch.device)
        self.learn(batch, spec, k_step)
        if k == 0:
            return torch.zeros_like(batch.lengths)
        evidence = getattr(drafter, "evidence", None)
        features = evidence(batch, spec.predictions, spec.committed, k) if evidence is not None \
            else torch.zeros(batch.batch_size, k, dtype=torch.long, device=batch.device)
        e = self.expected(batch, features)  # [B, k+1]
        active = ~batch.finished
        # 1 / r(w) for w = 1 .. k+1 (host floats, used as scalars: nothing is uploaded)
        scale = [1.0 / x for x in self.costs.ratios(max(1, batch.batch_size), k + 1)]
        # a row drafts where its own best E(j) / r(j + 1) beats a plain step
        own = torch.stack([e[:, j] * scale[j] for j in range(k + 1)], dim=1).argmax(dim=1)
        drafting = (own >= 1) & active
        # the step's width: the batch's expected tokens per cost (rows that draft use
        # w - 1 drafts, the others none), a plain step given the margin
        total = (torch.where(drafting[:, None], e, 1.0) * active[:, None]).sum(dim=0)  # [k+1]
        scale[0] *= 1 + self.margin
        width = torch.stack([total[j] * scale[j] for j in range(k + 1)]).argmax()  # w - 1
        nxt = torch.where(drafting, width, 0)
        self.next.index_copy_(0, batch.row_ids, nxt)
        return nxt

    def observe(self, width: int, rows: int, seconds: float) -> None:
        self.costs.observe(width, rows, seconds)


POLICIES = ("adaptive", "fixed")


def resolve(policy) -> DraftPolicy:
    """``"adaptive"`` (a fresh ``AdaptivePolicy``), ``"fixed"`` or a policy object
    (anything with the ``DraftPolicy`` methods)."""
    if isinstance(policy, str):
        if policy == "adaptive":
            return AdaptivePolicy()
        if policy == "fixed":
            return FixedPolicy()
        raise ValueError(f"policy must be one of {POLICIES} or a DraftPolicy object, got {policy!r}")
    missing = [m for m in ("begin", "admit", "lengths", "plan", "observe") if not callable(getattr(policy, m, None))]
    if missing:
        raise TypeError(f"policy must be one of {POLICIES} or an object with the DraftPolicy "
                        f"methods (specdec.policy), got {type(policy).__name__} without "
                        f"{', '.join(missing)}")
    return policy

