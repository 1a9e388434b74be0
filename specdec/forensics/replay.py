"""Deterministic re-runs of a recorded run: what ``specdec replay TRACE.json`` does.

A *run spec* is a JSON-able dict that fully describes a decoding run::

    {"model": "tiny:llama" | "default" | PATH, "prompts": [[ids], ...],
     "drafter": {"kind": "ngram"} | {"kind": "model", "model": "tiny-draft:llama"}
                | {"kind": "scripted", "scripts": [[ids], ...]}
                | {"kind": "forcing", "reference": [[ids], ...], "pattern": [[a, ...], ...]},
     "strategy": "eqspec", "k": 4, "batch_size": 8, "max_new_tokens": 16,
     "stop_token_ids": null | [ids], "known_bad": null | NAME, "mutant": null | NAME,
     "sampling": null | {"temperature": 0.7, "top_k": 0, "top_p": 1.0, "seed": 0,
                         "mode": "coupled" | "rejection"}}

Every field is checked by ``specdec.validation.run_spec`` before anything runs (types,
known strategies, drafters, known-bad engines and mutants, no unknown or inapplicable
field), then by the same checks as ``specdec.generate`` once the model is loaded
(vocabulary, budget within the context).

``run_spec(spec)`` runs it under a strict recording ``Monitor(run=spec)``, so every
violation's trace carries the spec; ``run_spec(spec, checker="guard")`` runs it under
``guard_model(run=spec, prompts=...)`` instead (coherence and the content rules C1-C3,
outputs checked at the end). ``replay(trace)`` re-runs the spec stored in a trace (an
``InvariantViolation`` JSON, or a proofs counterexample) under the checker that wrote it
(the trace's ``source``) and says whether the same violation (invariant, step, phase,
rows) comes back. A foreign loop's guard trace has no run spec (the project cannot
re-run someone else's loop): it says so instead. Tiny models are seeded and decoding
is greedy or sampled with counter-based noise (``specdec.sampling``), so a replay is
deterministic.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch


def make_drafter(spec: dict, target):
    from .. import drafters, models

    d = spec.get("drafter") or {"kind": "ngram"}
    kind = d.get("kind")
    if kind == "ngram":
        return drafters.NGramDrafter()
    if kind == "model":
        return drafters.ModelDrafter(models.resolve(d["model"])[0])
    if kind == "scripted":
        return drafters.ScriptedDrafter(d["scripts"])
    if kind == "forcing":
        return drafters.ForcingDrafter(d["reference"], d["pattern"], models.vocab_size(target))
    raise ValueError(f"unknown drafter kind {kind!r} in the run spec: ngram, model, scripted, forcing")


@dataclass
class RunResult:
    sequences: list
    violations: list
    spec: dict


#: the checkers a run spec can be replayed under: the strict Monitor on the engine's views,
#: or ``guard_model`` on the target's forwards with the content rules C1-C3 (the trace's
#: ``source``: "monitor" or "guard")
CHECKERS = ("monitor", "guard")


def run_spec(spec: dict, *, target=None, checker: str = "monitor") -> RunResult:
    """Run the decoding described by ``spec`` under a strict recording checker: the
    ``Monitor`` (default), or ``guard_model`` around the target with the content rules
    (prompts, budget, the run's stop ids, greedy unless the spec samples), outputs checked
    at the end."""
    import invariants

    from .. import engine, models, mutants, strategies, validation
    from ..sampling import Sampling
    from .known_bad import KNOWN_BAD, generate_known_bad

    if checker not in CHECKERS:
        raise ValueError(f"checker must be one of {CHECKERS}, got {checker!r}")
    validation.run_spec(spec, strategy_names=strategies.names(), known_bad_names=tuple(KNOWN_BAD))
    json.dumps(spec)  # a spec must be JSON-able: it goes into traces
    sampling = Sampling(**spec["sampling"]) if spec.get("sampling") is not None else None
    if target is None:
        target = models.resolve(spec.get("model", "default"))[0]
    drafter = make_drafter(spec, target)
    budget = spec.get("max_new_tokens", 16)
    stops = spec.get("stop_token_ids")
    if checker == "monitor":
        mon = invariants.Monitor(mode="strict", raise_on_violation=False, run=spec)
        hooks, guard = [mon], contextlib.nullcontext()
    else:
        hooks, mon = [], None
        guard = invariants.guard_model(
            target, "strict", raise_on_violation=False, run=spec, prompts=spec["prompts"],
            max_new_tokens=budget, greedy=sampling is None,
            stop_token_ids=models.stop_token_ids(target) if stops is None else stops)
    common = dict(drafter=drafter, k=spec.get("k", 4), max_new_tokens=budget,
                  stop_token_ids=stops, hooks=hooks)
    mutant = spec.get("mutant")
    ctx = mutants.apply(mutant) if mutant else contextlib.nullcontext()
    with ctx, torch.no_grad(), guard as g:
        if spec.get("known_bad"):
            seqs, _ = generate_known_bad(spec["known_bad"], target, spec["prompts"],
                                         batch_size=spec.get("batch_size"), **common)
        else:
            seqs = engine.generate(target, spec["prompts"], strategy=spec.get("strategy", "eqspec"),
                                   batch_size=spec.get("batch_size", 8), sampling=sampling,
                                   **common).sequences
    violations = mon.check() if mon is not None else g.check_outputs(seqs)
    return RunResult(seqs, violations, spec)


def _signature(v) -> tuple:
    return (v.invariant, v.step, v.phase, tuple(v.row_ids))


TRACE_RULE = ("a trace is a JSON object: an InvariantViolation trace (with 'invariant', "
              "'step', 'phase' and its 'run' spec) or a proofs counterexample")


def load_trace(trace) -> tuple[dict, str]:
    """(the trace object, its JSON text) from a path, JSON text (starting with ``{``) or a
    dict; refuses a missing file, text that is not JSON and JSON that is not a trace."""
    from .. import validation

    if isinstance(trace, dict):
        text, where = json.dumps(trace), "the trace"
    elif isinstance(trace, str) and trace.lstrip().startswith(("{", "[")):
        text, where = trace, "the trace text"
    elif isinstance(trace, (str, Path)):
        text, where = validation.read_text(trace, "trace file"), f"trace file {trace}"
    else:
        raise TypeError(f"{TRACE_RULE}; got {validation.describe(trace)}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                         f"{TRACE_RULE}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where} holds a JSON {type(data).__name__}, not an object; {TRACE_RULE}")
    is_proof = data.get("kind") == "proof-counterexample" or "counterexample" in data
    if not is_proof and not {"invariant", "step", "phase"} <= set(data):
        raise ValueError(f"{where} is not a trace: it lacks "
                         f"{sorted({'invariant', 'step', 'phase'} - set(data))}; {TRACE_RULE}")
    return data, text


def replay(trace) -> tuple[bool, str]:
    """Re-run the spec stored in ``trace`` (path, JSON text or dict); returns
    (same violation reproduced, a human-readable report). Bad input raises ValueError or
    TypeError naming the rule (``load_trace``, ``specdec.validation.run_spec``)."""
    import invariants

    data, text = load_trace(trace)
    if data.get("kind") == "proof-counterexample" or "counterexample" in data:
        from .counterexample import replay_counterexample  # a z3 counterexample

        rep = replay_counterexample(data)
        return bool(rep.diverged or rep.violations), str(rep)
    saved = invariants.InvariantViolation.from_json(text)
    spec = saved.trace.get("run") or {}
    if not isinstance(spec, dict):
        raise ValueError(f"the trace's 'run' must be a run spec object, got {spec!r}")
    if "prompts" not in spec:
        return False, ("this trace has no run spec (Monitor(run=...)) to replay: record runs "
                       "with specdec.forensics.replay.run_spec or pass run= to the Monitor")
    checker = "guard" if saved.trace.get("source") == "guard" else "monitor"
    result = run_spec(spec, checker=checker)
    if not result.violations:
        return False, f"replayed {spec.get('model')}: no violation this time (saved: {saved.invariant} " \
                      f"at step {saved.step}, {saved.phase})"
    got = result.violations[0]
    same = _signature(got) == _signature(saved)
    head = "reproduced" if same else "a different first violation"
    return same, f"{head}:\n{got}"
