"""At most one host read per decoding step (issue #19, point 1), proved on the CPU.

On a GPU every host read waits for the stream. ``invariants.testing.no_host_transfers``
counts the reads a CPU run would make there (``tests/test_host_transfers.py`` specifies
the detector). Over every strategy and both draft-length policies, and over the plain
batched loop (``reference_generate``), a whole ``generate`` call reads the host at most
once per step, plus a constant per call and per prefill (a batch or an admission):

- per step: the speculative loop's one read (``phases.sync``: which rows finished, the
  next step's width), the plain loop's one deferred read (has every row finished?);
- per call: ``phases.collect`` reads every output once;
- uploads: none per step in the fixed-batch strategies, at most one in EXSPEC (the pool
  rows of a newly scheduled group);
- per prefill: transformers' check whether a prefill may skip its mask (two reads in
  ``masking_utils._ignore_causal_mask_sdpa``), the adaptive policy's first draft lengths
  (``admit``) and, in the plain loop, the batch's outputs.

Rows finish at different steps (a stop token every row meets at its own time), so the
reads that decide which rows finished are exercised, with and without a fast Monitor
(whose hooks add none during the run: it reads once in ``check``).
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers

import specdec
from conftest import tiny_pair
from invariants import Monitor
from invariants.testing import no_host_transfers
from specdec.strategies import names as strategy_names

torch.set_num_threads(1)
transformers.logging.set_verbosity_error()

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16], [3] * 9, [20, 21, 22],
           [30, 31, 32], [40, 41, 42, 43, 44]]
BUDGET = 24
#: reads allowed per call (collect) and per prefill (mask check x2, admit, plain outputs)
PER_CALL, PER_PREFILL = 1, 3


def staggered_stop(target) -> list[int]:
    """A stop id that ends rows at different steps: the token the reference emits at the
    middle of the first row whose middle token some other row does not emit early."""
    ref = specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET, stop_token_ids=[])
    for row in ref:
        tok = row[BUDGET // 2]
        ends = [r.index(tok) if tok in r else BUDGET for r in ref]
        if len(set(ends)) > 2 and min(ends) > 1:
            return [tok]
    return [ref[0][BUDGET // 2]]


class Forwards:
    """Counts the target's forwards (a pre-hook that reads nothing)."""

    def __init__(self, model):
        self.count = 0
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, module, args):
        self.count += 1

    def remove(self):
        self.handle.remove()


@pytest.mark.engine
@pytest.mark.parametrize("monitor", [False, True], ids=["no-monitor", "fast-monitor"])
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
@pytest.mark.parametrize("strategy", strategy_names())
@pytest.mark.parametrize("batch_size", [3, 8])
def test_the_speculative_loop_reads_the_host_at_most_once_per_step(strategy, policy, monitor,
                                                                    batch_size):
    target, _ = tiny_pair("llama")
    stops = staggered_stop(target)
    hooks = [Monitor("fast")] if monitor else []
    prefills = 1 if strategy == "exspec" else math.ceil(len(PROMPTS) / batch_size)  # window >= prompts
    opts = {"window": max(batch_size, len(PROMPTS))} if strategy == "exspec" else {}
    with no_host_transfers(raise_on_transfer=False) as log:
        res = specdec.generate(target, PROMPTS, strategy=strategy, k=3, batch_size=batch_size,
                               max_new_tokens=BUDGET, stop_token_ids=stops, policy=policy,
                               hooks=hooks, **opts)
    assert res.sequences == specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET,
                                                       stop_token_ids=stops)
    lengths = {len(s) for s in res.sequences}
    assert len(lengths) > 1, "rows must finish at different steps"
    steps = res.stats.steps
    assert log.reads <= steps + PER_CALL + PER_PREFILL * prefills, [str(e) for e in log.events]
    # the step's one read is phases.sync's; nothing else reads once per step
    in_sync = sum(e.kind == "read" and e.where.endswith("in sync") for e in log.events)
    assert in_sync == steps
    # uploads: none per step, but EXSPEC's pool rows of a newly scheduled group (one at
    # most per step, none when the group is served again); per call and per prefill, the
    # stop ids and the policy's prior, the prompts (one rectangle per prefill, not one
    # upload per row), the batch's per-row facts
    uploads = [e.where for e in log.events if e.kind == "upload"]
    rows_up = sum(w.endswith("in host_rows") for w in uploads)
    assert rows_up <= (steps + prefills if strategy == "exspec" else 0), uploads
    assert len(uploads) - rows_up <= 2 + 5 * prefills, uploads
    if monitor:
        assert hooks[0].check() == []


@pytest.mark.engine
@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_the_plain_loop_reads_the_host_at_most_once_per_step(batch_size):
    target, _ = tiny_pair("llama")
    stops = staggered_stop(target)
    expected = specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET,
                                          stop_token_ids=stops)
    forwards = Forwards(target)
    try:
        with no_host_transfers(raise_on_transfer=False) as log:
            got = specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET,
                                             batch_size=batch_size, stop_token_ids=stops)
    finally:
        forwards.remove()
    assert got == expected
    batches = math.ceil(len(PROMPTS) / batch_size)
    steps = forwards.count - batches  # one prefill forward per batch, then one per step
    assert steps > 0
    assert log.reads <= steps + PER_PREFILL * batches, [str(e) for e in log.events]


@pytest.mark.engine
def test_the_plain_loop_defers_its_read_by_one_forward():
    """When every row has stopped, the plain loop learns it one forward later (the read
    overlaps that forward on a GPU): exactly one forward more than the steps it needed."""
    target, _ = tiny_pair("llama")
    ref = specdec.reference_generate(target, PROMPTS[:1], max_new_tokens=BUDGET, stop_token_ids=[])
    stop = ref[0][3]
    first = ref[0].index(stop)  # the row ends with its token at index `first`
    forwards = Forwards(target)
    try:
        got = specdec.reference_generate(target, PROMPTS[:1], max_new_tokens=BUDGET,
                                         stop_token_ids=[stop])
    finally:
        forwards.remove()
    assert got == [ref[0][: first + 1]]
    # prefill, then a forward per token after the first, plus the one that ran while the
    # host read the flag that said the row had stopped
    assert forwards.count == 1 + first + 1
