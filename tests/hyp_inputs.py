"""Hypothesis strategies for the adversarial property suite: one per kind of adversarial
input, and ``cases()`` composing them into a whole workload (``Case``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import strategies as st

# One strategy per kind of adversarial input; ``cases()`` composes them. Shrinking goes
# toward few rows (the row count is drawn first, from 1), few steps (small budgets, short
# patterns) and short prompts.

PATTERN_KINDS = ("all_zero", "all_max", "one_lagging", "alternating", "staircase", "random")


def shape_pattern(kind: str, row: int, rows: int, k: int, steps: int, drawn: list) -> list:
    """Row ``row``'s accepted count per step under pattern ``kind`` (``drawn``: the row's own
    random counts, used by "random" and to pick the lagging row)."""
    if kind == "all_zero":
        return [0] * steps
    if kind == "all_max":
        return [k] * steps
    if kind == "one_lagging":
        return [0 if row == 0 else k] * steps  # row 0 lags (shrinking keeps it first)
    if kind == "alternating":
        return [(k if (row + s) % 2 else 0) for s in range(steps)]
    if kind == "staircase":
        return [min(k, (row + s) % (k + 1)) for s in range(steps)]
    return [min(a, k) for a in drawn]


@st.composite
def acceptance_patterns(draw, rows: int, k: int, steps: int):
    """Per row, per step, the accepted count in [0, k] an engine must produce."""
    kind = draw(st.sampled_from(PATTERN_KINDS))
    drawn = [draw(st.lists(st.integers(0, k), min_size=1, max_size=steps)) for _ in range(rows)]
    return [shape_pattern(kind, r, rows, k, steps, drawn[r]) for r in range(rows)]


#: per-row draft-length patterns (k_b per request and step; ``specdec.policy.ForcedPolicy``)
LENGTH_KINDS = ("all_k", "all_zero", "one_drafting", "alternating", "staircase", "random")


def shape_lengths(kind: str, row: int, k: int, steps: int, drawn: list) -> list:
    """Row ``row``'s draft length k_b per step under pattern ``kind`` (``drawn``: the row's
    own random lengths, used by "random")."""
    if kind == "all_k":
        return [k] * steps  # every row drafts k: the fixed policy's steps
    if kind == "all_zero":
        return [0] * steps  # no row drafts: plain decode steps of width 1
    if kind == "one_drafting":
        return [k if row == 0 else 0] * steps  # one row sets the width, the rest ride along
    if kind == "alternating":
        return [(k if (row + s) % 2 else 0) for s in range(steps)]
    if kind == "staircase":
        return [min(k, (row + s) % (k + 1)) for s in range(steps)]
    return [min(x, k) for x in drawn]


@st.composite
def draft_lengths(draw, rows: int, k: int, steps: int):
    """Per row, per step, the draft length k_b in [0, k] the policy must use."""
    kind = draw(st.sampled_from(LENGTH_KINDS))
    drawn = [draw(st.lists(st.integers(0, k), min_size=1, max_size=steps)) for _ in range(rows)]
    return [shape_lengths(kind, r, k, steps, drawn[r]) for r in range(rows)]


def prompt_length(context: int, budget: int, shortest: int = 1):
    """A prompt length from ``shortest`` tokens to near the context limit (prompt + budget
    <= context), mostly short so that batches mix short and long rows."""
    return st.one_of(st.integers(shortest, shortest + 11), st.integers(shortest, context - budget))


def stop_placements(rows: int, budget: int):
    """None, or (row, offset): the reference token of that row at that offset becomes a stop
    token (so the row, and any row that meets the same id, stops there)."""
    return st.one_of(st.none(), st.tuples(st.integers(0, rows - 1), st.integers(0, budget - 1)))


def samplings(modes=("coupled",)):
    """A sampling configuration: any 64-bit seed, temperature 0.1 to 1.5, top-k from none
    to 1 (greedy-like) and top-p from none to 0.3 (shrinking toward no cut)."""
    from specdec import Sampling

    return st.builds(Sampling, temperature=st.floats(0.1, 1.5),
                     top_k=st.sampled_from((0, 1, 3, 20)),
                     top_p=st.one_of(st.just(1.0), st.floats(0.3, 1.0)),
                     seed=st.integers(0, 2**64 - 1), mode=st.sampled_from(modes))


@dataclass
class Case:
    """One adversarial workload (``sampling``: None for greedy decoding)."""

    family: str
    lengths: list
    budget: int
    k: int
    batch_size: int
    pattern: list
    stop: tuple | None
    seed: int = 0
    note: dict = field(default_factory=dict)
    strategy: str = "eqspec"
    # per row, per step: the draft length k_b (ForcedPolicy); None: every row drafts k
    draft_lengths: list | None = None
    vocab: int | None = None  # prompt ids are drawn below it (None: the tiny vocabulary)
    sampling: object = None

    @property
    def rows(self) -> int:
        return len(self.lengths)


@st.composite
def cases(draw, families=("llama", "qwen3", "glm4", "gpt2", "mistral", "gemma3"),
          max_rows: int = 16, max_budget: int = 12, context: int = 256, ks=(1, 2, 3, 4, 8),
          strategies=None, shortest: int = 1, vocab: int | None = None, sampled: bool = False):
    """A whole workload. Rows are drawn as one list of (prompt length, own accepted counts,
    own draft lengths) so that shrinking deletes whole rows; the pattern kinds shape every
    row's counts and lengths. ``shortest``: the shortest prompt (past a sliding window, for
    instance); ``vocab``: prompt ids are drawn below it (default: the tiny models' vocabulary);
    ``sampled``: greedy or coupled sampling (``samplings``), shrinking toward greedy."""
    family = draw(st.sampled_from(families))
    k = draw(st.sampled_from(ks))
    budget = draw(st.integers(1, max_budget))
    kind = draw(st.sampled_from(PATTERN_KINDS))
    length_kind = draw(st.sampled_from(LENGTH_KINDS))
    row = st.tuples(prompt_length(context, budget, shortest),
                    st.lists(st.integers(0, k), min_size=1, max_size=budget),
                    st.lists(st.integers(0, k), min_size=1, max_size=budget))
    drawn = draw(st.lists(row, min_size=1, max_size=max_rows))
    rows = len(drawn)
    lengths = [length for length, _, _ in drawn]
    pattern = [shape_pattern(kind, r, rows, k, budget, counts) for r, (_, counts, _) in enumerate(drawn)]
    kbs = [shape_lengths(length_kind, r, k, budget, own) for r, (_, _, own) in enumerate(drawn)]
    # drawn independently of the row count (then capped) so that deleting a row while
    # shrinking never invalidates the batch size
    batch_size = min(draw(st.integers(1, max_rows)), rows)
    stop = draw(stop_placements(rows, budget))
    seed = draw(st.integers(0, 3))
    if strategies is None:  # every registered strategy
        from specdec.strategies import names

        strategies = names()
    strategy = draw(st.sampled_from(strategies))
    sampling = draw(st.one_of(st.none(), samplings())) if sampled else None
    return Case(family, lengths, budget, k, batch_size, pattern, stop, seed,
                note={"kind": kind, "lengths": length_kind}, strategy=strategy, draft_lengths=kbs,
                vocab=vocab, sampling=sampling)
