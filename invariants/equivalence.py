"""The output-equivalence oracle (I7): are generated ids the target's greedy decoding (or
its plain coupled sampling, ``sampling=``)?

``compare_outputs(model, prompts, outputs)`` compares each row with a reference (given, or
computed here by ``greedy_reference``: the model's own batch-1 greedy loop, no specdec).

A row is ``"equal"`` when its ids are the reference's. Otherwise each divergence (an index
where the row's token is not the reference's) is judged:

- a **near-tie**: the engine's token and the reference's token both lie, in the batch-1
  logits for that prefix, within the *legitimate spread* of the top logit (below);
- a **desync**: anything else, and always a missing or an extra token.

A row after a near-tie is a different but legitimate continuation, so the rest of it is
checked against a reference re-decoded from the row's own prefix: one batch-1
teacher-forced forward over ``prompt ++ output`` gives the model's greedy choice after
every prefix of the row. A later divergence from it is judged the same way, so a real
desync after a near-tie is still found. The row is a desync when any divergence is, a
near-tie when it has near-ties only; ``RowComparison.divergences`` lists every one.

**The legitimate spread** (``tolerance=None``, the default: calibrated). In reduced
precision a batched engine and a batch-1 loop round differently (batch shapes, padding and
the number of tokens per forward change the reduction order), so near-tied argmaxes flip.
The oracle measures how far the arithmetic itself moves the logits at that prefix, in the
model's own dtype: it recomputes the next-token logits after ``prompt ++ output[:i]`` in
several shapes (``recomputations()``: one batch-1 forward, the prefix cached and then 1 or
``c`` tokens, left paddings, the prompt cached and then the output ``c`` or 1 tokens at a
time, and the engine's own batch size, padding and tokens per forward when the caller
knows them, ``EngineShape``). The first, a plain batch-1 forward, is the base. For every
tracked token (the base's top ``TRACKED``, the engine's and the reference's) the *gap* is
the top logit minus that token's logit; the spread is the largest change of any tracked
gap between the base and another recomputation. The threshold is the spread, but at least
``floor_ulps`` units of the dtype's resolution at the top logit's magnitude (``ulp``: in
bfloat16 the spacing of representable values is 0.125 between 16 and 32, so logit
differences there are multiples of 0.125). Near-tie iff both gaps are within the
threshold. Every divergence is measured in every shape, so each verdict reports the whole
spread (``Divergence.recomputations`` says over how many logit vectors); the cost is about
one batch-1 prefill of the prefix per shape, paid only where a row diverges.

``tolerance=<number>`` keeps the old absolute rule: near-tie iff the base's top-2 margin
and the engine token's gap are both ``<= tolerance`` logits.

Every divergence reports its evidence (``Divergence``): margin, both gaps, spread and
threshold, in logits and in ulps. Logits are compared in fp32 after the model computed
them in its own dtype.

Sampling (``sampling=``, see ``StepView.sampling``): in coupled mode the reference is
plain coupled sampling (the argmax of ``sampling.scores`` at every position, request
index = the row's index in ``prompts`` unless ``requests`` says otherwise), and every
logit vector above (the base, each recomputation, the teacher-forced one) is turned into
the scores of that request and output position before margins, gaps and spreads are
taken: the noise is the same in every recomputation, so the spread is the arithmetic's
(divided by the temperature; the ulp floor too). Tokens outside the candidate set have
score -inf: they are not tracked, and a token judged there is a desync. Rejection
sampling has no reference (its output is a random sample): refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ._hf import choice_scores, forced_logits, greedy_reference, model_dtype, shaped_logits

#: ``tolerance=None``: the calibrated rule (module docstring); a number is the old absolute rule
DEFAULT_TOLERANCE = None
#: the threshold of the calibrated rule is never below this many ulps at the top logit
FLOOR_ULPS = 2.0
#: top tokens of the base whose gaps measure the spread (plus the two tokens judged)
TRACKED = 16
#: tokens per forward assumed for the verify-like recomputations when the engine's is unknown
DEFAULT_CHUNK = 5
#: left paddings of the padded recomputations (engine's padding added when known)
PADDINGS = (3, 13)

__all__ = ["DEFAULT_TOLERANCE", "FLOOR_ULPS", "EngineShape", "Divergence", "RowComparison",
           "Comparison", "compare_outputs", "check_row", "greedy_reference",
           "divergence_margin", "ulp", "rule_text"]


@dataclass(frozen=True)
class EngineShape:
    """How the engine computed a row, when the caller knows it: one more recomputation
    runs in this shape (the row left-padded by ``padding`` in a batch of ``batch_size``
    rows, its last ``chunk`` tokens in one forward over the cached rest)."""

    batch_size: int = 1
    padding: int = 0
    chunk: int = 1

    def __post_init__(self):
        if self.batch_size < 1 or self.padding < 0 or self.chunk < 1:
            raise ValueError(f"EngineShape needs batch_size >= 1, padding >= 0, chunk >= 1; "
                             f"got {self}")


@dataclass(frozen=True)
class Divergence:
    """One place where a row leaves its reference, and the evidence of the verdict."""

    index: int  # output index
    classification: str  # "near-tie" | "desync"
    expected: int | None  # the reference's token (None: the reference ends there)
    actual: int | None  # the row's token (None: the row ends there)
    reference: str = "batch-1 greedy"  # "batch-1 coupled sampling" when judging coupled scores,
    # or "teacher-forced" (re-decoded from the row's prefix)
    margin: float | None = None  # base top-1 minus top-2 logit
    gap: float | None = None  # base top logit minus the row's token's logit
    reference_gap: float | None = None  # base top logit minus the reference token's logit
    spread: float | None = None  # measured spread of the gaps (calibrated rule)
    threshold: float | None = None  # what both gaps were held to
    ulp: float | None = None  # the dtype's resolution at the top logit's magnitude
    recomputations: int = 0  # logit vectors measured (the base included)

    @property
    def near_tie(self) -> bool:
        return self.classification == "near-tie"

    def in_ulps(self, value: float | None) -> float | None:
        return None if value is None or not self.ulp else value / self.ulp

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        for k in ("margin", "gap", "reference_gap", "spread", "threshold"):
            d[k + "_ulps"] = self.in_ulps(d[k])
        return d

    def describe(self) -> str:
        def f(v):
            if v is None:
                return "n/a"
            u = self.in_ulps(v)
            return f"{v:.3g}" + ("" if u is None else f" ({u:.3g} ulp)")

        if self.expected is None:
            what = f"output {self.actual} where the {self.reference} reference had ended"
        elif self.actual is None:
            what = f"output ended where the {self.reference} reference has {self.expected}"
        else:
            what = f"output {self.actual}, {self.reference} reference {self.expected}"
        head = f"{self.classification} at output index {self.index}: {what}"
        if self.margin is None:
            return head
        return (f"{head}; margin {f(self.margin)}, gap of output token {f(self.gap)}, "
                f"gap of reference token {f(self.reference_gap)}, spread {f(self.spread)} "
                f"over {self.recomputations} recomputations, threshold {f(self.threshold)}")


@dataclass(frozen=True)
class RowComparison:
    """One row: ``classification`` ("equal" | "near-tie" | "desync") and every divergence
    in order (near-ties, then the desync that ended the check, if any)."""

    row: int
    classification: str
    divergences: tuple = ()

    @property
    def equal(self) -> bool:
        return self.classification == "equal"

    @property
    def near_ties(self) -> list:
        return [d for d in self.divergences if d.near_tie]

    @property
    def desync(self) -> Divergence | None:
        return next((d for d in self.divergences if not d.near_tie), None)

    def _first(self, name):
        return getattr(self.divergences[0], name) if self.divergences else None

    # the first divergence's fields (the place where the row left the batch-1 reference)
    first_divergence = property(lambda self: self._first("index"))
    expected = property(lambda self: self._first("expected"))
    actual = property(lambda self: self._first("actual"))
    margin = property(lambda self: self._first("margin"))
    gap = property(lambda self: self._first("gap"))

    def describe(self) -> str:
        if self.equal:
            return f"row {self.row}: equal"
        return "\n".join([f"row {self.row}: {self.classification}"]
                         + [f"  {d.describe()}" for d in self.divergences])


@dataclass
class Comparison:
    rows: list = field(default_factory=list)
    tolerance: float | None = DEFAULT_TOLERANCE
    dtype: str = "float32"
    floor_ulps: float = FLOOR_ULPS

    @property
    def ok(self) -> bool:
        """Every row equals its reference."""
        return all(r.equal for r in self.rows)

    @property
    def near_ties(self) -> list:
        return [r for r in self.rows if r.classification == "near-tie"]

    @property
    def desyncs(self) -> list:
        return [r for r in self.rows if r.classification == "desync"]

    @property
    def rule(self) -> str:
        return rule_text(self.tolerance, self.floor_ulps)

    def counts(self) -> dict:
        return {"equal": sum(r.equal for r in self.rows), "near-tie": len(self.near_ties),
                "desync": len(self.desyncs)}

    def __str__(self) -> str:
        c = self.counts()
        head = (f"{len(self.rows)} rows: {c['equal']} equal, {c['near-tie']} near-tie, "
                f"{c['desync']} desync ({self.dtype}; {self.rule})")
        return "\n".join([head] + [r.describe() for r in self.rows if not r.equal])


def rule_text(tolerance: float | None, floor_ulps: float = FLOOR_ULPS) -> str:
    """The oracle's rule in one line (reports state it)."""
    if tolerance is None:
        return (f"calibrated: near-tie when both tokens lie within the measured spread of "
                f"the top logit (at least {floor_ulps:g} ulp of the model's dtype)")
    return f"absolute: near-tie when margin and gap are <= {tolerance:g} logits"


def ulp(value: float, dtype: torch.dtype) -> float:
    """Spacing of ``dtype``'s representable values at ``|value|`` (its resolution there)."""
    fi = torch.finfo(dtype)
    a = abs(float(value))
    if not math.isfinite(a):
        return float("nan")
    if a < fi.tiny:  # subnormal range: a fixed spacing
        return fi.eps * fi.tiny
    return fi.eps * 2.0 ** math.floor(math.log2(a))


def first_divergence(out: Sequence[int], ref: Sequence[int], start: int = 0) -> int | None:
    """First index ``>= start`` where the sequences differ (a missing token counts)."""
    for i in range(start, max(len(out), len(ref))):
        if i >= len(out) or i >= len(ref) or out[i] != ref[i]:
            return i
    return None


@torch.no_grad()
def divergence_margin(model, prompt: Sequence[int], ref_prefix: Sequence[int],
                      token: int | None, sampling=None,
                      request: int = 0) -> tuple[float, float | None]:
    """Teacher-force ``prompt ++ ref_prefix``; return (top-2 margin, gap of ``token``) of
    the logits (or of the coupled scores of ``request`` there, with ``sampling``)."""
    logits = choice_scores(shaped_logits(model, list(prompt) + list(ref_prefix)), sampling,
                           request, len(ref_prefix)).float()
    top = logits.topk(min(2, logits.shape[-1])).values
    margin = float(top[0] - top[1]) if top.numel() > 1 else float("inf")
    gap = None if token is None or not 0 <= token < logits.shape[-1] else float(top[0] - logits[token])
    return margin, gap


# ---------------------------------------------------------------------------------------
# Judging one divergence
# ---------------------------------------------------------------------------------------

def recomputations(prompt_len: int, n: int, shape: EngineShape | None):
    """The shapes the calibrated rule recomputes the logits after ``n`` tokens in, as
    ``shaped_logits`` keyword arguments, cheapest first (the base, a plain batch-1
    forward, excluded). ``prompt_len``: how many of the ``n`` tokens are the prompt."""
    c = shape.chunk if shape is not None and shape.chunk > 1 else DEFAULT_CHUNK
    tail = lambda m: (n - m,) if n > m else ()  # noqa: E731  (the last m tokens in one forward)
    out = []
    if n > 1:
        out.append({"split": tail(1)})  # greedy decoding's last step
    if n > c:
        out.append({"split": tail(c)})  # a verify step of c tokens
    out += [{"padding": pad, "split": tail(1 if i == 0 else c)} for i, pad in enumerate(PADDINGS)]
    if shape is not None and (shape.batch_size > 1 or shape.padding):
        out.append({"padding": shape.padding, "split": tail(shape.chunk),
                    "batch": shape.batch_size})
    generated = n - prompt_len
    if generated > 1 and prompt_len >= 1:  # the prompt prefilled, then the output in steps
        out.append({"split": (prompt_len,) + (c,) * ((generated - 1) // c)})
        out.append({"split": (prompt_len,) + (1,) * (generated - 1)})  # the reference's own
    return out


def _gaps(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return logits.max() - logits.index_select(0, tokens)


def _spread(v: torch.Tensor, tracked: torch.Tensor, base_gaps: torch.Tensor) -> float:
    """The largest change of a tracked gap (a token that left a sampling run's candidate
    set in ``v``, an infinite change, is not counted: the set is judged by the base)."""
    change = (_gaps(v, tracked) - base_gaps).abs()
    change = change[torch.isfinite(change)]
    return float(change.max()) if change.numel() else 0.0


def judge(model, prompt, prefix, expected: int | None, actual: int | None, *,
          index: int, tolerance: float | None = DEFAULT_TOLERANCE,
          floor_ulps: float = FLOOR_ULPS, shape: EngineShape | None = None,
          reference: str = "batch-1 greedy", extra_logits=(), sampling=None,
          request: int = 0) -> Divergence:
    """Judge a divergence at output ``index`` after ``prompt ++ prefix`` (module docstring).

    ``extra_logits``: logit vectors of that prefix already computed by a legitimate path
    (the teacher-forced reference's own), counted as recomputations. ``sampling``,
    ``request``: judge coupled scores instead of logits (module docstring).
    """
    if sampling is not None and reference == "batch-1 greedy":
        reference = "batch-1 coupled sampling"  # the reference the caller compared with
    mk = lambda cls, **kw: Divergence(index, cls, expected, actual, reference, **kw)  # noqa: E731
    if expected is None or actual is None:
        return mk("desync")
    x = list(prompt) + list(prefix)
    scored = lambda v: choice_scores(v, sampling, request, index).float()  # noqa: E731
    logits = shaped_logits(model, x)
    base = scored(logits)
    vocab = base.shape[-1]
    if not (0 <= actual < vocab and 0 <= expected < vocab):
        return mk("desync")
    top = base.topk(min(2, vocab)).values
    margin = float(top[0] - top[1]) if top.numel() > 1 else float("inf")
    scale = 1.0 if sampling is None else 1.0 / sampling.temperature
    step = ulp(float(logits.max()), model_dtype(model)) * scale
    gap, ref_gap = (float(top[0] - base[t]) for t in (actual, expected))
    if tolerance is not None:
        tie = margin <= tolerance and gap <= tolerance
        return mk("near-tie" if tie else "desync", margin=margin, gap=gap,
                  reference_gap=ref_gap, threshold=float(tolerance), ulp=step, recomputations=1)
    floor = floor_ulps * step
    tracked = torch.unique(torch.cat([base.topk(min(TRACKED, vocab)).indices,
                                      torch.tensor([actual, expected], device=base.device)]))
    tracked = tracked[torch.isfinite(base[tracked])]
    base_gaps = _gaps(base, tracked)
    spread, count = 0.0, 1

    def verdict():
        threshold = max(spread, floor)
        tie = gap <= threshold and ref_gap <= threshold
        return mk("near-tie" if tie else "desync", margin=margin, gap=gap,
                  reference_gap=ref_gap, spread=spread, threshold=threshold, ulp=step,
                  recomputations=count)

    vectors = list(extra_logits)
    vectors += [shaped_logits(model, x, **kw) for kw in recomputations(len(prompt), len(x), shape)]
    for v in vectors:
        count += 1
        spread = max(spread, _spread(scored(v), tracked, base_gaps))
    return verdict()


# ---------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------

def check_row(model, prompt, out, ref=None, *, row: int = 0, start: int = 0,
              complete: bool = True, budget: int | None = None, stop_token_ids=(),
              tolerance: float | None = DEFAULT_TOLERANCE, floor_ulps: float = FLOOR_ULPS,
              shape: EngineShape | None = None, sampling=None,
              request: int | None = None) -> RowComparison:
    """Check ``out[start:]`` (``out[:start]`` is known good).

    ``ref``: the batch-1 greedy reference; up to its first divergence the row is compared
    with it. ``ref=None``: the row is past a near-tie already, so it is compared with the
    teacher-forced reference from ``start`` on. ``complete``: the row has finished (its
    length is then checked: it ends at its first stop token, else at ``budget`` when
    known). A partial row (``complete=False``) is compared with ``ref[:len(out)]``.
    ``sampling``: coupled sampling keyed by ``request`` (default ``row``): the references
    and the judged values are the coupled scores (module docstring).
    """
    out = [int(t) for t in out]
    stops = {int(s) for s in stop_token_ids}
    request = row if request is None else request
    kw = dict(tolerance=tolerance, floor_ulps=floor_ulps, shape=shape, sampling=sampling,
              request=request)
    divs: list[Divergence] = []
    i = start
    if ref is not None:
        ref = [int(t) for t in ref]
        if not complete:
            ref = ref[: len(out)]
        d = first_divergence(out, ref, start)
        if d is None:
            return RowComparison(row, "equal")
        div = judge(model, prompt, out[:d], ref[d] if d < len(ref) else None,
                    out[d] if d < len(out) else None, index=d, **kw)
        divs.append(div)
        if not div.near_tie:
            return RowComparison(row, "desync", tuple(divs))
        i = d + 1
    forced = None
    while True:
        if i > 0 and i <= len(out) and out[i - 1] in stops:
            if i < len(out):  # the reference ends at a stop token; the row runs on
                divs.append(Divergence(i, "desync", None, out[i], "teacher-forced"))
            break
        if i >= len(out):
            over = budget is not None and len(out) > budget
            if over:
                divs.append(Divergence(budget, "desync", None, out[budget], "teacher-forced"))
            elif complete and budget is not None and len(out) < budget:
                forced = forced if forced is not None else forced_logits(model, prompt, out)
                nxt = choice_scores(forced[len(out)], sampling, request, len(out)).argmax()
                divs.append(Divergence(len(out), "desync", int(nxt), None, "teacher-forced"))
            break
        if forced is None:
            forced = forced_logits(model, prompt, out)
            preds = _forced_choices(forced, sampling, request)
        if out[i] != preds[i]:
            div = judge(model, prompt, out[:i], preds[i], out[i], index=i,
                        reference="teacher-forced", extra_logits=(forced[i],), **kw)
            divs.append(div)
            if not div.near_tie:
                break
        i += 1
    if not divs:
        return RowComparison(row, "equal")
    return RowComparison(row, "near-tie" if all(d.near_tie for d in divs) else "desync",
                         tuple(divs))


def _forced_choices(forced: torch.Tensor, sampling, request: int) -> list:
    """The choice after every prefix of a teacher-forced row ([L, V] logits): the argmax,
    or the coupled choice of ``request`` at output positions 0 .. L-1."""
    if sampling is None:
        return forced.argmax(-1).tolist()
    at = torch.arange(forced.shape[0], device=forced.device)
    return sampling.scores(forced, torch.full_like(at, request), at).argmax(-1).tolist()


def compare_outputs(model, prompts, outputs, references=None, *, max_new_tokens: int | None = None,
                    stop_token_ids=None, tolerance: float | None = DEFAULT_TOLERANCE,
                    floor_ulps: float = FLOOR_ULPS, batch_size: int | None = None,
                    chunk: int | None = None, sampling=None, requests=None) -> Comparison:
    """Compare ``outputs[i]`` (generated ids of ``prompts[i]``) with batch-1 greedy decoding
    (or batch-1 coupled sampling: ``sampling``, request index ``requests[i]``, default i;
    see the module docstring).

    references: the reference ids per prompt; when None they are computed with
    ``greedy_reference`` (then ``max_new_tokens`` is required). ``max_new_tokens`` is the
    budget the outputs were generated with: a row that ends without a stop token must
    have used all of it (without it, the budget is the reference's length when the
    reference ends without a stop token, and unknown otherwise). ``stop_token_ids``
    default to the model's generation config. ``tolerance``: None (calibrated) or an
    absolute number of logits (module docstring). ``batch_size`` and ``chunk`` (tokens per
    forward: ``k + 1`` for speculative decoding), when known, add a recomputation in the
    engine's shape: each row left-padded as in its batch of prompts taken in order.
    """
    if sampling is not None and getattr(sampling, "mode", None) != "coupled":
        raise ValueError(f"compare_outputs compares with a reference, which exists for greedy "
                         f"decoding and coupled sampling only, not for sampling mode "
                         f"{getattr(sampling, 'mode', None)!r}: test the distribution instead")
    requests = list(range(len(prompts))) if requests is None else [int(r) for r in requests]
    if len(requests) != len(prompts):
        raise ValueError(f"need one request index per prompt: {len(requests)} requests, "
                         f"{len(prompts)} prompts")
    if len(outputs) != len(prompts):
        raise ValueError(f"need one output per prompt: {len(outputs)} outputs, {len(prompts)} prompts")
    stops = default_stop_ids(model) if stop_token_ids is None else [int(s) for s in stop_token_ids]
    if references is None:
        if max_new_tokens is None:
            raise ValueError("compare_outputs computes the reference itself when references=None: "
                             "pass max_new_tokens (the budget the outputs were generated with)")
        references = [greedy_reference(model, p, max_new_tokens, stops, sampling, q)[0]
                      for p, q in zip(prompts, requests)]
    elif len(references) != len(prompts):
        raise ValueError(f"need one reference per prompt: {len(references)} references, "
                         f"{len(prompts)} prompts")
    if tolerance is not None and not tolerance >= 0:
        raise ValueError(f"tolerance must be None (calibrated) or a number >= 0, got {tolerance!r}")
    shapes = _engine_shapes(prompts, batch_size, chunk)
    rows = []
    for i, (p, o, r) in enumerate(zip(prompts, outputs, references)):
        budget = max_new_tokens
        if budget is None and not (r and int(r[-1]) in stops):
            budget = len(r)
        rows.append(check_row(model, p, o, r, row=i, budget=budget, stop_token_ids=stops,
                              tolerance=tolerance, floor_ulps=floor_ulps, shape=shapes[i],
                              sampling=sampling, request=requests[i]))
    return Comparison(rows, tolerance, str(model_dtype(model)).replace("torch.", ""), floor_ulps)


def _engine_shapes(prompts, batch_size, chunk) -> list:
    if batch_size is None and chunk is None:
        return [None] * len(prompts)
    b = int(batch_size or 1)
    if b < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    shapes = []
    for start in range(0, len(prompts), b):
        group = prompts[start : start + b]
        width = max(len(p) for p in group)
        shapes += [EngineShape(len(group), width - len(p), int(chunk or 1)) for p in group]
    return shapes


def default_stop_ids(model) -> list[int]:
    gc = getattr(model, "generation_config", None)
    eos = getattr(gc, "eos_token_id", None) if gc is not None else None
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
