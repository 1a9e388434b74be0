"""invariants over the real engine and Hugging Face generate (integration: imports specdec).

Acceptance: no false alarm from the Monitor in any mode on any tiny family with any
drafter (and in deep mode with every realignment strategy), nor from guard_model on
specdec.generate or Hugging Face generate (greedy, sampling, batch 1, left-padded,
assisted); deep mode catches a corrupted KV cache (I5) and a corrupted output (I7);
recording mode lets a broken run finish and keeps every violation.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

import specdec
from conftest import tiny_pair
from hyp_inputs import draft_lengths
from invariants import InvariantViolation, Monitor, guard_model
from specdec import drafters, models
from specdec.policy import ForcedPolicy
from specdec.strategies import names as strategy_names
from specdec.validation import fault_injection

pytestmark = pytest.mark.engine

torch.set_num_threads(1)
transformers.logging.set_verbosity_error()

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16], [3] * 9, [20, 21, 22]]
SLIDING = ("mistral", "gemma3")  # the tiny families with sliding-window layers
BUDGET = 10
K = 3


def make_drafter(kind, family, target):
    if kind == "ngram":
        return drafters.NGramDrafter()
    if kind == "model":
        return drafters.ModelDrafter(tiny_pair(family)[1])
    refs = specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET)
    # every third token wrong: rows keep rejecting at different offsets
    scripts = [[t if (i + r) % 3 else (t + 1) % models.TINY_VOCAB for i, t in enumerate(ref)]
               for r, ref in enumerate(refs)]
    return drafters.ScriptedDrafter(scripts)


@pytest.mark.parametrize("mode", ["fast", "strict", "deep"])
@pytest.mark.parametrize("kind", ["ngram", "model", "scripted"])
def test_no_false_alarm_on_the_engine(family, kind, mode):
    target, _ = tiny_pair(family)
    mon = Monitor(mode)
    with mon:
        res = specdec.generate(target, PROMPTS, drafter=make_drafter(kind, family, target), k=K,
                               batch_size=3, max_new_tokens=BUDGET, hooks=[mon])
    assert mon.violations == [] and mon.near_ties == []
    assert res.sequences == specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET)
    assert len(mon.accepted_history) == res.stats.steps


@pytest.mark.parametrize("strategy", [s for s in strategy_names() if s != "eqspec"])
def test_no_false_alarm_on_every_realignment_strategy(family, strategy):
    target, _ = tiny_pair(family)
    mon = Monitor("deep")
    try:
        res = specdec.generate(target, PROMPTS, drafter=make_drafter("scripted", family, target),
                               k=K, batch_size=3, max_new_tokens=BUDGET, strategy=strategy,
                               hooks=[mon])
    except NotImplementedError:
        pytest.skip(f"strategy {strategy} is not implemented in this checkout")
    assert mon.check() == [] and mon.near_ties == []
    assert res.sequences == specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET)


@pytest.mark.parametrize("k", [0, 1])
def test_no_false_alarm_with_few_drafts_and_early_stops(k):
    target, _ = tiny_pair("llama")
    refs = specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET)
    stop = refs[0][2]  # a token the first row emits early: rows stop at different steps
    mon = Monitor("deep")
    specdec.generate(target, PROMPTS, k=k, max_new_tokens=BUDGET, stop_token_ids=[stop],
                     hooks=[mon])
    assert mon.check() == []


@pytest.mark.parametrize("strategy", strategy_names())
def test_the_monitor_never_writes_its_view(family, strategy):
    """The Monitor declares ``read_only`` (the engine then does not watch it): run watched,
    through a hook that declares nothing, every mode it has on every family and strategy
    (deep on one family: it is slow), it writes none of the view's tensors or caches."""
    target, _ = tiny_pair(family)
    modes = ("fast", "strict", "deep") if family == "llama" else ("fast", "strict")
    assert Monitor.read_only is True
    for mode in modes:
        mon = Monitor(mode)
        watched = lambda phase, view, mon=mon: mon(phase, view)  # noqa: E731
        specdec.generate(target, PROMPTS, drafter=make_drafter("scripted", family, target), k=K,
                         batch_size=3, max_new_tokens=BUDGET, strategy=strategy,
                         hooks=[watched])  # a write raises ValueError here
        assert mon.check() == []


def test_the_fixture_monitors_an_engine_run(invariants_monitor):
    target, _ = tiny_pair("qwen3")
    specdec.generate(target, PROMPTS, k=K, max_new_tokens=BUDGET, hooks=[invariants_monitor])


# -- guard_model on the engine and on Hugging Face generate ------------------------------

def test_guard_is_silent_on_the_engine(family):
    target, draft = tiny_pair(family)
    with guard_model(target) as g, guard_model(draft) as gd:
        specdec.generate(target, PROMPTS, drafter=drafters.ModelDrafter(draft), k=K,
                         batch_size=3, max_new_tokens=BUDGET)
    assert g.forwards > 2 and gd.forwards > 2


@pytest.mark.parametrize("strategy", strategy_names())
def test_the_content_rules_are_silent_on_the_engine(family, strategy):
    """C1-C3 on specdec's own engine: rows realigned, dropped and refilled between
    forwards (the guard follows cached slots by their keys' fingerprints)."""
    target, draft = tiny_pair(family)
    stops = [2]
    for mode in ("strict", "fast"):
        try:
            with guard_model(target, mode, prompts=PROMPTS, max_new_tokens=BUDGET,
                             stop_token_ids=stops) as g, guard_model(draft):
                res = specdec.generate(target, PROMPTS, drafter=drafters.ModelDrafter(draft),
                                       strategy=strategy, k=K, batch_size=3,
                                       max_new_tokens=BUDGET, stop_token_ids=stops)
        except NotImplementedError as e:  # a strategy this model cannot serve
            pytest.skip(str(e))
        assert g.check_outputs(res.sequences) == []
        assert g.content.unknown == 0 and g.forwards > 2
        # every forward read, but where holes meet sliding windows (prepared 4-D masks)
        assert g.content.skipped == 0 or (strategy == "holes" and family in SLIDING), \
            g.content.skipped


@pytest.mark.parametrize("strategy", strategy_names())
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_guard_is_silent_on_the_engine_with_static_shapes(family, strategy):
    """static_shapes=True hands the target 2-D masks wider than C + q (key widths in
    buckets, 0 past C + q): the coherence and content rules stay silent, and the tokens
    are the reference's."""
    target = models.tiny(family)
    ref = specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET)
    for mode in ("strict", "fast"):
        try:
            with guard_model(target, mode, prompts=PROMPTS, max_new_tokens=BUDGET) as g:
                res = specdec.generate(target, PROMPTS, drafter=drafters.NGramDrafter(),
                                       strategy=strategy, k=K, batch_size=3, policy="fixed",
                                       max_new_tokens=BUDGET, static_shapes=True)
        except NotImplementedError as e:  # a strategy this model cannot serve
            pytest.skip(str(e))
        assert res.sequences == ref
        assert g.check_outputs(res.sequences) == [] and g.forwards > 2


@settings(max_examples=24, deadline=None, suppress_health_check=list(HealthCheck))
@given(family=st.sampled_from(models.FAMILIES), strategy=st.sampled_from(strategy_names()),
       lengths=draft_lengths(len(PROMPTS), K, BUDGET))
def test_the_content_rules_are_silent_on_the_engine_under_forced_draft_lengths(
        family, strategy, lengths):
    """Rows drafting different lengths per step (``ForcedPolicy``): a row whose k_b is
    below the step's width feeds drafts it does not verify, and the drafter may propose
    them again at the same place next step; C2 counts them as drafts until a forward
    attends them as decided, so an exact run raises nothing."""
    target, draft = tiny_pair(family)
    stops = [2]
    try:
        with guard_model(target, "strict", prompts=PROMPTS, max_new_tokens=BUDGET,
                         stop_token_ids=stops) as g:
            res = specdec.generate(target, PROMPTS, drafter=drafters.ModelDrafter(draft),
                                   strategy=strategy, k=K, batch_size=3,
                                   policy=ForcedPolicy(lengths), max_new_tokens=BUDGET,
                                   stop_token_ids=stops)
    except NotImplementedError:  # a strategy this model cannot serve
        assume(False)
    assert res.sequences == specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET,
                                                       stop_token_ids=stops)
    assert g.check_outputs(res.sequences) == []
    assert g.content.unknown == 0


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampling"])
def test_the_content_rules_are_silent_on_hf_generate(family, sample):
    target, _ = tiny_pair(family)
    ids, mask = _padded(PROMPTS)
    torch.manual_seed(0)
    with guard_model(target, prompts=PROMPTS, max_new_tokens=6, greedy=not sample) as g:
        gen = target.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=sample,
                              pad_token_id=2, eos_token_id=None)
    assert g.check_outputs(gen[:, ids.shape[1]:]) == []
    if not sample:
        assert gen[:, ids.shape[1]:].tolist() == specdec.reference_generate(
            target, PROMPTS, max_new_tokens=6, stop_token_ids=[])


def _padded(prompts):
    w = max(len(p) for p in prompts)
    ids = torch.tensor([[2] * (w - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (w - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampling"])
def test_guard_is_silent_on_hf_generate(family, sample):
    target, _ = tiny_pair(family)
    ids, mask = _padded(PROMPTS)
    torch.manual_seed(0)
    with guard_model(target) as g:
        target.generate(ids[:1, -6:], max_new_tokens=6, do_sample=sample, pad_token_id=2)
        target.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=sample,
                        pad_token_id=2)
    assert g.forwards >= 2 and g.violations == []


def test_guard_is_silent_on_hf_assisted_generation(family, monkeypatch):
    target, draft = tiny_pair(family)
    crops = []
    original = DynamicCache.crop
    monkeypatch.setattr(DynamicCache, "crop", lambda self, n: crops.append(n) or original(self, n))
    with guard_model(target), guard_model(draft):
        out = target.generate(torch.tensor([PROMPTS[0]]), assistant_model=draft,
                              max_new_tokens=16, do_sample=False, pad_token_id=2)
    assert crops, "assisted generation never rejected a draft: the test proves nothing"
    ref = specdec.reference_generate(target, PROMPTS[:1], max_new_tokens=16)[0]
    assert out[0, len(PROMPTS[0]):].tolist()[: len(ref)] == ref


# -- deep mode catches what only recomputation shows ----------------------------------------

def test_deep_mode_catches_a_corrupted_kv_cache():
    target, _ = tiny_pair("llama")

    def corrupt(phase, view):
        if phase == "realign" and view.step == 2:
            keys = view.cache_tensors()[1][0]
            keys[0, :, -1, :] += 0.5  # the newest cached slot of row 0, last layer

    with pytest.raises(InvariantViolation) as err:
        specdec.generate(target, PROMPTS, k=K, max_new_tokens=BUDGET,
                         hooks=[fault_injection(corrupt), Monitor("deep")])
    v = err.value
    assert (v.invariant, v.phase, v.step, v.rows) == ("I5", "realign", 2, [0])
    assert v.slots == [[v.trace["width"] - 2]]
    assert "allclose" in v.rules[0]


def test_deep_mode_catches_an_output_that_leaves_greedy_decoding():
    target, _ = tiny_pair("llama")

    def corrupt(phase, view):
        if phase == "commit" and view.step == 1:
            view.output[1, 0] = (view.output[1, 0] + 1) % models.TINY_VOCAB  # in the engine

    with pytest.raises(InvariantViolation) as err:
        specdec.generate(target, PROMPTS, k=K, max_new_tokens=BUDGET,
                         hooks=[fault_injection(corrupt), Monitor("deep", invariants=("I7",))])
    v = err.value
    assert (v.invariant, v.rows, v.slots) == ("I7", [1], [[0]])
    assert "desync" in v.rules[0]


def test_recording_mode_lets_a_broken_run_finish():
    target, _ = tiny_pair("llama")

    def shift(phase, view):  # a realignment that writes positions off by one
        if phase == "realign":
            view.positions[:, -1] += 1

    mon = Monitor("strict", raise_on_violation=False, run={"family": "llama"})
    res = specdec.generate(target, PROMPTS, k=K, max_new_tokens=BUDGET, hooks=[fault_injection(shift), mon])
    realigns = res.stats.steps - 1
    assert len(mon.violations) >= realigns > 0
    assert {v.invariant for v in mon.violations} == {"I3"}
    assert mon.violations[0].trace["info"]["strategy"] == "eqspec"
    assert mon.violations[0].trace["run"] == {"family": "llama"}


def test_deep_mode_records_a_near_tie_instead_of_raising():
    target = models.tiny("llama")  # a private copy: its output layer is edited below
    prompt = PROMPTS[0]
    t = specdec.reference_generate(target, [prompt], max_new_tokens=BUDGET)[0][1]
    u = next(x for x in range(3, models.TINY_VOCAB) if x != t)
    with torch.no_grad():  # u's logit equals t's everywhere (an exact tie), and as an
        # input u reads as t, so the row's continuation after either is the same
        target.lm_head.weight[u] = target.lm_head.weight[t]
        target.get_input_embeddings().weight[u] = target.get_input_embeddings().weight[t]
    ref = specdec.reference_generate(target, [prompt], max_new_tokens=BUDGET)[0]
    i = next(j for j, x in enumerate(ref) if x in (t, u))

    def flip(phase, view):  # the engine "chooses" the other tied token at index i
        if phase == "commit" and view.generated[0] > i and view.row_ids[0] == 0:
            view.output[0, i] = u if ref[i] == t else t

    mon = Monitor("deep", invariants=("I7",))
    specdec.generate(target, [prompt], k=K, max_new_tokens=BUDGET, hooks=[fault_injection(flip), mon])
    assert mon.check() == []
    assert [(n["row_id"], n["index"]) for n in mon.near_ties] == [(0, i)]
    assert mon.near_ties[0]["margin"] == 0 and mon.near_ties[0]["spread"] is not None


def test_deep_mode_finds_a_desync_after_a_near_tie():
    target = models.tiny("llama")  # a private copy: two tokens tied, as above
    prompt = PROMPTS[0]
    t = specdec.reference_generate(target, [prompt], max_new_tokens=BUDGET)[0][1]
    u = next(x for x in range(3, models.TINY_VOCAB) if x != t)
    with torch.no_grad():
        target.lm_head.weight[u] = target.lm_head.weight[t]
        target.get_input_embeddings().weight[u] = target.get_input_embeddings().weight[t]
    ref = specdec.reference_generate(target, [prompt], max_new_tokens=BUDGET)[0]
    i = next(j for j, x in enumerate(ref) if x in (t, u))
    j = i + 2
    assert j < len(ref)

    def flip_then_corrupt(phase, view):
        if phase == "commit" and view.row_ids[0] == 0:
            if view.generated[0] > i:
                view.output[0, i] = u if ref[i] == t else t  # a legitimate near-tie
            if view.generated[0] > j:
                view.output[0, j] = (ref[j] + 1) % models.TINY_VOCAB  # a real desync

    mon = Monitor("deep", invariants=("I7",))
    with pytest.raises(InvariantViolation) as err:
        specdec.generate(target, [prompt], k=K, max_new_tokens=BUDGET,
                         hooks=[fault_injection(flip_then_corrupt), mon])
    v = err.value
    assert (v.invariant, v.rows, v.slots) == ("I7", [0], [[j]])
    assert "teacher-forced" in v.rules[0] and "desync" in v.rules[0]
    assert [n["index"] for n in mon.near_ties] == [i]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_deep_mode_is_silent_on_a_correct_engine_in_reduced_precision(dtype):
    target = models.tiny("qwen3", dtype=dtype)
    prompts = PROMPTS + [[30 + r] * (4 + 7 * r) for r in range(4)]
    refs = specdec.reference_generate(target, prompts, max_new_tokens=BUDGET)
    scripts = [[t if (i + r) % 3 else (t + 1) % models.TINY_VOCAB for i, t in enumerate(ref)]
               for r, ref in enumerate(refs)]
    for strategy in strategy_names():
        mon = Monitor("deep", invariants=("I7",))
        specdec.generate(target, prompts, k=K, batch_size=4, max_new_tokens=BUDGET,
                         drafter=drafters.ScriptedDrafter(scripts), strategy=strategy,
                         hooks=[mon])
        assert mon.check() == []
        assert all(n["classification"] == "near-tie" for n in mon.near_ties)


# -- fast mode reads at the end, and records what strict mode records ----------------------

def _same_records(run):
    """Run ``run(hooks)`` under a fast and a strict recording Monitor side by side: the
    same violations (invariant, step, phase, rows, rules, slots), in the same order."""
    fast = Monitor("fast", raise_on_violation=False)
    strict = Monitor("strict", raise_on_violation=False)
    run([strict, fast])
    key = lambda v: (v.invariant, v.step, v.phase, v.rows, v.rules, v.slots)  # noqa: E731
    assert [key(v) for v in fast.check()] == [key(v) for v in strict.check()]
    return strict.violations


@pytest.mark.parametrize("fault", ["implicit_positions", "mask_all_ones", "accept_first_mismatch",
                                   "crop_to_batch_min", "drop_bonus", "keep_after_stop"])
def test_fast_mode_records_what_strict_records_on_every_known_bad_engine(fault):
    from specdec.forensics.known_bad import KNOWN_BAD, generate_known_bad

    assert fault in KNOWN_BAD
    target, _ = tiny_pair("llama")
    refs = specdec.reference_generate(target, PROMPTS, max_new_tokens=BUDGET)
    # exact drafts where the fault needs a step that accepts every draft
    drafter = drafters.ScriptedDrafter(refs) if fault == "drop_bonus" \
        else make_drafter("scripted", "llama", target)
    found = _same_records(lambda hooks: generate_known_bad(
        fault, target, PROMPTS, drafter=drafter, k=K, max_new_tokens=BUDGET,
        stop_token_ids=[refs[0][2]], hooks=hooks))
    assert found


@pytest.mark.parametrize("name", ["padding_off_by_one", "positions_from_slot",
                                  "mask_not_refreshed", "draft_limit_unclipped",
                                  "holes_keeps_first_rejected", "source_off_by_one"])
def test_fast_mode_records_what_strict_records_on_mutants(name):
    from specdec import mutants

    target, _ = tiny_pair("llama")
    strategy = mutants.CATALOGUE[name].strategy or "eqspec"
    with mutants.apply(name):
        found = _same_records(lambda hooks: specdec.generate(
            target, PROMPTS, drafter=make_drafter("scripted", "llama", target), k=K,
            batch_size=3, max_new_tokens=BUDGET, strategy=strategy, hooks=hooks,
            policy="fixed"))  # every row drafts k: the mutants act on drafts
    assert found


def test_fast_mode_checks_a_commit_as_it_was_seen():
    """An engine that writes a commit's output in place after the commit view (here a
    hook at the next realign): fast mode, which checks commits at the end, still judges
    each commit by the values its view showed, so it records what strict mode records."""
    target, _ = tiny_pair("llama")

    def rewrite(phase, view):
        if phase == "realign" and view.step == 2:
            view.output[0, 0] = (view.output[0, 0] + 1) % models.TINY_VOCAB

    found = _same_records(lambda hooks: specdec.generate(
        target, PROMPTS, k=K, batch_size=3, max_new_tokens=BUDGET,
        hooks=[fault_injection(rewrite)] + hooks))
    assert found and found[0].phase == "realign" and found[0].step == 2


def test_fast_mode_falls_back_to_the_groups_when_a_waiting_check_raises():
    """Should checking the waiting views fail (together and alone), each view's groups
    run one by one on it: the records are still strict mode's."""
    from invariants import rules as R

    def broken(*args, **kwargs):
        raise RuntimeError("a batch that cannot be checked")

    # (both ways of waiting: by reference, and by copy)
    saved = [(fusion, name, getattr(fusion, name)) for fusion in R.FUSIONS
             for name in ("batch", "batch_refs") if getattr(fusion, name) is not None]
    for fusion, name, _ in saved:  # (frozen records: set by hand, restored below)
        object.__setattr__(fusion, name, broken)
    try:
        target, _ = tiny_pair("llama")
        from specdec.forensics.known_bad import generate_known_bad

        found = _same_records(lambda hooks: generate_known_bad(
            "accept_first_mismatch", target, PROMPTS,
            drafter=make_drafter("scripted", "llama", target), k=K, max_new_tokens=BUDGET,
            hooks=hooks))
        assert found
    finally:
        for fusion, name, batch in saved:
            object.__setattr__(fusion, name, batch)
