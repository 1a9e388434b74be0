"""A plain step of the speculative loop costs what a step of plain decoding costs (issue
#17: a policy that drafts nothing must not be slower than not speculating).

Two differences used to make it dearer, each specified here:

- the extra forward: the loop's prefill left every row's last prompt token pending, so
  its first step ran a width-1 forward that plain decoding gets from its prefill. A
  batch whose first step is plain is now primed (``phases.prefill(prime=True)``): the
  prefill computes the pending token too and the first step verifies from its logits,
  so the loop runs as many target forwards as plain decoding, and outputs are unchanged;
- the row count: finished rows leave the batch, and on a CPU a product over 7 rows costs
  more than over 8 (``phases.padding_row``), so a plain step over such a row count runs
  one spare cache row along (``phases.verify_forward``); the rows in use get the logits
  and cache states they get without it.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import specdec
from conftest import tiny_pair
from invariants import Monitor
from specdec import cache as cache_mod, phases
from specdec.batch import left_pad
from specdec.policy import ForcedPolicy

torch.set_num_threads(1)
transformers.logging.set_verbosity_error()

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16], [3] * 9, [20, 21, 22],
           [30, 31, 32], [40, 41, 42, 43, 44]]
BUDGET = 12


class Forwards:
    """Counts the target's forwards by wrapping ``forward`` (a forward hook would turn
    padding off, ``phases.padding_row``)."""

    def __init__(self, model):
        self.model, self.count = model, 0
        self.inner = model.forward

        def counted(*args, **kwargs):
            self.count += 1
            return self.inner(*args, **kwargs)

        model.forward = counted

    def remove(self):
        del self.model.forward  # the class's forward again


@pytest.mark.parametrize("batch_size", [1, 3, 7])
def test_a_loop_that_never_drafts_runs_as_many_forwards_as_plain_decoding(batch_size):
    target, _ = tiny_pair("llama")
    zeros = ForcedPolicy([[0]] * len(PROMPTS))
    forwards = Forwards(target)
    try:
        plain = specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET,
                                           batch_size=batch_size, stop_token_ids=[])
        plain_forwards, forwards.count = forwards.count, 0
        res = specdec.generate(target, PROMPTS, k=3, batch_size=batch_size,
                               max_new_tokens=BUDGET, stop_token_ids=[], policy=zeros)
    finally:
        forwards.remove()
    assert res.sequences == plain
    assert res.stats.widths == {1: res.stats.steps}
    assert forwards.count == plain_forwards, (forwards.count, plain_forwards)


@pytest.mark.parametrize("strategy", ["eqspec", "holes"])
@pytest.mark.parametrize("monitor", [False, True], ids=["no-monitor", "strict-monitor"])
def test_a_primed_first_step_keeps_outputs_and_views_exact(strategy, monitor):
    """First steps plain (primed) and drafting (not primed) in one call, rows finishing
    at different steps; outputs equal batch-1 greedy and a strict Monitor finds nothing
    (the verify view's forward record describes the slot the prefill filled)."""
    target, _ = tiny_pair("llama")
    pattern = [[0, 2, 0, 3], [0], [1, 0], [0, 3]] * 2  # batches of 4: plain first, then drafting
    hooks = [Monitor("strict")] if monitor else []
    ref = specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET)
    res = specdec.generate(target, PROMPTS, strategy=strategy, k=3, batch_size=4,
                           max_new_tokens=BUDGET, policy=ForcedPolicy(pattern), hooks=hooks)
    assert res.sequences == ref
    if monitor:
        assert hooks[0].check() == []


def _batch_forward(target, prompts, pad: bool):
    """The logits and cache of one plain step over ``prompts`` (prefilled without the
    last token), through ``verify_forward`` with padding on or off."""
    tokens, valid, positions, lengths = left_pad(prompts)
    b, w = tokens.shape
    cache = cache_mod.new_cache(target, w + 4)
    extra = lambda x: torch.cat([x, x[:1]])[:, : w - 1]  # noqa: E731 (a row that leaves)
    cache_mod.forward(target, extra(tokens), extra(positions), extra(valid), cache,
                      last_logits=True)
    none = torch.zeros(0, dtype=torch.long)
    cache.keep_rows(none, none, b)  # b rows in use, a spare one in the store
    mask = valid.long()
    if not pad:
        return cache_mod.forward(target, tokens[:, w - 1:], positions[:, w - 1:], mask, cache), cache
    return phases.verify_forward(target, tokens[:, w - 1:], positions[:, w - 1:], mask, cache,
                                 mask), cache


def test_a_padded_plain_step_gives_the_rows_in_use_what_an_unpadded_one_does():
    target, _ = tiny_pair("llama")
    assert phases.padding_row(target, "cpu", 7, 1) == 1
    assert [phases.padding_row(target, "cpu", b, 1) for b in (1, 2, 4, 5, 6, 8)] == [0] * 6
    assert phases.padding_row(target, "cpu", 7, 2) == 0  # a wide step: never
    prompts = PROMPTS  # 7 rows: the store holds an 8th, spare row
    plain, c0 = _batch_forward(target, prompts, pad=False)
    padded, c1 = _batch_forward(target, prompts, pad=True)
    assert padded.shape == plain.shape == (7, 1, plain.shape[-1])
    torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-5)
    assert plain.argmax(-1).tolist() == padded.argmax(-1).tolist()
    assert c1.slab.rows == c0.slab.rows == 7 and c1.width == c0.width
    # the spare row ran along (its slot of this step written) only in the padded forward
    last = c0.width - 1
    assert not c0.slab.store[:, :, 7, :, last].any() and c1.slab.store[:, :, 7, :, last].any()
    torch.testing.assert_close(c1.slab.kv[..., : c1.width, :], c0.slab.kv[..., : c0.width, :],
                               rtol=1e-5, atol=1e-5)


def test_a_model_with_forward_hooks_is_never_padded():
    """A guard observes the model's forwards through hooks: it must see the batch's rows
    only, so no extra row is added under them."""
    target, _ = tiny_pair("llama")
    seen = []
    handle = target.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    try:
        assert phases.padding_row(target, "cpu", 7, 1) == 0
        res = specdec.generate(target, PROMPTS, k=3, batch_size=8, max_new_tokens=BUDGET,
                               stop_token_ids=[], policy=ForcedPolicy([[0]] * 7))
    finally:
        handle.remove()
    assert seen and max(seen) == 7
    assert res.sequences == specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET,
                                                       stop_token_ids=[])
