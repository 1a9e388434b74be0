"""Side-by-side throughput of batched standard decoding and every speculative strategy.

All configurations run in one process, interleaved per batch size, so that ratios are
measured under the same machine noise. Prints, per drafter, strategy and batch size:
tokens/s, decode tokens/s (tokens per second of decode time, prefill excluded), ratio to batched standard decoding at the same batch size, ratio to itself at
batch 1, acceptance, share of decode time per phase (draft, verify, realign, checks) and the
exact-match rate against batch-1 greedy decoding; then, per batch size, the best strategy
(highest geometric mean of tokens/s over the drafters), its realign share per drafter next
to EQSPEC's own, and the fastest strategy per drafter.
Writes JSON and PNG plots to --out.

    python benchmarks/throughput.py                      # real model, n-gram drafter
    python benchmarks/throughput.py --model tiny:llama --draft-model tiny-draft:llama
    python benchmarks/throughput.py --drafters ngram scripted:0.3 scripted:0.6 scripted:0.9 \
        --batch-sizes 1 2 4 8 16 --strategies eqspec exspec holes
    python benchmarks/throughput.py --strategies holes:0 holes:0.25 holes:0.5 holes:1 exspec:32

A strategy (a name of ``specdec.strategies.names()``) may carry a value of its first
option after a colon: ``holes:H`` (hole_threshold H) and ``exspec:N`` (window N). The
group column is exspec's group rate (share of steps served by a group of equal-length
rows, without realignment).

Decoding modes (``--modes greedy coupled rejection``): greedy, and sampling with
``--temperature --top-k --top-p --seed`` in coupled or rejection mode, each with its own
standard row (plain decoding in that mode, batched). Exact match: against batch-1 greedy
decoding (greedy), batch-1 plain coupled sampling (coupled); rejection sampling has no
reference ("-"; its distribution is tested by ``specdec.forensics.distribution``). The
realign summary is over the rows of the first mode given.

    python benchmarks/throughput.py --modes greedy coupled rejection --temperature 0.7 \
        --top-k 50 --top-p 0.95 --batch-sizes 8 --drafters ngram scripted:0.6
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import specdec  # noqa: E402
from specdec import Sampling, drafters, engine, models, prompts, strategies  # noqa: E402
from specdec.forensics.plots import phase_shares as shares_of, save, stacked_phase_shares  # noqa: E402

#: the phases of decode time (prefill aside)
DECODE_PHASES = ("draft", "verify", "commit", "realign", "checks")


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


MODES = ("greedy", "coupled", "rejection")


def phase_shares(seconds: dict) -> dict:
    """Each phase's share of decode time."""
    return shares_of(seconds, DECODE_PHASES)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct; or tiny:FAMILY, a path")
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--prompts", type=int, default=16, help="how many built-in prompts (default 16)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--strategies", nargs="+", default=["eqspec"])
    ap.add_argument("--drafters", nargs="+", default=["ngram"])
    ap.add_argument("--modes", nargs="+", default=["greedy"], choices=MODES,
                    help="decoding modes, each next to the others (default greedy)")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling modes (default 1)")
    ap.add_argument("--top-k", type=int, default=0, help="sampling modes (default 0: no cut)")
    ap.add_argument("--top-p", type=float, default=1.0, help="sampling modes (default 1: no cut)")
    ap.add_argument("--seed", type=int, default=0, help="sampling modes (default 0)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default=None, help="directory for results.json and PNG plots")
    ap.add_argument("--from-json", default=None, metavar="RESULTS",
                    help="run nothing: print the summary of a saved results.json (and, with "
                         "--out, rewrite its summary and plots)")
    args = ap.parse_args(argv)
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        first = data["meta"].get("modes", ["greedy"])[0]
        summary = realign_summary([r for r in data["rows"] if r.get("mode", "greedy") == first])
        print_summary(summary)
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            data["realign_summary"] = summary
            (out / "results.json").write_text(json.dumps(data, indent=2))
            plot(data["rows"], out)
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    samplings = {m: None if m == "greedy" else Sampling(args.temperature, args.top_k, args.top_p,
                                                       args.seed, m) for m in args.modes}

    target, tok = models.resolve(args.model)
    draft_model = models.resolve(args.draft_model)[0] if args.draft_model else None
    vocab = models.vocab_size(target)
    chosen = prompts.builtin_prompts()[: args.prompts]
    if tok is not None:
        ids = prompts.encode(chosen, tok)
    else:
        g = torch.Generator().manual_seed(0)
        ids = [torch.randint(3, vocab, (max(1, p.word_count() // 4),), generator=g).tolist() for p in chosen]
    new = args.max_new_tokens

    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    configs = [(m, b, None, "standard") for b in args.batch_sizes for m in args.modes]
    configs += [(m, b, d, s) for b in args.batch_sizes for m in args.modes for d in args.drafters
                for s in args.strategies]
    bar = tqdm(total=len(configs) + len(args.modes), desc="benchmark", file=sys.stderr) if tqdm else None

    # warm-up: first calls pay for lazy initialisation; keep that out of every figure
    specdec.reference_generate(target, ids[:2], max_new_tokens=4, batch_size=2)
    for s in args.strategies:
        name, opts = strategy_options(s)
        opts.pop("window", None)  # the warm-up batch may be smaller than a given window
        engine.generate(target, ids[:2], drafter=drafters.NGramDrafter(), strategy=name, k=args.k,
                        batch_size=2, max_new_tokens=4, **opts)
    references, ref_seconds = {}, {}
    for mode, smp in samplings.items():  # batch-1 plain decoding in each mode
        t0 = time.perf_counter()
        references[mode] = specdec.reference_generate(target, ids, max_new_tokens=new, batch_size=1,
                                                      sampling=smp)
        ref_seconds[mode] = time.perf_counter() - t0
        if bar:
            bar.update(1)
    reference = references[args.modes[0]]
    ref_tokens = sum(len(s) for s in reference)
    rows = []
    for mode, b, dspec, strategy in configs:
        smp = samplings[mode]
        if bar:
            bar.set_postfix_str(f"{mode} {strategy} {dspec or ''} batch {b}")
        t0 = time.perf_counter()
        if strategy == "standard":
            seqs = specdec.reference_generate(target, ids, max_new_tokens=new, batch_size=b,
                                              sampling=smp)
            stats = None
        else:
            drafter = make_drafter(dspec, references[mode], args.k, vocab, draft_model)
            name, opts = strategy_options(strategy)
            if opts.get("window", b) < b:
                opts["window"] = b
            res = engine.generate(target, ids, drafter=drafter, strategy=name, k=args.k,
                                  batch_size=b, max_new_tokens=new, sampling=smp, **opts)
            seqs, stats = res.sequences, res.stats
        secs = time.perf_counter() - t0
        n = sum(len(s) for s in seqs)
        exact = None if mode == "rejection" else \
            sum(a == r for a, r in zip(seqs, references[mode])) / len(ids)
        rows.append({
            "mode": mode, "strategy": strategy, "drafter": dspec, "batch_size": b, "seconds": secs,
            "tokens": n, "tokens_per_s": n / secs,
            "exact_match": exact,
            "acceptance": stats.acceptance if stats else None,
            "steps": stats.steps if stats else None,
            "phase_seconds": dict(stats.seconds) if stats else None,
            "phase_shares": phase_shares(stats.seconds) if stats else None,
            "decode_tokens_per_s": None,
            "group_rate": getattr(stats, "group_rate", None) if stats else None,
        })
        if bar:
            bar.update(1)
    if bar:
        bar.close()

    std = {(r["mode"], r["batch_size"]): r["tokens_per_s"] for r in rows if r["strategy"] == "standard"}
    own1 = {(r["mode"], r["strategy"], r["drafter"]): r["tokens_per_s"] for r in rows
            if r["batch_size"] == 1}
    greedy_std = {b: v for (m, b), v in std.items() if m == "greedy"}
    for r in rows:
        r["decode_tokens_per_s"] = decode_tokens_per_s(r)
        r["vs_standard"] = r["tokens_per_s"] / std[(r["mode"], r["batch_size"])]
        r["vs_greedy_standard"] = (r["tokens_per_s"] / greedy_std[r["batch_size"]]
                                   if r["batch_size"] in greedy_std else None)
        base = own1.get((r["mode"], r["strategy"], r["drafter"]))
        r["vs_own_batch1"] = r["tokens_per_s"] / base if base else None

    model_name = args.model or models.DEFAULT_MODEL_NAME
    print(f"model {model_name}, {len(ids)} prompts ({min(map(len, ids))}-{max(map(len, ids))} tokens), "
          f"{new} new tokens, k={args.k}, torch threads {torch.get_num_threads()}; "
          f"batch-1 reference ({args.modes[0]}): {ref_tokens / ref_seconds[args.modes[0]]:.1f} tok/s")
    if any(s is not None for s in samplings.values()):
        print(f"sampling: temperature {args.temperature}, top-k {args.top_k}, top-p {args.top_p}, "
              f"seed {args.seed}; 'vs std' is against plain decoding in the row's own mode, "
              "'vs grd' against plain greedy decoding")
    head = (f"{'mode':<9} {'strategy':<11} {'drafter':<13} {'batch':>5} {'tok/s':>7} {'dec/s':>7} {'vs std':>6} "
            f"{'vs grd':>6} {'vs b1':>6} "
            f"{'accept':>6} {'group':>6} {'draft':>6} {'verify':>6} {'realign':>7} {'checks':>6} "
            f"{'exact':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        sh = r["phase_shares"] or {}
        fmt = lambda x, w=6: f"{x * 100:{w - 1}.1f}%" if x is not None else f"{'-':>{w}}"  # noqa: E731
        acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        grp = f"{r['group_rate']:.2f}" if r["group_rate"] is not None else "-"
        vsg = "-" if r["vs_greedy_standard"] is None else format(r["vs_greedy_standard"], ".2f")
        exact = "-" if r["exact_match"] is None else f"{r['exact_match'] * 100:.0f}%"
        print(f"{r['mode']:<9} {r['strategy']:<11} {str(r['drafter'] or '-'):<13} {r['batch_size']:>5} "
              f"{r['tokens_per_s']:>7.1f} "
              f"{'-' if r['decode_tokens_per_s'] is None else format(r['decode_tokens_per_s'], '.1f'):>7} "
              f"{r['vs_standard']:>6.2f} {vsg:>6} "
              f"{(r['vs_own_batch1'] or 0):>6.2f} "
              f"{acc:>6} {grp:>6} "
              f"{fmt(sh.get('draft'))} {fmt(sh.get('verify'))} {fmt(sh.get('realign'), 7)} "
              f"{fmt(sh.get('checks'))} {exact:>6}")

    summary = realign_summary([r for r in rows if r["mode"] == args.modes[0]])
    print_summary(summary)

    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"model": model_name, "prompts": len(ids), "max_new_tokens": new, "k": args.k,
                "threads": torch.get_num_threads(), "modes": args.modes,
                "sampling": {m: s.as_dict() for m, s in samplings.items() if s is not None},
                "reference_tokens_per_s": ref_tokens / ref_seconds[args.modes[0]]}
        (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows, "realign_summary": summary}, indent=2))
        plot(rows, out)
        print(f"wrote {out / 'results.json'}, {out / 'throughput.png'}, {out / 'phases.png'}")
    return 0


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
                by.setdefault(r["strategy"], {})[r["drafter"]] = r
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
            "eqspec_realign": share("eqspec") if "eqspec" in by else None,
            "fastest_per_drafter": {x: max((d[x] for d in by.values() if x in d),
                                           key=lambda r: r["tokens_per_s"])["strategy"]
                                    for x in names},
        })
    return out


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


def plot(rows, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    key = lambda r: (r.get("mode", "greedy"), r["strategy"], r["drafter"])  # noqa: E731
    for m, s, d in sorted({key(r) for r in rows}, key=str):
        pts = sorted((r["batch_size"], r["tokens_per_s"]) for r in rows if key(r) == (m, s, d))
        label = (s if d is None else f"{s} / {d}") + ("" if m == "greedy" else f" ({m})")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens / s")
    save(fig, ax, out / "throughput.png", title="Throughput vs batch size", legend_size=7)

    spec = [r for r in rows if r["phase_shares"]]
    stacked_phase_shares(out / "phases.png",
                         [f"{r['strategy']}\n{r['drafter']}\nb{r['batch_size']}"
                          + ("" if r.get("mode", "greedy") == "greedy" else f"\n{r['mode']}")
                          for r in spec],
                         [r["phase_shares"] for r in spec], DECODE_PHASES,
                         ylabel="share of decode time", width_per_bar=0.45, min_width=7,
                         label_size=6)


if __name__ == "__main__":
    sys.exit(main())
