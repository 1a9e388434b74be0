"""What a plain step of the speculative loop costs against a decode step of plain batched
decoding on the same prompts (issue #17: kinds that draft almost nothing must not lose).

Three calls per kind, interleaved (their order rotated every repeat), on the same prompts
at the same batch size: ``plain`` (``specdec.reference_generate``, the loop the throughput
benchmark compares against), ``zero`` (``specdec.generate`` with the n-gram drafter and
every ``k_b = 0``, ``ForcedPolicy``: every step plain) and ``adaptive`` (the default
policy). Every target forward of both loops goes through ``specdec.cache.forward``; this
script wraps that function (not the model: forward hooks would change the engine's path)
and times each call in CPU time, so a call's CPU time splits into its forwards (per input
shape: rows x tokens) and everything else (the loop's own Python and tensor work: for
the speculative loop the draft, policy, commit, sync and realignment). Prints per kind
and configuration the median over repeats of: CPU seconds, forward seconds, the rest in
ms per call and per step, forwards run and the widths of the steps; then the median CPU
time of a forward per shape over every call; with ``--profile N`` the top N functions
of one cProfile'd call of each configuration by own time. Outputs are compared with
plain decoding's (token ids).

    python benchmarks/plain_step_cost.py --kinds qa math_reasoning coding --repeats 3
    python benchmarks/plain_step_cost.py --kinds qa --repeats 1 --profile 30
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import specdec  # noqa: E402
from specdec import cache as cache_mod  # noqa: E402
from specdec import drafters, models, prompts  # noqa: E402
from specdec import policy as policy_mod  # noqa: E402

CONFIGS = ("plain", "zero", "adaptive")


class ForwardClock:
    """Wraps ``specdec.cache.forward``: CPU seconds and input shape of every call."""

    def __init__(self):
        self.calls: list = []  # (rows, tokens, seconds)
        self.inner = cache_mod.forward

    def __call__(self, model, input_ids, *args, **kwargs):
        c0 = time.process_time()
        out = self.inner(model, input_ids, *args, **kwargs)
        self.calls.append((*input_ids.shape, time.process_time() - c0))
        return out


def decode(name: str, target, ids, new: int, batch: int, k: int):
    """(sequences, stats or None) of one configuration."""
    if name == "plain":
        return specdec.reference_generate(target, ids, max_new_tokens=new, batch_size=batch), None
    policy = "adaptive" if name == "adaptive" else policy_mod.ForcedPolicy([[0]] * len(ids))
    res = specdec.generate(target, ids, drafter=drafters.NGramDrafter(), strategy="eqspec",
                           k=k, batch_size=batch, max_new_tokens=new, policy=policy)
    return res.sequences, res.stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default="benchmarks/specbench_sample.jsonl",
                    help="a count of built-in prompts, or a JSONL file in the prompt reader's formats")
    ap.add_argument("--kinds", nargs="+", default=["qa", "math_reasoning"])
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--profile", type=int, default=0, help="top N functions of one cProfile'd call")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    target, tok = models.default_model()
    chosen = (prompts.builtin_prompts()[: int(args.prompts)] if args.prompts.isdigit()
              else prompts.load_jsonl(args.prompts))
    groups = {kind: prompts.encode([p for p in chosen if p.kind == kind], tok) for kind in args.kinds}
    clock = ForwardClock()
    cache_mod.forward = clock  # phases and reference call it through the module
    first = next(iter(groups.values()))
    for name in args.configs:  # warm-up: lazy initialisation out of the figures
        decode(name, target, first[:2], 4, 2, args.k)
    runs = collections.defaultdict(list)  # (kind, config) -> [dict]
    shapes = collections.defaultdict(list)  # (config, rows, tokens) -> [seconds]
    for r in range(args.repeats):
        for kind, ids in groups.items():
            shift = r % len(args.configs)
            for name in args.configs[shift:] + args.configs[:shift]:
                clock.calls.clear()
                c0 = time.process_time()
                seqs, stats = decode(name, target, ids, args.max_new_tokens, args.batch_size, args.k)
                cpu = time.process_time() - c0
                fwd = sum(s for _, _, s in clock.calls)
                for rows, q, s in clock.calls[1:]:  # decode forwards (the first: prefill)
                    shapes[(name, rows, q)].append(s)
                runs[(kind, name)].append({
                    "cpu": cpu, "forward": fwd, "rest": cpu - fwd, "forwards": len(clock.calls),
                    "steps": stats.steps if stats else len(clock.calls) - 1,
                    "widths": dict(stats.widths) if stats else None, "seqs": seqs})
    med = statistics.median
    print(f"SmolLM2 fp32, 1 thread, batch {args.batch_size}, {args.max_new_tokens} new tokens, "
          f"k={args.k}, {args.repeats} interleaved repeats; CPU time, medians over repeats")
    print(f"{'kind':15} {'config':9} {'cpu s':>7} {'fwd s':>7} {'rest ms':>8} {'ms/step':>8} "
          f"{'vs plain':>8} {'fwds':>5}  same  widths (last repeat)")
    for kind in groups:
        base = runs.get((kind, "plain"))
        for name in args.configs:
            rs = runs[(kind, name)]
            rest = med([x["rest"] for x in rs])
            steps = rs[-1]["steps"]
            ratio = med([b["cpu"] for b in base]) / med([x["cpu"] for x in rs]) if base else float("nan")
            same = all(x["seqs"] == base[0]["seqs"] for x in rs) if base else None
            print(f"{kind:15} {name:9} {med([x['cpu'] for x in rs]):7.3f} "
                  f"{med([x['forward'] for x in rs]):7.3f} {1000 * rest:8.1f} "
                  f"{1000 * rest / max(steps, 1):8.2f} {ratio:8.3f} {rs[-1]['forwards']:5d}  "
                  f"{same!s:5} {rs[-1]['widths']}")
    print("decode forwards: median CPU ms per shape (rows x tokens), count")
    for (name, rows, q), v in sorted(shapes.items()):
        print(f"  {name:9} {rows:2d} x {q}: {1000 * med(v):7.1f} ms  ({len(v)})")
    if args.profile:
        cache_mod.forward = clock.inner
        for kind, ids in groups.items():
            for name in args.configs:
                prof = cProfile.Profile()
                prof.enable()
                decode(name, target, ids, args.max_new_tokens, args.batch_size, args.k)
                prof.disable()
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.profile)
                print(f"== cProfile {kind} {name}")
                print("\n".join(out.getvalue().splitlines()[4:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
