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
    c.gather_slots(src)
    assert c.layer_widths() == [2, 2, 2]
    for layer, (kk, vv) in enumerate(c.layer_tensors()):
        want = (k + 100 * layer)[torch.arange(2)[:, None], :, src].permute(0, 2, 1, 3)
        assert torch.equal(kk, want) and torch.equal(vv, -want)
    c.keep_rows(torch.tensor([0]), torch.tensor([1]), 1)
    c.gather_slots(torch.tensor([[1]]))
    assert c.batch_size == 1 and c.width == 1


def _filled_slab(layers: int, rows: int, heads: int, slots: int, dim: int, dtype) -> tuple:
    """A SlabCache whose slots hold random bit patterns (NaN payloads and signalling NaNs
    included for float dtypes), and the [L, 2, B, H, C, D] tensor it holds."""
    c = cache_mod.SlabCache(layers, slots + 2)
    bits = torch.randint(-2**15, 2**15, (layers, 2, rows, heads, slots, dim), dtype=torch.int16)
    if dtype.itemsize == 4:
        bits = torch.randint(-2**31, 2**31 - 1, bits.shape, dtype=torch.int64).to(torch.int32)
        bits.view(-1)[:4] = torch.tensor([0x7F800001, 0x7FC00001, -0x00800001, 0x7FBFFFFF],
                                         dtype=torch.int32)
    else:
        bits.view(-1)[:2] = torch.tensor([0x7C01, 0x7F81], dtype=torch.int16)
    kv = bits.view(dtype)
    for layer in range(layers):
        c.layers[layer].update(kv[layer, 0], kv[layer, 1], layer)
    c.advance(slots)
    return c, kv


@pytest.mark.parametrize("dtype,dim", [(torch.float32, 64), (torch.bfloat16, 64),
                                       (torch.float16, 8), (torch.float32, 2),
                                       (torch.float32, 3)])
def test_realignment_moves_every_bit_pattern_unchanged(dtype, dim):
    # the copies view each D-vector as 16- or 8-byte elements where they can (complex128
    # or int64); NaN payloads must survive that, and odd sizes take the plain path
    c, kv = _filled_slab(2, 3, 2, 6, dim, dtype)
    src = torch.tensor([[5, 0, 2], [1, 1, 4], [3, 5, 5]])
    c.gather_slots(src)
    want = kv[:, :, torch.arange(3)[:, None], :, src].permute(2, 3, 0, 4, 1, 5)
    got = torch.stack([torch.stack(layer) for layer in c.layer_tensors()])
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))
    c.keep_rows(torch.tensor([0]), torch.tensor([2]), 2)  # row 0 leaves, row 2 fills it
    got = torch.stack([torch.stack(layer) for layer in c.layer_tensors()])
    assert torch.equal(got.view(torch.uint8), want[:, :, [2, 1]].contiguous().view(torch.uint8))


def test_realignment_double_buffers_instead_of_allocating():
    # every realignment writes into the other of two buffers: after the first one, no
    # step allocates a new slab (a fresh large tensor costs a page fault per page)
    c, _ = _filled_slab(2, 4, 2, 6, 8, torch.float32)
    c.gather_slots(torch.tensor([[0, 1, 2]] * 4))
    buffers = {c.slab.store.data_ptr(), c.slab.spare.data_ptr()}
    for _ in range(3):
        c.gather_slots(torch.tensor([[0, 1, 2]] * c.batch_size))
        last = c.batch_size - 1
        c.keep_rows(torch.tensor([0]), torch.tensor([last]), last)  # row 0 leaves
        assert {c.slab.store.data_ptr(), c.slab.spare.data_ptr()} == buffers
    assert c.batch_size == 1 and c.width == 3
    c.empty_rows(3)  # fewer rows than the buffers hold: reused
    assert c.slab.store.data_ptr() in buffers and c.batch_size == 3 and c.width == 0


def test_gather_slots_refuses_a_source_map_of_the_wrong_shape():
    c, _ = _filled_slab(1, 2, 1, 4, 8, torch.float32)
    with pytest.raises(ValueError, match="src has 3 rows, the cache 2"):
        c.gather_slots(torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="capacity exceeded"):
        c.gather_slots(torch.zeros(2, 7, dtype=torch.long))


def test_keep_rows_moves_only_the_rows_that_fill_finished_places():
    c, kv = _filled_slab(2, 5, 2, 4, 8, torch.float32)
    c.keep_rows(torch.tensor([0, 2]), torch.tensor([3, 4]), 3)  # rows 0, 2 finished; 3, 4 fill them
    got = torch.stack([torch.stack(layer) for layer in c.layer_tensors()])
    assert c.batch_size == 3 and c.width == 4
    assert torch.equal(got.view(torch.uint8), kv[:, :, [3, 1, 4]].contiguous().view(torch.uint8))
