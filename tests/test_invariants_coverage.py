"""Coverage triggers (issue 13, point 7): a fault that never fired is not "clean".

``invariants.Coverage`` counts, from the views a Monitor sees, how often each trigger of
``invariants.TRIGGERS`` occurred. Its counts equal a direct recount over the same views
(host lists, stated row by row); the hook reads nothing back and uploads nothing; the
Monitor carries one only when asked (``coverage=True``). On the engine, each known-bad
defect's trigger (``known_bad.TRIGGER``) occurs on a run that shows the defect and is 0
on a run that cannot, and the audit then prints that engine as "not exercised".
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import invariants
from invariants.coverage import TRIGGERS, Coverage
from invariants.testing import no_host_transfers
from toy_engine import TOY_STOP, toy_views

torch.set_num_threads(1)


def recount(views) -> dict:
    """The triggers of ``views``, stated directly on host lists."""
    n = dict.fromkeys(TRIGGERS, 0)
    last = None
    for phase, v in views:
        if phase == "realign" and last is not None:
            rows, width, k, profile = last
            n["row_drop"] += v.batch_size < rows
            if profile == v.profile == "holes" and v.width < width + k + 1:
                n["compaction"] += all(r == sorted(r) for r in v.valid.long().tolist())
            last = None
        if phase != "commit":
            continue
        last = (v.batch_size, v.width, v.k, v.profile)
        acc, lim, com = v.accepted.tolist(), v.draft_limit.tolist(), v.committed.tolist()
        gb, fin, out = v.generated_before.tolist(), v.finished.tolist(), v.output.tolist()
        rows = [b for b in range(v.batch_size) if com[b] > 0]
        n["all_accepted"] += sum(1 for b in rows if v.k > 0 and acc[b] == v.k)
        n["draft_rejected"] += sum(1 for b in rows if acc[b] < lim[b])
        n["stop_reached"] += sum(1 for b in rows
                                 if set(out[b][gb[b]: gb[b] + com[b]]) & set(v.stop_token_ids))
        on = [b for b in rows if not fin[b]]
        n["ragged_finish"] += bool(on) and any(fin[b] for b in rows)
        n["ragged_realign"] += len({com[b] for b in on}) > 1
    return n


toy_runs = st.tuples(
    st.lists(st.lists(st.integers(3, 15), min_size=1, max_size=8), min_size=1, max_size=5),
    st.integers(1, 4), st.integers(1, 10), st.integers(0, 10_000),
    st.sampled_from([0.0, 0.5, 0.9, 1.0]), st.sampled_from([(TOY_STOP,), (), (5, 7)]))


@settings(max_examples=40, deadline=None)
@given(toy_runs)
def test_counts_equal_a_direct_recount_over_the_same_views(run):
    prompts, k, budget, seed, p, stop = run
    views = list(toy_views(prompts, k=k, budget=budget, seed=seed, accept_p=p, stop=stop))
    cov = Coverage()
    for phase, v in views:
        cov(phase, v)
    assert cov.counts() == recount(views)


def test_the_hook_reads_nothing_back_and_uploads_nothing():
    views = list(toy_views([[3, 4, 5], [6, 7], [8, 9, 10, 11]], k=3, budget=8, seed=1,
                           accept_p=0.7))
    cov = Coverage()
    with no_host_transfers():
        for phase, v in views:
            cov(phase, v)
    assert sum(cov.counts().values()) > 0


def test_the_monitor_counts_triggers_only_when_asked():
    views = list(toy_views([[3, 4, 5], [6, 7]], k=2, budget=6, seed=2, accept_p=0.9))
    plain, counting, alone = invariants.Monitor("fast"), invariants.Monitor("fast", coverage=True), Coverage()
    for phase, v in views:
        plain(phase, v)
        counting(phase, v)
        alone(phase, v)
    assert plain.coverage is None and plain.check() == [] and counting.check() == []
    assert counting.coverage.counts() == alone.counts()
    counting.reset()
    assert set(counting.coverage.counts().values()) == {0}


# -- on the engine: each known-bad defect and its trigger --------------------------------------

ALL_RIGHT = [[] for _ in range(6)]  # ForcingDrafter patterns: every draft right
RAGGED = [[0], [1], [2], [3], [1], [2]]  # each row accepts its own count at every step


def _engine_case(stop_at: int | None, forced):
    """Tiny llama, 6 mixed prompts in batches of 3; drafts forced to the accepted counts
    ``forced`` (``ForcingDrafter`` patterns) or, for None, n-gram drafts (nearly all wrong
    on a random model); a stop token from row 0's reference."""
    import specdec
    from specdec import drafters, models

    target = models.tiny("llama")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, models.TINY_VOCAB, (n,), generator=g).tolist()
               for n in (3, 9, 5, 12, 2, 7)]
    ref = specdec.reference_generate(target, prompts, max_new_tokens=10, stop_token_ids=[])
    stops = [] if stop_at is None else [ref[0][stop_at]]
    make = (lambda: drafters.ForcingDrafter(ref, forced, models.vocab_size(target))) \
        if forced is not None else drafters.NGramDrafter
    return target, prompts, stops, make


@pytest.mark.engine
@pytest.mark.parametrize("fault", ["implicit_positions", "mask_all_ones", "accept_first_mismatch",
                                   "crop_to_batch_min", "drop_bonus", "keep_after_stop"])
def test_each_known_bad_defect_s_trigger_occurs_where_it_shows(fault):
    from specdec.forensics.known_bad import TRIGGER, generate_known_bad

    forced = {"drop_bonus": ALL_RIGHT, "crop_to_batch_min": RAGGED}.get(fault)
    target, prompts, stops, make = _engine_case(3, forced)
    cov, mon = Coverage(), invariants.Monitor("strict", raise_on_violation=False)
    generate_known_bad(fault, target, prompts, drafter=make(), k=3, max_new_tokens=10,
                       stop_token_ids=stops, hooks=[mon, cov], batch_size=3)
    assert cov.counts()[TRIGGER[fault]] > 0 and mon.check()


@pytest.mark.engine
@pytest.mark.parametrize("fault, forced, stop_at", [
    ("drop_bonus", None, 3),              # the n-gram drafter never gets every draft right here
    ("keep_after_stop", ALL_RIGHT, None),  # no stop token
    ("crop_to_batch_min", ALL_RIGHT, None),  # every row commits k + 1: one crop fits all
])
def test_a_defect_without_its_trigger_is_silent(fault, forced, stop_at):
    """What the audit must never call clean: no trigger, no violation."""
    from specdec.forensics.known_bad import TRIGGER, generate_known_bad

    target, prompts, stops, make = _engine_case(stop_at, forced)
    cov, mon = Coverage(), invariants.Monitor("strict", raise_on_violation=False)
    generate_known_bad(fault, target, prompts, drafter=make(), k=3, max_new_tokens=10,
                       stop_token_ids=stops, hooks=[mon, cov], batch_size=3)
    assert cov.counts()[TRIGGER[fault]] == 0 and mon.check() == []


@pytest.mark.engine
@pytest.mark.parametrize("strategy", ["eqspec", "exspec", "holes"])
def test_the_correct_engines_exercise_the_layout_triggers(strategy):
    """Mixed lengths, a stop, each row its own accepted count (one of them every draft):
    each strategy's run meets every row trigger, drops rows, and HOLES' compactions are
    the ones its Stats count."""
    import specdec

    target, prompts, stops, make = _engine_case(3, RAGGED)
    mon = invariants.Monitor("strict", coverage=True)
    res = specdec.generate(target, prompts, drafter=make(), strategy=strategy, k=3,
                           batch_size=3, max_new_tokens=10, stop_token_ids=stops, hooks=[mon],
                           policy="fixed", **({"hole_threshold": 0.2} if strategy == "holes" else {}))
    mon.check()
    got = mon.coverage.counts()
    print(strategy, got)
    assert got["all_accepted"] > 0 and got["stop_reached"] > 0 and got["ragged_finish"] > 0
    assert got["row_drop"] > 0 and got["draft_rejected"] > 0 and got["ragged_realign"] > 0
    assert got["compaction"] == (res.stats.compactions or 0)
    if strategy == "holes":
        assert got["compaction"] > 0


@pytest.mark.engine
def test_the_audit_prints_an_unexercised_defect_as_not_exercised(tmp_path, capsys):
    """On a random tiny model no row reaches the stop token: keep_after_stop is not
    exercised (never clean), mask_all_ones is (and caught); report.json says which."""
    from specdec import cli

    out = tmp_path / "audit"
    assert cli.main(["audit", "--model", "tiny:llama", "--limit", "6", "--max-new-tokens", "8",
                     "--engines", "eqspec", "mask_all_ones", "keep_after_stop",
                     "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    line = next(x for x in printed.splitlines() if x.startswith("keep_after_stop"))
    assert "not exercised (no stop_reached" in line
    engines = {e["name"]: e for e in json.loads((out / "report.json").read_text())["engines"]}
    assert engines["keep_after_stop"]["exercised"] is False
    assert engines["keep_after_stop"]["triggers"]["stop_reached"] == 0
    assert engines["mask_all_ones"]["exercised"] is True
    assert set(engines["eqspec"]["triggers"]) == set(TRIGGERS)
    assert engines["eqspec"]["exercised"] is None  # a correct engine has no defect to exercise
