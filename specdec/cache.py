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


def new_cache(model: torch.nn.Module, capacity: int) -> SlabCache:
    """A fresh ``SlabCache`` for ``model`` holding up to ``capacity`` slots."""
    return SlabCache(num_hidden_layers(model), capacity)


def num_hidden_layers(model: torch.nn.Module) -> int:
    cfg = model.config
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        if getattr(cfg, name, None):
            return int(getattr(cfg, name))
    raise ValueError(f"cannot find the number of layers in {type(cfg).__name__}")


def forward(model, input_ids, positions, attention_mask, cache):
    """One forward of ``model`` over new tokens with explicit positions and mask.

    input_ids:      [B, q] long
    positions:      [B, q] long, explicit position ids
    attention_mask: [B, cache.width + q] long/bool, valid over cache slots ++ new tokens
    Returns logits [B, q, V] and advances the cache by q.
    """
    q = input_ids.shape[1]
    out = model(
        input_ids=input_ids,
        position_ids=positions,
        attention_mask=attention_mask.long(),
        use_cache=True,
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
