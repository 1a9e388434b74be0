"""Test helpers and hypothesis strategies shared by the suite."""

from __future__ import annotations

import torch

#: prompt lengths mixed in one batch: from 1 token to 60
MIXED_LENGTHS = (1, 60, 7, 33, 2, 18, 45, 12)


def random_prompts(lengths, vocab: int, seed: int = 0, low: int = 3) -> list[list[int]]:
    """Seeded random prompts of the given lengths, ids in [low, vocab)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], max_new_tokens: int, stop_ids) -> list[int]:
    """Hugging Face generate at batch 1: the independent oracle (stop token kept)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=list(stop_ids),
                         pad_token_id=list(stop_ids)[0] if stop_ids else 0)
    ids = out[0, len(prompt):].tolist()
    for i, t in enumerate(ids):
        if t in stop_ids:
            return ids[: i + 1]
    return ids
