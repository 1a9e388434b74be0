"""Small Hugging Face helpers shared by the deep checks, the oracle and the guard.

Tested against transformers 5.24 and 4.51 (CI runs the checker's tests on both):

- 5.24: a causal LM's forward takes its cache as ``cache=`` (``past_key_values=`` is the
  deprecated name, still accepted); a ``Cache`` holds ``layers`` with ``keys``/``values``;
- 4.51: the keyword is ``past_key_values=``; ``DynamicCache`` keeps ``key_cache`` and
  ``value_cache`` lists, read here through the same ``keys``/``values``/``get_seq_length``
  interface (``_ListLayer``).

``DynamicCache()`` built without a config holds every token of every layer (no
sliding-window eviction), which is what a clean reference prefill needs.
"""

from __future__ import annotations

import inspect

import torch


def cache_kwarg(model) -> str:
    """Keyword under which ``model.forward`` takes its cache."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class _ListLayer:
    """One layer of a transformers 4.x ``DynamicCache`` (``key_cache``/``value_cache``
    lists) with the 5.x layer interface the checker reads."""

    def __init__(self, keys, values):
        self.keys = keys if isinstance(keys, torch.Tensor) else None
        self.values = values if isinstance(values, torch.Tensor) else None

    def get_seq_length(self) -> int:
        k = self.keys
        return int(k.shape[-2]) if k is not None and k.dim() >= 2 and k.numel() else 0


def cache_layers(cache) -> list:
    """The self-attention layers of a transformers ``Cache`` (empty when unknown)."""
    if cache is None:
        return []
    inner = getattr(cache, "self_attention_cache", None)  # EncoderDecoderCache
    if inner is not None:
        cache = inner
    layers = getattr(cache, "layers", None)
    if layers is None and isinstance(getattr(cache, "key_cache", None), list):  # 4.x
        return [_ListLayer(k, v) for k, v in zip(cache.key_cache, cache.value_cache)]
    return list(layers or [])


def cache_lengths(cache) -> list[int]:
    """Logical length of every layer (``get_seq_length``: tokens seen, window or not)."""
    out = []
    for layer in cache_layers(cache):
        try:
            out.append(int(layer.get_seq_length()))
        except Exception:  # a layer kind that does not track lengths (linear attention)
            continue
    if not out and cache is not None and hasattr(cache, "get_seq_length"):
        out.append(int(cache.get_seq_length()))
    return out


def cache_batch_sizes(cache) -> list[int]:
    """Batch size of every initialised layer (uninitialised layers are skipped)."""
    out = []
    for layer in cache_layers(cache):
        keys = getattr(layer, "keys", None)
        if isinstance(keys, torch.Tensor) and keys.dim() >= 1 and keys.numel() > 0:
            out.append(int(keys.shape[0]))
    return out


def model_device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def clean_prefill(model, ids: torch.Tensor):
    """K/V per layer of a batch-1 prefill of ``ids`` ([n] long): list of (K, V) ``[H, n, D]``.

    Uses a fresh config-less ``DynamicCache`` (every slot kept) and the model's default
    positions ``0 .. n-1`` (batch 1, no padding).
    """
    from transformers import DynamicCache

    cache = DynamicCache()
    model(input_ids=ids[None, :], use_cache=True, **{cache_kwarg(model): cache})
    return [(layer.keys[0], layer.values[0]) for layer in cache_layers(cache)]


def choice_scores(logits: torch.Tensor, sampling, request: int, t: int) -> torch.Tensor:
    """[V]: what the choice at output position ``t`` of request ``request`` maximises:
    the logits (``sampling`` None, greedy), or ``sampling.scores`` (coupled sampling: see
    ``StepView.sampling``)."""
    if sampling is None:
        return logits
    if getattr(sampling, "mode", None) != "coupled":
        raise ValueError(f"a reference exists for greedy decoding and coupled sampling only, "
                         f"not for sampling mode {getattr(sampling, 'mode', None)!r} (its "
                         "output is a random sample: test its distribution instead)")
    dev = logits.device
    at = lambda v: torch.tensor([v], dtype=torch.long, device=dev)  # noqa: E731
    return sampling.scores(logits[None], at(request), at(t))[0]


@torch.no_grad()
def greedy_reference(model, prompt, max_new_tokens: int, stop_token_ids=(), sampling=None,
                     request: int = 0):
    """Batch-1 greedy decoding: (ids, margins), ids cut after the first stop token.

    ``margins[i]`` is the top-1 minus top-2 logit at generated position ``i``. With
    ``sampling`` (coupled sampling, see ``StepView.sampling``) each token is instead the
    argmax of ``sampling.scores`` for request ``request`` at its output position, and the
    margins are those of the scores: plain coupled sampling, by the model's own loop.
    """
    from transformers import DynamicCache

    dev = model_device(model)
    stops = {int(s) for s in stop_token_ids}
    ids = torch.as_tensor(list(prompt), dtype=torch.long, device=dev)[None, :]
    cache = DynamicCache()
    kw = cache_kwarg(model)
    out, margins = [], []
    logits = model(input_ids=ids, use_cache=True, **{kw: cache}).logits[0, -1]
    for t in range(int(max_new_tokens)):
        scores = choice_scores(logits, sampling, request, t)
        top = top2_margin(scores)
        nxt = int(scores.argmax())
        out.append(nxt)
        margins.append(top)
        if nxt in stops or len(out) == max_new_tokens:
            break
        step = torch.tensor([[nxt]], dtype=torch.long, device=dev)
        logits = model(input_ids=step, use_cache=True, **{kw: cache}).logits[0, -1]
    return out, margins


def top2_margin(logits: torch.Tensor) -> float:
    """top-1 minus top-2 of a [V] logit vector (inf when V == 1)."""
    if logits.shape[-1] < 2:
        return float("inf")
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


@torch.no_grad()
def teacher_forced_margin(model, prompt, prefix) -> tuple[float, int]:
    """(top-2 margin, argmax) of the model's next-token logits after ``prompt ++ prefix``."""
    dev = model_device(model)
    ids = torch.as_tensor(list(prompt) + list(prefix), dtype=torch.long, device=dev)[None, :]
    logits = model(input_ids=ids, use_cache=False).logits[0, -1]
    return top2_margin(logits), int(logits.argmax())
