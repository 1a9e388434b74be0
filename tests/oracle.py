"""Reference oracles the engine's output is compared with: Hugging Face ``generate`` at
batch 1, and the engine package's own batch-1 decoding (greedy, or coupled sampling)
without stop tokens (cut at a chosen stop token afterwards)."""

from __future__ import annotations

import torch

_FREE: dict = {}


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


def free_reference(target, prompts, budget, key=None, sampling=None):
    """Batch-1 continuations without stop tokens, greedy or sampled (memoised per key)."""
    import specdec

    if key is None or key not in _FREE:
        ref = specdec.reference_generate(target, prompts, max_new_tokens=budget, stop_token_ids=[],
                                         sampling=sampling)
        if key is None:
            return ref
        _FREE[key] = ref
    return _FREE[key]


def cut_at_stop(seqs, stop_ids):
    """Output with stop tokens = the free continuation cut after the first stop (greedy or
    coupled sampling: the token at a position does not depend on what comes later)."""
    out = []
    for s in seqs:
        cut = next((i + 1 for i, t in enumerate(s) if t in stop_ids), len(s))
        out.append(s[:cut])
    return out
