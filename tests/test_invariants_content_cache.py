"""How the content rules follow a cache's slots (``invariants.content``): key fingerprints
are equal for copies in any layout and dtype and differ for different bits; a cache that
computes its keys on access (the engine's ``SlabCache``: a view of its storage) is
followed without a fingerprint while nothing writes to its storage, and fingerprinted
again as soon as anything does, so a slot overwritten in place is still caught (C1).
"""

from __future__ import annotations

import pytest
import torch

from invariants import guard_model
from invariants import content as C

torch.set_num_threads(1)


def fingerprint(keys: torch.Tensor) -> list:
    words = C.key_words(keys)
    i = torch.arange(words.shape[1] * words.shape[3]).view(words.shape[1], words.shape[3])
    mult = ((i * 2 + 1) * C._HASH)[None, :, None, :]
    return C.key_fingerprint(keys, mult).tolist()


@pytest.mark.parametrize("dtype,d", [(torch.float32, 16), (torch.float32, 7), (torch.bfloat16, 16),
                                     (torch.bfloat16, 6), (torch.float16, 8), (torch.float64, 3)])
def test_a_copy_has_its_fingerprint_in_any_layout(dtype, d):
    g = torch.Generator().manual_seed(0)
    store = torch.randn(2, 3, 2, 12, d, generator=g).to(dtype)  # [L, B, H, capacity, D]
    view = store[1, :, :, 2:9]  # a strided view, as a slab's layer keys
    assert not view.is_contiguous()
    want = fingerprint(view.contiguous())
    assert fingerprint(view) == want == fingerprint(view.clone())
    moved = view[:, :, [6, 0, 3]]  # slots gathered elsewhere keep their fingerprints
    assert fingerprint(moved) == [[r[6], r[0], r[3]] for r in want]
    assert len({x for r in want for x in r}) == 3 * 7  # every slot its own


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_changed_bit_changes_the_fingerprint(dtype):
    keys = torch.randn(1, 2, 4, 8).to(dtype)
    keys[0, 1, 2, 5] = 0.0
    a = fingerprint(keys)
    keys[0, 1, 2, 5] = -0.0  # zero's other sign: one bit apart
    b = fingerprint(keys)
    assert a[0][2] != b[0][2] and a[0][:2] + a[0][3:] == b[0][:2] + b[0][3:]


def test_same_view_means_the_same_elements():
    store = torch.zeros(4, 6)
    a = store[1:3, :4]
    assert C.same_view(a, store[1:3, :4]) and C.same_view(a, a)
    assert not C.same_view(a, store[1:3, :5]) and not C.same_view(a, store[2:4, :4])
    assert not C.same_view(a, store.clone()[1:3, :4])  # another storage
    assert not C.same_view(a, store[1:3, :4].view(torch.int32))


# -- on the engine's cache ----------------------------------------------------------------

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]]
STEPS = 6


def slab_loop(target, corrupt_at=None):
    """Greedy decoding of PROMPTS on a ``SlabCache`` (explicit positions and mask);
    before forward ``corrupt_at``, row 0's cached slot 1 is overwritten in place with
    slot 2's keys and values (no slot moves: only the storage's version tells)."""
    from specdec import cache as cache_mod

    ids = torch.tensor(PROMPTS)
    b, w = ids.shape
    cache = cache_mod.new_cache(target, w + STEPS + 1)
    ones = lambda n: torch.ones(b, n, dtype=torch.long)  # noqa: E731
    logits = cache_mod.forward(target, ids, torch.arange(w)[None].expand(b, w), ones(w), cache)
    out = [[] for _ in PROMPTS]
    for step in range(STEPS):
        nxt = logits[:, -1].argmax(-1)
        for r in range(b):
            out[r].append(int(nxt[r]))
        if step == STEPS - 1:
            break
        if step == corrupt_at:
            store = cache.slab.store
            store[:, :, 0, :, 1] = store[:, :, 0, :, 2]
        n = cache.width
        logits = cache_mod.forward(target, nxt[:, None], torch.full((b, 1), n), ones(n + 1), cache)
    return out


def run(target, mode, corrupt_at, monkeypatch):
    how = []
    forward = C.Content._forward

    def spy(self, kind, rows):
        how.append(kind[5])
        return forward(self, kind, rows)

    monkeypatch.setattr(C.Content, "_forward", spy)
    with guard_model(target, mode, prompts=PROMPTS, max_new_tokens=STEPS,
                     raise_on_violation=False) as g:
        out = slab_loop(target, corrupt_at)
    g.check_outputs(out)
    return g, how


@pytest.mark.engine
@pytest.mark.parametrize("mode", ["strict", "fast"])
def test_an_untouched_slab_cache_is_followed_without_fingerprints(mode, monkeypatch):
    from specdec import models

    g, how = run(models.tiny("llama"), mode, None, monkeypatch)
    assert g.violations == [] and g.content.unknown == 0 and g.content.skipped == 0
    assert how == ["none"] + ["seen"] * (STEPS - 1)


@pytest.mark.engine
@pytest.mark.parametrize("mode", ["strict", "fast"])
def test_a_slot_overwritten_in_place_is_fingerprinted_and_caught(mode, monkeypatch):
    from specdec import models

    g, how = run(models.tiny("llama"), mode, 2, monkeypatch)
    assert how[:3] == ["none", "seen", "seen"] and how[3] in ("fp", "group")  # looked again
    v = g.violations[0]
    # a prompt token replaced: row 0's context starts with no registered prompt, at slot 1
    assert (v.invariant, v.trace["rows"], v.trace["slots"]) == ("C1", [0], [[1]]), str(v)


def test_multipliers_one_per_element_hash_the_float32_bits():
    """``key_fingerprint`` with ``[1, H, 1, D]`` multipliers (its earlier form) still
    gives an exact hash: of each element's float32 bits."""
    keys = torch.randn(2, 2, 5, 16)
    i = torch.arange(32).view(2, 16)
    mult = ((i * 2 + 1) * C._HASH)[None, :, None, :]
    want = (keys.view(torch.int32) * mult).sum(dim=3).sum(dim=1)
    assert torch.equal(C.key_fingerprint(keys, mult), want)
    assert torch.equal(C.key_fingerprint(keys[:, :, [3, 1]], mult), want[:, [3, 1]])
