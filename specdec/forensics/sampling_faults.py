"""Known-bad sampling engines: speculative sampling defects as one-point faults.

Each fault replaces one function of ``specdec.sampling`` for the duration of a ``with``
block (``apply``), so the engine that runs is the real one with a single wrong step:

=======================  =====  =========================================================
name                     issue  what goes wrong
=======================  =====  =========================================================
accept_fresh_sample      (g)    rejection: a draft is accepted when it equals a fresh
                                sample of p (probability p(d), not min(1, p(d)/q(d))),
                                then the residual is sampled as usual; coupled: drafts are
                                checked against a sample with fresh noise each step
                                instead of the noise of their position
residual_unnormalised    (h)    rejection: the residual max(0, p - q) is sampled without
                                dividing by its mass, so the inverse CDF runs past its end
                                (capped at the last possible token) with probability
                                1 - mass
residual_unclipped       (h)    rejection: the residual p - q is not clipped at zero (the
                                mass is that of the clipped one): the cumulative sum dips
                                at tokens where q > p, which shifts every later token
bonus_from_draft         (i)    the bonus token (after the last draft) is sampled from the
                                draft model's q instead of the target's p (coupled: chosen
                                with the draft model's scores)
=======================  =====  =========================================================

Where a defect shows: each one shifts the output distribution, which the distribution
test (``specdec.forensics.distribution``) detects with a draft model whose q differs from
p. With a point-mass drafter (n-gram, scripted) (g) is harmless (accepting with
probability p(d) and resampling from p without d is exactly right when q is a point mass),
and (i) does not apply (such a drafter has no distribution after its last draft); (h)
shifts with any drafter. In coupled mode only (g) and (i) exist (there is no residual);
they change the ids, so the output oracle flags them against plain coupled sampling.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .. import sampling


@dataclass(frozen=True)
class Fault:
    name: str
    description: str
    # function of specdec.sampling -> (original -> faulty replacement)
    patches: dict
    # the modes in which the fault changes anything
    modes: tuple
    # whether it needs a drafter with a distribution (a draft model) to show
    needs_distribution: bool


def _fresh_sample(orig: Callable) -> Callable:
    def accept_draft(p, q, drafts, u):
        # the draft is compared with a fresh sample of p (drawn with the acceptance uniform)
        fresh = sampling.sample_cdf(p, u)
        return fresh == drafts
    return accept_draft


def _fresh_noise(orig: Callable) -> Callable:
    calls = itertools.count(1)

    def coupled_choice(logits, s, row_ids, t):
        # new noise at every call: the position's own noise is not what drafts meet
        return orig(logits, s, row_ids, t + (next(calls) % 2048) * 2**20)  # t stays < 2**31
    return coupled_choice


def _unnormalised(orig: Callable) -> Callable:
    def residual(p, q):
        return (p - q).clamp(min=0)
    return residual


def _unclipped(orig: Callable) -> Callable:
    def residual(p, q):
        r = p - q
        mass = r.clamp(min=0).sum(dim=-1, keepdim=True)
        return torch.where(mass > 0, r / mass.clamp(min=torch.finfo(r.dtype).tiny), p)
    return residual


def _bonus_from_q(orig: Callable) -> Callable:
    def bonus_distribution(p_last, draft_logits_last, s):
        if draft_logits_last is None:
            return orig(p_last, draft_logits_last, s)
        return sampling.distribution(draft_logits_last, s)
    return bonus_distribution


def _bonus_from_draft_scores(orig: Callable) -> Callable:
    def choose(logits, s, row_ids, t, drafts, draft_logits=None):
        out = orig(logits, s, row_ids, t, drafts, draft_logits)
        if s is None or s.mode != "coupled" or draft_logits is None:
            return out
        k = drafts.shape[1]
        bonus = sampling.coupled_choice(draft_logits[:, k], s, row_ids, t[:, k])
        return torch.cat([out[:, :k], bonus[:, None]], dim=1)
    return choose


FAULTS = {f.name: f for f in (
    Fault("accept_fresh_sample", "(g) drafts accepted when equal to a fresh target sample",
          {"accept_draft": _fresh_sample, "coupled_choice": _fresh_noise},
          ("coupled", "rejection"), True),
    Fault("residual_unnormalised", "(h) residual max(0, p - q) not renormalised",
          {"residual": _unnormalised}, ("rejection",), False),
    Fault("residual_unclipped", "(h) residual p - q not clipped at zero",
          {"residual": _unclipped}, ("rejection",), False),
    Fault("bonus_from_draft", "(i) bonus token sampled from the draft's q",
          {"bonus_distribution": _bonus_from_q, "choose": _bonus_from_draft_scores},
          ("coupled", "rejection"), True),
)}
NAMES = tuple(FAULTS)


@contextlib.contextmanager
def apply(name: str | None) -> Iterator[Fault | None]:
    """Run the block with fault ``name`` in ``specdec.sampling`` (None: no fault); the
    original functions are restored on exit, also when the block raises."""
    if name is None:
        yield None
        return
    if name not in FAULTS:
        raise ValueError(f"unknown sampling fault {name!r}; expected one of {', '.join(NAMES)}")
    fault = FAULTS[name]
    saved = {fn: getattr(sampling, fn) for fn in fault.patches}
    try:
        for fn, make in fault.patches.items():
            setattr(sampling, fn, make(saved[fn]))
        yield fault
    finally:
        for fn, orig in saved.items():
            setattr(sampling, fn, orig)
