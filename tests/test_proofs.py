"""The z3 proofs of the index math (``proofs/``) and the mutant catalogue (``specdec.mutants``).

- every obligation proves on the real layout (bound 4 quickly; the full bound 16 once);
- every mutant yields a z3 counterexample, which replays on the engine as a divergence
  or an invariant violation, and which the real layout passes;
- the engine executes the layout functions (patching one changes what the engine does)
  and no second copy of their formulas lives in the engine or the strategies.
"""

from __future__ import annotations

import io
import re
import time
import tokenize
from pathlib import Path

import pytest
import torch

import proofs
from proofs import __main__ as cli
from proofs.core import check
from specdec import layout, mutants

ROOT = Path(__file__).resolve().parents[1]
FULL_BOUND = proofs.DEFAULT_MAX_BATCH


# -- the real layout proves ------------------------------------------------------------------

def test_every_obligation_proves_at_small_bound():
    results = proofs.run(4)
    assert len(results) >= 20
    bad = [(r.name, r.status, r.counterexample) for r in results if not r.ok]
    assert not bad, bad


def test_every_obligation_proves_at_full_bound_within_a_minute():
    proofs.clear_caches()  # time it as a fresh process would run
    cpu0, wall0 = time.process_time(), time.perf_counter()
    results = proofs.run(FULL_BOUND)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    bad = [(r.name, r.status, r.counterexample) for r in results if not r.ok]
    assert not bad, bad
    # every size up to the bound, or size-free (scalar obligations: "any B")
    assert all(f"<={FULL_BOUND}" in r.bound or r.bound.startswith("any ") for r in results)
    # z3 is single-threaded: CPU time is the cost, wall time also counts other users' load
    assert cpu < 60, f"proofs took {cpu:.1f}s CPU ({wall:.1f}s wall) for B <= {FULL_BOUND}"


def test_cli_prints_one_line_per_obligation_and_exit_status(capsys):
    assert cli.main(["--max-batch", "2", "--only", "eqspec/I2"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith("eqspec/I2")]
    assert len(rows) == 1 and "proved" in rows[0] and "B<=2" in rows[0]
    assert re.search(r"\d+\.\d\d$", rows[0])  # seconds
    assert cli.main(["--max-batch", "2", "--only", "eqspec/I2", "--mutant",
                     "padding_off_by_one"]) == 1
    assert "counterexample" in capsys.readouterr().out


def test_obligations_are_not_vacuous():
    # a deliberately false property gets a counterexample in the very same situation
    from proofs import eqspec
    from proofs.core import Obligation

    ob = Obligation("false", "W' < n_new somewhere", eqspec.per_row(
        ("j",), lambda bt, b: bt.Wn >= bt.n_new(b)))
    r = check(ob, 2)
    assert r.status == "counterexample" and r.counterexample["rows"]


# -- sizing ----------------------------------------------------------------------------------
# Each sizing function made smaller by one slot more than its slack must fail the
# obligations that rely on it: the proofs see the very function the engine sizes with.

SIZING = {  # layout function: (slots taken away, obligations that must then fail)
    "output_width": (2, ["sizing/output width"]),
    "contiguous_capacity": (3, ["sizing/eqspec capacity", "sizing/reference capacity",
                                "sizing/holes capacity after compaction"]),
    "holes_capacity": (3, ["sizing/holes capacity after compaction",
                           "sizing/holes capacity, never compacting",
                           "sizing/holes threshold triggers first",
                           "sizing/holes never compacting fits"]),
    "pool_capacity": (2, ["sizing/exspec pool writes"]),
    "pool_compute_capacity": (2, ["sizing/exspec compute capacity"]),
}


@pytest.mark.parametrize("fn", SIZING)
def test_a_buffer_too_small_gives_a_sizing_counterexample(monkeypatch, fn):
    from proofs import sizing

    fewer, expected = SIZING[fn]
    orig = getattr(layout, fn)
    monkeypatch.setattr(layout, fn, lambda *a: orig(*a) - fewer)
    results = {ob.name: check(ob, 1) for ob in sizing.obligations()}
    assert all(results[name].status == "counterexample" for name in expected), \
        {n: r.status for n, r in results.items()}
    assert {n for n, r in results.items() if not r.ok} >= set(expected)


@pytest.mark.parametrize("strategy, fn, error", [
    ("eqspec", "contiguous_capacity", "cache capacity exceeded"),
    ("holes", "holes_capacity", "cache capacity exceeded"),
    ("exspec", "pool_compute_capacity", "cache capacity exceeded"),
    ("exspec", "pool_capacity", "out of bounds"),  # the pool's token store
    ("reference", "contiguous_capacity", "cache capacity exceeded")])
def test_the_engine_sizes_its_buffers_with_the_proved_functions(monkeypatch, strategy, fn, error):
    import specdec
    from specdec import models

    target = models.tiny("llama")
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    monkeypatch.setattr(layout, fn, lambda *a: 1)  # one slot: the first write overflows
    with pytest.raises((ValueError, IndexError), match=error):
        if strategy == "reference":
            specdec.reference_generate(target, prompts, max_new_tokens=4)
        else:
            specdec.generate(target, prompts, strategy=strategy, max_new_tokens=4)


# -- mutants ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", mutants.NAMES)
def test_every_mutant_yields_a_counterexample(name):
    group = mutants.CATALOGUE[name].proof_group
    results = proofs.run(3, mutant=name, groups=[group])
    cexs = [r for r in results if r.status == "counterexample"]
    assert cexs, f"mutant {name} survived every obligation"
    assert all(r.status in ("proved", "counterexample") for r in results)
    if group == "eqspec":  # forensics.counterexample rebuilds EQSPEC steps only
        assert any(cli.replayable(r.counterexample) for r in cexs)
    else:
        assert not any(cli.replayable(r.counterexample) for r in cexs)


@pytest.mark.parametrize("name", mutants.proved_in("eqspec"))
def test_mutant_counterexample_replays_on_the_engine(name):
    from specdec.forensics.counterexample import replay_counterexample

    torch.set_num_threads(1)
    results = proofs.run(3, mutant=name, groups=["eqspec"])
    first = next(r for r in results if cli.replayable(r.counterexample))
    trace = cli.trace_of(first, name, 3)
    caught = replay_counterexample(trace, extra_tokens=4)
    assert caught.mutant == name
    assert caught.caught, str(caught)
    clean = replay_counterexample(trace, mutant=None, extra_tokens=4)
    assert not clean.caught, str(clean)


def test_mutants_restore_the_layout():
    before = dict(vars(layout))
    for name in mutants.NAMES:
        target = mutants.CATALOGUE[name].target
        with mutants.apply(name):
            assert getattr(layout, target) is not before[target]
        assert getattr(layout, target) is before[target]
    with pytest.raises(RuntimeError):
        with mutants.apply("source_off_by_one"):
            raise RuntimeError("boom")
    assert vars(layout) == before
    with pytest.raises(ValueError, match="unknown mutant"):
        with mutants.apply("no_such_mutant"):
            pass


def test_save_trace_writes_replayable_json(tmp_path):
    import json

    path = tmp_path / "cex.json"
    rc = cli.main(["--max-batch", "3", "--only", "eqspec/", "--mutant", "crop_to_batch_min",
                   "--save-trace", str(path)])
    assert rc == 1
    doc = json.loads(path.read_text())
    assert doc["kind"] == cli.TRACE_KIND and doc["mutant"] == "crop_to_batch_min"
    cex = doc["counterexample"]
    assert doc["replayable"] and cex["strategy"] == "eqspec"
    assert {"n", "m"} <= set(cex["rows"][0]) and "old_width" in cex and "k" in cex


# -- the engine runs these very functions ----------------------------------------------------

def _tiny_run(**kw):
    import specdec
    from specdec import models

    torch.set_num_threads(1)
    target = models.tiny("llama")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, models.TINY_VOCAB, (n,), generator=g).tolist() for n in (3, 9, 5)]
    ref = specdec.reference_generate(target, prompts, max_new_tokens=8, stop_token_ids=[])
    # every row drafts k (policy "fixed"): the realignment runs at every step, whatever
    # the adaptive policy would decide on random prompts
    out = specdec.generate(target, prompts, k=3, batch_size=3, max_new_tokens=8,
                           stop_token_ids=[], **{"policy": "fixed", **kw}).sequences
    return out, ref


def test_engine_output_changes_under_a_layout_mutant():
    out, ref = _tiny_run()
    assert out == ref
    with mutants.apply("source_off_by_one"):
        bad, _ = _tiny_run()
    assert bad != ref


CALLED = ("realign_plan", "new_width", "cache_width", "verify_position", "draft_limit",
          "accepted_from_matches", "committed_from_accepted", "row_finished", "new_padding",
          "source_slot", "slot_valid", "slot_position", "source_shift", "cache_source_shift")


def test_engine_calls_the_layout_functions(monkeypatch):
    calls = {name: 0 for name in CALLED}
    for name in CALLED:
        orig = getattr(layout, name)

        def spy(*a, __orig=orig, __name=name, **kw):
            calls[__name] += 1
            return __orig(*a, **kw)

        monkeypatch.setattr(layout, name, spy)
    out, ref = _tiny_run()
    assert out == ref
    missing = [n for n, c in calls.items() if c == 0]
    assert not missing, f"the engine never called layout.{missing}"


# -- a single source: no copy of the formulas outside specdec/layout.py ---------------------

# (regex on code with comments and strings removed, what it restates)
FORMULAS = [
    (r"\bnew_width\s*-\s*\w", "new_padding: W' - n_new"),
    (r"width\s*-\s*new_width\b", "source_shift: W - W' + m"),
    (r"\bj\s*\+\s*shift\b", "source_slot: j + shift"),
    (r">=\s*pad\b", "slot_valid: j >= pad"),
    (r"\bj\s*-\s*pad\b", "slot_position: j - pad"),
    (r"\b(lengths|n)\s*\+\s*(committed|m)\b", "new_length: n + m"),
    (r"\bw(idth)?\s*-\s*1\b", "cache_width: W - 1"),
    (r"\bremaining\s*-\s*1\b", "draft_limit: remaining - 1"),
    (r"\blengths\s*\[[^\]]*\]\s*-\s*1\s*\+", "verify_position: n - 1 + i"),
    (r"\bcumprod\b", "accepted_from_matches"),
    (r"\baccepted\s*\+\s*1\b", "committed_from_accepted: accepted + 1"),
    (r"\bgenerated\s*>=\s*[\w.]*budgets\b", "row_finished: generated >= budgets"),
    (r"<\s*(committed|m)\s*-\s*1\b", "holes_slot_valid: i < m - 1"),
    (r"\bpad\w*\s*\+\s*pos\w*", "compact_dest_slot: pad' + position"),
    (r"\+\s*k\s*<=\s*[\w.]*capacity\b", "verify_fits: W + k <= capacity"),
    (r"\w\s*-\s*[\w.]*max_n\b", "slack: W - max n"),
    (r"\b\w*budget\w*\)?\s*\+\s*[\w.]*k\s*\+\s*1\b",
     "output_width / contiguous_capacity: ... + max_budget + k + 1"),
    (r"\blongest\s*\+\s*[\w.]*k\b", "pool_capacity / pool_compute_capacity: longest + k"),
    (r"/\s*\(\s*1\s*-", "widest_before_compaction: longest / (1 - threshold)"),
    (r"\bmax_budget\s*\*\s*\(", "holes_capacity: width + max_budget (k + 1)"),
]


def _code_only(path: Path) -> str:
    """The source without comments and string literals (docstrings explain formulas)."""
    out, prev = [], None
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            continue
        if tok.type in (tokenize.NEWLINE, tokenize.NL):
            out.append("\n")
        elif tok.string:
            if prev in (tokenize.NAME, tokenize.NUMBER) and tok.type in (tokenize.NAME, tokenize.NUMBER):
                out.append(" ")
            out.append(tok.string)
        prev = tok.type
    return "".join(out)


def test_no_second_copy_of_the_index_formulas():
    files = [ROOT / "specdec" / name for name in ("engine.py", "phases.py", "acceptance.py",
                                                  "reference.py")]
    files += sorted((ROOT / "specdec" / "strategies").glob("*.py"))
    found = []
    for path in files:
        code = _code_only(path)
        for pattern, what in FORMULAS:
            for m in re.finditer(pattern, code):
                found.append(f"{path.relative_to(ROOT)}: {m.group(0)!r} restates {what}")
    assert not found, ("index math belongs in specdec/layout.py (the single source the "
                       "proofs check); call it instead:\n" + "\n".join(found))


def test_formula_patterns_match_the_layout_itself():
    # the patterns are not vacuous: they find the formulas where they are defined
    code = _code_only(ROOT / "specdec" / "layout.py")
    hits = [what for pattern, what in FORMULAS if re.search(pattern, code)]
    assert len(hits) >= 6, hits


# -- the pool model ---------------------------------------------------------------------------

def test_pool_model_runs_concretely_and_keeps_its_invariant():
    # the same step/invariant code on Python values (how a real pool will be tied to it)
    import random

    from proofs import pool as P

    rng = random.Random(0)
    for N in (1, 3, 6):
        cap = rng.randint(1, N)
        st, order = P.State.initial(N), []
        for _ in range(300):
            before = st.next_out
            st = P.step(P.PY, st, rng.randrange(4), rng.randrange(N), cap)
            if st.next_out > before:
                order.append(before)
            assert all(ok for _, ok in P.invariant(P.PY, st, cap))
        assert order == list(range(len(order)))


def test_pool_obligations_catch_a_broken_pool(monkeypatch):
    from proofs import pool as P

    orig = P.step

    def finish_keeps_active(ops, st, move, r, cap):  # a finished request stays active too
        nxt = orig(ops, st, move, r, cap)
        nxt.active = [ops.or_(a, ops.and_(move == P.FINISH, r == i, st.active[i]))
                      for i, a in enumerate(nxt.active)]
        return nxt

    monkeypatch.setattr(P, "step", finish_keeps_active)
    proofs.clear_caches()
    try:
        ob = next(o for o in P.obligations() if "exactly one state" in o.name)
        r = check(ob, 3)
        assert r.status == "counterexample" and r.counterexample["move"] == "finish"
    finally:
        proofs.clear_caches()


# -- HOLES and EXSPEC ------------------------------------------------------------------------

def _first_cex(name: str, situations: tuple) -> dict:
    """The first counterexample of mutant ``name`` from a bit-level holes model."""
    results = proofs.run(2, mutant=name, groups=["holes"])
    for r in results:
        cex = r.counterexample or {}
        if r.status == "counterexample" and cex.get("situation") in situations:
            return cex
    raise AssertionError(f"no {situations} counterexample for {name}: "
                         f"{[(r.name, r.status) for r in results]}")


def _holes_step_torch(cex: dict):
    """The holes step of a bit-level counterexample, computed as strategies/holes.after_step
    computes it (torch, the current layout): (valid, positions, n + m) of the extended rows."""
    from invariants.predicates import valid_before

    k = cex["k"]
    valid = torch.tensor([[c == "1" for c in r["valid_before"]] for r in cex["rows"]])
    positions = torch.where(valid, valid_before(valid), 0)  # the precondition (I3)
    n = torch.tensor([r["n"] for r in cex["rows"]])
    m = torch.tensor([r["m"] for r in cex["rows"]])
    i = torch.arange(k + 1)[None, :]
    ext_valid = layout.holes_slot_valid(i, k, m[:, None])
    ext_pos = layout.holes_slot_position(layout.TORCH, i, k, n[:, None], m[:, None])
    return torch.cat([valid, ext_valid], 1), torch.cat([positions, ext_pos], 1), n + m


@pytest.mark.parametrize("name", ["holes_keeps_first_rejected", "holes_pending_position_plus_one"])
def test_holes_step_counterexample_is_flagged_by_the_checker(name):
    # the z3 witness, run through the strategy's own torch formulas, breaks I3 or the
    # valid count as the invariant checker sees it; on the real layout it does not
    from invariants.predicates import position_slots

    cex = _first_cex(name, ("step (bit per slot)",))
    with mutants.apply(name):
        valid, pos, n_new = _holes_step_torch(cex)
    assert position_slots(valid, pos).any() or (valid.sum(1) != n_new).any(), cex
    valid, pos, n_new = _holes_step_torch(cex)
    assert not position_slots(valid, pos).any() and (valid.sum(1) == n_new).all()


def test_compaction_counterexample_corrupts_compact_tokens():
    # the z3 witness of compact_dest_off_by_one, run through batch.compact_tokens (the
    # scatter the strategy and the n-gram drafter use), loses or moves real tokens
    from specdec.batch import compact_tokens

    cex = _first_cex("compact_dest_off_by_one", ("compaction",))
    valid = torch.tensor([[c == "1" for c in r["valid"]] for r in cex["rows"]])
    pos = torch.tensor([r["positions"] for r in cex["rows"]])
    lengths = valid.sum(1)
    wc = cex["W_c"]
    tokens = 100 + torch.arange(valid.shape[1]).expand_as(valid)  # token = 100 + slot
    want = [[0] * (wc - int(n)) + [100 + s for s in range(valid.shape[1]) if valid[b, s]]
            for b, n in enumerate(lengths)]

    def compacted():
        got, new_valid = compact_tokens(tokens, valid, pos, lengths, wc)
        return torch.where(new_valid, got, 0).tolist()

    with mutants.apply("compact_dest_off_by_one"):
        assert compacted() != want, cex
    assert compacted() == want


def test_row_mixing_compaction_is_caught_beyond_batch_1(monkeypatch):
    # B > 1 is settled by a syntactic row-independence check only when it holds: a
    # compaction that uses the batch-minimum padding for every row proves at B = 1 and
    # must fail at B = 2
    from proofs import holes

    orig = layout.compact_dest_slot

    def batch_min_pad(ops, valid, pos, pad_new, trash):
        return orig(ops, valid, pos, ops.amin(pad_new, dim=0, keepdim=True), trash)

    monkeypatch.setattr(layout, "compact_dest_slot", batch_min_pad)
    ob = next(o for o in holes.obligations() if o.name.endswith("compaction dest in [pad', W_c-1]"))
    assert check(ob, 1).ok
    r = check(ob, 3)
    assert r.status == "counterexample" and r.size == 2, r


def test_cli_prints_a_holes_counterexample_as_rows(capsys):
    assert cli.main(["--max-batch", "2", "--only", "holes/I3 literal", "--mutant",
                     "holes_keeps_first_rejected"]) == 1
    out = capsys.readouterr().out
    assert "counterexample at B=1" in out and "valid_after=" in out and "<- violates" in out


def test_holes_and_exspec_bounds_are_stated():
    from proofs import registry

    obs = {o.name: o for o in registry.obligations(["holes", "exspec"])}
    assert len([n for n in obs if n.startswith("holes/")]) >= 15
    assert len([n for n in obs if n.startswith("exspec/")]) >= 10
    assert "W<=8, k<=4" in obs["holes/I3 literal: position = valid slots before"].scope


def test_exspec_pool_follows_the_pool_model():
    """Tie proofs/pool.py's abstract pool to the real EXSPEC pool: on every view of a run
    (window smaller than the workload, mixed lengths, a stop token) the abstracted pool
    state satisfies the model's invariant, and each change since the previous view is the
    model's own moves (finish the requests that finished, admit the oldest waiting ones);
    the outputs then come back by ``emit`` moves in submission order. Views of grouped
    steps satisfy ``layout.grouped`` and carry no padding."""
    import specdec
    from conftest import tiny_pair
    from proofs import pool as P
    from specdec import drafters, models
    from harness import random_prompts

    torch.set_num_threads(1)
    target, _ = tiny_pair("llama")
    prompts = random_prompts((4, 9, 4, 6, 4, 4, 12), models.TINY_VOCAB, seed=5)
    free = specdec.reference_generate(target, prompts, max_new_tokens=6, stop_token_ids=[])
    stops = [free[1][1]]
    N, window = len(prompts), 3

    st = P.State.initial(N)
    for _ in range(N):  # every request is submitted before the first step
        st = P.step(P.PY, st, P.SUBMIT, 0, window)
    seen = {"views": 0, "grouped": 0, "admits": 0, "finishes": 0}

    def abstract(pool):
        w, a, f = set(pool["waiting"]), set(pool["active"]), set(pool["finished"])
        return P.State.from_flags(N, [r in w for r in range(N)], [r in a for r in range(N)],
                                  [r in f for r in range(N)], [False] * N, 0)

    def hook(phase, view):
        nonlocal st
        new = abstract(view.info["pool"])
        expect = st
        for r in range(N):  # finish moves, then admissions of the oldest waiting requests
            if new.finished[r] and not expect.finished[r]:
                expect = P.step(P.PY, expect, P.FINISH, r, window)
                seen["finishes"] += 1
        for r in range(N):
            if new.active[r] and not expect.active[r]:
                expect = P.step(P.PY, expect, P.ADMIT, r, window)
                seen["admits"] += 1
        assert vars(expect) == vars(new), (phase, view.step, view.info["pool"])
        assert all(ok for _, ok in P.invariant(P.PY, new, window)), view.info["pool"]
        st = new
        seen["views"] += 1
        if view.profile == "grouped":
            seen["grouped"] += 1
            assert bool(layout.grouped(layout.TORCH, view.lengths)) and bool(view.valid.all())

    res = specdec.generate(target, prompts, strategy="exspec", drafter=drafters.NGramDrafter(),
                           k=2, batch_size=2, window=window, max_new_tokens=6,
                           stop_token_ids=stops, hooks=[hook])
    ref = specdec.reference_generate(target, prompts, max_new_tokens=6, stop_token_ids=stops)
    assert res.sequences == ref
    assert seen["admits"] == N and seen["grouped"] > 0
    # the rows still active at the last view finish after it; then every output is emitted
    for r in range(N):
        if st.active[r]:
            st = P.step(P.PY, st, P.FINISH, r, window)
    for r in range(N):
        st = P.step(P.PY, st, P.EMIT, 0, window)
        assert st.returned[r] and st.next_out == r + 1
        assert all(ok for _, ok in P.invariant(P.PY, st, window))


HOLES_CALLED = ("holes_width", "holes_slot_valid", "holes_slot_position", "compact_dest_slot",
                "compaction_due", "verify_fits", "new_padding", "slot_valid", "slot_position")
EXSPEC_CALLED = ("compact_dest_slot", "slot_position", "slot_valid", "new_padding",
                 "verify_position", "cache_width", "new_length")


@pytest.mark.parametrize("strategy,called", [("holes", HOLES_CALLED), ("exspec", EXSPEC_CALLED)])
def test_holes_and_exspec_engines_call_the_layout_functions(monkeypatch, strategy, called):
    calls = {name: 0 for name in called}
    for name in called:
        orig = getattr(layout, name)

        def spy(*a, __orig=orig, __name=name, **kw):
            calls[__name] += 1
            return __orig(*a, **kw)

        monkeypatch.setattr(layout, name, spy)
    kw = {"hole_threshold": 0.2} if strategy == "holes" else {"window": 3}
    out, ref = _tiny_run(strategy=strategy, **kw)
    assert out == ref
    missing = [n for n, c in calls.items() if c == 0]
    assert not missing, f"strategy {strategy} never called layout.{missing}"


def test_compaction_trigger_obligations_catch_a_broken_trigger(monkeypatch):
    from proofs import holes

    obs = {o.name.split("/", 1)[1]: o for o in holes.obligations()}
    fits = layout.verify_fits
    monkeypatch.setattr(layout, "verify_fits", lambda w, k, cap: fits(w, k, cap + 1))  # 1 slot over
    for name in ("verify_fits = extended cache fits", "room for the next verify"):
        r = check(obs[name], 1)
        assert r.status == "counterexample", (name, r)
    monkeypatch.setattr(layout, "verify_fits", fits)
    slack = layout.slack
    monkeypatch.setattr(layout, "compaction_due", lambda w, mx, h: slack(w, mx) >= h * w)
    r = check(obs["no compaction due right after one"], 1)
    assert r.status == "counterexample" and r.counterexample["situation"] == "compaction trigger"
