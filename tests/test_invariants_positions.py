"""Implicit positions, judged by what they do: harmless on relative-position models when
every row keeps a constant offset (left padding), wrong where relative distances change
(holes, new tokens after right padding) or where the model adds absolute position
embeddings (GPT-2). ``positions="exact"`` keeps the strict rule. A test per family, each
built from transformers alone (the checker's 4.51 job runs this module too).

Also the cache types the guard reads on transformers 4.x and 5.x: a ``DynamicCache``
(``layers`` in 5.x, ``key_cache``/``value_cache`` lists in 4.x) and a legacy tuple of
``(key, value)`` per layer; every cache check fires on each.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from invariants import InvariantViolation, guard_model
from invariants._hf import cache_batch_sizes, cache_kwarg, cache_layers, cache_lengths, relative_positions
from toy_engine import HF_TINY_POSITIONS, hf_tiny

torch.set_num_threads(1)

RELATIVE = [f for f, kind in HF_TINY_POSITIONS.items() if kind == "relative"]
PROMPTS = [[5, 9, 13, 4, 8, 6], [7, 3], [11, 12, 13]]
_MODELS: dict = {}


def model_of(family):
    if family not in _MODELS:
        _MODELS[family] = hf_tiny(family)
    return _MODELS[family]


def left_padded(prompts, pad=2):
    w = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (w - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (w - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def last_logits_batch_1(model, prompts):
    with torch.no_grad():
        return torch.stack([model(input_ids=torch.tensor([p])).logits[0, -1] for p in prompts])


@pytest.mark.parametrize("family", list(HF_TINY_POSITIONS))
def test_the_kind_of_positions_is_read_from_the_config(family):
    assert relative_positions(model_of(family)) == (HF_TINY_POSITIONS[family] == "relative")


@pytest.mark.parametrize("family", RELATIVE)
def test_a_left_padded_forward_without_positions_is_harmless_and_silent(family):
    model = model_of(family)
    ids, mask = left_padded(PROMPTS)
    with guard_model(model) as g, torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, -1]
    assert g.violations == [] and g.forwards == 1
    # the claim the rule rests on: a constant offset changes nothing
    assert (logits - last_logits_batch_1(model, PROMPTS)).abs().max() < 1e-4


@torch.no_grad()
def cached_greedy(model, prompts, steps, explicit):
    ids, mask = left_padded(prompts)
    cache = DynamicCache()
    kw = {cache_kwarg(model): cache}
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, **kw,
                   **({"position_ids": pos} if explicit else {})).logits[:, -1]
    out = []
    for _ in range(steps):
        nxt = logits.argmax(-1)
        out.append(nxt)
        mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=torch.long)], dim=1)
        p = {"position_ids": mask.sum(1, keepdim=True) - 1} if explicit else {}
        logits = model(input_ids=nxt[:, None], attention_mask=mask, **kw, **p).logits[:, -1]
    return torch.stack(out, 1).tolist()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_20_step_cached_loop_with_implicit_positions_equals_explicit_and_is_silent(family):
    model = model_of(family)
    with guard_model(model) as g:
        implicit = cached_greedy(model, PROMPTS, 20, explicit=False)
    assert g.violations == [] and g.forwards == 21
    assert implicit == cached_greedy(model, PROMPTS, 20, explicit=True)


def test_absolute_positions_are_still_flagged_and_really_wrong():
    model = model_of("gpt2")
    ids, mask = left_padded(PROMPTS)
    with pytest.raises(InvariantViolation) as err:
        with guard_model(model), torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    assert err.value.invariant == "I3" and err.value.rows == [1, 2]
    assert "positions left implicit: the model uses" in err.value.rules[0]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, -1]
    assert (logits - last_logits_batch_1(model, PROMPTS))[1:].abs().max() > 1e-2


@pytest.mark.parametrize("family", RELATIVE)
def test_a_hole_before_a_new_token_is_flagged(family):
    model = model_of(family)
    ids = torch.tensor([[5, 9, 13, 4], [7, 3, 11, 12]])
    mask = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]])
    with pytest.raises(InvariantViolation) as err:
        with guard_model(model), torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    v = err.value
    assert (v.invariant, v.rows, v.slots) == ("I3", [0], [[2, 3]])
    assert "relative-position model" in v.rules[0]


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_a_new_token_after_right_padding_is_flagged(family):
    model = model_of(family)
    ids = torch.tensor([[5, 9, 2], [7, 3, 11]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    cache = DynamicCache()
    kw = {cache_kwarg(model): cache}
    with pytest.raises(InvariantViolation) as err:
        with guard_model(model), torch.no_grad():
            model(input_ids=ids, attention_mask=mask, **kw)  # right padding: harmless so far
            model(input_ids=torch.tensor([[4], [6]]), **kw,
                  attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1))
    assert (err.value.step, err.value.rows, err.value.slots) == (1, [0], [[3]])


@pytest.mark.parametrize("family", ["llama", "glm4"])
def test_exact_positions_keep_the_strict_rule(family):
    model = model_of(family)
    ids, mask = left_padded(PROMPTS)
    with pytest.raises(InvariantViolation, match="positions left implicit: the model uses"):
        with guard_model(model, positions="exact"), torch.no_grad():
            model(input_ids=ids, attention_mask=mask)


# -- the cache types of transformers 4.x and 5.x --------------------------------------------------

def kv(b, n, h=2, d=4):
    return torch.zeros(b, h, n, d), torch.zeros(b, h, n, d)


class ListCache:
    """A transformers 4.x ``DynamicCache`` as the checker reads it: per-layer lists."""

    def __init__(self, layers):
        self.key_cache = [k for k, _ in layers]
        self.value_cache = [v for _, v in layers]

    def get_seq_length(self, layer_idx=0):
        return self.key_cache[layer_idx].shape[-2]


def dynamic(layers):
    cache = DynamicCache()
    for i, (k, v) in enumerate(layers):
        cache.update(k, v, i)
    return cache


CACHE_TYPES = {"DynamicCache": dynamic, "4.x key_cache lists": ListCache, "legacy tuple": tuple}


@pytest.mark.parametrize("kind", list(CACHE_TYPES))
def test_every_cache_type_is_read(kind):
    cache = CACHE_TYPES[kind]([kv(3, 5), kv(3, 4)])
    assert len(cache_layers(cache)) == 2
    assert cache_lengths(cache) == [5, 4] and cache_batch_sizes(cache) == [3, 3]


@pytest.mark.parametrize("kind", list(CACHE_TYPES))
def test_every_cache_check_fires_on_every_cache_type(kind):
    model = model_of("llama")
    guard_ctx = guard_model(model)
    g = guard_ctx.__enter__()
    try:
        uneven = CACHE_TYPES[kind]([kv(2, 5), kv(2, 4)])
        with pytest.raises(InvariantViolation, match="same length"):
            g._pre(model, (), {"input_ids": torch.tensor([[5], [6]]), "past_key_values": uneven})
        other_batch = CACHE_TYPES[kind]([kv(3, 5), kv(3, 5)])
        with pytest.raises(InvariantViolation, match="batch size of the inputs"):
            g._pre(model, (), {"input_ids": torch.tensor([[5], [6]]),
                               "past_key_values": other_batch})
        narrow = CACHE_TYPES[kind]([kv(2, 5), kv(2, 5)])
        with pytest.raises(InvariantViolation, match="width cache length"):
            g._pre(model, (), {"input_ids": torch.tensor([[5], [6]]), "past_key_values": narrow,
                               "attention_mask": torch.ones(2, 5, dtype=torch.long)})
    finally:
        guard_ctx.__exit__(None, None, None)
