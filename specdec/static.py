"""Static shapes for decode and verify (issue #19, point 2): opt-in, ``static_shapes=True``.

A forward of the target over ``q`` new tokens with a cache of ``C`` filled slots attends
``C + q`` keys, and ``C`` changes at every step; so, eagerly, every step is a new shape
(a new CUDA graph, a new inductor specialisation). With static shapes:

- **key width buckets**: the forward attends ``K = key_bucket(C + q)`` keys, ``C + q``
  rounded up to a multiple of ``KEY_GRANULE`` slots (at most the cache's capacity). The
  attention mask is ``[B, K]``: the real mask over the ``C + q`` first columns, 0 after
  them; the ``SlabCache`` returns ``K`` slots of keys and values (``SlabCache`` docstring:
  the columns past ``C + q`` hold finite stale or zero values that the mask hides). A run
  sees at most ``ceil(capacity / KEY_GRANULE)`` key widths instead of one per step;
- **verify width buckets**: a verify forward covers ``k + 1`` tokens per row whenever any
  row drafts (``verify_drafts``), and 1 token on a step where no row drafts (a plain
  decode step), instead of ``max k_b + 1``: two widths per run. Rows that draft fewer
  than ``k`` tokens have their unused columns filled by the drafter's proposals and never
  accept them (``layout.draft_limit``);
- **fixed buffers** (``Buffers``): the forward's ``input_ids``, ``position_ids`` and 2-D
  attention mask are views of tensors allocated once per run for the run's most rows
  (``[R, q]`` per verify width, ``[R, capacity]`` for the mask), written in place every
  step. A batch of ``B <= R`` rows uses their first ``B`` rows: rows that finished leave
  by ``SlabCache.keep_rows`` moving the staying rows to the front, so the buffers stay
  where they are and a forward's input tensors always start at the same address. The
  number of distinct forward input shapes in a run is at most (row counts) x (verify
  widths) x (key widths), however many steps it runs (``tests/test_static_shapes.py``);
- **one cache per run**: ``FixedBatches`` sizes one ``SlabCache`` for its widest batch and
  reuses it for every batch (``SlabCache.reserve``: both buffers allocated before the
  first prefill), so no cache storage is allocated after the run's first prefill.

The design choice (eager keeps today's widths): on a CPU a verify column costs real
time (the adaptive policy exists because of it: ``specdec/policy.py``), so padding every
drafting step to ``k + 1`` columns and every forward to a key bucket costs work that a
graph replay does not win back there; on a GPU, where a step's cost is its launches and
one graph per shape replays them all, the few shapes are the point. So static shapes are
opt-in (``generate(..., static_shapes=True)``, ``reference_generate(...,
static_shapes=True)``), independent of ``compile=``; the tokens are the same either way
(greedy: the batch-1 reference, tested on every tiny family and strategy). Costs on the
CPU: ``benchmarks/throughput.py --static-shapes`` (README, issue #19 section).

Not covered: a ``ModelDrafter``'s own forwards (``specdec/drafters.py``) keep their eager
shapes; the prefill forward is one shape per batch. ``guard_model`` reads a bucketed
2-D mask by its first ``C + q`` columns and requires 0 past them (``guard.mask_tail``).
"""

from __future__ import annotations

import torch

#: key widths are rounded up to a multiple of this many slots (``key_bucket``)
KEY_GRANULE = 32


def checked(value, compile_mode=None) -> bool:
    """``static_shapes=`` checked at the boundary: True, False or None (the default: on
    with ``compile="cuda-graphs"``, whose graphs are captured per bucket, else off);
    ``TypeError`` for another type, ``ValueError`` for False with ``"cuda-graphs"``."""
    if value is None:
        return compile_mode == "cuda-graphs"
    if not isinstance(value, bool):
        raise TypeError(f"static_shapes must be True, False or None, got "
                        f"{type(value).__name__} {value!r}")
    if not value and compile_mode == "cuda-graphs":
        raise ValueError("compile='cuda-graphs' captures one graph per shape bucket, so it "
                         "needs static_shapes (True, or None: the default turns them on), "
                         "got static_shapes=False")
    return value


def key_bucket(needed: int, capacity: int, granule: int = KEY_GRANULE) -> int:
    """Keys a forward attends when it needs ``needed`` (``C + q``): ``needed`` rounded up to
    a multiple of ``granule``, at most ``capacity`` (host ints)."""
    if needed > capacity:
        raise ValueError(f"cache capacity exceeded: {needed} keys > capacity {capacity}")
    return min(capacity, -(-needed // granule) * granule)


def verify_drafts(needed: int, k: int) -> int:
    """Drafts of a verify step whose rows need at most ``needed`` (``max k_b``): ``k``
    when any row drafts, else 0 (two verify widths per run, ``k + 1`` and 1)."""
    return k if needed > 0 else 0


class Buffers:
    """The forward inputs of one run, allocated once and written in place.

    ids[q], pos[q]: [R, q] long for each verify width q in ``widths``
    mask:           [R, capacity] long: the 2-D attention mask (a view ``[:B, :K]``)
    kpos:           [R, capacity] long: key positions (sliding-window models with holes)
    masks4:         [R, 1, max q, capacity] bool or float: their 4-D masks (``hold``)
    """

    def __init__(self, rows: int, capacity: int, widths, device):
        self.rows, self.capacity = rows, capacity
        z = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=device)  # noqa: E731
        self.ids = {q: z(rows, q) for q in widths}
        self.pos = {q: z(rows, q) for q in widths}
        self.mask = z(rows, capacity)
        self.kpos = z(rows, capacity)
        self.widest = max(widths)
        # 4-D position masks [R, 1, max q, capacity] by (layer type, dtype): made at their
        # first use (only sliding-window models with holes build them)
        self.masks4: dict = {}

    def inputs(self, b: int, q: int, cached: int, capacity: int):
        """(ids [b, q], pos [b, q], mask [b, K], kpos [b, K]) views for a forward of ``q``
        tokens over ``cached`` cache slots, K = ``key_bucket(cached + q, capacity)``; the
        mask's columns from ``cached + q`` on are zeroed here, the rest is the caller's."""
        if q not in self.ids:
            raise ValueError(f"verify width {q} has no buffer: widths {sorted(self.ids)}")
        kw = key_bucket(cached + q, min(capacity, self.capacity))
        mask = self.mask[:b, :kw]
        mask[:, cached + q :].zero_()
        return self.ids[q][:b], self.pos[q][:b], mask, self.kpos[:b, :kw]

    def hold(self, given, kind=None):
        """A 4-D mask ``[B, 1, q, K]`` (or a dict of them per layer type) copied into this
        run's mask buffers: the same values at the same addresses every step (views)."""
        if isinstance(given, dict):
            return {t: self.hold(m, t) for t, m in given.items()}
        b, _, q, kw = given.shape
        key = (kind, given.dtype)
        if key not in self.masks4:
            self.masks4[key] = given.new_zeros((self.rows, 1, self.widest, self.capacity))
        view = self.masks4[key][:b, :, :q, :kw]
        view.copy_(given)
        return view


def real_columns(given, cols: int):
    """The mask a forward was given (2-D ``[B, K]``, 4-D ``[B, 1, q, K]`` or a dict of
    those per layer type) narrowed to its first ``cols`` key columns (views): what the
    checker's ``ForwardRecord`` holds (the columns past ``C + q`` are 0 by construction)."""
    if isinstance(given, dict):
        return {t: real_columns(m, cols) for t, m in given.items()}
    return given[..., :cols]
