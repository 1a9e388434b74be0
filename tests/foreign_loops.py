"""Decoding loops written the way users of other projects write them, each driving a
Hugging Face causal LM directly (transformers and torch only: no specdec).

``speculative`` is batched greedy speculative decoding over left-padded rows: a draft
model proposes ``k`` tokens per row (recomputed over each row's context, no cache), the
target verifies ``[pending, d1..dk]`` with an explicit mask and positions over a
``DynamicCache``, the cache is cropped to the longest kept row and the rejected slots of
the other rows become holes in the mask. Correct, its outputs equal batch-1 greedy
decoding. Each ``fault`` reproduces one defect measured on published batched
speculative-decoding code, with every forward still coherent (mask width, positions and
cache lengths agree):

- ``verify_without_mask``: verify forwards pass no attention mask (and no positions), so
  left padding is attended as content;
- ``commit_first_mismatch``: the first mismatching draft is committed instead of the
  target's correction;
- ``stop_at_fastest``: every row stops when the fastest row reaches its budget;
- ``pad_eos_done``: a row counts as finished when its (left-padded) ids contain the stop
  id, which they do when pad == eos;
- ``draft_left_in_cache``: rejected drafts stay in the cache and the mask (extended over
  them, with positions counted from it) keeps them valid.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from invariants._hf import cache_kwarg

FAULTS = ("verify_without_mask", "commit_first_mismatch", "stop_at_fastest", "pad_eos_done",
          "draft_left_in_cache")


def left_pad(rows, pad: int):
    """(ids, mask) [B, W] long: every row right-aligned, ``pad`` to its left."""
    w = max(len(r) for r in rows)
    ids = torch.full((len(rows), w), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), w, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, w - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[b, w - len(r):] = 1
    return ids, mask


@torch.no_grad()
def draft_tokens(draft, contexts, k: int, pad: int) -> torch.Tensor:
    """[B, k] long: ``k`` greedy tokens of ``draft`` after each context (no cache)."""
    ctx = [list(c) for c in contexts]
    for _ in range(k):
        ids, mask = left_pad(ctx, pad)
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        nxt = draft(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].argmax(-1)
        for c, t in zip(ctx, nxt.tolist()):
            c.append(t)
    return torch.tensor([c[len(c0):] for c, c0 in zip(ctx, contexts)], dtype=torch.long)


@torch.no_grad()
def speculative(target, draft, prompts, *, k: int = 3, max_new_tokens: int = 10,
                stop_token_ids=(), pad: int = 2, fault: str | None = None):
    """Generated ids per prompt (see the module docstring)."""
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
    stops = set(stop_token_ids)
    b = len(prompts)
    ids, mask = left_pad(prompts, pad)
    cache = DynamicCache()
    kw = {cache_kwarg(target): cache}
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    target(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=pos[:, :-1], **kw)
    cache_mask = mask[:, :-1]
    pending = ids[:, -1]
    n = mask.sum(1)  # [B] real tokens, the pending one included
    out = [[] for _ in prompts]
    done = [False] * b
    if fault == "pad_eos_done":
        done = [bool(stops & set(row)) for row in ids.tolist()]
    span = torch.arange(k + 1)
    while not all(done):
        drafts = draft_tokens(draft, [p + o for p, o in zip(prompts, out)], k, pad)
        inputs = torch.cat([pending[:, None], drafts], dim=1)
        m = torch.cat([cache_mask, torch.ones(b, k + 1, dtype=torch.long)], dim=1)
        if fault == "verify_without_mask":
            logits = target(input_ids=inputs, **kw).logits
        else:
            logits = target(input_ids=inputs, attention_mask=m,
                            position_ids=(n - 1)[:, None] + span, **kw).logits
        y = logits.argmax(-1)  # [B, k + 1]
        a = (drafts == y[:, :k]).long().cumprod(1).sum(1)  # [B] accepted drafts
        if fault == "draft_left_in_cache":
            kept = torch.ones(b, k + 1, dtype=torch.long)
            n = n + k + 1
        else:
            keep = int(a.max()) + 1
            if keep < k + 1:
                cache.crop(-(k + 1 - keep))
            kept = (torch.arange(keep)[None, :] <= a[:, None]).long()
            n = n + a + 1
        cache_mask = torch.cat([cache_mask, kept], dim=1)
        nxt = []
        for r in range(b):
            ar = int(a[r])
            if fault == "commit_first_mismatch" and ar < k:
                new = drafts[r, : ar + 1].tolist()
            else:
                new = y[r, : ar + 1].tolist()
            nxt.append(new[-1])
            for t in new:
                if done[r]:
                    break
                out[r].append(t)
                done[r] = t in stops or len(out[r]) == max_new_tokens
        pending = torch.tensor(nxt, dtype=torch.long)
        if fault == "stop_at_fastest" and any(len(o) >= max_new_tokens for o in out):
            break
    return out
