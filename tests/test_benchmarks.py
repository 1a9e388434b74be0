"""The side-by-side benchmark's contract, on a tiny model: every configuration runs, is
exact, and the realign summary names the fastest strategy next to EQSPEC's own share."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_benchmark(name: str):
    """The module ``benchmarks/NAME.py`` (the benchmarks are scripts, not a package),
    registered under NAME (a module's dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def throughput():
    return load_benchmark("throughput")


def test_benchmark_writes_exact_rows_and_the_realign_summary(throughput, tmp_path, capsys):
    argv = ["--model", "tiny:llama", "--prompts", "5", "--max-new-tokens", "6",
            "--batch-sizes", "1", "3", "--strategies", "eqspec", "holes", "exspec",
            "--drafters", "scripted:0.6", "--out", str(tmp_path)]
    assert throughput.main(argv) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    rows = data["rows"]
    got = {(r["strategy"], r["batch_size"]) for r in rows}
    assert got == {(s, b) for s in ("standard", "hf-generate", "eqspec", "holes", "exspec")
                   for b in (1, 3)}
    assert all(r["exact_match"] == 1.0 and r["near_ties"] == r["desyncs"] == 0 for r in rows)
    assert data["meta"]["dtype"] == "float32" and "calibrated" in data["meta"]["oracle"]
    for r in rows:
        if r["strategy"] not in ("standard", "hf-generate"):
            assert sum(r["phase_shares"].values()) == pytest.approx(1.0)
    summary = data["realign_summary"]
    assert [s["batch_size"] for s in summary] == [1, 3]
    for s in summary:
        cell = {r["strategy"]: r for r in rows if r["batch_size"] == s["batch_size"]}
        assert s["mean_tokens_per_s"] == {k: pytest.approx(cell[k]["tokens_per_s"])
                                          for k in ("eqspec", "holes", "exspec")}  # one drafter
        assert s["best"] == max(("eqspec", "holes", "exspec"), key=lambda k: cell[k]["tokens_per_s"])
        assert s["best_realign"] == {"scripted:0.6": cell[s["best"]]["phase_shares"]["realign"]}
        assert s["eqspec_realign"] == {"scripted:0.6": cell["eqspec"]["phase_shares"]["realign"]}
        assert s["fastest_per_drafter"] == {"scripted:0.6": s["best"]}
    assert (tmp_path / "throughput.png").stat().st_size > 0
    assert (tmp_path / "phases.png").stat().st_size > 0
    assert "best strategy per batch size" in capsys.readouterr().out
    # the summary can be recomputed from the saved file alone
    assert throughput.main(["--from-json", str(tmp_path / "results.json")]) == 0
    assert f"batch   3: {summary[1]['best']}" in capsys.readouterr().out


def test_benchmark_runs_static_shape_twins_exactly(throughput, tmp_path):
    """--static-shapes: every standard and speculative configuration also runs with static
    shapes (named +static), exact; plain decoding's ratio stays against the eager loop."""
    argv = ["--model", "tiny:llama", "--prompts", "4", "--max-new-tokens", "6",
            "--batch-sizes", "3", "--strategies", "eqspec", "--drafters", "scripted:0.6",
            "--policies", "fixed", "--static-shapes", "--out", str(tmp_path)]
    assert throughput.main(argv) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    rows = data["rows"]
    assert {r["engine"] for r in rows} == {"standard", "standard+static", "hf-generate",
                                           "eqspec", "eqspec+static"}
    assert all(r["exact_match"] == 1.0 for r in rows)
    assert data["meta"]["static_shapes"] is True


def test_benchmark_reads_specbench_jsonl_and_reports_per_kind(throughput, tmp_path, capsys):
    """``--prompts FILE.jsonl`` (SpecBench's form: the category is the kind), ``--kinds``
    picks kinds, and every kind gets tokens/s, the ratio to standard decoding of the same
    kind, acceptance and mean k_b per policy (fixed: every row drafts k while its budget
    allows)."""
    argv = ["--model", "tiny:llama", "--prompts", str(ROOT / "benchmarks" / "specbench_sample.jsonl"),
            "--kinds", "translation", "rag", "--max-new-tokens", "6", "--batch-sizes", "8",
            "--drafters", "scripted:0.9", "--policies", "adaptive", "fixed", "--k", "3",
            "--out", str(tmp_path)]
    assert throughput.main(argv) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["meta"]["kinds"] == {"translation": 8, "rag": 8}
    by_kind = {(r["kind"], r["engine"]): r for r in data["by_kind"]}
    assert {k for k, _ in by_kind} == {"translation", "rag"}
    for (kind, name), r in by_kind.items():
        assert r["exact_match"] == 1.0 and r["tokens_per_s"] > 0 and r["vs_standard"] > 0
        if name == "standard":
            assert r["vs_standard"] == 1.0 and r["acceptance"] is None
        elif name == "hf-generate":  # Hugging Face's own loop, in every run
            assert r["acceptance"] is None and r["vs_hf_generate"] == 1.0
        else:
            assert 0 <= r["acceptance"] <= 1 and 0 <= r["mean_draft_length"] <= 3
    assert {name for _, name in by_kind} == {"standard", "hf-generate", "eqspec/adaptive",
                                             "eqspec/fixed"}
    # fixed: k drafts per row-step except where the budget (6 tokens) cuts the last ones
    assert all(r["mean_draft_length"] > 2 for (_, n), r in by_kind.items() if n == "eqspec/fixed")
    out = capsys.readouterr().out
    assert "per prompt kind" in out and "translation" in out and "mean kb" in out
    with pytest.raises(SystemExit, match="not there: \\['poetry'\\]"):
        throughput.main([*argv[:4], "--kinds", "poetry"])


def test_validation_overhead_runs_every_configuration_exactly(tmp_path, capsys):
    bench = load_benchmark("validation_overhead")
    from specdec import batch as batch_mod
    from specdec import phases, validation

    shipped = (phases.sync, validation.checked_drafts, validation.HookWatch, batch_mod.StepView)
    out = tmp_path / "v.json"
    argv = ["--prompts", "3", "--max-new-tokens", "4", "--repeats", "1",
            "--component-loops", "20", "--json", str(out)]
    assert bench.main(argv) == 0  # 0: every configuration decoded the same ids
    data = json.loads(out.read_text())
    assert {r["config"] for r in data["rows"]} == set(bench.CONFIGS)
    assert all(r["identical"] for r in data["rows"])
    # the checks are the difference between the pairs: 3 more ops per step, no fewer
    steps_ops = data["ops_per_run"]
    assert steps_ops["none/validated"] > steps_ops["none/unvalidated"]
    assert (phases.sync, validation.checked_drafts, validation.HookWatch, batch_mod.StepView) == shipped
    assert "HookWatch" in capsys.readouterr().out


def test_monitor_overhead_reports_both_settings_and_the_transfers(tmp_path, capsys):
    mod = load_benchmark("monitor_overhead")
    out = tmp_path / "mo.json"
    argv = ["--settings", "cheap,real", "--model", "tiny:qwen3", "--prompts", "3",
            "--strategies", "eqspec,exspec", "--max-new-tokens", "4", "--repeats", "1",
            "--replay", "2", "--json", str(out)]
    assert mod.main(argv) == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    # --replay: the Monitor alone, per mode, a time for every phase the run had and check()
    # (EXSPEC's pool is rewritten in place as the run goes on: the replayed views show the
    # cache slots as they were at their hooks, or KV provenance would raise here)
    replays = data["replays"]
    assert [(r["strategy"], r["mode"]) for r in replays] == [
        (s, m) for s in ("eqspec", "exspec") for m in ("fast", "strict")]
    for r in replays:
        us = r["us_per_step"]
        assert {"prefill", "draft", "verify", "commit", "check", "total"} <= us.keys()
        # (each its own minimum: the best replay's total holds every part at least once)
        assert us["total"] >= sum(x for k, x in us.items() if k != "total") * (1 - 1e-9)
        assert us["verify"] > 0 and 0 < r["share_of_engine"] < 10
    got = {(r["setting"], r["config"]) for r in rows if r["strategy"] == "eqspec"}
    assert got == {(s, c) for s in ("cheap", "real")
                   for c in ("none", "null-hook", "fast", "strict", "strict-phase")}
    assert all(r["identical"] for r in rows)
    checked = {(r["setting"], r["config"]): r for r in rows if "reads_per_step" in r}
    for (setting, config), r in checked.items():
        assert r["uploads"] == 0 and r["dynamic_shapes"] == 0 and r["ops_per_step"] > 0
        assert r["most_reads_in_a_step"] == {"fast": 0, "strict": 1}.get(config, r["most_reads_in_a_step"])
    assert "no upload, no data-dependent shape, fast reads nothing" in capsys.readouterr().out


def test_monitor_overhead_breakdown_splits_check_by_part_and_restores_the_rules(tmp_path, capsys):
    """--breakdown: check() split into each fusion's batched check and KV provenance's
    detect (fast mode: every part timed, none larger than the total), provenance's whole
    cost, and the timers gone afterwards (the shipped fusions and detect are back)."""
    mod = load_benchmark("monitor_overhead")
    from invariants import provenance as PV
    from invariants import rules as R

    shipped = ([(f.batch, f.batch_refs) for f in R.FUSIONS], PV.detect)
    out = tmp_path / "bd.json"
    assert mod.main(["--settings", "cheap", "--strategies", "eqspec", "--max-new-tokens", "8",
                     "--repeats", "1", "--replay", "1", "--breakdown", "--no-count",
                     "--policy", "fixed", "--json", str(out)]) == 0
    assert ([(f.batch, f.batch_refs) for f in R.FUSIONS], PV.detect) == shipped
    fast, strict = json.loads(out.read_text())["replays"]
    assert (fast["mode"], strict["mode"]) == ("fast", "strict")
    parts = fast["check_parts_us"]
    assert "I5.provenance (detect)" in parts and len(parts) >= 3
    assert all(0 < x < fast["breakdown_total_us"] for x in parts.values())
    assert not strict["check_parts_us"]  # strict checks in its hooks: check() waits for nothing
    assert 0 < fast["breakdown_share"] < 10 and "provenance_us" in strict
    assert "check() by part" in capsys.readouterr().out


def test_monitor_overhead_times_hooks_as_a_user_would_pass_them(monkeypatch):
    """The timed hooks keep the Monitor's read_only promise (the null hook makes it too):
    the engine watches them for writes in a run's first steps only, as it watches
    hooks=[Monitor(...)], so no configuration pays a watch the user's would not."""
    mod = load_benchmark("monitor_overhead")
    from specdec import models, validation

    watched = []
    real = validation.HookWatch.__init__

    def counting(self, view, stores=()):
        watched.append(view.step)
        real(self, view, stores)

    monkeypatch.setattr(validation.HookWatch, "__init__", counting)
    args = argparse.Namespace(k=4, batch_size=4, max_new_tokens=12, policy="fixed")
    target, ids = models.tiny("llama"), mod.random_ids(4, 2, 8, models.TINY_VOCAB)
    for config in ("null-hook", "fast", "strict"):
        watched.clear()
        steps = mod.run_once(config, target, ids, "eqspec", "cpu", args)[4].steps
        assert steps > 2 * validation.WATCH_STEPS
        assert watched and max(watched) < validation.WATCH_STEPS, config


def test_prefill_split_compares_the_split_with_one_forward_side_by_side(tmp_path, capsys):
    mod = load_benchmark("prefill_split")
    out = tmp_path / "ps.json"
    assert mod.main(["--model", "tiny:llama", "--kinds", "rag", "qa", "--repeats", "2",
                     "--max-new-tokens", "3", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["kind"] for r in data["rows"]] == ["rag", "qa"]
    for r in data["rows"]:
        assert 0 < r["padding"] < 1 and r["forwards"] >= 1
        for m in (r["prefill"], r["end_to_end"]):
            assert m["same"] and m["ratio_min"] <= m["ratio"] <= m["ratio_max"]
    # the shipped split is restored after every run
    from specdec import cache as cache_mod
    assert cache_mod.SPLIT_FORWARD_TOKENS == data["split"]
    assert "geometric mean over kinds" in capsys.readouterr().out


# -- honest stats: no figure from counters that do not add up --------------------------------

ARGV = ["--model", "tiny:llama", "--prompts", "4", "--max-new-tokens", "8", "--batch-sizes", "4",
        "--strategies", "eqspec", "exspec", "--policies", "fixed", "--drafters", "ngram"]


def frequent_stop(throughput, monkeypatch):
    """Make the tiny model's stop token the token its greedy outputs hold most (so rows
    stop early and a stop cuts a commit): the generation config says the stop, as for a
    real model; the benchmark's prompts are decoded once to find it."""
    from collections import Counter

    from specdec import models

    model = models.tiny("llama")
    resolve = models.resolve
    monkeypatch.setattr(throughput.models, "resolve",
                        lambda name, dtype=None: (model, None) if name == "tiny:llama"
                        else resolve(name, dtype=dtype))
    seen = []
    orig = throughput.run_config

    def spy(c, target, ids, *a, **kw):
        out = orig(c, target, ids, *a, **kw)
        seen.extend(out[0])
        return out
    monkeypatch.setattr(throughput, "run_config", spy)
    assert throughput.main([*ARGV[:8], "--strategies", "eqspec", "--drafters", "ngram"]) == 0
    monkeypatch.setattr(throughput, "run_config", orig)
    stop = Counter(t for s in seen for t in s[1:]).most_common(1)[0][0]
    model.generation_config.eos_token_id = stop
    return stop


@pytest.mark.engine
def test_benchmark_refuses_stats_that_do_not_add_up_to_the_views(throughput, tmp_path, capsys,
                                                                 monkeypatch):
    """The mutant ``stats_accepted_from_committed`` keeps committed = the output length;
    the checked run's Monitor sees that accepted is not the sum over its views."""
    from specdec import mutants

    frequent_stop(throughput, monkeypatch)
    argv = [*ARGV[:-1], "scripted:1.0"]  # every draft right: a stop cuts accepted drafts
    capsys.readouterr()
    assert throughput.main([*argv, "--out", str(tmp_path / "clean")]) == 0
    capsys.readouterr()
    with mutants.apply("stats_accepted_from_committed"):
        assert throughput.main([*argv, "--out", str(tmp_path / "bad")]) == 2
    out = capsys.readouterr()
    assert "refusing to print figures" in out.err and "Stats.accepted" in out.err
    assert "tok/s" not in out.out and not (tmp_path / "bad").exists()


@pytest.mark.engine
def test_benchmark_refuses_stats_that_do_not_add_up_to_the_outputs(throughput, tmp_path, capsys,
                                                                   monkeypatch):
    """A Stats whose committed is not the total output length (checked on every timed run)."""
    orig = throughput.run_config

    def lying(*a, **kw):
        seqs, stats, secs, cpu = orig(*a, **kw)
        if stats is not None and not kw.get("hooks"):  # the timed runs only
            stats.committed += 1
        return seqs, stats, secs, cpu
    monkeypatch.setattr(throughput, "run_config", lying)
    assert throughput.main([*ARGV, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "committed = total output length" in err and "repeat 0" in err
    assert not (tmp_path / "results.json").exists()


def test_guard_content_overhead_reports_every_workload_and_mode(tmp_path, capsys):
    """Both workloads, both modes, silent and exact (the benchmark asserts it per run), with
    the ratio the issue bounds and the kernels per forward counted."""
    mod = load_benchmark("guard_content_overhead")
    out = tmp_path / "gc.json"
    assert mod.main(["--repeats", "1", "--budget", "3", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["workload"], r["mode"]) for r in rows} == {
        (w, m) for w in ("engine", "generate") for m in ("fast", "strict")}
    for r in rows:
        assert r["forwards"] > 0 and r["guard_kernels_per_forward"] > 0
        assert r["content_kernels_per_forward"] > r["guard_kernels_per_forward"]
        assert r["rules_over_guard_cpu"] == pytest.approx(
            (r["content_cpu_us"] - r["guard_cpu_us"]) / r["guard_cpu_us"])
    assert "rules/guard" in capsys.readouterr().out


def test_width_cost_prices_every_width_and_its_break_even(tmp_path, capsys):
    bench = load_benchmark("width_cost")
    # the break-even acceptance solves 1 + p + ... + p^(w-1) = r(w)
    assert bench.break_even(1.0, 3) == 0.0
    assert bench.break_even(3.0, 3) is None and bench.break_even(3.5, 3) is None
    p = bench.break_even(1.75, 3)
    assert abs(1 + p + p * p - 1.75) < 1e-9 and abs(p - 0.5) < 1e-9
    out = tmp_path / "w.json"
    assert bench.main(["--model", "tiny:llama", "--batch-sizes", "1", "3", "--k", "2",
                       "--context", "6", "--repeats", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    for b in ("1", "3"):
        rows = data["batches"][b]
        assert [r["width"] for r in rows] == [1, 2, 3]
        assert rows[0]["ratio"] == 1.0 and all(r["cpu_ms"] > 0 for r in rows)
        for r in rows[1:]:
            assert r["break_even"] == bench.break_even(r["ratio"], r["width"])
    assert "p*" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--k must be at least 1"):
        bench.main(["--model", "tiny:llama", "--k", "0"])


def test_the_gpu_session_script_runs_in_its_cpu_mode(tmp_path):
    """benchmarks/gpu_session.sh, the one command a session with a lent GPU runs, runs every
    step on the CPU with ALLOW_CPU=1: gpu_check.sh (the GPU tests on the CPU, the overhead
    benchmark of both settings) and gpu_throughput.sh (issue #19's side-by-side comparison:
    the plain loop, Hugging Face generate and the strategies with scripted drafts from the
    batched reference, each exact in fp32), everything in one archive, the figures last."""
    import os
    import subprocess
    import tarfile

    env = dict(os.environ, ALLOW_CPU="1", REPEATS="1", OUT=str(tmp_path),
               PYTHON=sys.executable)
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_session.sh")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert done.stdout.rstrip().endswith("exit 0") and "== figures" in done.stdout
    with tarfile.open(tmp_path / "gpu_session.tar.gz") as tar:
        tar.extractall(tmp_path / "got", filter="data")
    got = tmp_path / "got"
    tests = (got / "check" / "gpu_tests.log").read_text()
    assert " passed" in tests and "failed" not in tests
    overhead = json.loads((got / "check" / "monitor_overhead.json").read_text())
    configs = {(r["setting"], r["config"]) for r in overhead["rows"]}
    assert {(s, c) for s in ("cheap", "real") for c in ("none", "fast", "strict",
                                                          "guard-fast")} <= configs
    assert all(r["identical"] for r in overhead["rows"])
    for name, strategies in (("throughput-7b-bf16", {"eqspec", "holes"}),
                             ("throughput-1b-fp32", {"eqspec", "holes", "exspec"})):
        data = json.loads((got / "throughput" / name / "results.json").read_text())
        rows = data["rows"]
        assert {r["strategy"] for r in rows} == {"standard", "hf-generate"} | strategies
        assert data["meta"]["script_from"] == "batched" and data["meta"]["kinds"] == {"random": 4}
        assert all(r["batch_size"] == 8 and r["exact_match"] == 1.0 for r in rows)
        assert all(r["vs_hf_generate"] is not None for r in rows)
        assert "vs hf" in (got / "throughput" / f"{name}.log").read_text()


def test_step_ops_counts_a_plain_step_of_both_loops(capsys):
    """benchmarks/step_ops.py: per decode step, the plain loop's aten ops and host reads
    next to Hugging Face generate's (the plain loop reads once, issue #19)."""
    mod = load_benchmark("step_ops")
    assert mod.main(["--batch-size", "3", "--top", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    reads = next(line for line in lines if line.startswith("host reads")).split()[2:]
    ops = next(line for line in lines if line.startswith("aten ops")).split()[2:]
    assert float(reads[0]) == 1.0 and all(float(x) > 50 for x in ops)
