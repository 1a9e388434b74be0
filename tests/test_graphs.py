"""Whole-forward capture per bucket (issue #19, point 3): ``compile="cuda-graphs"``.

A CPU has no CUDA graphs, so these tests run the capture path with its CPU stand-in
(``specdec.graphs.cpu_proxy()``): a "capture" runs the forward under the host-transfer
detector (what would break a CUDA capture), and every "replay" runs it from the graph's
own static inputs with the cache's host width set back to the capture's (what a graph
replays with). Specified:

- exactness: the speculative loop (every strategy) and the plain loop equal batch-1 eager
  greedy decoding on every tiny family, past the sliding window and across key buckets,
  with every decode and verify forward served by a graph (captures bounded by buckets,
  most forwards replays, none eager);
- the stand-in can fail: a cache write addressed by the host width, or a replay that does
  not copy its inputs, changes the tokens;
- a forward that cannot be captured (a host read inside it) runs eagerly, with the reason
  kept, and the tokens stay right;
- the Monitor (strict) checks a captured run; the model's forward hooks see every
  captured forward with its own arguments (``guard_model`` counts them all, is silent on
  a right run and raises on a wrong position inside a replayed bucket); the guard's
  content rules learn from every cache update, which a replay does not make, so with
  ``prompts=`` a guarded model's forwards run eagerly (counted), and the guard is silent;
- the boundary: "cuda-graphs" needs static shapes (on by default with it) and, outside
  the stand-in, a CUDA model.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import transformers

import specdec
from conftest import tiny_pair
from invariants import InvariantViolation, Monitor, guard_model
from specdec import cache as cache_mod
from specdec import drafters, graphs, models, static
from specdec.strategies import names as strategy_names

torch.set_num_threads(1)
transformers.logging.set_verbosity_error()

# longer than the tiny sliding window (24 positions) once 40 tokens are added, and
# crossing key buckets (static.KEY_GRANULE slots)
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16], [3] * 9, [20, 21, 22],
           [30, 31, 32], [40, 41, 42, 43, 44]]
BUDGET = 40


def captured_run(target, strategy="eqspec", **kw):
    args = dict(drafter=drafters.NGramDrafter(), strategy=strategy, k=3, batch_size=3,
                max_new_tokens=BUDGET, stop_token_ids=[], policy="fixed")
    args.update(kw)
    with graphs.cpu_proxy():
        return specdec.generate(target, PROMPTS, compile="cuda-graphs", **args)


def assert_all_captured(stats):
    g = stats.graphs
    assert g["eager"] == {} and g["failed"] == 0, g
    assert 0 < g["captured"] < g["replayed"], g


# -- exactness -----------------------------------------------------------------------------

@pytest.mark.engine
def test_captured_forwards_are_exact_on_every_family_and_strategy(family):
    target, _ = tiny_pair(family)
    expected = specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET, stop_token_ids=[])
    with graphs.cpu_proxy():
        plain = specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET,
                                           stop_token_ids=[], batch_size=4,
                                           compile="cuda-graphs")
    assert plain == expected
    for strategy in strategy_names():
        try:
            res = captured_run(target, strategy)
        except NotImplementedError:  # a strategy this model cannot serve (eager alike)
            continue
        assert res.sequences == expected, strategy
        assert_all_captured(res.stats)
        # one capture per bucket: (row counts) x (verify widths) x (key buckets) x (the two
        # buffers a realignment alternates), never one per step
        buckets = -(-(max(map(len, PROMPTS)) + BUDGET + 3 + 1) // static.KEY_GRANULE) + 1
        assert res.stats.graphs["captured"] <= 3 * 2 * buckets * 2, strategy


@pytest.mark.engine
def test_a_captured_run_with_the_adaptive_policy_and_stops_is_exact():
    """Widths 1 and k + 1 in one run, rows finishing at different steps (row drops)."""
    target, _ = tiny_pair("mistral")
    ref = specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET, stop_token_ids=[])
    stop = [ref[0][BUDGET // 3]]
    expected = specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET,
                                          stop_token_ids=stop)
    script = drafters.ScriptedDrafter([[t if i % 3 else (t + 1) % 50 for i, t in enumerate(r)]
                                       for r in ref])
    for strategy in strategy_names():
        res = captured_run(target, strategy, drafter=script, policy="adaptive",
                           stop_token_ids=stop, batch_size=4)
        assert res.sequences == expected, strategy
        assert_all_captured(res.stats)


# -- the stand-in sees what a graph would get wrong ---------------------------------------

@pytest.mark.engine
def test_a_cache_write_addressed_by_the_host_width_is_caught(monkeypatch):
    target, _ = tiny_pair("llama")
    expected = specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET, stop_token_ids=[])
    real = cache_mod.SlabLayer.update

    def update(self, key_states, value_states, *args, **kwargs):
        slab = self.slab
        if not slab.addressed:
            return real(self, key_states, value_states, *args, **kwargs)
        kv, w, q = slab.kv[self.layer_idx], slab.width, key_states.shape[-2]
        kv[0, :, :, w : w + q] = key_states  # a graph would replay the capture's w
        kv[1, :, :, w : w + q] = value_states
        return kv[0, :, :, : slab.key_width], kv[1, :, :, : slab.key_width]

    monkeypatch.setattr(cache_mod.SlabLayer, "update", update)
    res = captured_run(target)
    assert res.sequences != expected


@pytest.mark.engine
def test_a_replay_that_does_not_copy_its_inputs_is_caught(monkeypatch):
    target, _ = tiny_pair("llama")
    expected = specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET, stop_token_ids=[])
    monkeypatch.setattr(graphs, "_copy_into", lambda static_mask, given: None)  # stale masks
    res = captured_run(target)
    assert res.sequences != expected


@pytest.mark.engine
def test_a_forward_that_reads_the_host_runs_eagerly_with_its_reason(monkeypatch):
    """Handed the 2-D mask, transformers builds the causal mask itself and compares the
    query offset (a device tensor in a captured forward) with 0 on the host: a CUDA
    capture would fail there. The bucket runs eagerly from then on; tokens stay right."""
    target, _ = tiny_pair("llama")
    expected = specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET, stop_token_ids=[])
    monkeypatch.setattr(cache_mod, "slot_masks", lambda model, mask, cached, q: mask)
    res = captured_run(target)
    assert res.sequences == expected
    g = res.stats.graphs
    assert g["captured"] == 0 and g["failed"] > 0
    assert g["eager"] == {"its bucket's capture failed": g["eager"]["its bucket's capture failed"]}


# -- the checker on a captured run -----------------------------------------------------------

@pytest.mark.engine
@pytest.mark.parametrize("strategy", strategy_names())
def test_the_strict_monitor_checks_a_captured_run(strategy):
    target, _ = tiny_pair("mistral")
    expected = specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET, stop_token_ids=[])
    monitor = Monitor("strict")
    res = captured_run(target, strategy, hooks=[monitor])
    assert res.sequences == expected
    assert monitor.check() == []
    assert_all_captured(res.stats)


@pytest.mark.engine
def test_forward_hooks_see_every_captured_forward_and_the_guard_is_silent():
    target, _ = tiny_pair("llama")
    expected = specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET, stop_token_ids=[])
    seen = []  # the rank of the mask every forward's pre-hook gets

    def record(module, args, kwargs):
        seen.append(kwargs["attention_mask"].dim())

    handle = target.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with guard_model(target, mode="strict") as guard:
            res = captured_run(target)
    finally:
        handle.remove()
    assert res.sequences == expected
    assert_all_captured(res.stats)
    # every forward: the replays and the (eager) prefills, each with the loop's 2-D mask
    assert guard.forwards == len(seen) > res.stats.graphs["replayed"]
    assert set(seen) == {2}


@pytest.mark.engine
def test_the_guard_catches_a_wrong_position_in_a_replayed_forward(monkeypatch):
    target, _ = tiny_pair("llama")
    orig, calls = cache_mod.forward, []

    def skipping(model, input_ids, positions, *args, **kw):  # a verify skips a position
        if kw.get("key_width") is not None and input_ids.shape[1] > 1:
            calls.append(1)
            if len(calls) == 6:
                positions = positions.clone()
                positions[0, -1] += 1
        return orig(model, input_ids, positions, *args, **kw)

    monkeypatch.setattr(cache_mod, "forward", skipping)
    with guard_model(target, mode="strict") as guard, \
            pytest.raises(InvariantViolation, match="I3"):
        captured_run(target)
    assert len(calls) == 6 and guard.forwards > 6


@pytest.mark.engine
def test_a_guard_with_content_rules_runs_its_forwards_eagerly_and_is_silent():
    target, _ = tiny_pair("llama")
    expected = specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET, stop_token_ids=[])
    with guard_model(target, mode="strict", prompts=PROMPTS, max_new_tokens=BUDGET,
                     stop_token_ids=[]) as guard:
        res = captured_run(target)
        guard.check_outputs(res.sequences)
    assert res.sequences == expected
    g = res.stats.graphs
    assert g["captured"] == 0 and sum(g["eager"].values()) > 0
    assert all("guard_model" in reason for reason in g["eager"])
    assert guard.forwards > 2
    # the guard is gone: the same model's forwards are captured again
    assert_all_captured(captured_run(target).stats)


# -- the boundary ------------------------------------------------------------------------------

def test_cuda_graphs_turn_static_shapes_on_and_refuse_them_off():
    target, _ = tiny_pair("llama")
    assert static.checked(None, "cuda-graphs") is True
    assert static.checked(None, None) is False and static.checked(None, "inductor") is False
    with graphs.cpu_proxy(), pytest.raises(ValueError, match=r"compile='cuda-graphs' captures "
                                           r"one graph per shape bucket, so it needs "
                                           r"static_shapes .*got static_shapes=False"):
        specdec.generate(target, PROMPTS, compile="cuda-graphs", static_shapes=False)


def test_cuda_graphs_on_a_cpu_outside_the_stand_in_are_refused():
    target, _ = tiny_pair("llama")
    with pytest.raises(ValueError, match=r"compile='cuda-graphs' captures CUDA graphs: it needs "
                                         r"a model on a CUDA device.*cpu_proxy"):
        specdec.generate(target, PROMPTS, compile="cuda-graphs")
    with pytest.raises(ValueError, match=r"the model is on 'cpu'"):
        graphs.ForwardGraphs(models.tiny("llama"))


@pytest.mark.engine
def test_an_addressed_forward_needs_a_key_width():
    target, _ = tiny_pair("llama")
    cache = cache_mod.new_cache(target, 40)
    with pytest.raises(ValueError, match=r"an addressed forward needs a filled cache and a key "
                                         r"width"):
        with cache.addressed():
            pass


# -- on a GPU (benchmarks/gpu_check.sh): real CUDA graphs ------------------------------------

DEVICE = os.environ.get("INVARIANTS_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.gpu
@pytest.mark.engine
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_captured_graphs_replay_the_eager_static_forwards_bit_for_bit(family):
    """On CUDA: every strategy and the plain loop, with CUDA graphs, give the tokens of
    the same run eager (static shapes, so the same kernels at the same shapes), and every
    decode and verify forward is a replay. On a CPU the same test runs the stand-in."""
    target = models.tiny(family).to(DEVICE)
    proxy = graphs.cpu_proxy if DEVICE == "cpu" else contextlib.nullcontext
    for strategy in strategy_names():
        kw = dict(drafter=drafters.NGramDrafter(), strategy=strategy, k=3, batch_size=3,
                  max_new_tokens=BUDGET, stop_token_ids=[], policy="fixed")
        eager = specdec.generate(target, PROMPTS, static_shapes=True, **kw)
        with proxy():
            res = specdec.generate(target, PROMPTS, compile="cuda-graphs", **kw)
        assert res.sequences == eager.sequences, strategy
        assert_all_captured(res.stats)
    plain = specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET, stop_token_ids=[],
                                       batch_size=4, static_shapes=True)
    with proxy():
        assert specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET,
                                          stop_token_ids=[], batch_size=4,
                                          compile="cuda-graphs") == plain
