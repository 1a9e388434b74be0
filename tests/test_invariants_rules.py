"""The rules as records, as a specification: every rule carries what the Monitor, the
guard and the trace renderer need, and every fused expression (a group's, or a fusion of
the groups that run together at one phase) flags exactly the rows that the OR of its
rules flags, on correct views and on views with adversarial values in every field."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from invariants import rules as R
from invariants import predicates as P
from toy_engine import toy_views

torch.set_num_threads(1)

PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10, 11, 12], [9], [5, 6, 7, 8, 9]]


def monitored_views(prompts=PROMPTS, k=3, budget=8, seed=0, accept_p=0.6, profile=None):
    """(view, prev snapshot, prompts) of a correct toy run, as a Monitor holds them."""
    prev = prompts_state = None
    out = []
    for ph, v in toy_views(prompts, k=k, budget=budget, seed=seed, accept_p=accept_p):
        if profile is not None:
            v = dataclasses.replace(v, profile=profile)
        out.append((v, prev, prompts_state))
        if ph == "prefill":
            prompts_state = P.Prompts.remember(prompts_state, v, 256)
        if ph in ("prefill", "commit"):
            prev = P.Snapshot.remember(prev, v, 256)
    return out


def definitional(groups, facts) -> torch.Tensor | None:
    """The OR of the device rules of ``groups`` that apply, rule by rule."""
    out = None
    for g in groups:
        if not R.group_applies(g, facts):
            continue
        for r, m in R.rule_masks(g, facts):
            if r.host is None:
                out = m if out is None else out | m
    return out


def assert_fused_exact(view, prev, prompts):
    facts = lambda: R.Facts(view, prev=prev, prompts=prompts)  # noqa: E731
    checked = 0
    for g in R.GROUPS:
        if g.fused is None or not R.group_applies(g, facts()):
            continue
        try:
            want = definitional([g], facts())
        except (RuntimeError, IndexError, ValueError):
            continue  # a malformed view: the Monitor reports the group as uncheckable
        got = g.fused(facts())
        if want is None:
            assert got is None or not got.any(), g.name
            continue
        assert got is not None and got.tolist() == want.tolist(), (g.name, got, want)
        checked += 1
    for fusion in R.FUSIONS:
        groups = [R.GROUPS_BY_NAME[n] for n in fusion.groups]
        if not all(R.group_applies(g, facts()) for g in groups):
            continue
        try:
            want = definitional(groups, facts())
        except (RuntimeError, IndexError, ValueError):
            continue
        try:
            got = fusion.fused(facts())
        except (RuntimeError, IndexError, ValueError):
            continue  # the groups then run one by one
        if got is None:
            continue
        assert got.tolist() == want.tolist(), (fusion.groups, view.phase, got, want)
        checked += 1
    return checked


# -- the records --------------------------------------------------------------------------

def test_every_rule_is_a_complete_record():
    ids = [r.id for r in R.RULES]
    assert len(ids) == len(set(ids))
    for r in R.RULES:
        assert r.invariant in ("I1", "I2", "I3", "I4", "I5", "I6", "I7"), r.id
        assert r.sentence and r.reads, r.id
        assert r.columns in (None,) + R.COLUMNS, r.id
        if r.invariant not in ("I5", "I7"):
            assert (r.mask is None) != (r.host is None) or r.id == "guard.cache_position", r.id


def test_groups_cover_every_cheap_rule_once_per_profile():
    for inv in ("I1", "I2", "I3", "I4", "I6"):
        assert R.INVARIANT_RULES[inv], inv
        in_groups = {r for g in R.GROUPS if g.invariant == inv for r in g.rules}
        assert in_groups == set(R.INVARIANT_RULES[inv])


def test_the_sentences_name_the_view_s_facts():
    _, v = next((ph, v) for ph, v in toy_views(PROMPTS, k=3, budget=8) if ph == "commit")
    text = R.RULES_BY_ID["I6.committed_range"].text(v)
    assert text == "1 <= committed <= k + 1 = 4 for a row active before the step"
    assert R.RULES_BY_ID["I1.cache_width"].text(v) == "every target cache layer has width " \
        f"{v.width + 3} (commit: W + k)"


def test_nothing_dispatches_on_sentence_text():
    """The Monitor, the guard and the trace grid choose slots and columns by record."""
    import inspect

    from invariants import guard, monitor

    for mod in (monitor, guard):
        src = inspect.getsource(mod)
        assert "startswith(" not in src and "P._rows" not in src and "P._extended" not in src


# -- fused expressions == the OR of their rules ------------------------------------------------

@pytest.mark.parametrize("profile", [None, "holes"])
def test_fused_expressions_are_exact_on_correct_runs(profile):
    checked = sum(assert_fused_exact(*x) for x in monitored_views(profile=profile))
    assert checked > 20


def _perturb(t: torch.Tensor, data, what: str) -> torch.Tensor:
    if t.numel() == 0:
        return t
    t = t.clone()
    flat = t.view(-1)
    for _ in range(data.draw(st.integers(1, 3), label=f"{what} edits")):
        i = data.draw(st.integers(0, flat.numel() - 1), label=f"{what} index")
        if t.dtype == torch.bool:
            flat[i] = not bool(flat[i])
        else:
            flat[i] = data.draw(st.integers(-3, 40), label=f"{what} value")
    return t


FIELDS = ("tokens", "valid", "positions", "lengths", "prompt_lengths", "budgets", "generated",
          "finished", "row_ids", "output", "drafts", "draft_limit", "predictions", "accepted",
          "committed", "generated_before")
VIEWS = monitored_views() + monitored_views(seed=3, accept_p=1.0, profile="holes") \
    + monitored_views(prompts=[[4], [5, 6]], k=1, budget=3, seed=1, accept_p=0.0) \
    + monitored_views(prompts=[[4, 5], [6], [7, 8, 9]], k=0, budget=4, seed=2) \
    + monitored_views(prompts=[[3, 4, 5], [6, 7, 8], [9, 10, 11]], k=2, budget=16, seed=4,
                      accept_p=1.0, profile="grouped") \
    + monitored_views(prompts=[[3, 4], [6, 7], [9, 10]], k=2, budget=6, seed=5,
                      profile="grouped") \
    + monitored_views(prompts=[[3, 4, 5], [6], [9, 10]], k=2, budget=6, seed=6,
                      profile="holes")


COMMITS = [x for x in VIEWS if x[0].phase == "commit"]


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fused_expressions_are_exact_on_adversarial_views(data):
    break_view(data, data.draw(st.sampled_from(VIEWS), label="view"))


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_the_commit_fusion_is_exact_on_adversarial_commits(data):
    break_view(data, data.draw(st.sampled_from(COMMITS), label="commit view"))


REALIGN_STATES = [x for x in VIEWS if x[0].phase == "realign" and x[1] is not None]


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_the_realign_state_fusion_is_exact_on_adversarial_realigns(data):
    """The I6 state + history fusion of a realign view (a pool's other group, EXSPEC)
    flags what the two groups flag, on views with a few edits each of the kinds that
    matter there: a stop token before a row's last output, or as its last; a count moved
    (generated, a budget, finished); a request id the previous snapshot does not know
    (a row the history rules cannot judge, where the state rules alone must flag); any
    output value."""
    from toy_engine import TOY_STOP

    view, prev, prompts = data.draw(st.sampled_from(REALIGN_STATES), label="realign view")
    edits = {n: getattr(view, n).clone() for n in ("output", "generated", "finished",
                                                    "budgets", "row_ids")}
    b, t = edits["output"].shape
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        row = data.draw(st.integers(0, b - 1), label="row")
        kind = data.draw(st.sampled_from(["stop", "last_stop", "count", "unknown", "output"]))
        g = int(edits["generated"][row])
        if kind in ("stop", "output"):
            at = data.draw(st.integers(0, t - 1), label="slot")
            edits["output"][row, at] = TOY_STOP if kind == "stop" else data.draw(
                st.integers(-1, 20), label="token")
        elif kind == "last_stop" and g > 0:
            edits["output"][row, min(g, t) - 1] = TOY_STOP
        elif kind == "count":
            name = data.draw(st.sampled_from(["generated", "budgets", "finished"]))
            edits[name][row] = data.draw(st.sampled_from([-1, 0, 1, 2, t - 1, t, t + 1]),
                                         label=name) \
                if name != "finished" else 1 - int(edits[name][row])
        elif kind == "unknown":
            edits["row_ids"][row] = 100 + row
    fusion = next(f for f in R.FUSIONS if f.groups == ("I6.state", "I6.history"))
    view = dataclasses.replace(view, **edits)
    facts = lambda: R.Facts(view, prev=prev, prompts=prompts)  # noqa: E731
    want = definitional([R.GROUPS_BY_NAME[n] for n in fusion.groups], facts())
    got = fusion.fused(facts())
    assert got is not None and got.tolist() == want.tolist(), (got, want)


def break_view(data, monitored):
    view, prev, prompts = monitored
    fields = data.draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3, unique=True))
    changes = {}
    for name in fields:
        t = getattr(view, name)
        if isinstance(t, torch.Tensor):
            changes[name] = _perturb(t, data, name)
    if view.forward is not None and data.draw(st.booleans(), label="break the forward"):
        fw = view.forward
        name = data.draw(st.sampled_from(["input_ids", "positions", "attention_mask"]))
        changes["forward"] = dataclasses.replace(fw, **{name: _perturb(getattr(fw, name), data, name)})
    assert_fused_exact(dataclasses.replace(view, **changes), prev, prompts)


# -- fast mode checks views of one kind together: equal to each checked alone ---------------

WAITING = [x for x in VIEWS if x[0].phase in ("verify", "commit", "realign")]


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_views_checked_together_flag_what_each_flags_alone(data):
    """A fusion's ``batch`` over the evidence of several views (adversarial values, views
    of different widths padded together) flags, row by row, what the fusion flags on each
    view alone; so does ``batch_refs`` over the same views kept by reference (``refer``
    accepts every view ``defer`` accepts, with the same key); a view whose evidence is
    taken is not changed by it."""
    checked_together(data, WAITING, 1)


#: per fusion that waits, the views it takes (several of one kind side by side)
POOLS = [pool for pool in (
    [x for x in WAITING if fusion.defer(R.Facts(x[0], prev=x[1], prompts=x[2]),
                                        P.Snapshot.of(x[0]).table) is not None]
    for fusion in R.FUSIONS if fusion.defer is not None) if len(pool) > 1]


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_views_of_one_kind_checked_side_by_side_flag_what_each_flags_alone(data):
    """As above, with every view drawn from those of one fusion (so that views of one
    row count are laid side by side, ``batch_refs``' own path, on every kind: forward,
    commit, state, contiguous, holes and grouped realigns)."""
    checked_together(data, data.draw(st.sampled_from(POOLS), label="kind"), 2)


def checked_together(data, pool, least):
    chosen = data.draw(st.lists(st.sampled_from(pool), min_size=least, max_size=5),
                       label="views")
    by_key, alone = {}, {}
    for j, (view, prev, prompts) in enumerate(chosen):
        fields = data.draw(st.lists(st.sampled_from(FIELDS), max_size=3, unique=True))
        changes = {n: _perturb(getattr(view, n), data, n) for n in fields
                   if isinstance(getattr(view, n), torch.Tensor)}
        view = dataclasses.replace(view, **changes)
        for fusion in R.FUSIONS:
            if fusion.defer is None:
                continue
            facts = R.Facts(view, prev=prev, prompts=prompts)
            wait = fusion.defer(facts, P.Snapshot.of(view).table)
            if wait is None:
                continue
            key, evidence = wait
            try:
                want = fusion.fused(R.Facts(view, prev=prev, prompts=prompts))
            except (RuntimeError, IndexError, ValueError):
                continue
            assert want is not None, (fusion.groups, view.phase)
            by_key.setdefault((fusion, key), []).append(((j, fusion), evidence))
            alone[j, fusion] = want.tolist()
            wait = fusion.refer(facts, P.Snapshot.of(view).table)
            assert wait is not None and wait[0] == key, (fusion.groups, view.phase)
            by_key.setdefault((fusion, key, "refs"), []).append(((j, fusion), wait[1]))
    for (fusion, key, *refs), members in by_key.items():
        if refs:  # by reference: the views' own tensors, batched at the read
            assert all(e.intact() for _, e in members)
            parts = fusion.batch_refs(key, [e for _, e in members], R.Constants(), None)
        else:
            flags = fusion.batch(key, [e for _, e in members], R.Constants(), None)
            parts = flags.split([e.size for _, e in members])
        for (at, _), got in zip(members, parts):
            assert got.tolist() == alone[at], (fusion.groups, key, at, bool(refs))
