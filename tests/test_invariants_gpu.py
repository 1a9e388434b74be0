"""invariants on CUDA: the engine, the Monitor and guard_model on GPU tensors, fast mode
never synchronising the stream inside a hook (CUDA's sync debug mode set to "error"
around each check) and strict mode synchronising once per engine step (sync debug mode
"warn", warnings counted per step). ``benchmarks/gpu_check.sh`` runs them on a GPU.

Without a CUDA device (or with ``INVARIANTS_TEST_DEVICE=cpu``) the same tests run on the
CPU, in CI, with ``invariants.testing`` (host reads, uploads and data-dependent shapes) in
place of the sync debug mode; ``tests/test_host_transfers.py`` covers every strategy and
family that way.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections import Counter

import pytest
import torch
import transformers

import specdec
from invariants import InvariantViolation, Monitor, guard_model
from invariants import predicates as P
from invariants import rules as R
from specdec import drafters, models
from specdec.validation import fault_injection
from invariants.testing import TransferLog, no_host_transfers

DEVICE = os.environ.get("INVARIANTS_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")

pytestmark = [pytest.mark.gpu, pytest.mark.engine]

transformers.logging.set_verbosity_error()
torch.set_num_threads(1)

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16], [3] * 9, [20, 21, 22]]
BUDGET = 12
K = 3


@contextlib.contextmanager
def no_sync():
    """Any stream synchronisation (or host read, on the CPU) inside the block fails."""
    if DEVICE.startswith("cuda"):
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)
    else:
        with no_host_transfers():
            yield


def without_sync(hook):
    """Wrap a step hook so that it runs under ``no_sync``."""
    def wrapped(phase, view):
        with no_sync():
            hook(phase, view)
    return wrapped


_MODELS: dict = {}


def on_device(family):
    if family not in _MODELS:
        _MODELS[family] = (models.tiny(family).to(DEVICE), models.tiny_draft(family).to(DEVICE))
    return _MODELS[family]


def reference(target):
    return specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET)


@pytest.mark.parametrize("family", models.FAMILIES)
def test_fast_monitor_never_syncs_inside_the_engine(family):
    target, draft = on_device(family)
    mon = Monitor("fast")
    res = specdec.generate(target, PROMPTS, drafter=drafters.ModelDrafter(draft), k=K,
                           batch_size=3, max_new_tokens=BUDGET, hooks=[without_sync(mon)])
    assert mon.check() == []
    assert res.sequences == reference(target)


@pytest.mark.parametrize("mode", ["strict", "deep"])
def test_strict_and_deep_monitors_run_on_gpu_tensors(mode):
    target, draft = on_device("llama")
    mon = Monitor(mode)
    res = specdec.generate(target, PROMPTS, drafter=drafters.ModelDrafter(draft), k=K,
                           batch_size=3, max_new_tokens=BUDGET, hooks=[mon])
    assert mon.check() == [] and mon.near_ties == []
    assert res.sequences == reference(target)


def test_fast_monitor_catches_a_mistake_on_gpu_and_reports_it_at_check():
    target, _ = on_device("qwen3")

    def shift(phase, view):
        if phase == "realign" and view.step == 2:
            view.positions[:, -1] += 1

    mon = Monitor("fast")
    specdec.generate(target, PROMPTS, k=K, max_new_tokens=BUDGET,
                     hooks=[fault_injection(shift), without_sync(mon)])
    with pytest.raises(InvariantViolation) as err:
        mon.check()
    assert (err.value.invariant, err.value.step) == ("I3", 2)


def test_predicate_masks_stay_on_the_gpu():
    target, _ = on_device("llama")
    seen = []

    def grab(phase, view):
        if phase == "commit":
            seen.append(view)

    specdec.generate(target, PROMPTS[:2], k=K, max_new_tokens=4, hooks=[grab])
    v = seen[0]
    with no_sync():
        masks = [R.i1_alignment(v), R.i2_layout(v), R.i3_positions(v), R.i4_mask(v),
                 R.i6_conservation(v)]
    assert all(m.device.type == torch.device(DEVICE).type for m in masks)


def test_guard_is_silent_on_the_engine_and_hf_generate_on_gpu():
    target, draft = on_device("mistral")
    ids = torch.tensor([[2, 2, 5, 6, 7], [8, 9, 10, 11, 12]], device=DEVICE)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1] * 5], device=DEVICE)
    with guard_model(target, mode="strict") as g, guard_model(draft, mode="fast"):
        specdec.generate(target, PROMPTS, drafter=drafters.ModelDrafter(draft), k=K,
                         max_new_tokens=BUDGET)
        target.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                        pad_token_id=2)
    assert g.forwards > 2


def test_fast_guard_checks_a_forward_without_syncing():
    target, _ = on_device("llama")
    ids = torch.tensor([[5, 2, 2, 6, 7], [8, 9, 10, 11, 12]], device=DEVICE)
    mask = torch.tensor([[1, 0, 0, 1, 1], [1] * 5], device=DEVICE)
    with guard_model(target, mode="fast", raise_on_violation=False) as g:
        with no_sync():
            # implicit positions over a hole: row 0 wrong
            g._pre(target, (ids,), {"attention_mask": mask})
    assert [v.rows for v in g.violations] == [[0]]


def test_the_fast_content_guard_never_syncs_and_is_silent_on_the_engine():
    """The content rules' hooks (pre, the argmax record, the cache's wrapped update) on
    GPU tensors: no synchronisation in fast mode, no false alarm, outputs checked."""
    from invariants.guard import Guard

    target, draft = on_device("llama")
    g = Guard(target, "fast", prompts=PROMPTS, max_new_tokens=BUDGET, stop_token_ids=[2])

    def quiet(fn):
        def wrapped(*a, **k):
            with no_sync():
                return fn(*a, **k)
        return wrapped
    g._pre, g._post = quiet(g._pre), quiet(g._post)
    g.content._learn = quiet(g.content._learn)
    g.install()
    try:
        res = specdec.generate(target, PROMPTS, drafter=drafters.ModelDrafter(draft), k=K,
                               batch_size=3, max_new_tokens=BUDGET, stop_token_ids=[2])
    finally:
        g.remove()
    assert g.check() == [] and g.check_outputs(res.sequences) == []
    assert g.content.unknown == 0 and g.content.skipped == 0 and g.forwards > 2


def counting_syncs(hook, per_step: Counter):
    """Wrap a step hook so that the stream synchronisations (host reads, on the CPU) of
    each call are added to ``per_step[view.step]``."""
    def wrapped(phase, view):
        if DEVICE.startswith("cuda"):
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    hook(phase, view)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            per_step[view.step] += sum("synchroniz" in str(w.message) for w in seen)
        else:
            log = TransferLog(raise_on_transfer=False)
            with log:
                hook(phase, view)
            per_step[view.step] += log.reads
    return wrapped


@pytest.mark.parametrize("strategy", ["eqspec", "holes", "exspec"])
def test_strict_monitor_synchronises_once_per_step(strategy):
    target, draft = on_device("llama")
    per_step: Counter = Counter()
    mon = Monitor("strict")
    res = specdec.generate(target, PROMPTS, drafter=drafters.ModelDrafter(draft), k=K,
                           batch_size=3, max_new_tokens=BUDGET, strategy=strategy,
                           hooks=[counting_syncs(mon, per_step)])
    assert mon.check() == []
    assert res.sequences == reference(target)
    assert per_step and max(per_step.values()) == 1, dict(per_step)


@pytest.mark.parametrize("strategy", ["holes", "exspec"])
def test_fast_monitor_never_syncs_on_every_strategy(strategy):
    target, draft = on_device("llama")
    mon = Monitor("fast")
    res = specdec.generate(target, PROMPTS, drafter=drafters.ModelDrafter(draft), k=K,
                           batch_size=3, max_new_tokens=BUDGET, strategy=strategy,
                           hooks=[without_sync(mon)])
    assert mon.check() == []
    assert res.sequences == reference(target)
