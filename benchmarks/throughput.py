"""Side-by-side throughput of batched standard decoding, every speculative strategy and
draft-length policy, and Hugging Face's prompt-lookup decoding.

Every configuration runs in one process on the same prompts, interleaved: each repeat runs
every prompt kind, and for each kind every configuration in turn (the order rotates from
one repeat to the next), so ratios are taken under the same machine noise. A ratio is
taken within one repeat and one kind (configuration over batched standard decoding at the
same batch size), then the median over repeats is reported, with its spread (min-max).

Prints, per prompt kind and configuration: tokens/s, the ratio to standard decoding,
acceptance (accepted / usable drafts) and the mean draft length k_b; then, per
configuration over all kinds: tokens/s, decode tokens/s (prefill excluded), the ratio
(geometric mean over kinds of the per-kind ratios, and the lowest kind), acceptance, mean
k_b, share of decode time per phase and the exact-match rate against batch-1 greedy
decoding, with the rows the output oracle ``invariants.compare_outputs`` judges
numerical near-ties or desyncs under its calibrated rule, measured in the configuration's
batch shape (the oracle's time is not part of any figure); then, per batch size, the best strategy (highest geometric mean of tokens/s
over the drafters) and its realign share next to EQSPEC's own. Writes JSON and PNG plots
to --out.

    python benchmarks/throughput.py                      # real model, n-gram drafter
    python benchmarks/throughput.py --prompts 48 --batch-sizes 8 --policies adaptive fixed
    python benchmarks/throughput.py --prompts questions.jsonl --repeats 3
    python benchmarks/throughput.py --batch-sizes 1 --hf-lookup 10 --prompts 48 --kinds translation
    python benchmarks/throughput.py --model tiny:llama --draft-model tiny-draft:llama
    python benchmarks/throughput.py --drafters ngram scripted:0.6 scripted:0.9 \
        --batch-sizes 1 2 4 8 16 --strategies eqspec exspec holes
    python benchmarks/throughput.py --strategies holes:0 holes:0.25 holes:0.5 holes:1 exspec:32
    python benchmarks/throughput.py --dtype bfloat16     # models cast to bf16 (or float16)
    python benchmarks/throughput.py --batch-sizes 8 --compile inductor   # compiled twins
    python benchmarks/throughput.py --model llama-7b-random --dtype bfloat16 --device cuda \
        --prompts 8 --prompt-tokens 64 256 --max-new-tokens 32 --batch-sizes 8 \
        --drafters scripted:0.9 --script-from batched --policies fixed

Every run also decodes with Hugging Face's own batched ``generate`` (greedy, left-padded,
``hf-generate``) at each batch size, next to the project's plain loop (``standard``).
``--model llama-1b-random|llama-7b-random``: random-weight Llama shapes
(``specdec.models.RANDOM_LLAMAS``), built on ``--device``; a model without a tokenizer
takes random prompts (``--prompt-tokens LO HI``: their lengths). ``--script-from
batched``: scripted drafts corrupt the plain loop's batched output at the row's batch size
rather than batch-1 decoding (in bf16 the two part early, and drafts from batch-1 are
rejected far more than their nominal rate). ``--compile MODE`` (``inductor``,
``cuda-graphs``): every standard and speculative configuration also runs compiled
(``specdec.compiled``; engine names get ``+MODE``), warmed up before any timing.
``--static-shapes``: every standard and speculative configuration (compiled twins
included) also runs with static shapes (``specdec/static.py``; names get ``+static``).

Honest stats: every timed run's ``Stats`` must add up against its outputs
(``Stats.conservation``: committed = total output length, each row commits 1 to
accepted + 1 tokens per step, accepted <= drafted <= planned); and once per configuration
and kind (first repeat) an untimed run under a fast Monitor must have counters equal to the
sums over the views it saw (``Monitor.check_stats``). If any rule breaks, the benchmark
prints why on stderr, prints no figure, writes nothing and exits with status 2. The
checked run is extra work, not part of any figure.

``--prompts`` takes a count of built-in prompts (``specdec.prompts.builtin_prompts``) or a
JSONL file in any format of ``specdec.prompts.load_jsonl`` (SpecBench's
``{"question_id", "category", "turns"}`` included: the category is the kind). A strategy
(a name of ``specdec.strategies.names()``) may carry a value of its first option after a
colon: ``holes:H`` (hole_threshold H) and ``exspec:N`` (window N). ``--policies``: the
draft-length policies (``specdec.policy``) each strategy runs with. ``--hf-lookup N``
adds Hugging Face ``generate(prompt_lookup_num_tokens=N)`` (greedy; one prompt at a time,
as HF runs it) at batch size 1. The group column is exspec's group rate.

Decoding modes (``--modes greedy coupled rejection``), a dimension of the configurations
like the batch size: greedy, and sampling with ``--temperature --top-k --top-p --seed`` in
coupled or rejection mode. Each mode has its own standard configuration (plain decoding in
that mode, batched), which its ratios ("vs std") are taken against; "vs grd" is the ratio
to plain greedy decoding at the same batch size (when greedy runs too). Engines of a
sampling mode are named ``ENGINE@MODE``. Exact match and the oracle: against batch-1
greedy decoding (greedy) or batch-1 plain coupled sampling, request indices as in the
configuration's own call (coupled); rejection sampling has no reference ("-"; its
distribution is tested by ``specdec.forensics.distribution``). The realign summary is over
the configurations of the first mode given.

    python benchmarks/throughput.py --modes greedy coupled rejection --temperature 0.7 \
        --top-k 50 --top-p 0.95 --batch-sizes 8 --drafters ngram scripted:0.6
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import specdec  # noqa: E402
from invariants.equivalence import DEFAULT_TOLERANCE, compare_outputs, rule_text  # noqa: E402
from specdec import Sampling, compiled, drafters, graphs, engine, models, prompts, strategies  # noqa: E402
from specdec import policy as policies  # noqa: E402
from specdec.reference import hf_generate  # noqa: E402
from specdec.forensics.plots import phase_shares as shares_of, save, stacked_phase_shares  # noqa: E402

#: the phases of decode time (prefill aside)
DECODE_PHASES = ("draft", "verify", "commit", "realign", "checks")
#: decoding modes (``--modes``)
MODES = ("greedy", "coupled", "rejection")


def corrupt_for_acceptance(reference: list[list[int]], p: float, k: int, vocab: int,
                           seed: int = 0) -> list[list[int]]:
    """Scripts whose drafts are accepted at rate ~p: each reference token is replaced with
    probability q, where q solves sum_{i=1..k} (1-q)^i / k = p."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        q = (lo + hi) / 2
        rate = sum((1 - q) ** i for i in range(1, k + 1)) / k
        lo, hi = (q, hi) if rate > p else (lo, q)
    rng = random.Random(seed)
    return [[(t + 1 + rng.randrange(vocab - 1)) % vocab if rng.random() < q else t for t in seq]
            for seq in reference]


def make_drafter(spec: str, reference, k: int, vocab: int, draft_model):
    if spec == "ngram":
        return drafters.NGramDrafter()
    if spec == "model":
        if draft_model is None:
            raise SystemExit("--drafters model needs --draft-model")
        return drafters.ModelDrafter(draft_model)
    if spec.startswith("scripted:"):
        return drafters.ScriptedDrafter(corrupt_for_acceptance(reference, float(spec.split(":")[1]), k, vocab))
    raise SystemExit(f"unknown drafter {spec!r}: ngram, model or scripted:P")


def policy_options(spec: str) -> tuple[str, dict]:
    """'adaptive', 'fixed', or 'adaptive:NAME=VALUE,..' (``AdaptivePolicy`` options,
    ``specdec.policy.OPTIONS``): 'adaptive:own=4' -> ('adaptive', {'own': 4.0})."""
    try:
        return policies.parse(spec)
    except ValueError as e:
        raise SystemExit(f"unknown policy: {e}") from None


def make_policy(c: "Config"):
    """The policy argument of ``c``: its name, or for a variant with options an
    ``AdaptivePolicy`` on the configuration's own ``Calibration`` (kept across its calls,
    as ``"adaptive"`` keeps the model's: variants never share what they learn)."""
    _, opts = policy_options(c.policy or "adaptive")
    if not opts:
        return c.policy
    if c.calibration is None:
        c.calibration = policies.Calibration()
    return policies.resolve(c.policy, calibration=c.calibration)


def strategy_options(spec: str) -> tuple[str, dict]:
    """'NAME' or 'NAME:VALUE', VALUE for the strategy's first option (from the registry):
    'holes:0.3' -> ('holes', {'hole_threshold': 0.3}); 'exspec:16' -> window 16."""
    name, _, arg = spec.partition(":")
    if name not in strategies.names():
        raise SystemExit(f"unknown strategy {name!r}: one of {', '.join(strategies.names())}")
    if not arg:
        return name, {}
    options = strategies.get(name).options
    if not options:
        takers = [f"{n}:{strategies.get(n).options[0].name}" for n in strategies.names()
                  if strategies.get(n).options]
        raise SystemExit(f"strategy {spec!r}: {name} takes no option (these do: {', '.join(takers)})")
    return name, {options[0].name: options[0].type(arg)}


def phase_shares(seconds: dict) -> dict:
    """Each phase's share of decode time."""
    return shares_of(seconds, DECODE_PHASES)


def geometric_mean(values) -> float:
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def load_prompts(arg: str, kinds=None) -> list:
    """``--prompts``: a count of built-in prompts, or a JSONL path (``prompts.load_jsonl``);
    ``--kinds``: only the prompts of these kinds (None: all)."""
    if arg.isdigit():
        count = int(arg)
        if count < 1:
            raise SystemExit(f"--prompts must be a count >= 1 or a JSONL file, got {arg!r}")
        chosen = prompts.builtin_prompts()[:count]
    else:
        path = Path(arg)
        if not path.exists():
            raise SystemExit(f"--prompts must be a count >= 1 or a JSONL file; no file {arg!r}")
        try:
            chosen = prompts.load_jsonl(path)
        except ValueError as e:
            raise SystemExit(str(e))
    if kinds:
        have = list(dict.fromkeys(p.kind for p in chosen))
        missing = [k for k in kinds if k not in have]
        if missing:
            raise SystemExit(f"--kinds must name kinds of the prompts {have}; not there: {missing}")
        chosen = [p for p in chosen if p.kind in kinds]
    return chosen


@dataclass
class Config:
    """One configuration: standard decoding, a strategy with a drafter and a policy, or
    Hugging Face prompt lookup; in one decoding mode."""

    kind: str  # "standard" | "spec" | "hf-lookup"
    batch_size: int
    drafter: str | None = None
    strategy: str = "standard"  # the strategy as given ("holes:0.3"), or the kind
    policy: str | None = None
    lookup: int = 0  # prompt_lookup_num_tokens (hf-lookup)
    show_policy: bool = False  # name the policy (several were given)
    mode: str = "greedy"  # a name of MODES
    sampling: Sampling | None = None  # the mode's parameters (None: greedy)
    compile: str | None = None  # specdec.compiled mode (None: eager)
    static: bool = False  # static shapes (specdec/static.py)
    calibration: object = None  # a policy variant's own (make_policy)
    runs: list = field(default_factory=list)  # per (repeat, kind): measurements

    @property
    def engine(self) -> str:
        """The configuration's name in the tables: strategy[/policy][@mode]."""
        if self.kind == "hf-lookup":
            return f"hf-lookup:{self.lookup}"
        if self.kind == "hf-generate":
            return "hf-generate"
        name = f"{self.strategy}/{self.policy}" if self.show_policy else self.strategy
        name = name if self.compile is None else f"{name}+{self.compile}"
        name = f"{name}+static" if self.static else name
        return name if self.mode == "greedy" else f"{name}@{self.mode}"


def hf_lookup_generate(target, ids: list, max_new_tokens: int, lookup: int, stops: list) -> list:
    """Hugging Face prompt-lookup decoding, greedy, one prompt at a time (HF's assisted
    generation takes batch size 1); the stop token included where one ended the row."""
    dev = next(target.parameters()).device
    out = []
    for p in ids:
        x = torch.tensor([p], dtype=torch.long, device=dev)
        with torch.no_grad():
            y = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                max_new_tokens=max_new_tokens, prompt_lookup_num_tokens=lookup,
                                eos_token_id=stops or None, pad_token_id=(stops or [0])[0])
        seq = y[0, len(p):].tolist()
        cut = next((i + 1 for i, t in enumerate(seq) if t in stops), len(seq))
        out.append(seq[:cut])
    return out


def run_config(c: Config, target, ids, new: int, k: int, reference, vocab, draft_model, stops,
               hooks=()):
    """Decode ``ids`` with configuration ``c``: (sequences, stats or None, wall seconds,
    CPU seconds of this process). ``hooks``: the engine's step hooks (speculative
    configurations only; the timed runs have none)."""
    sync(target)
    t0, c0 = time.perf_counter(), time.process_time()
    stats = None
    if c.kind == "standard":
        seqs = specdec.reference_generate(target, ids, max_new_tokens=new, batch_size=c.batch_size,
                                          sampling=c.sampling, compile=c.compile,
                                          static_shapes=True if c.static else None)
    elif c.kind == "hf-generate":
        seqs = hf_generate(target, ids, max_new_tokens=new, batch_size=c.batch_size)
    elif c.kind == "hf-lookup":
        seqs = hf_lookup_generate(target, ids, new, c.lookup, stops)
    else:
        drafter = make_drafter(c.drafter, reference, k, vocab, draft_model)
        name, opts = strategy_options(c.strategy)
        if opts.get("window", c.batch_size) < c.batch_size:
            opts["window"] = c.batch_size
        res = engine.generate(target, ids, drafter=drafter, strategy=name, k=k,
                              batch_size=c.batch_size, max_new_tokens=new, policy=make_policy(c),
                              sampling=c.sampling, hooks=hooks, compile=c.compile,
                              static_shapes=True if c.static else None, **opts)
        seqs, stats = res.sequences, res.stats
    sync(target)
    return seqs, stats, time.perf_counter() - t0, time.process_time() - c0


def sync(model) -> None:
    """Wait for the model's device (timings on a GPU end when its kernels do)."""
    if next(model.parameters()).device.type == "cuda":
        torch.cuda.synchronize()


def summarise(configs: list, kinds: list) -> tuple[list, list]:
    """(overall rows, per-kind rows) from the runs of every configuration; ratios against
    standard decoding in the configuration's own mode ("vs_standard") and in greedy
    decoding ("vs_greedy_standard", wall time)."""
    std = {(c.mode, c.batch_size): c for c in configs
           if c.kind == "standard" and c.compile is None and not c.static}
    hf = {c.batch_size: c for c in configs if c.kind == "hf-generate"}
    by_kind, overall = [], []
    for c in configs:
        base = std.get((c.mode, c.batch_size))
        greedy = std.get(("greedy", c.batch_size))
        per_kind = {"seconds": {}, "cpu_seconds": {}}
        vs_greedy, vs_hf = {}, {}
        for kind in kinds:
            runs = [r for r in c.runs if r["kind"] == kind]
            if not runs:
                continue
            ratios = {clock: _ratios(runs, base, kind, clock) for clock in per_kind}
            for clock, got in ratios.items():
                per_kind[clock][kind] = statistics.median(got) if got else None
            got = _ratios(runs, greedy, kind, "seconds")
            vs_greedy[kind] = statistics.median(got) if got else None
            got = _ratios(runs, hf.get(c.batch_size), kind, "seconds")
            vs_hf[kind] = statistics.median(got) if got else None
            by_kind.append(_row(c, kind, runs, ratios))
            by_kind[-1]["vs_greedy_standard"] = vs_greedy[kind]
            by_kind[-1]["vs_hf_generate"] = vs_hf[kind]
        row = _row(c, "all", c.runs, {})
        known = [v for v in vs_greedy.values() if v]
        row["vs_greedy_standard"] = geometric_mean(known) if known else None
        known = [v for v in vs_hf.values() if v]
        row["vs_hf_generate"] = geometric_mean(known) if known else None
        for clock, suffix in (("seconds", ""), ("cpu_seconds", "_cpu")):
            known = [v for v in per_kind[clock].values() if v]
            row["vs_standard" + suffix] = geometric_mean(known) if known else None
            row["vs_standard_min" + suffix] = min(known) if known else None
            row["vs_standard_max" + suffix] = max(known) if known else None
        overall.append(row)
    return overall, by_kind


def _ratios(runs: list, base, kind: str, clock: str) -> list:
    """Per repeat: tokens per ``clock`` second of ``runs`` over the standard run of the
    same kind and repeat (empty without a standard configuration)."""
    out = []
    for r in runs if base is not None else []:
        b = next((x for x in base.runs if x["kind"] == kind and x["repeat"] == r["repeat"]), None)
        if b:
            out.append((r["tokens"] / r[clock]) / (b["tokens"] / b[clock]))
    return out


def _row(c: Config, kind: str, runs: list, ratios: dict) -> dict:
    tokens = sum(r["tokens"] for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    per_repeat = {}
    for r in runs:
        t = per_repeat.setdefault(r["repeat"], [0, 0.0, 0.0])
        t[0] += r["tokens"]
        t[1] += r["seconds"]
        t[2] += r["cpu_seconds"]
    rates = [t / s for t, s, _ in per_repeat.values()]
    cpu_rates = [t / s for t, _, s in per_repeat.values()]
    wall, cpu = ratios.get("seconds", []), ratios.get("cpu_seconds", [])
    stats = [r["stats"] for r in runs if r["stats"]]
    phase_seconds = None
    if stats:
        phase_seconds = {p: sum(s["seconds"].get(p, 0.0) for s in stats) for p in stats[0]["seconds"]}
    drafted = sum(s["drafted"] for s in stats)
    row_steps = sum(s["row_steps"] for s in stats)
    judged = all(r["exact"] is not None for r in runs)  # rejection sampling: no reference
    return {
        "engine": c.engine, "mode": c.mode, "strategy": c.strategy, "policy": c.policy,
        "drafter": c.drafter,
        "batch_size": c.batch_size, "kind": kind, "repeats": len(per_repeat),
        "tokens": tokens, "seconds": seconds,
        "tokens_per_s": statistics.median(rates) if rates else 0.0,
        "tokens_per_s_spread": [min(rates), max(rates)] if rates else None,
        "cpu_tokens_per_s": statistics.median(cpu_rates) if cpu_rates else 0.0,
        "vs_standard": statistics.median(wall) if wall else None,
        "vs_standard_spread": [min(wall), max(wall)] if wall else None,
        "vs_standard_cpu": statistics.median(cpu) if cpu else None,
        "vs_standard_cpu_spread": [min(cpu), max(cpu)] if cpu else None,
        "exact_match": sum(r["exact"] for r in runs) / max(1, sum(r["rows"] for r in runs))
        if judged else None,
        "near_ties": sum(r["near_ties"] for r in runs) if judged else None,
        "desyncs": sum(r["desyncs"] for r in runs) if judged else None,
        "acceptance": (sum(s["accepted"] for s in stats) / drafted if drafted else 0.0) if stats else None,
        "mean_draft_length": (sum(s["planned"] for s in stats) / row_steps if row_steps else 0.0) if stats else None,
        "steps": sum(s["steps"] for s in stats) if stats else None,
        "widths": _merge_widths(stats) if stats else None,
        "phase_seconds": phase_seconds,
        "phase_shares": phase_shares(phase_seconds) if phase_seconds else None,
        "decode_tokens_per_s": None,
        "group_rate": _group_rate(stats),
    }


def _merge_widths(stats: list) -> dict:
    out: dict = {}
    for s in stats:
        for w, n in s["widths"].items():
            out[str(w)] = out.get(str(w), 0) + n
    return dict(sorted(out.items(), key=lambda x: int(x[0])))


def _group_rate(stats: list):
    rates = [s["group_rate"] for s in stats if s.get("group_rate") is not None]
    return sum(rates) / len(rates) if rates else None


def stats_failures(c: Config, where: str, stats, seqs) -> list[str]:
    """The conservation rules a timed run's ``Stats`` break against its outputs
    (``Stats.conservation``), each naming the run."""
    return [f"{c.engine} {c.drafter} batch {c.batch_size} {where}: {m}"
            for m in stats.conservation(seqs)]


def verify_stats(c: Config, target, ids, new: int, k: int, reference, vocab, draft_model,
                 stops, where: str) -> list[str]:
    """One untimed run of ``c`` under a fast Monitor: its ``Stats`` must be the sums over
    the views the Monitor saw (``Monitor.check_stats``: steps, drafted, accepted,
    committed) and the total output length; returns what broke, naming the run."""
    import invariants

    mon = invariants.Monitor("fast", raise_on_violation=False)
    seqs, stats, _, _ = run_config(c, target, ids, new, k, reference, vocab, draft_model, stops,
                                   hooks=[mon])
    found = mon.check() + mon.check_stats(stats, seqs)
    return [f"{c.engine} {c.drafter} batch {c.batch_size} {where} (checked run): {r}"
            for v in found for r in v.rules]


def refuse(failures: list[str]) -> int:
    """Print why no figure is printed; the exit status of a refused benchmark."""
    print(f"throughput: refusing to print figures: {len(failures)} conservation rule(s) broken "
          "(the engine's Stats do not add up, so its tokens/s, acceptance and draft lengths "
          "cannot be trusted):", file=sys.stderr)
    for f in failures[:20]:
        print(f"  {f}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct; or tiny:FAMILY, a path")
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--prompts", default="16",
                    help="a count of built-in prompts (default 16) or a JSONL file of prompts")
    ap.add_argument("--kinds", nargs="+", default=None,
                    help="only the prompts of these kinds (default: every kind)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--strategies", nargs="+", default=["eqspec"])
    ap.add_argument("--drafters", nargs="+", default=["ngram"])
    ap.add_argument("--dtype", default="float32", choices=tuple(models.DTYPES),
                    help="dtype the models are cast to (default float32)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--compile", nargs="+", default=[], choices=[m for m in compiled.MODES if m],
                    help="also run every standard and speculative configuration compiled")
    ap.add_argument("--static-shapes", action="store_true",
                    help="also run every standard and speculative configuration (compiled "
                         "twins included) with static shapes (specdec/static.py; name +static)")
    ap.add_argument("--graphs-cpu-proxy", action="store_true",
                    help="run --compile cuda-graphs on a CPU with specdec.graphs.cpu_proxy() "
                         "(the capture path's CPU stand-in: checks a script, no figure of it "
                         "means anything)")
    ap.add_argument("--prompt-tokens", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                    help="models without a tokenizer: random prompts of LO..HI tokens "
                         "(default: a quarter of each built-in prompt's word count)")
    ap.add_argument("--script-from", default="batch1", choices=("batch1", "batched"),
                    help="scripted drafts from batch-1 decoding (default) or from the plain "
                         "loop's batched output at the row's batch size")
    ap.add_argument("--policies", nargs="+", default=["adaptive"],
                    help="draft-length policies: adaptive (default), fixed, or an adaptive "
                         "variant adaptive:NAME=VALUE,.. (AdaptivePolicy options: "
                         f"{', '.join(policies.OPTIONS)}; its own calibration)")
    ap.add_argument("--modes", nargs="+", default=["greedy"], choices=MODES,
                    help="decoding modes, each next to the others (default greedy)")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling modes (default 1)")
    ap.add_argument("--top-k", type=int, default=0, help="sampling modes (default 0: no cut)")
    ap.add_argument("--top-p", type=float, default=1.0, help="sampling modes (default 1: no cut)")
    ap.add_argument("--seed", type=int, default=0, help="sampling modes (default 0)")
    ap.add_argument("--hf-lookup", type=int, default=0, metavar="N",
                    help="also run HF generate(prompt_lookup_num_tokens=N) at batch size 1")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved repeats (default 1)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default=None, help="directory for results.json and PNG plots")
    ap.add_argument("--from-json", default=None, metavar="RESULTS",
                    help="run nothing: print the summary of a saved results.json (and, with "
                         "--out, rewrite its summary and plots)")
    args = ap.parse_args(argv)
    if args.graphs_cpu_proxy:
        with graphs.cpu_proxy():
            return _main(args)
    return _main(args)


def _main(args) -> int:
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        if data.get("by_kind"):
            print_kinds(data["by_kind"], data["rows"])
        summary = realign_summary(first_mode(data["rows"], data["meta"].get("modes")))
        print_summary(summary)
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            data["realign_summary"] = summary
            (out / "results.json").write_text(json.dumps(data, indent=2))
            plot(data["rows"], out)
        return 0
    for pol in args.policies:  # a bad name fails before the model loads
        policy_options(pol)
    if args.threads:
        torch.set_num_threads(args.threads)
    chosen = load_prompts(args.prompts, args.kinds)
    modes = list(dict.fromkeys(args.modes))
    samplings = {m: None if m == "greedy" else Sampling(args.temperature, args.top_k, args.top_p,
                                                       args.seed, m) for m in modes}

    if args.model in models.RANDOM_LLAMAS:  # built on the device: no copy of a 7B model
        target, tok = models.random_llama(args.model, args.dtype, args.device), None
    else:
        target, tok = models.resolve(args.model, dtype=args.dtype)
        target = target.to(args.device)
    draft_model = models.resolve(args.draft_model, dtype=args.dtype)[0].to(args.device) \
        if args.draft_model else None
    for mode in args.compile:
        compiled.check(mode, target)
    vocab = models.vocab_size(target)
    stops = models.stop_token_ids(target)
    if tok is not None:
        ids = prompts.encode(chosen, tok)
    else:
        g = torch.Generator().manual_seed(0)
        lo_hi = args.prompt_tokens
        ids = [torch.randint(3, vocab, (max(1, p.word_count() // 4) if lo_hi is None else
                                        int(torch.randint(lo_hi[0], lo_hi[1] + 1, (1,), generator=g)),),
                             generator=g).tolist() for p in chosen]
    new = args.max_new_tokens
    kinds = list(dict.fromkeys(p.kind for p in chosen))
    groups = {kind: [i for i, p in enumerate(chosen) if p.kind == kind] for kind in kinds}
    if tok is None and args.prompt_tokens:  # random prompts: one kind, so batches fill up
        kinds, groups = ["random"], {"random": list(range(len(ids)))}

    configs = [Config("standard", b, mode=m, sampling=samplings[m])
               for b in args.batch_sizes for m in modes]
    configs += [Config("hf-generate", b, strategy="hf-generate") for b in args.batch_sizes]  # every run
    configs += [Config("spec", b, d, s, pol, show_policy=len(args.policies) > 1, mode=m,
                       sampling=samplings[m])
                for b in args.batch_sizes for m in modes for d in args.drafters
                for s in args.strategies for pol in args.policies]
    configs += [replace(c, compile=mode, runs=[]) for mode in args.compile for c in list(configs)
                if c.kind in ("standard", "spec")]
    if args.static_shapes:
        # (cuda-graphs runs with static shapes whatever is asked: no twin of it)
        configs += [replace(c, static=True, runs=[]) for c in list(configs)
                    if c.kind in ("standard", "spec") and c.compile != "cuda-graphs"]
    if args.hf_lookup:
        configs.append(Config("hf-lookup", 1, lookup=args.hf_lookup))

    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    total = len(configs) * len(kinds) * args.repeats + len(modes)
    bar = tqdm(total=total, desc="benchmark", file=sys.stderr) if tqdm else None

    # warm-up: first calls pay for lazy initialisation; keep that out of every figure
    specdec.reference_generate(target, ids[:2], max_new_tokens=4, batch_size=2)
    for s in args.strategies:
        name, opts = strategy_options(s)
        opts.pop("window", None)  # the warm-up batch may be smaller than a given window
        engine.generate(target, ids[:2], drafter=drafters.NGramDrafter(), strategy=name, k=args.k,
                        batch_size=2, max_new_tokens=4, **opts)
        for c in configs:  # a policy variant's own calibration gets the default's warm-up
            if c.kind == "spec" and c.strategy == s and policy_options(c.policy)[1]:
                engine.generate(target, ids[:2], drafter=drafters.NGramDrafter(), strategy=name,
                                k=args.k, batch_size=2, max_new_tokens=4, policy=make_policy(c),
                                **opts)
    if args.hf_lookup:
        hf_lookup_generate(target, ids[:1], 4, args.hf_lookup, stops)
    hf_generate(target, ids[:2], max_new_tokens=4, batch_size=2)
    # compiled regions: compile (every batch size's shapes) before timing; on a GPU every
    # configuration once at its own batch size (the allocator's growth and the kernels'
    # first choice for new shapes would otherwise land in whichever configuration runs
    # first: the H200 run of ../shared/gpu timed the plain loop first, warmed at batch 2)
    for c in configs:
        if (c.compile is not None or c.static or args.device == "cuda") and not c.runs:
            run_config(replace(c, drafter=c.drafter and "ngram", runs=[]), target,
                       ids[: c.batch_size], new, args.k, None, vocab, draft_model, stops)
    # batch-1 plain decoding per mode and kind (a configuration decodes one kind per call,
    # so a sampled row's request index is its index within its kind)
    references, ref_seconds = {}, {}
    for m in modes:
        t0 = time.perf_counter()
        references[m] = {kind: specdec.reference_generate(
            target, [ids[i] for i in groups[kind]], max_new_tokens=new, batch_size=1,
            sampling=samplings[m]) for kind in kinds}
        ref_seconds[m] = time.perf_counter() - t0
        if bar:
            bar.update(1)
    ref_tokens = sum(len(s) for ref in references[modes[0]].values() for s in ref)
    # what scripted drafts corrupt: batch-1 decoding, or the plain loop's batched output
    scripts = {(b, kind): specdec.reference_generate(
        target, [ids[i] for i in groups[kind]], max_new_tokens=new, batch_size=b)
        for b in args.batch_sizes for kind in kinds} if args.script_from == "batched" else {}
    failures = []  # conservation rules broken by a run's Stats: no figure is printed then
    for repeat in range(args.repeats):
        for kind in kinds:
            rows = groups[kind]
            sub = [ids[i] for i in rows]
            shift = (repeat + kinds.index(kind)) % len(configs)  # rotate the order
            for c in configs[shift:] + configs[:shift]:
                if bar:
                    bar.set_postfix_str(f"{c.engine} {c.drafter or ''} batch {c.batch_size} {kind}")
                sub_ref = references[c.mode][kind]
                script = scripts.get((c.batch_size, kind), sub_ref)
                seqs, stats, secs, cpu = run_config(c, target, sub, new, args.k, script, vocab,
                                                    draft_model, stops)
                if stats is not None:
                    where = f"{kind} repeat {repeat}"
                    failures += stats_failures(c, where, stats, seqs)
                    if repeat == 0:  # the counters against the views, once per config and kind
                        failures += verify_stats(c, target, sub, new, args.k, script, vocab,
                                                 draft_model, stops, where)
                counts, exact = {"near-tie": None, "desync": None}, None
                if c.mode != "rejection":  # the oracle's verdict in the configuration's batch shape (not timed)
                    counts = compare_outputs(target, sub, seqs, sub_ref, max_new_tokens=new,
                                             batch_size=c.batch_size,
                                             chunk=1 if stats is None else args.k + 1,
                                             sampling=c.sampling).counts()
                    exact = sum(a == r for a, r in zip(seqs, sub_ref))
                c.runs.append({"near_ties": counts["near-tie"], "desyncs": counts["desync"],
                               "repeat": repeat, "kind": kind, "seconds": secs, "cpu_seconds": cpu,
                               "tokens": sum(len(x) for x in seqs), "rows": len(seqs),
                               "exact": exact,
                               "stats": stats.as_dict() | {"row_steps": stats.row_steps,
                                                           "planned": stats.planned}
                               if stats else None})
                if bar:
                    bar.update(1)
    if bar:
        bar.close()
    if failures:
        return refuse(failures)

    rows, by_kind = summarise(configs, kinds)
    own1 = {(r["engine"], r["drafter"]): r["tokens_per_s"] for r in rows if r["batch_size"] == 1}
    for r in rows:
        r["decode_tokens_per_s"] = decode_tokens_per_s(r)
        base = own1.get((r["engine"], r["drafter"]))
        r["vs_own_batch1"] = r["tokens_per_s"] / base if base else None

    model_name = args.model or models.DEFAULT_MODEL_NAME
    source = args.prompts if not args.prompts.isdigit() else f"{len(ids)} built-in prompts"
    rule = rule_text(DEFAULT_TOLERANCE)
    print(f"model {model_name} ({args.dtype}), {source} ({min(map(len, ids))}-{max(map(len, ids))} tokens, "
          f"kinds: {', '.join(f'{k} {len(v)}' for k, v in groups.items())}), {new} new tokens, "
          f"k={args.k}, {args.repeats} interleaved repeat(s), torch threads "
          f"{torch.get_num_threads()}; batch-1 reference ({modes[0]}): "
          f"{ref_tokens / ref_seconds[modes[0]]:.1f} tok/s\noracle: {rule}")
    if any(s is not None for s in samplings.values()):
        print(f"sampling: temperature {args.temperature}, top-k {args.top_k}, top-p {args.top_p}, "
              f"seed {args.seed}; 'vs std' is against plain decoding in the row's own mode, "
              "'vs grd' against plain greedy decoding")
    print_kinds(by_kind, rows)
    print_overall(rows)
    summary = realign_summary(first_mode(rows, modes))
    print_summary(summary)
    print_graphs(configs)

    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"model": model_name, "dtype": args.dtype, "device": args.device,
                "compile": args.compile, "static_shapes": args.static_shapes, "script_from": args.script_from, "oracle": rule, "prompts": source, "kinds": {k: len(v) for k, v in groups.items()},
                "max_new_tokens": new, "k": args.k, "repeats": args.repeats, "modes": modes,
                "sampling": {m: s.as_dict() for m, s in samplings.items() if s is not None},
                "threads": torch.get_num_threads(),
                "reference_tokens_per_s": ref_tokens / ref_seconds[modes[0]]}
        (out / "results.json").write_text(json.dumps(
            {"meta": meta, "rows": rows, "by_kind": by_kind, "realign_summary": summary}, indent=2))
        plot(rows, out)
        print(f"wrote {out / 'results.json'}, {out / 'throughput.png'}, {out / 'phases.png'}")
    return 0


def first_mode(rows: list, modes) -> list:
    """The rows of the first mode given (the realign summary compares those)."""
    first = (modes or ["greedy"])[0]
    return [r for r in rows if r.get("mode", "greedy") == first]


def _pct(x, width: int = 6) -> str:
    return f"{'-':>{width}}" if x is None else f"{x * 100:{width - 1}.0f}%"


def _fmt(x, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{format(x, spec):>{width}}"


def _table(title: str, head: str) -> None:
    """A table's title, header line and rule."""
    print(title)
    print(head)
    print("-" * len(head))


def print_kinds(by_kind: list, rows: list) -> None:
    """Per prompt kind: tokens/s, ratio to standard (median over repeats, with its
    min-max) in wall time and in this process's CPU time, acceptance and mean draft
    length, one line per configuration."""
    _table("\nper prompt kind (median over repeats; ratio to batched standard decoding at the "
           "same batch size in wall time and in CPU time, [min-max] over repeats)",
           f"{'kind':<14} {'engine':<26} {'drafter':<13} {'batch':>5} {'tok/s':>7} "
           f"{'vs std':>6} {'spread':>11} {'vs grd':>6} {'cpu tok/s':>9} {'cpu vs':>6} {'spread':>11} "
           f"{'accept':>6} {'mean kb':>7} {'exact':>6}")
    spread = lambda s: f"{s[0]:.2f}-{s[1]:.2f}" if s else "-"  # noqa: E731
    for r in by_kind:
        print(f"{r['kind']:<14} {r['engine']:<26} {str(r['drafter'] or '-'):<13} {r['batch_size']:>5} "
              f"{r['tokens_per_s']:>7.1f} {_fmt(r['vs_standard'], '.2f', 6)} "
              f"{spread(r['vs_standard_spread']):>11} {_fmt(r.get('vs_greedy_standard'), '.2f', 6)} "
              f"{r['cpu_tokens_per_s']:>9.1f} "
              f"{_fmt(r['vs_standard_cpu'], '.2f', 6)} {spread(r['vs_standard_cpu_spread']):>11} "
              f"{_fmt(r['acceptance'], '.2f', 6)} {_fmt(r['mean_draft_length'], '.2f', 7)} "
              f"{_pct(r['exact_match'])}")


def print_overall(rows: list) -> None:
    _table("\nall kinds (vs std: geometric mean over kinds of the per-kind ratios, wall time; "
           "low: the lowest kind; vs hf: the same against Hugging Face generate at the same "
           "batch size; cpu: the same in CPU time)",
           f"{'engine':<26} {'drafter':<13} {'batch':>5} {'tok/s':>7} {'dec/s':>7} {'vs std':>6} "
           f"{'low':>5} {'vs grd':>6} {'vs hf':>6} {'cpu vs':>6} {'low':>5} {'vs b1':>6} {'accept':>6} {'kb':>5} "
           f"{'group':>6} {'draft':>6} {'verify':>6} {'realign':>7} {'checks':>6} {'exact':>6} {'ties':>4} {'desync':>6}")
    for r in rows:
        sh = r["phase_shares"] or {}
        pct = lambda x, w=6: f"{x * 100:{w - 1}.1f}%" if x is not None else f"{'-':>{w}}"  # noqa: E731
        print(f"{r['engine']:<26} {str(r['drafter'] or '-'):<13} {r['batch_size']:>5} "
              f"{r['tokens_per_s']:>7.1f} {_fmt(r['decode_tokens_per_s'], '.1f', 7)} "
              f"{_fmt(r['vs_standard'], '.2f', 6)} {_fmt(r['vs_standard_min'], '.2f', 5)} "
              f"{_fmt(r.get('vs_greedy_standard'), '.2f', 6)} {_fmt(r.get('vs_hf_generate'), '.2f', 6)} "
              f"{_fmt(r['vs_standard_cpu'], '.2f', 6)} {_fmt(r['vs_standard_min_cpu'], '.2f', 5)} "
              f"{_fmt(r.get('vs_own_batch1'), '.2f', 6)} {_fmt(r['acceptance'], '.2f', 6)} "
              f"{_fmt(r['mean_draft_length'], '.2f', 5)} {_fmt(r['group_rate'], '.2f', 6)} "
              f"{pct(sh.get('draft'))} {pct(sh.get('verify'))} {pct(sh.get('realign'), 7)} "
              f"{pct(sh.get('checks'))} {_pct(r['exact_match'])} {_fmt(r['near_ties'], 'd', 4)} "
              f"{_fmt(r['desyncs'], 'd', 6)}")


def decode_tokens_per_s(row: dict) -> float | None:
    """Tokens per second of decode time (every phase but prefill; None for standard)."""
    secs = row["phase_seconds"]
    if not secs:
        return None
    return row["tokens"] / max(sum(v for p, v in secs.items() if p != "prefill"), 1e-9)


def realign_summary(rows: list) -> list:
    """Per batch size: the best speculative strategy, the one with the highest geometric
    mean of end-to-end tokens/s over the drafters (among strategies run with all of them),
    its realign share of decode time per drafter next to EQSPEC's own, and the fastest
    strategy per drafter. End-to-end speed decides, since it is what a user gets (decode
    speed alone would flatter EXSPEC, whose admissions prefill in small groups)."""
    spec = [r for r in rows if r["phase_shares"]]
    names = sorted({r["drafter"] for r in spec}, key=str)
    out = []
    for b in sorted({r["batch_size"] for r in spec}):
        by: dict = {}
        for r in spec:
            if r["batch_size"] == b:
                by.setdefault(r["engine"], {})[r["drafter"]] = r
        full = {s: d for s, d in by.items() if len(d) == len(names)}
        if not full:
            continue
        mean = {s: math.exp(sum(math.log(d[x]["tokens_per_s"]) for x in names) / len(names))
                for s, d in full.items()}
        best = max(mean, key=mean.get)
        share = lambda s: {x: by[s][x]["phase_shares"]["realign"] for x in by[s]}  # noqa: E731
        out.append({
            "batch_size": b, "best": best, "mean_tokens_per_s": mean,
            "best_realign": share(best),
            "eqspec_realign": share(eq) if (eq := _eqspec_label(by)) else None,
            "fastest_per_drafter": {x: max((d[x] for d in by.values() if x in d),
                                           key=lambda r: r["tokens_per_s"])["engine"]
                                    for x in names},
        })
    return out


def _eqspec_label(by: dict):
    """EQSPEC's engine label among ``by``'s (``eqspec`` or ``eqspec/POLICY``), if any."""
    return next((s for s in by if s.split("/")[0] == "eqspec"), None)


def print_summary(summary: list) -> None:
    pct = lambda d: "  ".join(f"{x} {v * 100:.1f}%" for x, v in d.items())  # noqa: E731
    print("\nbest strategy per batch size (geometric mean of tokens/s over the drafters) and "
          "realign share of decode time")
    for r in summary:
        others = ", ".join(f"{s} {v:.1f}" for s, v in r["mean_tokens_per_s"].items() if s != r["best"])
        print(f"  batch {r['batch_size']:>3}: {r['best']} {r['mean_tokens_per_s'][r['best']]:.1f} tok/s"
              f"{' (' + others + ')' if others else ''}")
        print(f"    {r['best']} realign: {pct(r['best_realign'])}")
        if r["eqspec_realign"] is not None and r["best"] != "eqspec":
            print(f"    eqspec realign: {pct(r['eqspec_realign'])}")
        print("    fastest per drafter: " + ", ".join(f"{x} {s}" for x, s in r["fastest_per_drafter"].items()))


def print_graphs(configs: list) -> None:
    """compile="cuda-graphs": per configuration, the target forwards served by captured
    graphs over all its timed runs (captures, replays, eager forwards by reason)."""
    lines = []
    for c in configs:
        got = [r["stats"]["graphs"] for r in c.runs if r["stats"] and r["stats"].get("graphs")]
        if not got:
            continue
        eager: dict = {}
        for g in got:
            for why, n in g["eager"].items():
                eager[why] = eager.get(why, 0) + n
        lines.append(f"  {c.engine} batch {c.batch_size}: captured {sum(g['captured'] for g in got)}, "
                     f"replayed {sum(g['replayed'] for g in got)}, failed captures "
                     f"{sum(g['failed'] for g in got)}, eager {eager or 0}")
    if lines:
        print("\ncaptured forwards (compile=cuda-graphs, over every timed run)")
        print("\n".join(lines))


def plot(rows, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = sorted({(r["engine"], r["drafter"]) for r in rows}, key=str)
    for s, d in series:
        pts = sorted((r["batch_size"], r["tokens_per_s"]) for r in rows if (r["engine"], r["drafter"]) == (s, d))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s if d is None else f"{s} / {d}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens / s")
    save(fig, ax, out / "throughput.png", title="Throughput vs batch size", legend_size=7)

    spec = [r for r in rows if r["phase_shares"]]
    stacked_phase_shares(out / "phases.png",
                         [f"{r['engine']}\n{r['drafter']}\nb{r['batch_size']}" for r in spec],
                         [r["phase_shares"] for r in spec], DECODE_PHASES,
                         ylabel="share of decode time", width_per_bar=0.45, min_width=7,
                         label_size=6)


if __name__ == "__main__":
    sys.exit(main())
