"""A new strategy is one module plus one registry line.

``tests/by_length_strategy.py`` defines a strategy nothing else in the tree knows
(EQSPEC over length-sorted batches, with its own option ``sort_window``). Registering it
with the same one line the built-in strategies use makes it a value of
``generate(strategy=...)``, a choice of ``specdec generate --strategy`` with its option as
a flag, a correct engine of ``specdec audit`` (run under the strict Monitor there) and a
``NAME:VALUE`` of the throughput benchmark, with no other file touched.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

import invariants
import specdec
from harness import random_prompts
from specdec import cli, models, strategies

ROOT = Path(__file__).resolve().parents[1]
NAME = "by_length"
LENGTHS = (9, 2, 14, 5, 1, 7)


@pytest.fixture
def registered():
    assert NAME not in strategies.names()
    strategies.register(NAME, "by_length_strategy")  # the one registry line
    try:
        yield strategies.get(NAME)
    finally:
        strategies.unregister(NAME)


@pytest.fixture(scope="module")
def workload():
    target = models.tiny("llama")
    prompts = random_prompts(LENGTHS, models.TINY_VOCAB, seed=3)
    return target, prompts, specdec.reference_generate(target, prompts, max_new_tokens=8)


def test_no_file_outside_the_plugin_names_it():
    sources = [p for pkg in ("specdec", "invariants", "proofs", "benchmarks")
               for p in (ROOT / pkg).rglob("*.py")]
    assert sources and not [p for p in sources if NAME in p.read_text()]
    assert NAME not in strategies.names()


def test_generate_runs_it_under_the_monitor(registered, workload):
    target, prompts, ref = workload
    mon = invariants.Monitor(mode="strict")
    batches = []
    res = specdec.generate(target, prompts, strategy=NAME, batch_size=2, max_new_tokens=8,
                           sort_window=len(prompts), hooks=[
                               mon, lambda ph, v: batches.append(v.row_ids.tolist())
                               if ph == "prefill" else None])
    assert mon.check() == [] and res.sequences == ref
    by_len = sorted(range(len(prompts)), key=lambda i: LENGTHS[i])
    assert batches == [by_len[0:2], by_len[2:4], by_len[4:6]]  # its own batching ran


def test_its_option_is_validated_and_refused_elsewhere(registered, workload):
    target, prompts, _ = workload
    with pytest.raises(ValueError, match="sort_window must be an integer >= 1"):
        specdec.generate(target, prompts, strategy=NAME, sort_window=0)
    with pytest.raises(ValueError, match=f"sort_window= applies to strategy='{NAME}' only"):
        specdec.generate(target, prompts, strategy="eqspec", sort_window=2)


def test_specdec_generate_offers_it_with_its_option(registered, workload, capsys):
    target, prompts, ref = workload
    cli.main(["generate", "--model", "tiny:llama", "--strategy", NAME, "--sort-window", "3",
              "--batch-size", "2", "--max-new-tokens", "8", "--ids",
              *[" ".join(map(str, p)) for p in prompts]])
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [o["ids"] for o in out] == ref


def test_the_audit_runs_it_as_a_correct_engine(registered, capsys):
    from specdec.forensics import audit

    assert NAME in audit.correct_names() and NAME in audit.engine_names()
    rc = cli.main(["audit", "--model", "tiny:llama", "--limit", "6", "--max-new-tokens", "8",
                   "--batch-size", "3", "--engines", "standard", NAME])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith(NAME))
    assert rc == 0  # a correct engine with a desync or a violation fails the audit
    assert re.match(rf"{NAME}\s+yes\s.*\s100%\s+0\s+0\s+0\s+0\s+-$", row), row


def test_the_benchmark_parses_its_option(registered):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import throughput
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert throughput.strategy_options(f"{NAME}:4") == (NAME, {"sort_window": 4})
    assert throughput.strategy_options("holes:0.25") == ("holes", {"hole_threshold": 0.25})
