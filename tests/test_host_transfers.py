"""No host transfer where a GPU would stall, proved on the CPU.

``invariants.testing.no_host_transfers`` sees host reads, host uploads and data-dependent
shapes inside a block (the operations CUDA's sync debug mode refuses on a GPU). The
detector is specified first; then, over every realignment strategy and every tiny family:
the fast Monitor and the fast ``guard_model`` make none inside their hooks, and the strict
Monitor reads the host once per engine step (the strict guard once per forward).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import transformers

import specdec
from conftest import tiny_pair
from invariants import InvariantViolation, Monitor, guard_model
from invariants import rules as R
from invariants.testing import (HostTransferError, TransferLog, no_host_transfers,
                                watch_hook)
from specdec import drafters, models
from specdec.strategies import names as strategy_names
from specdec.validation import fault_injection

torch.set_num_threads(1)
transformers.logging.set_verbosity_error()

T = torch.arange(6)
M = T > 2


# -- the detector ----------------------------------------------------------------------------

READS = {
    "item": lambda: T[0].item(),
    "tolist": lambda: T.tolist(),
    "bool()": lambda: bool(M[0]),
    "if tensor": lambda: 1 if M.any() else 0,
    "int()": lambda: int(T[0]),
    "float()": lambda: float(T[0]),
    "range(tensor)": lambda: range(T[2]),
    ".cpu()": lambda: T.cpu(),
    ".numpy()": lambda: T.numpy(),
    "np.asarray": lambda: np.asarray(T),
    "torch.equal": lambda: torch.equal(T, T),
}
UPLOADS = {
    "torch.tensor(list)": lambda: torch.tensor([1, 2]),
    "torch.as_tensor(list)": lambda: torch.as_tensor([1, 2]),
    "t[i] = python number": lambda: T.clone().__setitem__(1, 5),
    "index by a list": lambda: T[[0, 1]],
    "new_tensor": lambda: T.new_tensor([3]),
}
DYNAMIC = {
    "nonzero": lambda: T.nonzero(),
    "torch.where(cond)": lambda: torch.where(M),
    "boolean index": lambda: T[M],
    "boolean index assignment": lambda: T.clone().__setitem__(M, T[:3]),
    "masked_select": lambda: T.masked_select(M),
    "unique": lambda: torch.unique(T),
    "repeat_interleave(tensor)": lambda: torch.repeat_interleave(T, T),
}
ALLOWED = {
    "elementwise with a python scalar": lambda: (T + 5) * 2 > 3,
    "torch.where(c, x, 0)": lambda: torch.where(M, T, 0),
    "torch.full": lambda: torch.full((3,), 7),
    "fill_ of a slice": lambda: T.clone()[1:2].fill_(5),
    "gather, index_select, cumsum, any": lambda: T.gather(0, T.clamp(max=2)).cumsum(0).any(),
    "shapes": lambda: (T.shape[0], M.dim(), T.numel()),
    "repeat_interleave(int)": lambda: torch.repeat_interleave(T, 2),
}


@pytest.mark.parametrize("kind, cases", [("read", READS), ("upload", UPLOADS),
                                         ("dynamic_shape", DYNAMIC)])
def test_each_kind_of_transfer_is_seen_and_refused(kind, cases):
    for name, op in cases.items():
        with no_host_transfers(raise_on_transfer=False) as log:
            op()
        assert log.count(kind) >= 1, name
        with pytest.raises(HostTransferError, match=kind.replace("_", "-")):
            with no_host_transfers():
                op()


def test_device_side_operations_pass():
    with no_host_transfers() as log:
        for op in ALLOWED.values():
            op()
    assert log.counts() == {"read": 0, "upload": 0, "dynamic_shape": 0}


def test_an_allowance_lets_that_many_through_and_names_the_next():
    with no_host_transfers(allow_reads=1) as log:
        T.tolist()
    assert log.reads == 1
    with pytest.raises(HostTransferError, match=r"Tensor.item at .*test_host_transfers.py"):
        with no_host_transfers(allow_reads=1):
            T.tolist()
            T[0].item()


def test_the_block_restores_every_tensor_method():
    before = {n: torch.Tensor.__dict__.get(n) for n in ("tolist", "item", "__bool__")}
    with pytest.raises(HostTransferError):
        with no_host_transfers():
            T.tolist()
    assert {n: torch.Tensor.__dict__.get(n) for n in before} == before
    assert T.tolist() == list(range(6))  # outside a block nothing is watched


def test_a_log_wraps_functions_and_nests():
    log = TransferLog(raise_on_transfer=False)
    read = log.wrap(lambda: T.tolist())
    read()
    with log:
        with no_host_transfers(raise_on_transfer=False) as inner:
            T[0].item()
    assert log.reads == 2 and inner.reads == 1


def test_allowances_are_validated():
    with pytest.raises(ValueError, match="allow"):
        TransferLog(allow={"reed": 1})
    with pytest.raises(ValueError, match="integer >= 0"):
        no_host_transfers(allow_reads=-1)


# -- the checker's hooks over the engine -------------------------------------------------------

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16], [3] * 9, [20, 21, 22]]
BUDGET = 10


@contextlib.contextmanager
def watched_guard(model, mode):
    """guard_model(model, mode) whose forward pre-hook runs inside a counting log (two
    pre-hooks around it start and stop the log); yields (guard, [per-forward logs])."""
    logs = []

    def start(module, args, kwargs):
        logs.append(TransferLog(raise_on_transfer=False).start())

    def stop(module, args, kwargs):
        logs[-1].stop()

    first = model.register_forward_pre_hook(start, prepend=True, with_kwargs=True)
    try:
        with guard_model(model, mode=mode) as g:
            last = model.register_forward_pre_hook(stop, with_kwargs=True)
            try:
                yield g, logs
            finally:
                last.remove()
    finally:
        first.remove()


def zero(counts: dict) -> bool:
    return counts == {"read": 0, "upload": 0, "dynamic_shape": 0}


@pytest.mark.engine
@pytest.mark.parametrize("strategy", strategy_names())
def test_fast_checkers_never_transfer_and_strict_reads_once_per_step(family, strategy):
    target, draft = tiny_pair(family)
    fast, strict = watch_hook(Monitor("fast")), watch_hook(Monitor("strict"))
    drafter = drafters.ModelDrafter(draft) if family == "llama" else drafters.NGramDrafter()
    try:
        with watched_guard(target, "fast") as (guard, logs):
            res = specdec.generate(target, PROMPTS, drafter=drafter, strategy=strategy, k=3,
                                   batch_size=3, max_new_tokens=BUDGET, hooks=[fast, strict])
    except NotImplementedError as e:  # a strategy this model cannot serve
        pytest.skip(str(e))
    assert fast.hook.check() == [] and strict.hook.check() == []
    assert res.sequences == specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET)
    # fast: nothing inside any hook call, the Monitor's or the guard's
    assert zero(fast.total()), fast.events()[:3]
    assert logs and all(zero(log.counts()) for log in logs), [e for l in logs for e in l.events][:3]
    # strict: one read at the end of every step, nothing else
    per_step = strict.per_step()
    steps = {s for s, phase, _ in strict.calls if phase == "commit"}
    assert {s: per_step[s]["read"] for s in steps} == {s: 1 for s in steps}
    assert all(c["read"] <= 1 and c["upload"] == 0 and c["dynamic_shape"] == 0
               for c in per_step.values())


@pytest.mark.engine
def test_the_strict_guard_reads_once_per_forward():
    target, _ = tiny_pair("llama")
    with watched_guard(target, "strict") as (guard, logs):
        specdec.generate(target, PROMPTS, k=3, batch_size=3, max_new_tokens=BUDGET)
    assert len(logs) == guard.forwards > 2
    assert all(log.reads <= 1 and log.uploads == 0 and log.dynamic_shapes == 0 for log in logs)


@pytest.mark.engine
def test_a_failing_fast_run_still_transfers_nothing_until_check():
    target, _ = tiny_pair("qwen3")

    def shift(phase, view):
        if phase == "realign" and view.step == 2:
            view.positions[:, -1] += 1

    mon = watch_hook(Monitor("fast"))
    specdec.generate(target, PROMPTS, k=3, max_new_tokens=BUDGET,
                     hooks=[fault_injection(shift), mon])
    assert zero(mon.total())
    with pytest.raises(InvariantViolation) as err:
        mon.hook.check()
    assert (err.value.invariant, err.value.step) == ("I3", 2)


@pytest.mark.engine
def test_stop_ids_reach_the_device_without_an_upload():
    target, _ = tiny_pair("llama")
    many = list(range(90, 90 + 2 * models.TINY_VOCAB // 16))  # past the compare limit: a tensor
    mon = watch_hook(Monitor("fast"))
    specdec.generate(target, PROMPTS[:2], k=2, max_new_tokens=6, stop_token_ids=many, hooks=[mon])
    assert zero(mon.total()) and mon.hook.check() == []


@pytest.mark.engine
@pytest.mark.parametrize("mode", ("coupled", "rejection"))
def test_sampling_runs_keep_the_checkers_transfer_free(mode):
    """A sampling engine hands the checkers the same tensors (its choices in place of the
    argmax): the fast Monitor still transfers nothing inside its hooks, the strict one
    reads once per step, and the run passes both."""
    target, draft = tiny_pair("llama")
    sampling = specdec.Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=5, mode=mode)
    fast, strict = watch_hook(Monitor("fast")), watch_hook(Monitor("strict"))
    res = specdec.generate(target, PROMPTS, drafter=drafters.ModelDrafter(draft), k=3,
                           batch_size=3, max_new_tokens=BUDGET, hooks=[fast, strict],
                           sampling=sampling)
    assert fast.hook.check() == [] and strict.hook.check() == []
    if mode == "coupled":
        assert res.sequences == specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET,
                                                           sampling=sampling)
    assert zero(fast.total()), fast.events()[:3]
    per_step = strict.per_step()
    steps = {s for s, phase, _ in strict.calls if phase == "commit"}
    assert steps and {s: per_step[s]["read"] for s in steps} == {s: 1 for s in steps}
    assert all(c["upload"] == 0 and c["dynamic_shape"] == 0 for c in per_step.values())


@pytest.mark.engine
@pytest.mark.parametrize("bound, value", [("MAX_WAITING", 4), ("MAX_WAITING_BYTES", 2048)])
def test_views_that_wait_past_the_limit_are_checked_in_the_hook_without_transfers(
        monkeypatch, bound, value):
    """Fast mode checks waiting views inside a hook once ``MAX_WAITING`` wait, or once
    they keep ``MAX_WAITING_BYTES`` of tensors alive (bounded memory on a long run):
    still no read, upload or data-dependent shape in any hook, and a fault is recorded as
    strict mode records it."""
    from invariants import monitor as monitor_module

    monkeypatch.setattr(monitor_module, bound, value)
    settles = []
    real = monitor_module.Monitor._settle
    monkeypatch.setattr(monitor_module.Monitor, "_settle",
                        lambda self: settles.append(len(self._deferred)) or real(self))
    target, _ = tiny_pair("llama")

    def shift(phase, view):
        if phase == "realign" and view.step == 3:
            view.positions[:, -1] += 1

    fast = watch_hook(Monitor("fast", raise_on_violation=False))
    strict = Monitor("strict", raise_on_violation=False)
    specdec.generate(target, PROMPTS, k=3, batch_size=3, max_new_tokens=BUDGET,
                     hooks=[fault_injection(shift), strict, fast])
    assert zero(fast.total()), fast.events()[:3]
    # what still waits for the read is under the bound (a hook settles it at the bound):
    # the bytes its tensors hold, or the count of views
    waiting = [evidence for *_, evidence in fast.hook._deferred]
    left = len(waiting) if bound == "MAX_WAITING" else sum(map(R.held_bytes, waiting))
    assert left < value, (bound, left)
    key = lambda v: (v.invariant, v.step, v.phase, v.rows, v.rules)  # noqa: E731
    found = [key(v) for v in fast.hook.check()]
    assert found and found == [key(v) for v in strict.check()]
    assert found[0][:3] == ("I3", 3, "realign")
    assert len(settles) > 2  # (checked in hooks: the bound, not only the read, settled)
