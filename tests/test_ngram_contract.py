"""The n-gram drafter's contract (issue 13, point 6), one property per test.

``NGramDrafter.propose(batch, k)`` promises, for every row on its own:

- the longest match wins: the drafts continue a match of the row's suffix that is as long
  as any (up to ``max_n``); a shorter match never overrides it, wherever it lies;
- exactly the drafted count: ``[B, k]`` drafts for every ``k`` (0 included, and more than
  the row holds: a match's continuation repeats periodically), and the first ``k_b`` of
  them are the row's drafts at ``k = k_b``: a row with its own draft length (per-row
  ``k_b``, the policy's) gets exactly the drafts it would get alone at that length;
- no token comes from another row: rows over disjoint vocabularies draft only their own
  tokens, and each row drafts what it drafts alone (batch-1).

The mutant ``ngram_shorter_match_wins`` (``specdec.mutants.FAULTS``: the latest match
continues even when it is shorter) keeps every output exact (the target verifies every
draft), so no Monitor rule can see it: a draft may be any proposal. These tests are what
catches it (``test_the_shorter_match_mutant_is_caught_by_the_contract``).
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from specdec import drafters, mutants
from specdec.batch import RaggedBatch, left_pad
from specdec.cache import SlabCache

torch.set_num_threads(1)

#: token ranges of a planted row: pattern, continuations, filler (pairwise disjoint)
PATTERN, FIRST, LATER, FILLER = range(10, 20), 20, 21, range(30, 36)


def batch_of(rows: list[list[int]]) -> RaggedBatch:
    """The rows right-aligned in a batch, as the engine hands it to a drafter."""
    tokens, valid, positions, lengths = left_pad(rows)
    b = len(rows)
    z = torch.zeros(b, dtype=torch.long)
    return RaggedBatch(tokens=tokens, valid=valid, positions=positions, lengths=lengths,
                       prompt_lengths=lengths.clone(), budgets=z + 64, generated=z.clone(),
                       finished=torch.zeros(b, dtype=torch.bool), row_ids=torch.arange(b),
                       output=torch.zeros(b, 64, dtype=torch.long), target_cache=SlabCache(1, 1))


def match_lengths(row: list[int], max_n: int) -> dict[int, int]:
    """For each slot s >= 1 of the row: how many tokens before s equal the row's last ones
    (up to ``max_n``), stated directly."""
    w, out = len(row), {}
    for s in range(1, w):
        n = 0
        while n < max_n and s - 1 - n >= 0 and row[s - 1 - n] == row[w - 1 - n]:
            n += 1
        out[s] = n
    return out


# -- inputs: one strategy per kind of row ----------------------------------------------------

@st.composite
def planted_rows(draw):
    """A row whose suffix (a pattern of distinct tokens, at least 2 long) occurred once
    early, followed by ``FIRST``; its last token alone occurred later, followed by
    ``LATER``: the longest match and a later, shorter one continue differently."""
    size = draw(st.integers(2, 5))
    pattern = draw(st.permutations(list(PATTERN)))[:size]
    fill = st.lists(st.sampled_from(list(FILLER)), max_size=4)
    a, b, c = draw(fill), draw(fill), draw(fill)
    return a + pattern + [FIRST] + b + [pattern[-1], LATER] + c + pattern


rows_any = st.lists(st.integers(3, 7), min_size=1, max_size=20)


@st.composite
def disjoint_batches(draw):
    """2-5 rows of different lengths, row b over its own vocabulary [100 b, 100 b + 4)."""
    count = draw(st.integers(2, 5))
    return [[100 * (b + 1) + t for t in draw(st.lists(st.integers(0, 3), min_size=1, max_size=16))]
            for b in range(count)]


# -- the properties, as checks that name what broke -------------------------------------------

def longest_match_failures(rows: list[list[int]], max_n: int = 8) -> list[str]:
    """Rows whose drafts continue a match shorter than the longest (or none at all)."""
    drafter = drafters.NGramDrafter(max_n=max_n)
    tokens, valid = batch_of(rows).contiguous_tokens()
    drafts, length, _ = drafter.lookup(tokens, valid, 1)
    bad = []
    for b, row in enumerate(rows):
        lens = match_lengths(row, max_n)
        longest = max(lens.values(), default=0)
        if int(length[b]) != longest:
            bad.append(f"row {b}: match length {int(length[b])}, the longest is {longest}")
        elif longest and int(drafts[b, 0]) not in {row[s] for s, n in lens.items() if n == longest}:
            bad.append(f"row {b}: first draft {int(drafts[b, 0])} follows no match of the "
                       f"longest length {longest} in {row}")
    return bad


@settings(max_examples=60, deadline=None)
@given(planted_rows())
def test_the_longest_match_wins_over_a_later_shorter_one(row):
    assert longest_match_failures([row]) == []
    drafts = drafters.NGramDrafter().propose(batch_of([row]), 1)
    assert drafts.tolist() == [[FIRST]]


@settings(max_examples=60, deadline=None)
@given(st.lists(rows_any, min_size=1, max_size=5), st.integers(1, 5))
def test_the_longest_match_wins_on_any_row(rows, max_n):
    assert longest_match_failures(rows, max_n) == []


def test_the_shorter_match_mutant_is_caught_by_the_contract():
    """The fault of issue 13 (a shorter match overrides the longest) breaks the property
    above: hypothesis finds, and shrinks, a planted row where it does."""
    search = settings(max_examples=60, derandomize=True, database=None, deadline=None,
                      suppress_health_check=list(HealthCheck))
    with mutants.apply("ngram_shorter_match_wins"):
        row = find(planted_rows(), lambda r: bool(longest_match_failures([r])), settings=search)
        print("shrunk:", row, longest_match_failures([row]))
        assert drafters.NGramDrafter().propose(batch_of([row]), 1).tolist() == [[LATER]]
    assert longest_match_failures([row]) == []


@settings(max_examples=60, deadline=None)
@given(st.lists(rows_any, min_size=1, max_size=5), st.integers(0, 3), st.data())
def test_exactly_the_drafted_count_per_row(rows, extra, data):
    """Shape [B, k] for every k up to past the longest row, and each row's first k_b
    drafts are its drafts at k = k_b (per-row draft lengths take a prefix)."""
    batch = batch_of(rows)
    drafter = drafters.NGramDrafter()
    top = batch.width + extra
    full = drafter.propose(batch, top)
    assert full.shape == (len(rows), top) and full.dtype == torch.long
    lengths = data.draw(st.lists(st.integers(0, top), min_size=len(rows), max_size=len(rows)))
    for b, kb in enumerate(lengths):
        alone = drafter.propose(batch, kb)
        assert alone.shape == (len(rows), kb)
        assert alone[b].tolist() == full[b, :kb].tolist(), (b, kb)


@settings(max_examples=60, deadline=None)
@given(disjoint_batches(), st.integers(1, 12))
def test_no_token_comes_from_another_row(rows, k):
    """Every draft of row b lies in row b's own vocabulary, and equals its batch-1 drafts."""
    drafter = drafters.NGramDrafter()
    drafts = drafter.propose(batch_of(rows), k)
    for b, row in enumerate(rows):
        own = set(range(100 * (b + 1), 100 * (b + 1) + 4))
        assert set(drafts[b].tolist()) <= own, (b, row, drafts[b].tolist())
        assert drafts[b].tolist() == drafter.propose(batch_of([row]), k)[0].tolist()
