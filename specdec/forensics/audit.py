"""``specdec audit``: which batched decoding engines stay exact, and where the others break.

On one model and one prompt set it runs batched standard decoding, Hugging Face's batched
``generate`` (left padding), every registered speculative strategy
(``specdec.strategies.names()``) and every known-bad reproduction
(``known_bad.KNOWN_BAD``), interleaved batch by batch (round-robin: every engine decodes a
batch before any decodes the next), so that the speed column compares engines under the
same machine noise; the spread of the per-batch speedups is reported next to it. Correct
speculative engines run under a strict Monitor (a violation stops that engine and is
reported); known-bad ones under a recording Monitor, so their whole output is seen. Every
engine's ids are judged by the output oracle ``invariants.compare_outputs`` against
batch-1 greedy decoding, calibrated by default (``tolerance=None``: a divergence is a
near-tie only when both tokens lie within the spread the model's own dtype produces at
that prefix, measured in the engine's batch shape among others; a number gives the
absolute rule). Overruns (output exact up to the reference's stop token, then more
tokens) are counted apart from the other desyncs. The report states the dtype, the rule
and the draft-length policy, and keeps every near-tie's and desync's evidence (margin,
gaps, spread, in logits and in ulps) in report.json. The policy (``POLICY`` by default)
learns on each engine's own calibration, kept across that engine's batches: no engine
plans from what the engines before it learned on the same batch.

Sampling engines. ``coupled:<strategy>``: the strategy with coupled sampling (the
audit's ``sampling``, mode coupled) on the same model, prompts, drafter and policy,
interleaved with the others, under a strict Monitor, judged by the same oracle against
batch-1 plain coupled sampling (``compare_outputs(sampling=)``: the oracle judges the
coupled scores; request indices as in the engine's own call, one per batch).
``rejection:<strategy>``: the strategy with speculative rejection sampling, whose output
equals no reference: a distribution test on a tiny model (``distribution.run``: tiny
Llama with vocabulary 8 and its draft model, chi-square against the exact distribution of
3-token continuations), run once after the interleaved batches and reported with its
p-value; it passes when ``p >= distribution.ALPHA``. The known-bad sampling engines
(``sampling_faults.FAULTS``: (g), (h), (i)) run the same distribution test with their
fault, and should fail it.

Coverage. Every engine with step hooks also runs an ``invariants.Coverage`` next to its
Monitor, over all its batches: report.json gives each one ``"triggers": {name: count}``
(a step that accepted every draft, a rejected draft, a stop token reached, rows finishing
at different steps, a realignment with differing lengths, a row drop, a compaction). A
known-bad engine whose defect's trigger (``known_bad.TRIGGER``) never occurred, and whose
defect did not show anyway, gets ``"exercised": false`` and prints "not exercised" in
place of its first violation: its clean columns say nothing about the defect.

The report (``Report``) prints as a table; ``write(dir)`` saves report.md, report.json and
two PNG figures. An interrupt (Ctrl-C) keeps the batches every engine finished.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .. import policy as policy_mod
from .. import strategies
from ..sampling import Sampling
from .plots import phase_shares, save, stacked_phase_shares

#: the audit's draft-length policy: adaptive, drafting in a batch's tail by the same 5%
#: margin as while requests wait (``specdec.policy``: the default's ``DRAIN_MARGIN``,
#: 0.4, makes a call of one batch of prompts that quote little draft nothing, and an
#: audit must exercise its engines' speculation)
POLICY = "adaptive:drain_margin=0.05"

#: engines that are no speculative loop (one token per row per forward, no Monitor)
PLAIN = ("standard", "hf_generate")


def correct_names() -> tuple[str, ...]:
    """The engines expected to be exact (batched standard decoding, Hugging Face's batched
    ``generate``, every strategy, every strategy with coupled sampling) or lossless in
    distribution (every strategy with rejection sampling)."""
    names = strategies.names()
    return (PLAIN + names + tuple(f"coupled:{n}" for n in names)
            + tuple(f"rejection:{n}" for n in names))


def engine_names() -> tuple[str, ...]:
    from .known_bad import KNOWN_BAD
    from .sampling_faults import NAMES

    return correct_names() + tuple(KNOWN_BAD) + NAMES


def distribution_names() -> tuple[str, ...]:
    """The engines judged by the distribution test (see the module docstring)."""
    from .sampling_faults import NAMES

    return tuple(f"rejection:{n}" for n in strategies.names()) + NAMES


def description(name: str) -> str:
    """What an engine is: "correct engine", or the known-bad reproduction's fault."""
    from .known_bad import KNOWN_BAD
    from .sampling_faults import FAULTS

    if name in KNOWN_BAD:
        return KNOWN_BAD[name]
    return FAULTS[name].description if name in FAULTS else "correct engine"


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
    # per batch (engines interleaved batch by batch): tokens/s, and the range of the
    # per-batch speedups over standard decoding of the same batch
    batch_tokens_per_s: list | None = None
    speedup_spread: list | None = None
    phase_shares: dict | None = None
    error: str | None = None
    description: str = ""
    oracle_seconds: float = 0.0
    divergences: list = field(default_factory=list)  # per diverging row: its evidence
    # distribution engines: the chi-square test (distribution.Outcome.as_json())
    distribution: dict | None = None
    # engines with step hooks: how often each coverage trigger occurred over all batches
    # (invariants.coverage.TRIGGERS); None for standard decoding, HF and distribution tests
    triggers: dict | None = None
    # known-bad engines: the trigger their defect needs (known_bad.TRIGGER), and whether
    # the run exercised it (it occurred, or the defect showed anyway: violations or
    # divergences). Not exercised: the run says nothing about the defect, never "clean"
    trigger: str | None = None
    exercised: bool | None = None


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
        head = (f"{'engine':<22} {'ok?':<4} {'tok/s':>7} {'speedup':>7} {'spread':>10} {'accept':>6} "
                f"{'exact':>6} {'ties':>4} {'desync':>6} {'overrun':>7} {'viol':>5}  first violation")
        lines = [head, "-" * (len(head) + 18)]
        for e in self.engines:
            if e.distribution is not None or (e.error and e.name in distribution_names()):
                continue
            fv = e.first_violation
            first = f"{fv['invariant']} step {fv['step']} {fv['phase']}" if fv else "-"
            if e.exercised is False:
                first = f"not exercised (no {e.trigger} in this run)"
            if e.error:
                first = f"error: {e.error[:40]}"
            acc = f"{e.acceptance:.2f}" if e.acceptance is not None else "-"
            sp = f"{e.speedup_vs_standard:.2f}x" if e.speedup_vs_standard is not None else "-"
            spread = f"{e.speedup_spread[0]:.2f}-{e.speedup_spread[1]:.2f}" if e.speedup_spread else "-"
            lines.append(f"{e.name:<22} {'yes' if e.expected_correct else 'BAD':<4} "
                         f"{e.tokens_per_s:>7.1f} {sp:>7} {spread:>10} {acc:>6} {e.exact_match * 100:>5.0f}% "
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
                     f"{c.samples} samples of {c.new_tokens} tokens, k={c.k}, draft model, "
                     f"fixed policy; pass: p >= {ALPHA:g}):",
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
        return (f"model {self.model} ({s.get('dtype', 'float32')}), {self.prompts} prompts, "
                f"batch {s['batch_size']}, k={s['k']}, {s['max_new_tokens']} new tokens, "
                f"drafter {s['drafter']}"
                + (f", policy {s['policy']}" if s.get("policy") else "")
                + (f"; sampling engines: temperature {smp['temperature']}, top-k {smp['top_k']}, "
                   f"top-p {smp['top_p']}, seed {smp['seed']}" if smp else "")
                + (" (interrupted: partial report)" if self.interrupted else "")
                + (f"\noracle: {s['oracle']}" if s.get("oracle") else ""))

    def write(self, out) -> None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(self.as_json(), indent=2))
        md = [f"# specdec audit\n", self.header() + "\n", "```", self.table(), "```", ""]
        md.append("Engines ran interleaved batch by batch; speedup: tokens/s over standard "
                  "decoding's, spread: the range of the per-batch speedups. "
                  "Near-ties: rows whose every divergence is a numerical near-tie under the "
                  "oracle's rule above (numerics, not bugs; the rest of a row after a near-tie "
                  "is checked against a reference re-decoded from the row's own prefix). "
                  "Overruns: output that runs on where the reference stopped. Desyncs: all "
                  "other divergences. report.json keeps each row's evidence. A known-bad "
                  "engine marked \"not exercised\" never met the situation its defect needs "
                  "(its trigger; report.json: \"triggers\" per engine): its clean columns "
                  "say nothing about the defect.\n")
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


def _classify(comparison):
    """(equal, near-tie, desync, overrun) row counts, the first desync (row, index) and
    every diverging row's evidence, from an ``invariants.Comparison``."""
    exact = near = desync = overrun = 0
    first_bad, evidence = None, []
    for row in comparison.rows:
        if row.equal:
            exact += 1
            continue
        evidence.append({"row": row.row, "classification": row.classification,
                         "divergences": [d.as_dict() for d in row.divergences]})
        bad = row.desync
        if bad is None:
            near += 1
            continue
        if bad.expected is None and bad.actual is not None:
            overrun += 1  # the output runs on where the reference had stopped
        else:
            desync += 1
        if first_bad is None:
            first_bad = (row.row, bad.index)
    return exact, near, desync, overrun, first_bad, evidence


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
              report: Report | None = None, tolerance: float | None = None,
              policy=POLICY, sampling=None, reference_ids=None) -> Report:
    """Run every engine in ``engines`` on ``ids``; fills and returns ``report``.
    ``tolerance``: the oracle's rule (None: calibrated; see ``invariants.equivalence``).
    ``reference_ids``: the target's batch-1 greedy ids of every prompt, exactly what
    ``specdec.reference_generate(target, ids, max_new_tokens=max_new_tokens)`` returns,
    when the caller already computed them (a scripted drafter built on them, say): the
    audit then judges against them instead of decoding the reference again
    (``reference_seconds`` is then 0); None computes them here.
    ``sampling``: the parameters of the sampling engines (``specdec.Sampling``; its mode
    is set per engine; default ``Sampling()``).

    The engines are interleaved batch by batch (round-robin, the order rotating from one
    batch to the next): every engine decodes the first ``batch_size`` prompts, then every
    engine the next ones, and so on, so their speeds are taken under the same machine
    noise. An engine's tokens/s is over all its batches; ``speedup_spread`` is the range
    of its per-batch speedups over standard decoding of the same batch. A correct engine
    stopped by a violation sits out the remaining batches. The distribution engines run
    once each, after the batches."""
    import invariants
    from invariants.equivalence import rule_text

    from .. import drafters, reference

    engines = check_engines(list(engines or engine_names()))
    drafter_factory = drafter_factory or drafters.NGramDrafter
    if report is None:
        report = Report(model_name, len(ids), {"batch_size": batch_size, "k": k,
                                               "max_new_tokens": max_new_tokens,
                                               "drafter": drafter_name})
    report.settings["dtype"] = str(next(target.parameters()).dtype).replace("torch.", "")
    report.settings["oracle"] = rule_text(tolerance)
    report.settings.setdefault("policy", policy if isinstance(policy, str) else type(policy).__name__)
    sampling = sampling or Sampling()
    coupled = dataclasses.replace(sampling, mode="coupled")
    if any(e.startswith("coupled:") or e in distribution_names() for e in engines):
        report.settings["sampling"] = {n: v for n, v in sampling.as_dict().items() if n != "mode"}
    batches = [list(range(s, min(s + batch_size, len(ids)))) for s in range(0, len(ids), batch_size)]
    # request index of each prompt in its engine call (one call per batch: 0 .. b-1)
    requests = [r - rows[0] for rows in batches for r in rows]
    t0 = time.perf_counter()
    ref = _given_reference(reference_ids, ids, max_new_tokens) if reference_ids is not None \
        else reference.reference_generate(target, ids, max_new_tokens=max_new_tokens, batch_size=1)
    report.reference_seconds = time.perf_counter() - t0 if reference_ids is None else 0.0
    coupled_ref = None
    if any(e.startswith("coupled:") for e in engines):  # the reference of coupled engines
        coupled_ref = [seq for rows in batches for seq in reference.reference_generate(
            target, [ids[r] for r in rows], max_new_tokens=max_new_tokens, batch_size=1,
            sampling=coupled)]
    if progress:
        progress(1)
    interleaved = [e for e in engines if e not in distribution_names()]
    runs = {name: _EngineRun(name, len(ids)) for name in interleaved}
    done = 0  # batches every engine ran
    try:
        for index, rows in enumerate(batches):
            shift = index % max(len(interleaved), 1)
            for name in interleaved[shift:] + interleaved[:shift]:
                runs[name].run_batch(target, [ids[r] for r in rows], rows, batch_size=batch_size,
                                     k=k, max_new_tokens=max_new_tokens,
                                     drafter_factory=drafter_factory, model_name=model_name,
                                     policy=policy, sampling=coupled)
                if progress:  # once per engine and batch
                    progress(1)
            done += 1
    except KeyboardInterrupt:  # report the batches every engine finished
        report.interrupted = True
        for run in runs.values():
            run.keep(done)
        covered = sum(len(rows) for rows in batches[:done])
        ids, ref = ids[:covered], ref[:covered]
        requests = requests[:covered]
        coupled_ref = coupled_ref[:covered] if coupled_ref is not None else None
        report.prompts = covered
    standard = runs.get("standard")
    for name in engines:
        if name in distribution_names():
            rep = EngineReport(name=name, expected_correct=name in correct_names(),
                               description=description(name))
            if not report.interrupted:
                _distribution_engine(rep, name, sampling, model_name)
                if progress:
                    progress(1)
            report.engines.append(rep)
            continue
        run = runs[name]
        rep = run.report
        rep.seconds = sum(run.batch_seconds)
        rep.tokens = sum(run.batch_tokens)
        rep.tokens_per_s = rep.tokens / rep.seconds if rep.seconds else 0.0
        rep.batch_tokens_per_s = [t / s if s else 0.0 for t, s in zip(run.batch_tokens, run.batch_seconds)]
        if standard is not None and standard.report.tokens_per_s:
            std = standard.batch_tokens
            rep.speedup_vs_standard = rep.tokens_per_s / (sum(std) / sum(standard.batch_seconds))
            per = [(t / s) / (st / ss) for t, s, st, ss in zip(run.batch_tokens, run.batch_seconds,
                                                               std, standard.batch_seconds)
                   if s and ss and st]
            rep.speedup_spread = [min(per), max(per)] if per else None
        if run.stats:
            drafted = sum(st.drafted for st in run.stats)
            rep.acceptance = sum(st.accepted for st in run.stats) / drafted if drafted else 0.0
            rep.phase_shares = phase_shares({p: sum(st.seconds[p] for st in run.stats)
                                             for p in run.stats[0].seconds})
        seqs = run.seqs[: len(ids)]
        run_sampling = coupled if name.startswith("coupled:") else None
        t0 = time.perf_counter()
        comparison = invariants.compare_outputs(
            target, ids, seqs, ref if run_sampling is None else coupled_ref,
            max_new_tokens=max_new_tokens, tolerance=tolerance, batch_size=batch_size,
            chunk=1 if name in PLAIN else k + 1, sampling=run_sampling,
            requests=requests if run_sampling is not None else None)
        rep.oracle_seconds = time.perf_counter() - t0
        exact, near, desync, overrun, first_bad, rep.divergences = _classify(comparison)
        rep.exact_match = exact / len(ids)
        rep.near_ties, rep.desyncs, rep.overruns = near, desync, overrun
        rep.violations = len(run.violations)
        if run.violations:
            v = run.violations[0]
            rep.first_violation = {"invariant": v.invariant, "step": v.step, "phase": v.phase,
                                   "rows": list(v.rows), "rule": (v.rules or [""])[0]}
        rep.sample = _sample(tokenizer, seqs, ref if run_sampling is None else coupled_ref,
                             first_bad)
        _coverage(rep, run)
        report.engines.append(rep)
    return report


def _coverage(rep: EngineReport, run: "_EngineRun") -> None:
    """The triggers the engine's batches exercised and, for a known-bad engine, whether
    they exercised its defect (see ``EngineReport.exercised``)."""
    from .known_bad import TRIGGER

    if run.coverage is None:
        return
    rep.triggers = run.coverage.counts()
    if rep.name in TRIGGER:
        rep.trigger = TRIGGER[rep.name]
        showed = rep.violations + rep.desyncs + rep.overruns > 0
        rep.exercised = rep.triggers[rep.trigger] > 0 or showed


def _given_reference(reference_ids, ids, max_new_tokens: int) -> list:
    """A caller's reference ids, checked for their shape: one list of at most
    ``max_new_tokens`` ids per prompt."""
    ref = [list(r) for r in reference_ids]
    if len(ref) != len(ids):
        raise ValueError(f"reference_ids must hold one row per prompt: {len(ref)} rows for "
                         f"{len(ids)} prompts")
    long = [i for i, r in enumerate(ref) if len(r) > max_new_tokens]
    if long:
        raise ValueError(f"reference_ids are generated ids only, at most max_new_tokens="
                         f"{max_new_tokens} per row; rows {long[:8]} are longer")
    return ref


def _distribution_engine(rep: EngineReport, name: str, sampling, model_name: str) -> None:
    """Fill ``rep`` with the distribution test of engine ``name`` (rejection sampling)."""
    import invariants

    from . import distribution
    from .sampling_faults import FAULTS

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


class _EngineRun:
    """One engine's batches in an interleaved audit: outputs in prompt order, per-batch
    tokens and seconds, stats, violations."""

    def __init__(self, name: str, count: int):
        self.name, self.correct = name, name in correct_names()
        self.report = EngineReport(name=name, expected_correct=self.correct,
                                   description=description(name))
        self.seqs = [[] for _ in range(count)]
        self.batch_tokens, self.batch_seconds = [], []
        self.stats, self.violations = [], []
        self.stopped = False
        # the triggers its views exercised over every batch (engines with hooks only)
        self.coverage = None
        self.calibration = None  # what its adaptive policy learns, over its batches

    def policy(self, policy):
        """The policy of one of this engine's calls: a policy string is resolved on this
        engine's own calibration (``policy.resolve``; kept across its batches, as
        ``"adaptive"`` keeps the model's), so that no engine plans from what the engines
        before it learned on the same batch; a policy object is used as given."""
        if not isinstance(policy, str):
            return policy
        if self.calibration is None:
            self.calibration = policy_mod.Calibration()
        return policy_mod.resolve(policy, calibration=self.calibration)

    def run_batch(self, target, prompts, rows, *, batch_size, k, max_new_tokens, drafter_factory,
                  model_name, policy, sampling=None) -> None:
        """Decode one batch (``sampling``: the coupled parameters ``coupled:*`` engines use)."""
        import invariants

        from .. import engine, reference
        from .known_bad import generate_known_bad

        if self.stopped:
            return
        mon = invariants.Monitor(mode="strict", raise_on_violation=self.correct,
                                 run={"engine": self.name, "model": model_name})
        if self.name not in PLAIN and self.coverage is None:
            self.coverage = invariants.Coverage()
        hooks = [mon, self.coverage] if self.coverage is not None else [mon]
        stats = None
        t0 = time.perf_counter()
        try:
            if self.name == "standard":
                seqs = reference.reference_generate(target, prompts, max_new_tokens=max_new_tokens,
                                                    batch_size=batch_size)
            elif self.name == "hf_generate":
                seqs = reference.hf_generate(target, prompts, max_new_tokens=max_new_tokens,
                                             batch_size=batch_size)
            elif self.correct:
                mode, _, strategy = self.name.rpartition(":")  # "coupled:<strategy>" or a strategy
                res = engine.generate(target, prompts, drafter=drafter_factory(), strategy=strategy,
                                      k=k, batch_size=batch_size, max_new_tokens=max_new_tokens,
                                      hooks=hooks, policy=self.policy(policy),
                                      sampling=sampling if mode == "coupled" else None)
                seqs, stats = res.sequences, res.stats
            else:
                seqs, stats = generate_known_bad(self.name, target, prompts, drafter=drafter_factory(),
                                                 k=k, max_new_tokens=max_new_tokens, hooks=hooks,
                                                 batch_size=batch_size)
            mon.check()
        except invariants.InvariantViolation as v:  # a correct engine broke an invariant
            if v not in mon.violations:
                mon.violations.append(v)
            seqs = [[] for _ in prompts]
            self.report.error = f"stopped by {v.invariant} at step {v.step}, {v.phase}"
            self.stopped = True
        self.batch_seconds.append(time.perf_counter() - t0)
        self.batch_tokens.append(sum(len(x) for x in seqs))
        for r, seq in zip(rows, seqs):
            self.seqs[r] = seq
        if stats is not None:
            self.stats.append(stats)
        self.violations.extend(mon.violations)

    def keep(self, batches: int) -> None:
        """Forget every batch after the first ``batches`` (an interrupted audit)."""
        self.batch_tokens, self.batch_seconds = self.batch_tokens[:batches], self.batch_seconds[:batches]
        self.stats = self.stats[:batches]
