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

Modes (``invariants.modes``): ``off`` (no hooks), ``fast`` (device flags: no host read,
upload or data-dependent shape inside the hook; one host read when the block exits or at
``guard.check()``), ``strict`` and ``deep`` (one read per forward; raise
``InvariantViolation`` before the forward runs). The rules are records
(``rules.GUARD_RULES``): a failure known on the host (a shape, a cache length) raises at
once in every mode. 4-D masks (prepared by the caller) are
not interpreted: only the cache checks and, with explicit positions and no mask, I3 run.
The hook is removed when the block exits, also after an exception. There is no forward
(post) hook: a cache may be advanced by its owner after the forward returns (specdec's
``SlabCache`` is), so cache lengths are only read before each forward.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch

from ._hf import cache_batch_sizes, cache_lengths
from .checker import Checker, Entry
from .modes import MODES
from .rules import GUARD_RULES, ForwardFacts, slot_rule
from .trace import MAX_GRID_ROWS, InvariantViolation, grid_row, grid_window, make_trace
from .predicates import valid_before

#: the sentences of the guard's rules, by name (kept for callers that match on them)
RULE_UNIFORM = "every cache layer has the same length"
RULE_CACHE_BATCH = "every cache layer has the batch size of the inputs"
RULE_CACHE_POSITION = "cache_position = cache length + arange(new tokens)"
RULE_MASK_WIDTH = "the 2-D attention mask has width cache length + new tokens"
RULE_MASK_BATCH = "the attention mask has one row per input row"
RULE_POS_EXPLICIT, RULE_POS_IMPLICIT, RULE_POS_NO_MASK = (r.sentence for r in GUARD_RULES[5:])


class Guard(Checker):
    """The state of one ``guard_model`` block: ``violations``, ``forwards``, ``check()``."""

    def __init__(self, model: torch.nn.Module, mode: str = "strict", *,
                 raise_on_violation: bool = True, run: dict | None = None,
                 max_violations: int = 100):
        super().__init__(mode, raise_on_violation=raise_on_violation, run=run,
                         max_violations=max_violations)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"guard_model needs a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.forwards = 0
        self._handles: list = []
        self._sig = inspect.signature(model.forward)

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

    def facts(self, args, kwargs) -> ForwardFacts | None:
        """What one forward's arguments say (host facts and device tensors), or None when
        there are no token inputs to check."""
        a = self._arguments(args, kwargs)
        ids, emb = a.get("input_ids"), a.get("inputs_embeds")
        src = ids if ids is not None else emb
        if src is None or src.dim() < 2:
            return None
        b, q = int(src.shape[0]), int(src.shape[1])
        cache = a.get("cache")
        if cache is None:
            cache = a.get("past_key_values")
        if cache is not None and not hasattr(cache, "get_seq_length"):
            cache = None  # legacy tuples are not interpreted
        lengths = cache_lengths(cache)
        c = lengths[0] if lengths else 0
        cpos = a.get("cache_position")
        mask = a.get("attention_mask")
        mask2d = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 \
            and mask.shape[1] == c + q and mask.shape[0] == b else None
        pos = a.get("position_ids")
        implicit = pos is None
        if implicit:
            pos = (torch.arange(q, device=src.device) + c)[None, :]
        elif not isinstance(pos, torch.Tensor) or pos.dim() != 2 or pos.shape[-1] != q:
            pos = None  # 3-D (multimodal rope) or odd shapes: not interpreted
        return ForwardFacts(b, q, lengths, cache_batch_sizes(cache),
                            cpos if isinstance(cpos, torch.Tensor) else None,
                            mask, mask2d, pos,
                            implicit, src.device)

    def _pre(self, module, args, kwargs):
        ff = self.facts(args, kwargs)
        if ff is None:
            return None
        index = self.forwards
        self.forwards += 1
        host = [r for r in GUARD_RULES if r.host is not None and r.host(ff)]
        if host:
            inv = host[0].invariant
            self._emit(self._build(ff, index, inv, list(range(ff.b)),
                                   [r for r in host if r.invariant == inv]))
        named, masks = [], []
        for r in GUARD_RULES:
            m = r.mask(ff) if r.mask is not None else None
            if m is not None:
                named.append(r)
                masks.append(m)
        if masks:
            self._pending.append(Entry(masks, context={"facts": ff, "index": index,
                                                       "rules": named}))
            if self.mode != "fast":
                self.read()  # the one host read of the forward
        return None

    # -- reporting -----------------------------------------------------------------------
    def report(self, entry: Entry, rows: list) -> None:
        ctx = entry.context
        failing = [(r, m) for r, m in zip(ctx["rules"], rows) if any(m)]
        inv = failing[0][0].invariant
        mine = [(r, m) for r, m in failing if r.invariant == inv]
        bad = [b for b in range(ctx["facts"].b) if any(m[b] for _, m in mine)]
        self._emit(self._build(ctx["facts"], ctx["index"], inv, bad, [r for r, _ in mine]))

    def _build(self, ff: ForwardFacts, index: int, inv: str, rows, rules) -> InvariantViolation:
        slots, grid = [[] for _ in rows], []
        rule = slot_rule(rules)
        try:
            s = rule.slots(ff) if rule is not None else None
            if s is not None:
                host = s.tolist()
                slots = [[j for j, x in enumerate(host[r]) if x] for r in rows]
                m = ff.mask2d.bool().tolist()
                p = ff.positions.expand(ff.b, -1).tolist()
                want = valid_before(ff.mask2d.bool()).tolist()
                c = ff.c
                for r, sl in list(zip(rows, slots))[:MAX_GRID_ROWS]:
                    columns = grid_window(len(m[0]), sl)
                    grid.append(grid_row(f"row {r}", {
                        "mask": ["#" if x else "." for x in m[r]],
                        "pos": [None] * c + p[r],
                        "want": [w if (j >= c and m[r][j]) else None for j, w in enumerate(want[r])],
                    }, sl, columns))
        except Exception:  # the grid is an aid; never hide the violation behind it
            slots, grid = [[] for _ in rows], []
        words = ff.words()
        trace = make_trace(
            invariant=inv, step=index, phase="forward", rows=rows, slots=slots,
            rules=[r.text(**words) for r in rules], grid=grid, width=None, run=self.run,
            source="guard",
            state={"cache_length": ff.c, "new_tokens": ff.q, "batch": ff.b,
                   "positions_implicit": ff.implicit, "model": type(self.model).__name__})
        return InvariantViolation(trace)


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


__all__ = ["MODES", "Guard", "guard_model"]
