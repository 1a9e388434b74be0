"""guard_model with prompts, as a specification: the content rules C1-C3 catch the
corruptions a foreign loop makes with every forward coherent, and stay silent on correct
loops, on Hugging Face ``generate`` (greedy, left-padded, assisted, sampling).

The loops (``foreign_loops.py``) drive a tiny Llama built from transformers alone; this
module collects no specdec code, so the checker's CI job runs it on transformers 4.51
too. The project's own engine under the content rules: ``test_invariants_integration.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from foreign_loops import FAULTS, left_pad, speculative
from invariants import InvariantViolation, guard_model
from invariants._hf import cache_kwarg
from invariants.equivalence import greedy_reference
from invariants.guard import Guard
from invariants.testing import TransferLog
from toy_engine import hf_tiny_llama

torch.set_num_threads(1)

VOCAB = 64
PROMPTS = [[5, 9, 13, 4, 8], [7, 3], [11, 12, 13]]
BUDGET = 12
K = 3
PAD = 2  # = the stop id of the pad == eos fault, as in SmolLM2's shipped config

#: the rule each fault breaks first: (invariant, rule id)
CAUGHT_BY = {
    "verify_without_mask": ("C1", "content.prompt"),
    "commit_first_mismatch": ("C2", "content.argmax"),
    "stop_at_fastest": ("C3", "outputs.length"),
    "pad_eos_done": ("C3", "outputs.length"),
    "draft_left_in_cache": ("C2", "content.argmax"),
}
SLOW = settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def target():
    return hf_tiny_llama(seed=2, vocab=VOCAB)


@pytest.fixture(scope="module")
def draft(target):
    """The target plus seeded relative noise: it agrees often, not always."""
    model = copy.deepcopy(target)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=g) * p.std() * 0.2)
    return model


def reference(target, prompts, budget=BUDGET, stops=()):
    return [greedy_reference(target, p, budget, stops)[0] for p in prompts]


def stops_of(fault):
    return [PAD] if fault == "pad_eos_done" else []


def guarded_run(target, draft, prompts, fault=None, mode="strict", **kw):
    """(outputs, guard) of the foreign loop under a content guard, outputs checked."""
    stops = stops_of(fault)
    with guard_model(target, mode, prompts=prompts, max_new_tokens=BUDGET,
                     stop_token_ids=stops) as g:
        out = speculative(target, draft, prompts, k=K, max_new_tokens=BUDGET,
                          stop_token_ids=stops, pad=PAD, fault=fault, **kw)
    g.check_outputs(out)
    return out, g


# -- adversarial inputs ------------------------------------------------------------------------

def ragged_prompts(min_rows=2, max_rows=4):
    """Prompts of different lengths (so rows are padded), tokens that avoid the pad id."""
    tokens = st.integers(3, VOCAB - 1)
    return st.lists(st.lists(tokens, min_size=1, max_size=6), min_size=min_rows,
                    max_size=max_rows).filter(lambda ps: len({len(p) for p in ps}) > 1)


draft_lengths = st.integers(1, 4)


# -- silent on correct loops ---------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["strict", "fast"])
def test_silent_on_a_correct_ragged_speculative_loop(target, draft, mode):
    out, g = guarded_run(target, draft, PROMPTS, mode=mode)
    assert out == reference(target, PROMPTS)
    assert g.violations == [] and g.content.unknown == 0
    assert g.forwards > 3


@SLOW
@given(prompts=ragged_prompts(), k=draft_lengths)
def test_any_correct_ragged_loop_is_exact_and_silent(target, draft, prompts, k):
    with guard_model(target, prompts=prompts, max_new_tokens=8) as g:
        out = speculative(target, draft, prompts, k=k, max_new_tokens=8, pad=PAD)
    g.check_outputs(out)
    assert out == reference(target, prompts, 8)


def test_silent_on_hf_generate_greedy_batch_1_and_left_padded(target):
    for prompts in (PROMPTS[:1], PROMPTS):
        ids, mask = left_pad(prompts, PAD)
        with guard_model(target, prompts=prompts, max_new_tokens=BUDGET) as g:
            gen = target.generate(ids, attention_mask=mask, max_new_tokens=BUDGET,
                                  do_sample=False, pad_token_id=PAD, eos_token_id=None)
        out = gen[:, ids.shape[1]:].tolist()
        g.check_outputs(out)
        assert out == reference(target, prompts) and g.content.unknown == 0


def test_silent_on_hf_generate_with_a_stop_token(target):
    """Rows that stop keep being fed padding (attended) by generate: past a row's first
    stop token nothing is checked; outputs are cut after it."""
    refs = reference(target, PROMPTS)
    stop = refs[1][3]  # a token row 1 really produces
    ids, mask = left_pad(PROMPTS, PAD)
    with guard_model(target, prompts=PROMPTS, max_new_tokens=BUDGET, stop_token_ids=[stop]) as g:
        gen = target.generate(ids, attention_mask=mask, max_new_tokens=BUDGET, do_sample=False,
                              pad_token_id=PAD, eos_token_id=stop)
    out = [o[: o.index(stop) + 1] if stop in o else o for o in gen[:, ids.shape[1]:].tolist()]
    g.check_outputs(out)
    assert out == reference(target, PROMPTS, stops=[stop]) and len(out[1]) < BUDGET


def test_silent_on_hf_assisted_generation(target, draft):
    prompt = PROMPTS[:1]
    with guard_model(target, prompts=prompt, max_new_tokens=BUDGET) as g, guard_model(draft):
        gen = target.generate(torch.tensor(prompt), assistant_model=draft, max_new_tokens=BUDGET,
                              do_sample=False, pad_token_id=PAD, eos_token_id=None)
    out = gen[:, len(prompt[0]):].tolist()
    g.check_outputs(out)
    assert out == reference(target, prompt) and g.forwards < BUDGET  # drafts were accepted


def test_sampling_keeps_c1_and_c3(target):
    ids, mask = left_pad(PROMPTS, PAD)
    torch.manual_seed(0)
    with guard_model(target, prompts=PROMPTS, max_new_tokens=BUDGET, greedy=False) as g:
        gen = target.generate(ids, attention_mask=mask, max_new_tokens=BUDGET, do_sample=True,
                              pad_token_id=PAD, eos_token_id=None)
    out = gen[:, ids.shape[1]:].tolist()
    g.check_outputs(out)
    assert out != reference(target, PROMPTS)  # really sampled
    with pytest.raises(InvariantViolation) as err:
        g.check_outputs([o[:-1] for o in out])  # C3 still holds the budget
    assert err.value.invariant == "C3"


@torch.no_grad()
def regrouping_loop(model, prompts, budget, mistake=None):
    """Greedy decoding that reverses the batch order every step and drops a row once it
    has its budget (cache rows selected with ``batch_select_indices``), as loops that
    regroup rows do. mistake="stale_mask": the mask is not reordered with the cache."""
    ids, mask = left_pad(prompts, PAD)
    cache = __import__("transformers").DynamicCache()
    kw = {cache_kwarg(model): cache}
    rows = list(range(len(prompts)))
    budgets = [budget - r for r in rows]  # ragged budgets: rows leave at different steps
    out = [[] for _ in prompts]
    logits = model(input_ids=ids, attention_mask=mask,
                   position_ids=(mask.cumsum(1) - 1).clamp(min=0), **kw).logits[:, -1]
    while rows:
        nxt = logits.argmax(-1).tolist()
        for i, r in enumerate(rows):
            out[r].append(nxt[i])
        keep = [i for i, r in enumerate(rows) if len(out[r]) < budgets[r]][::-1]
        if not keep:
            break
        order = torch.tensor(keep)
        cache.batch_select_indices(order)
        rows = [rows[i] for i in keep]
        mask = mask if mistake == "stale_mask" and len(keep) == mask.shape[0] else mask[order]
        tok = torch.tensor([nxt[i] for i in keep])[:, None]
        mask = torch.cat([mask, torch.ones(len(keep), 1, dtype=torch.long)], dim=1)
        pos = mask.sum(1, keepdim=True) - 1
        logits = model(input_ids=tok, attention_mask=mask, position_ids=pos, **kw).logits[:, -1]
    return out, [budget - r for r in range(len(prompts))]


def test_rows_may_be_reordered_and_dropped_between_forwards(target):
    with guard_model(target, prompts=PROMPTS, max_new_tokens=BUDGET) as g:
        out, budgets = regrouping_loop(target, PROMPTS, BUDGET)
    assert out == [r[:b] for r, b in zip(reference(target, PROMPTS), budgets)]
    assert g.violations == [] and g.content.unknown == 0


def test_a_mask_left_in_the_old_row_order_is_caught(target):
    with pytest.raises(InvariantViolation) as err:
        with guard_model(target, prompts=PROMPTS, max_new_tokens=BUDGET):
            regrouping_loop(target, PROMPTS, BUDGET, mistake="stale_mask")
    assert err.value.invariant == "C1" and err.value.step == 1


# -- each known-bad loop is caught ---------------------------------------------------------------

@pytest.mark.parametrize("fault", FAULTS)
def test_each_known_bad_loop_is_invisible_to_the_coherence_checks(target, draft, fault):
    """Every forward of these loops is coherent: without prompts the guard is silent, and
    yet the outputs are not greedy decoding's."""
    stops = stops_of(fault)
    with guard_model(target) as g:
        out = speculative(target, draft, PROMPTS, k=K, max_new_tokens=BUDGET,
                          stop_token_ids=stops, pad=PAD, fault=fault)
    assert g.violations == []
    assert out != reference(target, PROMPTS, stops=stops)


@pytest.mark.parametrize("mode", ["strict", "fast"])
@pytest.mark.parametrize("fault", FAULTS)
def test_each_known_bad_loop_is_caught_by_the_content_rules(target, draft, fault, mode):
    with pytest.raises(InvariantViolation) as err:
        guarded_run(target, draft, PROMPTS, fault=fault, mode=mode)
    v = err.value
    assert (v.invariant, v.trace["state"]["rule"]) == CAUGHT_BY[fault]


@SLOW
@given(prompts=ragged_prompts(), k=draft_lengths, fault=st.sampled_from(FAULTS))
def test_no_known_bad_loop_corrupts_an_output_silently(target, draft, prompts, k, fault):
    """Whenever a faulty loop's outputs differ from greedy decoding, the guard said so."""
    stops = stops_of(fault)
    try:
        with guard_model(target, prompts=prompts, max_new_tokens=8, stop_token_ids=stops) as g:
            out = speculative(target, draft, prompts, k=k, max_new_tokens=8,
                              stop_token_ids=stops, pad=PAD, fault=fault)
        g.check_outputs(out)
    except InvariantViolation as e:
        assert e.invariant in ("C1", "C2", "C3")
        return
    assert out == reference(target, prompts, 8, stops)


def test_a_prompt_with_padding_attended_is_no_registered_prompt(target):
    """C1 without a mask: every slot is valid, so the left padding is context."""
    ids, mask = left_pad(PROMPTS, PAD)
    with pytest.raises(InvariantViolation) as err:
        with guard_model(target, prompts=PROMPTS), torch.no_grad():
            target(input_ids=ids)
    v = err.value
    assert (v.invariant, v.rows, v.slots) == ("C1", [1, 2], [[0], [0]])


# -- traces ----------------------------------------------------------------------------------------

def test_a_content_trace_shows_context_kept_tokens_and_argmax(target, draft):
    with pytest.raises(InvariantViolation) as err:
        with guard_model(target, prompts=PROMPTS, run={"loop": "commit_first_mismatch"}):
            speculative(target, draft, PROMPTS, k=K, max_new_tokens=BUDGET, pad=PAD,
                        fault="commit_first_mismatch")
    v = err.value
    names = [name for name, _ in v.trace["grid"][0]["lines"]]
    assert names == ["context", "kept", "argmax"]
    row = v.rows[0]
    at = v.slots[0][0]
    cells = dict(v.trace["grid"][0]["lines"])
    col = v.trace["grid"][0]["columns"].index(at)
    assert cells["context"][col] != cells["argmax"][col]  # where they part
    assert at >= len(PROMPTS[v.trace["state"]["prompts"][0]]) and row in range(len(PROMPTS))
    assert InvariantViolation.from_json(v.to_json()).trace == v.trace
    assert "C2 greedy consistency violated" in str(v)


def test_an_output_trace_names_the_argmax_predicted_where_it_ended(target, draft):
    with pytest.raises(InvariantViolation) as err:
        guarded_run(target, draft, PROMPTS, fault="pad_eos_done")
    v = err.value
    assert v.phase == "outputs" and "without a stop; the model's argmax at output[0] was" \
        in v.rules[0]


# -- the boundary ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, message", [
    ({"prompts": []}, "non-empty list"),
    ({"prompts": [[1, -2]]}, "token ids >= 0"),
    ({"prompts": [[1]], "max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
    ({"max_new_tokens": 4}, "pass prompts= too"),
    ({"positions": "slots"}, "positions must be one of"),
])
def test_arguments_are_validated(target, kw, message):
    with pytest.raises(ValueError, match=message):
        Guard(target, **kw)


def test_check_outputs_needs_one_output_per_prompt(target):
    with guard_model(target, prompts=PROMPTS) as g:
        pass
    with pytest.raises(ValueError, match="one output per prompt: 3 prompts, got 2"):
        g.check_outputs([[1], [2]])


def test_without_prompts_the_guard_installs_no_content_hook(target):
    with guard_model(target) as g:
        assert g.content is None and len(target._forward_hooks) == 0
    with guard_model(target, prompts=PROMPTS):
        assert len(target._forward_hooks) == 1
    assert len(target._forward_hooks) == 0


# -- fast mode makes no host transfer ---------------------------------------------------------------

def test_the_fast_content_guard_makes_no_host_transfer(target, draft):
    """Every hook the content guard runs (the pre-hook, the argmax record, the cache's
    wrapped update) makes no host read, upload or data-dependent shape in fast mode."""
    log = TransferLog()  # raises at the first transfer
    g = Guard(target, "fast", prompts=PROMPTS, max_new_tokens=BUDGET)
    g._pre, g._post = log.wrap(g._pre), log.wrap(g._post)
    g.content._learn = log.wrap(g.content._learn)
    g.install()
    try:
        out = speculative(target, draft, PROMPTS, k=K, max_new_tokens=BUDGET, pad=PAD)
    finally:
        g.remove()
    assert log.counts() == {"read": 0, "upload": 0, "dynamic_shape": 0}
    assert g.check() == [] and g.check_outputs(out) == []
