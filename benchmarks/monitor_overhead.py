"""Cost of checking: specdec.generate with no hooks vs the invariants Monitor (and guard).

All configurations run in one process on the same prompts, interleaved repetition by
repetition (the order rotates every repetition), so that ratios see the same machine
noise. Configurations:

- ``none``: no hooks (the engine builds no view);
- ``null-hook``: one hook that does nothing (the engine's own cost of building views);
- ``fast``, ``strict``: a Monitor in that mode (fast includes its one ``check()``);
- ``deep`` with ``--deep`` (KV recompute and reference decoding: slow by design);
- ``guard-fast``, ``guard-strict`` with ``--guard``: guard_model around the target.

Prints the median seconds, tokens/s, the overhead against ``none`` and the share of the
engine's time spent inside hooks; ``--json`` writes the same as JSON. Outputs of every
configuration are compared with the unchecked run (``identical``).

    python benchmarks/monitor_overhead.py                       # the real model (SmolLM2)
    python benchmarks/monitor_overhead.py --model tiny:llama --repeats 3 --device cpu
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import specdec  # noqa: E402
from invariants import Monitor, guard_model  # noqa: E402
from specdec import drafters, models, prompts  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_once(config: str, target, ids, args):
    """(seconds, sequences, hook seconds) of one generate call under ``config``."""
    hooks, guard, mon = [], None, None
    if config == "null-hook":
        hooks = [lambda phase, view: None]
    elif config in ("fast", "strict", "deep"):
        mon = Monitor(config)
        hooks = [mon]
    elif config.startswith("guard-"):
        guard = guard_model(target, mode=config.split("-", 1)[1])
    sync(args.device)
    t0 = time.perf_counter()
    if guard is not None:
        with guard:
            res = specdec.generate(target, ids, drafter=drafters.NGramDrafter(), k=args.k,
                                   batch_size=args.batch_size, max_new_tokens=args.max_new_tokens)
    else:
        res = specdec.generate(target, ids, drafter=drafters.NGramDrafter(), k=args.k,
                               batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                               hooks=hooks)
        if mon is not None:
            mon.check()  # fast mode: the run's one host sync belongs to its cost
    sync(args.device)
    return time.perf_counter() - t0, res.sequences, res.stats.seconds.get("checks", 0.0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="default: SmolLM2-135M-Instruct (specdec.models.default_model); "
                         "or tiny:FAMILY, a local path or hub name")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=[None, "float32", "bfloat16", "float16"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--deep", action="store_true", help="also time deep mode")
    ap.add_argument("--guard", action="store_true", help="also time guard_model (fast, strict)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads")
    ap.add_argument("--json", default=None, help="write the results to this JSON file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    target, tok = models.resolve(args.model)
    target = target.to(args.device)
    if args.dtype:
        target = target.to(getattr(torch, args.dtype))
    chosen = prompts.builtin_prompts()[: args.prompts]
    if tok is not None:
        ids = prompts.encode(chosen, tok)
    else:
        vocab = models.vocab_size(target)
        g = torch.Generator().manual_seed(0)
        ids = [torch.randint(3, vocab, (max(1, p.word_count() // 4),), generator=g).tolist()
               for p in chosen]

    configs = ["none", "null-hook", "fast", "strict"]
    configs += ["deep"] if args.deep else []
    configs += ["guard-fast", "guard-strict"] if args.guard else []
    for c in configs:  # warm-up: lazy initialisation stays out of every figure
        run_once(c, target, ids[:2], argparse.Namespace(**{**vars(args), "max_new_tokens": 4}))
    times = {c: [] for c in configs}
    hook_times = {c: [] for c in configs}
    outputs = {}
    for rep in range(args.repeats):
        order = configs[rep % len(configs):] + configs[: rep % len(configs)]
        for c in order:
            secs, seqs, hook_secs = run_once(c, target, ids, args)
            times[c].append(secs)
            hook_times[c].append(hook_secs)
            outputs.setdefault(c, seqs)
    tokens = sum(len(s) for s in outputs["none"])
    base = statistics.median(times["none"])
    rows = []
    for c in configs:
        med = statistics.median(times[c])
        rows.append({"config": c, "median_seconds": med, "tokens_per_s": tokens / med,
                     "overhead": med / base - 1.0,
                     "hook_share": statistics.median(hook_times[c]) / med,
                     "identical": outputs[c] == outputs["none"], "seconds": times[c]})

    name = args.model or models.DEFAULT_MODEL_NAME
    print(f"model {name} on {args.device} ({next(target.parameters()).dtype}), {len(ids)} prompts, "
          f"batch {args.batch_size}, {args.max_new_tokens} new tokens, k={args.k}, "
          f"{args.repeats} repeats, {tokens} tokens per run")
    head = f"{'config':<13} {'median s':>9} {'tok/s':>8} {'overhead':>9} {'in hooks':>9} {'same':>5}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['config']:<13} {r['median_seconds']:>9.4f} {r['tokens_per_s']:>8.1f} "
              f"{r['overhead'] * 100:>8.1f}% {r['hook_share'] * 100:>8.1f}% "
              f"{'yes' if r['identical'] else 'NO':>5}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        meta = {k: v for k, v in vars(args).items() if k != "json"}
        meta.update(model=name, tokens=tokens, torch=torch.__version__)
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        print(f"wrote {args.json}")
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
