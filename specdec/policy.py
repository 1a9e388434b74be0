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
- ``admit(row_ids, batch, drafter) -> list[int]``: rows enter (prefill; ``batch``: the
  admitted rows, the pending token last, after the drafter's prefill and before the
  target's forward, which covers the pending token too when every returned ``k_b`` is 0:
  ``phases.prefill(prime=True)``); their ``k_b`` for their
  first step, as host integers (the device table holds the same values; a policy that
  plans them on the device reads them once per prefill, never in a step);
- ``lengths(batch, k_step) -> [B] long``: this step's ``k_b`` of the batch's rows (device,
  each ``<= k_step``, the step's drafts);
- ``plan(batch, spec, drafter, k_step) -> [B] long``: after the commit, every row's
  ``k_b`` for its next step (device, ``0 .. k``; finished rows 0);
- ``observe(width, rows, seconds)``: the wall time of one step of verify width ``width``
  over ``rows`` rows, measured from one host read to the next (host floats only);
- optional, an attribute ``refills``: where a policy has one, ``generate`` sets it before
  ``begin`` to the strategy's ``refills`` (whether a row that finishes hands its place to
  a waiting request; ``specdec.strategies``).

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
  the drafter's prior (``evidence_prior``, worth ``PRIOR_WEIGHT`` observations); with
  ``cautious=True`` (off by default) it uses one standard error below it, ``p - sqrt(p
  (1 - p) / n)`` over the ``n`` observations counted, so that evidence seen a few times
  pays less than the same acceptance proven;
- the cost of verify width on this machine: ``StepCosts``, calibrated online from the
  step timings the engine records (``observe``), as the ratio ``r(w)`` of a step of width
  ``w`` to a plain step over as many rows.

From them: ``E_b(j)``, the expected tokens row ``b`` commits with ``j`` drafts
(``1 + sum_i prod_{l<i} p_l``, capped by its budget). The step's width ``w`` maximises the
batch's expected tokens per unit of cost, ``sum_b v_b E_b(w - 1) / r(w)``, and must beat
a plain step (``sum_b v_b / r(1)``) by ``margin`` (5%); otherwise every row drafts 0 and
the step is plain decoding (width 1). "Once no request waits" below means: no request
waits for a place that a finishing row would free (``AdaptivePolicy.waits``: every
request was admitted, or the strategy decodes fixed batches and never refills, as EQSPEC
and holes do). Once no request waits and the step has several
rows, a drafter whose evidence stands without drafting (``standing_evidence``: the n-gram
drafter's match lengths) must beat it by ``drain_margin`` (``DRAIN_MARGIN``, 40%): the
batch then ends with its slowest row, and marginal steps priced on the sum of the rows'
tokens lose there (``docs/history/draft-lengths.md``).
(Optionally, ``AdaptivePolicy(harmonic=True)``: once no request waits, the weighted
harmonic mean ``sum_b v_b / sum_b (v_b / E_b(w - 1))`` takes the sum's place, a plain step being worth 1; ``AdaptivePolicy.value``. Off by
default: its measurements were mixed, ``docs/history/draft-lengths.md``. Also an
option, off by default: ``AdaptivePolicy(own=W)`` corrects the class acceptance by what
each row's own drafts achieved in the call, ``own_factor``: accepted against what their
classes expected, the class estimate worth ``W`` expected acceptances; ``own_call=C``
the same over the whole call. On the device, no host read.) ``v_b`` is
what row b's tokens are worth: 1 while requests wait for admission and the strategy
refills (EXSPEC's pool gives a row that finishes early to the next), and otherwise
(every request admitted, or a strategy of fixed batches, EQSPEC and holes, whose next
batch waits for the whole of this one) ``(remaining_b / max remaining) ** drain``
(``DRAIN``): the batch
then ends with its slowest row, and tokens of rows ahead of it shorten nothing. A step
is as wide for every row (the verify forward is rectangular),
so when a step drafts, every active row uses its ``w - 1`` drafts: a row whose own
evidence is weak adds its expected tokens at no cost beyond the width the others pay
for, and a row drafts only in a step whose expected committed tokens per unit of cost
beat a plain step. Rows near their budget use fewer (``draft_limit``).

What a policy learns lives in a ``Calibration`` (step costs and acceptance); with
``policy="adaptive"`` it is the target model's own (``calibration(model)``), kept across
``generate`` calls, and the first step of admitted rows is planned from the drafter's
evidence on their prompts (``admit``), so a call starts where the last one left off
rather than at ``k_b = 0`` with nothing measured.
"""

from __future__ import annotations

import weakref
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
#: observations per (feature, slot) that acceptance carried into a generate call weighs
MEMORY = 32.0
#: once no request waits, a row's committed tokens are worth (its remaining budget over the
#: batch's most remaining) to this power: the batch ends with its slowest row
DRAIN = 8.0
#: once no request waits, how much a step over several rows must beat a plain step for a
#: drafter whose evidence stands without drafting (``standing_evidence``: the n-gram
#: drafter); the batch ends with its slowest row (``AdaptivePolicy(drain_margin=...)``)
DRAIN_MARGIN = 0.4
#: the most a row's corrected acceptance per slot may reach (``AdaptivePolicy(own=...)``)
OWN_CAP = 0.99


class DraftPolicy(Protocol):
    """The interface (see the module docstring)."""

    def begin(self, k: int, requests: int, device) -> None: ...
    def admit(self, row_ids: Sequence[int], batch=None, drafter=None) -> list[int]: ...
    def lengths(self, batch, k_step: int) -> torch.Tensor: ...
    def plan(self, batch, spec, drafter, k_step: int) -> torch.Tensor: ...
    def observe(self, width: int, rows: int, seconds: float) -> None: ...


class FixedPolicy:
    """Every row drafts ``k`` every step (verify width ``k + 1``): today's behaviour."""

    name = "fixed"

    def begin(self, k: int, requests: int, device) -> None:
        self.k = k

    def admit(self, row_ids, batch=None, drafter=None) -> list[int]:
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

    def admit(self, row_ids, batch=None, drafter=None) -> list[int]:
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
    step of width ``w`` over the cost of a plain step (``r(1) = 1``) over as many rows:
    measured widths as measured, others interpolated linearly in ``w`` between measured
    ones, and past the widest measured extrapolated with the slope of the last two
    measured widths but at most ``slope`` (``PRIOR_SLOPE``: optimism, so that a wider step
    is tried and measured once the evidence favours it); with no measurement beyond width
    1, ``1 + slope (w - 1)``. Before a plain step over ``rows`` rows was measured, the
    ratios of the nearest batch size that has one stand in (the nearest larger first: rows
    leave a batch one by one as they finish, so 7 rows borrow what 8 measured); with no
    plain step measured at any batch size it returns None: the policy then plans a plain
    step, which costs what plain decoding costs and measures the base every ratio needs.
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

    def ratios(self, rows: int, widths: int) -> list[float] | None:
        """``[r(1), .., r(widths)]`` for a step over ``rows`` rows (None: no plain step
        measured at any batch size yet)."""
        t = self.seconds.get(rows, {})
        if 1 not in t:
            based = [n for n, table in self.seconds.items() if 1 in table]
            if not based:
                return None
            larger = [n for n in based if n > rows]
            t = self.seconds[min(larger) if larger else max(based)]
        points = {w: s / t[1] for w, s in t.items()}
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


class Calibration:
    """What adaptive policies learn about one model on this machine, kept across
    ``generate`` calls: the cost of verify width (``costs``, a ``StepCosts``) and the
    acceptance statistics per drafter kind (``acceptance``: (drafter class, its
    ``evidence_prior``, k) -> [tries, hits], [F * k] float each). ``calibration(model)``
    gives the model's own; ``policy="adaptive"`` starts from it, so a call begins with the
    widths and acceptance the earlier calls measured instead of the priors."""

    def __init__(self, costs: StepCosts | None = None):
        self.costs = costs if costs is not None else StepCosts()
        self.acceptance: dict = {}


_CALIBRATIONS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def calibration(model) -> Calibration:
    """The ``Calibration`` of ``model`` (one per model object, dropped with it)."""
    found = _CALIBRATIONS.get(model)
    if found is None:
        found = _CALIBRATIONS[model] = Calibration()
    return found


_model_calibration = calibration  # (``resolve`` has a parameter of that name)


def forget_calibration(model=None) -> None:
    """Drop what adaptive policies learned about ``model`` (every model when None): the
    next ``policy="adaptive"`` call starts from the priors again, as a first call does."""
    if model is None:
        _CALIBRATIONS.clear()
    else:
        _CALIBRATIONS.pop(model, None)


class AdaptivePolicy(_PerRequest):
    """Per-row draft lengths for goodput (see the module docstring).

    ``margin``: how much a drafting step's expected goodput must beat a plain step's
    (0.05: by 5%); ``calibration``: where the learned step costs and acceptance live
    (default: a fresh ``Calibration``, kept by this object across the ``generate`` calls
    it is passed to; ``policy="adaptive"`` passes the model's own, ``calibration(model)``);
    ``costs``: a ``StepCosts`` for a fresh calibration. Acceptance carried into a call
    weighs at most ``MEMORY`` observations per (feature, slot), so that a new call's
    prompts take over within a few steps. ``drain``: the power of a row's share of the
    most remaining budget in what its tokens are worth once no request waits (``DRAIN``;
    0: every active row's tokens count alike); ``cautious``: price acceptance one
    standard error below its estimate (default False: the estimate itself; True drafted
    too little at batch 1, ``docs/history/draft-lengths.md``); ``harmonic``: once no
    request waits, a step's return is the rows' weighted harmonic mean of expected tokens
    (``value``; default False: their weighted sum, as while requests wait; True lifted
    the kinds that barely draft but cost the kinds where drafts are best, ``docs/history/draft-lengths.md``);
    ``own``: the weight, in expected acceptances, of the class estimate against each
    row's own record in the call (``own_factor``; default 0: no correction; 3 and 12
    measured within the noise of the default, same page); ``own_call``: the same for the
    call's record, every row's prior (default 0: none). ``drain_margin``: the margin of
    a step over more than one row once no request waits (default ``DRAIN_MARGIN``, 0.4),
    for a drafter whose evidence stands without drafting (its ``standing_evidence`` is
    True: ``NGramDrafter``); the batch then ends with its slowest row, and a step's
    expected tokens, summed over rows, overstate what it takes off the call when they
    land on rows other than the slowest (or when the class estimate, learned on other
    prompts, overrates a marginal match). Any other drafter keeps ``margin`` there: its
    evidence is refreshed only by its own drafts (``ModelDrafter``'s confidence) or it
    has none (``ScriptedDrafter``: one class, from the prior of 0.5), so a margin that
    stops it drafting would stop it learning that its drafts are good. (0.4 lifted the
    priced floor over prompt kinds from 0.920 to 0.981; a call of one batch of prompts
    that quote little then drafts nothing, which is why ``specdec audit``, which must
    exercise its engines, asks for ``"adaptive:drain_margin=0.05"``; ``docs/history/draft-lengths.md``.) The options priced for
    the floor (``docs/history/draft-lengths.md``, round i17s), all off by default: ``shadow`` (plain steps count each row's would-be
    first draft, ``learn_plain``); ``minority`` (a width whose rows that pay for it alone
    hold under half the weight must beat a plain step by this much more); ``memory``
    (observations per class carried into a call, ``MEMORY``); ``slowest`` (once no
    request waits, a step's return is the expected drop of the batch's most remaining
    budget, ``slowest_value``); ``blend`` (between that and the rows' mean tokens, by
    the call's share of rows whose evidence pays alone, to this power).
    """

    name = "adaptive"
    #: whether the strategy hands a finished row's place to a waiting request (set by
    #: ``generate``; see ``waits``)
    refills = True

    def __init__(self, margin: float = 0.05, costs: StepCosts | None = None,
                 calibration: Calibration | None = None, drain: float = DRAIN,
                 cautious: bool = False, harmonic: bool = False, own: float = 0.0,
                 own_call: float = 0.0, shadow: bool = False, minority: float = 0.0,
                 slowest: bool = False, blend: float = 0.0, drain_margin: float = DRAIN_MARGIN,
                 memory: float = MEMORY):
        from . import validation

        self.margin = validation.number(margin, "AdaptivePolicy margin", 0, 10)
        self.drain_margin = validation.number(drain_margin, "AdaptivePolicy drain_margin", 0, 10)
        self.drain = validation.number(drain, "AdaptivePolicy drain", 0, 64)
        self.own = validation.number(own, "AdaptivePolicy own", 0, 1e6)
        self.own_call = validation.number(own_call, "AdaptivePolicy own_call", 0, 1e6)
        self.minority = validation.number(minority, "AdaptivePolicy minority", 0, 10)
        self.memory = validation.number(memory, "AdaptivePolicy memory", 1, 1e6)
        self.shadow = bool(shadow)
        self.slowest = bool(slowest)
        self.blend = validation.number(blend, "AdaptivePolicy blend", 0, 64)
        self.cautious = bool(cautious)
        self.harmonic = bool(harmonic)
        self.calibration = calibration if calibration is not None else Calibration(costs)
        self._stats_key = None
        self._standing = False  # the drafter's ``standing_evidence`` (``_prepare``)

    @property
    def waits(self) -> bool:
        """Whether a row that finishes now frees its place for a request (one waits for
        admission and the strategy ``refills``); otherwise the batch ends with its slowest
        row."""
        return self.refills and self.waiting > 0

    @property
    def costs(self) -> StepCosts:
        """The calibration's step costs."""
        return self.calibration.costs

    def begin(self, k: int, requests: int, device) -> None:
        super().begin(k, requests, device)
        # [N, k] long: evidence bucket of every slot of the request's next step
        self.bucket = torch.zeros(requests, max(k, 1), dtype=torch.long, device=device)
        # [N] float each: every request's own record in this call, over the slots its
        # drafts reached: drafts accepted, and drafts the class estimates expected accepted
        self.row_hits = torch.zeros(requests, dtype=torch.float32, device=device)
        self.row_expected = torch.zeros(requests, dtype=torch.float32, device=device)
        # [N] long, [N] bool: every request's first draft of its next step, had it one
        # (``shadow``: a plain step's commit tells whether it would have been accepted)
        self.first = torch.zeros(requests, dtype=torch.long, device=device)
        self.has_first = torch.zeros(requests, dtype=torch.bool, device=device)
        # [1] float each: over this call's plans, the summed share of active rows whose
        # own evidence pays for some width alone, and the plans counted (``blend``)
        self.paying = torch.zeros(1, dtype=torch.float32, device=device)
        self.plans = torch.zeros(1, dtype=torch.float32, device=device)
        self.waiting = requests  # requests not admitted yet (host integer)
        self._stats_key = None  # re-read (and age) the calibration's acceptance
        # [1, k+1] long: 0 .. k, the draft counts of a step (built once per call, not per plan)
        self.counts = torch.arange(k + 1, device=device)[None, :]

    def _prepare(self, drafter, k: int, device) -> None:
        """Acceptance statistics per (feature, slot) of this drafter kind and ``k``: the
        calibration's (aged to at most ``MEMORY`` observations each), else the drafter's
        prior."""
        prior = list(getattr(drafter, "evidence_prior", None) or [0.5])
        key = (type(drafter).__name__, tuple(prior), k)
        if key == self._stats_key and self.tries.device == torch.device(device):
            return
        self._stats_key = key
        # the drain margin applies to a drafter whose evidence stands without drafting
        self._standing = bool(getattr(drafter, "standing_evidence", False))
        kept = self.calibration.acceptance.get(key)
        if kept is None:
            p0 = torch.tensor(prior, dtype=torch.float32).repeat_interleave(max(k, 1))
            kept = [torch.full_like(p0, PRIOR_WEIGHT), p0 * PRIOR_WEIGHT]  # [F * k] each
        tries, hits = (x.to(device) for x in kept)
        age = (self.memory / tries).clamp(max=1.0)
        self.tries, self.hits = tries * age, hits * age  # [F * k] each
        self.calibration.acceptance[key] = [self.tries, self.hits]  # learn() adds in place

    def admit(self, row_ids, batch=None, drafter=None) -> list[int]:
        """The admitted rows' first ``k_b``, planned from the drafter's evidence on their
        prompts (one host read per prefill); without a batch, 0 (plain steps until a
        commit gives evidence)."""
        self.waiting = max(0, self.waiting - len(row_ids))
        if batch is None or drafter is None or self.k == 0 or not len(row_ids):
            return self._admit_as(row_ids, [0] * len(row_ids))
        self._prepare(drafter, self.k, batch.device)
        nothing = batch.lengths.new_zeros(batch.batch_size, 0)  # [B, 0]: no commit yet
        features = self.features(batch, drafter, nothing, batch.lengths.new_zeros(batch.batch_size))
        values = self.decide(batch, features).tolist()
        return values

    def features(self, batch, drafter, predictions, committed) -> torch.Tensor:
        """[B, k] long: the drafter's evidence for every row's next drafts (one feature
        when it gives none)."""
        evidence = getattr(drafter, "evidence", None)
        if evidence is None:
            return torch.zeros(batch.batch_size, self.k, dtype=torch.long, device=batch.device)
        both = getattr(drafter, "evidence_drafts", None)
        if not self.shadow or both is None:
            return evidence(batch, predictions, committed, self.k)
        features, first = both(batch, predictions, committed, self.k)
        self.first.index_copy_(0, batch.row_ids, first)
        self.has_first.index_copy_(0, batch.row_ids, ~batch.finished)
        return features

    def learn(self, batch, spec, k_step: int) -> None:
        """Count, per (feature, slot) of this step's drafts, the slots reached (every
        earlier draft accepted, within the row's limit) and accepted."""
        if k_step == 0:
            if self.shadow:
                self.learn_plain(batch, spec)
            return
        bucket = self.bucket.index_select(0, batch.row_ids)[:, :k_step]  # [B, ks]
        j = torch.arange(k_step, device=bucket.device)[None, :]
        a = spec.accepted[:, None]
        reached = (j < spec.limit[:, None]) & (j <= a)
        hit = j < a
        if self.own or self.own_call:  # the row's own record, against what its classes
            # expected (before this step's counts join the class estimates)
            rows = batch.row_ids
            p = self.hits[bucket] / self.tries[bucket]  # [B, ks]
            self.row_expected.index_add_(0, rows, (p * reached).sum(dim=1))
            self.row_hits.index_add_(0, rows, hit.float().sum(dim=1))
        self.tries.index_add_(0, bucket.flatten(), reached.flatten().float())
        self.hits.index_add_(0, bucket.flatten(), hit.flatten().float())

    def learn_plain(self, batch, spec) -> None:
        """``shadow``: a plain step counts too. The first draft each row would have
        verified (``first``, from the drafter's ``evidence_drafts`` at the plan) is
        accepted exactly when it equals the token the step committed, the target's
        choice at the pending token: one observation of slot 0 of the row's evidence
        class per row whose budget allowed a draft (as a drafting step's ``learn``
        counts it), so that what a class earns on this call's prompts is measured on
        every step, not only on the steps its estimate made the policy draft."""
        rows = batch.row_ids
        before = batch.remaining + spec.committed  # budget before this step
        seen = self.has_first.index_select(0, rows) & (before > 1)  # [B]
        hit = seen & (self.first.index_select(0, rows) == spec.predictions[:, 0])
        slot0 = self.bucket.index_select(0, rows)[:, 0]  # [B]: its class at slot 0
        self.tries.index_add_(0, slot0, seen.float())
        self.hits.index_add_(0, slot0, hit.float())

    def expected(self, batch, features: torch.Tensor) -> torch.Tensor:
        """[B, k+1] float: ``E_b(j)``, expected tokens committed with ``j`` drafts (capped
        at the row's budget after this step's commit)."""
        k = self.k
        bucket = features * k + self.counts[:, :k]  # [B, k]
        self.bucket.index_copy_(0, batch.row_ids, bucket)
        tries = self.tries[bucket]
        p = self.hits[bucket] / tries
        if self.cautious:  # one standard error below the estimate: unproven evidence pays less
            p = (p - (p * (1 - p) / tries).sqrt()).clamp(min=0.0)
        if self.own or self.own_call:  # corrected by what the row's own drafts achieved
            p = (p * self.own_factor(batch)[:, None]).clamp(max=OWN_CAP)
        reach = torch.cumprod(p, dim=1)
        e = torch.nn.functional.pad(1 + torch.cumsum(reach, dim=1), (1, 0), value=1.0)  # [B, k+1]
        usable = layout.draft_limit(layout.TORCH, k, batch.remaining)  # [B]
        return e.gather(1, torch.minimum(self.counts, usable[:, None]))

    def own_factor(self, batch) -> torch.Tensor:
        """[B] float: how far each row's drafts did better (> 1) or worse (< 1) than their
        evidence classes expected, shrunk toward 1: ``(own + accepted) / (own + expected)``
        over the slots its drafts reached in this call (``expected``: the sum of the class
        acceptance at each reached slot, as estimated when the step was verified). The
        class estimate is the prior, worth ``own`` expected acceptances; the row's own
        record the data (a Gamma posterior mean of the rate ratio). A row that never
        drafted, or whose drafts did as their classes do, keeps the class estimate. With
        ``own_call``, the call's record (every request of this ``generate`` call, the
        same ratio with prior weight ``own_call``) corrects the class estimate first, and
        is the prior of each row's (or, with ``own = 0``, every row's factor)."""
        rows = batch.row_ids
        hits = self.row_hits.index_select(0, rows)
        expected = self.row_expected.index_select(0, rows)
        base = 1.0
        if self.own_call:  # [1]: the whole call's drafts against their classes
            base = (self.own_call + self.row_hits.sum(0, keepdim=True)) / (
                self.own_call + self.row_expected.sum(0, keepdim=True))
            if not self.own:
                return base.expand_as(hits)
        return (self.own * base + hits) / (self.own + expected)

    def decide(self, batch, features: torch.Tensor) -> torch.Tensor:
        """[B] long: every row's next ``k_b`` from its evidence (device; finished rows 0);
        records it in the request table."""
        k = self.k
        e = self.expected(batch, features)  # [B, k+1]
        active = ~batch.finished
        ratios = self.costs.ratios(max(1, batch.batch_size), k + 1)
        if ratios is None:  # no plain step over as many rows measured: plan one
            nxt = torch.zeros_like(batch.lengths)
            self.next.index_copy_(0, batch.row_ids, nxt)
            return nxt
        # 1 / r(w) for w = 1 .. k+1 (host floats, used as scalars: nothing is uploaded)
        scale = [1.0 / x for x in ratios]
        # the step's width: the batch's expected tokens per cost, where every active row
        # uses the step's w - 1 drafts (the verify forward is rectangular: once the step
        # is w wide, a row's drafts cost nothing more than its plain token), a plain step
        # given the margin
        v = self.weights(batch)
        total = self.value(e, v[:, None])  # [k+1]
        if self.blend:  # how often this call's rows have evidence that pays alone
            pays = torch.stack([e[:, j] * scale[j] for j in range(1, k + 1)], dim=1)
            pays = ((pays >= 1 + self.margin).any(dim=1) & active).float()
            self.paying += pays.sum() / active.sum().clamp(min=1)
            self.plans += 1
        if (self.slowest or self.blend) and not self.waits:
            slow = self.slowest_value(batch, e)
            if self.blend:  # between the slowest row's drop and the rows' mean tokens
                rho = (self.paying / self.plans.clamp(min=1)) ** self.blend
                mean = (e * v[:, None]).sum(dim=0) / v.sum().clamp(min=1e-30)  # plain: 1
                total = slow + rho * (mean - slow)
            else:
                total = slow
        if self.minority:  # a width that most of the weight does not pay for alone must
            # beat a plain step by ``minority`` more
            alone = torch.stack([e[:, j] * scale[j] for j in range(k + 1)], dim=1) >= 1 + self.margin
        # the batch ends with its slowest row (and the drafter sees its evidence anyway)
        several = not self.waits and batch.batch_size > 1 and self._standing
        scale[0] *= 1 + (self.drain_margin if several else self.margin)
        score = list(torch._foreach_mul(total.unbind(), scale))  # total[j] * scale[j]
        if self.minority:
            share = (v[:, None] * alone).sum(dim=0) / v.sum().clamp(min=1e-30)  # [k+1]
            strict = torch.where(share < 0.5, 1.0 / (1.0 + self.minority), 1.0)
            score = [score[0]] + [score[j] * strict[j] for j in range(1, k + 1)]
        width = torch.stack(score).argmax()  # w - 1
        nxt = width * active  # finished rows draft 0
        self.next.index_copy_(0, batch.row_ids, nxt)
        return nxt

    def value(self, e: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[k+1]: what a step of each width returns (before its cost), from ``e`` [B, k+1]
        (``expected``) and the rows' weights ``v`` [B, 1] (``weights``). While requests
        wait, the weighted sum of the rows' expected tokens (a pool refills a row that
        finishes early: tokens are what count), and so by default. Once none waits, with
        ``drain`` and ``harmonic``, their weighted harmonic mean ``sum v / sum (v / E)``:
        the batch then ends with its slowest row, and which row that is follows the rows'
        evidence (rows with matches get ahead, rows without stay behind), so the return is
        one of time per row, ``1 / E``, averaged, and a step pays only when most rows that
        count expect more than a token from it. Every row alike (a batch of one; drafts
        with the same acceptance for every row) gives what the weighted sum gives. A plain
        step is worth ``sum v`` and 1 respectively."""
        if self.waits or not self.drain or not self.harmonic:
            return (e * v).sum(dim=0)
        return v.sum(dim=0) / (v / e).sum(dim=0).clamp(min=1e-30)

    def slowest_value(self, batch, e: torch.Tensor) -> torch.Tensor:
        """[k+1]: ``slowest``, once no request waits: the expected drop of the batch's most
        remaining budget ``M`` with each number of drafts (a plain step: 1): what the step
        takes off the call's remaining steps if every later step is plain. With ``s_b = M - remaining_b`` (how
        far row b is ahead) and ``T_b`` its committed tokens, the drop is ``1 + sum_{t=1..j}
        prod_b P(T_b >= t + 1 - s_b)``, and ``P(T_b >= u) = E_b(u - 1) - E_b(u - 2)`` for
        ``u >= 2`` (1 below): the rows' outcomes independent, finished rows never the
        slowest."""
        k = self.k
        active = ~batch.finished
        left = torch.where(active, batch.remaining, -(1 << 30))  # [B]
        ahead = (left.max() - left)[:, None]  # [B, 1]
        t = torch.arange(1, k + 1, device=e.device)[None, :]  # [1, k]
        inc = e[:, 1:] - e[:, :-1]  # [B, k]: P(T_b >= i + 2), i = 0 .. k-1
        at = t - 1 - ahead  # [B, k]
        g = torch.where(at < 0, 1.0, inc.gather(1, at.clamp(min=0, max=k - 1)))
        h = g.prod(dim=0)  # [k]
        return torch.cat([h.new_ones(1), 1 + torch.cumsum(h, dim=0)])

    def weights(self, batch) -> torch.Tensor:
        """[B] float: what a committed token of each row is worth to the step's choice.
        While requests wait, 1 for every active row (a row that finishes frees its place
        for the next request); once none waits, the batch ends with its slowest row, so a
        row's tokens are worth ``(remaining / most remaining) ** drain`` (the rows furthest
        from their end count fully, rows ahead of them less); finished rows 0."""
        active = ~batch.finished
        if self.waits or not self.drain:
            return active.float()
        left = torch.where(active, batch.remaining, 0).float()  # [B]
        return (left / left.max().clamp(min=1.0)) ** self.drain

    def plan(self, batch, spec, drafter, k_step: int) -> torch.Tensor:
        k = self.k
        self._prepare(drafter, k, batch.device)
        self.learn(batch, spec, k_step)
        if k == 0:
            return torch.zeros_like(batch.lengths)
        return self.decide(batch, self.features(batch, drafter, spec.predictions, spec.committed))

    def observe(self, width: int, rows: int, seconds: float) -> None:
        self.costs.observe(width, rows, seconds)


POLICIES = ("adaptive", "fixed")


def _flag(value: str) -> bool:
    return bool(float(value))


#: the ``AdaptivePolicy`` options a policy string ``"adaptive:NAME=VALUE,.."`` may set,
#: each with how its value is read
OPTIONS = {"margin": float, "drain": float, "drain_margin": float, "own": float,
           "own_call": float, "minority": float, "memory": float, "blend": float,
           "cautious": _flag, "harmonic": _flag, "shadow": _flag, "slowest": _flag}


def parse(spec: str) -> tuple[str, dict]:
    """A policy string: ``"adaptive"``, ``"fixed"`` or ``"adaptive:NAME=VALUE,.."``
    (``AdaptivePolicy`` options, ``OPTIONS``): ``"adaptive:drain_margin=0.05"`` ->
    ``("adaptive", {"drain_margin": 0.05})``. Raises ValueError stating the rule."""
    name, _, arg = spec.partition(":")
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, 'adaptive:NAME=VALUE,..' or a "
                         f"DraftPolicy object, got {spec!r}")
    if not arg:
        return name, {}
    if name != "adaptive":
        raise ValueError(f"policy {spec!r}: only adaptive takes options")
    opts = {}
    for item in arg.split(","):
        key, eq, value = item.partition("=")
        if not eq or key not in OPTIONS:
            raise ValueError(f"policy {spec!r}: options are NAME=VALUE with NAME one of "
                             f"{', '.join(OPTIONS)}")
        try:
            opts[key] = OPTIONS[key](value)
        except ValueError:
            raise ValueError(f"policy {spec!r}: {key} takes a number, got {value!r}") from None
    return name, opts


def resolve(policy, model=None, *, calibration: Calibration | None = None) -> DraftPolicy:
    """``"adaptive"`` (a fresh ``AdaptivePolicy`` on ``calibration``, else on ``model``'s
    own, ``calibration(model)``, when given), ``"adaptive:NAME=VALUE,.."`` (the same with
    those options, ``parse``), ``"fixed"`` or a policy object (anything with the
    ``DraftPolicy`` methods)."""
    if isinstance(policy, str):
        name, opts = parse(policy)
        if name == "fixed":
            return FixedPolicy()
        if calibration is None and model is not None:
            calibration = _model_calibration(model)
        return AdaptivePolicy(calibration=calibration, **opts)
    missing = [m for m in ("begin", "admit", "lengths", "plan", "observe") if not callable(getattr(policy, m, None))]
    if missing:
        raise TypeError(f"policy must be one of {POLICIES} or an object with the DraftPolicy "
                        f"methods (specdec.policy), got {type(policy).__name__} without "
                        f"{', '.join(missing)}")
    return policy

