"""The phases every strategy shares: prefill, then per step draft -> verify -> commit, the
step's one host sync, and handing finished rows back; hooks after each phase.

A strategy (``specdec/strategies/``) composes these functions into its loop; this module
imports neither the engine nor any strategy. Two objects travel through every call:

- ``Context``: the per-run constants (models, k, stop ids, hooks, the strategy's resolved
  options), fixed for the whole ``generate`` call (a frozen dataclass);
- ``State``: what changes during the run (steps done, the batch index, the layout profile
  the next views carry, the counters in ``Stats``, the strategy's extra view facts).

The verify phase's choice at each position is ``sampling.choose``: the argmax (greedy),
or when the run samples (``Context.sampling``) the coupled choice or rejection sampling's
choice; the commit is the same greedy acceptance over it in every case.

After each phase every hook is called as ``hook(phase, view)`` with a read-only
``invariants.StepView`` (``RaggedBatch.view``); nothing is built when there are no hooks.

Host synchronisation: one small transfer per step (``sync``: which rows finished, the
longest row, the committed counts, every row's draft length for its next step, whether
any draft lay outside the vocabulary: ``3B + 7`` integers, plus the ``B`` accepted counts
when hooks run), needed to size the next tensors; none inside draft, verify, commit or
the realignment gathers (issue #19: at most one host read per step, plus a constant per
call and per prefill; ``tests/test_step_reads.py`` counts them). It cannot be
deferred here: the next step's shapes (width, draft width) are host facts it carries.
The finished rows leave in ``retire`` and ``collect`` reads every output once per call.

Step costs on a GPU: the policy's step timings (``StepCost``) are host-clock intervals
(``perf_counter`` on CUDA, this process's CPU time on a CPU) from before a step's draft
to after its realignment; they time the GPU's draft, verify and commit kernels only
because the step's one read waits for them (the realignment's kernels land in the next
interval), so they add no synchronisation of their own. A loop that deferred the read
would time the host's enqueueing instead, and would need CUDA events read with it.

Draft lengths (``specdec/policy.py``): each step, row ``b`` drafts ``k_b`` tokens
(``0 <= k_b <= k``, the policy's ``lengths``), may use ``min(k_b, remaining - 1)`` of them
(``layout.draft_limit``, the views' ``draft_limit``), and the verify forward covers
``state.draft_k + 1`` tokens per row, ``state.draft_k = max k_b`` (``layout.draft_width``;
0: a plain decode step). The verify width is a host fact: right after the commit the
policy plans every row's next ``k_b`` on the device (``ctx.policy.plan``, in ``sync``),
the step's one read carries them, and the host takes the maximum over the rows of the
next step. The views' ``k`` is the step's ``draft_k``. The policy also gets the cost of
every step, from its draft to its realignment (``StepCost``, on ``ctx.clock``), to
calibrate what width costs.

Static shapes (``Context.static_shapes``, ``specdec/static.py``): the strategy sizes the
run's buffers and one target cache up front (``begin_static``); the verify width is 1 or
``k + 1`` (``next_draft_k``), and ``speculate`` writes the verify inputs into the buffers
(``verify_inputs``) and attends a bucketed key width; the views still see the ``C + q``
real mask columns (``static_record``).

Checks while decoding (``validation.py``): ``speculate`` checks each ``propose`` result
(type, dtype, device and shape at once; ids outside the vocabulary are clamped for the
verify forward and flagged on the device; ``sync`` reads the flag with the step's one read
and raises ``ValueError``, so such a step's output is never returned); ``emit`` refuses a
hook that writes to its view (``validation.HookWatch``, tensor version counters); when
every hook declares ``read_only`` (``validation.watched``, ``Context.watch_hooks``), only
in a run's first ``validation.WATCH_STEPS`` steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping, Sequence

import torch

from invariants.view import ForwardRecord, StepView

from . import acceptance, layout, sampling, static, validation
from .sampling import Sampling
from . import cache as cache_mod
from .batch import RaggedBatch, left_pad, rows_where
from .models import vocab_size
from .policy import FixedPolicy

PHASE_NAMES = ("prefill", "draft", "verify", "commit", "realign")

Hook = Callable[[str, StepView], None]
#: ``after_step(ctx, state, batch, spec, host) -> next batch``: a strategy's layout work
AfterStep = Callable[["Context", "State", RaggedBatch, "Spec", "HostStep"], RaggedBatch]
#: ``capacity(width, max_budget) -> cache slots`` of a batch whose prompts have ``width``
Capacity = Callable[[int, int], int]


@dataclass
class Stats:
    """Counters of one ``generate`` call."""

    steps: int = 0
    drafted: int = 0  # drafts rows could use (sum of draft limits)
    accepted: int = 0
    committed: int = 0
    # sum over steps and rows of the row's draft length k_b, and of rows per step
    planned: int = 0
    row_steps: int = 0
    # verify width (draft_k + 1) -> steps run at that width
    widths: dict = field(default_factory=dict)
    # wall seconds per phase, plus "checks": time spent inside hooks
    seconds: dict = field(default_factory=lambda: {p: 0.0 for p in PHASE_NAMES + ("checks",)})
    accepted_history: list = field(default_factory=list)  # per step: [B] accepted (host)
    # exspec: steps served by a group of equal-length rows (no realignment); else None
    grouped_steps: int | None = None
    # holes: compactions run (slack past the threshold or capacity); else None
    compactions: int | None = None
    # compile="cuda-graphs": {"captured", "replayed", "eager": {reason: n}, "failed"}
    # of the target's forwards (``specdec.graphs``); else None
    graphs: dict | None = None

    @property
    def acceptance(self) -> float:
        """Accepted / usable drafts (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.committed / self.steps if self.steps else 0.0

    @property
    def mean_draft_length(self) -> float:
        """Mean k_b over rows and steps (0 when no step ran)."""
        return self.planned / self.row_steps if self.row_steps else 0.0

    @property
    def group_rate(self) -> float | None:
        """Share of steps served without realignment (exspec only; None otherwise)."""
        if self.grouped_steps is None:
            return None
        return self.grouped_steps / self.steps if self.steps else 0.0

    def conservation(self, outputs) -> list[str]:
        """The rules these counters obey against the run's ``outputs`` (every request's
        generated ids) alone, one sentence per broken rule (empty: all hold). Every row of
        a step commits at least one token and at most its accepted drafts plus one, and
        uses at most its draft length: ``committed = total output length``,
        ``row_steps <= committed <= accepted + row_steps``, ``accepted <= drafted <=
        planned``, and the widths count every step. A fault that keeps these (``accepted``
        counted as the sum of ``committed - 1``) needs the views: ``Monitor.check_stats``."""
        total = sum(len(o) for o in outputs)
        rules = [
            (self.committed == total, f"committed = total output length: committed "
                                      f"{self.committed}, the outputs hold {total} tokens"),
            (self.row_steps <= self.committed, f"each row commits >= 1 token per step: committed "
                                               f"{self.committed} < row_steps {self.row_steps}"),
            (self.committed <= self.accepted + self.row_steps,
             f"each row commits <= accepted + 1 per step: committed {self.committed} > accepted "
             f"{self.accepted} + row_steps {self.row_steps}"),
            (0 <= self.accepted <= self.drafted, f"0 <= accepted <= drafted: accepted "
                                                 f"{self.accepted}, drafted {self.drafted}"),
            (self.drafted <= self.planned, f"drafted <= planned (a row uses at most its draft "
                                           f"length): drafted {self.drafted}, planned {self.planned}"),
            (sum(self.widths.values()) == self.steps,
             f"the widths count every step: {sum(self.widths.values())} counted, steps {self.steps}"),
        ]
        return [f"Stats: {text}" for ok, text in rules if not ok]

    def as_dict(self) -> dict:
        return {"steps": self.steps, "drafted": self.drafted, "accepted": self.accepted,
                "committed": self.committed, "acceptance": self.acceptance,
                "mean_draft_length": self.mean_draft_length, "widths": dict(self.widths),
                "group_rate": self.group_rate, "compactions": self.compactions,
                "graphs": self.graphs, "seconds": dict(self.seconds)}


@dataclass(frozen=True)
class Context:
    """The per-run constants of one ``generate`` call: nothing here changes during the run
    (what does is in ``State``)."""

    target: torch.nn.Module
    drafter: object
    k: int
    stop_ids: torch.Tensor  # [S] long
    hooks: Sequence[Hook]
    max_position: int
    stop_tuple: tuple = ()  # stop_ids on the host (views carry them without a sync)
    # the strategy's registry name (shown in every view's info)
    strategy: str = "eqspec"
    # the strategy's options after its own validation, defaults filled in (read-only)
    options: Mapping = field(default_factory=lambda: MappingProxyType({}))
    # sliding window of the target (None: full attention); holes need position masks
    target_window: int | None = None
    # the target's vocabulary size (every draft is checked against it); 0: the target's
    vocab: int = 0
    # how tokens are chosen (specdec.sampling.Sampling); None: greedy (the argmax)
    sampling: Sampling | None = None
    # the draft-length policy (specdec.policy; begun by generate); None: FixedPolicy
    policy: object = None
    # () -> seconds: the clock step costs are measured with for the policy (``step_clock``)
    clock: Callable[[], float] | None = None
    # static shapes for decode and verify (``specdec/static.py``): verify widths 1 or k + 1,
    # bucketed key widths, forward inputs written into the run's ``State.buffers``
    static_shapes: bool = False
    # whether ``emit`` watches the hooks for writes (``validation.watched``: derived from
    # ``hooks``, once per run)
    watch_hooks: bool = field(init=False, default=True)

    def __post_init__(self):
        object.__setattr__(self, "watch_hooks", validation.watched(self.hooks))
        if not self.vocab:
            object.__setattr__(self, "vocab", vocab_size(self.target))
        if self.policy is None:
            fixed = FixedPolicy()
            fixed.begin(self.k, 0, None)
            object.__setattr__(self, "policy", fixed)
        if self.clock is None:
            object.__setattr__(self, "clock", step_clock(next(self.target.parameters()).device))


def step_clock(device) -> Callable[[], float]:
    """The clock a step's cost is measured with (``observe``): on a CPU the process's CPU
    time (``time.process_time``: the work of the step, unmoved by other processes sharing
    the cores), elsewhere wall time (``time.perf_counter``: a GPU's work shows up as the
    host's wait for the step's read, which the interval includes)."""
    return time.process_time if torch.device(device).type == "cpu" else time.perf_counter


@dataclass
class State:
    """What changes during one ``generate`` call."""

    stats: Stats = field(default_factory=Stats)
    # verify steps run so far (the step number views carry)
    step: int = 0
    # which batch (or, for a pool, which admission) the views belong to; the Monitor
    # starts its per-batch history when it sees a prefill of a new batch_index
    batch_index: int = 0
    # the layout profile the next views carry (invariants.view.PROFILES)
    profile: str = "contiguous"
    # () -> dict of strategy facts added to every view's info (built only with hooks)
    info: Callable[[], dict] | None = None
    # drafts of the next verify step, max k_b over its rows (host; None: ctx.k). Set by
    # prefill and step, or by a strategy that picks the rows of a step itself
    draft_k: int | None = None
    # k_b of the rows the last prefill admitted, in its row order (host)
    admitted_lengths: list = field(default_factory=list)
    # static shapes: the run's forward input buffers (``static.Buffers``) and, for
    # strategies that decode batch after batch, the one target cache they all reuse
    buffers: static.Buffers | None = None
    cache: cache_mod.SlabCache | None = None
    # (batch, [B, 1, V] logits): a primed prefill computed the pending token of every row
    # of ``batch`` too (``prefill(prime=True)``); its first step, when plain, uses these
    # logits instead of a forward (``speculate``). None otherwise
    primed: tuple | None = None


def begin_static(ctx: Context, state: State, rows: int, capacity: int,
                 cache: cache_mod.SlabCache | None = None) -> None:
    """Static shapes: size the run's buffers for ``rows`` rows and ``capacity`` cache
    slots, and the target cache (``cache``, else a new one kept in ``state.cache``) so that
    it allocates both its buffers once, at its first forward (``SlabCache.reserve``)."""
    dev = next(ctx.target.parameters()).device
    state.buffers = static.Buffers(rows, capacity, sorted({1, ctx.k + 1}), dev)
    if cache is None:
        cache = state.cache = cache_mod.new_cache(ctx.target, capacity)
    cache.reserve(rows)


def next_draft_k(ctx: Context, needed: int) -> int:
    """Drafts of the next verify step when its rows need ``needed`` (max k_b): ``needed``,
    or with static shapes its verify-width bucket (``static.verify_drafts``)."""
    return static.verify_drafts(needed, ctx.k) if ctx.static_shapes else needed


# ---------------------------------------------------------------------------------------
# Hooks
# ---------------------------------------------------------------------------------------

def emit(ctx: Context, state: State, phase: str, batch: RaggedBatch, **extra) -> None:
    """Build the read-only view and call every hook (nothing is built without hooks)."""
    if not ctx.hooks:
        return
    t0 = time.perf_counter()
    k = step_k(ctx, state)
    lag = k + 1 if batch.draft_cache is not None and phase in ("draft", "verify", "commit") else 0
    view = batch.view(
        step=state.step, phase=phase, profile=state.profile, k=k,
        stop_token_ids=ctx.stop_tuple, model=ctx.target, draft_cache_lag=lag, sampling=ctx.sampling,
        info={"strategy": ctx.strategy, "batch_index": state.batch_index,
              **({"sampling": ctx.sampling.as_dict()} if ctx.sampling is not None else {}),
              **(state.info() if state.info is not None else {})}, **extra)
    watch = validation.HookWatch(view, batch.stores()) \
        if ctx.watch_hooks or state.step < validation.WATCH_STEPS else None
    try:
        for hook in ctx.hooks:
            hook(phase, view)
            if watch is not None:
                watch.check(hook)
    finally:
        state.stats.seconds["checks"] += time.perf_counter() - t0


def step_k(ctx: Context, state: State) -> int:
    """Drafts of the current (or next) verify step: ``state.draft_k``, else ``ctx.k``."""
    return ctx.k if state.draft_k is None else state.draft_k


def timed(state: State, phase: str, t0: float) -> float:
    """Add the wall time since ``t0`` to ``phase``; returns now."""
    t1 = time.perf_counter()
    state.stats.seconds[phase] += t1 - t0
    return t1


# ---------------------------------------------------------------------------------------
# Phases
# ---------------------------------------------------------------------------------------

@torch.no_grad()
def prefill(ctx: Context, state: State, prompts: list[list[int]], row_ids: list[int],
            budgets: list[int], capacity: Capacity | None = None,
            cache: cache_mod.SlabCache | None = None, prime: bool = False) -> RaggedBatch:
    """Right-align the prompts and compute the target (and drafter) cache of all but the
    pending token of every row. ``capacity(width, max_budget)`` sizes the caches (default:
    ``layout.contiguous_capacity``, the contiguous profile's need); ``cache``: a target
    cache to reuse (emptied; static shapes: the run's one cache), else a new one. The
    target's forward leaves out the padding the rows do not need (``cache_mod.prefill``:
    on a CPU, rows of very different lengths prefill in separate forwards).

    ``prime``: when the rows' first step is plain (every admitted ``k_b`` is 0), the
    prefill forward covers the pending token too (as plain decoding's prefill does) and
    keeps its logits in ``state.primed``; the cache's width stays ``W - 1`` (the pending
    token's slot is written but not yet filled, ``SlabCache.crop``), so every view reads as
    without priming. The first step then verifies from those logits and fills the slot
    instead of running a width-1 forward of its own (``speculate``): a plain step of the
    speculative loop costs what plain decoding's does, from the first one on. The policy
    is asked for the first ``k_b`` before the target's forward (its evidence reads tokens
    only)."""
    t0 = time.perf_counter()
    dev = next(ctx.target.parameters()).device
    tokens, valid, positions, lengths = left_pad(prompts, device=dev)
    b, w = tokens.shape
    max_budget = max(budgets)
    budgets_t = torch.tensor(budgets, dtype=torch.long, device=dev)
    need = layout.contiguous_capacity(w, max_budget, ctx.k) if capacity is None \
        else capacity(w, max_budget)
    if cache is None:
        cache = cache_mod.new_cache(ctx.target, need)
    elif need > cache.capacity:
        raise ValueError(f"the run's cache holds {cache.capacity} slots, this batch needs {need}")
    else:
        cache.empty_rows(b)
    batch = RaggedBatch(
        tokens=tokens, valid=valid, positions=positions, lengths=lengths,
        prompt_lengths=lengths.clone(), budgets=budgets_t,
        generated=torch.zeros(b, dtype=torch.long, device=dev),
        finished=torch.zeros(b, dtype=torch.bool, device=dev),
        row_ids=torch.tensor(row_ids, dtype=torch.long, device=dev),
        output=torch.zeros(b, layout.output_width(max_budget, ctx.k), dtype=torch.long, device=dev),
        target_cache=cache,
    )
    record = None
    cw = layout.cache_width(w)
    ctx.drafter.prefill(batch)
    lengths = ctx.policy.admit(row_ids, batch, ctx.drafter)  # the rows' first k_b (host)
    state.admitted_lengths = list(lengths)
    state.draft_k = next_draft_k(ctx, max(lengths, default=0))
    state.primed = None
    primed = prime and state.draft_k == 0
    if cw > 0 or primed:
        q = w if primed else cw
        logits = cache_mod.prefill(ctx.target, tokens[:, :q], positions[:, :q], valid[:, :q],
                                   batch.target_cache, [max(0, len(p) - (w - q)) for p in prompts])
        if primed:  # the pending token's slot is written, not filled (see the docstring)
            batch.target_cache.crop(cw)
            state.primed = (batch, logits)
        if cw > 0:  # what the cache holds: the slots before the pending token
            record = ForwardRecord(tokens[:, :cw], positions[:, :cw], valid[:, :cw], 0,
                                   window=ctx.target_window)
    timed(state, "prefill", t0)
    emit(ctx, state, "prefill", batch, forward=record)
    return batch


@dataclass
class Spec:
    """What one draft -> verify -> commit produced (device tensors)."""

    # [B, k] long (k: this step's draft_k)
    drafts: torch.Tensor
    # [B] long: drafts each row may use, min(k_b, remaining - 1)
    limit: torch.Tensor
    # [B, k+1] long: the target's choice at pending and each draft (greedy: the argmax;
    # sampling: see specdec.sampling.choose)
    predictions: torch.Tensor
    # [B] long
    accepted: torch.Tensor
    # [B] long: tokens committed this step
    committed: torch.Tensor
    # [B, k] long: the ids as proposed (any integer dtype; ``drafts`` holds them clamped
    # into the vocabulary), and [B, k] bool: outside the vocabulary (``sync`` raises)
    proposed: torch.Tensor | None = None
    bad_drafts: torch.Tensor | None = None
    # [B] long: the rows' draft lengths k_b this step (each <= k)
    lengths: torch.Tensor | None = None
    # the step verified from a primed prefill's logits (no forward of its own: its cost
    # is not a step's, so the policy does not observe it)
    primed: bool = False

    @property
    def k(self) -> int:
        """Drafts of this step (its verify forward covered ``k + 1`` tokens per row)."""
        return self.drafts.shape[1]


def propose(ctx: Context, batch: RaggedBatch, k: int, step: int):
    """(the drafter's proposals, the draft model's logits [B, k+1, V] or None).

    When the run samples, a drafter with ``propose_sampled`` (a draft model) chooses its
    drafts by the run's rule and returns its logits (rejection sampling needs its
    distribution ``q``); any other drafter is a point mass (logits None)."""
    if ctx.sampling is not None and hasattr(ctx.drafter, "propose_sampled"):
        proposed, logits = ctx.drafter.propose_sampled(batch, k, ctx.sampling)
        validation.draft_logits(logits, batch.batch_size, k, batch.device, ctx.vocab, step)
        return proposed, logits
    return ctx.drafter.propose(batch, k), None


@dataclass
class HostStep:
    """The one host transfer of a step."""

    finished: list  # [B] bool per row
    max_n: int  # longest row after the commit among rows that stay (0 when none stays)
    committed: list  # [B] int
    next_lengths: list = field(default_factory=list)  # [B] int: k_b of each row's next step
    next_k: int = 0  # max of next_lengths over the rows that stay (layout.draft_width)


@torch.no_grad()
def speculate(ctx: Context, state: State, batch: RaggedBatch) -> Spec:
    """Draft, verify and commit on ``batch`` (hooks after each phase); no host sync. The
    step drafts ``state.draft_k`` tokens per row (``step_k``), row b may use
    ``min(k_b, remaining - 1)`` of them (``k_b``: the policy's ``lengths``)."""
    k, dev = step_k(ctx, state), batch.device
    b, w = batch.tokens.shape
    t = time.perf_counter()

    # -- draft ---------------------------------------------------------------------------
    remaining = batch.remaining
    lengths = ctx.policy.lengths(batch, k)  # [B] long, each <= k
    # a plain step (k = 0): every k_b is 0, and so is every row's draft limit
    limit = layout.draft_limit(layout.TORCH, lengths, remaining) if k else lengths
    proposed, draft_logits = propose(ctx, batch, k, state.step)
    # type, dtype, device, shape checked here; ids outside the vocabulary are clamped for
    # the forward and flagged, and the flag is read with the step's one sync (``sync``)
    drafts, bad = validation.checked_drafts(proposed, b, k, dev, ctx.vocab, state.step)
    t = timed(state, "draft", t)
    emit(ctx, state, "draft", batch, drafts=drafts, draft_limit=limit)

    # -- verify: one forward over pending ++ drafts, explicit positions and mask ----------
    t = time.perf_counter()
    cw = layout.cache_width(w)  # slots 0 .. cw-1 are cached; the pending token is slot cw
    i = torch.arange(k + 1, device=dev)[None, :]
    # holes in a sliding-window model: the window must count positions, not slots
    by_position = cache_mod.positions_matter(batch.holes, ctx.target_window)
    if state.buffers is None:
        inputs = torch.cat([batch.tokens[:, cw:], drafts], dim=1)
        positions = layout.verify_position(batch.lengths[:, None], i).clamp(max=ctx.max_position)
        mask = torch.cat([batch.valid[:, :cw], torch.ones(b, k + 1, dtype=torch.bool, device=dev)],
                         dim=1)
        kpos = torch.cat([batch.positions[:, :cw], positions], dim=1) if by_position else None
        key_width = None
    else:
        inputs, positions, mask, kpos = verify_inputs(ctx, state, batch, drafts, i, by_position)
        key_width = mask.shape[1]
    cache_before = batch.target_cache.width
    stash, state.primed = state.primed, None
    primed = stash is not None and stash[0] is batch and k == 0 and kpos is None
    if primed:  # the prefill computed the pending token (``prefill(prime=True)``): its
        given, logits = mask, stash[1]  # slot is filled now, as the forward would have
        batch.target_cache.advance(1)
    else:  # what the model attends with
        given = cache_mod.model_mask(ctx.target, mask, positions, kpos,
                                     None if key_width is None else cw)
        if key_width is not None and kpos is not None:  # a 4-D mask: into the run's buffers
            given = state.buffers.hold(given)
        logits = verify_forward(ctx.target, inputs, positions, mask, batch.target_cache, given,
                                key_width)
    if key_width is not None and ctx.hooks:  # the views see the C + q real columns
        inputs, positions, mask, given = static_record(ctx, inputs, positions, mask, given,
                                                       cw + k + 1)
    # the choice at each position: argmax, coupled choice, or rejection sampling's choice
    at = batch.generated[:, None] + i if ctx.sampling is not None else None  # output positions
    predictions = sampling.choose(logits, ctx.sampling, batch.row_ids, at, drafts, draft_logits)
    t = timed(state, "verify", t)
    emit(ctx, state, "verify", batch, drafts=drafts, draft_limit=limit, predictions=predictions,
         forward=ForwardRecord(inputs, positions, mask, cache_before, window=ctx.target_window,
                               model_mask=given if kpos is not None else None))

    # -- commit: accept, correction/bonus, stop tokens, budget ---------------------------
    t = time.perf_counter()
    accepted = acceptance.accepted_count(drafts, predictions, limit)
    committed, stopped = acceptance.committed_count(predictions, accepted, remaining, ctx.stop_ids)
    before = batch.generated
    cols = before[:, None] + i
    written = torch.where(i < committed[:, None], predictions, 0)
    batch.output = batch.output.scatter(1, cols, written)
    batch.generated = before + committed
    batch.finished = layout.row_finished(batch.finished, stopped, batch.generated, batch.budgets)
    timed(state, "commit", t)
    emit(ctx, state, "commit", batch, drafts=drafts, draft_limit=limit, predictions=predictions,
         accepted=accepted, committed=committed, generated_before=before)
    return Spec(drafts, limit, predictions, accepted, committed, proposed, bad, lengths, primed)


def padding_row(target, device, rows: int, width: int) -> int:
    """Rows to add to a verify forward of ``rows`` x ``width`` tokens: 1 for a plain
    step (``width`` 1) on a CPU when ``rows`` is 3 modulo 4, else 0. Measured here (MKL
    sgemm, AVX-512, one thread; SmolLM2's 576 x 1536 product): over M = 3, 7, 11, 15
    token rows a product costs 200, 289, 361, 425 us, over M + 1 rows 171, 238, 305,
    375 us (its kernel takes rows 4 at a time, then 2, then 1), and a SmolLM2 step over 7
    rows 115 ms against 103 ms over 8. Rows leave the batch as they finish, so without it
    a batch of 8 went on at 7 rows, each plain step 11% dearer than plain decoding's
    (which keeps finished rows). A wider step would add ``width`` token rows, which does
    not pay (M = 3 -> 6: 200 -> 232 us). Not on a model a guard observes (it has forward
    hooks: they would see the extra row)."""
    if torch.device(device).type != "cpu" or width != 1 or rows % 4 != 3:
        return 0
    if target._forward_hooks or target._forward_pre_hooks:
        return 0
    return 1


def verify_forward(target, inputs, positions, mask, cache, given,
                   key_width: int | None = None) -> torch.Tensor:
    """``cache_mod.forward`` of the verify step (logits [B, q, V]), over one extra row
    when ``padding_row`` says it is cheaper: a copy of row 0's inputs, positions and
    mask on a spare row of the cache (``SlabCache.padding_rows``); its logits are dropped
    and no row in use reads it. Without a spare row, with a mask other than 2-D, or with
    static shapes (``key_width``: the inputs are the run's fixed buffers), as is."""
    b, q = inputs.shape
    extra = 0 if key_width is not None else padding_row(target, inputs.device, b, q)
    if (not extra or not isinstance(given, torch.Tensor) or given.dim() != 2
            or not isinstance(cache, cache_mod.SlabCache) or not cache.padding_rows(extra)):
        return cache_mod.forward(target, inputs, positions, mask, cache, mask=given,
                                 key_width=key_width)
    try:
        pad = lambda x: torch.cat([x, x[:1]])  # noqa: E731  (``padding_row`` adds one row: row 0 again)
        logits = cache_mod.forward(target, pad(inputs), pad(positions), pad(mask), cache,
                                   mask=pad(given))
    finally:
        cache.unpad(extra)
    return logits[:b]


def verify_inputs(ctx: Context, state: State, batch: RaggedBatch, drafts: torch.Tensor,
                  i: torch.Tensor, by_position: bool):
    """Static shapes: the verify forward's (inputs [B, q], positions [B, q], mask [B, K],
    key positions [B, K] or None), written in place into the run's buffers (views of
    them): q = k + 1, K the key bucket of ``C + q`` (``static.Buffers.inputs``)."""
    b, w = batch.tokens.shape
    cw, q = layout.cache_width(w), i.shape[1]
    inputs, positions, mask, kpos = state.buffers.inputs(b, q, cw, batch.target_cache.capacity)
    torch.cat([batch.tokens[:, cw:], drafts], dim=1, out=inputs)
    torch.clamp(layout.verify_position(batch.lengths[:, None], i), max=ctx.max_position,
                out=positions)
    mask[:, :cw] = batch.valid[:, :cw]
    mask[:, cw : cw + q] = 1
    if not by_position:
        return inputs, positions, mask, None
    kpos[:, :cw] = batch.positions[:, :cw]
    kpos[:, cw : cw + q] = positions
    kpos[:, cw + q :] = 0
    return inputs, positions, mask, kpos


def static_record(ctx: Context, inputs, positions, mask, given, cols: int):
    """What the views record of a static verify forward (built only with hooks): its
    real ``cols = C + q`` mask columns (the rest are 0), as copies: the buffers are
    rewritten next step, and a hook may keep what it saw."""
    own = given is mask  # no 4-D mask: the model got the 2-D one
    mask = mask[:, :cols].bool()
    if own:
        given = mask
    elif isinstance(given, dict):
        given = {t: m.clone() for t, m in static.real_columns(given, cols).items()}
    else:
        given = static.real_columns(given, cols).clone()
    return inputs.clone(), positions.clone(), mask, given


def sync(ctx: Context, state: State, batch: RaggedBatch, spec: Spec) -> HostStep:
    """The one host sync of the step: finished rows, the longest staying row, committed
    counts, every row's draft length for its next step (planned here by the policy, on
    the device), whether any draft was outside the vocabulary (then it raises ValueError:
    the step's output is never returned); updates the counters and the step number."""
    b = batch.batch_size
    t = time.perf_counter()
    nxt = ctx.policy.plan(batch, spec, ctx.drafter, spec.k)  # [B] long, next k_b
    t = timed(state, "draft", t)
    keep = ~batch.finished
    max_n = layout.new_width(layout.TORCH, batch.lengths, spec.committed, keep)
    next_k = layout.draft_width(layout.TORCH, nxt, keep)
    bad = spec.bad_drafts.sum() if spec.bad_drafts is not None else torch.zeros_like(max_n)
    used = spec.lengths.sum() if spec.lengths is not None else torch.zeros_like(max_n)
    scalars = torch.stack([max_n, spec.limit.sum(), spec.accepted.sum(), spec.committed.sum(),
                           bad, next_k, used])  # [7] long
    # [3B + 7 (+ B)]: with hooks the per-row accepted counts ride on the same read
    parts = [batch.finished.long(), spec.committed, nxt, scalars]
    host = torch.cat(parts + [spec.accepted] if ctx.hooks else parts).tolist()
    timed(state, "realign", t)  # the wait for the read (as before: realign's)
    if host[3 * b + 4]:
        validation.raise_bad_drafts(spec.proposed, spec.bad_drafts, batch.row_ids, ctx.vocab,
                                    state.step)
    st = state.stats
    st.steps += 1
    st.drafted += host[3 * b + 1]
    st.accepted += host[3 * b + 2]
    st.committed += host[3 * b + 3]
    st.planned += host[3 * b + 6]
    st.row_steps += b
    st.widths[spec.k + 1] = st.widths.get(spec.k + 1, 0) + 1
    if ctx.hooks:
        st.accepted_history.append(host[3 * b + 7 :])
    state.step += 1
    return HostStep([bool(f) for f in host[:b]], host[3 * b], host[b : 2 * b],
                    host[2 * b : 3 * b], next_draft_k(ctx, host[3 * b + 5]))


def retire(batch: RaggedBatch, host: HostStep, done: list) -> None:
    """Hand the rows that finished this step to ``done`` (row_ids, output, generated)."""
    count = sum(host.finished)
    if count:
        fin = rows_where(batch.finished, count)
        done.append((batch.row_ids[fin], batch.output[fin], batch.generated[fin]))


@torch.no_grad()
def step(ctx: Context, state: State, batch: RaggedBatch, done: list,
         after_step: AfterStep) -> RaggedBatch | None:
    """One speculative step; returns the next batch, or None when every row finished.

    Finished rows go to ``done`` (row_ids, output, generated); ``after_step`` (the
    strategy's layout work: drop them, realign or append) makes the next batch.
    """
    cost = StepCost(ctx, state)
    spec = speculate(ctx, state, batch)
    host = sync(ctx, state, batch, spec)
    t = time.perf_counter()
    retire(batch, host, done)
    if all(host.finished):
        timed(state, "realign", t)
        return None
    batch = after_step(ctx, state, batch, spec, host)
    state.draft_k = host.next_k  # the next step: max k_b over the rows that stay
    timed(state, "realign", t)
    if not spec.primed:
        cost.observe(spec.k + 1, len(host.finished))
    emit(ctx, state, "realign", batch)
    return batch


class StepCost:
    """Measures one step for the policy (``observe``): from before its draft to after its
    realignment, on ``ctx.clock``, hooks excluded (their wall seconds, ``checks``)."""

    def __init__(self, ctx: Context, state: State):
        self.ctx, self.state = ctx, state
        self.start, self.checks = ctx.clock(), state.stats.seconds["checks"]

    def observe(self, width: int, rows: int) -> None:
        hooks = self.state.stats.seconds["checks"] - self.checks
        self.ctx.policy.observe(width, rows, self.ctx.clock() - self.start - hooks)


def run_batch(ctx: Context, state: State, prompts, row_ids, budgets, done: list, *,
              capacity: Capacity, after_step: AfterStep) -> None:
    """Prefill one batch and step it until every row finished."""
    batch = prefill(ctx, state, prompts, row_ids, budgets, capacity, state.cache, prime=True)
    while batch is not None:
        batch = step(ctx, state, batch, done, after_step)


def collect(done: list, count: int) -> list[list[int]]:
    """Host-side assembly of finished rows into per-prompt lists: one host read per call
    (every finished row's request index, length and output in one tensor)."""
    seqs: list = [None] * count
    if not done:
        return seqs
    width = max(output.shape[1] for _, output, _ in done)
    table = torch.cat([torch.cat([row_ids[:, None], generated[:, None],
                                  torch.nn.functional.pad(output, (0, width - output.shape[1]))],
                                 dim=1) for row_ids, output, generated in done])  # [N, 2 + width]
    for r, g, *out in table.tolist():
        seqs[r] = out[:g]
    return seqs
