"""The only module that touches transformers cache internals.

``SlabCache`` keeps the key/value states of every layer in one preallocated tensor, the
slab, of shape ``[L, 2, B, H, capacity, D]`` (layer, key/value, row, kv head, slot, head
dim). A forward of ``q`` new tokens writes them in place at slots ``width .. width+q-1`` of
every layer and returns views ``[B, H, width+q, D]``; the engine then calls ``advance(q)``.
Because all layers live in one tensor, realignment is a single gather over the slot axis
for the whole model (no Python loop over layers or rows), and dropping finished rows is a
single ``index_select`` over the row axis.

Tested against transformers 5.24 (``pyproject.toml`` pins ``>=5.24,<5.25``):
- the forward keyword is ``cache`` (``past_key_values`` is deprecated until 5.40);
- masks take the query offset from ``Cache.get_query_offset`` and sizes from
  ``CacheLayerMixin.get_mask_sizes``; layers must subclass ``CacheLayerMixin``;
- ``DynamicCache.crop(n)`` takes ``-tokens_to_drop`` (a positive ``n`` raises).
``tests/test_cache_api.py`` fails loudly when any of these change.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

#: keyword under which a transformers 5.24 causal LM takes its cache
CACHE_KWARG = "cache"


class _Slab:
    """Shared storage of a ``SlabCache``: the tensor and the number of filled slots."""

    def __init__(self, num_layers: int, capacity: int):
        self.num_layers = num_layers
        self.capacity = capacity
        # [L, 2, B, H, capacity, D], allocated on the first update
        self.kv: torch.Tensor | None = None
        self.width = 0


class SlabLayer(DynamicLayer):
    """One layer's view of the slab; satisfies the transformers cache-layer interface."""

    is_sliding = False
    is_compileable = False

    def __init__(self, slab: _Slab, layer_idx: int):
        super().__init__()
        self.slab = slab
        self.layer_idx = layer_idx

    def lazy_initialization(self, key_states, value_states):
        slab = self.slab
        if slab.kv is None:
            b, h, _, d = key_states.shape
            slab.kv = key_states.new_zeros((slab.num_layers, 2, b, h, slab.capacity, d))
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        slab = self.slab
        w, q = slab.width, key_states.shape[-2]
        if w + q > slab.capacity:
            raise ValueError(
                f"cache capacity exceeded: width {w} + {q} new tokens > capacity {slab.capacity}"
            )
        kv = slab.kv[self.layer_idx]
        kv[0, :, :, w : w + q] = key_states
        kv[1, :, :, w : w + q] = value_states
        return kv[0, :, :, : w + q], kv[1, :, :, : w + q]

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
        return self.slab.width + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("SlabCache is realigned with gather_slots, never cropped")


class SlabCache(Cache):
    """A transformers ``Cache`` over one slab tensor; see the module docstring."""

    def __init__(self, num_layers: int, capacity: int):
        slab = _Slab(num_layers, capacity)
        super().__init__(layers=[SlabLayer(slab, i) for i in range(num_layers)])
        self.slab = slab

    # -- engine-facing API -------------------------------------------------------------
    @property
    def width(self) -> int:
        """Filled slots C (every layer has the same width by construction)."""
        return self.slab.width

    def advance(self, q: int) -> None:
        """Declare that the last forward wrote ``q`` new slots in every layer."""
        self.slab.width += q

    def gather_slots(self, src: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Keep batch rows ``rows`` (all when None) and, per kept row, the slots ``src``.

        src:  [B', C'] long, source slot of every destination slot (all < width).
        rows: [B'] long, indices into the current rows, or None.
        One ``index_select`` and one ``gather`` over the whole slab.
        """
        kv = self.slab.kv
        if kv is None:
            raise RuntimeError("gather_slots before the first forward")
        w = self.slab.width
        kv = kv[..., :w, :]
        if rows is not None:
            kv = kv.index_select(2, rows)
        L, two, b, h, _, d = kv.shape
        c_new = src.shape[1]
        idx = src.view(1, 1, b, 1, c_new, 1).expand(L, two, b, h, c_new, d)
        gathered = torch.gather(kv, 4, idx)
        if rows is not None:  # fewer rows: a smaller slab (rare: once per finished row set)
            self.slab.kv = kv.new_empty((L, two, b, h, self.slab.capacity, d))
        # write back in place: no capacity-sized allocation per step
        self.slab.kv[..., :c_new, :] = gathered
        self.slab.width = c_new

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep batch rows ``rows`` ([B'] long), every slot unchanged: one ``index_select``
        over the row axis of the filled slots into a new slab (finished rows leave)."""
        kv = self.slab.kv
        if kv is None:
            raise RuntimeError("select_rows before the first forward")
        w = self.slab.width
        kept = kv[..., :w, :].index_select(2, rows)
        L, two, b, h, _, d = kept.shape
        self.slab.kv = kv.new_empty((L, two, b, h, self.slab.capacity, d))
        self.slab.kv[..., :w, :] = kept

    def crop(self, width: int) -> None:
        """Forget every slot from ``width`` on (no copy: later forwards overwrite them)."""
        if not 0 <= width <= self.slab.width:
            raise ValueError(f"crop to {width} slots: the cache has {self.slab.width}")
        self.slab.width = width

    def empty_rows(self, b: int) -> None:
        """No filled slot, ``b`` rows (the slab is reallocated only if it has other rows)."""
        kv = self.slab.kv
        if kv is not None and kv.shape[2] != b:
            L, two, _, h, cap, d = kv.shape
            self.slab.kv = kv.new_empty((L, two, b, h, cap, d))
        self.slab.width = 0

    def load(self, kv: torch.Tensor) -> None:
        """Replace the content by ``kv`` ([L, 2, B, H, C, D]): the slab is reused when the
        batch size is unchanged, else reallocated (same capacity)."""
        L, two, b, h, c, d = kv.shape
        if c > self.slab.capacity:
            raise ValueError(f"cache capacity exceeded: {c} slots > capacity {self.slab.capacity}")
        cur = self.slab.kv
        if cur is None or cur.shape[2] != b or cur.dtype != kv.dtype or cur.device != kv.device:
            self.slab.kv = kv.new_empty((L, two, b, h, self.slab.capacity, d))
        self.slab.kv[..., :c, :] = kv
        self.slab.width = c

    def layer_widths(self) -> list[int]:
        """Width of every layer as transformers sees it (for I1)."""
        return [layer.get_seq_length() for layer in self.layers]

    def layer_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(K, V) of every layer, each ``[B, H, C, D]`` (views; for deep checks)."""
        return [(layer.keys, layer.values) for layer in self.layers]

    @property
    def batch_size(self) -> int:
        kv = self.slab.kv
        return -1 if kv is None else kv.shape[2]


class SlotPool:
    """Key/value storage of up to ``rows`` requests, one pool row each, for a scheduler
    that forms compute batches from a larger pool (EXSPEC).

    Layout ``[L, 2, rows, H, capacity, D]`` like a slab, but each pool row is left-aligned:
    slot ``s`` holds the KV of the request's token at position ``s`` (no padding, so a row
    never needs realigning). Slot ``capacity - 1`` is the trash slot: scatters send
    padding there and nothing reads it. Three operations, each one indexing kernel plus
    one copy over all layers (no loop over rows or layers):

    - ``store(pool_rows, cache, dest)``: scatter a prefill cache into pool rows;
    - ``load(pool_rows, src, into)``: gather pool rows into a compute ``SlabCache``;
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
        kv = self._ensure(src)
        rows = pool_rows[:, None].expand_as(dest)
        kv[:, :, rows, :, dest] = src.permute(2, 4, 0, 1, 3, 5)

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
        ``src[b, j]``: one gather of ``B * C`` slots over all layers, one copy into the
        compute slab."""
        b, c = src.shape
        if c == 0:
            into.empty_rows(b)
            return
        rows = pool_rows[:, None].expand_as(src)
        into.load(self.kv[:, :, rows, :, src].permute(2, 3, 0, 4, 1, 5))


def sliding_window(model: torch.nn.Module) -> int | None:
    """The sliding window of ``model`` when every attention layer slides, None when none
    does. Models mixing full and sliding layers are refused (a single position-based mask
    cannot serve both)."""
    cfg = model.config
    win = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        sliding = [t == "sliding_attention" for t in types]
        if not any(sliding):
            return None
        if not all(sliding):
            raise NotImplementedError(
                f"{type(model).__name__} mixes full and sliding-window attention layers; "
                "position-based masks for holes support uniform sliding windows only"
            )
    if not win or getattr(cfg, "use_sliding_window", True) is False:
        return None
    return int(win)


def position_mask(model, attention_mask: torch.Tensor, key_positions: torch.Tensor,
                  query_positions: torch.Tensor, window: int) -> torch.Tensor:
    """The 4-D mask ``[B, 1, q, C + q]`` of a sliding-window model computed from positions,
    not slot indices: query i (slot ``C + i``) attends key slot j iff j is valid, j is not
    after the query's slot, and ``0 <= pos(query) - pos(key) < window``.

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
    qslot = (c_q - q + torch.arange(q, device=dev))[:, None]
    kp, qp = key_positions[:, None, :], query_positions[:, :, None]
    allowed = (attention_mask.bool()[:, None, :] & (kslot <= qslot)[None]
               & (kp <= qp) & (kp > qp - window))[:, None]
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
            last_logits: bool = False):
    """One forward of ``model`` over new tokens with explicit positions and mask.

    input_ids:      [B, q] long
    positions:      [B, q] long, explicit position ids
    attention_mask: [B, cache.width + q] long/bool, valid over cache slots ++ new tokens
    key_positions:  [B, cache.width + q] long or None: position of every mask column.
                    Given when slots may have holes; for a sliding-window model the mask
                    is then built from positions (``position_mask``), otherwise unused.
    last_logits:    compute the LM head at the last new token only (prefill: the head over
                    every prompt slot would cost more than the whole transformer).
    Returns logits [B, q, V] ([B, 1, V] with last_logits) and advances the cache by q.
    """
    q = input_ids.shape[1]
    mask = attention_mask.long()
    if key_positions is not None:
        window = sliding_window(model)
        if window is not None:
            mask = position_mask(model, attention_mask, key_positions, positions, window)
    out = model(
        input_ids=input_ids,
        position_ids=positions,
        attention_mask=mask,
        use_cache=True,
        logits_to_keep=1 if last_logits else 0,
        **{CACHE_KWARG: cache},
    )
    if isinstance(cache, SlabCache):
        cache.advance(q)
    return out.logits


def crop_dynamic(cache: DynamicCache, tokens_to_drop: int) -> None:
    """Drop the last ``tokens_to_drop`` slots of a ``DynamicCache`` (5.24 convention)."""
    if tokens_to_drop:
        cache.crop(-tokens_to_drop)


def model_accepts_cache_kwarg(model) -> bool:
    """True when ``model.forward`` takes the cache under ``CACHE_KWARG`` (API drift check)."""
    params = inspect.signature(model.forward).parameters
    return CACHE_KWARG in params
