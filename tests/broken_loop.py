"""A batched greedy loop with a planted bug: what an oracle must call a desync, in any
dtype (the calibrated rule must not excuse it)."""

from __future__ import annotations

import torch

#: bugs of ``broken_greedy``: each row's first real token masked out (the padding mask off
#: by one), or every generated token but the newest masked out (the mask not extended)
BROKEN_LOOPS = ("first_token_masked", "history_masked")


@torch.no_grad()
def broken_greedy(model, prompts, max_new_tokens: int, stop_ids=None,
                  bug: str = "history_masked") -> list[list[int]]:
    """A batched greedy loop (left padding, explicit positions, a ``DynamicCache``) with
    one bug of ``BROKEN_LOOPS``. Greedy ids per prompt, cut after the first stop token."""
    from transformers import DynamicCache

    assert bug in BROKEN_LOOPS, bug
    stops = {int(s) for s in ([model.generation_config.eos_token_id] if stop_ids is None
                              else stop_ids)}
    width = max(len(p) for p in prompts)
    tokens = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
    pad = torch.tensor([width - len(p) for p in prompts])[:, None]
    slots = torch.arange(width)[None, :]
    positions = (slots - pad).clamp(min=0)
    mask = (slots > pad if bug == "first_token_masked" else slots >= pad).long()
    cache, out = DynamicCache(), []
    logits = model(input_ids=tokens, position_ids=positions, attention_mask=mask,
                   cache=cache, use_cache=True).logits[:, -1]
    nxt_pos = positions[:, -1:] + 1
    for _ in range(max_new_tokens):
        nxt = logits.argmax(-1, keepdim=True)
        out.append(nxt)
        if bug == "history_masked" and len(out) > 1:
            mask[:, -1] = 0  # the previous generated token drops out of the context
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        logits = model(input_ids=nxt, position_ids=nxt_pos, attention_mask=mask,
                       cache=cache, use_cache=True).logits[:, -1]
        nxt_pos = nxt_pos + 1
    seqs = []
    for row in torch.cat(out, dim=1).tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        seqs.append(row[:cut])
    return seqs
