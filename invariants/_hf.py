"""Small Hugging Face helpers shared by the deep checks, the oracle and the guard.

Tested against transformers 5.24 and 4.51 (CI runs the checker's tests on both):

- 5.24: a causal LM's forward takes its cache as ``cache=`` (``past_key_values=`` is the
  deprecated name, still accepted); a ``Cache`` holds ``layers`` with ``keys``/``values``;
- 4.51: the keyword is ``past_key_values=``; ``DynamicCache`` keeps ``key_cache`` and
  ``value_cache`` lists, read here through the same ``keys``/``values``/``get_seq_length``
  interface (``_ListLayer``), and so are legacy caches (a tuple of ``(key, value)`` per
  layer, which 4.x models such as GPT-2 still accept and return). A 4.x ``StaticCache``
  is not interpreted (its lists are preallocated: their width is not the length).

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
    if is_legacy_cache(cache):  # a tuple of (key, value) per layer (transformers 4.x)
        return [_ListLayer(kv[0], kv[1]) for kv in cache]
    inner = getattr(cache, "self_attention_cache", None)  # EncoderDecoderCache
    if inner is not None:
        cache = inner
    layers = getattr(cache, "layers", None)
    if layers is None and isinstance(getattr(cache, "key_cache", None), list) \
            and not hasattr(cache, "max_cache_len"):  # 4.x dynamic (a static one is not read)
        return [_ListLayer(k, v) for k, v in zip(cache.key_cache, cache.value_cache)]
    return list(layers or [])


def is_legacy_cache(cache) -> bool:
    """A legacy cache: a tuple (or list) of per-layer (key, value) tensor pairs."""
    return isinstance(cache, (tuple, list)) and len(cache) > 0 and all(
        isinstance(kv, (tuple, list)) and len(kv) >= 2 and isinstance(kv[0], torch.Tensor)
        for kv in cache)


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


#: config attributes that mean rotary position embeddings (4.x and 5.x names)
_ROPE_ATTRS = ("rope_theta", "rope_parameters", "rope_scaling", "rotary_dim", "rotary_pct",
               "partial_rotary_factor", "rotary_emb_base")


def relative_positions(model) -> bool:
    """Whether the model's attention sees only relative positions (RoPE or ALiBi), decided
    from its config: a constant per-row offset of every position changes nothing there.
    Absolute position embeddings (GPT-2's ``wpe``) and unknown configs count as absolute."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return False
    cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    if getattr(cfg, "alibi", False) or getattr(cfg, "model_type", None) == "bloom":
        return True
    if getattr(cfg, "position_embedding_type", None) not in (None, "rotary", "rope"):
        return False
    return any(getattr(cfg, a, None) is not None for a in _ROPE_ATTRS)


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


def model_dtype(model) -> torch.dtype:
    """The dtype the model computes its logits in (its output embedding's, else its
    first floating parameter's)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point():
        return weight.dtype
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _accepts(model, name: str) -> bool:
    return name in inspect.signature(model.forward).parameters


@torch.no_grad()
def shaped_logits(model, ids, *, padding: int = 0, split=(), batch: int = 1) -> torch.Tensor:
    """fp32 ``[V]``: the next-token logits after ``ids`` computed in a given shape.

    The row is left-padded by ``padding`` masked slots (explicit positions ``0 .. n-1`` on
    its real tokens). ``split`` gives the real tokens of each forward before the last one,
    which run at batch 1 over a ``DynamicCache`` (the first also covers the padding); the
    last forward takes the remaining tokens with the cache repeated to ``batch`` identical
    rows, the shape of an engine's batched step (a row's values never depend on the other
    rows' contents, only on the shapes). ``split=()`` and ``batch=1``: one plain forward.
    """
    from transformers import DynamicCache

    ids = [int(t) for t in ids]
    n = len(ids)
    sizes = [int(s) for s in split]
    if n < 1 or any(s < 1 for s in sizes) or sum(sizes) >= n:
        raise ValueError(f"split {tuple(sizes)} must cut the {n} tokens into positive parts "
                         f"that leave at least one token for the last forward")
    if padding < 0 or batch < 1:
        raise ValueError(f"padding must be >= 0 and batch >= 1, got padding={padding}, "
                         f"batch={batch}")
    dev = model_device(model)
    tokens = torch.tensor([ids[0]] * padding + ids, dtype=torch.long, device=dev)[None]
    mask = torch.ones_like(tokens)
    mask[:, :padding] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    cuts = [0]  # slot boundaries of the forwards (the first also covers the padding)
    for s in sizes:
        cuts.append(cuts[-1] + s + (padding if len(cuts) == 1 else 0))
    if batch > 1 and not sizes:
        cuts = []  # nothing runs before the batched forward: it takes the whole row
    kw = {"use_cache": bool(cuts[1:]) or batch > 1}
    if kw["use_cache"]:
        kw[cache_kwarg(model)] = DynamicCache()
    if _accepts(model, "logits_to_keep"):
        kw["logits_to_keep"] = 1
    for a, b in zip(cuts, cuts[1:]):
        model(input_ids=tokens[:, a:b], position_ids=positions[:, a:b],
              attention_mask=mask[:, :b], **kw)
    a = cuts[-1] if cuts else 0
    if batch > 1 and sizes:
        kw[cache_kwarg(model)].batch_repeat_interleave(batch)
    rep = lambda t: t.expand(batch, -1)  # noqa: E731
    out = model(input_ids=rep(tokens[:, a:]), position_ids=rep(positions[:, a:]),
                attention_mask=rep(mask), **kw)
    return out.logits[0, -1].float()


@torch.no_grad()
def forced_logits(model, prompt, output) -> torch.Tensor:
    """``[len(output) + 1, V]`` (the model's dtype): one batch-1 forward over
    ``prompt ++ output``; row ``i`` holds the next-token logits after ``output[:i]``."""
    ids = torch.as_tensor(list(prompt) + list(output), dtype=torch.long,
                          device=model_device(model))[None]
    keep = len(output) + 1
    if _accepts(model, "logits_to_keep"):
        return model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits[0]
    return model(input_ids=ids, use_cache=False).logits[0, -keep:]
