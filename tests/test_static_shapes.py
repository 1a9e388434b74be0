"""Static shapes for decode and verify (issue #19, point 2): ``static_shapes=True``.

Specified on the CPU, with a forward pre-hook on the target that records what every
decode and verify forward is given (shapes and storage addresses of ``input_ids``,
``position_ids`` and the attention mask, and the cache's buffers):

- the tokens are unchanged: every row equals batch-1 greedy decoding on every tiny
  family (sliding-window Mistral and mixed Gemma 3 included), every strategy, and in the
  plain batched loop;
- the forward inputs are views of buffers allocated once per run: within a verify width
  their addresses never change, across steps, row drops and realignments;
- the number of distinct forward input shapes is bounded by (row counts) x (verify
  widths) x (key-width buckets), not by the number of steps (an eager run, for contrast,
  has a new shape nearly every step);
- no cache storage is allocated after the run's first prefill (one cache per run, both
  buffers allocated at its first forward);
- the step still reads the host at most once (``tests/test_step_reads.py``'s rule).
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from hypothesis import given, strategies as st

import specdec
from conftest import tiny_pair
from invariants import Monitor
from invariants.testing import no_host_transfers
from specdec import cache as cache_mod
from specdec import drafters, static
from specdec.strategies import names as strategy_names

torch.set_num_threads(1)
transformers.logging.set_verbosity_error()

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16], [3] * 9, [20, 21, 22],
           [30, 31, 32], [40, 41, 42, 43, 44]]
BUDGET = 40  # long enough to cross key buckets (KEY_GRANULE slots)


class Inputs:
    """Records every target forward after the first one of each batch (its prefill):
    shapes and ``data_ptr`` of the inputs, the cache's store and spare addresses."""

    def __init__(self, model):
        self.calls: list[dict] = []
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        cache = kwargs["cache"]
        slab = cache.slab
        self.calls.append({
            "prefill": cache.width == 0,
            "shapes": tuple(tuple(kwargs[n].shape) for n in ("input_ids", "position_ids"))
            + (tuple(kwargs["attention_mask"].shape) if torch.is_tensor(kwargs["attention_mask"])
               else tuple(sorted((t, tuple(m.shape)) for t, m in kwargs["attention_mask"].items())),),
            "ptrs": tuple(kwargs[n].data_ptr() for n in ("input_ids", "position_ids"))
            + ((kwargs["attention_mask"].data_ptr(),) if torch.is_tensor(kwargs["attention_mask"])
               else ()),
            "q": kwargs["input_ids"].shape[1],
            "kind": kwargs["attention_mask"].dim() if torch.is_tensor(kwargs["attention_mask"])
            else "per layer type",
            "rows": kwargs["input_ids"].shape[0],
            "stores": tuple(t.data_ptr() for t in (slab.store, slab.spare) if t is not None),
            "capacity": slab.capacity,
        })

    def steps(self) -> list[dict]:
        return [c for c in self.calls if not c["prefill"]]

    def remove(self):
        self.handle.remove()


def record(model, **kw):
    rec = Inputs(model)
    try:
        res = specdec.generate(model, PROMPTS, max_new_tokens=BUDGET, stop_token_ids=[], **kw)
    finally:
        rec.remove()
    return res, rec


def scripted(target) -> drafters.ScriptedDrafter:
    """Drafts from the reference with every third token wrong: partial acceptance, so
    rows commit different counts and the adaptive policy mixes widths 1 and k + 1."""
    ref = specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET, stop_token_ids=[])
    return drafters.ScriptedDrafter([[t if i % 3 else (t + 1) % 50 for i, t in enumerate(row)]
                                     for row in ref])


def bound(steps: list[dict]) -> int:
    """(row counts) x (verify widths) x (key buckets of the capacity)."""
    rows = {c["rows"] for c in steps}
    widths = {c["q"] for c in steps}
    buckets = math.ceil(max(c["capacity"] for c in steps) / static.KEY_GRANULE)
    return len(rows) * len(widths) * buckets


# -- the boundary and the bucket rule -------------------------------------------------------

def test_static_shapes_takes_a_bool():
    target, _ = tiny_pair("llama")
    with pytest.raises(TypeError, match=r"static_shapes must be True, False or None, got str 'yes'"):
        specdec.generate(target, PROMPTS, static_shapes="yes")
    with pytest.raises(TypeError, match=r"static_shapes must be True, False or None, got int 1"):
        specdec.reference_generate(target, PROMPTS, max_new_tokens=2, static_shapes=1)


@given(st.integers(1, 2000), st.integers(0, 500), st.integers(1, 64))
def test_a_key_bucket_covers_the_keys_within_the_capacity(needed, room, granule):
    capacity = needed + room
    kw = static.key_bucket(needed, capacity, granule)
    assert needed <= kw <= capacity
    assert kw % granule == 0 or kw == capacity
    assert kw - needed < granule  # never a whole granule more than needed
    assert static.key_bucket(max(1, needed - 1), capacity, granule) <= kw  # monotone


def test_a_key_bucket_refuses_more_keys_than_the_capacity():
    with pytest.raises(ValueError, match=r"cache capacity exceeded: 65 keys > capacity 64"):
        static.key_bucket(65, 64)


def test_verify_widths_are_one_or_k_plus_one():
    assert [static.verify_drafts(n, 4) for n in range(5)] == [0, 4, 4, 4, 4]


@pytest.mark.engine
def test_a_forward_key_width_must_cover_the_cache_and_match_the_mask():
    target, _ = tiny_pair("llama")
    cache = cache_mod.new_cache(target, 40)
    ids = torch.tensor([[5, 6, 7]])
    pos = torch.arange(3)[None]
    with pytest.raises(ValueError, match=r"key_width must lie in \[cache width \+ q, capacity\] "
                                         r"= \[3, 40\] and equal the mask's width 3, got 2"):
        cache_mod.forward(target, ids, pos, torch.ones(1, 3, dtype=torch.long), cache, key_width=2)
    mask = torch.zeros(1, 32, dtype=torch.long)
    mask[:, :3] = 1
    wide = cache_mod.forward(target, ids, pos, mask, cache, key_width=32)
    cache2 = cache_mod.new_cache(target, 40)
    plain = cache_mod.forward(target, ids, pos, mask[:, :3], cache2)
    assert torch.allclose(wide, plain, atol=1e-5) and cache.width == cache2.width == 3


# -- exactness ------------------------------------------------------------------------------

@pytest.mark.engine
def test_static_shapes_are_exact_on_every_family_and_strategy(family):
    target, draft = tiny_pair(family)
    expected = specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET, stop_token_ids=[])
    got = specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET, stop_token_ids=[],
                                     batch_size=4, static_shapes=True)
    assert got == expected
    drafter = drafters.ModelDrafter(draft) if family in ("llama", "mistral") else drafters.NGramDrafter()
    for strategy in strategy_names():
        try:
            res = specdec.generate(target, PROMPTS, drafter=drafter, strategy=strategy, k=3,
                                   batch_size=3, max_new_tokens=BUDGET, stop_token_ids=[],
                                   policy="fixed", static_shapes=True)
        except NotImplementedError:  # a strategy this model cannot serve (eager alike)
            continue
        assert res.sequences == expected, strategy
        assert set(res.stats.widths) == {4}, strategy  # fixed policy: every step k + 1


@pytest.mark.engine
@pytest.mark.parametrize("strategy", strategy_names())
def test_the_monitor_checks_a_static_run_with_varying_draft_lengths(strategy):
    """The adaptive policy and a stop token that ends rows at different steps: steps of
    width 1 and k + 1, rows dropping out; the strict Monitor finds nothing."""
    target, draft = tiny_pair("mistral")
    ref = specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET, stop_token_ids=[])
    stop = [ref[0][BUDGET // 3]]
    expected = specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET, stop_token_ids=stop)
    monitor = Monitor("strict")
    res = specdec.generate(target, PROMPTS, drafter=drafters.ModelDrafter(draft), strategy=strategy,
                           k=3, batch_size=4, max_new_tokens=BUDGET, stop_token_ids=stop,
                           static_shapes=True, hooks=[monitor])
    assert res.sequences == expected
    assert monitor.check() == []
    assert set(res.stats.widths) <= {1, 4}


# -- static shapes: addresses, shapes, allocations ------------------------------------------

@pytest.mark.engine
@pytest.mark.parametrize("strategy", strategy_names())
def test_forward_inputs_stay_in_the_run_buffers_and_shapes_are_bounded_by_buckets(strategy):
    target, _ = tiny_pair("mistral")  # sliding window: holes build position masks
    kw = dict(strategy=strategy, k=3, batch_size=4, policy="adaptive", drafter=scripted(target))
    eager, eager_rec = record(target, **kw)
    res, rec = record(target, static_shapes=True, **kw)
    assert res.sequences == eager.sequences
    steps = rec.steps()
    assert len(steps) >= 20
    # one address per input, verify width and mask kind (holes: a 4-D position mask
    # while the layout has holes, the 2-D one after a compaction), for the whole run
    # (two batches included)
    for q, kind in {(c["q"], c["kind"]) for c in steps}:
        ptrs = {c["ptrs"] for c in steps if (c["q"], c["kind"]) == (q, kind)}
        assert len(ptrs) == 1, (q, kind, ptrs)
    shapes = {c["shapes"] for c in steps}
    assert len(shapes) <= bound(steps) < len(steps)
    # every key width is a bucket: a multiple of the granule, or the whole capacity
    for c in steps:
        width = c["shapes"][2][-1] if isinstance(c["shapes"][2][-1], int) else c["shapes"][2][0][1][-1]
        assert width % static.KEY_GRANULE == 0 or width == c["capacity"]
    # the contrast: eagerly, a new mask width nearly every step (this test can fail)
    assert len({c["shapes"] for c in eager_rec.steps()}) > len(shapes)


@pytest.mark.engine
@pytest.mark.parametrize("strategy", strategy_names())
def test_no_cache_storage_is_allocated_after_the_first_prefill(strategy, monkeypatch):
    target, _ = tiny_pair("llama")
    made = []
    real = cache_mod._Slab.allocate

    def allocate(self, like, rows):
        made.append(rows)
        real(self, like, rows)

    monkeypatch.setattr(cache_mod._Slab, "allocate", allocate)
    res, rec = record(target, strategy=strategy, k=3, batch_size=3, policy="fixed",
                      static_shapes=True)
    assert res.stats.steps > 10
    steps = rec.steps()
    stores = {p for c in steps for p in c["stores"]}
    assert len(stores) == 2 and all(len(c["stores"]) == 2 for c in steps)
    # eqspec and holes: one cache for the run's three batches; exspec: its compute cache
    # plus one prefill cache per admission (prefill forwards, not decode or verify)
    if strategy != "exspec":
        assert made == [3]
    # and eagerly each batch allocates its own cache (the contrast)
    made.clear()
    record(target, strategy=strategy, k=3, batch_size=3, policy="fixed")
    if strategy != "exspec":
        assert len(made) == 3


@pytest.mark.engine
@pytest.mark.parametrize("strategy", strategy_names())
def test_a_static_run_still_reads_the_host_at_most_once_per_step(strategy):
    target, _ = tiny_pair("llama")
    opts = {"window": len(PROMPTS)} if strategy == "exspec" else {}
    with no_host_transfers(raise_on_transfer=False) as log:
        res = specdec.generate(target, PROMPTS, strategy=strategy, k=3, batch_size=3,
                               max_new_tokens=BUDGET, stop_token_ids=[], static_shapes=True, **opts)
    prefills = 1 if strategy == "exspec" else math.ceil(len(PROMPTS) / 3)
    assert log.reads <= res.stats.steps + 1 + 3 * prefills, [str(e) for e in log.events]


@pytest.mark.engine
def test_the_plain_loop_runs_in_place_at_bucketed_widths():
    target, _ = tiny_pair("llama")
    rec = Inputs(target)
    try:
        got = specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET, stop_token_ids=[],
                                         batch_size=7, static_shapes=True)
    finally:
        rec.remove()
    assert got == specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET,
                                             stop_token_ids=[])
    steps = rec.steps()
    assert len(steps) == BUDGET - 1
    assert len({c["ptrs"] for c in steps}) == 1
    assert len({c["shapes"] for c in steps}) <= math.ceil(steps[0]["capacity"] / static.KEY_GRANULE)


def test_the_static_shapes_benchmark_reports_both_widths_side_by_side(capsys):
    """benchmarks/static_shapes.py on the tiny Llama: every engine eager and static, exact,
    and the static run with fewer distinct forward shapes."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "static_shapes.py"
    spec = importlib.util.spec_from_file_location("static_shapes_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--model", "tiny:llama", "--prompts", "4", "--max-new-tokens", "40",
                       "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if len(line.split()) > 1
            and line.split()[1] in ("eager", "static")]
    assert len(rows) == 6  # plain-loop, eqspec/adaptive, eqspec/fixed, each eager and static
    for row in rows:
        assert "100%" in row
    # the "fwd shapes" column: distinct shapes / decode and verify forwards
    shapes = {(r[0], r[1]): int(next(c for c in r if "/" in c and c[0].isdigit()).split("/")[0])
              for r in rows}
    for engine in {r[0] for r in rows}:
        assert shapes[(engine, "static")] < shapes[(engine, "eager")]
