"""Fails loudly when transformers changes the cache API that specdec/cache.py relies on."""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers
from packaging.version import Version
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache

from specdec import cache as cache_mod
from specdec.batch import left_pad
from conftest import tiny_pair


def test_transformers_version_is_in_the_tested_range():
    v = Version(transformers.__version__)
    assert Version("5.24") <= v < Version("5.25"), (
        f"specdec/cache.py was tested against transformers 5.24.x, found {v}: re-check the "
        "cache API (cache keyword, crop sign, mask sizes) and widen the pin in pyproject.toml")


@pytest.mark.parametrize("family", ["llama", "qwen3", "glm4", "gpt2", "mistral"])
def test_forward_takes_the_cache_keyword(family):
    assert cache_mod.model_accepts_cache_kwarg(tiny_pair(family)[0])


def test_dynamic_cache_crop_takes_minus_the_tokens_to_drop():
    target, _ = tiny_pair("llama")
    c = DynamicCache()
    target(input_ids=torch.tensor([[5, 6, 7, 8]]), cache=c, use_cache=True)
    with pytest.raises(ValueError):
        c.crop(2)
    cache_mod.crop_dynamic(c, 1)
    assert c.get_seq_length() == 3


def test_cache_layer_interface_is_what_slab_layers_implement():
    for name in ("update", "get_mask_sizes", "get_seq_length"):
        assert hasattr(CacheLayerMixin, name)
    assert "get_query_offset" in dict(inspect.getmembers(Cache))
    c = cache_mod.SlabCache(2, 16)
    assert c.is_sliding == [False, False] and c.get_query_offset() == 0


@pytest.mark.parametrize("family", ["llama", "gpt2", "mistral"])
def test_slab_cache_gives_the_logits_of_a_dynamic_cache(family):
    target, _ = tiny_pair(family)
    tokens, valid, positions, _ = left_pad([[5, 6, 7, 8, 9], [10, 11]])
    slab = cache_mod.new_cache(target, 16)
    dyn = DynamicCache()
    with torch.no_grad():
        a = cache_mod.forward(target, tokens[:, :4], positions[:, :4], valid[:, :4], slab)
        b = target(input_ids=tokens[:, :4], position_ids=positions[:, :4],
                   attention_mask=valid[:, :4].long(), cache=dyn, use_cache=True).logits
        mask = valid
        a2 = cache_mod.forward(target, tokens[:, 4:], positions[:, 4:], mask, slab)
        b2 = target(input_ids=tokens[:, 4:], position_ids=positions[:, 4:],
                    attention_mask=mask.long(), cache=dyn, use_cache=True).logits
    assert slab.width == dyn.get_seq_length() == 5
    assert torch.allclose(a[valid[:, :4]], b[valid[:, :4]], atol=1e-5)
    assert torch.allclose(a2, b2, atol=1e-5)


def test_gather_slots_moves_all_layers_at_once():
    c = cache_mod.SlabCache(3, 8)
    k = torch.arange(2 * 1 * 4 * 2, dtype=torch.float32).view(2, 1, 4, 2)
    for layer in range(3):
        c.layers[layer].update(k + 100 * layer, -k - 100 * layer, layer)
    c.advance(4)
    src = torch.tensor([[3, 1], [0, 0]])
    c.gather_slots(src, rows=None)
    assert c.layer_widths() == [2, 2, 2]
    for layer, (kk, vv) in enumerate(c.layer_tensors()):
        want = (k + 100 * layer)[torch.arange(2)[:, None], :, src].permute(0, 2, 1, 3)
        assert torch.equal(kk, want) and torch.equal(vv, -want)
    c.gather_slots(torch.tensor([[1]]), rows=torch.tensor([1]))
    assert c.batch_size == 1 and c.width == 1
