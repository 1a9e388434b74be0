"""The decoding loop: prefill -> (draft -> verify -> commit -> realign)* with hooks.

Reads top to bottom: ``generate`` validates its inputs, splits the prompts into batches of
``batch_size`` and runs ``run_batch`` on each; ``run_batch`` calls ``prefill`` once and
``step`` until every row has finished. After each phase every hook is called as
``hook(phase, view)`` with a read-only ``invariants.StepView``.

Strategies plug in after the shared phases: ``speculate`` (draft, verify, commit) and
``sync`` (the host transfer) are common; what happens to the layout afterwards is the
strategy's ``after_step`` (``strategies/eqspec.py``: realign every step; ``holes.py``:
append and compact past a threshold). ``strategies/exspec.py`` runs its own loop over a
request pool with the same ``prefill``, ``speculate`` and ``sync``. Each strategy names
the layout profile its views carry (``ctx.profile``).

Host synchronisation: one small transfer per step (which rows finished, the longest
row, the committed counts, whether any draft lay outside the vocabulary: ``2B + 5``
integers), needed to size the next tensors; none inside draft, verify, commit or the
realignment gathers.

Validation (``validation.py``): ``generate`` checks every argument before any work;
``speculate`` checks each ``propose`` result (host facts at once; out-of-vocabulary ids
are clamped for the verify forward and flagged on the device, and ``sync`` raises
``ValueError`` when the flag is set, so such a step's output is never returned); ``emit``
refuses a hook that writes to its view (``validation.HookWatch``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import torch

from invariants.view import ForwardRecord, StepView

from . import acceptance, layout, validation
from . import cache as cache_mod
from .batch import RaggedBatch, left_pad, rows_where
from .drafters import NGramDrafter
from .models import context_length, stop_token_ids as model_stop_ids, vocab_size
from .strategies import eqspec, exspec, holes

STRATEGIES = ("eqspec", "exspec", "holes")
PHASE_NAMES = ("prefill", "draft", "verify", "commit", "realign")

Hook = Callable[[str, StepView], None]


@dataclass
class Stats:
    """Counters of one ``generate`` call."""

    steps: int = 0
    drafted: int = 0  # drafts rows could use (sum of draft limits)
    accepted: int = 0
    committed: int = 0
    # wall seconds per phase, plus "checks": time spent inside hooks
    seconds: dict = field(default_factory=lambda: {p: 0.0 for p in PHASE_NAMES + ("checks",)})
    accepted_history: list = field(default_factory=list)  # per step: [B] accepted (host)
    # exspec: steps served by a group of equal-length rows (no realignment); else None
    grouped_steps: int | None = None
    # holes: compactions run (slack past the threshold or capacity); else None
    compactions: int | None = None

    @property
    def acceptance(self) -> float:
        """Accepted / usable drafts (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.committed / self.steps if self.steps else 0.0

    @property
    def group_rate(self) -> float | None:
        """Share of steps served without realignment (exspec only; None otherwise)."""
        if self.grouped_steps is None:
            return None
        return self.grouped_steps / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        return {"steps": self.steps, "drafted": self.drafted, "accepted": self.accepted,
                "committed": self.committed, "acceptance": self.acceptance,
                "group_rate": self.group_rate, "compactions": self.compactions,
                "seconds": dict(self.seconds)}


@dataclass
class Result:
    # generated ids per prompt, in prompt order, the stop token included where one ended it
    sequences: list
    stats: Stats


@dataclass
class Context:
    """What stays fixed during one ``generate`` call."""

    target: torch.nn.Module
    drafter: object
    k: int
    stop_ids: torch.Tensor  # [S] long
    hooks: Sequence[Hook]
    stats: Stats
    max_position: int
    profile: str = "contiguous"
    stop_tuple: tuple = ()  # stop_ids on the host (views carry them without a sync)
    strategy: str = "eqspec"
    step: int = 0
    batch_index: int = 0
    # holes: slack share of the width past which a batch is compacted
    hole_threshold: float = 0.0
    # sliding window of the target (None: full attention); holes need position masks
    target_window: int | None = None
    # () -> dict of strategy facts added to every view's info (built only with hooks)
    info: Callable[[], dict] | None = None
    # the target's vocabulary size (drafts are checked against it); default: from target
    vocab: int = 0

    def __post_init__(self):
        if not self.vocab:
            self.vocab = vocab_size(self.target)


# ---------------------------------------------------------------------------------------
# Validation at the boundary (the rules live in validation.py)
# ---------------------------------------------------------------------------------------

def validate(target, prompts, *, tokenizer, drafter, strategy, k, batch_size, max_new_tokens,
             stop_token_ids, hooks, window, hole_threshold):
    """Every check of ``generate``'s arguments, before any work; returns them checked
    (ints as ints, the prompts as id lists, the default drafter filled in, stop ids None
    for the model's own)."""
    ids = validation.prompt_ids(prompts, tokenizer)
    max_new_tokens, stops = validation.request(target, ids, max_new_tokens=max_new_tokens,
                                               stop_token_ids=stop_token_ids)
    validation.choice(strategy, "strategy", STRATEGIES)
    k = validation.integer(k, "k (drafts per step)", minimum=0)
    batch_size = validation.integer(batch_size, "batch_size", minimum=1)
    hooks = validation.hooks(hooks)
    drafter = NGramDrafter() if drafter is None else drafter
    validation.drafter(drafter)
    if hasattr(drafter, "check_compatible"):
        drafter.check_compatible(target)
    if window is not None:
        if strategy != "exspec":
            raise ValueError(f"window= applies to strategy='exspec' only, not {strategy!r}")
        window = validation.integer(window, "window (requests in the pool)", minimum=1)
        if window < batch_size:
            raise ValueError(f"window (requests in the pool) must be an integer >= batch_size "
                             f"= {batch_size}, got {window!r}")
    if hole_threshold is not None:
        if strategy != "holes":
            raise ValueError(f"hole_threshold= applies to strategy='holes' only, not {strategy!r}")
        hole_threshold = validation.number(hole_threshold, "hole_threshold", 0, 1)
    if strategy == "holes":  # refuse sliding-window setups a position mask cannot serve
        holes.check_model(target)
        if drafter.uses_cache:
            holes.check_model(drafter.model)
    return Checked(ids, drafter, stops, hooks, k, batch_size, max_new_tokens, window,
                   hole_threshold)


class Checked(NamedTuple):
    """``generate``'s arguments after ``validate``."""

    ids: list  # [[int]] per prompt
    drafter: object
    stops: list | None  # None: the model's generation config
    hooks: tuple
    k: int
    batch_size: int
    max_new_tokens: int
    window: int | None
    hole_threshold: float | None


# ---------------------------------------------------------------------------------------
# Hooks
# ---------------------------------------------------------------------------------------

def emit(ctx: Context, phase: str, batch: RaggedBatch, **extra) -> None:
    """Build the read-only view and call every hook (nothing is built without hooks)."""
    if not ctx.hooks:
        return
    t0 = time.perf_counter()
    tc, dc = batch.target_cache, batch.draft_cache
    lag = 0
    if dc is not None and phase in ("draft", "verify", "commit"):
        lag = ctx.k + 1
    view = StepView(
        step=ctx.step, phase=phase, profile=ctx.profile, k=ctx.k,
        tokens=batch.tokens, valid=batch.valid, positions=batch.positions,
        lengths=batch.lengths, prompt_lengths=batch.prompt_lengths, budgets=batch.budgets,
        generated=batch.generated, finished=batch.finished, row_ids=batch.row_ids,
        output=batch.output, stop_token_ids=ctx.stop_tuple,
        cache_widths=tuple(tc.layer_widths()),
        cache_batch_sizes=tuple([tc.batch_size] * len(tc.layers)),
        draft_cache_widths=tuple(dc.layer_widths()) if dc is not None else (),
        draft_cache_lag=lag, model=ctx.target, cache_tensors=tc.layer_tensors,
        info={"strategy": ctx.strategy, "batch_index": ctx.batch_index,
              **(ctx.info() if ctx.info is not None else {})}, **extra,
    )
    watch = validation.HookWatch(view, _stores(batch))
    try:
        for hook in ctx.hooks:
            hook(phase, view)
            watch.check(hook)
    finally:
        ctx.stats.seconds["checks"] += time.perf_counter() - t0


def _stores(batch: RaggedBatch) -> tuple:
    """The cache storage a view exposes (``view.cache_tensors``), named for HookWatch."""
    out = [("target cache", batch.target_cache.slab.store)]
    if batch.draft_cache is not None:
        out.append(("draft cache", batch.draft_cache.slab.store))
    return tuple(out)


# ---------------------------------------------------------------------------------------
# Phases
# ---------------------------------------------------------------------------------------

@torch.no_grad()
def prefill(ctx: Context, prompts: list[list[int]], row_ids: list[int], budgets: list[int],
            capacity: Callable[[int, int], int] | None = None) -> RaggedBatch:
    """Right-align the prompts and compute the target (and drafter) cache of all but the
    pending token of every row. ``capacity(width, max_budget)`` sizes the caches (default:
    room for the whole budget at the prompt width, the contiguous profile's need)."""
    t0 = time.perf_counter()
    dev = next(ctx.target.parameters()).device
    tokens, valid, positions, lengths = left_pad(prompts, device=dev)
    b, w = tokens.shape
    max_budget = max(budgets)
    capacity = (w + max_budget + ctx.k + 1) if capacity is None else capacity(w, max_budget)
    budgets_t = torch.tensor(budgets, dtype=torch.long, device=dev)
    batch = RaggedBatch(
        tokens=tokens, valid=valid, positions=positions, lengths=lengths,
        prompt_lengths=lengths.clone(), budgets=budgets_t,
        generated=torch.zeros(b, dtype=torch.long, device=dev),
        finished=torch.zeros(b, dtype=torch.bool, device=dev),
        row_ids=torch.tensor(row_ids, dtype=torch.long, device=dev),
        output=torch.zeros(b, max_budget + ctx.k + 1, dtype=torch.long, device=dev),
        target_cache=cache_mod.new_cache(ctx.target, capacity),
    )
    record = None
    cw = layout.cache_width(w)
    if cw > 0:
        ids, pos, mask = tokens[:, :cw], positions[:, :cw], valid[:, :cw]
        cache_mod.forward(ctx.target, ids, pos, mask, batch.target_cache, last_logits=True)
        record = ForwardRecord(ids, pos, mask, 0)
    ctx.drafter.prefill(batch)
    _timed(ctx, "prefill", t0)
    emit(ctx, "prefill", batch, forward=record)
    return batch


def _timed(ctx: Context, phase: str, t0: float) -> float:
    t1 = time.perf_counter()
    ctx.stats.seconds[phase] += t1 - t0
    return t1


@dataclass
class Spec:
    """What one draft -> verify -> commit produced (device tensors)."""

    # [B, k] long: the drafts verified (proposed ids, clamped into the vocabulary)
    drafts: torch.Tensor
    # [B] long: drafts each row may use
    limit: torch.Tensor
    # [B, k+1] long: target argmax at pending and each draft
    predictions: torch.Tensor
    # [B] long
    accepted: torch.Tensor
    # [B] long: tokens committed this step
    committed: torch.Tensor
    # [B, k] long: the ids as proposed (any integer dtype), and [B, k] bool: outside the
    # vocabulary (validation.checked_drafts; sync raises when any is set)
    proposed: torch.Tensor | None = None
    bad_drafts: torch.Tensor | None = None


@dataclass
class HostStep:
    """The one host transfer of a step."""

    finished: list  # [B] bool per row
    max_n: int  # longest row after the commit among rows that stay (0 when none stays)
    committed: list  # [B] int


@torch.no_grad()
def speculate(ctx: Context, batch: RaggedBatch) -> Spec:
    """Draft, verify and commit on ``batch`` (hooks after each phase); no host sync."""
    k, dev = ctx.k, batch.device
    b, w = batch.tokens.shape
    t = time.perf_counter()

    # -- draft ---------------------------------------------------------------------------
    remaining = batch.remaining
    limit = layout.draft_limit(layout.TORCH, k, remaining)
    proposed = ctx.drafter.propose(batch, k)
    # type, dtype, device, shape checked here; ids outside the vocabulary are clamped for
    # the forward and flagged, and the flag is read with the step's one sync (``sync``)
    drafts, bad = validation.checked_drafts(proposed, b, k, dev, ctx.vocab, ctx.step)
    t = _timed(ctx, "draft", t)
    emit(ctx, "draft", batch, drafts=drafts, draft_limit=limit)

    # -- verify: one forward over pending ++ drafts, explicit positions and mask ----------
    t = time.perf_counter()
    cw = layout.cache_width(w)  # slots 0 .. cw-1 are cached; the pending token is slot cw
    inputs = torch.cat([batch.tokens[:, cw:], drafts], dim=1)
    i = torch.arange(k + 1, device=dev)[None, :]
    positions = layout.verify_position(batch.lengths[:, None], i).clamp(max=ctx.max_position)
    mask = torch.cat([batch.valid[:, :cw], torch.ones(b, k + 1, dtype=torch.bool, device=dev)], dim=1)
    # holes in a sliding-window model: the window must count positions, not slots
    kpos = torch.cat([batch.positions[:, :cw], positions], dim=1) \
        if batch.holes and ctx.target_window is not None else None
    cache_before = batch.target_cache.width
    logits = cache_mod.forward(ctx.target, inputs, positions, mask, batch.target_cache,
                               key_positions=kpos)
    predictions = logits.argmax(dim=-1)
    t = _timed(ctx, "verify", t)
    emit(ctx, "verify", batch, drafts=drafts, draft_limit=limit, predictions=predictions,
         forward=ForwardRecord(inputs, positions, mask, cache_before))

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
    _timed(ctx, "commit", t)
    emit(ctx, "commit", batch, drafts=drafts, draft_limit=limit, predictions=predictions,
         accepted=accepted, committed=committed, generated_before=before)
    return Spec(drafts, limit, predictions, accepted, committed, proposed, bad)


def sync(ctx: Context, batch: RaggedBatch, spec: Spec) -> HostStep:
    """The one host sync of the step: finished rows, the longest staying row, committed
    counts, whether any draft was outside the vocabulary (then it raises ValueError: the
    step's output is never returned); updates the counters."""
    b = batch.batch_size
    max_n = layout.new_width(layout.TORCH, batch.lengths, spec.committed, ~batch.finished)
    scalars = torch.stack([max_n, spec.limit.sum(), spec.accepted.sum(), spec.committed.sum(),
                           spec.bad_drafts.sum()])  # [5] long
    host = torch.cat([batch.finished.long(), spec.committed, scalars]).tolist()
    if host[2 * b + 4]:
        validation.raise_bad_drafts(spec.proposed, spec.bad_drafts, batch.row_ids, ctx.vocab,
                                    ctx.step)
    st = ctx.stats
    st.steps += 1
    st.drafted += host[2 * b + 1]
    st.accepted += host[2 * b + 2]
    st.committed += host[2 * b + 3]
    if ctx.hooks:
        st.accepted_history.append(spec.accepted.tolist())
    ctx.step += 1
    return HostStep([bool(f) for f in host[:b]], host[2 * b], host[b : 2 * b])


def retire(batch: RaggedBatch, host: HostStep, done: list) -> None:
    """Hand the rows that finished this step to ``done`` (row_ids, output, generated)."""
    count = sum(host.finished)
    if count:
        fin = rows_where(batch.finished, count)
        done.append((batch.row_ids[fin], batch.output[fin], batch.generated[fin]))


@torch.no_grad()
def step(ctx: Context, batch: RaggedBatch, done: list) -> RaggedBatch | None:
    """One speculative step; returns the next batch, or None when every row finished.

    Finished rows leave the batch; their (row_ids, output, generated) go to ``done``.
    """
    spec = speculate(ctx, batch)
    t = time.perf_counter()
    host = sync(ctx, batch, spec)
    retire(batch, host, done)
    if all(host.finished):
        _timed(ctx, "realign", t)
        return None
    batch = STRATEGY_MODULES[ctx.strategy].after_step(ctx, batch, spec, host)
    _timed(ctx, "realign", t)
    emit(ctx, "realign", batch)
    return batch


STRATEGY_MODULES = {"eqspec": eqspec, "holes": holes, "exspec": exspec}


def run_batch(ctx: Context, prompts, row_ids, budgets, done: list) -> None:
    plan = STRATEGY_MODULES[ctx.strategy]
    batch = prefill(ctx, prompts, row_ids, budgets,
                    capacity=lambda w, mb: plan.capacity(ctx, w, mb))
    while batch is not None:
        batch = step(ctx, batch, done)


# ---------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------

def generate(target, prompts, *, tokenizer=None, drafter=None, strategy="eqspec", k=4,
             batch_size=8, max_new_tokens=64, stop_token_ids=None, hooks=(), window=None,
             hole_threshold=None) -> Result:
    """Greedy speculative decoding of ``prompts`` with ``target``.

    Returns ``Result(sequences, stats)``: ``sequences[i]`` is the list of generated ids of
    prompt i, the stop token included where one ended the row, equal to the target's own
    greedy decoding. ``stop_token_ids`` defaults to the target's generation config.

    Strategy options: ``window`` (exspec: requests held in the pool, default
    ``2 * batch_size``, at least ``batch_size``); ``hole_threshold`` (holes: compact when
    the reclaimable share of the width passes it, in ``[0, 1]``; default
    ``holes.DEFAULT_THRESHOLD``; 1 never compacts unless the cache is full).

    Bad input raises ``TypeError`` (a value of the wrong kind) or ``ValueError`` (out of
    range) with one line that states the rule (``specdec.validation``), before any work;
    a drafter's bad output, or a hook's write to its view, raises ``ValueError`` during
    the run.
    """
    a = validate(target, prompts, tokenizer=tokenizer, drafter=drafter, strategy=strategy, k=k,
                 batch_size=batch_size, max_new_tokens=max_new_tokens,
                 stop_token_ids=stop_token_ids, hooks=hooks, window=window,
                 hole_threshold=hole_threshold)
    ids, drafter, k, batch_size, max_new_tokens = a.ids, a.drafter, a.k, a.batch_size, a.max_new_tokens
    window_t = cache_mod.sliding_window(target) if strategy == "holes" else None
    dev = next(target.parameters()).device
    stops = model_stop_ids(target) if a.stops is None else a.stops
    ctx_len = context_length(target)
    ctx = Context(
        target=target, drafter=drafter, k=k,
        stop_ids=torch.tensor(stops, dtype=torch.long, device=dev), stop_tuple=tuple(stops),
        hooks=a.hooks, stats=Stats(),
        max_position=(ctx_len - 1) if ctx_len else 2**31 - 1, strategy=strategy,
        profile=STRATEGY_MODULES[strategy].PROFILE, target_window=window_t,
        hole_threshold=holes.DEFAULT_THRESHOLD if a.hole_threshold is None else a.hole_threshold,
    )
    if hasattr(drafter, "bind"):
        drafter.bind(ids)
    done: list = []
    if strategy == "exspec":
        exspec.run(ctx, ids, batch_size=batch_size, max_new_tokens=max_new_tokens,
                   window=exspec.default_window(batch_size) if a.window is None else a.window,
                   done=done)
        return Result(sequences=collect(done, len(ids)), stats=ctx.stats)
    if strategy == "holes":
        ctx.stats.compactions = 0
    for start in range(0, len(ids), batch_size):
        chunk = list(range(start, min(start + batch_size, len(ids))))
        ctx.batch_index = start // batch_size
        run_batch(ctx, [ids[r] for r in chunk], chunk, [max_new_tokens] * len(chunk), done)
    return Result(sequences=collect(done, len(ids)), stats=ctx.stats)


def collect(done: list, count: int) -> list[list[int]]:
    """Host-side assembly of finished rows into per-prompt lists (once per call)."""
    seqs: list = [None] * count
    for row_ids, output, generated in done:
        for r, out, g in zip(row_ids.tolist(), output.tolist(), generated.tolist()):
            seqs[r] = out[:g]
    return seqs
