"""Sampling, exactly: the token chosen at every output position, in two modes.

``Sampling(temperature=1.0, top_k=0, top_p=1.0, seed=0, mode="coupled")`` describes how a
run samples; ``sampling=None`` everywhere means greedy decoding (the argmax).

The candidate set and the target distribution. ``x = logits / temperature`` (in fp32).
top-k keeps exactly the k tokens of largest ``x`` (among values equal to the k-th largest,
the smaller token ids; ``top_k=0``: no cut); top-p then keeps, over the softmax of what
top-k left, the tokens whose probability is at least that of the last token of the
shortest prefix of the descending order whose mass reaches ``top_p`` (ties kept together).
Either way the set is a function of the values, never of how a sort orders equal values;
the most probable token is always kept. ``p`` is the softmax of ``x`` over that set
(``distribution``, fp64, 0 outside it). With top-k, only the k candidates are sorted and
given noise (``candidates``); without it, every token is (on a CPU a sort of a 49152-token
vocabulary for top-p and its noise cost far more than an argmax; see the README).

Counter-based randomness. Every random number is a hash of (seed, request index,
output position t, stream[, token id]) computed with integer tensor ops on the logits'
device: no device RNG, no generator state, no upload. Values are held in int64 tensors
in ``[0, 2**32)``; each multiplication is of a value below ``2**32`` by a constant below
``2**31``, so nothing overflows and the bits are the mathematically defined ones on any
device, at any batch size and in any schedule (``mix`` runs unchanged on Python ints:
the tests compare both; ``mix`` is a xorshift-multiply bijection whose statistical
quality the tests check: even bins over seeds, no correlation between neighbouring
positions or streams, Gumbel moments, sampling frequencies). The seed of request i is
``(seed, i)`` hashed (``keys``).
Uniforms: ``(h + 0.5) / 2**32`` (Gumbel noise, from one 32-bit word per token) or a
53-bit fp64 uniform from the two 32-bit lanes of a key (``uniform``). Gumbel noise is
``-log(-log(u))`` computed in fp64 and rounded to fp32: identical on every device unless
a device's fp64 log differs by an ulp exactly at an fp32 rounding boundary.

Streams: ``COUPLED`` (the Gumbel noise of the coupled choice, shared by the target and a
draft model), ``DRAFT`` (a draft model's samples in rejection mode), ``ACCEPT`` (the
acceptance uniforms), ``RESAMPLE`` (residual and bonus samples; plain rejection-mode
sampling).

Coupled mode (``coupled_choice``). The token at output position t of request i is
``argmax(x + G)`` over the candidate set, with ``G`` the Gumbel noise keyed by (seed, i,
t): a sample from ``p`` (the Gumbel-max trick), and a deterministic function of the
logits at that position. Speculative decoding then checks drafts against that choice with
the greedy rule, so its output equals plain sampling token for token, exactly as greedy
speculative decoding equals greedy decoding (and with the same caveat: logits computed in
a batched verify forward and in a one-token forward differ by float noise, which changes
a choice only when two scores tie to within it; fp32 tiny models never did in the tests).

Rejection mode (``rejection_choices``; Leviathan et al. 2023, Chen et al. 2023). Draft
``d`` at a position is accepted iff ``u * q(d) < p(d)`` (probability ``min(1, p/q)``);
on rejection the token is sampled from ``norm(max(0, p - q))``; after the last draft the
bonus is sampled from ``p``. A drafter without a distribution (n-gram, scripted) has the
point mass ``q = onehot(d)``; a draft model has ``q`` = its own ``distribution`` under the
same temperature, top-k and top-p. Samples from a distribution use the inverse CDF in fp64
(``sample_cdf``). The step's choice at each position is the accepted draft, else the
residual sample, and the bonus at the end: a rejected draft has ``max(0, p - q) = 0`` at
itself, so the choice differs from it, and the greedy acceptance rule (longest prefix of
drafts equal to the choices) gives exactly the accepted count. The output is a sample of
the target's distribution, not equal to any fixed reference. Keys are positions, not
steps: a position after a rejection is drafted again at the next step with the same keys,
which is sound because the randomness of positions after the last committed one never
influenced anything committed (so it is still fresh given the committed output); and so
the output depends on the request, the seed, the drafter and the draft lengths (k and
each row's ``k_b``: fixed by ``policy="fixed"``, chosen from measured step costs by the
adaptive policy), not on the batch or the schedule. A row that drafts ``k_b < k`` verifies
the step's slots past its ``k_b`` too: its choice at slot ``k_b`` is ``accept-or-resample``
of the unused draft there, still a sample of ``p`` (the draft is a sample of ``q``, or a
point mass), so the bonus rule needs no per-row position.

Every function is a tensor op over the batch: no loop over rows, no host read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import validation

MODES = ("coupled", "rejection")
#: hash streams (see the module docstring)
COUPLED, DRAFT, ACCEPT, RESAMPLE = 1, 2, 3, 4
#: the largest seed (seeds are 64-bit)
MAX_SEED = 2**64 - 1

M32 = 0xFFFFFFFF
#: odd multipliers below 2**31 (so products of 32-bit values stay below 2**63)
MUL = (0x21F0AAAD, 0x735A2D97)
#: the two key lanes' salts
LANES = (0x243F6A88, 0x85A308D3)


@dataclass(frozen=True)
class Sampling:
    """How a run samples (see the module docstring); checked at construction.

    temperature: > 0, finite (for greedy decoding pass ``sampling=None``)
    top_k: integer >= 0 (0: no top-k cut)
    top_p: in (0, 1] (1: no top-p cut)
    seed: integer in [0, 2**64); request i samples with (seed, i)
    mode: "coupled" (equal to plain sampling token for token) or "rejection"
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    mode: str = "coupled"

    def __post_init__(self):
        t = validation.positive_number(self.temperature, "temperature",
                                       hint="for greedy decoding pass sampling=None")
        rule = "top_p must be a number in (0, 1] (1 keeps every token)"
        try:
            p = validation.number(self.top_p, "top_p", 0, 1)
        except ValueError:
            p = 0.0
        if p == 0:
            raise ValueError(f"{rule}, got {self.top_p!r}")
        object.__setattr__(self, "temperature", t)
        object.__setattr__(self, "top_p", p)
        object.__setattr__(self, "top_k", validation.integer(self.top_k, "top_k", minimum=0))
        object.__setattr__(self, "seed", validation.integer(self.seed, "seed", minimum=0,
                                                            maximum=MAX_SEED))
        validation.choice(self.mode, "sampling mode", MODES)

    def scores(self, logits: torch.Tensor, row_ids: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The coupled scores ``x + G`` (``-inf`` outside the candidate set), whose argmax
        is the coupled choice. logits: [..., V]; row_ids, t: long, broadcastable to
        ``logits.shape[:-1]``. Returns [..., V] fp32."""
        return coupled_scores(logits, self, row_ids, t)

    def as_dict(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                "seed": self.seed, "mode": self.mode}


def checked(value) -> Sampling | None:
    """``sampling=`` of the public entry points: None (greedy) or a ``Sampling`` (whose
    fields were checked when it was built)."""
    if value is not None and not isinstance(value, Sampling):
        raise TypeError(f"sampling must be a specdec.Sampling(temperature=, top_k=, top_p=, "
                        f"seed=, mode=) or None (greedy), got {validation.describe(value)}")
    return value


# ---------------------------------------------------------------------------------------
# Counter-based random bits
# ---------------------------------------------------------------------------------------

def mix(x):
    """A bijective mix of 32-bit values (int64 tensors in ``[0, 2**32)``, or Python
    ints): xor-shifts and multiplications by odd constants below ``2**31``, masked to 32
    bits after each product, which stays below ``2**63``."""
    x = x ^ (x >> 16)
    x = (x * MUL[0]) & M32
    x = x ^ (x >> 15)
    x = (x * MUL[1]) & M32
    return x ^ (x >> 15)


def request_seeds(seed: int, row_ids: torch.Tensor) -> tuple:
    """(lane 0, lane 1) of the seed of each request: ``(seed, i)`` hashed; each
    ``row_ids``-shaped long in ``[0, 2**32)``."""
    lo, hi = seed & M32, seed >> 32
    return tuple(mix(row_ids ^ mix(mix(lo ^ salt) ^ hi)) for salt in LANES)


def keys(seed: int, row_ids: torch.Tensor, t: torch.Tensor, stream: int) -> tuple:
    """The two 32-bit lanes of the key of (seed, request, output position, stream).
    row_ids, t: long, broadcastable; returns two long tensors of their broadcast shape."""
    return tuple(mix(mix(lane ^ t) ^ stream) for lane in request_seeds(seed, row_ids))


def token_bits(k0: torch.Tensor, k1: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
    """32 random bits per (key, token id): keys [...], vocab: ids, broadcast as
    ``[..., V]``. A bijection of the token id for a fixed key (no two ids collide)."""
    return mix(mix(k0[..., None] ^ vocab) ^ k1[..., None])


def uniform(k0: torch.Tensor, k1: torch.Tensor) -> torch.Tensor:
    """A uniform in (0, 1) per key, fp64 with 53 random bits (27 of lane 0, 26 of lane 1)."""
    bits = (k0 >> 5) * (1 << 26) + (k1 >> 6)
    return (bits.double() + 0.5) * 2.0**-53


def gumbel(seed: int, row_ids: torch.Tensor, t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Gumbel noise of the coupled stream at token ids ``ids`` (broadcast as ``[..., C]``
    against keys ``[...]``): ``-log(-log(u))`` in fp64, ``u = (bits + 0.5) / 2**32``,
    rounded to fp32. The noise of a token does not depend on which other ids are asked."""
    k0, k1 = keys(seed, row_ids, t, COUPLED)
    u = (token_bits(k0, k1, ids).double() + 0.5) * 2.0**-32
    return (-torch.log(-torch.log(u))).float()


# ---------------------------------------------------------------------------------------
# The candidate set and the target distribution
# ---------------------------------------------------------------------------------------

def candidates(logits: torch.Tensor, s: Sampling):
    """(ids [..., C] long or None, x [..., C] fp32): the tokens top-k leaves and their
    ``logits / temperature``, ``-inf`` where top-p drops one. ``C = top_k`` when
    ``0 < top_k < V`` (then exactly the k largest, ties at the boundary broken toward the
    smaller token id, so the set is a function of the values alone), else ``C = V`` and
    ``ids`` is None (every token, in order). Top-p needs a sort of the C values only."""
    x = logits.float() / s.temperature
    vocab = x.shape[-1]
    ids = None
    if 0 < s.top_k < vocab:
        kth = x.topk(s.top_k, dim=-1).values[..., -1:]
        above = x > kth
        room = s.top_k - above.sum(dim=-1, keepdim=True)  # how many tied tokens fit
        tied = x == kth
        keep = above | (tied & (tied.cumsum(dim=-1) <= room))  # exactly top_k per row
        ids = keep.to(x.dtype).topk(s.top_k, dim=-1).indices  # the kept ids, any order
        x = x.gather(-1, ids)
    if s.top_p < 1:
        probs = torch.softmax(x.double(), dim=-1)
        ordered = probs.sort(dim=-1, descending=True).values
        before = ordered.cumsum(dim=-1) - ordered  # mass strictly before, in sorted order
        count = (before < s.top_p).sum(dim=-1, keepdim=True)  # >= 1: the top token
        threshold = ordered.gather(-1, count - 1)
        x = x.masked_fill(probs < threshold, -math.inf)
    return ids, x


def spread(ids: torch.Tensor | None, values: torch.Tensor, vocab: int, fill: float) -> torch.Tensor:
    """[..., V]: candidate ``values`` [..., C] at their token ids, ``fill`` elsewhere."""
    if ids is None:
        return values
    out = values.new_full((*values.shape[:-1], vocab), fill)
    return out.scatter(-1, ids, values)


def scaled(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """[..., V] fp32: ``logits / temperature`` with ``-inf`` outside the top-k / top-p set."""
    ids, x = candidates(logits, s)
    return spread(ids, x, logits.shape[-1], -math.inf)


def distribution(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """[..., V] fp64: the sampling distribution ``p`` (softmax over the candidate set)."""
    ids, x = candidates(logits, s)
    return spread(ids, torch.softmax(x.double(), dim=-1), logits.shape[-1], 0.0)


# ---------------------------------------------------------------------------------------
# Coupled mode
# ---------------------------------------------------------------------------------------

def _noisy(logits: torch.Tensor, s: Sampling, row_ids: torch.Tensor, t: torch.Tensor):
    """(ids or None, ``x + G`` at the candidates) (see ``candidates``)."""
    row_ids, t = torch.broadcast_tensors(row_ids, t)
    ids, x = candidates(logits, s)
    at = torch.arange(logits.shape[-1], device=logits.device) if ids is None else ids
    return ids, x + gumbel(s.seed, row_ids, t, at)


def coupled_scores(logits: torch.Tensor, s: Sampling, row_ids: torch.Tensor,
                   t: torch.Tensor) -> torch.Tensor:
    """[..., V] fp32: ``x + G`` (``-inf`` outside the candidate set), G keyed by (seed,
    request, t) (see ``Sampling.scores``)."""
    ids, scores = _noisy(logits, s, row_ids, t)
    return spread(ids, scores, logits.shape[-1], -math.inf)


def coupled_choice(logits: torch.Tensor, s: Sampling, row_ids: torch.Tensor,
                   t: torch.Tensor) -> torch.Tensor:
    """[...] long: the coupled choice ``argmax(x + G)`` at every position (over the
    top-k candidates only when top-k cuts: the same choice, less noise to compute)."""
    ids, scores = _noisy(logits, s, row_ids, t)
    best = scores.argmax(dim=-1)
    return best if ids is None else ids.gather(-1, best[..., None])[..., 0]


# ---------------------------------------------------------------------------------------
# Rejection mode
# ---------------------------------------------------------------------------------------

def sample_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample: the first token whose cumulative probability exceeds ``u``.

    probs: [..., V] fp64, normalised; u: [...] fp64 in (0, 1). A token of probability 0
    is never chosen (the index is capped at the last token of positive probability, which
    a rounding of the cumulative sum below ``u`` would otherwise overrun).
    """
    cdf = probs.cumsum(dim=-1)
    index = (cdf <= u[..., None]).sum(dim=-1)
    ids = torch.arange(probs.shape[-1], device=probs.device)
    last = torch.where(probs > 0, ids, 0).amax(dim=-1)
    return torch.minimum(index, last)


def draft_distribution(drafts: torch.Tensor, draft_logits: torch.Tensor | None, s: Sampling,
                       vocab: int) -> torch.Tensor:
    """q [B, k, V] fp64 of the drafts: the draft model's distribution at each draft, or
    the point mass on the draft for a drafter without one (``draft_logits`` None)."""
    k = drafts.shape[1]
    if draft_logits is None:  # a comparison, not one_hot: its range check reads the host
        ids = torch.arange(vocab, device=drafts.device)
        return (drafts[..., None] == ids).double()
    return distribution(draft_logits[:, :k], s)


def accept_draft(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
                 u: torch.Tensor) -> torch.Tensor:
    """[B, k] bool: draft accepted with probability ``min(1, p(d) / q(d))``: ``u q(d) < p(d)``.
    p, q: [B, k, V] fp64; drafts: [B, k] long; u: [B, k] fp64."""
    at = drafts[..., None]
    return u * q.gather(-1, at)[..., 0] < p.gather(-1, at)[..., 0]


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[B, k, V] fp64: ``norm(max(0, p - q))``, the distribution of a token after a
    rejection (``p`` itself where ``p <= q`` everywhere, which only rounding allows)."""
    r = (p - q).clamp(min=0)
    mass = r.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp(min=torch.finfo(r.dtype).tiny), p)


def bonus_distribution(p_last: torch.Tensor, draft_logits_last: torch.Tensor | None,
                       s: Sampling) -> torch.Tensor:
    """[B, 1, V] fp64: the distribution of the bonus token, the target's ``p`` after the
    last draft (the draft model's logits there are not used)."""
    return p_last


def rejection_choices(logits: torch.Tensor, s: Sampling, row_ids: torch.Tensor, t: torch.Tensor,
                      drafts: torch.Tensor, draft_logits: torch.Tensor | None) -> torch.Tensor:
    """[B, k+1] long: the step's choice at each position (see the module docstring).

    logits: [B, k+1, V] target logits at pending and each draft; row_ids: [B] long;
    t: [B, k+1] long output positions; drafts: [B, k] long; draft_logits: [B, k+1, V]
    the draft model's logits at each draft and after the last one, or None (point masses).
    """
    k, vocab = drafts.shape[1], logits.shape[-1]
    p = distribution(logits, s)  # [B, k+1, V]
    q = draft_distribution(drafts, draft_logits, s, vocab)  # [B, k, V]
    u_accept = uniform(*keys(s.seed, row_ids[:, None], t[:, :k], ACCEPT))  # [B, k]
    u_sample = uniform(*keys(s.seed, row_ids[:, None], t, RESAMPLE))  # [B, k+1]
    accepted = accept_draft(p[:, :k], q, drafts, u_accept)
    last = None if draft_logits is None else draft_logits[:, k:]
    weights = torch.cat([residual(p[:, :k], q), bonus_distribution(p[:, k:], last, s)], dim=1)
    sampled = sample_cdf(weights, u_sample)  # [B, k+1]
    return torch.cat([torch.where(accepted, drafts, sampled[:, :k]), sampled[:, k:]], dim=1)


# ---------------------------------------------------------------------------------------
# The choice of a verify step, of plain decoding and of a draft model
# ---------------------------------------------------------------------------------------

def choose(logits: torch.Tensor, s: Sampling | None, row_ids: torch.Tensor,
           t: torch.Tensor | None, drafts: torch.Tensor,
           draft_logits: torch.Tensor | None = None) -> torch.Tensor:
    """[B, k+1] long: the token chosen at each position of a verify step (plain decoding:
    ``k = 0``). Greedy (``s`` None): the argmax (``t``, the output positions, unread: may
    be None); coupled: the coupled choice; rejection: ``rejection_choices``. Shapes as in
    ``rejection_choices``."""
    if s is None:
        return logits.argmax(dim=-1)
    if s.mode == "coupled":
        return coupled_choice(logits, s, row_ids[:, None], t)
    return rejection_choices(logits, s, row_ids, t, drafts, draft_logits)


def draft_choice(logits: torch.Tensor, s: Sampling, row_ids: torch.Tensor,
                 t: torch.Tensor) -> torch.Tensor:
    """[B] long: a draft model's token at output position t ([B] long) from its logits
    [B, V]: the coupled choice with the target's own noise (coupled mode: a draft model
    that agrees with the target proposes the token the target will choose), or a sample
    of its distribution ``q`` from the draft stream (rejection mode)."""
    if s.mode == "coupled":
        return coupled_choice(logits, s, row_ids, t)
    return sample_cdf(distribution(logits, s), uniform(*keys(s.seed, row_ids, t, DRAFT)))


def choice_margins(logits: torch.Tensor, s: Sampling | None, row_ids: torch.Tensor,
                   t: torch.Tensor) -> torch.Tensor:
    """[...] fp32: top-1 minus top-2 of the scores a choice maximises (greedy: the
    logits; coupled: ``x + G``); inf with a single candidate. Not defined for rejection
    mode, whose choice maximises nothing."""
    if s is not None and s.mode != "coupled":
        raise ValueError("choice margins are defined for greedy decoding and coupled "
                         f"sampling, not for mode {s.mode!r} (its tokens are random samples)")
    scores = logits.float() if s is None else coupled_scores(logits, s, row_ids, t)
    if scores.shape[-1] < 2:
        return torch.full(scores.shape[:-1], math.inf, device=scores.device)
    top = scores.topk(2, dim=-1).values
    return torch.where(top[..., 1] > -math.inf, top[..., 0] - top[..., 1], math.inf)
