"""``Monitor``: a step hook that checks I1-I7 after every phase of a decoding engine.

Use it as a hook: ``specdec.generate(..., hooks=[monitor])``; any engine that calls
``hook(phase, view)`` with a ``StepView`` works.

Modes (``MODES``):

- ``off``: does nothing.
- ``fast``: the cheap invariants (I1-I4, I6) run as tensor ops on the view's device; each
  phase reduces them to a few flags kept on the device. Nothing is read back until
  ``check()`` (also ``finish()``, the end of a ``with monitor:`` block, or the next run's
  prefill), which performs the one host sync of the run and raises the first violation.
  The engine only calls hooks and cannot tell the monitor that it finished, so call
  ``check()`` after ``generate`` returns, or use the context manager::

      with invariants.Monitor("fast") as m:
          specdec.generate(model, prompts, hooks=[m])   # raises at the end of the block

- ``strict``: the same checks, one host read per phase; raises ``InvariantViolation`` at
  the failing phase, inside the engine.
- ``deep``: strict plus I5 (each row's K/V recomputed by a clean batch-1 prefill, compared
  with allclose at every valid cache slot, at the prefill, verify and realign phases;
  tolerances ``predicates.KV_TOLERANCE`` unless ``kv_atol``/``kv_rtol`` are given) and I7
  (after every commit, each row's output so far must be a prefix of the target's batch-1
  greedy reference, computed here; a divergence whose reference margin is a near-tie
  within ``near_tie_tolerance`` is recorded in ``near_ties`` and ends the comparison of
  that row instead of raising).

Sampling engines (``view.sampling``). Coupled mode: the view's ``predictions`` are the
target's coupled choices, so I1-I6 apply unchanged, and deep I7 compares with batch-1
coupled sampling (the argmax of ``view.sampling.scores``; margins of the scores).
Rejection mode: I1-I6 apply unchanged to the step's own choices (accepted drafts, then the
residual or bonus sample): the commit writes exactly them, accepted counts are the longest
prefix of drafts equal to them, budgets and stops hold. What no step rule can check is
that the choices follow the target's distribution: I7 is skipped (each run's skip is
listed in ``unchecked``) and the distribution is tested statistically
(``specdec.forensics.distribution``).

Cost: a group of rules is not re-run when every tensor it reads is the same object, with
the same ``_version`` (so not modified in place), as at its last check
(``skip_unchanged=True``, the default): engines hand the same tokens/valid/positions to
draft, verify and commit, which then cost a few kernels. At commit the row tokens (still
those of before the commit) are not compared with prompt ++ output again; the commit rules
check what it appends and the realign phase checks the tokens.

``raise_on_violation=False`` records every violation in ``.violations`` instead of raising
(forensics of known-bad engines); ``check()`` then returns the list. The accepted counts
of every step are kept (``accepted_history``), and the ``run`` dict given at construction
is attached to every trace so that the run can be replayed.

A new run starts at a ``prefill`` view with ``step == 0`` and ``info["batch_index"]`` 0
(or absent): the monitor then finishes the previous run (fast mode: its pending flags are
read, and a violation raises there) and resets its per-run state.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from . import predicates as P
from .equivalence import DEFAULT_TOLERANCE, classify, first_divergence
from .trace import MAX_GRID_ROWS, InvariantViolation, grid_row, grid_window, make_trace
from .view import PHASES, StepView

MODES = ("off", "fast", "strict", "deep")
#: phases at which deep mode recomputes the KV cache (draft and commit see the same cache)
KV_PHASES = ("prefill", "verify", "realign")


@dataclass
class _Pending:
    """One phase checked in fast mode: the flags stay on the device until ``check``."""

    view: StepView
    keys: list  # [(invariant, rule)]
    masks: torch.Tensor  # [P, B] bool
    flags: torch.Tensor  # [P] bool
    prev: object
    prompts: object
    history_len: int


class Monitor:
    """A step hook checking I1-I7; see the module docstring for modes and costs.

    ``Monitor(mode="strict", *, raise_on_violation=True, run=None, invariants=None,
    kv_atol=None, kv_rtol=None, near_tie_tolerance=1e-3, max_violations=100,
    skip_unchanged=True, remember_rows=256)``; ``invariants`` restricts the checks to a
    subset of ``("I1", ..., "I7")``. ``remember_rows``: how many requests' prompts and
    outputs the I6 history rules remember across views (the newest; at least the batch),
    so a scheduler that serves a different group of a larger pool each step (EXSPEC) is
    checked on every row it has served, not only the previous view's.
    """

    def __init__(self, mode: str = "strict", *, raise_on_violation: bool = True,
                 run: dict | None = None, invariants=None, kv_atol: float | None = None,
                 kv_rtol: float | None = None, near_tie_tolerance: float = DEFAULT_TOLERANCE,
                 max_violations: int = 100, skip_unchanged: bool = True,
                 remember_rows: int = 256):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        chosen = tuple(P.INVARIANTS if invariants is None else invariants)
        unknown = [i for i in chosen if i not in P.INVARIANTS]
        if unknown:
            raise ValueError(f"unknown invariants {unknown}; expected a subset of {P.INVARIANTS}")
        run = dict(run or {})
        try:
            json.dumps(run)
        except TypeError as e:
            raise TypeError(f"run must be JSON-serialisable (it goes into traces): {e}") from None
        self.mode = mode
        self.raise_on_violation = raise_on_violation
        self.run = run
        self.invariants = chosen
        self.kv_atol, self.kv_rtol = kv_atol, kv_rtol
        self.near_tie_tolerance = near_tie_tolerance
        self.max_violations = max_violations
        self.skip_unchanged = skip_unchanged
        if not isinstance(remember_rows, int) or remember_rows < 0:
            raise ValueError(f"remember_rows must be an integer >= 0, got {remember_rows!r}")
        self.remember_rows = remember_rows
        self.violations: list[InvariantViolation] = []
        self.near_ties: list[dict] = []
        self.unchecked: list[dict] = []  # checks a run's engine left undefined (see above)
        self.calls = 0
        self.runs = 0
        self._reported = 0
        self._reset_run()

    # -- per-run state -------------------------------------------------------------------
    def _reset_run(self) -> None:
        self._prev: P.Snapshot | None = None
        self._prompts: P.Prompts | None = None
        self._stops: dict = {}
        self._history: list = []  # (step, row_ids, accepted), device tensors
        self._pending: list[_Pending] = []
        self._refs: dict = {}  # deep I7: request id -> (ids, margins)
        self._diverged: set = set()
        self._memo: dict = {}  # group -> the inputs it last checked (see _cheap)

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
        self.calls += 1
        keys, masks = self._cheap(view)
        if masks is not None:
            if self.mode == "fast":
                self._pending.append(_Pending(view, keys, masks, masks.any(dim=1), self._prev,
                                              self._prompts, len(self._history)))
            else:
                flags = masks.any(dim=1).tolist()  # the one host read of the phase
                if any(flags):
                    self._report(view, keys, masks, flags, self._prev, self._prompts,
                                 len(self._history))
        if self.mode == "deep":
            self._deep(view)
        self._advance(view)

    def _cheap(self, view: StepView):
        """(keys, [P, B] masks) of the cheap invariants chosen (tensor ops only).

        A group of rules is skipped when every tensor it reads is the very object it
        checked last time, unmodified (same ``_version``): the result cannot differ, and
        a failure was already reported. An engine hands the same tokens/valid/positions to
        draft, verify and commit, so those phases cost little.
        """
        keys, masks = [], []
        chosen = self.invariants
        dev_key = (view.stop_token_ids, view.device)
        if dev_key not in self._stops:  # one small device write per run
            self._stops[dev_key] = P.stop_tensor(view)
        stops = self._stops[dev_key]
        if "I1" in chosen:
            for rule in P.i1_failures(view):  # host facts: no kernel unless broken
                keys.append(("I1", rule))
                masks.append(P._rows(view, True))
        shapes_ok = tuple(view.valid.shape) == tuple(view.tokens.shape) == \
            tuple(view.positions.shape)
        groups = []
        if shapes_ok:  # later invariants index [B, W] tensors together
            f, commit = view.forward, view.phase == "commit"
            if "I2" in chosen:
                groups.append(("I2", "layout", P.i2_rules,
                               (view.profile, view.valid, view.lengths, view.finished)))
            if "I3" in chosen:
                groups.append(("I3", "positions", P.i3_view_rules,
                               (view.valid, view.positions)))
                if f is not None:
                    groups.append(("I3", "forward positions", P.i3_forward_rules,
                                   (f, view.draft_limit, view.phase)))
            if "I4" in chosen and f is not None:
                groups.append(("I4", "mask", P.i4_rules,
                               (f, view.tokens, view.valid, view.drafts, view.phase)))
            if "I6" in chosen:
                prev, prompts = self._prev, self._prompts
                groups += [
                    ("I6", "state", lambda v: P.i6_state_rules(v, stops),
                     (view.output, view.generated, view.budgets, view.finished, stops)),
                    ("I6", "history", lambda v: P.i6_history_rules(v, prev),
                     (view.output, view.generated, view.generated_before, view.row_ids,
                      prev, commit)),
                    ("I6", "commit", lambda v: P.i6_commit_rules(v, stops, prev),
                     None if commit else ()),
                    # at commit the tokens are still those of before it (checked then); what
                    # the commit appends is checked by the commit rules, tokens at realign
                    ("I6", "sequence", lambda v: P.i6_sequence_rules(v, prompts),
                     () if commit else (view.tokens, view.valid, view.output, view.generated,
                                        view.lengths, view.prompt_lengths, view.row_ids,
                                        prompts, view.phase == "prefill")),
                ]
        for inv, name, rules_of, deps in groups:
            if deps == ():  # not this phase
                continue
            if deps is not None and self.skip_unchanged and self._unchanged(name, deps):
                continue
            try:
                rules = rules_of(view)
            except (RuntimeError, IndexError, ValueError) as e:  # a malformed view
                rules = {f"the view can be checked ({name} rules raised {type(e).__name__}: "
                         f"{str(e).splitlines()[0][:120]})": P._rows(view, True)}
            for rule, mask in rules.items():
                keys.append((inv, rule))
                masks.append(mask)
        if not masks:
            return keys, None
        return keys, torch.stack(masks)

    def _unchanged(self, slot: str, deps) -> bool:
        """True when ``deps`` are the objects (tensors: same object, same version) seen at
        the last check of group ``slot``; remembers them either way."""
        key = []
        for x in deps:
            if isinstance(x, torch.Tensor):
                try:
                    key.append((x, x._version))
                except RuntimeError:  # inference tensors keep no version: always check
                    self._memo.pop(slot, None)
                    return False
            else:
                key.append((x, None))
        old = self._memo.get(slot)
        self._memo[slot] = key
        if old is None or len(old) != len(key):
            return False
        for (a, va), (b, vb) in zip(old, key):
            same = a is b or (isinstance(a, (str, int, bool, tuple)) and type(a) is type(b)
                              and a == b)
            if not same or va != vb:
                return False
        return True

    def _advance(self, view: StepView) -> None:
        """Update the per-run state after the checks of a phase."""
        if view.phase == "prefill":
            self._prompts = P.Prompts.remember(self._prompts, view, self.remember_rows)
        if view.phase in ("prefill", "commit"):
            self._prev = P.Snapshot.remember(self._prev, view, self.remember_rows)
        if view.phase == "commit" and view.accepted is not None:
            self._history.append((view.step, view.row_ids, view.accepted))

    # -- deep checks -----------------------------------------------------------------------
    def _deep(self, view: StepView) -> None:
        if "I5" in self.invariants and view.phase in KV_PHASES:
            a, r = P.kv_tolerance(_cache_dtype(view), self.kv_atol, self.kv_rtol)
            rule = (f"cached K/V at every valid slot equals a clean batch-1 prefill of the "
                    f"row's real tokens (allclose atol={a:g}, rtol={r:g})")
            try:
                _, slots = P.kv_mismatches(view, atol=self.kv_atol, rtol=self.kv_rtol)
                rows = [b for b, s in enumerate(slots) if s]
            except (RuntimeError, IndexError, ValueError) as e:  # e.g. a cache of wrong shape
                rows, slots = list(range(view.batch_size)), [[] for _ in range(view.batch_size)]
                rule += f"; the cache could not be compared: {type(e).__name__}: {e}"[:300]
            if rows:
                self._emit(self._build(view, "I5", rows, [slots[b] for b in rows], [rule],
                                       prev=self._prev, prompts=self._prompts,
                                       history_len=len(self._history)))
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
        out = view.output.tolist()
        prompts = self._prompt_lists(view)
        bad_rows, slots, rules = [], [], []
        for b, rid in enumerate(ids):
            if rid in self._diverged or prompts[b] is None:
                continue
            if rid not in self._refs:
                from ._hf import greedy_reference

                self._refs[rid] = greedy_reference(view.model, prompts[b], budgets[b],
                                                   view.stop_token_ids, view.sampling, rid)
            ref = self._refs[rid][0]
            o = out[b][: gen[b]]
            if first_divergence(o, ref if fin[b] else ref[: len(o)]) is None:
                continue
            row = classify(view.model, prompts[b], o, ref if fin[b] else ref[: len(o)], b,
                           self.near_tie_tolerance, view.sampling, rid)
            self._diverged.add(rid)  # past a divergence the reference no longer applies
            if row.classification == "near-tie":
                self.near_ties.append({"step": view.step, "row": b, "row_id": rid,
                                       "index": row.first_divergence, "engine": row.actual,
                                       "reference": row.expected, "margin": row.margin})
                continue
            bad_rows.append(b)
            slots.append([row.first_divergence])
            what = "greedy" if view.sampling is None else "coupled-sampling"
            rules.append(f"output equals the batch-1 {what} reference: {row.describe()} "
                         f"(tolerance {self.near_tie_tolerance:g}: desync)")
        if bad_rows:
            self._emit(self._build(view, "I7", bad_rows, slots, rules, prev=self._prev,
                                   prompts=self._prompts, history_len=len(self._history)))

    def _prompt_lists(self, view: StepView) -> list:
        if self._prompts is None:
            return [None] * view.batch_size
        idx, found = P.match_rows(view.row_ids, self._prompts.row_ids)
        toks = self._prompts.tokens.index_select(0, idx).tolist()
        lens = view.prompt_lengths.tolist()
        return [t[:n] if f else None for t, n, f in zip(toks, lens, found.tolist())]

    # -- reporting -----------------------------------------------------------------------
    def _report(self, view, keys, masks, flags, prev, prompts, history_len) -> None:
        """Build the violation of the first failing invariant of a phase (host side)."""
        failing = [i for i, f in enumerate(flags) if f]
        first_inv = keys[failing[0]][0]
        mine = [i for i in failing if keys[i][0] == first_inv]
        rows_mask = masks[mine].any(dim=0).tolist()
        rows = [b for b, x in enumerate(rows_mask) if x]
        rules = [keys[i][1] for i in mine]
        also = sorted({keys[i][0] for i in failing} - {first_inv})
        slots = _slots(view, first_inv, rules, rows, prev, prompts, self._stops)
        self._emit(self._build(view, first_inv, rows, slots, rules, also=also, prev=prev,
                               prompts=prompts, history_len=history_len))

    def _build(self, view, inv, rows, slots, rules, *, also=(), prev=None, prompts=None,
               history_len=None) -> InvariantViolation:
        hist = _history_host(self._history[:history_len])
        grid = _grid(view, inv, rules, rows, slots)
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

    def _emit(self, violation: InvariantViolation) -> None:
        if len(self.violations) < self.max_violations:
            self.violations.append(violation)
        if self.raise_on_violation:
            self._reported = len(self.violations)
            raise violation

    # -- the end of a run ------------------------------------------------------------------
    def _flush(self) -> None:
        """Fast mode: read every pending flag in one host transfer and report failures."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        flat = torch.cat([p.flags for p in pending]).tolist()  # the one sync of the run
        at = 0
        for p in pending:
            flags = flat[at : at + len(p.keys)]
            at += len(p.keys)
            if any(flags):
                self._report(p.view, p.keys, p.masks, flags, p.prev, p.prompts, p.history_len)
                if len(self.violations) >= self.max_violations:
                    return

    def check(self) -> list[InvariantViolation]:
        """Finish the pending checks (fast mode: one host sync) and raise the first
        violation not raised yet; with ``raise_on_violation=False`` return them all."""
        if self.raise_on_violation:
            try:
                self._flush()
            finally:
                self._pending = []
            if self._reported < len(self.violations):  # pragma: no cover - _emit raises
                v = self.violations[self._reported]
                self._reported = len(self.violations)
                raise v
        else:
            self._flush()
        return list(self.violations)

    finish = check

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
    flat = torch.cat([torch.cat([r.long(), a.long()]) for _, r, a in history]).tolist()
    out, at = [], 0
    for s, r, _ in history:
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


def _slots(view, inv, rules, rows, prev, prompts, stops) -> list[list[int]]:
    """Offending slots per row (see the module docstring of ``trace``)."""
    empty = [[] for _ in rows]
    try:
        if inv == "I2":
            return _rows_of(P.layout_slots(view), rows)
        if inv == "I3":
            if any(r.startswith("at every valid slot") for r in rules):
                return _rows_of(P.position_slots(view.valid, view.positions), rows)
            fs = P.forward_slots(view)
            if fs is not None:
                c = view.forward.cache_width
                return [[c + j for j in s] for s in _rows_of(fs, rows)]
        if inv == "I4":
            ms = P.mask_slots(view)
            if ms is not None:
                return _rows_of(ms, rows)
        if inv == "I6":
            seq = P.sequence_slots(view, prompts) if view.phase != "prefill" else None
            if seq is not None and any(r.startswith("the row's real tokens") for r in rules):
                return _rows_of(seq, rows)
            stop = next(iter(stops.values()), None)
            return _rows_of(P.output_slots(view, stop), rows)
    except Exception:  # slots are an aid; a malformed view must still give a trace
        return empty
    return empty


def _grid(view, inv, rules, rows, slots):
    """Grid entries for the first ``MAX_GRID_ROWS`` offending rows (a window each)."""
    shown = list(zip(rows, slots))[:MAX_GRID_ROWS]
    if not shown:
        return []
    ids = view.row_ids.tolist()
    forward_cols = inv == "I4" or (inv == "I3" and not any(
        r.startswith("at every valid slot") for r in rules))
    try:
        if forward_cols and view.forward is not None:
            f = view.forward
            mask = f.attention_mask.bool().tolist()
            pos = f.positions.expand(view.batch_size, -1).tolist() \
                if f.positions.shape[0] == 1 else f.positions.tolist()
            want = P.valid_before(f.attention_mask.bool()).tolist()
            _, valid_ext = P._extended(view)
            vext = valid_ext.tolist()
            c = f.cache_width
            width = len(mask[0])
            grid = []
            for b, s in shown:
                columns = grid_window(width, s)
                lines = {"mask": ["#" if x else "." for x in mask[b]]}
                if inv == "I4":  # the mask against the validity it stands for
                    lines["valid"] = ["#" if x else "." for x in vext[b][:width]]
                else:  # I3: positions of the new tokens against the mask's count
                    lines["pos"] = [None] * c + pos[b]
                    lines["want"] = [w if (j >= c and mask[b][j]) else None
                                     for j, w in enumerate(want[b])]
                grid.append(grid_row(f"row {b} (req {ids[b]})", lines, s, columns))
            return grid
        valid = view.valid.bool().tolist()
        pos = view.positions.tolist()
        slot_cols = inv in ("I2", "I3", "I5") or any(r.startswith("the row's real tokens")
                                                     for r in rules)
        want = P.valid_before(view.valid.bool()).tolist() if inv == "I3" else None
        tok = view.tokens.tolist()
        grid = []
        for b, s in shown:
            columns = grid_window(view.width, s if slot_cols else [])
            lines = {"valid": ["#" if x else "." for x in valid[b]],
                     "pos": [p if v else None for p, v in zip(pos[b], valid[b])]}
            if want is not None:
                lines["want"] = [w if v else None for w, v in zip(want[b], valid[b])]
            if inv in ("I6", "I7"):
                lines["token"] = [t if v else None for t, v in zip(tok[b], valid[b])]
            grid.append(grid_row(f"row {b} (req {ids[b]})", lines, s if slot_cols else [],
                                 columns))
        return grid
    except Exception:  # the grid is an aid; never let it hide the violation
        return []
