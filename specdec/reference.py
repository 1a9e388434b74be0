"""Standard decoding of the target, greedy or sampled: the ground truth for output
equivalence.

Batch 1, or left-padded batches (every row grows by one token per step, so no
realignment is needed: the mask and positions simply extend). One host read per step
(has every row finished?), deferred by one forward (``hostread.DeferredRead``), and one
per batch for its outputs (issue #19). It runs through the same
forward path as the engine (``specdec.cache.forward`` over a ``SlabCache``) with explicit
positions and masks, and the same prefill (``specdec.cache.prefill``: on a CPU the
padding the rows do not need is left out, so the engine and this loop compare like with
like; Hugging Face ``generate`` prefills the padded rectangle). Rows that finished keep
being computed (their tokens are ignored), as in Hugging Face batched generation.
"""

from __future__ import annotations

import torch

from . import cache as cache_mod
from . import compiled as compiled_mod
from . import layout
from .batch import left_pad
from .hostread import DeferredRead
from . import sampling as sampling_mod
from . import static as static_mod
from . import validation
from .models import stop_token_ids as model_stop_ids


@torch.no_grad()
def reference_generate(target, prompts, *, max_new_tokens, batch_size=1, stop_token_ids=None,
                       tokenizer=None, return_margins=False, sampling=None, compile=None,
                       static_shapes=None):
    """Generated ids per prompt (stop token included where one ended the row): greedy, or
    plain sampling with ``sampling`` (a ``specdec.Sampling``; request i samples with
    (seed, i), so a row's ids depend only on its prompt, the seed, i and the parameters,
    not on the batch size). Mode "coupled": the coupled choice at every position;
    "rejection": inverse-CDF samples of the resample stream (what the rejection engine
    does with k = 0).

    With ``return_margins=True`` also returns, per prompt, the top-1 minus top-2 margin of
    the scores the choice maximised (greedy: the logits; coupled: ``logits / T + G``) at
    every generated position (a list of floats; not defined in rejection mode).
    Inputs are checked as ``specdec.generate`` checks them (``specdec.validation``).
    ``compile``: None, ``"inductor"`` or ``"cuda-graphs"``, the compiled fast path of
    ``specdec.generate`` (``specdec.compiled``) for this loop. ``static_shapes``: the
    decode forwards attend bucketed key widths through buffers written in place
    (``specdec.static``), as in ``specdec.generate``.
    """
    cache_mod.check_transformers()  # first: it decodes through the engine's cache
    ids, max_new_tokens, batch_size, stops = _checked_request(
        target, prompts, tokenizer, max_new_tokens, batch_size, stop_token_ids)
    sampling = sampling_mod.checked(sampling)
    mode = compiled_mod.check(compile, target)
    static_shapes = static_mod.checked(static_shapes, mode)
    if return_margins and sampling is not None and sampling.mode != "coupled":
        raise ValueError("return_margins needs greedy decoding or coupled sampling: rejection "
                         "sampling maximises no score (its tokens are random samples)")
    dev = next(target.parameters()).device
    stop_t = torch.tensor(stops, dtype=torch.long, device=dev)
    seqs, margins = [], []
    with compiled_mod.compiled(target, mode, whole=True):
        for start in range(0, len(ids), batch_size):
            chunk = ids[start : start + batch_size]
            out, marg = _decode_batch(target, chunk, max_new_tokens, stop_t, dev, sampling,
                                      start, return_margins, stops, static_shapes)
            seqs.extend(out)
            margins.extend(marg)
    return (seqs, margins) if return_margins else seqs


def _checked_request(target, prompts, tokenizer, max_new_tokens, batch_size, stop_token_ids):
    """A decoding request checked as ``specdec.generate`` checks it (``specdec.validation``):
    (prompt ids, max_new_tokens, batch_size, stop ids; the model's own when none given)."""
    ids = validation.prompt_ids(prompts, tokenizer)
    max_new_tokens, stops = validation.request(target, ids, max_new_tokens=max_new_tokens,
                                               stop_token_ids=stop_token_ids)
    batch_size = validation.integer(batch_size, "batch_size", minimum=1)
    return ids, max_new_tokens, batch_size, model_stop_ids(target) if stops is None else stops


def _decode_batch(target, prompts, max_new_tokens, stop_t, dev, sampling, first_row, margins,
                  stops, static_shapes=False):
    tokens, valid, positions, lengths = left_pad(prompts, device=dev)
    b, w = tokens.shape
    cache = cache_mod.new_cache(target, layout.contiguous_capacity(w, max_new_tokens, 0))
    logits = cache_mod.prefill(target, tokens, positions, valid, cache,
                               [len(p) for p in prompts])[:, -1]
    mask = valid
    pos = lengths.clone()
    bufs = None
    if static_shapes:  # the mask grows in place in a [b, capacity] buffer; ids, pos too
        bufs = static_mod.Buffers(b, cache.capacity, (1,), dev)
        bufs.mask[:, :w] = valid
        bufs.pos[1][:, 0] = pos
    outs, margs = [], []
    alive = torch.ones(b, dtype=torch.bool, device=dev)
    row_ids = first_row + torch.arange(b, device=dev)  # request index of each row
    no_drafts = torch.zeros(b, 0, dtype=torch.long, device=dev)
    for t in range(max_new_tokens):
        at = torch.full((b, 1), t, dtype=torch.long, device=dev)  # output position
        nxt = sampling_mod.choose(logits[:, None], sampling, row_ids, at, no_drafts)[:, 0]
        outs.append(nxt)
        if margins:
            margs.append(sampling_mod.choice_margins(logits, sampling, row_ids, at[:, 0]))
        if len(outs) == max_new_tokens:  # the budget: a host fact, no read
            break
        alive = alive & ~torch.isin(nxt, stop_t)
        # the step's one host read, deferred by a forward: the copy starts now, the next
        # forward is queued, then the host waits for the copy alone (rows finish rarely;
        # when they all did, that forward is wasted and its logits dropped)
        some_alive = DeferredRead(alive.any())
        if bufs is None:
            mask = torch.cat([mask, torch.ones(b, 1, dtype=mask.dtype, device=dev)], dim=1)
            logits = cache_mod.forward(target, nxt[:, None], pos[:, None], mask, cache)[:, -1]
            pos = pos + 1
        else:
            c = cache.width
            ids, bpos, bmask, _ = bufs.inputs(b, 1, c, cache.capacity)
            bmask[:, c] = 1
            ids[:, 0] = nxt
            logits = cache_mod.forward(target, ids, bpos, bmask, cache,
                                       key_width=bmask.shape[1])[:, -1]
            bpos += 1
        if not some_alive.tolist():
            break
    out = torch.stack(outs, dim=1).tolist()
    marg = torch.stack(margs, dim=1).tolist() if margins else [[] for _ in out]
    stop_set = set(stops)
    seqs, margins = [], []
    for row, mrow in zip(out, marg):  # host-side trimming of the final result
        cut = next((i + 1 for i, t in enumerate(row) if t in stop_set), len(row))
        seqs.append(row[:cut])
        margins.append(mrow[:cut])
    return seqs, margins


@torch.no_grad()
def hf_generate(target, prompts, *, max_new_tokens, batch_size=8, stop_token_ids=None,
                tokenizer=None):
    """Hugging Face's own batched greedy ``generate``, prompts left-padded in batches of
    ``batch_size``: an independent batched decoding loop (not specdec's forward path).
    Greedy ids per prompt, cut after the first stop token; inputs checked as in
    ``reference_generate``."""
    ids, max_new_tokens, batch_size, stops = _checked_request(
        target, prompts, tokenizer, max_new_tokens, batch_size, stop_token_ids)
    dev = next(target.parameters()).device
    pad = target.generation_config.pad_token_id
    pad = stops[0] if pad is None and stops else (0 if pad is None else pad)
    seqs = []
    for start in range(0, len(ids), batch_size):
        tokens, valid, _, _ = left_pad(ids[start : start + batch_size], device=dev)
        tokens = torch.where(valid, tokens, pad)
        out = target.generate(input_ids=tokens, attention_mask=valid.long(), do_sample=False,
                              max_new_tokens=max_new_tokens, eos_token_id=stops or None,
                              pad_token_id=pad, temperature=None, top_p=None, top_k=None)
        for row in out[:, tokens.shape[1]:].tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
            seqs.append(row[:cut])
    return seqs
