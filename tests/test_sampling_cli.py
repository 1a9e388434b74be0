"""Sampling on the command line (``--temperature --top-k --top-p --seed --sampling-mode``)
and in the audit (coupled engines exact against plain coupled sampling; rejection and the
known-bad samplers by the distribution test, with their p-values)."""

from __future__ import annotations

import json

import pytest

import specdec
from specdec import Sampling, cli, models
from harness import random_prompts


@pytest.mark.parametrize("flags, sampling", [
    (["--temperature", "0.7", "--top-k", "20", "--seed", "3"], Sampling(0.7, 20, 1.0, 3)),
    (["--top-p", "0.9", "--sampling-mode", "rejection"], Sampling(top_p=0.9, mode="rejection")),
    (["--seed", "5"], Sampling(seed=5)),
])
def test_generate_samples_as_the_flags_say(flags, sampling, capsys):
    prompts = random_prompts((4, 11, 2), models.TINY_VOCAB, seed=3)
    assert cli.main(["generate", "--model", "tiny:llama", "--max-new-tokens", "6", "--k", "3",
                     *flags, *[" ".join(map(str, p)) for p in prompts]]) == 0
    got = [json.loads(line)["ids"] for line in capsys.readouterr().out.splitlines()]
    target = models.tiny("llama")
    if sampling.mode == "coupled":  # equal to plain sampling
        assert got == specdec.reference_generate(target, prompts, max_new_tokens=6, sampling=sampling)
    else:  # the same engine run from the API
        assert got == specdec.generate(target, prompts, k=3, max_new_tokens=6,
                                       sampling=sampling).sequences
    greedy = specdec.reference_generate(target, prompts, max_new_tokens=6)
    assert got != greedy


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "0"], "temperature must be a finite number > 0"),
    (["--temperature", "-1"], "temperature must be a finite number > 0"),
    (["--top-p", "1.5"], "top_p must be a number in (0, 1]"),
    (["--top-k", "-2"], "top_k must be an integer >= 0, got -2"),
    (["--seed", "-1"], "seed must be an integer in [0, 18446744073709551615], got -1"),
    (["--sampling-mode", "greedy"], "invalid choice: 'greedy'"),
    (["--top-k", "2.5"], "invalid int value: '2.5'"),
])
def test_bad_sampling_flags_are_one_line_and_exit_2_before_any_model_loads(flags, message, capsys,
                                                                           monkeypatch):
    monkeypatch.setattr(models, "resolve", lambda name: pytest.fail("a model was loaded"))
    assert cli.main(["generate", "--model", "tiny:llama", *flags, "3 4 5"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_the_audit_runs_sampling_engines_and_reports_p_values(tmp_path, capsys):
    out = tmp_path / "audit"
    rc = cli.main(["audit", "--model", "tiny:llama", "--limit", "6", "--max-new-tokens", "8",
                   "--temperature", "0.9", "--top-p", "0.95",
                   "--engines", "coupled:eqspec", "coupled:holes", "rejection:exspec",
                   "residual_unnormalised", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "distribution tests" in printed and "p-value" in printed
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["sampling"] == {"temperature": 0.9, "top_k": 0, "top_p": 0.95, "seed": 0}
    engines = {e["name"]: e for e in report["engines"]}
    for name in ("coupled:eqspec", "coupled:holes"):
        e = engines[name]
        assert e["expected_correct"] and e["exact_match"] == 1.0 and e["violations"] == 0
    good, bad = engines["rejection:exspec"], engines["residual_unnormalised"]
    assert good["expected_correct"] and good["distribution"]["passed"]
    assert good["distribution"]["p_value"] >= 1e-3 and good["violations"] == 0
    assert not bad["expected_correct"] and bad["distribution"]["p_value"] < 1e-6
    assert bad["distribution"]["strategy"] == "eqspec"


def test_a_run_spec_replays_a_sampling_run_and_refuses_bad_sampling_fields():
    from specdec.forensics.replay import run_spec

    prompts = random_prompts((4, 9), models.TINY_VOCAB, seed=4)
    spec = {"model": "tiny:llama", "prompts": prompts, "k": 2, "max_new_tokens": 6,
            "sampling": {"temperature": 0.8, "seed": 9}}
    result = run_spec(spec)
    s = Sampling(temperature=0.8, seed=9)
    assert not result.violations
    assert result.sequences == specdec.reference_generate(models.tiny("llama"), prompts,
                                                          max_new_tokens=6, sampling=s)
    for bad, error in (({"temp": 1}, ValueError), ({"temperature": 0}, ValueError),
                       ([0.7], ValueError)):
        with pytest.raises(error):
            run_spec({**spec, "sampling": bad})
    with pytest.raises(ValueError, match="does not apply to a known_bad run"):
        run_spec({**spec, "known_bad": "drop_bonus"})
