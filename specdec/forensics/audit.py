"""``specdec audit``: which batched decoding engines stay exact, and where the others break.

On one model and one prompt set it runs batched standard decoding, every registered
speculative strategy (``specdec.strategies.names()``) and every known-bad reproduction
(``known_bad.KNOWN_BAD``). Correct engines run under a strict Monitor (a violation stops
that engine and is reported); known-bad ones under a recording Monitor, so their whole
output is seen. Every engine's ids are compared with batch-1 greedy decoding; a divergence
is a near-tie when the reference's top-2 logit margin at its first position is below
``invariants.DEFAULT_TOLERANCE``, a desync otherwise.

Sampling engines. ``coupled:<strategy>``: the strategy with coupled sampling (the
audit's ``sampling``, mode coupled) on the same model, prompts and drafter, under a strict
Monitor, compared id for id with batch-1 plain coupled sampling (near-ties by the margin
of the coupled scores). ``rejection:<strategy>``: the strategy with speculative
rejection sampling, whose output equals no reference: a distribution test on a tiny
model (``distribution.run``: tiny Llama with vocabulary 8 and its draft model, chi-square
against the exact distribution of 3-token continuations), reported with its p-value;
it passes when ``p >= distribution.ALPHA``. The known-bad sampling engines
(``sampling_faults.FAULTS``: (g), (h), (i)) run the same distribution test with their
fault, and should fail it.

The report (``Report``) prints as a table; ``write(dir)`` saves report.md, report.json and
two PNG figures. Engines finish one at a time: an interrupt (Ctrl-C) keeps what finished.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .. import strategies
from ..sampling import Sampling
from .plots import phase_shares, save, stacked_phase_shares
from .sampling_faults import FAULTS


def correct_names() -> tuple[str, ...]:
    """The engines expected to be exact (batched standard decoding, every strategy, every
    strategy with coupled sampling) or lossless in distribution (every strategy with
    rejection sampling)."""
    names = strategies.names()
    return (("standard",) + names + tuple(f"coupled:{n}" for n in names)
            + tuple(f"rejection:{n}" for n in names))


def engine_names() -> tuple[str, ...]:
    from .known_bad import KNOWN_BAD
    from .sampling_faults import NAMES

    return correct_names() + tuple(KNOWN_BAD) + NAMES


def distribution_names() -> tuple[str, ...]:
    """The engines judged by the distribution test (see the module docstring)."""
    from .sampling_faults import NAMES

    return tuple(f"rejection:{n}" for n in strategies.names()) + NAMES


def check_engines(engines: list) -> list:
    """``engines`` if every name is known, else ValueError listing the known ones."""
    unknown = [e for e in engines if e not in engine_names()]
    if unknown:
        raise ValueError(f"unknown engines {unknown}; choose from {', '.join(engine_names())}")
    return engines


@dataclass
class EngineReport:
    name: str
    expected_correct: bool
    tokens_per_s: float = 0.0
    speedup_vs_standard: float | None = None
    acceptance: float | None = None
    exact_match: float = 0.0
    near_ties: int = 0
    desyncs: int = 0
    overruns: int = 0  # rows whose output runs on past the reference's stop (prefix exact)
    violations: int = 0
    first_violation: dict | None = None
    sample: str | None = None  # a short excerpt of corrupted text
    seconds: float = 0.0
    tokens: int = 0
    phase_shares: dict | None = None
    error: str | None = None
    description: str = ""
    # distribution engines: the chi-square test (distribution.Outcome.as_json())
    distribution: dict | None = None


@dataclass
class Report:
    model: str
    prompts: int
    settings: dict
    engines: list = field(default_factory=list)
    reference_seconds: float = 0.0
    interrupted: bool = False

    def as_json(self) -> dict:
        keys = ("name", "expected_correct", "tokens_per_s", "speedup_vs_standard", "acceptance",
                "exact_match", "near_ties", "desyncs", "violations", "first_violation")
        return {"model": self.model, "prompts": self.prompts, "settings": self.settings,
                "interrupted": self.interrupted,
                "engines": [{**{k: getattr(e, k) for k in keys},
                             **{k: v for k, v in asdict(e).items() if k not in keys}}
                            for e in self.engines]}

    def table(self) -> str:
        head = (f"{'engine':<22} {'ok?':<4} {'tok/s':>7} {'speedup':>7} {'accept':>6} "
                f"{'exact':>6} {'ties':>4} {'desync':>6} {'overrun':>7} {'viol':>5}  first violation")
        lines = [head, "-" * (len(head) + 18)]
        for e in self.engines:
            if e.distribution is not None or (e.error and e.name in distribution_names()):
                continue
            fv = e.first_violation
            first = f"{fv['invariant']} step {fv['step']} {fv['phase']}" if fv else "-"
            if e.error:
                first = f"error: {e.error[:40]}"
            acc = f"{e.acceptance:.2f}" if e.acceptance is not None else "-"
            sp = f"{e.speedup_vs_standard:.2f}x" if e.speedup_vs_standard is not None else "-"
            lines.append(f"{e.name:<22} {'yes' if e.expected_correct else 'BAD':<4} "
                         f"{e.tokens_per_s:>7.1f} {sp:>7} {acc:>6} {e.exact_match * 100:>5.0f}% "
                         f"{e.near_ties:>4} {e.desyncs:>6} {e.overruns:>7} {e.violations:>5}  {first}")
        lines += self.distribution_table()
        samples = [e for e in self.engines if e.sample]
        if samples:
            lines.append("")
            lines.append("samples of corrupted text (reference | engine, from the first divergence):")
            for e in samples:
                lines.append(f"  {e.name}: {e.sample}")
        return "\n".join(lines)

    def distribution_table(self) -> list[str]:
        """The distribution tests, one line each (empty when none ran)."""
        from .distribution import ALPHA, Config

        rows = [e for e in self.engines if e.name in distribution_names()]
        if not rows:
            return []
        c = Config()
        lines = ["", f"distribution tests (rejection sampling; tiny {c.family}, vocabulary {c.vocab}, "
                     f"{c.samples} samples of {c.new_tokens} tokens, k={c.k}, draft model; "
                     f"pass: p >= {ALPHA:g}):",
                 f"{'engine':<22} {'ok?':<4} {'p-value':>9} {'chi2':>9} {'df':>4} {'accept':>6} "
                 f"{'viol':>5}  verdict"]
        for e in rows:
            d = e.distribution
            if d is None:
                lines.append(f"{e.name:<22} {'yes' if e.expected_correct else 'BAD':<4} error: {e.error}")
                continue
            verdict = "pass" if d["passed"] else "FAIL"
            lines.append(f"{e.name:<22} {'yes' if e.expected_correct else 'BAD':<4} "
                         f"{d['p_value']:>9.3g} {d['statistic']:>9.1f} {d['df']:>4} "
                         f"{d['acceptance']:>6.2f} {e.violations:>5}  {verdict}")
        return lines

    def header(self) -> str:
        s = self.settings
        smp = s.get("sampling")
        return (f"model {self.model}, {self.prompts} prompts, batch {s['batch_size']}, "
                f"k={s['k']}, {s['max_new_tokens']} new tokens, drafter {s['drafter']}"
                + (f"; sampling engines: temperature {smp['temperature']}, top-k {smp['top_k']}, "
                   f"top-p {smp['top_p']}, seed {smp['seed']}" if smp else "")
                + (" (interrupted: partial report)" if self.interrupted else ""))

    def write(self, out) -> None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(self.as_json(), indent=2))
        md = [f"# specdec audit\n", self.header() + "\n", "```", self.table(), "```", ""]
        md.append("Near-ties: divergences where the batch-1 reference's top-2 logit margin is "
                  "below the tolerance (numerics, not bugs). Overruns: output exact up to the "
                  "reference's stop token, then more tokens. Desyncs: all other divergences.\n")
        md.append("![throughput vs exact match](exactness.png)\n\n![phase shares](phases.png)\n")
        (out / "report.md").write_text("\n".join(md))
        _plots(self, out)


def _plots(report: Report, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for e in report.engines:
        if e.name in distribution_names():  # judged by a p-value, not by exact match
            continue
        mark, color = ("o", "tab:green") if e.expected_correct else ("x", "tab:red")
        ax.scatter(e.tokens_per_s, e.exact_match * 100, marker=mark, color=color, s=60)
        ax.annotate(e.name, (e.tokens_per_s, e.exact_match * 100), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    ax.scatter([], [], marker="o", color="tab:green", label="correct engines")
    ax.scatter([], [], marker="x", color="tab:red", label="known-bad reproductions")
    ax.set_xlabel("tokens / s")
    ax.set_ylabel("exact match vs batch-1 greedy (%)")
    ax.set_ylim(-5, 105)
    save(fig, ax, out / "exactness.png", title="Throughput vs exactness", legend_size=8)

    rows = [e for e in report.engines if e.phase_shares]
    stacked_phase_shares(out / "phases.png", [e.name for e in rows], [e.phase_shares for e in rows],
                         ("prefill", "draft", "verify", "commit", "realign", "checks"),
                         ylabel="share of engine time", width_per_bar=0.8, min_width=6,
                         label_size=7, rotation=30)


def _classify(seqs, reference, margins, tolerance):
    exact = near = desync = overrun = 0
    first_bad = None
    for row, (got, want) in enumerate(zip(seqs, reference)):
        if got == want:
            exact += 1
            continue
        if len(got) > len(want) and got[: len(want)] == want:
            overrun += 1  # exact up to the reference's end (a stop token), then more tokens
            if first_bad is None:
                first_bad = (row, len(want) - 1)
            continue
        j = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        margin = margins[row][j] if j < len(margins[row]) else None
        if margin is not None and margin < tolerance:
            near += 1
        else:
            desync += 1
            if first_bad is None:
                first_bad = (row, j)
    return exact, near, desync, overrun, first_bad


def _sample(tokenizer, seqs, reference, first_bad, width: int = 60) -> str | None:
    if first_bad is None:
        return None
    row, j = first_bad
    dec = (lambda ids: tokenizer.decode(ids, skip_special_tokens=False)) if tokenizer else str
    ref_txt = dec(reference[row][j : j + 12]).replace("\n", "\\n")[:width]
    got_txt = dec(seqs[row][j : j + 12]).replace("\n", "\\n")[:width]
    return f"prompt {row}, token {j}: {ref_txt!r} | {got_txt!r}"


def run_audit(target, tokenizer, ids, *, model_name="model", engines=None, batch_size=8, k=4,
              max_new_tokens=32, drafter_factory=None, drafter_name="ngram", progress=None,
              report: Report | None = None, sampling=None) -> Report:
    """Run every engine in ``engines`` on ``ids``; fills and returns ``report``.
    ``sampling``: the parameters of the sampling engines (``specdec.Sampling``; its mode
    is set per engine; default ``Sampling()``)."""
    import invariants

    from .. import drafters, engine, reference
    from .known_bad import KNOWN_BAD, generate_known_bad

    engines = check_engines(list(engines or engine_names()))
    drafter_factory = drafter_factory or drafters.NGramDrafter
    sampling = sampling or Sampling()
    coupled = dataclasses.replace(sampling, mode="coupled")
    if report is None:
        report = Report(model_name, len(ids), {"batch_size": batch_size, "k": k,
                                               "max_new_tokens": max_new_tokens,
                                               "drafter": drafter_name})
    if any(e.startswith("coupled:") or e in distribution_names() for e in engines):
        report.settings["sampling"] = {n: v for n, v in sampling.as_dict().items() if n != "mode"}
    if any(e.startswith("coupled:") for e in engines):  # the reference of coupled engines
        coupled_ref, coupled_margins = reference.reference_generate(
            target, ids, max_new_tokens=max_new_tokens, batch_size=1, return_margins=True,
            sampling=coupled)
    tol = invariants.DEFAULT_TOLERANCE
    t0 = time.perf_counter()
    ref, margins = reference.reference_generate(target, ids, max_new_tokens=max_new_tokens,
                                                batch_size=1, return_margins=True)
    report.reference_seconds = time.perf_counter() - t0
    if progress:
        progress(1)
    standard_tps = None
    for name in engines:
        correct = name in correct_names()
        rep = EngineReport(name=name, expected_correct=correct,
                           description=KNOWN_BAD.get(name, FAULTS[name].description
                                                     if name in FAULTS else "correct engine"))
        if name in distribution_names():
            _distribution_engine(rep, name, sampling, model_name)
            report.engines.append(rep)
            if progress:
                progress(1)
            continue
        mode, _, strategy = name.rpartition(":")  # "coupled:<strategy>" or a plain name
        run_sampling = coupled if mode == "coupled" else None
        mon = invariants.Monitor(mode="strict", raise_on_violation=correct,
                                 run={"engine": name, "model": model_name})
        stats = None
        t0 = time.perf_counter()
        try:
            if name == "standard":
                seqs = reference.reference_generate(target, ids, max_new_tokens=max_new_tokens,
                                                    batch_size=batch_size)
            elif correct:
                res = engine.generate(target, ids, drafter=drafter_factory(), strategy=strategy,
                                      k=k, batch_size=batch_size, max_new_tokens=max_new_tokens,
                                      hooks=[mon], sampling=run_sampling)
                seqs, stats = res.sequences, res.stats
            else:
                seqs, stats = generate_known_bad(name, target, ids, drafter=drafter_factory(), k=k,
                                                 max_new_tokens=max_new_tokens, hooks=[mon],
                                                 batch_size=batch_size)
            mon.check()
        except invariants.InvariantViolation as v:  # a correct engine broke an invariant
            if v not in mon.violations:
                mon.violations.append(v)
            seqs = [[] for _ in ids]
            rep.error = f"stopped by {v.invariant} at step {v.step}, {v.phase}"
        rep.seconds = time.perf_counter() - t0
        rep.tokens = sum(len(s) for s in seqs)
        rep.tokens_per_s = rep.tokens / rep.seconds if rep.seconds else 0.0
        if name == "standard":
            standard_tps = rep.tokens_per_s
        if standard_tps:
            rep.speedup_vs_standard = rep.tokens_per_s / standard_tps
        if stats is not None:
            rep.acceptance = stats.acceptance
            rep.phase_shares = phase_shares(stats.seconds)
        want, marg = (coupled_ref, coupled_margins) if run_sampling is not None else (ref, margins)
        exact, near, desync, overrun, first_bad = _classify(seqs, want, marg, tol)
        rep.exact_match = exact / len(ids)
        rep.near_ties, rep.desyncs, rep.overruns = near, desync, overrun
        rep.violations = len(mon.violations)
        if mon.violations:
            v = mon.violations[0]
            rep.first_violation = {"invariant": v.invariant, "step": v.step, "phase": v.phase,
                                   "rows": list(v.rows), "rule": (v.rules or [""])[0]}
        rep.sample = _sample(tokenizer, seqs, want, first_bad)
        report.engines.append(rep)
        if progress:
            progress(1)
    return report


def _distribution_engine(rep: EngineReport, name: str, sampling, model_name: str) -> None:
    """Fill ``rep`` with the distribution test of engine ``name`` (rejection sampling)."""
    import invariants

    from . import distribution

    fault = name if name in FAULTS else None
    strategy = name.partition(":")[2] if fault is None else "eqspec"
    mon = invariants.Monitor(mode="strict", raise_on_violation=rep.expected_correct,
                             run={"engine": name, "model": "distribution test"})
    try:
        out = distribution.run(dataclasses.replace(sampling, mode="rejection"), drafter="model",
                               strategy=strategy, fault=fault, hooks=[mon], engine=name)
        mon.check()
    except invariants.InvariantViolation as v:
        if v not in mon.violations:
            mon.violations.append(v)
        rep.error = f"stopped by {v.invariant} at step {v.step}, {v.phase}"
        out = None
    rep.violations = len(mon.violations)
    if mon.violations:
        v = mon.violations[0]
        rep.first_violation = {"invariant": v.invariant, "step": v.step, "phase": v.phase,
                               "rows": list(v.rows)[:8], "rule": (v.rules or [""])[0]}
    if out is not None:
        rep.distribution = out.as_json()
        rep.seconds, rep.acceptance = out.seconds, out.acceptance
        rep.tokens = out.samples * distribution.Config().new_tokens
        rep.tokens_per_s = rep.tokens / out.seconds if out.seconds else 0.0
