"""The only module that touches transformers cache internals.

``SlabCache`` keeps the key/value states of every layer in one preallocated tensor, the
slab, of shape ``[L, 2, B, H, capacity, D]`` (layer, key/value, row, kv head, slot, head
dim). A forward of ``q`` new tokens writes them in place at slots ``width .. width+q-1`` of
every layer and returns views ``[B, H, width+q, D]``; the engine then calls ``advance(q)``.
Because all layers live in one tensor, realignment is a single gather over the slot axis
for the whole model (no Python loop over layers or rows), and dropping finished rows is a
copy of the few rows that fill the finished rows' places (``keep_rows``). The gather writes
into a second buffer of the same size that then becomes the slab (double buffering: no
allocation and no copy-back per step), and copies move each slot's ``D``-vector as a few
wide elements instead of ``D`` scalars. Measured on the default model's cache shape (30
layers, batch 8, 460 slots, fp32, 2 CPU cores): a realignment gather went from 214 ms to
20 ms and a row drop from 132 ms (a full ``index_select``) to 4 ms; a plain copy of the
same data takes 14 ms. Memory: the steady state holds two buffers where it held one, but
every realignment used to allocate a temporary of the same size, so the peak is unchanged.
The spare is zeroed when made, so every slot of either buffer always holds a finite
value (computed K/V, stale K/V or zero).

Static shapes (``specdec/static.py``, ``generate(..., static_shapes=True)``): a forward
given ``key_width`` attends that many slots, a bucket ``>= width + q``: ``update`` returns
``[B, H, key_width, D]`` views and ``get_mask_sizes`` reports ``key_width``, and the
caller's mask is 0 past ``width + q`` (those slots hold finite stale values: masked, they
add exact zeros). ``reserve(rows)`` makes the first forward allocate both buffers for at
least ``rows`` rows, and one cache serves every batch of a run (``empty_rows``), so no
cache storage is allocated after the run's first prefill; row drops (``keep_rows``) and
realignments (``gather_slots``) already work within the two buffers.

Prefill without the padding (``prefill``): a batch of left-padded prompts of mixed
lengths spends most of one padded prefill forward on padding (44-63% of the tokens a batch
of 8 built-in prompts computes). On a CPU, where every computed token costs, the rows,
sorted by length, go through the forwards ``prefill_groups`` chooses (``split_cost``: what
one more forward costs, in tokens), each over the columns its longest row needs and into a
cache of its own, copied into the batch's slots. The engine's prefill and the plain
batched loop's both take it (a ``ModelDrafter``'s prefill stays one forward).

Written for transformers 5.24 (``SUPPORTED_TRANSFORMERS``; ``pyproject.toml`` allows
4.51 to 5.24 so that ``invariants`` installs into projects on transformers 4.x, and a
``SlabCache`` refuses any other version at run time, ``check_transformers``):
- the forward keyword is ``cache`` (``past_key_values`` is deprecated until 5.40);
- masks take the query offset from ``Cache.get_query_offset`` and sizes from
  ``CacheLayerMixin.get_mask_sizes``; layers must subclass ``CacheLayerMixin``;
- ``DynamicCache.crop(n)`` takes ``-tokens_to_drop`` (a positive ``n`` raises).
``tests/test_cache_api.py`` fails loudly when any of these change.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Sequence

import torch
import transformers

from . import graphs as graphs_mod

try:
    from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
except ImportError:  # transformers < 5: importing works, running the engine does not
    Cache = DynamicCache = DynamicLayer = object

#: the transformers release series whose cache internals this module is written for
SUPPORTED_TRANSFORMERS = "5.24"


class UnsupportedTransformersError(RuntimeError):
    """The installed transformers is not the one the engine's cache is written for."""


def transformers_supported(version: str | None = None) -> bool:
    v = transformers.__version__ if version is None else version
    return v == SUPPORTED_TRANSFORMERS or v.startswith(SUPPORTED_TRANSFORMERS + ".")


def check_transformers(version: str | None = None) -> None:
    """Refuse, with the fix, a transformers whose cache internals differ from 5.24's."""
    v = transformers.__version__ if version is None else version
    if not transformers_supported(v):
        raise UnsupportedTransformersError(
            f"specdec's engine needs transformers {SUPPORTED_TRANSFORMERS}.x: its KV cache "
            f"(specdec/cache.py) builds on that release's cache internals, found transformers "
            f"{v}. Install it with: pip install 'transformers>={SUPPORTED_TRANSFORMERS},<5.25'. "
            f"(The invariants checker alone works with transformers 4.51 to 5.24.)")

#: keyword under which a transformers 5.24 causal LM takes its cache
CACHE_KWARG = "cache"


class _Slab:
    """Shared storage of a ``SlabCache``: two buffers and the filled region.

    ``store`` and ``spare`` are ``[L, 2, R, H, capacity, D]`` with ``R`` the rows they were
    allocated for; the cache uses the first ``rows`` rows and ``width`` slots of ``store``.
    A realignment writes its result into ``spare`` and swaps the two, so no step allocates
    (a fresh large tensor costs a page fault per 4 KiB on first touch: on a CPU that was
    most of the realignment time) and nothing is copied back. ``spare`` is allocated on the
    first realignment, so a cache that is never realigned holds one buffer.
    """

    def __init__(self, num_layers: int, capacity: int):
        self.num_layers = num_layers
        self.capacity = capacity
        self.store: torch.Tensor | None = None
        self.spare: torch.Tensor | None = None
        self.rows = 0
        self.width = 0
        # keys a forward attends (static shapes: a bucket >= width + q); None: width + q
        self.key_width: int | None = None
        # static shapes: allocate the spare with the store, for at least reserve_rows rows
        # (nothing allocated later)
        self.reserve = False
        self.reserve_rows = 0
        self._ends: dict = {}  # id(buffer) -> (buffer, its K0 and V_last views)
        # whole-forward capture (``specdec/graphs.py``): while ``addressed``, writes go to
        # slots ``offset + arange(q)`` and the query offset is ``offset``, a 0-d long
        # device tensor holding the width (``SlabCache.addressed``), never a host int
        self.addressed = False
        self.offset: torch.Tensor | None = None

    @property
    def kv(self) -> torch.Tensor | None:
        """``[L, 2, rows, H, capacity, D]``: the rows in use (a view of ``store``)."""
        return None if self.store is None else self.store[:, :, : self.rows]

    def allocate(self, like: torch.Tensor, rows: int) -> None:
        """A fresh ``store`` for ``rows`` rows shaped like ``like`` (``[.., H, *, D]``);
        the spare is dropped (it is re-made at the size of the store when next needed)."""
        h, d = like.shape[-3], like.shape[-1]
        rows = max(rows, self.reserve_rows) if self.reserve else rows
        self.store = like.new_zeros((self.num_layers, 2, rows, h, self.capacity, d))
        self.spare = torch.zeros_like(self.store) if self.reserve else None
        self.rows = rows
        self._ends.clear()  # views of the old buffers must not keep them alive

    def fits(self, like: torch.Tensor, rows: int) -> bool:
        """True when ``rows`` rows of states like ``like`` fit in the current store."""
        st = self.store
        return (st is not None and rows <= st.shape[2] and st.dtype == like.dtype
                and st.device == like.device and st.shape[3] == like.shape[-3]
                and st.shape[5] == like.shape[-1])

    def spare_rows(self, rows: int) -> torch.Tensor:
        """The first ``rows`` rows of the spare buffer (made on first use, zeroed: every
        slot and row of either buffer always holds a finite value, which a forward attending
        a key bucket past the width, or a padded forward computing on a spare row
        (``SlabCache.padding_rows``), relies on)."""
        if self.spare is None or self.spare.shape != self.store.shape:
            self.spare = torch.zeros_like(self.store)
        return self.spare[:, :, :rows]

    def end_layers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(K of layer 0, V of the last layer) of the whole store, each ``[R, H, capacity,
        D]`` (views), made once per buffer (the store and the spare alternate)."""
        st = self.store
        hit = self._ends.get(id(st))
        if hit is None or hit[0] is not st:
            if len(self._ends) >= 2:
                self._ends.clear()
            hit = self._ends[id(st)] = (st, st[0, 0], st[-1, 1])
        return hit[1], hit[2]

    def swap(self, rows: int, width: int) -> None:
        """The spare now holds the content: make it the store."""
        self.store, self.spare = self.spare, self.store
        self.rows, self.width = rows, width


def as_wide_elements(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``[..., D]`` viewed with its last dimension as 16- or 8-byte elements when
    the layout allows, else ``t`` itself. Copies through the view move the same bytes with
    ``16 / itemsize`` (or ``8 / itemsize``) times fewer index lookups. The wide types are
    only copied, never computed with, so every bit pattern survives (tests/test_cache_api.py
    checks NaN payloads)."""
    size = t.shape[-1] * t.element_size()
    if t.stride(-1) != 1 or t.device.type not in ("cpu", "cuda"):  # e.g. MPS: no complex128
        return t
    for wide, width in ((torch.complex128, 16), (torch.int64, 8)):
        if t.element_size() < width and size % width == 0:
            try:
                return t.view(wide)
            except RuntimeError:  # strides or offset not multiples of the wide element
                continue
    return t


def _gather(kv: torch.Tensor, src: torch.Tensor, out: torch.Tensor) -> None:
    """``out[l, t, b, h, j] = kv[l, t, b, h, src[b, j]]`` over ``[L, 2, B, H, *, D]``
    tensors (one gather, the index broadcast over layers, heads and D)."""
    L, two, b, h, _, d = kv.shape
    c = src.shape[1]
    torch.gather(kv, 4, src.view(1, 1, b, 1, c, 1).expand(L, two, b, h, c, d), out=out)


class SlabLayer(DynamicLayer):
    """One layer's view of the slab; satisfies the transformers cache-layer interface."""

    is_sliding = False
    # True: the slab has a fixed capacity. It also keeps transformers (5.24
    # ``masking_utils.create_causal_mask``) from reading the padding mask on the host at
    # every one-token forward (``_ignore_causal_mask_sdpa``'s ``fast_all``: a stream sync
    # per decode step on a GPU) to decide whether the mask can be dropped: the mask is
    # always built, on the device (issue #19: one host read per step)
    is_compileable = True

    def __init__(self, slab: _Slab, layer_idx: int):
        super().__init__()
        self.slab = slab
        self.layer_idx = layer_idx

    def lazy_initialization(self, key_states, value_states):
        slab = self.slab
        if slab.store is None:
            slab.allocate(key_states, key_states.shape[0])
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        slab = self.slab
        w, q = slab.width, key_states.shape[-2]
        if slab.addressed:  # a captured forward: addressed by the offset tensor alone
            kv = slab.kv[self.layer_idx]
            at = slab.offset + torch.arange(q, device=slab.offset.device)
            kv[0].index_copy_(2, at, key_states)
            kv[1].index_copy_(2, at, value_states)
            return kv[0, :, :, : slab.key_width], kv[1, :, :, : slab.key_width]
        if w + q > slab.capacity:
            raise ValueError(
                f"cache capacity exceeded: width {w} + {q} new tokens > capacity {slab.capacity}"
            )
        kv = slab.kv[self.layer_idx]
        kv[0, :, :, w : w + q] = key_states
        kv[1, :, :, w : w + q] = value_states
        end = w + q if slab.key_width is None else slab.key_width  # static: the key bucket
        return kv[0, :, :, :end], kv[1, :, :, :end]

    @property
    def keys(self):
        kv = self.slab.kv
        return None if kv is None else kv[self.layer_idx, 0, :, :, : self.slab.width]

    @keys.setter
    def keys(self, value):  # DynamicLayer.__init__/reset assign; the slab owns storage
        pass

    @property
    def values(self):
        kv = self.slab.kv
        return None if kv is None else kv[self.layer_idx, 1, :, :, : self.slab.width]

    @values.setter
    def values(self, value):
        pass

    def get_seq_length(self) -> int:
        return self.slab.width

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        kw = self.slab.key_width
        return (self.slab.width + query_length if kw is None else kw), 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("SlabCache is realigned with gather_slots, never cropped")


class LayerTensors(Sequence):
    """The (K, V) views of a cache's layers, each made only when indexed; ``ends`` gives
    what KV provenance reads (``invariants/provenance.py``) in six view ops."""

    __slots__ = ("layers", "slab")

    def __init__(self, layers, slab: "_Slab"):
        self.layers, self.slab = layers, slab

    def ends(self, first: int = 0, last: int | None = None):
        """(K of layer 0, V of the last layer), each ``[B, H, q, D]`` (views, head-major):
        slots ``first .. last - 1`` of the filled width (``last`` None: to the width);
        two slicing ops each."""
        slab = self.slab
        end = slab.width if last is None else min(last, slab.width)
        k, v = slab.end_layers()
        b = slab.rows
        return k[:b, :, first:end], v[:b, :, first:end]

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self.layers)))]
        layer = self.layers[i]
        return layer.keys, layer.values


class SlabCache(Cache):
    """A transformers ``Cache`` over one slab tensor; see the module docstring."""

    def __init__(self, num_layers: int, capacity: int):
        check_transformers()
        slab = _Slab(num_layers, capacity)
        super().__init__(layers=[SlabLayer(slab, i) for i in range(num_layers)])
        self.slab = slab

    # -- engine-facing API -------------------------------------------------------------
    @property
    def width(self) -> int:
        """Filled slots C (every layer has the same width by construction)."""
        return self.slab.width

    @property
    def capacity(self) -> int:
        """Slots per row of the slab."""
        return self.slab.capacity

    def reserve(self, rows: int = 0) -> None:
        """Static shapes: allocate the spare buffer together with the store (at the first
        forward, or now when the store exists), both for at least ``rows`` rows, so that no
        step allocates cache storage."""
        slab = self.slab
        slab.reserve, slab.reserve_rows = True, rows
        if slab.store is not None:
            slab.spare_rows(0)

    def advance(self, q: int) -> None:
        """Declare that the last forward wrote ``q`` new slots in every layer."""
        self.slab.width += q

    @contextlib.contextmanager
    def addressed(self):
        """A block whose forwards (over a key width, ``_Slab.key_width``) address the
        cache by device tensors only, as a captured graph must (``specdec/graphs.py``):
        ``offset`` is filled with the width (a fill kernel, no host copy) and the layers
        write at ``offset + arange(q)``; transformers reads ``offset`` as the query
        offset (``get_query_offset``)."""
        slab = self.slab
        if slab.key_width is None or slab.store is None:
            raise ValueError("an addressed forward needs a filled cache and a key width "
                             "(static shapes)")
        if slab.offset is None or slab.offset.device != slab.store.device:
            slab.offset = torch.zeros((), dtype=torch.long, device=slab.store.device)
        slab.offset.fill_(slab.width)
        slab.addressed = True
        try:
            yield
        finally:
            slab.addressed = False

    def get_query_offset(self, layer_idx: int = 0):
        """transformers' query offset: the width, or, in an addressed forward, the 0-d
        device tensor that holds it (as its static caches do)."""
        if self.slab.addressed:
            return self.slab.offset
        return self.get_seq_length(layer_idx)

    def gather_slots(self, src: torch.Tensor) -> None:
        """Keep, per row, the slots ``src``.

        src: [B, C'] long, source slot of every destination slot (all < width).
        One ``gather`` over the whole slab into the spare buffer, which becomes the store;
        it moves whole ``D``-vectors as wide elements (``as_wide_elements``). Rows leave
        before it, with ``keep_rows``.
        """
        slab = self.slab
        if slab.store is None:
            raise RuntimeError("gather_slots before the first forward")
        w, (b, c_new) = slab.width, src.shape
        if b != slab.rows:
            raise ValueError(f"gather_slots: src has {b} rows, the cache {slab.rows}")
        if c_new > slab.capacity:
            raise ValueError(f"cache capacity exceeded: {c_new} slots > capacity {slab.capacity}")
        _gather(as_wide_elements(slab.kv[..., :w, :]), src,
                as_wide_elements(slab.spare_rows(b)[..., :c_new, :]))
        slab.swap(b, c_new)

    def keep_rows(self, moved_to: torch.Tensor, moved_from: torch.Tensor, kept: int) -> None:
        """Copy rows ``moved_from`` ([M] long, all ``>= kept``) onto rows ``moved_to`` ([M]
        long, all ``< kept``), then keep the first ``kept`` rows (``batch.rows_leaving``):
        finished rows leave by moving only the ``M`` rows that fill their places (through
        the spare buffer), not the whole cache. Before the first realignment made the
        spare, through a temporary of the ``M`` rows instead: making the spare zeroes a
        buffer as large as the store (about 14 ms for SmolLM2 at batch 8, a seventh of a
        step), which a batch whose steps are all plain never needs."""
        slab = self.slab
        if slab.store is None:
            raise RuntimeError("keep_rows before the first forward")
        w, m = slab.width, moved_to.shape[0]
        if m:
            kv = as_wide_elements(slab.kv[..., :w, :])
            if slab.spare is None:
                tmp = torch.index_select(kv, 2, moved_from)
            else:
                tmp = as_wide_elements(slab.spare_rows(m)[..., :w, :])
                torch.index_select(kv, 2, moved_from, out=tmp)
            kv.index_copy_(2, moved_to, tmp)
        slab.rows = kept

    def padding_rows(self, extra: int) -> bool:
        """Let the next forward run over ``extra`` rows past the rows in use (rows of the
        store nothing reads: their slots hold zeros or a departed row's states, finite
        either way); False when the store has no such rows. ``unpad`` ends it. A forward
        computes every row on its own, so the rows in use get what they would without."""
        slab = self.slab
        if slab.store is None or slab.rows + extra > slab.store.shape[2]:
            return False
        slab.rows += extra
        return True

    def unpad(self, extra: int) -> None:
        """Back to the rows in use after a forward over ``padding_rows(extra)``."""
        self.slab.rows -= extra

    def crop(self, width: int) -> None:
        """Forget every slot from ``width`` on (no copy: later forwards overwrite them)."""
        if not 0 <= width <= self.slab.width:
            raise ValueError(f"crop to {width} slots: the cache has {self.slab.width}")
        self.slab.width = width

    def empty_rows(self, b: int) -> None:
        """No filled slot, ``b`` rows (the store is reused when it has room for them)."""
        slab = self.slab
        if slab.store is not None:
            if b > slab.store.shape[2]:
                slab.allocate(slab.store, b)
            slab.rows = b
        slab.width = 0

    def load_rows(self, source: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
        """Fill row b, slot j from ``source`` row ``rows[b]``, slot ``src[b, j]``.

        source: [L, 2, R, H, S, D] (a ``SlotPool``); rows: [B] long; src: [B, C] long with
        ``src[b, j] <= j`` (so only the first C source slots are read). An
        ``index_select`` of the rows into the spare buffer, then one gather of ``B x C``
        slots over all layers into the store; the store is reused when it has room for B
        rows of the same dtype, device and head shape, else reallocated (same capacity).
        """
        b, c = src.shape
        slab = self.slab
        if c > slab.capacity:
            raise ValueError(f"cache capacity exceeded: {c} slots > capacity {slab.capacity}")
        if not slab.fits(source, b):
            slab.allocate(source, b)
        slab.rows, slab.width = b, c
        spare = as_wide_elements(slab.spare_rows(b)[..., :c, :])
        torch.index_select(as_wide_elements(source[..., :c, :]), 2, rows, out=spare)
        _gather(spare, src, as_wide_elements(slab.kv[..., :c, :]))

    def layer_widths(self) -> list[int]:
        """Width of every layer as transformers sees it (for I1)."""
        return [layer.get_seq_length() for layer in self.layers]

    def layer_tensors(self) -> "LayerTensors":
        """(K, V) of every layer, each ``[B, H, C, D]`` (views, made when indexed: KV
        provenance reads two layers per phase, deep checks every one)."""
        return LayerTensors(self.layers, self.slab)

    @property
    def batch_size(self) -> int:
        return -1 if self.slab.store is None else self.slab.rows


class SlotPool:
    """Key/value storage of up to ``rows`` requests, one pool row each, for a scheduler
    that forms compute batches from a larger pool (EXSPEC).

    Layout ``[L, 2, rows, H, capacity, D]`` like a slab, but each pool row is left-aligned:
    slot ``s`` holds the KV of the request's token at position ``s`` (no padding, so a row
    never needs realigning). Slot ``capacity - 1`` is the trash slot: scatters send
    padding there and nothing reads it. Three operations, each one or two indexing kernels
    over all layers that move whole ``D``-vectors as wide elements (no loop over rows or
    layers):

    - ``store(pool_rows, cache, dest)``: scatter a prefill cache into pool rows;
    - ``load(pool_rows, src, into)``: gather pool rows into a compute ``SlabCache``
      (through its spare buffer: no allocation per step);
    - ``write_back(pool_rows, cache, first, dest)``: scatter the slots a verify step wrote.
    """

    def __init__(self, rows: int, capacity: int):
        self.rows = rows
        self.capacity = capacity
        self.kv: torch.Tensor | None = None  # allocated like the first cache stored

    @property
    def trash(self) -> int:
        return self.capacity - 1

    def _ensure(self, like: torch.Tensor) -> torch.Tensor:
        if self.kv is None:
            L, two, _, h, _, d = like.shape
            self.kv = like.new_zeros((L, two, self.rows, h, self.capacity, d))
        return self.kv

    def _scatter(self, pool_rows: torch.Tensor, src: torch.Tensor, dest: torch.Tensor) -> None:
        # src [L, 2, B, H, C, D]; dest [B, C] pool slots; advanced indices (row, slot)
        # separated by a slice put their dims first: kv[:, :, R, :, S] is [B, C, L, 2, H, D]
        kv = as_wide_elements(self._ensure(src))
        rows = pool_rows[:, None].expand_as(dest)
        kv[:, :, rows, :, dest] = as_wide_elements(src).permute(2, 4, 0, 1, 3, 5)

    def store(self, pool_rows: torch.Tensor, cache: "SlabCache", dest: torch.Tensor) -> None:
        """Scatter the ``C = dest.shape[1]`` first slots of ``cache`` (row b) into pool row
        ``pool_rows[b]`` at slots ``dest[b]`` (``trash`` for padding)."""
        c = dest.shape[1]
        if c == 0 or cache.slab.kv is None:
            return
        self._scatter(pool_rows, cache.slab.kv[..., :c, :], dest)

    def write_back(self, pool_rows: torch.Tensor, cache: "SlabCache", first: int,
                   dest: torch.Tensor) -> None:
        """Scatter cache slots ``first .. first + q - 1`` (q = dest.shape[1]) of row b into
        pool row ``pool_rows[b]`` at slots ``dest[b]``."""
        q = dest.shape[1]
        self._scatter(pool_rows, cache.slab.kv[..., first : first + q, :], dest)

    def load(self, pool_rows: torch.Tensor, src: torch.Tensor, into: "SlabCache") -> None:
        """Fill ``into`` (batch row b, slot j) from pool row ``pool_rows[b]``, slot
        ``src[b, j]`` (``src[b, j] <= j``: right-aligning left-aligned rows moves slots
        right only); ``SlabCache.load_rows``: no allocation once ``into`` has room."""
        if src.shape[1] == 0:  # one-token rows: nothing cached (the pool may be unset)
            into.empty_rows(src.shape[0])
        else:
            into.load_rows(self.kv, pool_rows, src)


def sliding_window(model: torch.nn.Module) -> int | None:
    """The sliding window of ``model``'s sliding layers, None when no layer slides.

    A model may mix full-attention and sliding-window layers (``config.layer_types``,
    e.g. Gemma 3: five sliding layers to one full one); ``layer_types`` tells which."""
    cfg = model.config
    win = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    if not win or getattr(cfg, "use_sliding_window", True) is False:
        return None
    return int(win)


def layer_types(model: torch.nn.Module) -> tuple[str, ...] | None:
    """The attention kinds of a model mixing full and sliding layers (the keys of the mask
    mapping such a model takes), None when every layer attends alike."""
    types = getattr(model.config, "layer_types", None)
    if types is None or sliding_window(model) is None or len(set(types)) == 1:
        return None
    return tuple(sorted(set(types)))


def position_mask(model, attention_mask: torch.Tensor, key_positions: torch.Tensor,
                  query_positions: torch.Tensor, window: int | None,
                  query_slot: int | None = None) -> torch.Tensor:
    """The 4-D mask ``[B, 1, q, K]`` computed from positions, not slot indices: query
    i (slot ``C + i``) attends key slot j iff j is valid, j is not after the query's slot,
    and ``0 <= pos(query) - pos(key) < window`` (no window: ``window=None``). ``K`` is the
    mask's width, ``C + q`` unless static shapes bucket it (``query_slot``: ``C``, the
    first query's slot; None: ``K - q``).

    Transformers 5.24 builds the sliding mask over slot indices (``kv_idx > q_idx -
    window``), which is wrong as soon as holes separate slots from positions; a 4-D mask
    is used as given (``masking_utils._preprocess_mask_arguments`` returns it early). sdpa
    takes it as bool (True = attend), eager as an additive float mask.
    """
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    c_q = attention_mask.shape[1]
    q = query_positions.shape[1]
    dev = attention_mask.device
    kslot = torch.arange(c_q, device=dev)[None, :]
    first = c_q - q if query_slot is None else query_slot
    qslot = (first + torch.arange(q, device=dev))[:, None]
    kp, qp = key_positions[:, None, :], query_positions[:, :, None]
    allowed = attention_mask.bool()[:, None, :] & (kslot <= qslot)[None] & (kp <= qp)
    if window is not None:
        allowed = allowed & (kp > qp - window)
    allowed = allowed[:, None]
    if impl == "sdpa":
        return allowed
    if impl == "eager":
        dtype = next(model.parameters()).dtype
        zero = torch.zeros((), dtype=dtype, device=dev)
        return torch.where(allowed, zero, torch.finfo(dtype).min)
    raise NotImplementedError(
        f"position-based sliding-window masks are built for sdpa and eager attention, "
        f"not {impl!r}"
    )


def position_masks(model, attention_mask: torch.Tensor, key_positions: torch.Tensor,
                   query_positions: torch.Tensor, window: int, query_slot: int | None = None):
    """What a sliding-window model attends over holes: one ``position_mask`` when every
    layer slides; for a model mixing full and sliding layers, the mapping from layer type
    to mask that its forward takes in place of ``attention_mask`` (transformers 5.24:
    ``{"full_attention": ..., "sliding_attention": ...}``; a dict is used as given), the
    full layers' mask without the window."""
    types = layer_types(model)
    if types is None:
        return position_mask(model, attention_mask, key_positions, query_positions, window,
                             query_slot)
    return {t: position_mask(model, attention_mask, key_positions, query_positions,
                             window if t == "sliding_attention" else None, query_slot)
            for t in types}


def positions_matter(holes: bool, window: int | None) -> bool:
    """Whether a forward's mask must be built from positions (``key_positions``): only a
    layout with holes (slot distance differs from position distance) under a sliding
    window (the window counts positions). Otherwise the model's own mask over slots is
    the same mask."""
    return holes and window is not None


def model_mask(model, attention_mask: torch.Tensor, positions: torch.Tensor,
               key_positions: torch.Tensor | None = None, query_slot: int | None = None):
    """The attention mask ``forward`` gives ``model``: ``attention_mask`` (``[B, C + q]``,
    as long; the model builds its causal mask and window over slots), or, with
    ``key_positions`` on a sliding-window model, the mask(s) built from positions
    (``position_masks``). Engines record it for the checker (``ForwardRecord.model_mask``).
    ``query_slot``: the first query's slot when the mask is wider than ``C + q`` (static
    shapes' key bucket)."""
    if key_positions is not None:
        window = sliding_window(model)
        if window is not None:
            extra = () if query_slot is None else (query_slot,)
            return position_masks(model, attention_mask, key_positions, positions, window,
                                  *extra)
    return attention_mask.long()


def slot_masks(model, attention_mask: torch.Tensor, cached: int, q: int):
    """The 4-D mask(s) transformers would build from a 2-D ``attention_mask`` ``[B, K]``
    (causal and sliding window over slot indices: query i sits in slot ``cached + i``),
    built here, for a captured forward (``specdec/graphs.py``): handed a 4-D mask, the
    model builds none, so nothing in the graph depends on the cache width on the host
    (``position_masks`` with slot indices for positions)."""
    b, kw = attention_mask.shape
    dev = attention_mask.device
    kpos = torch.arange(kw, device=dev)[None, :].expand(b, kw)
    qpos = (cached + torch.arange(q, device=dev))[None, :].expand(b, q)
    window = sliding_window(model)
    if window is None:
        return position_mask(model, attention_mask, kpos, qpos, None, cached)
    return position_masks(model, attention_mask, kpos, qpos, window, cached)


def new_cache(model: torch.nn.Module, capacity: int) -> SlabCache:
    """A fresh ``SlabCache`` for ``model`` holding up to ``capacity`` slots."""
    return SlabCache(num_hidden_layers(model), capacity)


def num_hidden_layers(model: torch.nn.Module) -> int:
    cfg = model.config
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        if getattr(cfg, name, None):
            return int(getattr(cfg, name))
    raise ValueError(f"cannot find the number of layers in {type(cfg).__name__}")


def forward(model, input_ids, positions, attention_mask, cache, key_positions=None,
            last_logits: bool = False, mask=None, key_width: int | None = None):
    """One forward of ``model`` over new tokens with explicit positions and mask.

    input_ids:      [B, q] long
    positions:      [B, q] long, explicit position ids
    attention_mask: [B, cache.width + q] long/bool, valid over cache slots ++ new tokens
    key_positions:  [B, cache.width + q] long or None: position of every mask column.
                    Given when slots may have holes; for a sliding-window model the mask
                    is then built from positions (``position_masks``: one mask, or one
                    per layer type for a model mixing full and sliding layers),
                    otherwise unused.
    last_logits:    compute the LM head at the last new token only (prefill: the head over
                    every prompt slot would cost more than the whole transformer).
    mask:           ``model_mask`` of these arguments when the caller built it already
                    (to record what the model attends with); None: built here.
    key_width:      static shapes (``specdec/static.py``): the forward attends this many
                    key slots of a ``SlabCache`` (``>= cache.width + q``), and
                    ``attention_mask`` / ``key_positions`` are that wide (0 past
                    ``cache.width + q``); None: ``cache.width + q``.
    Returns logits [B, q, V] ([B, 1, V] with last_logits) and advances the cache by q.
    """
    q = input_ids.shape[1]
    if key_width is not None:
        need = cache.width + q
        if not need <= key_width <= cache.capacity or attention_mask.shape[-1] != key_width:
            raise ValueError(f"key_width must lie in [cache width + q, capacity] = [{need}, "
                             f"{cache.capacity}] and equal the mask's width "
                             f"{attention_mask.shape[-1]}, got {key_width}")
    if mask is None:
        mask = model_mask(model, attention_mask, positions, key_positions,
                          None if key_width is None else cache.width)
    keep = 1 if last_logits else 0

    def call(ids, pos, m):  # the model as always: its hooks see the forward
        return model(input_ids=ids, position_ids=pos, attention_mask=m, use_cache=True,
                     logits_to_keep=keep, **{CACHE_KWARG: cache}).logits

    if key_width is not None:
        cache.slab.key_width = key_width
    try:
        captured = graphs_mod.active(model) if key_width is not None else None
        if captured is None:
            logits = call(input_ids, positions, mask)
        else:  # compile="cuda-graphs": a graph per bucket
            own = vars(model).get("forward") or type(model).forward.__get__(model)
            cached = cache.width

            def core(ids, pos, m):  # the model's own forward, no hooks: what is captured
                return own(input_ids=ids, position_ids=pos, attention_mask=m, use_cache=True,
                           logits_to_keep=keep, **{CACHE_KWARG: cache}).logits

            logits = captured.forward(call, core, input_ids, positions, mask, cache, key_width,
                                      keep, lambda m: slot_masks(model, m, cached, q))
    finally:
        if key_width is not None:
            cache.slab.key_width = None
    if isinstance(cache, SlabCache):
        cache.advance(q)
    return logits


#: the cost of one more prefill forward, in padded prompt tokens computed, per device type
#: (``prefill_groups``). A CPU computes every token of a padded prefill, padding included,
#: and pays a forward's fixed cost (a pass over the weights) about once per 25 tokens of
#: SmolLM2-135M's prefill on one thread (3.2 ms a token, about 80 ms a batch-1 decode
#: forward): 64 splits only where a split saves more than twice that. A device type not
#: listed (CUDA: a prefill there is launch-bound, and no GPU has measured a split)
#: prefills in one forward.
SPLIT_FORWARD_TOKENS = {"cpu": 64}

#: a forward's dispatch (Python and op launches, whatever the model computes), in
#: floating-point operations of prefill work it could have done instead: about 2 ms at
#: 20 GFLOP/s. A small model's token costs about ``2 x parameters`` of them, so its split
#: must save at least this over ``2 x parameters`` tokens per forward (the tiny test models,
#: 90k parameters: 222 tokens; SmolLM2: the table's 64)
FORWARD_DISPATCH_FLOPS = 4e7


def split_cost(model, device: torch.device) -> float | None:
    """What one more prefill forward of ``model`` costs on ``device``, in tokens (None:
    never split there): ``SPLIT_FORWARD_TOKENS``, at least its dispatch
    (``FORWARD_DISPATCH_FLOPS`` over the model's FLOPs per token)."""
    per = SPLIT_FORWARD_TOKENS.get(device.type)
    if per is None:
        return None
    params = sum(p.numel() for p in model.parameters())
    return max(per, FORWARD_DISPATCH_FLOPS / max(2 * params, 1))


def prefill_groups(counts: list[int], forward_tokens: float) -> list[tuple[int, int]]:
    """The rows of a prefill split into forwards: ``counts`` are the rows' valid tokens,
    sorted ascending; returns ``(first, end)`` ranges of that order, each one forward over
    its rows padded to the count of its last row, that minimise the tokens computed plus
    ``forward_tokens`` per forward (exact dynamic programme over contiguous ranges, which
    is optimal for sorted counts; O(B^2) on the host). Rows with no valid token are in no
    range (nothing to compute)."""
    first = next((i for i, c in enumerate(counts) if c > 0), len(counts))
    n = len(counts)
    best = [0.0] * (n + 1)  # best[e]: rows first..e-1 covered
    cut = [first] * (n + 1)
    for e in range(first + 1, n + 1):
        best[e], cut[e] = min((best[a] + (e - a) * counts[e - 1] + forward_tokens, a)
                              for a in range(first, e))
    groups, e = [], n
    while e > first:
        groups.append((cut[e], e))
        e = cut[e]
    return groups[::-1]


def prefill(model, input_ids, positions, attention_mask, cache: "SlabCache",
            counts: list[int]):
    """``forward`` of a prefill (an empty ``SlabCache``, ``last_logits``) over left-padded
    rows, with the padding the rows do not need left out: ``counts[b]`` (host ints) is the
    number of valid tokens of row b (its last ``counts[b]`` columns). The rows, sorted by
    count, go through the forwards ``prefill_groups`` chooses at ``split_cost`` (per
    device type, at least a forward's dispatch), each over the last columns its longest
    row needs and into
    a cache of its own, whose slots are then copied to the same slots of ``cache`` (right
    alignment keeps a row's slot of every token). One forward when no split pays (always
    off a CPU). Every row computes exactly what it computes in any batch: its own tokens
    and positions under its own mask (invalid slots hold zeros, or a forward's states for
    its padding: finite, never attended). The row order is sorted on the device
    (``argsort`` of the mask's row sums, stable like the host's), so nothing is uploaded.
    Returns logits ``[B, 1, V]`` (zeros for a row with no valid token)."""
    b, q = input_ids.shape
    if len(counts) != b or cache.width != 0:
        raise ValueError(f"prefill needs an empty cache and one valid-token count per row: "
                         f"the cache holds {cache.width} slots, {len(counts)} counts for {b} rows")
    per_forward = split_cost(model, input_ids.device)
    if per_forward is None or b == 1:
        return forward(model, input_ids, positions, attention_mask, cache, last_logits=True)
    order_host = sorted(range(b), key=counts.__getitem__)
    sorted_counts = [counts[i] for i in order_host]
    groups = prefill_groups(sorted_counts, per_forward)
    if not groups or (len(groups) == 1 and groups[0] == (0, b)):
        return forward(model, input_ids, positions, attention_mask, cache, last_logits=True)
    order = torch.argsort(attention_mask[:, :q].sum(1), stable=True)
    slab, out = cache.slab, None
    for first, end in groups:
        m = sorted_counts[end - 1]
        rows = order[first:end]
        cols = slice(q - m, q)
        part = SlabCache(slab.num_layers, m)
        logits = forward(model, input_ids[rows, cols], positions[rows, cols],
                         attention_mask[rows, cols], part, last_logits=True)
        if slab.store is None:
            slab.allocate(part.slab.store[0, 0], b)
        slab.kv[..., q - m : q, :].index_copy_(2, rows, part.slab.kv[..., :m, :])
        if out is None:
            out = logits.new_zeros((b,) + tuple(logits.shape[1:]))
        out.index_copy_(0, rows, logits)
    cache.advance(q)
    return out


def crop_dynamic(cache: DynamicCache, tokens_to_drop: int) -> None:
    """Drop the last ``tokens_to_drop`` slots of a ``DynamicCache`` (5.24 convention)."""
    if tokens_to_drop:
        cache.crop(-tokens_to_drop)


def model_accepts_cache_kwarg(model) -> bool:
    """True when ``model.forward`` takes the cache under ``CACHE_KWARG`` (API drift check)."""
    params = inspect.signature(model.forward).parameters
    return CACHE_KWARG in params
