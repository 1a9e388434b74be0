"""The command line: generate (ids in and out on a tiny model) and replay."""

from __future__ import annotations

import json

import pytest

import invariants
import specdec
from specdec import cli, models
from specdec.forensics.replay import run_spec
from harness import random_prompts


def test_generate_prints_ids_equal_to_the_reference(capsys):
    prompts = random_prompts((4, 11), models.TINY_VOCAB, seed=2)
    cli.main(["generate", "--model", "tiny:llama", "--max-new-tokens", "6", "--k", "3",
              *[" ".join(map(str, p)) for p in prompts]])
    lines = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
    ref = specdec.reference_generate(models.tiny("llama"), prompts, max_new_tokens=6)
    assert [l["ids"] for l in lines] == ref


def test_generate_reads_jsonl(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    # a tiny model reads prompts as ids; a SpecBench question keeps every turn (9 10, 11)
    f.write_text('{"prompt": "5 6 7"}\n\n{"question_id": 3, "category": "math", "turns": ["9 10", "11"]}\n')
    cli.main(["generate", "--model", "tiny:gpt2", "--max-new-tokens", "3", "--jsonl", str(f)])
    out = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
    assert [o["id"] for o in out] == ["line-1", "3"]
    ref = specdec.reference_generate(models.tiny("gpt2"), [[5, 6, 7], [9, 10, 11]], max_new_tokens=3)
    assert [o["ids"] for o in out] == ref


def _known_bad_trace(tmp_path):
    spec = {"model": "tiny:llama", "prompts": random_prompts((3, 9, 20), models.TINY_VOCAB, seed=1),
            "drafter": {"kind": "ngram"}, "k": 3, "max_new_tokens": 8, "known_bad": "implicit_positions"}
    result = run_spec(spec)
    assert result.violations
    path = tmp_path / "trace.json"
    result.violations[0].save(path)
    return path, result.violations[0]


def test_replay_reproduces_a_saved_violation(tmp_path, capsys):
    path, saved = _known_bad_trace(tmp_path)
    assert cli.main(["replay", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("reproduced") and saved.invariant in out


def test_replay_says_when_the_violation_is_gone(tmp_path, capsys):
    path, _ = _known_bad_trace(tmp_path)
    data = json.loads(path.read_text())
    data["run"]["known_bad"] = None  # the bug fixed: the same run is now clean
    path.write_text(json.dumps(data))
    assert cli.main(["replay", str(path)]) == 1
    assert "no violation" in capsys.readouterr().out


def test_replay_of_a_trace_without_run_spec_explains_why(tmp_path, capsys):
    path, _ = _known_bad_trace(tmp_path)
    data = json.loads(path.read_text())
    data["run"] = {}
    path.write_text(json.dumps(data))
    assert cli.main(["replay", str(path)]) == 1
    assert "no run spec" in capsys.readouterr().out


def test_replay_of_a_malformed_file_is_a_clean_error(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    assert cli.main(["replay", str(bad)]) == 2
    assert "cannot replay" in capsys.readouterr().err


def test_generate_passes_strategy_options(capsys):
    prompts = random_prompts((4, 11, 7), models.TINY_VOCAB, seed=3)
    ref = specdec.reference_generate(models.tiny("llama"), prompts, max_new_tokens=5)
    for extra in (["--strategy", "exspec", "--window", "3"],
                  ["--strategy", "holes", "--hole-threshold", "0"]):
        cli.main(["generate", "--model", "tiny:llama", "--max-new-tokens", "5", "--batch-size", "2",
                  *extra, *[" ".join(map(str, p)) for p in prompts]])
        assert [json.loads(l)["ids"] for l in capsys.readouterr().out.splitlines()] == ref


def test_generate_states_the_rule_for_bad_options():
    args = ["generate", "--model", "tiny:llama", "--batch-size", "4", "5 6 7"]
    with pytest.raises(SystemExit, match="window .* must be an integer >= batch_size = 4"):
        cli.main([*args, "--strategy", "exspec", "--window", "2"])
    with pytest.raises(SystemExit, match="hole_threshold= applies to strategy='holes' only"):
        cli.main([*args, "--hole-threshold", "0.3"])
