"""Single-point mutations of the index math in ``specdec.layout``.

Each mutant is one plausible bug of batched speculative decoding, applied by replacing one
function of ``specdec.layout`` for the duration of a ``with`` block::

    with mutants.apply("positions_from_slot"):
        specdec.generate(...)      # the engine now runs the mutated formula
        proofs.run(...)            # and the proofs check the mutated formula

The engine, the strategies and ``proofs/`` call layout functions through the module
(``layout.slot_position(...)``), so the patch reaches all of them; the original functions
are restored on exit, also when the block raises. Used by ``python -m proofs --mutant``,
by ``tests/test_proofs.py`` (every mutant must yield a z3 counterexample) and by the
property-test suite (every mutant must be caught by the invariant checker).

A mutant is written as a wrapper around the original function, so it stays a single
point of difference from the real layout.

``FAULTS``: single-point faults outside the index math (the n-gram drafter, the engine's
bookkeeping, ...), applied the same way to one function of another ``specdec`` module
(``Mutant.module``). No proof obligation covers them (``NAMES``, ``names`` and
``proved_in`` list the index-math mutants only); ``Mutant.caught_by`` names what catches
each. The KV faults (``cache_gather_shifted``, ``row_drop_reversed``, ``exspec_pool_late``,
``exspec_draft_pool_late``, ``draft_cache_lag_off_by_one``) keep every width, mask and
position right and move the wrong K/V: KV provenance (``invariants/provenance.py``)
catches them in fast and strict mode. A module that imported the function by name
(``from ..phases import sync``) is patched too: every loaded ``specdec`` module whose
attribute of that name is the original.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from dataclasses import dataclass
from typing import Callable, Iterator

from . import layout


@dataclass(frozen=True)
class Mutant:
    name: str
    target: str      # the layout function it replaces
    description: str
    make: Callable[[Callable], Callable]  # original function -> mutated function
    invariants: tuple  # the invariants it breaks (what a checker should report)
    # the realignment strategy whose engine runs (and whose proofs, proofs.registry group)
    # the mutated function: "eqspec" for the contiguous-profile math, "holes" for the
    # hole profile and compaction
    strategy: str = "eqspec"
    # the proofs.registry group whose obligations the mutated function breaks, when it is
    # not the strategy's own (``draft_limit`` is proved in "acceptance")
    proofs: str | None = None
    # the specdec module holding ``target`` ("layout" for the index math)
    module: str = "layout"
    # what catches a fault outside the index math (tests, rules); "" for the catalogue
    caught_by: str = ""

    @property
    def proof_group(self) -> str:
        return self.proofs or self.strategy


def _padding_plus_one(orig):
    def new_padding(new_width, n_new):
        return orig(new_width, n_new) + 1
    return new_padding


def _padding_minus_one(orig):
    def new_padding(new_width, n_new):
        return orig(new_width, n_new) - 1
    return new_padding


def _positions_from_slot(orig):
    def slot_position(ops, j, pad):
        return orig(ops, j, 0 * pad)  # position = slot index, ignoring the padding
    return slot_position


def _crop_to_batch_min(orig):
    def cache_source_shift(ops, old_width, new_width, committed):
        # every row crops its cache as if it had committed the batch minimum
        return orig(ops, old_width, new_width, ops.amin(committed, dim=0, keepdim=True))
    return cache_source_shift


def _mask_not_refreshed(orig):
    def realign_plan(ops, j, n, committed, old_width, new_width, k):
        plan = orig(ops, j, n, committed, old_width, new_width, k)
        # valid computed from the padding the row had before this step
        return plan._replace(valid=layout.slot_valid(j, layout.new_padding(old_width, n)))
    return realign_plan


def _source_off_by_one(orig):
    def source_slot(ops, j, pad_new, shift, ext_width):
        return orig(ops, j, pad_new, shift + 1, ext_width)
    return source_slot


def _compact_dest_off_by_one(orig):
    def compact_dest_slot(ops, valid, pos, pad_new, trash):
        # valid slots land one slot to the right: the pending token reaches the trash
        # column and slot pad' receives nothing
        return ops.where(valid, orig(ops, valid, pos, pad_new, trash) + 1, trash + 0 * pos)
    return compact_dest_slot


def _holes_keeps_first_rejected(orig):
    def holes_slot_valid(i, k, committed):
        # the first rejected draft d_m (extended index m - 1) stays valid too
        return orig(i, k, committed) | (i == committed - 1)
    return holes_slot_valid


def _holes_pending_position_plus_one(orig):
    def holes_slot_position(ops, i, k, n, committed):
        # the new pending token gets position n' instead of n' - 1
        return orig(ops, i, k, n, committed) + ops.where(i == k, 1 + 0 * i, 0 * i)
    return holes_slot_position


def _draft_limit_unclipped(orig):
    def draft_limit(ops, k, remaining):
        # clamp(remaining, 0, k): a row with r <= k tokens left may draft r, so its last
        # budgeted token can be a draft
        return orig(ops, k, remaining + 1)
    return draft_limit


CATALOGUE: dict[str, Mutant] = {m.name: m for m in (
    Mutant("padding_off_by_one", "new_padding",
           "new left padding is one slot too many (W' - n_new + 1): a real token is masked",
           _padding_plus_one, ("I2", "I3", "I7")),
    Mutant("padding_off_by_minus_one", "new_padding",
           "new left padding is one slot too few (W' - n_new - 1): a padding slot is attended",
           _padding_minus_one, ("I2", "I3", "I7")),
    Mutant("positions_from_slot", "slot_position",
           "position id = slot index j instead of j - pad (ignores left padding)",
           _positions_from_slot, ("I3", "I7")),
    Mutant("crop_to_batch_min", "cache_source_shift",
           "every row's cache keeps the batch-minimum of committed tokens (one crop for all)",
           _crop_to_batch_min, ("I5", "I7")),
    Mutant("mask_not_refreshed", "realign_plan",
           "valid after realignment computed from the old padding W - n, not W' - n_new",
           _mask_not_refreshed, ("I2", "I4", "I7")),
    Mutant("source_off_by_one", "source_slot",
           "every gather reads the extended slot one to the right (j + shift + 1)",
           _source_off_by_one, ("I6", "I5", "I7")),
    Mutant("compact_dest_off_by_one", "compact_dest_slot",
           "compaction sends each valid slot to pad' + position + 1 (the pending token is dropped)",
           _compact_dest_off_by_one, ("I6", "I5", "I7"), strategy="holes"),
    Mutant("holes_keeps_first_rejected", "holes_slot_valid",
           "after a holes step the first rejected draft stays valid (a kept token never committed)",
           _holes_keeps_first_rejected, ("I3", "I6", "I7"), strategy="holes"),
    Mutant("holes_pending_position_plus_one", "holes_slot_position",
           "after a holes step the new pending token gets position n' (a gap before it)",
           _holes_pending_position_plus_one, ("I3", "I7"), strategy="holes"),
    Mutant("draft_limit_unclipped", "draft_limit",
           "drafts clipped to clamp(remaining, 0, k) instead of min(k, remaining - 1)",
           _draft_limit_unclipped, ("I6",), proofs="acceptance"),
)}

NAMES = tuple(CATALOGUE)


def _latest_match_wins(orig):
    def longest_match(length):
        # every match ranks as long as any other: the latest wins, even a shorter one
        _, best = orig((length > 0).long())
        return length.gather(1, best[:, None])[:, 0], best
    return longest_match


def _accepted_from_committed(orig):
    def sync(ctx, state, batch, spec):
        before = state.stats.accepted
        host = orig(ctx, state, batch, spec)
        # accepted counted as the sum of (committed - 1): wrong wherever a stop token cut
        # a row's commit (this extra host read is the mutant's, not the engine's)
        state.stats.accepted = before + int((spec.committed - 1).sum())
        return host
    return sync


def _pool_written_late(store: str):
    """A mutant of EXSPEC's ``write_back``: pool ``store`` ("kv", the target's; "draft_kv",
    the draft model's) receives the step's new KV one slot after its position."""
    def make(orig):
        def write_back(ctx, state, pool, *rest):  # rest: rows, R, batch, spec, host
            kv = getattr(pool, store)
            if kv is None:
                return orig(ctx, state, pool, *rest)
            real = kv.write_back
            kv.write_back = lambda r, cache, first, dest: real(r, cache, first, dest + 1)
            try:
                return orig(ctx, state, pool, *rest)
            finally:
                del kv.write_back
        return write_back
    return make


#: the draft model's new KV lands one pool slot after its position (the target's pool is
#: right): the next steps' drafts attend a shifted cache
_draft_pool_one_slot_late = _pool_written_late("draft_kv")
#: the target's new KV lands one pool slot after its position
_pool_one_slot_late = _pool_written_late("kv")


def _gather_one_slot_right(orig):
    def _gather(kv, src, out):
        # every cache gather reads the slot one to the right of its plan (the last slot
        # reads itself): tokens, valid and positions stay right, the K/V do not
        return orig(kv, (src + 1).clamp(max=kv.shape[4] - 1), out)
    return _gather


def _drop_copies_backwards(orig):
    def rows_leaving(finished, finished_host):
        plan = orig(finished, finished_host)
        if plan is None:
            return None
        # the caches copy the finished rows onto the staying ones instead of the reverse
        # (the row tensors follow ``order``, which stays right)
        return type(plan)(plan.order, plan.moved_from, plan.moved_to)
    return rows_leaving


def _draft_realigned_one_slot_off(orig):
    def realign(batch, predictions, committed, leaving, new_width, k, identity=False):
        draft = batch.draft_cache
        if draft is None:
            return orig(batch, predictions, committed, leaving, new_width, k, identity)
        real = draft.gather_slots
        # the drafter's cache is gathered as if it lagged the target's by one more slot:
        # every source slot one to the left (widths stay right)
        draft.gather_slots = lambda src: real((src - 1).clamp(min=0))
        try:
            return orig(batch, predictions, committed, leaving, new_width, k, identity)
        finally:
            del draft.gather_slots
    return realign


def _holes_flag_inverted(orig):
    def positions_matter(holes, window):
        # the holes flag read backwards: a batch with holes gets the model's own mask over
        # slots (its window then counts holes), one without gets position masks (harmless)
        return orig(not holes, window)
    return positions_matter


FAULTS: dict[str, Mutant] = {m.name: m for m in (
    Mutant("ngram_shorter_match_wins", "longest_match",
           "the n-gram drafter continues the latest match even when a longer one exists",
           _latest_match_wins, (), strategy="eqspec", module="drafters",
           caught_by="the n-gram drafter's contract tests (tests/test_ngram_contract.py); "
                     "no Monitor rule: drafts are any proposal, outputs stay exact"),
    Mutant("stats_accepted_from_committed", "sync",
           "Stats.accepted grows by the sum of (committed - 1) per step, not of accepted",
           _accepted_from_committed, ("I6",), module="phases",
           caught_by="Monitor.check_stats (I6.stats) once a stop token cut a commit; "
                     "benchmarks/throughput.py refuses to print its figures"),
    Mutant("exspec_draft_pool_late", "write_back",
           "EXSPEC writes the draft model's new KV back into its pool one slot late",
           _draft_pool_one_slot_late, ("I5",), strategy="exspec", module="strategies.exspec",
           caught_by="KV provenance of the draft cache (I5.provenance, fast and strict "
                     "Monitor); a drafter equal to the target must accept every draft "
                     "(tests/test_self_draft.py); outputs stay exact"),
    Mutant("cache_gather_shifted", "_gather",
           "every KV cache gather (realignment, compaction, pool load) reads one slot to the "
           "right of its plan; tokens, masks, positions and widths stay right",
           _gather_one_slot_right, ("I5", "I7"), strategy="eqspec", module="cache",
           caught_by="KV provenance (I5.provenance, fast and strict Monitor) at the next "
                     "verify view, before the cache is used again; deep I5 and I7"),
    Mutant("row_drop_reversed", "rows_leaving",
           "when rows finish, the caches copy the finished rows onto the staying rows that "
           "should fill their places (the wrong direction); the row tensors stay right",
           _drop_copies_backwards, ("I5", "I7"), strategy="eqspec", module="batch",
           caught_by="KV provenance (I5.provenance, fast and strict Monitor) at the verify "
                     "view after a row drop; deep I5 and I7"),
    Mutant("exspec_pool_late", "write_back",
           "EXSPEC writes the target's new KV back into its pool one slot late",
           _pool_one_slot_late, ("I5", "I7"), strategy="exspec", module="strategies.exspec",
           caught_by="KV provenance (I5.provenance, fast and strict Monitor) at the verify "
                     "view after the pool load; deep I5 and I7"),
    Mutant("draft_cache_lag_off_by_one", "realign",
           "EQSPEC realigns the drafter's cache as if it lagged the target's by one slot more "
           "than it does (its gather one slot to the left); widths stay right",
           _draft_realigned_one_slot_off, ("I5",), strategy="eqspec",
           module="strategies.eqspec",
           caught_by="KV provenance of the draft cache (I5.provenance, fast and strict "
                     "Monitor); a drafter equal to the target must accept every draft"),
    Mutant("holes_flag_inverted", "positions_matter",
           "the holes flag inverted where a forward's mask is chosen: a batch with holes on a "
           "sliding-window model gets a window over slots, not positions (only sliding-window "
           "models are affected)",
           _holes_flag_inverted, ("I4", "I7"), strategy="holes", module="cache",
           caught_by="the Monitor's I4.window (strict: at the verify forward; fast: at "
                     "check()), tests/test_invariants_window.py"),
)}

#: every name ``apply`` takes
ALL: dict[str, Mutant] = {**CATALOGUE, **FAULTS}


def names(strategy: str) -> tuple:
    """The mutants of one strategy's index math (``Mutant.strategy``)."""
    return tuple(n for n, m in CATALOGUE.items() if m.strategy == strategy)


def proved_in(group: str) -> tuple:
    """The mutants whose counterexamples come from one proof group (``Mutant.proof_group``)."""
    return tuple(n for n, m in CATALOGUE.items() if m.proof_group == group)


@contextlib.contextmanager
def apply(name: str) -> Iterator[Mutant]:
    """Replace one function of a ``specdec`` module (``specdec.layout`` for the index-math
    catalogue) by its mutant inside the block; modules that imported it by name too."""
    if name not in ALL:
        raise ValueError(f"unknown mutant {name!r}; the catalogue has: {', '.join(ALL)}")
    mutant = ALL[name]
    home = importlib.import_module(f"{__package__}.{mutant.module}")
    orig = getattr(home, mutant.target)
    new = mutant.make(orig)
    bound = [m for n, m in list(sys.modules.items())
             if m is not None and (n == __package__ or n.startswith(__package__ + "."))
             and getattr(m, mutant.target, None) is orig]
    for m in bound:
        setattr(m, mutant.target, new)
    try:
        yield mutant
    finally:
        for m in bound:
            setattr(m, mutant.target, orig)
