"""Replay a z3 counterexample of the realignment on the real engine.

``python -m proofs --mutant NAME --save-trace cex.json`` writes a counterexample as a
concrete small batch: old width ``W``, drafts ``k`` and per row ``n`` (real tokens) and
``m`` (tokens committed in the step). ``replay_counterexample`` builds exactly that step
with a tiny model and runs the engine on it:

- row ``b`` gets a random prompt of ``n`` tokens (so after prefill it has ``n`` real
  tokens and the batch width is ``max n``); when ``W > max n`` one more row of ``W``
  tokens and budget 1 is added, which finishes in that step and leaves the batch (the
  situation the proofs allow: finished rows make the old width larger);
- a ``ScriptedDrafter`` proposes the target's own greedy continuation with draft ``m``
  replaced by a wrong token, so the first verify step accepts ``m - 1`` drafts and
  commits ``m`` tokens (``m = k + 1``: every draft right, the bonus token);
- each row's budget is ``m + extra_tokens`` so decoding continues after the step and a
  corrupted layout shows in the output.

The engine output is compared with ``specdec.reference_generate`` (batch-1 greedy, run
on the unmutated layout), and an ``invariants.Monitor`` (strict checks, recording instead
of raising) watches every phase. Under the mutant that produced the trace the engine is
expected to diverge or to violate an invariant (a wrong position id, for instance, may
not change the output of a rotary model whose offset is constant along the row, but it
breaks I3); with ``mutant=None`` (the real layout) it must do neither.

    from specdec.forensics.counterexample import replay_counterexample
    report = replay_counterexample("cex.json")          # the trace's mutant
    report = replay_counterexample("cex.json", mutant=None)   # the real layout
    report.diverged, report.rows, print(report)

This module drives the engine's phases (``specdec.phases``) with EQSPEC's layout step; it
lives under forensics because it runs the engine: ``proofs/`` only writes the JSON.
"""

from __future__ import annotations

import contextlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["replay_counterexample", "ReplayReport", "FROM_TRACE"]

#: default of ``mutant``: apply the mutant named in the trace (if any)
FROM_TRACE = "from-trace"


@dataclass
class ReplayReport:
    diverged: bool                 # some row's engine output differs from the reference
    mutant: str | None             # the mutant the engine ran with (None: real layout)
    obligation: str | None         # the obligation the counterexample violates
    k: int
    old_width: int
    # per row: n, m (forced), committed (what the engine committed in the step), budget,
    # engine, reference, first_divergence (index or None), filler (the extra row)
    rows: list = field(default_factory=list)
    error: str | None = None       # the engine raised (counts as diverged)
    # invariant violations the monitor recorded: {"invariant", "step", "phase", "rows"}
    violations: list = field(default_factory=list)

    @property
    def caught(self) -> bool:
        """The engine diverged or broke an invariant: the counterexample is real."""
        return self.diverged or bool(self.violations)

    def __str__(self) -> str:
        head = (f"replay of {self.obligation or 'counterexample'}: k={self.k} W={self.old_width} "
                f"layout={'mutant ' + self.mutant if self.mutant else 'real'} -> "
                f"{'DIVERGED' if self.diverged else 'matches the reference'}")
        lines = [head]
        if self.error:
            lines.append(f"  engine raised: {self.error}")
        seen: dict = {}
        for v in self.violations:
            seen.setdefault(v["invariant"], []).append(v)
        for inv, vs in seen.items():
            v = vs[0]
            more = f" (and {len(vs) - 1} later phases)" if len(vs) > 1 else ""
            lines.append(f"  invariant {inv} violated first at step {v['step']} ({v['phase']}), "
                         f"rows {v['rows']}{more}")
        for b, r in enumerate(self.rows):
            tag = " (finishing row for W)" if r["filler"] else ""
            d = r["first_divergence"]
            status = "ok" if d is None else f"diverges at token {d}"
            lines.append(f"  row {b}: n={r['n']} m={r['m']} committed={r['committed']} "
                         f"budget={r['budget']}{tag}: {status}")
            if d is not None:
                lines.append(f"    engine    {r['engine']}")
                lines.append(f"    reference {r['reference']}")
        return "\n".join(lines)


def _load(trace) -> dict:
    if isinstance(trace, (str, Path)):
        with open(trace) as f:
            trace = json.load(f)
    if not isinstance(trace, dict):
        raise TypeError("a counterexample is a path to its JSON file or the loaded dict")
    return trace


def replay_counterexample(trace, *, mutant=FROM_TRACE, family: str = "llama",
                          extra_tokens: int = 8, seed: int = 0) -> ReplayReport:
    """Run the engine on the batch of a saved counterexample; report any divergence.

    trace:        path of a ``--save-trace`` JSON file, or its dict (or the bare
                  ``counterexample`` dict inside it)
    mutant:       name of a ``specdec.mutants`` mutant to run the engine with; by default
                  the one recorded in the trace; None runs the real layout
    family:       tiny model family (``specdec.models.FAMILIES``)
    extra_tokens: tokens each row decodes after the counterexample step
    seed:         seed of the model and of the random prompts
    """
    import torch

    import invariants
    import specdec
    from specdec import drafters, models, mutants, phases, strategies

    doc = _load(trace)
    cex = doc.get("counterexample", doc)
    if mutant == FROM_TRACE:
        mutant = doc.get("mutant")
    if cex.get("strategy") != "eqspec" or "old_width" not in cex:
        raise ValueError(
            "only realignment counterexamples (strategy 'eqspec', with old_width and rows of "
            f"n and m) can be replayed; this one is {cex.get('strategy') or cex.get('model') or 'unknown'}")
    k, W = int(cex["k"]), int(cex["old_width"])
    rows = [(int(r["n"]), int(r["m"])) for r in cex["rows"]]
    for b, (n, m) in enumerate(rows):
        if not (1 <= n <= W and 1 <= m <= k + 1):
            raise ValueError(f"row {b}: need 1 <= n <= W and 1 <= m <= k + 1, got n={n} m={m} "
                             f"W={W} k={k}")

    target = models.tiny(family, seed)
    vocab = models.vocab_size(target)
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n, _ in rows]
    budgets = [m + extra_tokens for _, m in rows]
    filler = W > max(n for n, _ in rows)
    if filler:
        prompts.append([rng.randrange(3, vocab) for _ in range(W)])
        budgets.append(1)
    ctx_len = models.context_length(target)
    if ctx_len is not None and max(len(p) + b for p, b in zip(prompts, budgets)) > ctx_len:
        raise ValueError(f"the counterexample is too large for the tiny model's context {ctx_len}")

    # the reference on the real layout (batch 1: no padding at all)
    ref = specdec.reference_generate(target, prompts, max_new_tokens=max(budgets),
                                     stop_token_ids=[])
    ref = [r[:b] for r, b in zip(ref, budgets)]
    scripts = []
    for b, r in enumerate(ref):
        s = list(r) + [0] * (k + 1)
        if b < len(rows) and rows[b][1] <= k:  # draft m (index m-1) wrong: accept m-1
            s[rows[b][1] - 1] = (s[rows[b][1] - 1] + 1) % vocab
        scripts.append(s)
    drafter = drafters.ScriptedDrafter(scripts)

    first_step: dict = {}

    def record(phase, view):
        if phase == "commit" and view.step == 0 and "committed" not in first_step:
            first_step["committed"] = view.committed.tolist()

    dev = next(target.parameters()).device
    monitor = invariants.Monitor("strict", raise_on_violation=False)
    ctx = phases.Context(
        target=target, drafter=drafter, k=k, stop_ids=torch.zeros(0, dtype=torch.long, device=dev),
        hooks=(record, monitor), max_position=(ctx_len - 1) if ctx_len else 2**31 - 1,
    )
    eqspec = strategies.get("eqspec")
    drafter.bind(prompts)
    done: list = []
    error = None
    with mutants.apply(mutant) if mutant else contextlib.nullcontext():
        try:
            with torch.no_grad():
                phases.run_batch(ctx, phases.State(), prompts, list(range(len(prompts))), budgets,
                                 done, capacity=lambda w, mb: eqspec.capacity(ctx, w, mb),
                                 after_step=eqspec.after_step)
        except Exception as e:  # a mutated layout may also crash the engine
            error = f"{type(e).__name__}: {e}"
    out = phases.collect(done, len(prompts)) if error is None else [None] * len(prompts)
    try:
        found = monitor.check()
    except Exception as e:  # noqa: BLE001 - report, do not mask the replay
        found, error = [], error or f"monitor: {type(e).__name__}: {e}"
    violations = [{"invariant": v.invariant, "step": v.step, "phase": v.phase, "rows": v.rows}
                  for v in found]

    committed = first_step.get("committed", [None] * len(prompts))
    report_rows = []
    for b, (p, budget) in enumerate(zip(prompts, budgets)):
        got, want = out[b], ref[b]
        d = None
        if got != want:
            got_l = got or []
            d = next((i for i, (x, y) in enumerate(zip(got_l, want)) if x != y),
                     min(len(got_l), len(want)))
        is_filler = b >= len(rows)
        report_rows.append({
            "n": len(p), "m": 1 if is_filler else rows[b][1], "budget": budget,
            "committed": committed[b] if b < len(committed) else None,
            "engine": got, "reference": want, "first_divergence": d, "filler": is_filler,
        })
    diverged = error is not None or any(r["first_divergence"] is not None for r in report_rows)
    return ReplayReport(diverged=diverged, mutant=mutant, obligation=doc.get("obligation"),
                        k=k, old_width=W, rows=report_rows, error=error, violations=violations)


def main(argv=None) -> int:
    """``python -m specdec.forensics.counterexample FILE [--mutant NAME|none] [--family F]``:
    exit 1 when the engine diverges or breaks an invariant (``specdec replay FILE`` runs
    the trace's own mutant)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m specdec.forensics.counterexample")
    ap.add_argument("trace")
    ap.add_argument("--mutant", default=FROM_TRACE, help="mutant to apply; 'none': real layout")
    ap.add_argument("--family", default="llama")
    ap.add_argument("--extra-tokens", type=int, default=8)
    args = ap.parse_args(argv)
    mutant = None if args.mutant in ("none", "None", "") else args.mutant
    report = replay_counterexample(args.trace, mutant=mutant, family=args.family,
                                   extra_tokens=args.extra_tokens)
    print(report)
    return 1 if report.caught else 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
