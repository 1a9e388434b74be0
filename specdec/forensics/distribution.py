"""Distribution tests of sampling engines against the target's exact distribution.

Speculative rejection sampling is lossless in distribution: whatever the drafts, its
tokens are a sample of the target's own sampling distribution ``p`` (temperature, top-k,
top-p: ``specdec.sampling.distribution``). This module tests that claim where it can be
checked exactly: on a tiny vocabulary the distribution of the first ``T`` tokens of a
prompt is enumerated (at depth ``j`` all ``V**j`` continuations in one batched forward,
without a cache; the probability of a ``T``-token continuation is the product of its
conditionals), the engine samples ``N`` continuations of the prompt in one ``generate``
call (``N`` requests: request i samples with (seed, i), independent streams), and
Pearson's chi-square compares the counts of the ``V**T`` continuations with ``N`` times
their probabilities. Cells of expected count below 5 are pooled (smallest first, until the
pool reaches 5); a sample in a cell of probability 0 (outside the top-k/top-p set) gives
p-value 0. The p-value is the chi-square survival function, the regularised upper
incomplete gamma ``Q(df / 2, x / 2)`` (``torch.special.gammaincc``).

``Config`` holds the defaults: tiny Llama models with vocabulary 8 (the target, and as
draft model its weights with 20% relative noise: about 40% of drafts accepted at
temperature 1, so runs mix accepted and rejected drafts and bonus tokens), a prompt on
which the n-gram drafter's proposals are accepted too (15% at temperature 1), T = 3 new
tokens, k = 2 (so later steps have budget-limited draft lengths), N = 12000 samples,
significance ``ALPHA = 1e-3``: an engine passes when p >= ALPHA. ``banned`` tokens get
logit -inf in the draft model (a q with zeros where p has mass). Runs are deterministic
(counter-based randomness), so a result is reproducible, not a fresh draw.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass

import torch

#: significance level of the distribution test: an engine passes when p >= ALPHA
ALPHA = 1e-3
#: cells of expected count below this are pooled
MIN_EXPECTED = 5.0


@dataclass(frozen=True)
class Config:
    """A distribution test's workload (see the module docstring)."""

    family: str = "llama"
    vocab: int = 8
    seed: int = 0
    draft_noise: float = 0.2
    # tokens the draft model never proposes (an LM-head bias of -inf): q(v) = 0
    banned: tuple = ()
    prompt: tuple = (3, 4, 3, 3, 3, 3, 3, 3, 3, 4)
    new_tokens: int = 3
    k: int = 2
    samples: int = 12000
    # rows per batch (the Monitor's history rules match rows across views, quadratic in B)
    batch_size: int = 2000


@dataclass
class Outcome:
    """One distribution test: the chi-square statistic, its degrees of freedom, the
    p-value, and what ran."""

    engine: str
    sampling: dict
    drafter: str
    strategy: str
    samples: int
    cells: int  # cells after pooling
    statistic: float
    df: int
    p_value: float
    acceptance: float
    seconds: float
    alpha: float = ALPHA

    @property
    def passed(self) -> bool:
        return self.p_value >= self.alpha

    def as_json(self) -> dict:
        return {**asdict(self), "passed": self.passed}

    def describe(self) -> str:
        return (f"{self.engine}: chi2 {self.statistic:.1f}, df {self.df}, p = {self.p_value:.3g} "
                f"({'pass' if self.passed else 'FAIL'} at alpha {self.alpha:g}; {self.samples} "
                f"samples, {self.drafter} drafter, {self.strategy}, acceptance {self.acceptance:.2f})")


_MODELS: dict = {}


def models(config: Config = Config()):
    """(target, draft model) of ``config`` (built once per process)."""
    from .. import models as m

    key = (config.family, config.vocab, config.seed, config.draft_noise, config.banned)
    if key not in _MODELS:
        draft = m.tiny_draft(config.family, config.seed, noise=config.draft_noise,
                             vocab=config.vocab)
        if config.banned:
            head = draft.get_output_embeddings()
            biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
            with torch.no_grad():
                biased.weight.copy_(head.weight)
                biased.bias.zero_()
                biased.bias[list(config.banned)] = -torch.inf
            draft.set_output_embeddings(biased)
        _MODELS[key] = (m.tiny(config.family, config.seed, vocab=config.vocab), draft)
    return _MODELS[key]


@torch.no_grad()
def exact_distribution(model, prompt, steps: int, sampling) -> torch.Tensor:
    """[V ** steps] fp64: the probability of every continuation of ``prompt`` by ``steps``
    tokens under ``sampling``'s distribution, continuation ``(x_0, .., x_{T-1})`` at index
    ``sum x_j V ** (T - 1 - j)``."""
    from .. import sampling as sampling_mod

    dev = next(model.parameters()).device
    vocab = int(model.get_output_embeddings().weight.shape[0])
    joint = torch.ones(1, dtype=torch.float64, device=dev)
    for depth in range(steps):
        prefixes = torch.tensor(list(itertools.product(range(vocab), repeat=depth)),
                                dtype=torch.long, device=dev).reshape(vocab ** depth, depth)
        ids = torch.cat([torch.tensor(prompt, device=dev).expand(prefixes.shape[0], -1), prefixes], 1)
        logits = model(input_ids=ids, use_cache=False).logits[:, -1]
        p = sampling_mod.distribution(logits, sampling)  # [V**depth, V]
        joint = (joint[:, None] * p).reshape(-1)
    return joint


def chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = MIN_EXPECTED):
    """(statistic, degrees of freedom, p-value, cells) of Pearson's test of ``counts``
    ([C] observed) against ``probs`` ([C] fp64, summing to 1), cells of expected count
    below ``min_expected`` pooled (smallest first until the pool reaches it); a count in a
    cell of probability 0 gives p-value 0."""
    counts, probs = counts.double().cpu(), probs.double().cpu()
    n = float(counts.sum())
    if bool(((probs <= 0) & (counts > 0)).any()):
        return float("inf"), 0, 0.0, int((probs > 0).sum())
    keep = probs > 0
    expected, observed = probs[keep] * n, counts[keep]
    order = expected.argsort()
    expected, observed = expected[order], observed[order]
    # every cell below min_expected, and more (smallest first) until the pool reaches it
    small = int((expected < min_expected).sum())
    pooled = min(max(small, int((expected.cumsum(0) < min_expected).sum()) + 1), expected.numel())
    if small:
        expected = torch.cat([expected[:pooled].sum()[None], expected[pooled:]])
        observed = torch.cat([observed[:pooled].sum()[None], observed[pooled:]])
    df = expected.numel() - 1
    stat = float(((observed - expected) ** 2 / expected).sum())
    if df < 1:
        return stat, 0, 1.0, expected.numel()
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, df, p, expected.numel()


def continuation_counts(sequences, vocab: int, steps: int) -> torch.Tensor:
    """[V ** steps] long: how many sequences start with each continuation (all must have
    ``steps`` tokens: the test runs without stop tokens)."""
    ids = torch.tensor([s[:steps] for s in sequences], dtype=torch.long)
    if ids.shape[1] != steps:
        raise ValueError(f"every sample needs {steps} tokens, got {ids.shape[1]}")
    weights = vocab ** torch.arange(steps - 1, -1, -1)
    return torch.bincount((ids * weights).sum(dim=1), minlength=vocab ** steps)


def run(sampling, *, drafter: str = "model", strategy: str = "eqspec", fault: str | None = None,
        config: Config = Config(), hooks=(), engine: str | None = None,
        policy="fixed") -> Outcome:
    """Sample ``config.samples`` continuations with the speculative engine (``drafter``:
    "model" (the draft model), "ngram" or "none" (k = 0: plain sampling by the engine);
    ``fault``: a name of ``sampling_faults.FAULTS`` or None) and test them against the
    exact distribution. ``policy``: the draft-length policy (default "fixed": every step
    drafts k, so the acceptance path the known-bad faults break runs at every step)."""
    import specdec
    from .. import drafters
    from .sampling_faults import apply

    target, draft = models(config)
    make = {"model": lambda: drafters.ModelDrafter(draft), "ngram": drafters.NGramDrafter,
            "none": drafters.NGramDrafter}
    if drafter not in make:
        raise ValueError(f"drafter must be one of {', '.join(make)}, got {drafter!r}")
    prompts = [list(config.prompt)] * config.samples
    t0 = time.perf_counter()
    with apply(fault):
        res = specdec.generate(target, prompts, drafter=make[drafter](), strategy=strategy,
                               k=0 if drafter == "none" else config.k,
                               batch_size=config.batch_size, max_new_tokens=config.new_tokens,
                               stop_token_ids=[], hooks=list(hooks), sampling=sampling,
                               policy=policy)
    seconds = time.perf_counter() - t0
    counts = continuation_counts(res.sequences, config.vocab, config.new_tokens)
    probs = exact_distribution(target, config.prompt, config.new_tokens, sampling)
    stat, df, p, cells = chi_square(counts, probs)
    return Outcome(engine or fault or f"rejection:{strategy}", sampling.as_dict(), drafter,
                   strategy, config.samples, cells, stat, df, p, res.stats.acceptance, seconds)
