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
  new tokens), or is wider with every column past ``C + q`` 0 (a bucketed key width: a
  cache that attends more slots than it holds, specdec's ``static_shapes``); no mask means
  every slot is valid;
- I3: the position each valid new token gets equals the number of valid mask slots before
  it. Positions are the explicit ``position_ids``, or, when none are passed, the model's
  own default ``C + arange(q)`` (transformers 5.24, every family). Implicit positions are
  judged by what they do (``positions="relative"``, the default): on a model whose
  attention sees only relative positions (RoPE, ALiBi; read from its config,
  ``_hf.relative_positions``) a constant offset per row is harmless, so only a valid new
  token whose offset (slot minus valid slots before it) differs from that of the row's
  first valid slot is flagged (holes, new tokens after right padding); on absolute
  positions (GPT-2) and with ``positions="exact"`` any padding before a new token is.

With ``prompts=`` (and ``max_new_tokens``, ``stop_token_ids``, ``greedy``) the guard also
checks content, ``invariants.content``: each forward's ids, mask and cache fingerprints
are captured before it and the argmax of its logits after it (a forward hook), a few
kernels and no host read; the captures are read with the coherence flags (the mode's one
read) and C1/C2 run there, on the host, forward by forward; C3 on the outputs
(``guard.check_outputs``).

Hugging Face ``generate`` passes ``position_ids = cumsum(mask) - 1`` (padding slots 0,
never checked) and extends the mask and positions by one per step, so it passes; so do
assisted generation (the target's cache is cropped after rejections) and
``specdec.generate``. Typical mistakes it flags: positions left implicit over holes
(or any padding, on absolute positions), positions that count padded or rejected slots, a mask not extended for the new
tokens, a cache not cropped after a rejection, a cache cropped to the batch minimum while
some rows keep more tokens.

Modes (``invariants.modes``): ``off`` (no hooks), ``fast`` (device flags: no host read,
upload or data-dependent shape inside the hook; one host read when the block exits or at
``guard.check()``), ``strict`` and ``deep`` (one read per forward; raise
``InvariantViolation`` before the forward runs). The rules are records
(``rules.GUARD_RULES``): a failure known on the host (a shape, a cache length) raises at
once in every mode. 4-D masks (prepared by the caller) are
not interpreted: only the cache checks and, with explicit positions and no mask, I3 run.
The hooks are removed (and a wrapped cache ``update`` restored) when the block exits,
also after an exception. Cache lengths are only read before each forward: a cache may be
advanced by its owner after the forward returns (specdec's ``SlabCache`` is); the
content rules' forward hook reads only the logits.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch

from ._hf import (cache_batch_sizes, cache_lengths, is_legacy_cache, model_device,
                  relative_positions)
from .checker import Checker, Entry
from .content import (C3_ARGMAX, C3_CHAIN, C3_LENGTH, C3_STOP, DEVICE_RULES, Content,
                      ContentSpec, first_stop)
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
RULE_POS_EXPLICIT, RULE_POS_IMPLICIT, RULE_POS_RELATIVE, RULE_POS_NO_MASK = (
    r.sentence for r in GUARD_RULES[5:9])
#: what ``positions=`` accepts: "relative" (implicit positions need only a constant
#: offset per row on a RoPE/ALiBi model) or "exact" (the number of valid slots before)
POSITIONS = ("relative", "exact")


class Guard(Checker):
    """The state of one ``guard_model`` block: ``violations``, ``forwards``, ``check()``."""

    def __init__(self, model: torch.nn.Module, mode: str = "strict", *,
                 raise_on_violation: bool = True, run: dict | None = None,
                 max_violations: int = 100, positions: str = "relative",
                 prompts=None, max_new_tokens: int | None = None, stop_token_ids=(),
                 greedy: bool = True):
        super().__init__(mode, raise_on_violation=raise_on_violation, run=run,
                         max_violations=max_violations)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"guard_model needs a torch.nn.Module, got {type(model).__name__}")
        if positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {positions!r}")
        self.model = model
        self.forwards = 0
        self._handles: list = []
        self._sig = inspect.signature(model.forward)
        # implicit positions need only a constant per-row offset on a relative model
        self.relative = positions == "relative" and relative_positions(model)
        self.content: Content | None = None
        if prompts is not None:
            spec = ContentSpec(prompts, max_new_tokens, tuple(stop_token_ids or ()), greedy)
            self.content = Content(spec, model_device(model), self._capture,
                                   copy=self.mode == "fast")
        elif max_new_tokens is not None or stop_token_ids:
            raise ValueError("max_new_tokens and stop_token_ids describe the prompts: pass "
                             "prompts= too (content rules need them)")

    # -- installation ------------------------------------------------------------------
    def install(self) -> "Guard":
        if self.mode != "off" and not self._handles:
            self._handles = [
                self.model.register_forward_pre_hook(self._pre, with_kwargs=True),
            ]
            if self.content is not None:  # records the argmax of every computed position
                self._handles.append(self.model.register_forward_hook(self._post))
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.content is not None:
            self.content.unwatch()

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

    def facts(self, args, kwargs, a: dict | None = None) -> ForwardFacts | None:
        """What one forward's arguments say (host facts and device tensors), or None when
        there are no token inputs to check (``a``: the arguments by name, when bound
        already)."""
        a = self._arguments(args, kwargs) if a is None else a
        ids, emb = a.get("input_ids"), a.get("inputs_embeds")
        src = ids if ids is not None else emb
        if src is None or src.dim() < 2:
            return None
        b, q = int(src.shape[0]), int(src.shape[1])
        cache = _cache_argument(a)
        if cache is not None and not (hasattr(cache, "get_seq_length") or is_legacy_cache(cache)):
            cache = None  # not a cache this guard can read
        lengths = cache_lengths(cache)
        c = lengths[0] if lengths else 0
        cpos = a.get("cache_position")
        mask = a.get("attention_mask")
        mask2d = tail = None
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] >= c + q \
                and mask.shape[0] == b:  # wider: a bucketed key width (``guard.mask_tail``)
            mask2d = mask if mask.shape[1] == c + q else mask[:, : c + q]
            tail = None if mask.shape[1] == c + q else mask[:, c + q :]
        pos = a.get("position_ids")
        implicit = pos is None
        if implicit:
            pos = (torch.arange(q, device=src.device) + c)[None, :]
        elif not isinstance(pos, torch.Tensor) or pos.dim() != 2 or pos.shape[-1] != q:
            pos = None  # 3-D (multimodal rope) or odd shapes: not interpreted
        return ForwardFacts(b, q, lengths, cache_batch_sizes(cache),
                            cpos if isinstance(cpos, torch.Tensor) else None,
                            mask, mask2d, pos,
                            implicit, src.device, self.relative, tail)

    def _pre(self, module, args, kwargs):
        a = self._arguments(args, kwargs)
        ff = self.facts(args, kwargs, a)
        if ff is None:
            if self.content is not None:
                self.content.skip()
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
        if self.content is not None:
            self._content(ff, index, a)
        if self._pending and self.mode != "fast":
            self.read()  # the one host read of the forward
        return None

    def _content(self, ff: ForwardFacts, index: int, a: dict) -> None:
        """C1/C2 over this forward's rows (device masks), when its tokens can be read."""
        content = self.content
        ids = a.get("input_ids")
        cache = _cache_argument(a)
        if ids is None or ids.dim() != 2 or is_legacy_cache(cache) \
                or (cache is not None and not hasattr(cache, "update")):
            content.skip()
            return
        if ff.mask is not None and ff.mask2d is None:  # a 4-D (prepared) mask: not read
            if cache is not None:
                content.watch(cache)
            content.skip(ids if cache is not None else None)
            return
        content.before(ids, cache, ff.c, ff.mask2d)

    def _capture(self, kind: tuple, data: list) -> Entry:
        """A capture of the content rules: its tensors wait with the coherence flags for
        the mode's host read, then ``report`` hands them to ``Content.process``."""
        entry = Entry(data, host_failure=True,
                      context={"content": kind, "index": self.forwards - 1})
        self._pending.append(entry)
        return entry

    def read(self) -> None:
        if self.content is not None:
            self.content.settle()  # the learned keys' fingerprints join the read
        super().read()

    def _post(self, module, args, output):
        logits = getattr(output, "logits", None)
        if logits is None and isinstance(output, (tuple, list)) and output:
            logits = output[0]
        self.content.after(logits)
        return None

    # -- reporting -----------------------------------------------------------------------
    def report(self, entry: Entry, rows: list) -> None:
        ctx = entry.context
        if "content" in ctx:
            found = self.content.process(ctx["content"], rows)
            if found:  # the first rule broken, with every row that breaks it
                k = min(k for k, _ in found)
                self._emit(self._content_violation(k, [f for i, f in found if i == k],
                                                   ctx["index"]))
            return
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


    # -- content reports ------------------------------------------------------------------
    def _content_violation(self, k: int, found: list, index: int) -> InvariantViolation:
        """Content rule ``DEVICE_RULES[k]`` broken by rows of one forward, with each row's
        context tokens, the kept ones, the recorded argmax and where they part."""
        inv, rid, sentence = DEVICE_RULES[k]
        prompts = self.content.spec.prompts
        slots, grid, which = [], [], []
        for f in found:
            ctx = f["ctx"]
            if k == 0:  # no prompt: where the context parts from the closest prompt
                p, offset, part = closest_prompt(ctx, prompts)
                at = [part]
                width = max(len(ctx), offset + len(prompts[p]))
                lines = {"context": ctx, "prompt": [None] * offset + prompts[p]}
            else:  # the slots that break the rule (kept ones changed, or newly kept)
                p, at, chain, rec, kept = (f[x] for x in ("prompt", "at", "chain", "rec", "kept"))
                width = max(len(ctx), len(prompts[p]))
                lines = {"context": ctx,
                         "kept": [chain[j] if j < kept and j < len(chain) else None
                                  for j in range(width)],
                         "argmax": [r if r >= 0 else None for r in rec[:width]]}
            which.append(p)
            slots.append(at)
            if len(grid) < MAX_GRID_ROWS:
                grid.append(grid_row(f"row {f['row']}", lines, at, grid_window(width, at)))
        trace = make_trace(
            invariant=inv, step=index, phase="forward", rows=[f["row"] for f in found],
            slots=slots, rules=[sentence], grid=grid, width=None, run=self.run,
            source="guard",
            state={"rule": rid, "prompts": which, "model": type(self.model).__name__,
                   "greedy": self.content.spec.greedy})
        return InvariantViolation(trace)

    def check_outputs(self, outputs) -> list[InvariantViolation]:
        """C3: ``outputs`` (generated ids per prompt, in prompt order) are the committed
        chains, each ending at its first stop or after exactly ``max_new_tokens``.

        Reads the pending flags first (``check()``), then the content state (one host
        read). Raises the first violation, or returns every one with
        ``raise_on_violation=False``."""
        if self.content is None:
            raise ValueError("check_outputs needs the prompts: guard_model(model, prompts=...)")
        spec = self.content.spec
        outputs = [o.tolist() if isinstance(o, torch.Tensor) else list(o) for o in outputs]
        if len(outputs) != len(spec.prompts):
            raise ValueError(f"check_outputs needs one output per prompt: {len(spec.prompts)} "
                             f"prompts, got {len(outputs)} outputs")
        self.check()
        chains, kept, rec = self.content.host_state()
        stops = set(spec.stop_token_ids)
        n = spec.max_new_tokens
        for i, out in enumerate(outputs):
            found = output_fault(out, spec.prompts[i], chains[i], kept[i], rec[i], stops, n,
                                 spec.greedy)
            if found is not None:
                self._emit(self._output_violation(i, out, spec.prompts[i], chains[i],
                                                  kept[i], rec[i], *found))
        return list(self.violations)

    def _output_violation(self, i, out, prompt, chain, kept, rec, rule, at, note):
        inv, rid, sentence = rule
        n = len(prompt)
        width = max(len(out), at + 1)
        lines = {"output": out,
                 "kept": [chain[n + j] if n + j < len(chain) and kept[n + j] else None
                          for j in range(width)],
                 "argmax": [rec[n + j] if n + j < len(rec) and rec[n + j] >= 0 else None
                            for j in range(width)]}
        text = sentence.format(n=self.content.spec.max_new_tokens)
        trace = make_trace(
            invariant=inv, step=self.forwards, phase="outputs", rows=[i], slots=[[at]],
            rules=[text + (f": {note}" if note else "")], source="guard", run=self.run,
            grid=[grid_row(f"prompt {i}", lines, [at], grid_window(width, [at]))],
            width=None, state={"rule": rid, "output_length": len(out),
                               "prompt_length": n, "model": type(self.model).__name__})
        return InvariantViolation(trace)


def closest_prompt(row, prompts):
    """(prompt index, offset, first differing position) of the prompt a context that
    starts with none looks like: a prompt found whole after some leading tokens (padding
    attended as content) first, else the longest common prefix."""
    for o in range(1, len(row)):
        for i, pr in enumerate(prompts):
            if row[o: o + len(pr)] == pr:
                return i, o, 0
    common = [next((j for j, (u, v) in enumerate(zip(row, pr)) if u != v),
                   min(len(row), len(pr))) for pr in prompts]
    i = max(range(len(prompts)), key=lambda k: common[k])
    return i, 0, common[i]


def output_fault(out, prompt, chain, kept, rec, stops, budget, greedy):
    """The first C3 rule ``out`` breaks, as (rule, output index, note), or None."""
    n = len(prompt)
    for j, tok in enumerate(out):
        t = n + j
        if t < len(chain) and kept[t] and chain[t] != tok:
            return C3_CHAIN, j, f"output[{j}] = {tok}, the loop kept {chain[t]} there"
        if greedy and t < len(rec) and rec[t] >= 0 and rec[t] != tok:
            return C3_ARGMAX, j, f"output[{j}] = {tok}, the model's argmax there is {rec[t]}"
    s = first_stop(out, stops)
    if s is not None and s + 1 < len(out):
        return C3_STOP, s + 1, f"{len(out) - s - 1} tokens after the stop token {out[s]} at {s}"
    if s is None and budget is not None and len(out) != budget:
        j = len(out)
        if j > budget:
            return C3_LENGTH, budget, f"{j} tokens for a budget of {budget}"
        t = n + j
        pred = rec[t] if t < len(rec) and rec[t] >= 0 else None
        said = "not recorded" if pred is None else str(pred) + (
            " (a stop token)" if pred in stops else "")
        return C3_LENGTH, j, (f"ended after {j} of {budget} tokens without a stop; the "
                              f"model's argmax at output[{j}] was {said}")
    return None


def _cache_argument(a: dict):
    cache = a.get("cache")
    return a.get("past_key_values") if cache is None else cache


@contextmanager
def guard_model(model: torch.nn.Module, mode: str = "strict", *, raise_on_violation: bool = True,
                run: dict | None = None, positions: str = "relative", prompts=None,
                max_new_tokens: int | None = None, stop_token_ids=(), greedy: bool = True):
    """Check every forward of ``model`` inside the block (see the module docstring).

    Yields the ``Guard`` (``.violations``, ``.forwards``, ``.check()``,
    ``.check_outputs(outputs)``). In fast mode the pending flags are read when the block
    exits without an exception. ``positions="exact"`` flags implicit positions wherever
    they differ from the valid-slot count, also on relative-position models. With
    ``prompts`` (token ids, in the order ``check_outputs`` gets the outputs) the content
    rules C1-C3 run too (``invariants.content``); guard the target model with them, a
    draft model without.
    """
    guard = Guard(model, mode, raise_on_violation=raise_on_violation, run=run,
                  positions=positions, prompts=prompts, max_new_tokens=max_new_tokens,
                  stop_token_ids=stop_token_ids, greedy=greedy).install()
    try:
        yield guard
        guard.check()
    finally:
        guard.remove()


__all__ = ["MODES", "POSITIONS", "Guard", "guard_model", "output_fault"]
