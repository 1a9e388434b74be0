"""``guard_model``: check every forward of a Hugging Face causal LM, whoever drives it.

::

    with invariants.guard_model(model, mode="strict") as guard:
        model.generate(...)            # or a hand-written decoding loop, or specdec.generate

A forward pre-hook (``register_forward_pre_hook(..., with_kwargs=True)``) sees the inputs
exactly as the model gets them and checks, with ``C`` the cache length before the forward
(``get_seq_length`` of each layer: tokens seen, sliding window or not) and ``q`` the new
tokens:

- I1: every cache layer has the same length and batch size ``B``; an explicit
  ``cache_position`` equals ``C + arange(q)``;
- I4: a 2-D attention mask has ``B`` rows and width ``C + q`` (the cache slots, then the
  new tokens); no mask means every slot is valid;
- I3: the position each valid new token gets equals the number of valid mask slots before
  it. Positions are the explicit ``position_ids``, or, when none are passed, the model's
  own default ``C + arange(q)`` (transformers 5.24, every family), which is wrong as soon
  as the mask has padding or holes.

Hugging Face ``generate`` passes ``position_ids = cumsum(mask) - 1`` (padding slots 0,
never checked) and extends the mask and positions by one per step, so it passes; so do
assisted generation (the target's cache is cropped after rejections) and
``specdec.generate``. Typical mistakes it flags: positions left implicit with left
padding, positions that count padded or rejected slots, a mask not extended for the new
tokens, a cache not cropped after a rejection, a cache cropped to the batch minimum while
some rows keep more tokens.

Modes: ``off`` (no hooks), ``fast`` (device flags, one host read when the block exits or
at ``guard.check()``), ``strict`` and ``deep`` (read after each forward and raise
``InvariantViolation`` before the forward runs). 4-D masks (prepared by the caller) are
not interpreted: only the cache checks and, with explicit positions and no mask, I3 run.
The hook is removed when the block exits, also after an exception. There is no forward
(post) hook: a cache may be advanced by its owner after the forward returns (specdec's
``SlabCache`` is), so cache lengths are only read before each forward.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ._hf import cache_batch_sizes, cache_lengths
from .predicates import forward_position_slots, valid_before
from .trace import MAX_GRID_ROWS, InvariantViolation, grid_row, grid_window, make_trace

MODES = ("off", "fast", "strict", "deep")

RULE_UNIFORM = "every cache layer has the same length"
RULE_CACHE_BATCH = "every cache layer has the batch size of the inputs"
RULE_CACHE_POSITION = "cache_position = cache length + arange(new tokens)"
RULE_MASK_WIDTH = "the 2-D attention mask has width cache length + new tokens"
RULE_MASK_BATCH = "the attention mask has one row per input row"
RULE_POS_EXPLICIT = ("the position_ids of every valid new token = number of valid mask "
                     "slots before it")
RULE_POS_IMPLICIT = ("positions left implicit: the model uses cache length + arange(new "
                     "tokens), which must equal the number of valid mask slots before each "
                     "new token (it does not with padding or holes: pass position_ids)")
RULE_POS_NO_MASK = ("without an attention mask every slot is valid, so position_ids must be "
                    "cache length + arange(new tokens)")


@dataclass
class _Forward:
    """What one guarded forward looked like (host ints, device tensors by reference)."""

    index: int
    batch: int
    q: int
    cache_len: int
    mask: torch.Tensor | None  # [B, C + q] as given (2-D only)
    positions: torch.Tensor | None  # [B or 1, q] the positions the model uses
    implicit: bool


class Guard:
    """The state of one ``guard_model`` block: ``violations``, ``forwards``, ``check()``."""

    def __init__(self, model: torch.nn.Module, mode: str = "strict", *,
                 raise_on_violation: bool = True, run: dict | None = None,
                 max_violations: int = 100):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"guard_model needs a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.mode = mode
        self.raise_on_violation = raise_on_violation
        self.run = dict(run or {})
        self.max_violations = max_violations
        self.violations: list[InvariantViolation] = []
        self.forwards = 0
        self._handles: list = []
        self._pending: list = []  # fast: (forward, keys, masks [P, B], flags [P])
        self._sig = inspect.signature(model.forward)
        self._reported = 0

    # -- installation ------------------------------------------------------------------
    def install(self) -> "Guard":
        if self.mode != "off" and not self._handles:
            self._handles = [
                self.model.register_forward_pre_hook(self._pre, with_kwargs=True),
            ]
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- hooks -------------------------------------------------------------------------
    def _arguments(self, args, kwargs) -> dict:
        try:
            bound = self._sig.bind_partial(*args, **kwargs).arguments
        except TypeError:
            return dict(kwargs)
        out = {}
        for name, value in bound.items():
            p = self._sig.parameters.get(name)
            if p is not None and p.kind is inspect.Parameter.VAR_KEYWORD:
                out.update(value)
            else:
                out[name] = value
        return out

    def _pre(self, module, args, kwargs):
        a = self._arguments(args, kwargs)
        ids, emb = a.get("input_ids"), a.get("inputs_embeds")
        src = ids if ids is not None else emb
        if src is None or src.dim() < 2:
            return None
        b, q = int(src.shape[0]), int(src.shape[1])
        dev = src.device
        cache = a.get("cache")
        if cache is None:
            cache = a.get("past_key_values")
        if cache is not None and not hasattr(cache, "get_seq_length"):
            cache = None  # legacy tuples are not interpreted
        lengths = cache_lengths(cache)
        c = lengths[0] if lengths else 0
        index = self.forwards
        self.forwards += 1

        host: list = []  # (invariant, rule) broken, known on the host
        dev_rules: list = []  # (invariant, rule, [B] mask)
        if len(set(lengths)) > 1:
            host.append(("I1", f"{RULE_UNIFORM} (layer lengths {lengths})"))
        sizes = cache_batch_sizes(cache)
        if any(s != b for s in sizes):
            host.append(("I1", f"{RULE_CACHE_BATCH} ({b}; layers have {sorted(set(sizes))})"))
        cpos = a.get("cache_position")
        if isinstance(cpos, torch.Tensor):
            want = torch.arange(q, device=cpos.device) + c
            if cpos.shape[-1] != q:
                host.append(("I1", RULE_CACHE_POSITION))
            else:
                dev_rules.append(("I1", RULE_CACHE_POSITION,
                                  (cpos.reshape(-1, q) != want).any(dim=1).expand(b)))
        mask = a.get("attention_mask")
        mask2d = None
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            if mask.shape[1] != c + q:
                host.append(("I4", f"{RULE_MASK_WIDTH}: got {mask.shape[1]}, cache length "
                                   f"{c} + {q} new tokens = {c + q}"))
            elif mask.shape[0] != b:
                host.append(("I4", f"{RULE_MASK_BATCH}: {mask.shape[0]} rows for {b}"))
            else:
                mask2d = mask
        pos = a.get("position_ids")
        implicit = pos is None
        if implicit:
            pos = (torch.arange(q, device=dev) + c)[None, :]
        elif not isinstance(pos, torch.Tensor) or pos.dim() != 2 or pos.shape[-1] != q:
            pos = None  # 3-D (multimodal rope) or odd shapes: not interpreted
        if pos is not None and mask2d is not None:
            bad = forward_position_slots(mask2d, pos, c)
            dev_rules.append(("I3", RULE_POS_IMPLICIT if implicit else RULE_POS_EXPLICIT,
                              bad.any(dim=1)))
        elif pos is not None and mask is None and not implicit:
            want = torch.arange(q, device=pos.device) + c
            dev_rules.append(("I3", RULE_POS_NO_MASK, (pos != want).any(dim=1).expand(b)))

        record = _Forward(index, b, q, c, mask2d, pos, implicit)
        if host:
            self._emit(self._build(record, host[0][0], list(range(b)), [h[1] for h in host
                                                                         if h[0] == host[0][0]]))
        if dev_rules:
            keys = [(i, r) for i, r, _ in dev_rules]
            masks = torch.stack([m for _, _, m in dev_rules])
            if self.mode == "fast":
                self._pending.append((record, keys, masks, masks.any(dim=1)))
            else:
                flags = masks.any(dim=1).tolist()  # the one host read of the forward
                if any(flags):
                    self._report(record, keys, masks, flags)
        return None

    # -- reporting -----------------------------------------------------------------------
    def _report(self, record, keys, masks, flags) -> None:
        failing = [i for i, f in enumerate(flags) if f]
        inv = keys[failing[0]][0]
        mine = [i for i in failing if keys[i][0] == inv]
        rows_mask = masks[mine].any(dim=0).tolist()
        rows = [r for r, x in enumerate(rows_mask) if x]
        self._emit(self._build(record, inv, rows, [keys[i][1] for i in mine]))

    def _build(self, rec: _Forward, inv: str, rows, rules) -> InvariantViolation:
        slots, grid = [], []
        try:
            if rec.mask is not None and rec.positions is not None:
                mask = rec.mask.bool()
                pos = rec.positions.expand(rec.batch, -1)
                bad = forward_position_slots(mask, pos, rec.cache_len).tolist()
                slots = [[rec.cache_len + j for j, x in enumerate(bad[r]) if x] for r in rows]
                m = mask.tolist()
                p = pos.tolist()
                want = valid_before(mask).tolist()
                c = rec.cache_len
                for r, s in list(zip(rows, slots))[:MAX_GRID_ROWS]:
                    columns = grid_window(len(m[0]), s)
                    grid.append(grid_row(f"row {r}", {
                        "mask": ["#" if x else "." for x in m[r]],
                        "pos": [None] * c + p[r],
                        "want": [w if (j >= c and m[r][j]) else None for j, w in enumerate(want[r])],
                    }, s, columns))
            else:
                slots = [[] for _ in rows]
        except Exception:  # the grid is an aid; never hide the violation behind it
            slots, grid = [[] for _ in rows], []
        trace = make_trace(
            invariant=inv, step=rec.index, phase="forward", rows=rows, slots=slots, rules=rules,
            grid=grid, width=None, run=self.run, source="guard",
            state={"cache_length": rec.cache_len, "new_tokens": rec.q, "batch": rec.batch,
                   "positions_implicit": rec.implicit,
                   "model": type(self.model).__name__})
        return InvariantViolation(trace)

    def _emit(self, violation: InvariantViolation) -> None:
        if len(self.violations) < self.max_violations:
            self.violations.append(violation)
        if self.raise_on_violation:
            self._reported = len(self.violations)
            raise violation

    # -- the end -------------------------------------------------------------------------
    def check(self) -> list[InvariantViolation]:
        """Fast mode: read the pending flags (one host transfer) and raise the first
        violation; with ``raise_on_violation=False`` return every violation."""
        pending, self._pending = self._pending, []
        if pending:
            flat = torch.cat([p[3] for p in pending]).tolist()
            at = 0
            for record, keys, masks, _ in pending:
                flags = flat[at : at + len(keys)]
                at += len(keys)
                if any(flags):
                    self._report(record, keys, masks, flags)
        return list(self.violations)


@contextmanager
def guard_model(model: torch.nn.Module, mode: str = "strict", *, raise_on_violation: bool = True,
                run: dict | None = None):
    """Check every forward of ``model`` inside the block (see the module docstring).

    Yields the ``Guard`` (``.violations``, ``.forwards``, ``.check()``). In fast mode the
    pending flags are read when the block exits without an exception.
    """
    guard = Guard(model, mode, raise_on_violation=raise_on_violation, run=run).install()
    try:
        yield guard
        guard.check()
    finally:
        guard.remove()
