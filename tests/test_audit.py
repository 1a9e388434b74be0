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
                   "--engines", "standard", "eqspec", "exspec", "holes", "implicit_positions",
                   "mask_all_ones", "accept_first_mismatch", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "implicit_positions" in printed and "first violation" in printed
    report = json.loads((out / "report.json").read_text())
    assert report["model"] == "tiny:llama" and report["prompts"] == 6
    engines = {e["name"]: e for e in report["engines"]}
    for e in engines.values():
        assert KEYS <= set(e) and 0.0 <= e["exact_match"] <= 1.0
    for name in ("standard", "eqspec", "exspec", "holes"):
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
