"""The output-equivalence oracle (I7): compare generated ids with batch-1 greedy decoding
(or with batch-1 coupled sampling, ``sampling=``).

``compare_outputs(model, prompts, outputs)`` compares each row with a reference (given, or
computed here by ``greedy_reference``: the model's own batch-1 greedy loop, no specdec).
For a row that differs it reports the first divergence index ``d`` and, by teacher-forcing
the model on ``prompt ++ reference[:d]``, the reference's top-2 logit margin there and the
gap between the top logit and the output's token. Classification:

- ``"equal"``: same ids;
- ``"near-tie"``: both tokens exist at ``d``, the top-2 margin is ``<= tolerance`` and the
  output's token is within ``tolerance`` of the top logit (a numerical flip between tied
  candidates, e.g. from batched vs batch-1 reductions);
- ``"desync"``: anything else (a missing or extra token, or a clear winner not chosen).

``DEFAULT_TOLERANCE = 1e-3``, absolute, in logit units (suitable for fp32; use a larger
tolerance such as 5e-2 for bf16/fp16 models). Margins are computed in fp32.

Sampling (``sampling=``, see ``StepView.sampling``): in coupled mode the reference is
plain coupled sampling (the argmax of ``sampling.scores`` at every position, request
index = the row's index in ``prompts``) and margins and gaps are those of the scores.
Rejection sampling has no reference (its output is a random sample): refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ._hf import choice_scores, greedy_reference, model_device

#: absolute logit tolerance under which a divergence counts as a numerical near-tie
DEFAULT_TOLERANCE = 1e-3

__all__ = ["DEFAULT_TOLERANCE", "RowComparison", "Comparison", "compare_outputs",
           "greedy_reference", "divergence_margin"]


@dataclass(frozen=True)
class RowComparison:
    row: int
    classification: str  # "equal" | "near-tie" | "desync"
    first_divergence: int | None = None  # output index of the first difference
    expected: int | None = None  # reference token there (None: the reference had ended)
    actual: int | None = None  # output token there (None: the output had ended)
    margin: float | None = None  # reference top-1 minus top-2 logit there
    gap: float | None = None  # reference top-1 logit minus the output token's logit

    @property
    def equal(self) -> bool:
        return self.classification == "equal"

    def describe(self) -> str:
        if self.equal:
            return f"row {self.row}: equal"
        m = "n/a" if self.margin is None else f"{self.margin:.3g}"
        g = "n/a" if self.gap is None else f"{self.gap:.3g}"
        return (f"row {self.row}: {self.classification} at output index {self.first_divergence}: "
                f"output {self.actual}, reference {self.expected}, reference top-2 margin {m}, "
                f"gap to output token {g}")


@dataclass
class Comparison:
    rows: list = field(default_factory=list)
    tolerance: float = DEFAULT_TOLERANCE

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

    def __str__(self) -> str:
        head = (f"{len(self.rows)} rows: {sum(r.equal for r in self.rows)} equal, "
                f"{len(self.near_ties)} near-tie, {len(self.desyncs)} desync "
                f"(tolerance {self.tolerance:g} logits)")
        return "\n".join([head] + [r.describe() for r in self.rows if not r.equal])


def first_divergence(out: Sequence[int], ref: Sequence[int]) -> int | None:
    """First index where the sequences differ (a missing token counts), None if equal."""
    for i in range(max(len(out), len(ref))):
        if i >= len(out) or i >= len(ref) or out[i] != ref[i]:
            return i
    return None


@torch.no_grad()
def divergence_margin(model, prompt: Sequence[int], ref_prefix: Sequence[int],
                      token: int | None, sampling=None, request: int = 0) -> tuple[float, float | None]:
    """Teacher-force ``prompt ++ ref_prefix``; return (top-2 margin, gap of ``token``) of
    the logits (or of the coupled scores of ``request`` there, with ``sampling``)."""
    dev = model_device(model)
    ids = torch.as_tensor(list(prompt) + list(ref_prefix), dtype=torch.long, device=dev)[None]
    logits = model(input_ids=ids, use_cache=False).logits[0, -1].float()
    logits = choice_scores(logits, sampling, request, len(ref_prefix)).float()
    top = logits.topk(min(2, logits.shape[-1])).values
    margin = float(top[0] - top[1]) if top.numel() > 1 else float("inf")
    gap = None if token is None or not 0 <= token < logits.shape[-1] else float(top[0] - logits[token])
    return margin, gap


def classify(model, prompt, out, ref, row: int = 0,
             tolerance: float = DEFAULT_TOLERANCE, sampling=None,
             request: int | None = None) -> RowComparison:
    """Compare one row (see the module docstring for the classification); ``request``:
    the request index the coupled scores are keyed by (default ``row``)."""
    out, ref = [int(t) for t in out], [int(t) for t in ref]
    d = first_divergence(out, ref)
    if d is None:
        return RowComparison(row, "equal")
    expected = ref[d] if d < len(ref) else None
    actual = out[d] if d < len(out) else None
    margin = gap = None
    if expected is not None:
        margin, gap = divergence_margin(model, prompt, ref[:d], actual, sampling,
                                        row if request is None else request)
    tie = (expected is not None and actual is not None and margin is not None
           and gap is not None and margin <= tolerance and gap <= tolerance)
    return RowComparison(row, "near-tie" if tie else "desync", d, expected, actual, margin, gap)


def compare_outputs(model, prompts, outputs, references=None, *, max_new_tokens: int | None = None,
                    stop_token_ids=None, tolerance: float = DEFAULT_TOLERANCE,
                    sampling=None) -> Comparison:
    """Compare ``outputs[i]`` (generated ids of ``prompts[i]``) with batch-1 greedy decoding
    (or batch-1 coupled sampling: ``sampling``, see the module docstring).

    references: the reference ids per prompt; when None they are computed with
    ``greedy_reference`` (then ``max_new_tokens`` is required; ``stop_token_ids`` defaults
    to the model's generation config). ``tolerance``: see ``DEFAULT_TOLERANCE``.
    """
    if sampling is not None and getattr(sampling, "mode", None) != "coupled":
        raise ValueError(f"compare_outputs compares with a reference, which exists for greedy "
                         f"decoding and coupled sampling only, not for sampling mode "
                         f"{getattr(sampling, 'mode', None)!r}: test the distribution instead")
    if len(outputs) != len(prompts):
        raise ValueError(f"need one output per prompt: {len(outputs)} outputs, {len(prompts)} prompts")
    if references is None:
        if max_new_tokens is None:
            raise ValueError("compare_outputs computes the reference itself when references=None: "
                             "pass max_new_tokens (the budget the outputs were generated with)")
        stops = default_stop_ids(model) if stop_token_ids is None else list(stop_token_ids)
        references = [greedy_reference(model, p, max_new_tokens, stops, sampling, i)[0]
                      for i, p in enumerate(prompts)]
    elif len(references) != len(prompts):
        raise ValueError(f"need one reference per prompt: {len(references)} references, "
                         f"{len(prompts)} prompts")
    rows = [classify(model, p, o, r, i, tolerance, sampling)
            for i, (p, o, r) in enumerate(zip(prompts, outputs, references))]
    return Comparison(rows, tolerance)


def default_stop_ids(model) -> list[int]:
    gc = getattr(model, "generation_config", None)
    eos = getattr(gc, "eos_token_id", None) if gc is not None else None
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
