"""``Monitor``: a step hook that checks I1-I7 after every phase of a decoding engine.

Use it as a hook: ``specdec.generate(..., hooks=[monitor])``; any engine that calls
``hook(phase, view)`` with a ``StepView`` works.

Modes (``MODES``):

- ``off``: does nothing.
- ``fast``: the cheap invariants (I1-I4, I6) run as tensor ops on the view's device; each
  phase leaves a few ``[B]`` masks on the device, or, at a verify, commit or realign
  view, references to what its fused check reads (``rules.Refs``: the view's tensors and
  their versions, no aten op), checked at the read with every view of its kind at once
  (see "Cost" below). A monitor's first ``PROBATION_STEPS`` steps copy instead (a few
  stacks) and watch whether the engine, or a later hook, writes a view's tensors in
  place after the hook: one that does is checked from the copies for the monitor's life,
  and loses nothing. Past probation such a write is seen at the next hook and the
  monitor copies from then on; the one view whose tensors changed before the read is
  not judged on them but listed in ``unchecked`` with a ``RuntimeWarning``. Inside a hook nothing is read back,
  uploaded or sized by data (``invariants.testing.no_host_transfers`` proves it on a CPU).
  The masks are read at ``check()`` (also ``finish()``, the end of a ``with monitor:``
  block, or the next run's prefill): the one host read of the run, which raises the first
  violation. The engine only calls hooks and cannot tell the monitor that it finished,
  so call ``check()`` after ``generate`` returns, or use the context manager::

      with invariants.Monitor("fast") as m:
          specdec.generate(model, prompts, hooks=[m])   # raises at the end of the block

- ``strict``: the same checks, read back once per engine step: every phase's masks stay
  on the device until the step ends, then one host read raises ``InvariantViolation``
  naming the first failing phase, inside the engine. ``read="phase"`` reads after every
  phase instead (one read per phase; the engine stops at the failing phase itself).
- ``deep``: strict plus I5 (each row's K/V recomputed by a clean batch-1 prefill, compared
  with allclose at every valid cache slot, at the prefill, verify and realign phases;
  tolerances ``predicates.KV_TOLERANCE`` unless ``kv_atol``/``kv_rtol`` are given) and I7
  (after every commit, each row's new tokens are checked by the output oracle,
  ``equivalence.check_row``: up to its first divergence a row must follow the target's
  batch-1 greedy reference, computed here; a divergence that is a numerical near-tie is
  recorded in ``near_ties`` with its evidence, and the row's later tokens are then checked
  against the target's greedy choice after the row's own prefix, so a later desync is still
  raised. ``near_tie_tolerance=None``, the default, is the oracle's calibrated rule,
  measured in the model's dtype and in the view's batch shape; a number is the absolute
  rule). Pending cheap flags are read before a deep violation is raised, so the first
  failing phase is still the one reported.

Sampling engines (``view.sampling``). Coupled mode: the view's ``predictions`` are the
target's coupled choices, so I1-I6 apply unchanged, and deep I7 compares with batch-1
coupled sampling (the argmax of ``view.sampling.scores``; the oracle judges the scores).
Rejection mode: I1-I6 apply unchanged to the step's own choices (accepted drafts, then the
residual or bonus sample): the commit writes exactly them, accepted counts are the longest
prefix of drafts equal to them, budgets and stops hold. What no step rule can check is
that the choices follow the target's distribution: I7 is skipped (each run's skip is
listed in ``unchecked``) and the distribution is tested statistically
(``specdec.forensics.distribution``).

When a step ends: views carry ``step``, the verify steps completed before the phase, so
the views of step ``s`` are the prefill (or the realign that opens the step), draft,
verify and commit. The commit view ends the step: strict mode reads there. A view whose
step differs from the pending ones' (an engine that emits no commit view) and the end
of the run (``check()``, the next run's prefill) read what is left.

Cost: the rules are records (``rules.py``) in groups that read the same tensors; each
group runs as one fused tensor expression (the OR of its rules) and is named rule by rule
only when it flags a row. A group is not re-run when every tensor it reads is the same
object, with the same ``_version`` (so not modified in place), as at its last check
(``skip_unchanged=True``, the default): engines hand the same tokens/valid/positions to
draft, verify and commit, and the same output to commit and realign. At commit the row
tokens (still those of before the commit) are not compared with prompt ++ output again;
the commit rules check what it appends and the realign phase checks the tokens.

In fast mode the three phase fusions (``rules.FUSIONS``: the forward's rules at verify,
the output rules at commit, the layout, position and sequence rules at realign) do not
run in the hook: the hook keeps references to what the fusion reads (``Fusion.refer``:
the view's tensors with their ``_version``, and the commit's snapshot, which the monitor
keeps anyway) and the read (``check()``) checks every waiting view of one kind at once
(``Fusion.batch_refs``: views of one row count laid side by side, one ``cat`` per field
along the slots and an index from each column to its view, so no op runs per view;
views of row counts that fewer than ``SIDE_BY_SIDE`` views share stacked in one more
call, padded on the left with invalid slots, which changes no row's flags; a row-wise
check, ``Fusion.rowwise``, takes every row count in one call; all tested against each
view alone on adversarial views). On probation,
and once an engine was seen writing a view's tensors in place after its hook, the hook
copies instead (``Fusion.defer``, ``Fusion.batch``: one or two stacks per view). A view whose check
cannot wait (another phase, shapes the fusion does not expect) is checked in its hook as
before; once ``MAX_WAITING`` views wait, or the tensors they keep alive reach
``MAX_WAITING_BYTES``, they are checked in the hook (device ops, no read), which bounds
what a long run keeps.
KV provenance (I5-lite, ``provenance.py``) waits the same way in fast mode: the hook
takes the target cache's fingerprints and a copy of the positions and masks they are
checked against (10 aten ops at a verify view instead of 21), and ``check()`` checks
every forward of the run at once (one sort of the records, one binary search per checked
slot; forwards over fewer rows padded with inert zero rows), replaying a flagged view
through the hooks' table to report it.
Strict mode reads every step, so its fusions and its provenance table run in the hooks.

Measured (``benchmarks/monitor_overhead.py --settings cheap --repeats 9 --threads 1
--no-count --replay 10``, tiny Llama, one thread, EQSPEC and holes, both policies, on a
quiet 2-core machine, tree ``adef010``; the README's "Cost of checking" has the table, and
``docs/history/cost-of-checking.md`` what each round changed): fast mode +41-46% wall over
no hooks, strict +43-45%; building the views (a null hook) adds 1.4-3.6%. The targets of
issue 12 (fast +10%, strict +25% over no hooks) are not met: what is left is Python per
view, not aten ops. Replayed alone (``--replay``: one run's views, no model between
hooks), the Monitor's own code takes 238-304 us per engine step in fast mode, 19-22% of
the engine's CPU time with no hooks, and 341-377 us, 26-28%, in strict; in a run it costs
about twice that (the model's forwards themselves run 3-12% slower beside it).

``raise_on_violation=False`` records every violation in ``.violations`` instead of raising
(forensics of known-bad engines); ``check()`` then returns the list. The accepted counts
of every step are kept (``accepted_history``), and the ``run`` dict given at construction
is attached to every trace so that the run can be replayed.

A new run starts at a ``prefill`` view with ``step == 0`` and ``info["batch_index"]`` 0
(or absent): the monitor then finishes the previous run (its pending flags are read, and
a violation raises there) and resets its per-run state.
"""

from __future__ import annotations

import json
import operator
import warnings
from collections import Counter

import torch

from . import predicates as P
from . import provenance as PV
from . import rules as R
from .checker import Checker, Entry
from .coverage import Coverage
from .equivalence import DEFAULT_TOLERANCE, EngineShape, check_row, rule_text
from .modes import MODES, READS
from .trace import MAX_GRID_ROWS, InvariantViolation, grid_row, grid_window, make_trace
from .view import PHASES, StepView

#: phases at which deep mode recomputes the KV cache (draft and commit see the same cache)
KV_PHASES = ("prefill", "verify", "realign")

#: fast mode copies what its deferred checks read during a monitor's first steps (and
#: watches whether the engine writes its views' tensors in place after their hooks) and
#: keeps references from this step on when it never did
PROBATION_STEPS = 2

#: fast mode: the views that wait are checked in a hook (device ops only, no read) once
#: this many wait, or once the tensors they keep alive (the views' own, referenced, or
#: the copies made on probation; ``rules.held_bytes``) reach ``MAX_WAITING_BYTES``: that
#: bounds a long run's memory, while a short run of small views (the cheap setting's 64
#: steps) waits whole for the read and is checked in one batch, not two
MAX_WAITING = 1024
MAX_WAITING_BYTES = 256 * 2**20

#: fast mode's read: views of one row count laid side by side in one call when at least
#: this many share it (``_by_row_count``)
SIDE_BY_SIDE = 4


#: the last sentence of a trace whose view's tensors changed between its hook and the read
#: that reported it (the rules are named, and the grid and state shown, from the tensors
#: as they are at the read)
IN_PLACE_NOTE = ("note: the view's tensors were written in place after its hook, before the "
                 "read that reported it: the rules named, the slots, the grid and the state "
                 "are read from them as they are now, not as the check saw them (the check "
                 "itself, and the step and phase, are right); Monitor(\"strict\", "
                 "read=\"phase\") reads and names at every phase")

#: names in a group's ``reads`` that are monitor state, not view fields
_STATE_NAMES = ("prev", "prompts", "stops", "is_commit", "is_prefill")
_SIMPLE = (str, int, bool, tuple, type(None))
_TENSOR = torch.Tensor


def _signature(values) -> tuple:
    """What the skip test compares between phases, one entry per value: a tensor's
    identity and version counter, a plain value itself, another object's identity. A
    tensor without a version counter (inference mode) gets a new object, equal to
    nothing: its group always runs. (Whoever keeps a signature keeps the values too, so
    no identity is reused while it is remembered.)"""
    try:  # one comprehension: the common case, every tensor with a version counter
        return tuple([(id(x), x._version) if isinstance(x, _TENSOR)
                      else x if type(x) in _SIMPLE else id(x) for x in values])
    except RuntimeError:
        pass
    out = []
    for x in values:
        if isinstance(x, _TENSOR):
            try:
                out.append((id(x), x._version))
            except RuntimeError:
                out.append(object())
        elif type(x) in _SIMPLE:
            out.append(x)
        else:
            out.append(id(x))
    return tuple(out)


class _Plan:
    """The groups that apply to views of one kind (phase, profile, which optional fields
    are present, which monitor state exists), each with how to pick what it compares out
    of the view's one signature; and, per set of groups that run, the fusions to use."""

    __slots__ = ("steps", "fields", "state", "state_index", "get", "fusions", "_all_fusions",
                 "fused_bits")

    def __init__(self, groups, skip: bool, fusions):
        names = [] if not skip else list(dict.fromkeys(
            n for g in groups if g.reads is not None for n in g.reads))
        self.fields = tuple(n for n in names if n not in _STATE_NAMES)
        self.state = tuple(n for n in names if n in _STATE_NAMES)
        self.state_index = tuple(_STATE_NAMES.index(n) for n in self.state)
        order = self.fields + self.state
        self.get = operator.attrgetter(*self.fields) if len(self.fields) > 1 else (
            (lambda v, one=operator.attrgetter(self.fields[0]): (one(v),)) if self.fields
            else (lambda v: ()))
        # (group, picks its values out of the view's, host rules, its name, its bit in
        # the set of groups that run)
        self.steps = tuple(
            (g, None if not skip or g.reads is None
             else _picker(tuple(order.index(n) for n in g.reads)), g.host_rules, g.name,
             1 << i)
            for i, g in enumerate(groups))
        self.fusions = {}  # bits of the groups that run -> the fusions covering them
        self._all_fusions = fusions
        # the groups with a device expression (the others, I1, are host facts alone)
        self.fused_bits = sum(bit for g, *_, bit in self.steps if g.fused is not None)

    def values(self, view, prev, prompts, stops) -> tuple:
        """The view's fields, then the monitor state the groups read (``rules.Facts.dep``
        of each name: the snapshot, the prompts, the stop ids, whether the view is a
        commit, a prefill), without building the view's Facts."""
        vals = self.get(view)
        if self.state:
            phase = view.phase
            known = (prev, prompts, stops, phase == "commit", phase == "prefill")
            vals = vals + tuple([known[i] for i in self.state_index])
        return vals

    def fusions_for(self, bits: int) -> tuple:
        """The fusions covering the groups that run (``bits``: theirs, or-ed)."""
        f = self.fusions.get(bits)
        if f is None:
            have = {name for _, _, _, name, bit in self.steps if bits & bit}
            chosen, covered = [], set()
            for x in self._all_fusions:  # (one whose groups an earlier one covers: not)
                if all(n in have for n in x.groups) and not covered.issuperset(x.groups):
                    chosen.append(x)
                    covered.update(x.groups)
            f = self.fusions[bits] = tuple(chosen)
        return f


def _by_row_count(members: list, rowwise: bool) -> list:
    """How the checks of one key that waited by reference are called: all at once when
    the check is row by row (``Fusion.rowwise``); else the views of a row count that
    ``SIDE_BY_SIDE`` or more share, laid side by side (a few ops for all of them), and
    the rest in one call that stacks them view by view (a few ops each: a batch that
    loses rows as they finish makes several row counts of one or two views each)."""
    if rowwise:
        return [members]
    sizes = Counter(e.size for *_, e in members)
    if len(sizes) == 1:
        return [members]
    big = [n for n, c in sizes.items() if c >= SIDE_BY_SIDE]
    calls = [[m for m in members if m[2].size == n] for n in big]
    rest = [m for m in members if sizes[m[2].size] < SIDE_BY_SIDE]
    return calls + ([rest] if rest else [])


def _picker(index: tuple):
    """A function tuple -> the entries at ``index``, as a tuple."""
    if len(index) == 1:
        i = index[0]
        return lambda t: (t[i],)
    return operator.itemgetter(*index)


class Monitor(Checker):
    """A step hook checking I1-I7; see the module docstring for modes and costs.

    ``Monitor(mode="strict", *, raise_on_violation=True, run=None, invariants=None,
    kv_atol=None, kv_rtol=None, near_tie_tolerance=None, max_violations=100,
    skip_unchanged=True, remember_rows=256, read="step", coverage=False)``;
    ``invariants`` restricts the checks to a subset of ``("I1", ..., "I7")``.
    ``remember_rows``: how many requests' prompts and outputs the I6 history rules remember across views (the newest; at least
    the batch), so a scheduler that serves a different group of a larger pool each step
    (EXSPEC) is checked on every row it has served, not only the previous view's.
    ``read``: when strict and deep modes read their flags, ``"step"`` (once per engine
    step) or ``"phase"`` (after every phase). ``coverage=True``: also count which triggers
    the views exercised (``self.coverage``, an ``invariants.coverage.Coverage``; its
    ``counts()`` after the run), a few tensor ops per commit view; off by default.
    """

    #: the monitor never writes a view's tensors (an engine need not watch it for writes:
    #: ``specdec.validation.watched``; its tests run it watched, every mode and strategy)
    read_only = True

    def __init__(self, mode: str = "strict", *, raise_on_violation: bool = True,
                 run: dict | None = None, invariants=None, kv_atol: float | None = None,
                 kv_rtol: float | None = None,
                 near_tie_tolerance: float | None = DEFAULT_TOLERANCE,
                 max_violations: int = 100, skip_unchanged: bool = True,
                 remember_rows: int = 256, read: str = "step", coverage: bool = False):
        chosen = tuple(P.INVARIANTS if invariants is None else invariants)
        super().__init__(mode, raise_on_violation=raise_on_violation, run=None,
                         max_violations=max_violations)
        unknown = [i for i in chosen if i not in P.INVARIANTS]
        if unknown:
            raise ValueError(f"unknown invariants {unknown}; expected a subset of {P.INVARIANTS}")
        run = dict(run or {})
        try:
            json.dumps(run)
        except TypeError as e:
            raise TypeError(f"run must be JSON-serialisable (it goes into traces): {e}") from None
        if read not in READS:
            raise ValueError(f"read must be one of {READS}, got {read!r}")
        self.run = run
        self.invariants = chosen
        self.read_every = read
        self.kv_atol, self.kv_rtol = kv_atol, kv_rtol
        self.near_tie_tolerance = near_tie_tolerance
        self.skip_unchanged = skip_unchanged
        if not isinstance(remember_rows, int) or remember_rows < 0:
            raise ValueError(f"remember_rows must be an integer >= 0, got {remember_rows!r}")
        self.remember_rows = remember_rows
        # opt-in: which triggers the views exercised (invariants.coverage; off by default,
        # so the checks' own cost does not grow)
        self.coverage = Coverage() if coverage else None
        self.near_ties: list[dict] = []
        self.unchecked: list[dict] = []  # checks a run's engine left undefined (see above)
        self.calls = 0
        self.runs = 0
        #: how often each rule group ran (group name -> count); skipped groups do not count
        self.group_runs: Counter = Counter()
        self._groups = tuple(g for g in R.GROUPS if g.invariant in chosen)
        names = {g.name for g in self._groups}
        self._fusions = tuple(f for f in R.FUSIONS if all(n in names for n in f.groups))
        #: fast mode: whether deferred checks keep the view's tensors by reference
        #: (``rules.Refs``): None on probation (the first ``PROBATION_STEPS`` steps: they
        #: copy, and the versions of what they would have referenced are watched), then
        #: True; False once an engine was seen writing a view's tensors in place after its
        #: hook (copies for the monitor's life)
        self._by_reference = None
        self._watched: list = []  # probation: the Refs whose versions are watched
        self._consts = R.Constants()
        self._reset_run()

    # -- per-run state -------------------------------------------------------------------
    def _reset_run(self) -> None:
        self._prev: P.Snapshot | None = None
        self._prompts: P.Prompts | None = None
        self._stops: dict = {}
        # (step, row_ids, accepted, draft_limit, committed) per commit view, device tensors
        self._history: list = []
        self._pending = []
        self._refs: dict = {}  # deep I7: request id -> (ids, margins)
        self._checked: dict = {}  # deep I7: request id -> (output checked, past a near-tie)
        self._settled: set = set()  # deep I7: rows finished or desynchronised
        self._memo: dict = {}  # group name -> (values, versions) it last checked
        self._plans: dict = {}  # (phase, profile, ...) -> the groups to run
        self._lookups: dict = {}  # row-id tensor -> its rows in a remembered state
        # fast mode: fusions whose check waits for the read, (entry, mask index, fusion,
        # key, evidence) (``_settle``); and the last view's snapshot, for ``_advance``
        self._deferred: list = []
        self._waiting_bytes = 0  # what the waiting checks keep alive (rules.held_bytes)
        self._snapshot = None
        # fast mode: the waiting checks of the last hook that kept references (``Refs``),
        # compared at the next hook: an engine that writes its views' tensors in place
        # after the hook makes the monitor copy from then on (``_by_reference``)
        self._last_refs: list = []
        # I5 provenance and the draft cache's lag (invariants/provenance.py)
        self._kv = PV.KVProvenance(self.remember_rows, provenance="I5" in self.invariants,
                                   lag="I1" in self.invariants, defer=self.mode == "fast") \
            if "I5" in self.invariants or "I1" in self.invariants else None

    @property
    def accepted_history(self) -> list[dict]:
        """Per step: {"step", "row_ids", "accepted"} (host lists; reading syncs once)."""
        return _history_host(self._history)

    # -- the hook --------------------------------------------------------------------------
    def __call__(self, phase: str, view: StepView) -> None:
        if self.mode == "off":
            return
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; expected one of {PHASES}")
        if phase == "prefill" and view.step == 0 and not view.info.get("batch_index", 0) \
                and self.calls:
            self._end_run()
        elif self._pending and self.mode != "fast" \
                and self._pending[-1].context["view"].step != view.step:
            self.read()  # the previous step ended without a commit view
        self.calls += 1
        if self._last_refs:  # did the engine write the last views' tensors in place?
            if not all(r.intact() for r in self._last_refs):
                self._by_reference = False  # copy from now on (their check flags them)
            self._last_refs = []
        if self._watched:  # probation: every view so far copied, their versions watched
            if not all(r.intact() for r in self._watched):
                self._by_reference, self._watched = False, []
            elif view.step >= PROBATION_STEPS:
                self._by_reference, self._watched = True, []
        if self.coverage is not None:
            self.coverage(phase, view)
        entry = self._cheap(view)
        if entry is not None:
            self._pending.append(entry)
        if self._kv is not None:  # KV provenance, draft cache lag: device ops, no read
            kv = self._kv(view)
            if kv is not None:
                kv.context["history_len"] = len(self._history)
                self._pending.append(kv)
        if len(self._deferred) >= MAX_WAITING or self._waiting_bytes >= MAX_WAITING_BYTES:
            self._settle()
        if self.mode != "fast" and self._pending and (self.read_every == "phase"
                                                      or phase == "commit"):
            self.read()  # strict: the one host read of the step
        if self.mode == "deep":
            self._deep(view)
        self._advance(view)

    def _stops_of(self, view: StepView, device):
        key = (view.stop_token_ids, device)
        s = self._stops.get(key)
        if s is None:  # host ids, or a device tensor built by fill kernels, once per run
            s = self._stops[key] = P.stop_ids(view)
        return s

    def _plan(self, view: StepView, shapes_ok: bool) -> _Plan:
        """The groups to run for views like ``view`` (see ``_Plan``)."""
        key = (view.phase, view.profile, view.forward is None, view.committed is None,
               shapes_ok, self._prev is None, self._prompts is None)
        plan = self._plans.get(key)
        if plan is None:
            facts = R.Facts(view, stops=(), prev=self._prev, prompts=self._prompts,
                            consts=self._consts)
            # later groups index [B, W] tensors together: only when their shapes agree
            groups = [g for g in self._groups
                      if (shapes_ok or g.invariant == "I1") and R.group_applies(g, facts)]
            plan = self._plans[key] = _Plan(groups, self.skip_unchanged, self._fusions)
        return plan

    def _cheap(self, view: StepView) -> Entry | None:
        """Run the cheap groups that apply to ``view`` and whose inputs changed (fused
        where a ``rules.FUSIONS`` entry covers several): an Entry with their ``[B]`` masks
        (device), or None when nothing ran."""
        device = view.tokens.device
        stops = self._stops_of(view, device)
        shapes_ok = view.valid.shape == view.tokens.shape == view.positions.shape
        plan = self._plan(view, shapes_ok)
        memo = self._memo
        to_run = []
        bits = 0
        seen = None
        if plan.fields or plan.state:
            values = plan.values(view, self._prev, self._prompts, stops)
            sig = _signature(values)
            seen = (values, sig)
        for g, pick, host_rules, name, bit in plan.steps:
            if pick is not None:  # skip a group whose inputs are those it checked
                now = pick(sig)
                old = memo.get(name)
                if old is not None and old[1] == now:
                    continue  # (the memo already holds these very values)
                memo[name] = (pick(values), now)
            to_run.append((g, host_rules))
            bits |= bit
        if not to_run:
            return None
        fusions = plan.fusions_for(bits)
        # (a view whose groups are host facts alone, a draft view typically, builds none)
        facts = R.Facts(view, stops=stops, prev=self._prev, prompts=self._prompts,
                        consts=self._consts, lookups=self._lookups, device=device) \
            if fusions or bits & plan.fused_bits else None
        b = view.batch_size
        masks, shared, waiting = [], {}, []
        for fusion in fusions:
            if fusion.defer is not None and self.mode == "fast":
                # fast mode reads at the end: keep references to what the fusion reads
                # (or copy it: a snapshot the monitor keeps anyway, two stacks) and check
                # every such view at once
                defer = fusion.refer if self._by_reference and fusion.refer is not None \
                    else fusion.defer
                try:
                    table = self._snapshot_of(view) if fusion.snapshot else None
                    wait = defer(facts, table)
                    if self._by_reference is None and fusion.refer is not None:
                        probe = fusion.refer(facts, table)  # probation: watched only
                        if probe is not None:
                            self._watched.append(probe[1])
                except (RuntimeError, IndexError, ValueError, AttributeError):
                    wait = None
                if wait is not None:
                    for n in fusion.groups:
                        shared[n] = len(masks)
                    waiting.append((len(masks), fusion) + wait)
                    masks.append(None)  # filled by _settle, before the read
                    continue
            try:
                m = fusion.fused(facts)
            except (RuntimeError, IndexError, ValueError, AttributeError):
                m = None  # a malformed view: the groups one by one say why
            if m is not None and m.dim() == 1 and m.shape[0] == b:
                for n in fusion.groups:
                    shared[n] = len(masks)
                masks.append(m)
        checked, host_failure = [], False
        runs = self.group_runs
        for g, host_rules in to_run:
            runs[g.name] += 1
            index = shared.get(g.name)
            if index is not None:
                checked.append((g, (), None, index))
                continue
            broken, error = (), None
            try:
                if host_rules and not (g.host_ok is not None and g.host_ok(view)):
                    broken = [r for r in host_rules if r.applies(view) and r.host(view)]
                m = g.fused(facts) if g.fused is not None else None
                if m is not None and (m.dim() != 1 or m.shape[0] != b):
                    raise ValueError(f"a [B] mask was expected, got shape {list(m.shape)}")
            except (RuntimeError, IndexError, ValueError, AttributeError) as e:  # malformed
                error = (f"the view can be checked ({g.name} rules raised "
                         f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})")
                m = None
            if m is not None:
                index = len(masks)
                masks.append(m)
            if broken or error is not None:
                host_failure = True
            checked.append((g, broken, error, index))
        if not masks and not host_failure:
            return None
        entry = Entry(masks, host_failure, {
            "view": view, "checked": checked, "prev": self._prev, "prompts": self._prompts,
            "stops": P.stop_ids(view, stops) if facts is None else facts.stops,
            "history_len": len(self._history), "seen": seen})
        for index, fusion, key, evidence in waiting:
            self._deferred.append((entry, index, fusion, key, evidence))
            self._waiting_bytes += R.held_bytes(evidence)
            if isinstance(evidence, R.Refs):
                self._last_refs.append(evidence)
        return entry

    def _snapshot_of(self, view: StepView) -> torch.Tensor:
        """The view's ``Snapshot.of`` table, built once per view (``_advance`` keeps it)."""
        if self._snapshot is None or self._snapshot[0] is not view:
            self._snapshot = (view, P.Snapshot.of(view))
        return self._snapshot[1].table

    def _settle(self) -> None:
        """Check the views whose fusions waited (fast mode), every view of one key at
        once, and put each one's [B] mask in its entry. A batch that raises is checked
        view by view; a view whose own check raises runs its groups one by one, on the
        view as it is now (the errors then say why, as at the hook)."""
        items, self._deferred, self._waiting_bytes = self._deferred, [], 0
        self._last_refs = []
        by_key: dict = {}
        for entry, index, fusion, key, evidence in items:
            refs = isinstance(evidence, R.Refs)
            if refs and not evidence.intact():
                self._unreferenced(entry, index, fusion, evidence)
                continue
            by_key.setdefault((fusion, key, refs), []).append((entry, index, evidence))
        for (fusion, key, refs), members in by_key.items():
            stops = members[0][0].context["stops"]
            if refs:
                for part in _by_row_count(members, fusion.rowwise):
                    self._settle_refs(fusion, key, part, stops)
                continue
            try:
                flags = fusion.batch(key, [e for _, _, e in members], self._consts, stops)
                parts = flags.split([e.size for _, _, e in members]) \
                    if len(members) > 1 else (flags,)
            except (RuntimeError, IndexError, ValueError, AttributeError):
                parts = [None] * len(members)
            for (entry, index, evidence), m in zip(members, parts):
                if m is None:
                    try:
                        m = fusion.batch(key, [evidence], self._consts, stops)
                    except (RuntimeError, IndexError, ValueError, AttributeError):
                        m = self._one_by_one(entry, index, fusion)
                entry.masks[index] = m

    def _unreferenced(self, entry: Entry, index: int, fusion, evidence) -> None:
        """A view whose tensors were written in place after its hook (by the engine or
        a later hook): its references show what the hook did not see, so its deferred
        groups are not judged on them. Listed in ``unchecked`` with a warning (never
        silently), and the monitor copies in every later hook (``_by_reference``)."""
        view = entry.context["view"]
        entry.masks[index] = self._consts.zeros(evidence.size, view.device)
        self._by_reference = False
        changed = [i for i, (t, v) in enumerate(zip(evidence.tensors, evidence.versions))
                   if t._version != v]
        reason = (f"step {view.step} {view.phase}: the view's tensors were written in place "
                  f"after its hook (fast mode checks them by reference at the read; "
                  f"tensors {changed} of the check's inputs changed), so the groups "
                  f"{list(fusion.groups)} were not checked on this view; later views are "
                  f"copied in the hook")
        self.unchecked.append({"run": self.runs, "invariant": ", ".join(dict.fromkeys(
            R.GROUPS_BY_NAME[g].invariant for g in fusion.groups)), "step": view.step,
            "phase": view.phase, "groups": list(fusion.groups), "reason": reason})
        warnings.warn(f"invariants.Monitor(fast): {reason}", RuntimeWarning, stacklevel=3)

    def _settle_refs(self, fusion, key, members: list, stops) -> None:
        """``_settle`` for checks that waited by reference (``rules.Refs``, every one
        intact): all at once, else one by one, else the groups one by one."""
        try:
            parts = fusion.batch_refs(key, [e for _, _, e in members], self._consts, stops)
        except (RuntimeError, IndexError, ValueError, AttributeError):
            parts = [None] * len(members)
        for (entry, index, evidence), m in zip(members, parts):
            if m is None:
                try:
                    m = fusion.batch_refs(key, [evidence], self._consts, stops)[0]
                except (RuntimeError, IndexError, ValueError, AttributeError):
                    m = self._one_by_one(entry, index, fusion)
            entry.masks[index] = m

    def _one_by_one(self, entry: Entry, index: int, fusion) -> torch.Tensor:
        """The groups of a fusion that could not be checked at once, one by one on the
        entry's view: their masks are added to the entry; returns the first's (or an
        all-False mask when none gives one)."""
        ctx = entry.context
        view = ctx["view"]
        facts = R.Facts(view, stops=ctx["stops"], prev=ctx["prev"], prompts=ctx["prompts"],
                        consts=self._consts, lookups=self._lookups)
        checked, first = ctx["checked"], None
        for at, (g, broken, error, i) in enumerate(checked):
            if i != index:
                continue
            try:
                m = g.fused(facts) if g.fused is not None else None
                if m is not None and (m.dim() != 1 or m.shape[0] != view.batch_size):
                    raise ValueError(f"a [B] mask was expected, got shape {list(m.shape)}")
            except (RuntimeError, IndexError, ValueError, AttributeError) as e:
                error = (f"the view can be checked ({g.name} rules raised "
                         f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})")
                entry.host_failure, m = True, None
            if m is None:
                checked[at] = (g, broken, error, None)
            elif first is None:
                first = m
                checked[at] = (g, broken, error, index)
            else:
                checked[at] = (g, broken, error, len(entry.masks))
                entry.masks.append(m)
        return first if first is not None else self._consts.zeros(view.batch_size, view.device)

    def read(self) -> None:
        if self._deferred:
            self._settle()
        if self._kv is not None:  # fast mode: the run's target-cache provenance, at once
            self._kv.settle()
        super().read()

    def _advance(self, view: StepView) -> None:
        """Update the per-run state after the checks of a phase."""
        try:
            if view.phase == "prefill":
                self._prompts = P.Prompts.remember(self._prompts, view, self.remember_rows)
            if view.phase in ("prefill", "commit"):
                now = self._snapshot[1] if self._snapshot is not None \
                    and self._snapshot[0] is view else None
                self._prev = P.Snapshot.remember(self._prev, view, self.remember_rows, now)
                # a later view holding these very tensors has nothing new for the history
                # rules (its output and generated are what the snapshot just copied)
                seen = (view.output, view.generated, None, view.row_ids, self._prev, False)
                self._memo["I6.history"] = (seen, _signature(seen))
        except (RuntimeError, IndexError, ValueError):  # a malformed view (I1 reports it)
            pass
        if view.phase == "commit" and view.accepted is not None:
            self._history.append((view.step, view.row_ids, view.accepted, view.draft_limit,
                                  view.committed))


    # -- deep checks -----------------------------------------------------------------------
    def _deep(self, view: StepView) -> None:
        if "I5" in self.invariants and view.phase in KV_PHASES:
            a, r = P.kv_tolerance(_cache_dtype(view), self.kv_atol, self.kv_rtol)
            rule = R.R_KV.text(atol=a, rtol=r)
            try:
                _, slots = P.kv_mismatches(view, atol=self.kv_atol, rtol=self.kv_rtol)
                rows = [b for b, s in enumerate(slots) if s]
            except (RuntimeError, IndexError, ValueError) as e:  # e.g. a cache of wrong shape
                rows, slots = list(range(view.batch_size)), [[] for _ in range(view.batch_size)]
                rule += f"; the cache could not be compared: {type(e).__name__}: {e}"[:300]
            if rows:
                self.read()  # cheap violations of this phase or earlier come first
                self._emit(self._build(view, "I5", rows, [slots[b] for b in rows], [rule],
                                       rule=R.R_KV, history_len=len(self._history)))
        if "I7" in self.invariants and view.phase == "commit" and view.model is not None:
            s = view.sampling
            if s is None or getattr(s, "mode", None) == "coupled":
                self._check_reference(view)
            elif not any(u["run"] == self.runs for u in self.unchecked):
                self.unchecked.append({
                    "run": self.runs, "invariant": "I7",
                    "reason": f"sampling mode {getattr(s, 'mode', None)!r}: the output is a random "
                              "sample, equal to no reference; test its distribution instead "
                              "(specdec.forensics.distribution)"})

    def _check_reference(self, view: StepView) -> None:
        ids = view.row_ids.tolist()
        gen = view.generated.tolist()
        fin = view.finished.tolist()
        budgets = view.budgets.tolist()
        lengths = view.lengths.tolist()
        out = view.output.tolist()
        prompts = self._prompt_lists(view)
        bad_rows, slots, rules = [], [], []
        for b, rid in enumerate(ids):
            if rid in self._settled or prompts[b] is None:
                continue
            if rid not in self._refs:
                from ._hf import greedy_reference

                self._refs[rid] = greedy_reference(view.model, prompts[b], budgets[b],
                                                   view.stop_token_ids, view.sampling, rid)
            o = out[b][: gen[b]]
            seen, past_tie = self._checked.get(rid, ([], False))
            if o[: len(seen)] != seen:  # the output changed after it was checked: again
                seen, past_tie = [], False
            checked = len(seen)
            if len(o) <= checked and not fin[b]:
                continue
            shape = EngineShape(view.batch_size, max(view.width - lengths[b], 0), view.k + 1)
            row = check_row(view.model, prompts[b], o, None if past_tie else self._refs[rid][0],
                            row=b, start=checked, complete=bool(fin[b]), budget=budgets[b],
                            stop_token_ids=view.stop_token_ids,
                            tolerance=self.near_tie_tolerance, shape=shape,
                            sampling=view.sampling, request=rid)
            self.near_ties += [{"step": view.step, "row": b, "row_id": rid, **d.as_dict()}
                               for d in row.near_ties]
            self._checked[rid] = (o, past_tie or bool(row.near_ties))
            if fin[b]:
                self._settled.add(rid)
            bad = row.desync
            if bad is None:
                continue
            self._settled.add(rid)  # past a desync the row is not checked again
            bad_rows.append(b)
            slots.append([bad.index])
            what = "greedy decoding" if view.sampling is None else "plain coupled sampling"
            rules.append(R.R_REFERENCE.text(what=what, detail=f"row {b}: {bad.describe()}",
                                            oracle=rule_text(self.near_tie_tolerance)))
        if bad_rows:
            self.read()  # cheap violations of this phase or earlier come first
            self._emit(self._build(view, "I7", bad_rows, slots, rules, rule=R.R_REFERENCE,
                                   history_len=len(self._history)))

    def _prompt_lists(self, view: StepView) -> list:
        if self._prompts is None:
            return [None] * view.batch_size
        idx, found = P.match_rows(view.row_ids, self._prompts.row_ids)
        toks = self._prompts.tokens.index_select(0, idx).tolist()
        lens = view.prompt_lengths.tolist()
        return [t[:n] if f else None for t, n, f in zip(toks, lens, found.tolist())]

    # -- reporting -----------------------------------------------------------------------
    def report(self, entry: Entry, rows: list) -> None:
        """Name the rules behind the flagged groups of one phase and build the violation
        of its first failing invariant (host side: runs only on a failure)."""
        ctx = entry.context
        view = ctx["view"]
        if "provenance" in ctx:  # invariants/provenance.py
            found = PV.describe(entry, rows)
            if found is not None:
                inv, bad, slots, texts = found
                self._emit(self._build(view, inv, bad, slots, texts, rule=PV.RULE,
                                       history_len=ctx["history_len"]))
            return
        facts = R.Facts(view, stops=ctx["stops"], prev=ctx["prev"], prompts=ctx["prompts"],
                        consts=self._consts)
        failing = []  # (invariant, Rule | None, sentence, host rows)
        everyone = [True] * view.batch_size
        named_at, first_at = set(), {}  # mask index -> a group named a rule / its first group
        for g, broken, error, index in ctx["checked"]:
            for r in broken:
                failing.append((g.invariant, r, r.text(view), everyone))
            if error is not None:
                failing.append((g.invariant, None, error, everyone))
            if index is None or not any(rows[index]):
                continue
            first_at.setdefault(index, g)
            try:
                named = [(r, m.tolist()) for r, m in R.rule_masks(g, facts) if r.host is None]
                named = [(r, m) for r, m in named if any(m)]
            except (RuntimeError, IndexError, ValueError, AttributeError) as e:
                failing.append((g.invariant, None,
                                f"the view can be checked ({g.name} rules raised "
                                f"{type(e).__name__}: {str(e).splitlines()[0][:120]})", everyone))
                continue
            if named:
                named_at.add(index)
            failing += [(g.invariant, r, r.text(view), m) for r, m in named]
        for index, g in first_at.items():
            if index not in named_at:  # its tensors changed in place since the check
                failing.append((g.invariant, None,
                                f"{g.name} (flagged at the check; its tensors were modified in "
                                f"place before the read, so the rule cannot be named)",
                                rows[index]))
        if not failing:
            return
        inv = failing[0][0]
        mine = [f for f in failing if f[0] == inv]
        bad = [b for b in range(view.batch_size) if any(f[3][b] for f in mine)]
        also = sorted({f[0] for f in failing} - {inv})
        rule = R.slot_rule([f[1] for f in mine if f[1] is not None])
        slots = _slots(facts, rule, bad)
        texts = [f[2] for f in mine]
        seen = ctx.get("seen")
        if seen is not None and _signature(seen[0]) != seen[1]:
            texts.append(IN_PLACE_NOTE)
        self._emit(self._build(view, inv, bad, slots, texts, rule=rule,
                               also=also, history_len=ctx["history_len"]))

    def _build(self, view, inv, rows, slots, rules, *, rule=None, also=(),
               history_len=None) -> InvariantViolation:
        hist = _history_host(self._history[:history_len])
        grid = _grid(view, rule, rows, slots)
        sel = lambda t: None if t is None else [t.tolist()[b] for b in rows]  # noqa: E731
        state = {
            "lengths": sel(view.lengths), "prompt_lengths": sel(view.prompt_lengths),
            "generated": sel(view.generated), "budgets": sel(view.budgets),
            "finished": sel(view.finished), "accepted": sel(view.accepted),
            "committed": sel(view.committed), "generated_before": sel(view.generated_before),
            "draft_limit": sel(view.draft_limit), "drafts": sel(view.drafts),
            "predictions": sel(view.predictions),
            "cache_widths": list(view.cache_widths),
            "expected_cache_width": view.expected_cache_width(),
            "draft_cache_widths": list(view.draft_cache_widths),
        }
        trace = make_trace(
            invariant=inv, step=view.step, phase=view.phase, rows=rows,
            row_ids=[view.row_ids.tolist()[b] for b in rows], slots=slots, rules=rules,
            grid=grid, accepted_history=hist, profile=view.profile, k=view.k,
            width=view.width, state={k: v for k, v in state.items() if v is not None},
            info=view.info, run=self.run, also=also, source="monitor")
        return InvariantViolation(trace)

    # -- stats conservation ----------------------------------------------------------------
    def check_stats(self, stats, outputs=None) -> list[InvariantViolation]:
        """I6.stats: the engine's counters equal the sums over the commit views this
        monitor saw in the run (``steps`` = commit views, ``drafted`` = sum of draft
        limits, ``accepted`` and ``committed`` = sums of the views' counts), and with
        ``outputs`` (every request's generated ids) ``committed`` = the total output
        length. ``stats`` is any object with those four integer attributes (the engine's
        ``Stats``). Call it after the run, before the next one starts; one host read. The
        hook itself does no work for it: the commit views' tensors are kept by reference.
        Returns the violations (raises the first unless ``raise_on_violation=False``)."""
        names = ("steps", "drafted", "accepted", "committed")
        seen = [h for h in self._history if h[3] is not None and h[4] is not None]
        sums = torch.stack([torch.stack([h[3].long().sum(), h[2].long().sum(), h[4].long().sum()])
                            for h in seen]).sum(dim=0).tolist() if seen else [0, 0, 0]
        want = dict(zip(names, [len(self._history)] + sums))
        broken = [f"I6.stats: Stats.{n} = {getattr(stats, n)} but the {len(self._history)} "
                  f"commit views sum to {want[n]}" for n in names if getattr(stats, n) != want[n]]
        if len(seen) != len(self._history):
            broken.append("I6.stats: a commit view carried no draft_limit or committed, so "
                          "the counters cannot be summed")
        if outputs is not None:
            total = sum(len(o) for o in outputs)
            if stats.committed != total:
                broken.append(f"I6.stats: Stats.committed = {stats.committed} but the outputs "
                              f"hold {total} tokens")
        if not broken:
            return []
        last = self._history[-1][0] if self._history else 0
        self._emit(InvariantViolation(make_trace(
            invariant="I6", step=int(last), phase="commit", rows=[], row_ids=[], slots=[],
            rules=broken, grid=[], accepted_history=_history_host(self._history),
            profile=None, k=None, width=None,
            state={"stats": {n: getattr(stats, n) for n in names}, "views": want},
            info={}, run=self.run, also=[], source="monitor")))
        return [self.violations[-1]] if self.violations else []

    # -- the end of a run ------------------------------------------------------------------
    def finish(self) -> list[InvariantViolation]:
        return self.check()

    def _end_run(self) -> None:
        try:
            self.check()
        finally:
            self.runs += 1
            self._reset_run()

    def reset(self) -> None:
        """Forget violations, near-ties and the run state (keeps the configuration)."""
        self.violations, self.near_ties, self.unchecked = [], [], []
        self.calls = self.runs = self._reported = 0
        self.group_runs = Counter()
        if self.coverage is not None:
            self.coverage.reset()
        self._reset_run()

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.check()

    def __repr__(self) -> str:
        return (f"Monitor(mode={self.mode!r}, calls={self.calls}, "
                f"violations={len(self.violations)})")


# ---------------------------------------------------------------------------------------
# Host-side helpers for traces (run only when a violation exists)
# ---------------------------------------------------------------------------------------

def _history_host(history) -> list[dict]:
    """The accepted-count history on the host, in one transfer."""
    if not history:
        return []
    flat = torch.cat([torch.cat([h[1].long(), h[2].long()]) for h in history]).tolist()
    out, at = [], 0
    for s, r, *_ in history:
        n = r.shape[0]
        out.append({"step": int(s), "row_ids": flat[at : at + n],
                    "accepted": flat[at + n : at + 2 * n]})
        at += 2 * n
    return out


def _cache_dtype(view: StepView):
    try:
        return view.cache_tensors()[0][0].dtype
    except Exception:
        return torch.float32


def _rows_of(mask, rows):
    host = mask.tolist()
    return [[j for j, x in enumerate(host[b]) if x] for b in rows]


def _slots(facts: R.Facts, rule: R.Rule | None, rows) -> list[list[int]]:
    """Offending slots per row: the ``slots`` of the rule that shows them (see
    ``rules.slot_rule``), indexed as its ``columns`` say."""
    empty = [[] for _ in rows]
    if rule is None or rule.slots is None:
        return empty
    try:
        s = rule.slots(facts)
        return empty if s is None else _rows_of(s, rows)
    except Exception:  # slots are an aid; a malformed view must still give a trace
        return empty


def _grid(view, rule, rows, slots):
    """Grid entries for the first ``MAX_GRID_ROWS`` offending rows (a window each); the
    columns and lines are those of ``rule`` (the one whose slots are shown)."""
    shown = list(zip(rows, slots))[:MAX_GRID_ROWS]
    if not shown:
        return []
    ids = view.row_ids.tolist()
    columns = rule.columns if rule is not None else None
    lines_of = rule.lines if rule is not None else ("valid", "pos")
    try:
        if columns == "forward" and view.forward is not None:
            f = view.forward
            mask = f.attention_mask.bool().tolist()
            pos = f.positions.expand(view.batch_size, -1).tolist() \
                if f.positions.shape[0] == 1 else f.positions.tolist()
            want = P.valid_before(f.attention_mask.bool()).tolist()
            _, valid_ext = P.extended(view)
            vext = valid_ext.tolist()
            c = f.cache_width
            width = len(mask[0])
            grid = []
            for b, s in shown:
                window = grid_window(width, s)
                lines = {"mask": ["#" if x else "." for x in mask[b]]}
                if "valid" in lines_of:  # the mask against the validity it stands for
                    lines["valid"] = ["#" if x else "." for x in vext[b][:width]]
                if "pos" in lines_of:  # positions of the new tokens against the mask's count
                    lines["pos"] = [None] * c + pos[b]
                if "want" in lines_of:
                    lines["want"] = [w if (j >= c and mask[b][j]) else None
                                     for j, w in enumerate(want[b])]
                if rule is not None and rule.grid is not None:  # the rule's own lines
                    lines.update(rule.grid(view, b))
                grid.append(grid_row(f"row {b} (req {ids[b]})", lines, s, window))
            return grid
        valid = view.valid.bool().tolist()
        pos = view.positions.tolist()
        slot_cols = columns == "slots"
        want = P.valid_before(view.valid.bool()).tolist() if "want" in lines_of else None
        tok = view.tokens.tolist()
        grid = []
        for b, s in shown:
            window = grid_window(view.width, s if slot_cols else [])
            lines = {"valid": ["#" if x else "." for x in valid[b]],
                     "pos": [p if v else None for p, v in zip(pos[b], valid[b])]}
            if want is not None:
                lines["want"] = [w if v else None for w, v in zip(want[b], valid[b])]
            if "token" in lines_of:
                lines["token"] = [t if v else None for t, v in zip(tok[b], valid[b])]
            grid.append(grid_row(f"row {b} (req {ids[b]})", lines, s if slot_cols else [],
                                 window))
        return grid
    except Exception:  # the grid is an aid; never let it hide the violation
        return []
