"""Known-bad batched speculative decoding engines, kept for forensics and tests.

Each reproduces one defect found in published batch speculative decoding code. They share
one naive loop that drives the model the way such code does: a Hugging Face
``DynamicCache``, new tokens appended at the right of the batch after every verify step,
rejected drafts left in place and masked (the "holes" layout: every row's pending token
in slot ``W - 1``). Without a defect the loop is exact (``fault=None``, tested); each
fault changes one thing:

======================  =====  ================================================  ==========
name                    issue  what goes wrong                                   caught by
======================  =====  ================================================  ==========
implicit_positions      (a)    rejected slots only masked and no explicit         I3
                               positions: the model numbers slots, so positions
                               count padded and rejected slots (the published
                               code pads on the right; the effect is the same)
mask_all_ones           (b)    padding re-added each step without stripping the   I4
                               old, and the mask is all ones: queries attend
                               padding and rejected slots
accept_first_mismatch   (c)    the first mismatching draft is committed instead   I6 (+ I7)
                               of the target's correction
crop_to_batch_min       (d)    the cache is cropped to the batch minimum of       I2 (+ I3)
                               committed tokens: rows that accepted more lose
                               the KV of their extra tokens
drop_bonus              (e)    the bonus token is dropped when every draft is     I6
                               accepted (output stays exact: not a desync,
                               only slower)
keep_after_stop         (f)    tokens after a stop token are kept (not a desync   I6 (+ the
                               of the prefix: the output runs on past the stop)   oracle: length)
======================  =====  ================================================  ==========

The naive loop itself is exact on full-attention models. On a sliding-window model it is
not: it hands the model a 2-D mask, transformers applies the window over slot indices, and
holes make slot distance differ from position distance. Its forwards record the model's
window, so the Monitor's ``I4.window`` (a query attends exactly the valid keys within the
window counted in positions) flags the first forward whose slot window drops a key; the
output oracle (I7) sees only the tokens that change. ``specdec``'s holes strategy builds
the mask from positions instead.

Every engine hands ``invariants.StepView`` objects to its hooks after each phase, with
profile "holes", so the ``Monitor`` checks it exactly as it checks the real engine; the
forwards go through the model, so ``guard_model`` sees them too.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from invariants.view import ForwardRecord

from .. import acceptance, layout
from ..batch import PAD_FILL, RaggedBatch, left_pad
from ..cache import CACHE_KWARG, SlabCache, crop_dynamic, sliding_window
from .. import validation
from ..phases import Stats
from ..models import stop_token_ids as model_stop_ids

KNOWN_BAD = {
    "implicit_positions": "(a) rejected slots only masked, no explicit positions",
    "mask_all_ones": "(b) padding re-added without stripping the old, mask all ones",
    "accept_first_mismatch": "(c) first mismatching draft accepted instead of the correction",
    "crop_to_batch_min": "(d) KV cache cropped to the batch minimum of committed tokens",
    "drop_bonus": "(e) bonus token dropped when all drafts are accepted",
    "keep_after_stop": "(f) tokens kept after a stop token",
}
#: the invariant whose trace names each defect first
EXPECTED_INVARIANT = {
    "implicit_positions": "I3", "mask_all_ones": "I4", "accept_first_mismatch": "I6",
    "crop_to_batch_min": "I2", "drop_bonus": "I6", "keep_after_stop": "I6",
}
#: the coverage trigger (``invariants.coverage.TRIGGERS``) without which each defect
#: cannot show: slot numbers, an all-ones mask and a committed mismatch need a rejected
#: draft (a hole; mixed prompt lengths show the first two as well), the batch-minimum crop
#: rows that go on with different counts, the dropped bonus a row accepting every draft,
#: the kept tokens a stop token. A run without it says nothing about the defect
TRIGGER = {
    "implicit_positions": "draft_rejected", "mask_all_ones": "draft_rejected",
    "accept_first_mismatch": "draft_rejected", "crop_to_batch_min": "ragged_realign",
    "drop_bonus": "all_accepted", "keep_after_stop": "stop_reached",
}
#: defects visible in the model's forward inputs, which ``guard_model`` flags too
GUARD_VISIBLE = ("implicit_positions", "mask_all_ones", "crop_to_batch_min")
#: defects that change the tokens (desyncs); the others keep the prefix exact
DESYNCS = ("implicit_positions", "mask_all_ones", "accept_first_mismatch", "crop_to_batch_min")


def _forward(model, ids, positions, mask, cache, fault, keep=0):
    kwargs = {"input_ids": ids, "attention_mask": mask.long(), "use_cache": True,
              "logits_to_keep": keep, CACHE_KWARG: cache}
    if fault == "mask_all_ones":
        kwargs["attention_mask"] = torch.ones_like(mask, dtype=torch.long)
    if fault != "implicit_positions":
        kwargs["position_ids"] = positions
    return model(**kwargs).logits


def _model_positions(valid, positions, fault, offset=0):
    """The positions the model will actually use (slot numbers when left implicit)."""
    if fault == "implicit_positions":
        w = valid.shape[1]
        return (torch.arange(w, device=valid.device)[None, :] + offset).expand_as(positions)
    return positions


def generate_known_bad(fault, target, prompts, *, drafter, k=4, max_new_tokens=32,
                       stop_token_ids=None, hooks=(), tokenizer=None, batch_size=None):
    """Run the naive engine with ``fault`` (a key of ``KNOWN_BAD``, or None for the exact
    naive engine) on ``prompts`` in batches of ``batch_size`` (default: one batch).
    Returns (sequences, Stats)."""
    if fault is not None and fault not in KNOWN_BAD:
        raise ValueError(f"unknown known-bad engine {fault!r}; expected one of {list(KNOWN_BAD)}")
    ids = validation.prompt_ids(prompts, tokenizer)
    max_new_tokens, stop_token_ids = validation.request(
        target, ids, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids)
    k = validation.integer(k, "k (drafts per step)", minimum=0)
    hooks = validation.hooks(hooks)
    validation.drafter(drafter)
    if hasattr(drafter, "check_compatible"):
        drafter.check_compatible(target)
    if hasattr(drafter, "bind"):
        drafter.bind(ids)
    size = len(ids) if batch_size is None else validation.integer(batch_size, "batch_size", minimum=1)
    seqs, stats = [], Stats()
    for index, start in enumerate(range(0, len(ids), size)):
        out = _run_batch(fault, target, ids[start : start + size], start, index, drafter=drafter,
                         k=k, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids,
                         hooks=hooks, stats=stats)
        seqs.extend(out)
    return seqs, stats


@torch.no_grad()
def _run_batch(fault, target, ids, row_offset, batch_index, *, drafter, k, max_new_tokens,
               stop_token_ids, hooks, stats):
    stops = model_stop_ids(target) if stop_token_ids is None else list(stop_token_ids)
    stop_t = torch.tensor(stops, dtype=torch.long)
    check_stops = stop_t if fault != "keep_after_stop" else stop_t[:0]
    tokens, valid, positions, lengths = left_pad(ids)
    b, w = tokens.shape
    # the naive engine's state, in the holes layout of DESIGN.md; its cache is the
    # DynamicCache below (the batch's SlabCache is a placeholder the drafters never use)
    st = RaggedBatch(
        tokens=tokens, valid=valid, positions=positions, lengths=lengths,
        prompt_lengths=lengths.clone(), budgets=torch.full((b,), max_new_tokens, dtype=torch.long),
        generated=torch.zeros(b, dtype=torch.long), finished=torch.zeros(b, dtype=torch.bool),
        row_ids=torch.arange(b) + row_offset,
        output=torch.zeros(b, layout.output_width(max_new_tokens, k), dtype=torch.long),
        target_cache=SlabCache(1, 1))
    cache = DynamicCache()
    window = sliding_window(target)  # recorded with every forward (I4.window)
    step_no = 0
    results: dict = {}

    def emit(phase, **extra):
        if not hooks:
            return
        widths = tuple(layer.get_seq_length() for layer in cache.layers) or (0,) * 1
        view = st.view(
            step=step_no, phase=phase, profile="holes", k=k, stop_token_ids=tuple(stops),
            positions=_model_positions(st.valid, st.positions, fault), cache_widths=widths,
            cache_batch_sizes=tuple(layer.keys.shape[0] if getattr(layer, "keys", None) is not None
                                    and layer.keys.numel() else b for layer in cache.layers) or (b,),
            model=target,
            cache_tensors=lambda: [(layer.keys, layer.values) for layer in cache.layers],
            info={"strategy": f"known-bad:{fault}", "batch_index": batch_index}, **extra)
        for hook in hooks:
            hook(phase, view)

    # prefill: every slot but the pending token
    if w > 1:
        pos = _model_positions(valid[:, : w - 1], positions[:, : w - 1], fault)
        _forward(target, tokens[:, : w - 1], pos, valid[:, : w - 1], cache, fault, keep=1)
        given = valid[:, : w - 1] if fault != "mask_all_ones" else torch.ones_like(valid[:, : w - 1])
        emit("prefill", forward=ForwardRecord(tokens[:, : w - 1], pos, given, 0, window=window))
    else:
        emit("prefill")
    drafter.prefill(st)

    while not bool(st.finished.all()):
        w = st.tokens.shape[1]
        active = ~st.finished
        remaining = torch.where(active, st.budgets - st.generated, 1)
        limit = torch.where(active, layout.draft_limit(layout.TORCH, k, remaining), 0)
        drafts = drafter.propose(st, k)
        emit("draft", drafts=drafts, draft_limit=limit)

        i = torch.arange(k + 1)[None, :]
        inputs = torch.cat([st.tokens[:, w - 1 :], drafts], dim=1)
        vpos = layout.verify_position(st.lengths[:, None], i)
        mask = torch.cat([st.valid[:, : w - 1], torch.ones(b, k + 1, dtype=torch.bool)], dim=1)
        used = vpos if fault != "implicit_positions" else (w - 1 + i).expand(b, -1)
        cache_before = cache.get_seq_length()
        predictions = _forward(target, inputs, used, mask, cache, fault).argmax(-1)
        emit("verify", drafts=drafts, draft_limit=limit, predictions=predictions,
             forward=ForwardRecord(inputs, used, mask if fault != "mask_all_ones" else torch.ones_like(mask),
                                   cache_before, window=window))

        accepted = acceptance.accepted_count(drafts, predictions, limit)
        committed, stopped = acceptance.committed_count(predictions, accepted, remaining, check_stops)
        chosen = predictions
        if fault == "accept_first_mismatch":
            # the draft at the first mismatch is committed instead of the correction
            use_draft = (i[:, :k] == accepted[:, None]) & (accepted[:, None] < limit[:, None])
            chosen = torch.cat([torch.where(use_draft, drafts, predictions[:, :k]), predictions[:, k:]], 1)
        if fault == "drop_bonus":
            full = (accepted == k) & (committed == k + 1)
            committed = torch.where(full, committed - 1, committed)
        committed = torch.where(active, committed, 0)
        before = st.generated
        written = torch.where(i < committed[:, None], chosen, 0)
        st.output = st.output.scatter(1, before[:, None] + i, written)
        st.generated = before + committed
        st.finished = st.finished | (active & (stopped | (st.generated >= st.budgets)))
        emit("commit", drafts=drafts, draft_limit=limit, predictions=chosen, accepted=accepted,
             committed=committed, generated_before=before)
        stats.steps += 1
        stats.drafted += int(limit.sum())
        stats.accepted += int(accepted.sum())
        stats.committed += int(committed.sum())
        step_no += 1

        # realign by appending: accepted drafts stay, rejected ones become holes, the new
        # pending token goes to slot W + k for every row (no copy)
        # finished rows leave the batch (their output is kept)
        if bool(st.finished.any()):
            for r, out, g in zip(st.row_ids.tolist(), st.output.tolist(), st.generated.tolist()):
                results[r] = out[:g]
            rows = torch.nonzero(~st.finished).squeeze(1)
            if rows.numel() == 0:
                break
            cache.batch_select_indices(rows)
            st = st.select(rows)
            chosen, committed, active = chosen.index_select(0, rows), committed.index_select(0, rows), active.index_select(0, rows)
            b = rows.numel()
        m = committed
        if fault == "crop_to_batch_min":
            keep = int(torch.where(active, m, k + 1).min())  # the published crop
            crop_dynamic(cache, k + 1 - keep)
            new_w = w + keep
        else:
            new_w = w + k + 1
        ext_tokens = torch.cat([st.tokens, chosen], dim=1)[:, :new_w].clone()
        ext_valid = torch.cat([st.valid, torch.zeros(b, new_w - w, dtype=torch.bool)], dim=1)
        j = torch.arange(new_w)[None, :]
        kept_draft = (j >= w) & (j < w + m[:, None] - 1) & (j < new_w - 1)
        last = chosen.gather(1, (m - 1).clamp(min=0)[:, None])
        ext_tokens[:, new_w - 1 :] = torch.where(m[:, None] > 0, last, ext_tokens[:, new_w - 1 :])
        ext_valid = ext_valid | kept_draft
        ext_valid[:, new_w - 1] = m > 0  # finished rows keep their old pending slot
        ext_tokens = torch.where(ext_valid, ext_tokens, PAD_FILL)
        lengths = st.lengths + m
        # explicit positions: valid slots before each slot; the pending token's position is
        # the engine's own count of committed tokens (they agree unless KV was cropped)
        ext_pos = torch.where(ext_valid, torch.cumsum(ext_valid.long(), 1) - 1, 0)
        ext_pos[:, -1] = torch.where(ext_valid[:, -1], lengths - 1, 0)
        st = st.replace(tokens=ext_tokens, valid=ext_valid, positions=ext_pos, lengths=lengths)
        emit("realign")
    return [results[row_offset + r] for r in range(len(ids))]
