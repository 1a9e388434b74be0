"""guard_model as a specification: silent on correct hand-driven loops, and each classic
mistake of a batched (speculative) decoding loop is caught at the forward that makes it.

The loops drive a tiny Llama built from transformers alone (no specdec) with a
``DynamicCache``; the correct ones are checked against batch-1 greedy decoding so that
"silent" means "silent on a loop that is really right". Hugging Face ``generate`` and the
specdec engine are in ``test_invariants_integration.py``.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from invariants import InvariantViolation, guard_model
from invariants._hf import cache_kwarg
from invariants.equivalence import greedy_reference
from invariants.testing import no_host_transfers
from toy_engine import hf_tiny_llama

torch.set_num_threads(1)

PROMPTS = [[5, 9, 13, 4, 8], [7, 3], [11, 12, 13]]
K = 3
STEPS = 4
VOCAB = 64


@pytest.fixture(scope="module")
def model():
    return hf_tiny_llama(seed=2, vocab=VOCAB)


@pytest.fixture(scope="module")
def refs(model):
    return [greedy_reference(model, p, STEPS * (K + 1) + K, ())[0] for p in PROMPTS]


def cached(model, cache) -> dict:
    """The cache keyword of this transformers (``cache`` in 5.x, ``past_key_values`` in 4.x)."""
    return {cache_kwarg(model): cache}


def drop_last_slot(cache, layer: int) -> None:
    """Crop one layer of a DynamicCache by one slot (5.x layers, or 4.x key/value lists)."""
    if hasattr(cache, "layers"):
        cache.layers[layer].crop(-1)
    else:
        cache.key_cache[layer] = cache.key_cache[layer][..., :-1, :]
        cache.value_cache[layer] = cache.value_cache[layer][..., :-1, :]


def left_pad(prompts):
    w = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), w, dtype=torch.long)
    mask = torch.zeros(len(prompts), w, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, w - len(p):] = torch.tensor(p)
        mask[b, w - len(p):] = 1
    return ids, mask


@torch.no_grad()
def greedy_loop(model, prompts, steps=5, positions="explicit"):
    """Left-padded batched greedy decoding. positions: "explicit" (right), "implicit"
    (none passed: the model counts padding), "slots" (explicit, but counting padding)."""
    ids, mask = left_pad(prompts)
    b, w = ids.shape
    cache = DynamicCache()

    def pos_kw(p):
        return {} if positions == "implicit" else {"position_ids": p}
    first = (mask.cumsum(1) - 1).clamp(min=0) if positions == "explicit" else \
        torch.arange(w).expand(b, w)
    logits = model(input_ids=ids, attention_mask=mask, **cached(model, cache),
                   **pos_kw(first)).logits[:, -1]
    n = mask.sum(1)
    outs = []
    for _ in range(steps):
        nxt = logits.argmax(-1)
        outs.append(nxt)
        c = cache.get_seq_length()
        mask = torch.cat([mask, torch.ones(b, 1, dtype=torch.long)], dim=1)
        p = n[:, None] if positions == "explicit" else torch.full((b, 1), c)
        logits = model(input_ids=nxt[:, None], attention_mask=mask, **cached(model, cache),
                       **pos_kw(p)).logits[:, -1]
        n = n + 1
    return torch.stack(outs, 1).tolist()


def drafts_for(ref, done, step, row):
    """The reference continuation with one wrong token at (2 * step + row) % (K + 1), so rows
    accept different numbers of drafts (index K: every draft right)."""
    d = list(ref[done : done + K])
    wrong = (2 * step + row) % (K + 1)
    if wrong < K:
        d[wrong] = (d[wrong] + 1) % VOCAB
    return d


@torch.no_grad()
def spec_loop(model, prompts, refs, mistake=None):
    """Speculative decoding with holes: after a verify step the cache is cropped to the
    longest kept row and the rejected slots of the other rows become holes in the mask.

    mistake: None, "positions_count_rejected", "mask_not_extended",
    "cache_not_cropped", "crop_to_min".
    """
    ids, mask = left_pad(prompts)
    b, w = ids.shape
    pad = w - mask.sum(1)
    cache = DynamicCache()
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=pos[:, :-1],
          **cached(model, cache))
    cache_mask = mask[:, :-1]
    pending = ids[:, -1]
    n = mask.sum(1)  # real tokens, the pending one included
    out = [[] for _ in prompts]
    i = torch.arange(K + 1)
    for step in range(STEPS):
        drafts = torch.tensor([drafts_for(refs[r], len(out[r]), step, r) for r in range(b)])
        c = cache.get_seq_length()
        m = cache_mask if mistake == "mask_not_extended" else \
            torch.cat([cache_mask, torch.ones(b, K + 1, dtype=torch.long)], dim=1)
        p = (c - pad)[:, None] + i if mistake == "positions_count_rejected" else (n - 1)[:, None] + i
        y = model(input_ids=torch.cat([pending[:, None], drafts], 1), attention_mask=m,
                  position_ids=p, **cached(model, cache)).logits.argmax(-1)
        match = (drafts == y[:, :K]).long().cumprod(1)
        a = match.sum(1)
        keep = int(a.min() if mistake == "crop_to_min" else a.max()) + 1
        if mistake != "cache_not_cropped" and keep < K + 1:
            cache.crop(-(K + 1 - keep))
        kept = torch.ones(b, keep, dtype=torch.long) if mistake == "crop_to_min" else \
            (torch.arange(keep)[None, :] <= a[:, None]).long()
        cache_mask = torch.cat([cache_mask, kept], dim=1)
        for r in range(b):
            out[r] += y[r, : int(a[r]) + 1].tolist()
        pending = y[torch.arange(b), a]
        n = n + a + 1
    return out


# -- silent on correct loops -------------------------------------------------------------

def test_silent_on_a_correct_left_padded_greedy_loop(model, refs):
    with guard_model(model) as g:
        out = greedy_loop(model, PROMPTS)
    assert g.forwards == 6 and g.violations == []
    assert out == [r[:5] for r in refs]


def test_silent_on_implicit_positions_without_padding(model, refs):
    with guard_model(model):
        out = greedy_loop(model, PROMPTS[:1], positions="implicit")
    assert out == [refs[0][:5]]


def test_silent_on_a_correct_speculative_loop_with_holes(model, refs):
    with guard_model(model) as g:
        out = spec_loop(model, PROMPTS, refs)
    assert g.forwards == STEPS + 1
    assert all(o == r[: len(o)] for o, r in zip(out, refs))
    assert len({len(o) for o in out}) > 1  # rows really accepted different numbers


def test_silent_on_hugging_face_generate_left_padded(model, refs):
    ids, mask = left_pad(PROMPTS)
    for mode in ("strict", "fast"):
        with guard_model(model, mode=mode) as g:
            out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                 pad_token_id=2, eos_token_id=None)
        assert g.forwards == 5 and g.violations == []
    assert out[:, ids.shape[1]:].tolist() == [r[:5] for r in refs]


# -- each mistake is caught ----------------------------------------------------------------

def test_exact_positions_catch_positions_left_implicit_with_left_padding(model):
    """positions="exact" keeps the strict rule: implicit positions must equal the number of
    valid slots before each new token (harmless on RoPE, but some users want it)."""
    with pytest.raises(InvariantViolation) as err:
        with guard_model(model, positions="exact"):
            greedy_loop(model, PROMPTS, positions="implicit")
    v = err.value
    assert (v.invariant, v.phase, v.step) == ("I3", "forward", 0)
    assert "positions left implicit" in v.rules[0]
    assert v.rows == [1, 2]  # the padded rows


def test_catches_positions_that_count_padded_slots(model):
    with pytest.raises(InvariantViolation) as err:
        with guard_model(model):
            greedy_loop(model, PROMPTS, positions="slots")
    assert err.value.invariant == "I3" and err.value.rows == [1, 2]


def test_catches_positions_that_count_rejected_slots(model, refs):
    with pytest.raises(InvariantViolation) as err:
        with guard_model(model):
            spec_loop(model, PROMPTS, refs, mistake="positions_count_rejected")
    assert err.value.invariant == "I3" and err.value.step == 2  # after the first rejection


def test_catches_a_mask_not_extended_for_the_new_tokens(model, refs):
    with pytest.raises(InvariantViolation) as err:
        with guard_model(model):
            spec_loop(model, PROMPTS, refs, mistake="mask_not_extended")
    assert err.value.invariant == "I4" and "width cache length + new tokens" in err.value.rules[0]


@pytest.mark.parametrize("mode", ["strict", "fast"])
def test_a_bucketed_mask_is_read_by_its_real_columns(model, mode):
    """A 2-D mask wider than C + q (a cache that attends a bucket of slots, specdec's static
    shapes) is coherent when every column past C + q is 0, and flagged (guard.mask_tail)
    when one of them lets a row attend a slot the cache does not hold."""
    ids = torch.tensor([[5, 9, 13], [7, 3, 4]])
    plain = model(input_ids=ids, attention_mask=torch.ones(2, 3, dtype=torch.long),
                  **cached(model, DynamicCache())).logits
    for tail, caught in (([0, 0], False), ([0, 1], True)):
        mask = torch.cat([torch.ones(2, 3, dtype=torch.long), torch.tensor([tail, [0, 0]])], 1)
        if not caught:
            with guard_model(model, mode) as g:
                out = model(input_ids=ids, attention_mask=mask, **cached(model, DynamicCache()))
            assert g.forwards == 1 and torch.equal(out.logits, plain)
            continue
        with pytest.raises(InvariantViolation) as err:
            with guard_model(model, mode):
                model(input_ids=ids, attention_mask=mask, **cached(model, DynamicCache()))
        v = err.value
        assert v.invariant == "I4" and v.rows == [0]
        assert "every column from 3 on (width 5) must be 0" in v.rules[0]
    # narrower than C + q stays a host failure, in every mode
    with pytest.raises(InvariantViolation, match="width cache length \\+ new tokens"):
        with guard_model(model, mode):
            model(input_ids=ids, attention_mask=torch.ones(2, 2, dtype=torch.long),
                  **cached(model, DynamicCache()))


def test_catches_a_cache_not_cropped_after_rejection(model, refs):
    with pytest.raises(InvariantViolation) as err:
        with guard_model(model):
            spec_loop(model, PROMPTS, refs, mistake="cache_not_cropped")
    assert err.value.invariant == "I4" and err.value.step == 2


def test_catches_a_cache_cropped_to_the_batch_minimum(model, refs):
    with pytest.raises(InvariantViolation) as err:
        with guard_model(model):
            spec_loop(model, PROMPTS, refs, mistake="crop_to_min")
    v = err.value
    assert v.invariant == "I3" and v.step == 2
    assert v.rows  # the rows that kept more tokens than the cache


def test_catches_cache_layers_of_different_lengths(model):
    ids = torch.tensor([[5, 6, 7]])
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, **cached(model, cache))
        drop_last_slot(cache, 1)
        with pytest.raises(InvariantViolation, match="same length"):
            with guard_model(model):
                model(input_ids=ids[:, :1], **cached(model, cache))


def test_catches_a_cache_position_that_is_not_the_cache_length(model):
    guard_ctx = guard_model(model)
    g = guard_ctx.__enter__()
    try:
        with pytest.raises(InvariantViolation, match="cache_position"):
            g._pre(model, (), {"input_ids": torch.tensor([[5, 6]]),
                               "cache_position": torch.tensor([1, 2])})
    finally:
        guard_ctx.__exit__(None, None, None)


# -- modes and lifecycle -----------------------------------------------------------------

def test_fast_mode_raises_when_the_block_ends(model):
    g = None
    with pytest.raises(InvariantViolation):
        with guard_model(model, mode="fast", positions="exact") as g:
            greedy_loop(model, PROMPTS, positions="implicit")
            assert g.violations == []  # nothing read yet
    assert g.violations and g.violations[0].invariant == "I3"


def test_fast_mode_checks_a_forward_without_reading_tensor_values(model):
    ids, mask = left_pad(PROMPTS)
    with guard_model(model, mode="fast", raise_on_violation=False, positions="exact") as g:
        with no_host_transfers():
            g._pre(model, (ids,), {"attention_mask": mask})  # implicit positions: wrong
    assert [v.invariant for v in g.violations] == ["I3"]


def test_recording_mode_collects_without_raising(model):
    with guard_model(model, raise_on_violation=False, positions="exact") as g:
        greedy_loop(model, PROMPTS, positions="implicit")
    assert len(g.violations) == 6  # every forward of the loop


def test_off_mode_installs_nothing(model):
    with guard_model(model, mode="off") as g:
        greedy_loop(model, PROMPTS, positions="implicit")
    assert g.forwards == 0


def test_hooks_are_removed_on_exit_and_after_an_exception(model):
    with guard_model(model):
        assert len(model._forward_pre_hooks) == 1
    assert len(model._forward_pre_hooks) == 0
    with pytest.raises(InvariantViolation):
        with guard_model(model, positions="exact"):
            greedy_loop(model, PROMPTS, positions="implicit")
    assert len(model._forward_pre_hooks) == 0


def test_the_guard_trace_shows_mask_and_positions(model):
    with pytest.raises(InvariantViolation) as err:
        with guard_model(model, run={"loop": "greedy-implicit"}, positions="exact"):
            greedy_loop(model, PROMPTS, positions="implicit")
    v = err.value
    text = str(v)
    assert "mask" in text and "want" in text and v.trace["source"] == "guard"
    assert v.slots[0] == [3, 4]  # row 1's two real tokens, at the wrong positions
    assert InvariantViolation.from_json(v.to_json()).trace == v.trace
    assert v.trace["run"] == {"loop": "greedy-implicit"}
