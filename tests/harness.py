"""Running workloads on the engine: seeded prompts, the tiny targets, a ``Case`` run with a
forcing drafter under a recording Monitor (``run_case`` -> ``Outcome``), the properties an
outcome must keep (``outcome_failures``), and the drafters of the equivalence grids."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from hyp_inputs import Case
from oracle import cut_at_stop, free_reference

#: prompt lengths mixed in one batch: from 1 token to 60
MIXED_LENGTHS = (1, 60, 7, 33, 2, 18, 45, 12)


def random_prompts(lengths, vocab: int, seed: int = 0, low: int = 3) -> list[list[int]]:
    """Seeded random prompts of the given lengths, ids in [low, vocab)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab, (n,), generator=g).tolist() for n in lengths]


_MODELS: dict = {}


def tiny_target(family: str):
    if family not in _MODELS:
        from specdec import models

        _MODELS[family] = models.tiny(family)
    return _MODELS[family]


def case_prompts(case: Case) -> list[list[int]]:
    from specdec import models

    return random_prompts(case.lengths, case.vocab or models.TINY_VOCAB, seed=case.seed)


@dataclass
class Outcome:
    sequences: list
    reference: list
    forced: list  # per step: [B] forced accepted counts (before the draft limit)
    commits: list  # per step: (row_ids, draft_limit, accepted, committed) host lists
    violations: list
    k: int
    budget: int
    stops: list
    # per step: [B] the rows' draft lengths k_b, the step's drafts (verify width - 1), and
    # [B] the rows' remaining budgets before the commit
    draft_lengths: list = None
    widths: list = None
    remaining: list = None

    def steps(self) -> int:
        """Verify steps run (over all batches)."""
        return len(self.commits)

    def divergence_step(self) -> int | None:
        """1-based step (over all batches) that committed the first wrong token, if any."""
        first = None
        for row_id, (got, want) in enumerate(zip(self.sequences, self.reference)):
            if got == want:
                continue
            j = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            total = 0
            for step, (rows, _, _, committed) in enumerate(self.commits, start=1):
                if row_id in rows:
                    total += committed[rows.index(row_id)]
                    if total > j:
                        first = step if first is None else min(first, step)
                        break
        return first

    def steps_to_failure(self) -> int:
        """Steps up to the first violation or the first wrong token (all steps when none)."""
        marks = [s for s in (self.divergence_step(),) if s is not None]
        if self.violations:
            marks.append(self.violations[0].step + 1)
        return min(marks) if marks else self.steps()


class CommitRecorder:
    def __init__(self):
        self.commits = []
        self.widths = []
        self.remaining = []

    def __call__(self, phase, view):
        if phase == "commit":
            self.commits.append((view.row_ids.tolist(), view.draft_limit.tolist(),
                                 view.accepted.tolist(), view.committed.tolist()))
            self.widths.append(view.drafts.shape[1])
            before = view.generated_before if view.generated_before is not None \
                else view.generated - view.committed
            self.remaining.append((view.budgets - before).tolist())


def run_case(case: Case, *, strategy: str | None = None, known_bad=None, mutant=None, target=None,
             raise_on_violation: bool = False, mode: str = "strict") -> Outcome:
    """Run ``case`` with a ForcingDrafter under a Monitor in ``mode`` (strict by default;
    recording by default);
    with ``case.sampling`` (coupled) the reference and the forced drafts are those of plain
    coupled sampling.

    ``mutant`` (a name of specdec.mutants; default: the drill's ``$SPECDEC_MUTANT``,
    tests/campaign.py) applies to the engine run only: the reference is always computed
    with the real layout (reference decoding shares left_pad's math).
    """
    import contextlib

    import invariants
    import specdec
    from campaign import planted_mutant
    from specdec import drafters, models, mutants

    mutant = mutant or planted_mutant()
    target = target if target is not None else tiny_target(case.family)
    prompts = case_prompts(case)
    free = free_reference(target, prompts, case.budget,
                          key=(id(target), tuple(case.lengths), case.budget, case.seed, case.sampling),
                          sampling=case.sampling)
    stops = models.stop_token_ids(target)
    if case.stop is not None:
        row, off = case.stop
        off = min(off, len(free[row]) - 1)
        stops = [free[row][off]]
    ref = cut_at_stop(free, set(stops))
    drafter = drafters.ForcingDrafter(free, case.pattern, models.vocab_size(target))
    forced = []
    orig = drafter.propose

    def propose(batch, k):
        forced.append(drafter.forced(batch, k).tolist())
        return orig(batch, k)

    drafter.propose = propose
    policy, kbs = forced_policy(case)
    mon = invariants.Monitor(mode=mode, raise_on_violation=raise_on_violation)
    rec = CommitRecorder()
    strategy = strategy or case.strategy
    with mutants.apply(mutant) if mutant else contextlib.nullcontext():
        seqs = _run_engine(case, target, prompts, drafter, stops, strategy, known_bad, [mon, rec],
                           policy)
    violations = mon.check()
    return Outcome(seqs, ref, forced, rec.commits, violations, case.k, case.budget, stops,
                   kbs, rec.widths, rec.remaining)


#: ``run_case(known_bad=NAIVE)``: the known-bad engines' shared loop without a defect
NAIVE = "naive"


def forced_policy(case: Case):
    """A ForcedPolicy with the case's draft lengths (every row k when it has none), and
    the list its ``lengths`` calls append each step's [B] k_b to."""
    from specdec.policy import ForcedPolicy

    pattern = case.draft_lengths or [[case.k]] * case.rows
    policy = ForcedPolicy(pattern)
    kbs: list = []
    orig = policy.lengths

    def lengths(batch, k_step):
        out = orig(batch, k_step)
        kbs.append(out.tolist())
        return out

    policy.lengths = lengths
    return policy, kbs


def _run_engine(case, target, prompts, drafter, stops, strategy, known_bad, hooks, policy):
    import specdec

    if known_bad is None:
        return specdec.generate(target, prompts, drafter=drafter, strategy=strategy, k=case.k,
                                batch_size=case.batch_size, max_new_tokens=case.budget,
                                stop_token_ids=stops, hooks=hooks, policy=policy,
                                sampling=case.sampling).sequences
    from specdec.forensics.known_bad import generate_known_bad

    fault = None if known_bad == NAIVE else known_bad
    seqs, _ = generate_known_bad(fault, target, prompts, drafter=drafter, k=case.k,
                                 max_new_tokens=case.budget, stop_token_ids=stops, hooks=hooks,
                                 batch_size=case.batch_size)
    return seqs


def outcome_failures(o: Outcome) -> list[str]:
    """Every property an outcome breaks (empty: all hold)."""
    bad = []
    if o.violations:
        v = o.violations[0]
        bad.append(f"invariant {v.invariant} at step {v.step}, {v.phase}")
    if o.sequences != o.reference:
        bad.append("ids differ from the batch-1 reference")
    for (rows, limit, acc, com), forced in zip(o.commits, o.forced):
        for lim, a, c, f in zip(limit, acc, com, forced):
            if a != min(f, lim):
                bad.append(f"accepted {a} != forced min({f}, {lim})")
            if not 1 <= c <= o.k + 1:
                bad.append(f"committed {c} outside [1, k+1]")
    for kb, width, (rows, limit, _, com), rem in zip(o.draft_lengths or [], o.widths or [],
                                                      o.commits, o.remaining or []):
        if width != max(kb):
            bad.append(f"verify drafts {width} != max k_b {max(kb)}")
        for k_b, lim, c, r in zip(kb, limit, com, rem):
            if lim != max(0, min(k_b, r - 1)):
                bad.append(f"draft limit {lim} != min(k_b {k_b}, remaining {r} - 1)")
            if c > k_b + 1:
                bad.append(f"committed {c} > k_b {k_b} + 1")
    for s in o.sequences:
        if len(s) > o.budget:
            bad.append("budget exceeded")
        if any(t in o.stops for t in s[:-1]):
            bad.append("tokens after a stop token")
    return bad


def once_per_case(verdict):
    """``verdict(case)``, run once per case: a search's shrinker draws the same case again
    through different choices (measured: 30 distinct cases in 172 calls while shrinking
    ``source_off_by_one``), and an engine run is deterministic, so the first verdict is
    the verdict. Cases differing only in ``note`` (a label, read by no run) are one case."""
    verdicts: dict = {}

    def once(case):
        key = repr(replace(case, note={}) if isinstance(case, Case) else case)
        if key not in verdicts:
            verdicts[key] = verdict(case)
        return verdicts[key]

    return once


def corrupted(seqs, vocab: int, every: int = 3):
    """The reference with every ``every``-th token replaced: forces partial acceptance."""
    return [[(t + 1) % vocab if i % every == every - 1 else t for i, t in enumerate(s)]
            for s in seqs]


def make_drafter(kind: str, draft_model, ref, vocab: int):
    """The grid's drafter of ``kind``: ngram, model (``draft_model``) or scripted
    (the corrupted reference)."""
    from specdec import drafters

    if kind == "ngram":
        return drafters.NGramDrafter()
    if kind == "model":
        return drafters.ModelDrafter(draft_model)
    if kind == "scripted":
        return drafters.ScriptedDrafter(corrupted(ref, vocab))
    raise AssertionError(kind)
