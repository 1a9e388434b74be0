"""Whole-forward capture per bucket (issue #19, point 3): ``compile="cuda-graphs"``.

With static shapes (``specdec/static.py``) a decode or verify forward of the target has
one of a few input shapes per run: ``[B, q]`` tokens (``q`` is 1 or ``k + 1``) over a key
bucket of ``K`` slots. Each such bucket is captured once as a CUDA graph
(``torch.cuda.CUDAGraph``) of the model's whole forward, attention and cache writes
included, and replayed for every later forward of the same bucket: one launch instead of
the ~770 kernels of an eager step.

What a replay may not depend on is any host value of the capture: a graph replays the
kernels with the arguments they had then. So, while a forward is captured or replayed,
the ``SlabCache`` is addressed by tensors only (``SlabCache.addressed``):

- the new keys and values are written at ``offset + arange(q)`` (``index_copy_``), where
  ``offset`` is a 0-d device tensor that holds the cache width, filled (``fill_``, a
  kernel with a scalar argument: no host copy, no sync) before each replay;
- transformers' mask builder gets that tensor as the query offset
  (``get_query_offset``), and the key width ``K`` (the bucket) from ``get_mask_sizes``;
- the forward's inputs (ids, positions, the model's mask) are copied into the graph's own
  static tensors before each replay, and the logits are copied out of its memory after.

A bucket's key: rows, tokens per row, key width, which of the cache's two buffers holds
the store (a realignment swaps them: ``_Slab.swap``) and its shape, the offset tensor's
address, the input dtypes and mask kinds.

The model's forward hooks still see every forward (``guard_model``'s rules on the
inputs): the model is called as always (``Module.__call__``: pre-hooks, forward,
hooks), with its ``forward`` standing in for the graph for the call's duration, so the
hooks get the forward's own arguments (the 2-D mask) and an output with its logits.

Not captured (the forward runs eagerly, counted in ``ForwardGraphs.eager`` by reason): a
prefill (no key width: one shape per batch), a cache whose ``update`` is wrapped
(``guard_model``'s content rules learn from every update, which a replay does not call),
a cache other than a ``SlabCache``, and a bucket whose capture failed (the error is kept
in ``failures`` and the bucket runs eagerly from then on; its first forward's outputs are
recomputed eagerly, so a failed capture costs time, never tokens).

On a CPU there are no CUDA graphs; ``cpu_proxy()`` runs the same path with a stand-in that
checks what a graph would get wrong (tests, and a user who wants to know whether a model
can be captured before renting a GPU): "capture" runs the forward eagerly under
``invariants.testing.no_host_transfers()`` (a host read, an upload or a data-dependent
shape inside the forward would break a CUDA capture), and every "replay" runs it again
from the graph's static inputs with the cache's host width set back to the capture's,
so a forward that read the width on the host (rather than the offset tensor) computes
the wrong tokens, which the exactness tests see.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

#: model -> its ForwardGraphs, while a ``compiled(model, "cuda-graphs")`` block runs
_ACTIVE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

#: ``cpu_proxy()`` depth: "cuda-graphs" runs on a CPU with the stand-in backend
_PROXY = [0]


@contextlib.contextmanager
def cpu_proxy():
    """A block in which ``compile="cuda-graphs"`` runs on a CPU model with the stand-in
    backend (see the module docstring): capture under the host-transfer detector, replay
    from the static inputs with the capture's host state."""
    _PROXY[0] += 1
    try:
        yield
    finally:
        _PROXY[0] -= 1


def proxy_active() -> bool:
    return _PROXY[0] > 0


def active(model) -> "ForwardGraphs | None":
    """The graphs of ``model`` while a cuda-graphs block runs (None: eager)."""
    try:
        return _ACTIVE.get(model)
    except TypeError:  # not weakly referenceable
        return None


@contextlib.contextmanager
def installed(model):
    """Capture ``model``'s bucketed forwards for the block (``ForwardGraphs``); yields it.
    A model's graphs live as long as the block: their memory is freed after it."""
    graphs = ForwardGraphs(model)
    _ACTIVE[model] = graphs
    try:
        yield graphs
    finally:
        _ACTIVE.pop(model, None)


def _global_hooks() -> bool:
    hooks = torch.nn.modules.module
    return bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks)


def _copy_into(static, given) -> None:
    if isinstance(static, dict):
        for name, t in static.items():
            t.copy_(given[name])
    else:
        static.copy_(given)


def _clone(given):
    if isinstance(given, dict):
        return {name: t.clone() for name, t in given.items()}
    return given.clone()


def _signature(given) -> tuple:
    if isinstance(given, dict):
        return tuple((name,) + _signature(t) for name, t in sorted(given.items()))
    return (tuple(given.shape), given.dtype)


class _Graph:
    """One captured bucket: its static inputs, its output, and how to replay it."""

    __slots__ = ("ids", "pos", "mask", "out", "graph", "width")

    def __init__(self, ids, pos, mask):
        self.ids, self.pos, self.mask = ids.clone(), pos.clone(), _clone(mask)
        self.out = None
        self.graph = None  # torch.cuda.CUDAGraph (CUDA), None (the CPU stand-in)
        self.width = 0  # the cache's host width at capture (the stand-in replays with it)


class ForwardGraphs:
    """The captured forwards of one model (see the module docstring).

    ``captured``: buckets captured; ``replayed``: forwards served by a replay;
    ``eager``: forwards run eagerly, by reason; ``failures``: bucket key -> the error
    its capture raised."""

    def __init__(self, model):
        self.model = model
        self.graphs: dict = {}
        self.failures: dict = {}
        self.captured = 0
        self.replayed = 0
        self.eager: Counter = Counter()
        dev = next(model.parameters()).device
        self.cuda = dev.type == "cuda"
        if not self.cuda and not proxy_active():
            raise ValueError(f"compile='cuda-graphs' captures CUDA graphs: the model is on "
                             f"{dev.type!r} (specdec.graphs.cpu_proxy() runs the CPU stand-in)")
        self.pool = torch.cuda.graph_pool_handle() if self.cuda else None

    def counts(self) -> dict:
        return {"captured": self.captured, "replayed": self.replayed,
                "eager": dict(self.eager), "failed": len(self.failures)}

    def why_eager(self, cache) -> str | None:
        """Why this forward cannot run from a graph (None: it can)."""
        if not hasattr(cache, "slab") or not hasattr(cache, "addressed"):
            return "the cache is not a SlabCache"
        if "update" in vars(cache):
            return "the cache's update is wrapped (guard_model's content rules)"
        return None

    def forward(self, call, core, input_ids, positions, mask, cache, key_width: int,
                logits_to_keep: int, four_d=None):
        """The logits of a forward over ``cache`` served by a captured graph of its bucket
        (captured first), or eagerly where it cannot be (``why_eager``). ``call(ids, pos,
        mask)``: the model called as always (its hooks run), returning its logits;
        ``core(ids, pos, mask)``: the model's own forward, no hooks (what is captured).
        ``four_d``: a 2-D mask -> the 4-D mask(s) the model would build from it (a captured
        forward is handed those, so that transformers builds no mask from the cache's host
        width inside the graph)."""
        model = self.model
        if not (model._forward_hooks or model._forward_pre_hooks or _global_hooks()):
            return self._serve(core, input_ids, positions, mask, cache, key_width,
                               logits_to_keep, four_d)
        # hooks: the model is called as always, its forward standing in for the graph
        # (checked for eagerness inside: a pre-hook may wrap the cache's update)
        old = vars(model).get("forward")

        def served(*args, **kwargs):
            return CausalLMOutputWithPast(
                logits=self._serve(core, kwargs["input_ids"], kwargs["position_ids"],
                                   kwargs["attention_mask"], cache, key_width,
                                   logits_to_keep, four_d),
                past_key_values=cache)

        model.forward = served
        try:
            return call(input_ids, positions, mask)
        finally:
            if old is None:
                del model.forward
            else:
                model.forward = old

    def _serve(self, core, input_ids, positions, mask, cache, key_width, logits_to_keep,
               four_d):
        reason = self.why_eager(cache)
        if reason is not None:
            self.eager[reason] += 1
            return core(input_ids, positions, mask)
        if four_d is not None and isinstance(mask, torch.Tensor) and mask.dim() == 2:
            mask = four_d(mask)
        slab = cache.slab
        with cache.addressed():  # (from here on the forward reads the offset tensor)
            # the store's address and shape, and the offset's address: what a graph's
            # kernels read and write (a realignment swaps the store with the spare, a new
            # cache moves both)
            key = (input_ids.shape, key_width, slab.rows, logits_to_keep,
                   slab.store.data_ptr(), tuple(slab.store.shape), slab.store.dtype,
                   slab.offset.data_ptr(), input_ids.dtype, positions.dtype,
                   _signature(mask))
            if key in self.failures:
                self.eager["its bucket's capture failed"] += 1
                return core(input_ids, positions, mask)
            g = self.graphs.get(key)
            if g is None:
                try:
                    g = self._capture(core, input_ids, positions, mask, cache)
                except Exception as e:  # noqa: BLE001 - any failure: eager, kept with its reason
                    self.failures[key] = f"{type(e).__name__}: {e}"
                    self.eager["its bucket's capture failed"] += 1
                    # (the offset-addressed writes are idempotent: an eager forward now
                    # writes and attends what the failed capture may have half-written)
                    return core(input_ids, positions, mask)
                self.graphs[key] = g
                self.captured += 1
            self.replayed += 1
            return self._replay(g, core, input_ids, positions, mask, cache)

    def _capture(self, run, ids, pos, mask, cache) -> _Graph:
        g = _Graph(ids, pos, mask)
        g.width = cache.slab.width
        if self.cuda:
            # one eager warm-up on a side stream (the cache writes are addressed by the
            # offset, so running a forward twice writes the same slots with the same
            # values), then the capture, which runs nothing; the replay computes
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                run(g.ids, g.pos, g.mask)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                g.out = run(g.ids, g.pos, g.mask)
            g.graph = graph
        else:
            from invariants.testing import no_host_transfers

            with no_host_transfers():  # what would break a CUDA capture, on a CPU
                run(g.ids, g.pos, g.mask)
        return g

    def _replay(self, g: _Graph, run, ids, pos, mask, cache):
        g.ids.copy_(ids)
        g.pos.copy_(pos)
        _copy_into(g.mask, mask)
        if g.graph is not None:
            g.graph.replay()
            return g.out.clone()  # the graph's memory is reused by its next replay
        slab = cache.slab  # the stand-in: the capture's host state, only tensors current
        width, slab.width = slab.width, g.width
        try:
            return run(g.ids, g.pos, g.mask).clone()
        finally:
            slab.width = width
