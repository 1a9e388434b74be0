"""The pytest plugin (entry point ``invariants``): option, fixtures, failure reports."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest_plugins = ["pytester"]

GUARDED_TEST = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM

def tiny():
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    return LlamaForCausalLM(cfg).eval()

def test_a_hole_without_positions(guarded):
    model = guarded(tiny())
    ids = torch.tensor([[5, 0, 6], [7, 8, 9]])
    mask = torch.tensor([[1, 0, 1], [1, 1, 1]])
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)  # positions implicit over a hole: row 0 is wrong
"""


def test_the_plugin_module_imports_without_torch():
    code = ("import sys, invariants.pytest_plugin; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_option_chooses_the_mode_of_the_fixtures(pytester):
    pytester.makepyfile("""
        def test_mode(invariants_mode, invariants_monitor):
            assert invariants_mode == "fast" and invariants_monitor.mode == "fast"
    """)
    pytester.runpytest_inprocess("--invariants=fast", "-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_the_fixture_monitor_judges_outputs_by_the_calibrated_rule(pytester):
    pytester.makepyfile("""
        def test_rule(invariants_monitor):
            assert invariants_monitor.near_tie_tolerance is None  # no fixed tolerance
    """)
    pytester.runpytest_inprocess("--invariants=deep", "-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_the_default_mode_is_strict_unless_the_environment_says(pytester, monkeypatch):
    pytester.makepyfile("""
        import os
        def test_mode(invariants_mode):
            assert invariants_mode == os.environ.get("WANT", "strict")
    """)
    pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)
    monkeypatch.setenv("INVARIANTS_MODE", "deep")
    monkeypatch.setenv("WANT", "deep")
    pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


@pytest.mark.parametrize("mode", ["strict", "fast"])
def test_a_guarded_violation_fails_the_test_with_the_trace(pytester, mode):
    pytester.makepyfile(GUARDED_TEST)
    result = pytester.runpytest_inprocess(f"--invariants={mode}", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*invariants trace*", "*I3 position-id contiguity violated*",
                                 "*positions left implicit*"])


def test_off_mode_lets_the_same_test_pass(pytester):
    pytester.makepyfile(GUARDED_TEST)
    pytester.runpytest_inprocess("--invariants=off", "-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_traces_of_failures_can_be_written_to_a_directory(pytester):
    pytester.makepyfile(GUARDED_TEST)
    out = pytester.path / "traces"
    pytester.runpytest_inprocess(f"--invariants-trace-dir={out}", "-p", "no:cacheprovider")
    files = list(out.glob("*.json"))
    assert len(files) == 1
    trace = json.loads(files[0].read_text())
    assert trace["invariant"] == "I3" and trace["run"]["test"].endswith(
        "test_a_hole_without_positions")
