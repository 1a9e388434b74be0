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
    assert all(f"<={FULL_BOUND}" in r.bound for r in results)
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


# -- mutants ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", mutants.NAMES)
def test_every_mutant_yields_a_counterexample(name):
    results = proofs.run(3, mutant=name, groups=["eqspec"])
    cexs = [r for r in results if r.status == "counterexample"]
    assert cexs, f"mutant {name} survived every obligation"
    assert all(r.status in ("proved", "counterexample") for r in results)
    assert any(cli.replayable(r.counterexample) for r in cexs)


@pytest.mark.parametrize("name", mutants.NAMES)
def test_mutant_counterexample_replays_on_the_engine(name):
    from proofs.replay import replay_counterexample

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
    out = specdec.generate(target, prompts, k=3, batch_size=3, max_new_tokens=8,
                           stop_token_ids=[], **kw).sequences
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
    files = [ROOT / "specdec" / "engine.py", ROOT / "specdec" / "acceptance.py"]
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
    P._CACHE.clear()
    try:
        ob = next(o for o in P.obligations() if "exactly one state" in o.name)
        r = check(ob, 3)
        assert r.status == "counterexample" and r.counterexample["move"] == "finish"
    finally:
        P._CACHE.clear()
