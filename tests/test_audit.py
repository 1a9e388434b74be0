"""``specdec audit``: the report's contract, on a tiny model; and on Gemma 3 past its window."""

from __future__ import annotations

import json

import pytest

from specdec import cli

KEYS = {"name", "expected_correct", "tokens_per_s", "speedup_vs_standard", "acceptance",
        "exact_match", "near_ties", "desyncs", "violations", "first_violation"}


def test_audit_writes_the_report_and_flags_known_bad_engines(tmp_path, capsys):
    out = tmp_path / "audit"
    rc = cli.main(["audit", "--model", "tiny:llama", "--limit", "6", "--max-new-tokens", "8",
                   "--engines", "standard", "hf_generate", "eqspec", "exspec", "holes",
                   "implicit_positions", "mask_all_ones", "accept_first_mismatch",
                   "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "implicit_positions" in printed and "first violation" in printed
    report = json.loads((out / "report.json").read_text())
    assert report["model"] == "tiny:llama" and report["prompts"] == 6
    assert report["settings"]["dtype"] == "float32"
    assert report["settings"]["oracle"].startswith("calibrated")  # no fixed tolerance
    engines = {e["name"]: e for e in report["engines"]}
    for e in engines.values():
        assert KEYS <= set(e) and 0.0 <= e["exact_match"] <= 1.0
    for name in ("standard", "hf_generate", "eqspec", "exspec", "holes"):
        e = engines[name]
        assert e["expected_correct"] and e["exact_match"] == 1.0
        assert e["desyncs"] == 0 and e["violations"] == 0
    for name, inv in (("implicit_positions", "I3"), ("mask_all_ones", "I3"),
                      ("accept_first_mismatch", "I6")):
        e = engines[name]
        assert not e["expected_correct"] and e["violations"] > 0
        assert e["first_violation"]["invariant"] == inv
    for f in ("report.md", "exactness.png", "phases.png"):
        assert (out / f).stat().st_size > 0


def test_audit_refuses_unknown_engines(capsys):
    assert cli.main(["audit", "--model", "tiny:llama", "--limit", "2", "--engines", "warp"]) == 2
    assert "unknown engines ['warp']" in capsys.readouterr().err


def test_audit_runs_in_the_dtype_asked_and_says_so(tmp_path, capsys):
    out = tmp_path / "audit"
    rc = cli.main(["audit", "--model", "tiny:gpt2", "--dtype", "bfloat16", "--limit", "4",
                   "--max-new-tokens", "6", "--engines", "standard", "hf_generate", "holes",
                   "crop_to_batch_min", "--out", str(out)])
    assert rc == 0
    assert "(bfloat16)" in capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["dtype"] == "bfloat16"
    for e in report["engines"]:
        if e["expected_correct"]:
            assert e["desyncs"] == 0 and e["violations"] == 0
            assert all(r["classification"] == "near-tie" for r in e["divergences"])


def test_audit_interleaves_the_engines_batch_by_batch_and_reports_the_spread(monkeypatch):
    from specdec import models
    from specdec.forensics import audit

    order = []
    orig = audit._EngineRun.run_batch

    def spy(self, target, prompts, rows, **kw):
        order.append((rows[0], self.name))
        return orig(self, target, prompts, rows, **kw)

    monkeypatch.setattr(audit._EngineRun, "run_batch", spy)
    target = models.tiny("llama")
    ids = [[5 + i, 6, 7, 8 + i] for i in range(6)]
    engines = ["standard", "eqspec", "holes"]
    report = audit.run_audit(target, None, ids, engines=engines, batch_size=2, max_new_tokens=4)
    # batch-major, the order rotating: every engine ran a batch before any ran the next
    assert [r for r, _ in order] == [0, 0, 0, 2, 2, 2, 4, 4, 4]
    assert [n for _, n in order[3:6]] == ["eqspec", "holes", "standard"]
    for e in report.engines:
        assert len(e.batch_tokens_per_s) == 3 and e.exact_match == 1.0
        lo, hi = e.speedup_spread
        assert 0 < lo <= hi
    assert report.engines[0].speedup_spread == [1.0, 1.0]


def test_audit_judges_against_a_given_reference_and_checks_its_shape():
    """``reference_ids``: the audit judges the engines against the caller's batch-1 ids
    (one decode fewer); ids that are not the reference make correct engines mismatch, and a
    reference of the wrong shape is refused with the rule."""
    import specdec
    from specdec import models
    from specdec.forensics import audit

    target = models.tiny("llama")
    ids = [[5 + i, 6, 7, 8 + i] for i in range(4)]
    ref = specdec.reference_generate(target, ids, max_new_tokens=4)
    report = audit.run_audit(target, None, ids, engines=["eqspec"], batch_size=4,
                             max_new_tokens=4, reference_ids=ref)
    assert report.reference_seconds == 0.0 and report.engines[0].exact_match == 1.0
    wrong = [[(t + 1) % models.vocab_size(target) for t in r] for r in ref]
    report = audit.run_audit(target, None, ids, engines=["eqspec"], batch_size=4,
                             max_new_tokens=4, reference_ids=wrong)
    assert report.engines[0].exact_match < 1.0
    with pytest.raises(ValueError, match="one row per prompt: 3 rows for 4 prompts"):
        audit.run_audit(target, None, ids, engines=["eqspec"], max_new_tokens=4,
                        reference_ids=ref[:3])
    with pytest.raises(ValueError, match="at most max_new_tokens=2 per row"):
        audit.run_audit(target, None, ids, engines=["eqspec"], max_new_tokens=2,
                        reference_ids=ref)


@pytest.mark.real
@pytest.mark.xdist_group("gemma3-270m")
def test_audit_on_gemma3_past_its_window_is_clean_for_correct_engines(tmp_path, capsys):
    """``specdec audit --model gemma3-270m`` on a prompt past the 512-token window (one
    prompt, a few engines, to keep CI short: the full audit's figures are in the README)."""
    out = tmp_path / "audit"
    rc = cli.main(["audit", "--model", "gemma3-270m", "--prompts", "long", "--limit", "1",
                   "--batch-size", "1", "--max-new-tokens", "6", "--engines", "eqspec",
                   "holes", "implicit_positions", "accept_first_mismatch", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert report["model"] == "gemma3-270m" and report["prompts"] == 1
    engines = {e["name"]: e for e in report["engines"]}
    for name in ("eqspec", "holes"):
        e = engines[name]
        assert e["exact_match"] == 1.0 and e["desyncs"] == 0 and e["violations"] == 0
    for name, inv in (("implicit_positions", "I3"), ("accept_first_mismatch", "I6")):
        assert engines[name]["violations"] > 0
        assert engines[name]["first_violation"]["invariant"] == inv


def test_each_engine_learns_on_its_own_calibration(monkeypatch):
    """The audit's engines run the same batches one after the other: a policy string gives
    each its own calibration, kept across its batches, so no engine plans from what the
    engines before it learned on the batch (the model's own calibration is left alone)."""
    import torch

    from specdec import drafters, models, policy
    from specdec.forensics import audit

    target = models.tiny("llama")
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, models.TINY_VOCAB, (n,), generator=g).tolist() for n in (4, 9, 6, 12)]
    seen = []
    original = audit._EngineRun.policy

    def spy(self, given):
        chosen = original(self, given)
        seen.append((self.name, chosen))
        return chosen

    monkeypatch.setattr(audit._EngineRun, "policy", spy)
    audit.run_audit(target, None, ids, engines=["eqspec", "holes"], batch_size=2, k=3,
                    max_new_tokens=5, drafter_factory=drafters.NGramDrafter)
    monkeypatch.undo()
    cals = {name: {id(p.calibration) for n, p in seen if n == name} for name in ("eqspec", "holes")}
    assert len(seen) == 4 and all(len(c) == 1 for c in cals.values())  # kept across batches
    assert cals["eqspec"] != cals["holes"]
    assert all(isinstance(p, policy.AdaptivePolicy) and p.drain_margin == 0.05 for _, p in seen)
    assert policy.calibration(target).acceptance == {}  # the model's own: untouched
    assert isinstance(audit._EngineRun("eqspec", 1).policy("fixed"), policy.FixedPolicy)
