"""Specification of the strategies beyond EQSPEC (whose grid is tests/test_engine.py):
every output equals batch-1 greedy decoding and every view satisfies the invariants under
the strict Monitor, on every tiny family; the edge cases, for every registered strategy;
plus what is specific to each (holes: no KV gather below the threshold, compaction above
it, sliding windows over holes; exspec: grouping, window refill, fallback, submission
order, conservation of requests)."""

from __future__ import annotations

import pytest
import torch

import invariants
import specdec
from conftest import tiny_pair
from specdec import cache as cache_mod
from specdec import drafters, layout, models
from specdec import strategies as registry
from specdec.strategies import exspec as exspec_mod
from specdec.strategies import holes as holes_mod
from harness import MIXED_LENGTHS, corrupted, make_drafter, random_prompts

#: every registered strategy (edge cases), and those besides EQSPEC (the grid)
ALL = registry.names()
STRATEGIES = tuple(s for s in ALL if s != "eqspec")
NEW = 16  # new tokens per row in the equivalence grid
LENGTHS = MIXED_LENGTHS[:5]  # 1, 60, 7, 33, 2: mixed, the longest beyond mistral's window
_REF: dict = {}


def reference(family: str):
    """(prompts, batch-1 greedy ids) of the family's target on mixed-length prompts."""
    if family not in _REF:
        target, _ = tiny_pair(family)
        prompts = random_prompts(LENGTHS, models.TINY_VOCAB, seed=1)
        _REF[family] = (prompts, specdec.reference_generate(target, prompts, max_new_tokens=NEW))
    return _REF[family]


def grid_drafter(kind: str, family: str, ref):
    return make_drafter(kind, tiny_pair(family)[1], ref, models.TINY_VOCAB)


def run(target, prompts, strategy, *, monitor=True, hooks=(), **kw):
    """``generate`` under the strict Monitor. Tests whose assertions need drafts (holes
    left, compactions, groups) pass ``policy="fixed"``: the default policy drafts by what
    earlier calls on the same model measured."""
    mon = invariants.Monitor(mode="strict")
    res = specdec.generate(target, prompts, strategy=strategy,
                           hooks=([mon] if monitor else []) + list(hooks), **kw)
    if monitor:
        assert mon.check() == []
    return res


# -- equivalence grid ------------------------------------------------------------------
# Full product per family and strategy: batch sizes {1, 3, 8} x k {1, 4, 8} x drafter
# {ngram, model, scripted}; batch 8 is also larger than the 5 prompts.

@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("drafter_kind", ["ngram", "model", "scripted"])
@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_equals_batch_1_greedy_under_the_strict_monitor(family, strategy, batch_size, k,
                                                        drafter_kind):
    target, _ = tiny_pair(family)
    prompts, ref = reference(family)
    res = run(target, prompts, strategy, drafter=grid_drafter(drafter_kind, family, ref), k=k,
              batch_size=batch_size, max_new_tokens=NEW)
    for i, (got, want) in enumerate(zip(res.sequences, ref)):
        assert got == want, f"row {i} (prompt length {len(prompts[i])}) diverges"


# -- edge cases (every strategy) -----------------------------------------------------------

@pytest.mark.parametrize("strategy", ALL)
def test_row_that_stops_at_its_first_new_token(strategy):
    target, draft = tiny_pair("llama")
    prompts = random_prompts((5, 12, 30), models.TINY_VOCAB, seed=7)
    free = specdec.reference_generate(target, prompts, max_new_tokens=12, stop_token_ids=[])
    stop = free[1][0]  # row 1's first token becomes a stop token
    ref = specdec.reference_generate(target, prompts, max_new_tokens=12, stop_token_ids=[stop])
    assert ref[1] == [stop]
    for drafter in (drafters.NGramDrafter(), drafters.ModelDrafter(draft)):
        res = run(target, prompts, strategy, drafter=drafter, k=4, batch_size=3,
                  max_new_tokens=12, stop_token_ids=[stop])
        assert res.sequences == ref


@pytest.mark.parametrize("strategy", ALL)
def test_max_new_tokens_one(strategy):
    target, draft = tiny_pair("gpt2")
    prompts = random_prompts((1, 8, 30), models.TINY_VOCAB, seed=3)
    ref = specdec.reference_generate(target, prompts, max_new_tokens=1)
    for drafter in (drafters.NGramDrafter(), drafters.ModelDrafter(draft)):
        res = run(target, prompts, strategy, drafter=drafter, k=4, max_new_tokens=1)
        assert res.sequences == ref and all(len(s) == 1 for s in res.sequences)


@pytest.mark.parametrize("strategy", ALL)
def test_batch_larger_than_prompt_count(strategy):
    target, draft = tiny_pair("mistral")
    prompts = random_prompts((3, 50, 17), models.TINY_VOCAB, seed=4)
    ref = specdec.reference_generate(target, prompts, max_new_tokens=20)
    res = run(target, prompts, strategy, drafter=drafters.ModelDrafter(draft), k=4,
              batch_size=16, max_new_tokens=20)
    assert res.sequences == ref


@pytest.mark.parametrize("strategy", ALL)
def test_pad_equal_to_eos_and_eos_inside_prompt(strategy):
    target, draft = tiny_pair("qwen3")
    stop = models.stop_token_ids(target)[0]
    assert target.generation_config.pad_token_id == stop
    prompts = random_prompts((9, 3, 20), models.TINY_VOCAB, seed=5)
    prompts[0][3] = stop  # eos inside a prompt must neither stop nor pad anything
    prompts[1] = [stop] + prompts[1]  # and at its start
    ref = specdec.reference_generate(target, prompts, max_new_tokens=16)
    res = run(target, prompts, strategy, drafter=drafters.ModelDrafter(draft), k=4,
              batch_size=3, max_new_tokens=16)
    assert res.sequences == ref


@pytest.mark.parametrize("strategy", ALL)
def test_nothing_is_committed_after_a_stop_token(strategy):
    target, _ = tiny_pair("glm4")
    prompts = random_prompts((4, 15), models.TINY_VOCAB, seed=11)
    free = specdec.reference_generate(target, prompts, max_new_tokens=20, stop_token_ids=[])
    stop = free[0][5]
    res = run(target, prompts, strategy, drafter=drafters.ScriptedDrafter(free), k=8,
              batch_size=2, max_new_tokens=20, stop_token_ids=[stop])
    assert res.sequences[0] == free[0][: free[0].index(stop) + 1]
    for seq in res.sequences:
        assert stop not in seq[:-1]


def test_strategy_options_are_validated():
    target, _ = tiny_pair("llama")
    with pytest.raises(ValueError, match="hole_threshold"):
        specdec.generate(target, [[5, 6]], strategy="holes", hole_threshold=1.5)
    with pytest.raises(ValueError, match="applies to strategy='holes'"):
        specdec.generate(target, [[5, 6]], strategy="eqspec", hole_threshold=0.5)
    with pytest.raises(ValueError, match="window"):
        specdec.generate(target, [[5, 6]], strategy="exspec", batch_size=4, window=2)
    with pytest.raises(ValueError, match="applies to strategy='exspec'"):
        specdec.generate(target, [[5, 6]], strategy="holes", window=8)


# -- holes ---------------------------------------------------------------------------------

class Counter:
    """Counts calls of a method while patched (monkeypatch keeps the original)."""

    def __init__(self, monkeypatch, owner, name):
        self.calls = 0
        orig = getattr(owner, name)

        def wrapped(*a, **kw):
            self.calls += 1
            return orig(*a, **kw)

        monkeypatch.setattr(owner, name, wrapped)


def has_holes(valid: torch.Tensor) -> bool:
    """Some valid slot follows an invalid one after the row's first valid slot."""
    v = valid.long()
    started = v.cummax(dim=1).values.bool()
    return bool((started & ~valid.bool()).any())


class HoleRecorder:
    def __init__(self):
        self.holes = 0
        self.widths = []

    def __call__(self, phase, view):
        if phase == "draft":
            self.holes += has_holes(view.valid)
            self.widths.append(view.width)


def test_holes_never_gathers_below_the_threshold(monkeypatch):
    target, draft = tiny_pair("llama")
    prompts, ref = reference("llama")
    gathers = Counter(monkeypatch, cache_mod.SlabCache, "gather_slots")
    keeps = Counter(monkeypatch, cache_mod.SlabCache, "keep_rows")
    rec = HoleRecorder()
    res = run(target, prompts, "holes", policy="fixed", drafter=drafters.ModelDrafter(draft), k=4, batch_size=8,
              max_new_tokens=NEW, hole_threshold=1.0, hooks=[rec])
    assert res.sequences == ref
    assert gathers.calls == 0 and res.stats.compactions == 0
    assert rec.holes > 0  # rejected drafts did leave holes
    assert rec.widths == sorted(rec.widths)  # the batch only grows
    assert keeps.calls > 0  # finished rows left by moving a few rows (prompts finish apart)


def test_holes_compacts_above_the_threshold(monkeypatch):
    target, draft = tiny_pair("llama")
    prompts, ref = reference("llama")
    counts = {}
    for h in (0.0, 0.05, 1.0):
        gathers = Counter(monkeypatch, cache_mod.SlabCache, "gather_slots")
        res = run(target, prompts, "holes", policy="fixed", drafter=drafters.ModelDrafter(draft), k=4,
                  batch_size=8, max_new_tokens=NEW, hole_threshold=h)
        assert res.sequences == ref
        assert gathers.calls == 2 * res.stats.compactions  # target and draft cache
        counts[h] = res.stats.compactions
    assert counts[0.0] > counts[0.05] > counts[1.0] == 0


def test_holes_capacity_compaction_when_the_cache_is_full(monkeypatch):
    """With the threshold unreachable and a cache sized for EQSPEC, compaction is forced.
    Every row drafts k (policy='fixed'): the adaptive policy's lengths follow step timings,
    and a loaded machine can keep the widths small enough that the cache never fills."""
    target, _ = tiny_pair("gpt2")
    prompts, ref = reference("gpt2")
    monkeypatch.setattr(holes_mod.STRATEGY, "capacity",
                        lambda ctx, w, mb: layout.contiguous_capacity(w, mb, ctx.k))
    res = run(target, prompts, "holes", drafter=drafters.ScriptedDrafter(corrupted(ref, models.TINY_VOCAB)), k=4,
              batch_size=3, max_new_tokens=NEW, hole_threshold=1.0, policy="fixed")
    assert res.sequences == ref and res.stats.compactions > 0


def test_holes_ngram_drafts_ignore_holes():
    """The n-gram drafter sees each row compacted: it proposes what it proposes under
    EQSPEC, step for step (same acceptance counts), with every row drafting k and with
    forced per-row draft lengths (the adaptive policy's lengths depend on step timings,
    so two runs need not step alike)."""
    from specdec.policy import ForcedPolicy

    target, _ = tiny_pair("gpt2")
    prompts, ref = reference("gpt2")
    ragged = [[(r + s) % 5 for s in range(NEW)] for r in range(len(prompts))]  # k_b 0..4
    for policy in (lambda: "fixed", lambda: ForcedPolicy(ragged)):
        got = {}
        for strategy, kw in (("eqspec", {}), ("holes", {"hole_threshold": 1.0})):
            hist = []
            res = specdec.generate(target, prompts, drafter=drafters.NGramDrafter(), k=4,
                                   batch_size=8, max_new_tokens=NEW, strategy=strategy,
                                   policy=policy(),
                                   hooks=[lambda ph, v: hist.append(v.drafts.tolist())
                                          if ph == "draft" else None], **kw)
            assert res.sequences == ref
            got[strategy] = (hist, res.stats.accepted)
        assert got["holes"] == got["eqspec"] and got["eqspec"][1] > 0


class WindowHoles:
    """Records whether a verify ever had a hole within the sliding window of its pending
    token (the situation where slot-based sliding masks go wrong)."""

    def __init__(self, window):
        self.window, self.seen = window, False

    def __call__(self, phase, view):
        if phase == "verify":
            tail = view.valid[:, -self.window:]
            self.seen |= has_holes(torch.cat([torch.ones_like(tail[:, :1]), tail], dim=1))


@pytest.mark.parametrize("family", [models.SLIDING_FAMILY, models.HYBRID_FAMILY])
def test_holes_sliding_window_beyond_the_window(monkeypatch, family):
    """Every layer sliding (mistral), or sliding layers mixed with full ones (gemma3: one
    position mask per layer type). Every row drafts k (policy='fixed'): holes need
    rejected drafts, and the adaptive policy may draft nothing on a tiny model."""
    target, draft = tiny_pair(family)
    window = target.config.sliding_window
    prompts = random_prompts((5, 30, 12, 40), models.TINY_VOCAB, seed=2)
    new = 40  # every row ends beyond the window
    ref = specdec.reference_generate(target, prompts, max_new_tokens=new)
    kinds = (drafters.ScriptedDrafter(corrupted(ref, models.TINY_VOCAB)), drafters.ModelDrafter(draft))
    for drafter in kinds:
        rec = WindowHoles(window)
        res = run(target, prompts, "holes", drafter=drafter, k=4, batch_size=4,
                  max_new_tokens=new, hole_threshold=1.0, hooks=[rec], policy="fixed")
        assert res.sequences == ref and rec.seen and res.stats.compactions == 0
    # controls: the slot-based mask Hugging Face would build diverges on the same run; so
    # does, on the hybrid family, the window applied to its full-attention layers too
    position_mask = cache_mod.position_mask
    wrong = [lambda model, mask, *a: mask.long()]
    if cache_mod.layer_types(target) is not None:
        wrong.append(lambda model, mask, kpos, qpos, win: {
            t: position_mask(model, mask, kpos, qpos, win) for t in cache_mod.layer_types(model)})
    for masks in wrong:
        monkeypatch.setattr(cache_mod, "position_masks", masks)
        res = specdec.generate(target, prompts, k=4, batch_size=4, max_new_tokens=new,
                               drafter=drafters.ScriptedDrafter(corrupted(ref, models.TINY_VOCAB)),
                               strategy="holes", hole_threshold=1.0, policy="fixed")
        assert res.sequences != ref


def test_holes_refuses_sliding_windows_it_cannot_mask():
    model = models.tiny(models.SLIDING_FAMILY)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(NotImplementedError, match="sdpa or eager"):
        specdec.generate(model, [[5, 6, 7]], strategy="holes", max_new_tokens=2)


@pytest.mark.parametrize("family", [models.SLIDING_FAMILY, models.HYBRID_FAMILY])
def test_holes_eager_attention_sliding_window(family):
    """The additive float form of the position mask (eager attention)."""
    model = models.tiny(family)
    model.config._attn_implementation = "eager"
    prompts = random_prompts((30, 9), models.TINY_VOCAB, seed=6)
    ref = specdec.reference_generate(model, prompts, max_new_tokens=24)
    res = run(model, prompts, "holes", drafter=drafters.ScriptedDrafter(corrupted(ref, models.TINY_VOCAB)), k=4,
              batch_size=2, max_new_tokens=24, hole_threshold=1.0)
    assert res.sequences == ref


# -- exspec --------------------------------------------------------------------------------

class PoolRecorder:
    """Checks conservation of requests at every phase and records what the pool did."""

    def __init__(self, count, window):
        self.count, self.window = count, window
        self.profiles, self.prefills, self.finish_order = [], 0, []
        self.active_seen = set()
        self.last_served, self.max_wait = {}, 0

    def __call__(self, phase, view):
        pool = view.info["pool"]
        w, a, f = pool["waiting"], pool["active"], pool["finished"]
        assert sorted(w + a + f) == list(range(self.count)), "every request in exactly one set"
        assert len(a) <= self.window
        assert w == sorted(w), "waiting requests are admitted in submission order"
        assert f[: len(self.finish_order)] == self.finish_order, "finished only grows"
        self.finish_order = list(f)
        self.active_seen.update(a)
        if phase == "prefill":
            self.prefills += 1
        if phase == "draft":
            self.profiles.append(view.profile)
            served = set(view.row_ids.tolist())
            for r in a:  # steps an active request waited since its admission or last step
                self.last_served.setdefault(r, view.step)
                if r in served:
                    self.max_wait = max(self.max_wait, view.step - self.last_served[r])
                    self.last_served[r] = view.step + 1


def test_exspec_groups_equal_lengths_and_reuses_the_group(monkeypatch):
    """Equal prompt lengths and drafts always accepted: every row commits k + 1 per step,
    so groups form and persist; a persisting group is reused without a pool load."""
    target, _ = tiny_pair("llama")
    prompts = random_prompts((10,) * 8, models.TINY_VOCAB, seed=8)
    ref = specdec.reference_generate(target, prompts, max_new_tokens=NEW, stop_token_ids=[])
    loads = Counter(monkeypatch, cache_mod.SlotPool, "load")
    rec = PoolRecorder(len(prompts), 4)
    res = run(target, prompts, "exspec", policy="fixed", drafter=drafters.ScriptedDrafter(ref), k=3,
              batch_size=2, window=4, max_new_tokens=NEW, stop_token_ids=[], hooks=[rec])
    assert res.sequences == ref
    assert res.stats.group_rate == 1.0 and set(rec.profiles) == {"grouped"}
    assert res.stats.as_dict()["group_rate"] == 1.0
    assert loads.calls < res.stats.steps  # reused groups load nothing


def test_exspec_fallback_refill_order_and_conservation():
    """Mixed lengths force fallback steps; more prompts than the window force refills;
    stop tokens make requests finish out of order; outputs stay in submission order."""
    target, draft = tiny_pair("qwen3")
    prompts = random_prompts((1, 60, 7, 33, 2, 18, 45, 12, 7, 7, 7), models.TINY_VOCAB, seed=9)
    free = specdec.reference_generate(target, prompts, max_new_tokens=20, stop_token_ids=[])
    stops = [free[3][2], free[6][9]]
    ref = specdec.reference_generate(target, prompts, max_new_tokens=20, stop_token_ids=stops)
    rec = PoolRecorder(len(prompts), 6)
    res = run(target, prompts, "exspec", policy="fixed", drafter=drafters.ModelDrafter(draft), k=4,
              batch_size=3, window=6, max_new_tokens=20, stop_token_ids=stops, hooks=[rec])
    assert res.sequences == ref
    assert "contiguous" in rec.profiles  # the fallback ran
    assert rec.prefills > 1  # the window was refilled
    assert rec.active_seen == set(range(len(prompts)))
    # (the last rows finish after the last view: hooks see a prefix of the finish order)
    assert len(set(rec.finish_order)) == len(rec.finish_order) > len(prompts) // 2
    assert rec.finish_order != sorted(rec.finish_order)  # finished out of order
    assert 0.0 <= res.stats.group_rate < 1.0
    # shortest-first fallback with patience: no request waits much beyond the patience
    rounds = -(-6 // 3)
    assert rec.max_wait <= (exspec_mod.PATIENCE + 1) * rounds + 1, rec.max_wait


def test_exspec_group_rate_on_a_mixed_workload():
    """A workload that allows grouping (lengths in pairs) but rejects drafts at a different
    step in each row, so pairs drift apart and the fallback is needed too: the group rate
    is strictly between 0 and 1."""
    target, _ = tiny_pair("gpt2")
    prompts = random_prompts((6, 6, 9, 9, 14, 14, 3, 3), models.TINY_VOCAB, seed=10)
    ref = specdec.reference_generate(target, prompts, max_new_tokens=NEW, stop_token_ids=[])
    v = models.TINY_VOCAB
    scripts = [[(t + 1) % v if (i + r) % 4 == 3 else t for i, t in enumerate(s)]
               for r, s in enumerate(ref)]
    res = run(target, prompts, "exspec", policy="fixed", drafter=drafters.ScriptedDrafter(scripts),
              k=4, batch_size=2, window=8, max_new_tokens=NEW, stop_token_ids=[])
    assert res.sequences == ref
    assert 0.0 < res.stats.group_rate < 1.0


def test_exspec_batch_1_is_always_grouped():
    target, _ = tiny_pair("glm4")
    prompts, ref = reference("glm4")
    res = run(target, prompts, "exspec", drafter=drafters.NGramDrafter(), k=4, batch_size=1,
              max_new_tokens=NEW)
    assert res.sequences == ref and res.stats.group_rate == 1.0


def test_other_strategies_report_no_group_rate():
    target, _ = tiny_pair("llama")
    res = specdec.generate(target, [[5, 6, 7]], max_new_tokens=3)
    assert res.stats.group_rate is None and res.stats.as_dict()["group_rate"] is None
