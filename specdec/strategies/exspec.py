"""EXSPEC: a request pool larger than the compute batch; steps run on groups of rows of
equal length, so that most steps need no realignment and no padding at all.

Pool. ``window`` requests (default ``2 * batch_size``) are active at a time, each in one
pool row; the rest wait in submission order. A pool row keeps its request's tokens and
KV **left-aligned**: slot ``s`` holds the token at position ``s`` (``cache.SlotPool``,
``[L, 2, window, H, capacity, D]``, one more such pool for a ``ModelDrafter``'s cache).
Nothing in a pool row ever moves: a verify step's accepted drafts are already at their
positions, rejected ones lie past the row's length and are overwritten later.

Step. The host scheduler (``schedule``, on host copies of the lengths kept from the one
sync per step) picks ``G = min(batch_size, active)`` rows:

1. the rows of the previous step again, when they were a group, all committed the same
   count and none finished: they are still a group and their compute cache is reused as
   is (cropped to the new width, **no copy at all**);
2. else a full group, ``G`` rows of equal length (the bucket holding the least recently
   served row; in it the least recently served rows): grouped profile, no padding;
3. else the fallback: the ``G`` shortest rows, except that a row left unserved for more
   than ``PATIENCE`` round-robin rounds (``PATIENCE * ceil(active / G)`` steps) comes
   first (also before cases 1 and 2, unless the group holds the row that waited longest,
   so no row waits much longer than that); right-aligned at the width of the longest
   (EQSPEC's contiguous profile, minimal width). Shortest-first lets short rows catch up
   with longer ones, which is what forms groups: on the tiny llama with 24 mixed prompts,
   k = 4, batch 4, window 16, the group rate was 0.00 with the n-gram drafter and 0.02
   with a scripted one at acceptance 0.5 when the fallback took the least recently
   served rows, 0.44 and 0.24 with this rule, for the same number of steps within 1%
   (within 5% at window 8). It also keeps the fallback's padding small.

Cases 2 and 3 load the chosen rows into the compute batch (``build``): pool slot
``slot_position(j, W - n)`` to compute slot ``j`` (EQSPEC's right-alignment, done by the
load), i.e. one row selection into the compute slab's spare buffer and one gather of
``G x (W - 1)`` slots over all layers into its store: about the traffic of one EQSPEC
realignment plus a row drop. After verify, the
``k + 1`` slots the forward wrote (pending and drafts) are scattered back to the pool rows
at positions ``n - 1 .. n + k - 1`` (``write_back``: ``G x (k + 1)`` slots, every step, so
the pool is always authoritative); the committed tokens likewise. So, honestly:

- reused group (case 1): ``G (k + 1)`` slots copied per step, no gather;
- new group or fallback (2, 3): ``G (W - 1) + G (k + 1)`` slots, about one EQSPEC gather;
- memory: the pool (``window`` rows) plus the compute slab (``batch_size`` rows, double
  buffered like every ``SlabCache``), each of ``longest prompt + budget + k`` slots: with
  the default window, 2x EQSPEC's two buffers.

The share of steps in cases 1 and 2 is ``Stats.group_rate``; the gain over EQSPEC is the
copy saved in case 1 and the padding avoided in 1 and 2; on workloads where equal lengths
are rare (acceptance varies per row) EXSPEC degrades to EQSPEC plus the write-back.

Refill. When rows finish, their pool rows are freed and waiting requests are admitted in
submission order: one prefill forward over all admitted prompts (left-padded, contiguous
profile, emitted as a ``prefill`` view), then a scatter into their pool rows
(``layout.compact_dest_slot`` with padding 0: slot = position). Outputs are returned in
submission order (``phases.collect``). Every request is in exactly one of waiting,
active, finished (``Pool.state``; hooks see it in ``view.info["pool"]``).

Views. A step's views carry the compute batch with profile ``grouped`` (cases 1, 2) or
``contiguous`` (3). The view after building the next batch is the ``realign`` phase
(also before the first step), so the phase order is prefill, realign, draft, verify,
commit, [prefill when admitting], realign, ...
"""

from __future__ import annotations

import time
from collections import deque

import torch

from .. import cache as cache_mod
from .. import layout, validation
from ..batch import PAD_FILL, RaggedBatch, host_rows, take_rows
from ..phases import (StepCost, begin_static, emit, next_draft_k, prefill, retire, speculate,
                      sync, timed)
from . import Option, Strategy

#: profile of grouped steps; fallback steps and prefills use FALLBACK_PROFILE
PROFILE = "grouped"
FALLBACK_PROFILE = "contiguous"
#: round-robin rounds a row may wait before the fallback serves it before shorter rows
PATIENCE = 2
#: the per-row fields of a request the pool keeps on the device, per pool row
POOL_FIELDS = ("prompt_lengths", "budgets", "generated", "row_ids", "output")


def default_window(batch_size: int) -> int:
    return 2 * batch_size


class Pool:
    """Host bookkeeping and device storage of the active requests (see module docstring)."""

    def __init__(self, ctx, prompts: list, budgets: list, size: int, device):
        k = ctx.k
        self.prompts, self.budget_list = prompts, budgets
        self.size = size
        longest = max(len(p) + b for p, b in zip(prompts, budgets))
        self.capacity = layout.pool_capacity(longest, k)  # the last slot is the trash slot
        self.compute_capacity = layout.pool_compute_capacity(longest, k)
        # host state per pool row
        self.rid = [-1] * size       # request served, -1 when free
        self.n = [0] * size          # its length (prompt + committed)
        self.kb = [0] * size         # its draft length k_b at its next step
        self.served = [0] * size     # step it was last served or admitted (fairness)
        self.waiting = deque(range(len(prompts)))
        self.finished: list = []
        self.prefills = 0
        # device state per pool row
        z = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=device)  # noqa: E731
        self.tokens = z(size, self.capacity)
        self.lengths, self.prompt_lengths, self.budgets, self.generated = z(size), z(size), z(size), z(size)
        self.row_ids = z(size) - 1
        self.output = z(size, layout.output_width(max(budgets), k))
        self.kv = cache_mod.SlotPool(size, self.capacity)
        self.draft_kv = cache_mod.SlotPool(size, self.capacity) if ctx.drafter.uses_cache else None

    @property
    def trash(self) -> int:
        return self.capacity - 1

    def active(self) -> list:
        return [p for p in range(self.size) if self.rid[p] >= 0]

    def state(self) -> dict:
        """Requests waiting, active (in pool order) and finished (host lists)."""
        return {"waiting": list(self.waiting), "active": [r for r in self.rid if r >= 0],
                "finished": list(self.finished)}


def admit(ctx, state, pool: Pool) -> None:
    """Admit waiting requests into free pool rows: one prefill, one scatter per cache."""
    free = [p for p in range(pool.size) if pool.rid[p] < 0]
    take = min(len(free), len(pool.waiting))
    if not take:
        return
    rows = free[:take]
    reqs = [pool.waiting.popleft() for _ in range(take)]
    state.profile = FALLBACK_PROFILE
    state.batch_index = pool.prefills  # 0 only for the run's first prefill (monitor resets)
    pool.prefills += 1
    for p, r in zip(rows, reqs):  # host bookkeeping first: the prefill view shows it
        pool.rid[p], pool.n[p], pool.served[p] = r, len(pool.prompts[r]), state.step
    batch = prefill(ctx, state, [pool.prompts[r] for r in reqs], reqs,
                    [pool.budget_list[r] for r in reqs], capacity=lambda w, mb: max(w, 1))
    for p, kb in zip(rows, state.admitted_lengths):
        pool.kb[p] = kb
    t = time.perf_counter()
    R = host_rows(rows, batch.device)
    dest = layout.compact_dest_slot(layout.TORCH, batch.valid, batch.positions, 0, pool.trash)
    pool.tokens[R[:, None].expand_as(dest), dest] = batch.tokens
    cw = layout.cache_width(batch.width)
    pool.kv.store(R, batch.target_cache, dest[:, :cw])
    if pool.draft_kv is not None:
        pool.draft_kv.store(R, batch.draft_cache, dest[:, :cw])
    pool.lengths[R] = batch.lengths
    pool.prompt_lengths[R] = batch.prompt_lengths
    pool.budgets[R] = batch.budgets
    pool.generated.index_fill_(0, R, 0)  # (fill kernels: a Python 0 assigned by index
    pool.output.index_fill_(0, R, 0)  # would be uploaded first)
    pool.row_ids[R] = batch.row_ids
    timed(state, "prefill", t)


def schedule(pool: Pool, batch_size: int, reusable: list | None, step: int | None = None):
    """(pool rows, grouped, reuse) of the next step (host only; see module docstring).
    ``step``: steps run so far (default: the latest step any pool row was served at)."""
    if step is None:
        step = max(pool.served)
    active = pool.active()
    g = min(batch_size, len(active))
    patience = PATIENCE * -(-len(active) // g)
    key = lambda p: (pool.served[p], pool.rid[p])  # noqa: E731 least recently served, oldest
    starved = [p for p in active if step - pool.served[p] > patience]
    if reusable is not None and len(reusable) == g and not starved:
        return reusable, True, True
    buckets: dict = {}
    for p in active:
        buckets.setdefault(pool.n[p], []).append(p)
    full = [ps for ps in buckets.values() if len(ps) >= g]
    if starved:  # a group may serve only if it takes the row that waited longest
        first = min(starved, key=key)
        full = [ps for ps in full if first in ps]
    if full:
        best = min(full, key=lambda ps: min(map(key, ps)))
        return sorted(sorted(best, key=key)[:g]), True, False
    order = sorted(active, key=lambda p: (p not in starved, pool.n[p]) + key(p))
    return sorted(order[:g]), False, False


def build(pool: Pool, rows: list, R: torch.Tensor, reuse: bool, tcache, dcache) -> RaggedBatch:
    """The compute batch of pool rows ``rows`` (``R``: the same, [G] long on the device),
    right-aligned at the longest row's width; the caches are loaded from the pool (one
    gather each) unless ``reuse``."""
    dev = pool.tokens.device
    w = max(pool.n[p] for p in rows)
    n = pool.lengths.index_select(0, R)
    j = torch.arange(w, device=dev)[None, :]
    pad = layout.new_padding(w, n)[:, None]
    valid = layout.slot_valid(j, pad)
    src = layout.slot_position(layout.TORCH, j, pad).expand(len(rows), w)  # pool slot = position
    tokens = torch.where(valid, pool.tokens.index_select(0, R).gather(1, src), PAD_FILL)
    cw = layout.cache_width(w)
    for pk, c in ((pool.kv, tcache), (pool.draft_kv, dcache)):
        if c is None:
            continue
        if reuse:
            c.crop(cw)
        else:
            pk.load(R, src[:, :cw], c)
    return RaggedBatch(tokens=tokens, valid=valid, positions=src, lengths=n,
                       finished=torch.zeros(len(rows), dtype=torch.bool, device=dev),
                       target_cache=tcache, draft_cache=dcache, **take_rows(pool, R, POOL_FIELDS))


def write_back(ctx, state, pool: Pool, rows: list, R: torch.Tensor, batch: RaggedBatch, spec,
               host) -> None:
    """Scatter the step's new KV slots, committed tokens and outputs into the pool rows
    (``rows``; ``R`` the same on the device); update the host lengths; free the rows that
    finished."""
    k, dev = spec.k, batch.device  # this step's drafts (max k_b)
    n = batch.lengths
    i = torch.arange(k + 1, device=dev)[None, :]
    dest = layout.verify_position(n[:, None], i)  # pool slots of pending, d_1 .. d_k
    first = layout.cache_width(batch.width)
    pool.kv.write_back(R, batch.target_cache, first, dest)
    if pool.draft_kv is not None:
        pool.draft_kv.write_back(R, batch.draft_cache, first, dest)
    tok_dest = layout.verify_position(n[:, None], i + 1)  # positions of y_0 .. y_k
    pool.tokens[R[:, None].expand_as(tok_dest), tok_dest] = spec.predictions
    pool.lengths[R] = layout.new_length(n, spec.committed)
    pool.generated[R] = batch.generated
    pool.output[R] = batch.output
    for b, p in enumerate(rows):
        pool.n[p] += host.committed[b]
        pool.kb[p] = host.next_lengths[b]
        pool.served[p] = state.step
        if host.finished[b]:
            pool.finished.append(pool.rid[p])
            pool.rid[p] = -1


def run(ctx, state, ids: list, *, batch_size: int, max_new_tokens: int, window: int,
        done: list) -> None:
    """Decode every prompt of ``ids`` through the pool; finished rows go to ``done``."""
    dev = next(ctx.target.parameters()).device
    budgets = [max_new_tokens] * len(ids)
    pool = Pool(ctx, ids, budgets, min(window, len(ids)), dev)
    state.stats.grouped_steps = 0
    state.info = lambda: {"pool": pool.state()}
    tcache = cache_mod.new_cache(ctx.target, pool.compute_capacity)
    dcache = cache_mod.new_cache(ctx.drafter.model, pool.compute_capacity) \
        if ctx.drafter.uses_cache else None
    if ctx.static_shapes:
        begin_static(ctx, state, min(batch_size, pool.size), pool.compute_capacity, tcache)
    admit(ctx, state, pool)
    reusable, R = None, None
    while pool.active():
        t = time.perf_counter()
        cost = StepCost(ctx, state)
        rows, grouped, reuse = schedule(pool, batch_size, reusable, state.step)
        # the rows' pool indices on the device: one upload per new group, none on reuse
        R = R if reuse else host_rows(rows, dev)
        batch = build(pool, rows, R, reuse, tcache, dcache)
        state.profile = PROFILE if grouped else FALLBACK_PROFILE
        # the step's width: max k_b of its rows (static shapes: its bucket)
        state.draft_k = next_draft_k(ctx, max(pool.kb[p] for p in rows))
        timed(state, "realign", t)
        emit(ctx, state, "realign", batch)
        spec = speculate(ctx, state, batch)
        host = sync(ctx, state, batch, spec)
        t = time.perf_counter()
        state.stats.grouped_steps += int(grouped)
        write_back(ctx, state, pool, rows, R, batch, spec, host)
        retire(batch, host, done)
        same = len(set(host.committed)) == 1 and not any(host.finished)
        reusable = rows if grouped and same else None
        timed(state, "realign", t)
        cost.observe(spec.k + 1, len(rows))
        admit(ctx, state, pool)


class ExSpec(Strategy):
    """A request pool larger than the batch; steps on groups of equal-length rows."""

    name = "exspec"
    profile = PROFILE  # of grouped steps; admit and the fallback set state.profile
    refills = True  # a finished row's pool place goes to the next waiting request
    options = (Option("window", int, "requests held in the pool (default 2x batch size)"),)

    def check_options(self, options: dict, *, batch_size: int) -> dict:
        window = validation.integer(options.get("window", default_window(batch_size)),
                         "window (requests in the pool)", minimum=1)
        if window < batch_size:
            raise ValueError(f"window (requests in the pool) must be an integer >= batch_size "
                             f"= {batch_size}, got {window!r}")
        return {"window": window}

    def run(self, ctx, state, ids, *, batch_size, max_new_tokens, done):
        run(ctx, state, ids, batch_size=batch_size, max_new_tokens=max_new_tokens,
            window=ctx.options["window"], done=done)


STRATEGY = ExSpec()
