"""The command line: generate (ids in and out on a tiny model) and replay; every user
error is one line on stderr with exit code 2 (the tables at the end)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


@pytest.mark.parametrize("known_bad, invariant", [("accept_first_mismatch", "C2"),
                                                  ("mask_all_ones", "I3")])
def test_replay_reproduces_a_guard_violation_under_the_guard(tmp_path, capsys, known_bad,
                                                             invariant):
    """A trace written by guard_model (source "guard": a content rule, or a forward's
    coherence) replays under the guard, not the Monitor, and the same run without the
    fault is silent there."""
    spec = {"model": "tiny:llama", "prompts": random_prompts((3, 9, 20), models.TINY_VOCAB, seed=1),
            "drafter": {"kind": "ngram"}, "k": 3, "max_new_tokens": 8, "known_bad": known_bad}
    result = run_spec(spec, checker="guard")
    assert result.violations and result.violations[0].trace["source"] == "guard"
    saved = result.violations[0]
    assert saved.invariant == invariant
    path = tmp_path / "trace.json"
    saved.save(path)
    assert cli.main(["replay", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("reproduced") and saved.invariant in out
    assert run_spec({**spec, "known_bad": None}, checker="guard").violations == []


def test_run_spec_names_its_checkers():
    with pytest.raises(ValueError, match="checker must be one of"):
        run_spec({"model": "tiny:llama", "prompts": [[3, 4]]}, checker="deep")


def test_replay_of_a_malformed_file_is_a_clean_error(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    assert cli.main(["replay", str(bad)]) == 2
    assert f"trace file {bad} is not JSON" in capsys.readouterr().err


def test_generate_passes_strategy_options(capsys):
    prompts = random_prompts((4, 11, 7), models.TINY_VOCAB, seed=3)
    ref = specdec.reference_generate(models.tiny("llama"), prompts, max_new_tokens=5)
    for extra in (["--strategy", "exspec", "--window", "3"],
                  ["--strategy", "holes", "--hole-threshold", "0"]):
        cli.main(["generate", "--model", "tiny:llama", "--max-new-tokens", "5", "--batch-size", "2",
                  *extra, *[" ".join(map(str, p)) for p in prompts]])
        assert [json.loads(l)["ids"] for l in capsys.readouterr().out.splitlines()] == ref


def test_generate_passes_the_draft_length_policy(monkeypatch, capsys):
    from specdec import engine

    prompts = random_prompts((4, 11, 7), models.TINY_VOCAB, seed=4)
    ref = specdec.reference_generate(models.tiny("llama"), prompts, max_new_tokens=5)
    seen, orig = [], engine.generate
    monkeypatch.setattr(engine, "generate", lambda *a, **kw: seen.append(kw["policy"]) or orig(*a, **kw))
    for extra in ([], ["--policy", "fixed"]):
        cli.main(["generate", "--model", "tiny:llama", "--max-new-tokens", "5", "--batch-size", "2",
                  *extra, *[" ".join(map(str, p)) for p in prompts]])
        assert [json.loads(l)["ids"] for l in capsys.readouterr().out.splitlines()] == ref
    assert seen == ["adaptive", "fixed"]


def test_generate_passes_static_shapes(monkeypatch, capsys):
    from specdec import engine

    prompts = random_prompts((4, 11, 7), models.TINY_VOCAB, seed=5)
    ref = specdec.reference_generate(models.tiny("llama"), prompts, max_new_tokens=5)
    seen, orig = [], engine.generate
    monkeypatch.setattr(engine, "generate",
                        lambda *a, **kw: seen.append(kw["static_shapes"]) or orig(*a, **kw))
    for extra in ([], ["--static-shapes"]):
        cli.main(["generate", "--model", "tiny:llama", "--max-new-tokens", "5", "--batch-size", "2",
                  "--policy", "fixed", *extra, *[" ".join(map(str, p)) for p in prompts]])
        assert [json.loads(l)["ids"] for l in capsys.readouterr().out.splitlines()] == ref
    assert seen == [None, True]  # None: the engine's default (on with --compile cuda-graphs)


def test_generate_states_the_rule_for_bad_options(capsys):
    args = ["generate", "--model", "tiny:llama", "--batch-size", "4", "5 6 7"]
    assert cli.main([*args, "--strategy", "exspec", "--window", "2"]) == 2
    assert "window (requests in the pool) must be an integer >= batch_size = 4" in capsys.readouterr().err
    assert cli.main([*args, "--hole-threshold", "0.3"]) == 2
    assert "hole_threshold= applies to strategy='holes' only" in capsys.readouterr().err


# -- every user error: one line on stderr, exit code 2, no traceback ---------------------------

def _files(tmp: Path) -> dict:
    """Bad files for the tables: missing, malformed, binary, a directory, a JSON list."""
    (tmp / "malformed.jsonl").write_text('{"prompt": "5 6"}\n{"prompt": \n')
    (tmp / "binary.jsonl").write_bytes(b"\xff\xfe\x00\x01binary")
    (tmp / "list.json").write_text("[1, 2, 3]")
    (tmp / "notjson.json").write_text("not json")
    (tmp / "object.json").write_text('{"hello": 1}')
    (tmp / "a_dir").mkdir()
    return {"missing": str(tmp / "missing.jsonl"), "malformed": str(tmp / "malformed.jsonl"),
            "binary": str(tmp / "binary.jsonl"), "dir": str(tmp / "a_dir"),
            "list": str(tmp / "list.json"), "notjson": str(tmp / "notjson.json"),
            "object": str(tmp / "object.json")}


TINY = ["--model", "tiny:llama"]
# (row id, argv with {file} placeholders, message fragment, whether no model may load)
CLI_ERRORS = [
    ("jsonl-missing", ["generate", *TINY, "--jsonl", "{missing}"], "prompt file {missing} does not exist", True),
    ("jsonl-malformed", ["generate", *TINY, "--jsonl", "{malformed}"], "malformed.jsonl:2: not valid JSON", True),
    ("jsonl-binary", ["generate", *TINY, "--jsonl", "{binary}"], "binary.jsonl is not UTF-8 text (byte 0", True),
    ("jsonl-directory", ["generate", *TINY, "--jsonl", "{dir}"], "a_dir is a directory, not a file", True),
    ("model-tiny-bert", ["generate", "--model", "tiny:bert", "5 6"],
     "unknown model 'tiny:bert': tiny families are llama, qwen3, glm4, gpt2, mistral, gemma3; known names: default", False),
    ("model-nonexistent", ["generate", "--model", "/nonexistent", "5 6"],
     "model path /nonexistent does not exist; known names: default (SmolLM2-135M-Instruct), smollm2-135m-instruct, gemma3-270m, tiny:llama", False),
    ("model-not-a-model-dir", ["generate", "--model", "{dir}", "5 6"], "is not a Hugging Face model directory", False),
    ("generate-empty-prompt", ["generate", *TINY, ""], "prompt 0 is empty: every prompt needs at least one token", False),
    ("generate-text-on-tiny", ["generate", *TINY, "hello"], "this model has no tokenizer: give prompts as space-separated token ids, got 'hello'", False),
    ("generate-no-prompts", ["generate", *TINY], "give prompts as arguments or with --jsonl FILE", True),
    ("generate-budget-beyond-context", ["generate", *TINY, "--max-new-tokens", "1000", "5 6"], "prompt + budget must be <= context", False),
    ("generate-k-negative", ["generate", *TINY, "--k", "-1", "5"], "argument --k: k (drafts per step) must be an integer >= 0, got -1", True),
    ("generate-k-float", ["generate", *TINY, "--k", "1.5", "5"], "k (drafts per step) must be an integer >= 0, got '1.5'", True),
    ("generate-window-zero", ["generate", *TINY, "--strategy", "exspec", "--window", "0", "5"], "window (requests in the pool) must be an integer >= 1, got 0", True),
    ("generate-window-float", ["generate", *TINY, "--strategy", "exspec", "--window", "1.5", "5"], "argument --window: invalid int value: '1.5'", True),
    ("generate-hole-threshold", ["generate", *TINY, "--strategy", "holes", "--hole-threshold", "1.5", "5"], "hole_threshold must be a number in [0, 1], got 1.5", True),
    ("generate-option-of-another", ["generate", *TINY, "--window", "4", "5"], "window= applies to strategy='exspec' only, not 'eqspec'", True),
    ("audit-prompts-missing", ["audit", *TINY, "--prompts", "{missing}"], "prompt file {missing} does not exist", True),
    ("audit-prompts-malformed", ["audit", *TINY, "--prompts", "{malformed}"], "not valid JSON", True),
    ("audit-engines-unknown", ["audit", *TINY, "--engines", "nosuch"], "unknown engines ['nosuch']; choose from standard, hf_generate, eqspec", True),
    ("audit-k-negative", ["audit", *TINY, "--k", "-1"], "k (drafts per step) must be an integer >= 0, got -1", True),
    ("audit-batch-zero", ["audit", *TINY, "--batch-size", "0"], "batch size must be an integer >= 1, got 0", True),
    ("audit-out-is-a-file", ["audit", *TINY, "--out", "/etc/passwd"], "--out /etc/passwd exists and is not a directory", True),
    ("audit-limit-negative", ["audit", *TINY, "--limit", "-1"], "limit must be an integer >= 0, got -1", True),
    ("audit-strategy-unknown", ["audit", *TINY, "--strategy", "fast"], "argument --strategy: invalid choice: 'fast'", True),
    ("replay-missing", ["replay", "{missing}"], "trace file {missing} does not exist", True),
    ("replay-list", ["replay", "{list}"], "holds a JSON list, not an object; a trace is a JSON object", True),
    ("replay-not-json", ["replay", "{notjson}"], "is not JSON (Expecting value at line 1 column 1)", True),
    ("replay-not-a-trace", ["replay", "{object}"], "is not a trace: it lacks ['invariant', 'phase', 'step']", True),
    ("replay-directory", ["replay", "{dir}"], "is a directory, not a file", True),
]


def _run_cli(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _assert_one_line_error(code, out, err, command, fragment):
    assert code == 2, (code, err)
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err  # exactly one line
    assert err.startswith(f"specdec {command}: "), err
    assert fragment in err, err
    assert "Traceback" not in err


def forbid_model_loads(monkeypatch):
    """Options and files are checked before any model loads: loading one fails the test."""
    def refuse(name):
        raise AssertionError(f"a model was loaded ({name}) before the options were checked")
    monkeypatch.setattr(models, "resolve", refuse)


@pytest.mark.parametrize("argv, fragment, before_work", [r[1:] for r in CLI_ERRORS],
                         ids=[r[0] for r in CLI_ERRORS])
def test_every_cli_user_error_is_one_line_with_exit_code_2(tmp_path, capsys, monkeypatch, argv,
                                                           fragment, before_work):
    files = _files(tmp_path)
    argv = [a.format(**files) for a in argv]
    if before_work:
        forbid_model_loads(monkeypatch)
    code, out, err = _run_cli(argv, capsys)
    _assert_one_line_error(code, out, err, argv[0], fragment.format(**files))


@pytest.fixture(scope="module")
def saved_trace(tmp_path_factory):
    """A real trace of a known-bad run (its run spec is what the edits below change)."""
    spec = {"model": "tiny:llama", "prompts": random_prompts((3, 9, 20), models.TINY_VOCAB, seed=1),
            "drafter": {"kind": "ngram"}, "k": 3, "max_new_tokens": 8, "known_bad": "implicit_positions"}
    result = run_spec(spec)
    assert result.violations
    return json.loads(result.violations[0].to_json())


# (row id, edit of the run spec, message fragment): one edited field per row
SPEC_EDITS = [
    ("k-negative", {"k": -3}, "run spec 'k' (drafts per step) must be an integer >= 0, got -3"),
    ("prompt-out-of-vocab", {"prompts": [[5, 500]]}, "prompt 0 has token ids outside the vocabulary [0, 128): [500]"),
    ("prompts-string", {"prompts": "hello"}, "run spec 'prompts' must be a non-empty list of token-id lists"),
    ("prompt-float-id", {"prompts": [[5, 6.5]]}, "run spec 'prompts'[0], position 1: a token id must be an integer"),
    ("drafter-string", {"drafter": "ngram"}, "run spec 'drafter' must be an object such as {\"kind\": \"ngram\"}"),
    ("drafter-kind-unknown", {"drafter": {"kind": "oracle"}}, "run spec drafter 'kind' must be one of ngram, model, scripted, forcing"),
    ("drafter-extra-field", {"drafter": {"kind": "ngram", "n": 3}}, "run spec drafter of kind 'ngram' has the fields ['kind']"),
    ("drafter-scripts-beyond-vocab", {"known_bad": None, "drafter": {"kind": "scripted", "scripts": [[1], [2], [900]]}},
     "ScriptedDrafter script 2 (or fill) has token ids outside the target's vocabulary [0, 128): [900]"),
    ("budget-float", {"max_new_tokens": 1e6}, "run spec 'max_new_tokens' must be an integer, got 1000000.0"),
    ("budget-beyond-context", {"max_new_tokens": 10**6}, "prompt + budget must be <= context"),
    ("batch-size-zero", {"batch_size": 0}, "run spec 'batch_size' must be an integer >= 1, got 0"),
    ("strategy-nonsense", {"known_bad": None, "strategy": "nonsense"},
     "run spec 'strategy' must be one of eqspec, exspec, holes; got 'nonsense'"),
    ("strategy-with-known-bad", {"strategy": "eqspec"}, "run spec 'strategy' does not apply to a known_bad run"),
    ("known-bad-unknown", {"known_bad": "nosuch"}, "run spec 'known_bad' must be one of implicit_positions"),
    ("mutant-unknown", {"mutant": "nosuch"}, "run spec 'mutant' must be one of padding_off_by_one"),
    ("unknown-field", {"seed": 3}, "unknown run spec fields ['seed']; a run spec has model, prompts"),
    ("model-unknown", {"model": "tiny:bert"}, "unknown model 'tiny:bert'"),
    ("stop-ids-int", {"stop_token_ids": 2}, "run spec 'stop_token_ids' must be a list of token ids or null, got 2"),
]


@pytest.mark.parametrize("edit, fragment", [r[1:] for r in SPEC_EDITS], ids=[r[0] for r in SPEC_EDITS])
def test_replay_validates_every_run_spec_field(saved_trace, tmp_path, capsys, edit, fragment):
    trace = json.loads(json.dumps(saved_trace))
    trace["run"].update(edit)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(trace))
    code, out, err = _run_cli(["replay", str(path)], capsys)
    _assert_one_line_error(code, out, err, "replay", fragment)


@pytest.mark.parametrize("argv, fragment", [
    (["replay", "/nonexistent/trace.json"], "trace file /nonexistent/trace.json does not exist"),
    (["generate", "--model", "tiny:bert", "5 6"], "unknown model 'tiny:bert'"),
])
def test_a_user_error_in_a_subprocess_has_no_traceback(argv, fragment):
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "specdec.cli", *argv], capture_output=True,
                          text=True, cwd=root, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and fragment in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_each_commands_help_states_its_own_default_budget(capsys):
    # the audit decodes 32 new tokens by default (run_audit's default), generate 64: the
    # shared --max-new-tokens option's help says which
    import inspect

    from specdec.forensics.audit import run_audit

    want = {"audit": inspect.signature(run_audit).parameters["max_new_tokens"].default,
            "generate": 64}
    for command, default in want.items():
        try:
            assert cli.main([command, "--help"]) == 0
        except SystemExit as e:
            assert e.code == 0
        text = " ".join(capsys.readouterr().out.split())
        assert f"new tokens per prompt (default {default})" in text, command
