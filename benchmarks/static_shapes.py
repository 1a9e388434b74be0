"""Static shapes (issue #19, point 2) against eager widths, side by side in one process.

For each engine (the plain batched loop, EQSPEC with the n-gram drafter under the
adaptive and the fixed draft-length policy) and each ``--compile`` mode, runs eager
widths and ``static_shapes=True`` interleaved (the order alternates between repeats) and
prints, per configuration: tokens/s (wall), the static/eager ratio of wall time and of
CPU time per repeat (median, min-max), the distinct forward input shapes of one run
against its decode/verify forwards (counts: machine-independent), the verify widths
used, and whether every row equals batch-1 greedy decoding. With ``--compile
inductor`` it also counts, in one cold run per configuration (dynamo reset first, not
timed), the graphs dynamo compiled (``torch._dynamo.utils.counters``).

    python benchmarks/static_shapes.py                    # SmolLM2, batch 8, 8 chat prompts
    python benchmarks/static_shapes.py --compile none inductor --repeats 2 \
        --engines plain-loop eqspec/adaptive
    python benchmarks/static_shapes.py --model tiny:llama --prompts 8 --max-new-tokens 24
    python benchmarks/static_shapes.py --kinds rag --drafter scripted:0.6 --engines eqspec/adaptive
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))

import specdec  # noqa: E402
from specdec import compiled, drafters, models, prompts  # noqa: E402


class Shapes:
    """Distinct (input_ids, position_ids, mask) shapes of a model's forwards after each
    prefill (a forward on an empty cache), and how many such forwards ran."""

    def __init__(self, model):
        self.shapes: set = set()
        self.forwards = 0
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        cache = kwargs.get("cache")
        if cache is None or cache.width == 0:
            return
        mask = kwargs["attention_mask"]
        masks = mask.values() if isinstance(mask, dict) else [mask]
        self.forwards += 1
        self.shapes.add((tuple(kwargs["input_ids"].shape),) + tuple(tuple(m.shape) for m in masks))

    def remove(self):
        self.handle.remove()


def engines(k: int, drafter=drafters.NGramDrafter):
    """(name, run(model, ids, new, static, mode) -> (sequences, widths)); ``drafter()``
    makes each speculative run's drafter."""
    def plain(model, ids, new, static, mode):
        out = specdec.reference_generate(model, ids, max_new_tokens=new, batch_size=len(ids),
                                         stop_token_ids=[], static_shapes=static, compile=mode)
        return out, {1: None}

    def eqspec(policy):
        def run(model, ids, new, static, mode):
            res = specdec.generate(model, ids, drafter=drafter(), k=k,
                                   batch_size=len(ids), max_new_tokens=new, stop_token_ids=[],
                                   policy=policy, static_shapes=static, compile=mode)
            return res.sequences, dict(res.stats.widths)
        return run

    return [("plain-loop", plain), ("eqspec/adaptive", eqspec("adaptive")),
            ("eqspec/fixed", eqspec("fixed"))]


def timed(run, model, ids, new, static, mode):
    t0, c0 = time.perf_counter(), time.process_time()
    out = run(model, ids, new, static, mode)
    return out, time.perf_counter() - t0, time.process_time() - c0


def cold_graphs(run, model, ids, new, static, mode) -> int:
    """Graphs dynamo compiles in a cold run (its caches and specdec's reset first)."""
    torch._dynamo.reset()
    compiled._COMPILED.clear()
    torch._dynamo.utils.counters.clear()
    run(model, ids, new, static, mode)
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--prompts", type=int, default=8, help="built-in prompts of --kinds")
    ap.add_argument("--kinds", nargs="*", default=["chat"])
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile", nargs="+", default=["none"], choices=["none", "inductor"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--drafter", default="ngram",
                    help="ngram, or scripted:P (batch-1 greedy output corrupted to accept ~P)")
    ap.add_argument("--engines", nargs="+", default=[n for n, _ in engines(0)],
                    choices=[n for n, _ in engines(0)])
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = models.resolve(args.model)
    chosen = [p for p in prompts.builtin_prompts() if not args.kinds or p.kind in args.kinds]
    chosen = chosen[: args.prompts]
    ids = prompts.encode(chosen, tok) if tok is not None else \
        [[(7 * i + j) % 90 + 3 for j in range(6 + 3 * i)] for i in range(args.prompts)]
    new = args.max_new_tokens
    modes = [None if m == "none" else m for m in args.compile]
    reference = specdec.reference_generate(model, ids, max_new_tokens=new, stop_token_ids=[])
    make = drafters.NGramDrafter
    if args.drafter.startswith("scripted:"):
        from throughput import corrupt_for_acceptance  # benchmarks/throughput.py

        scripts = corrupt_for_acceptance(reference, float(args.drafter.split(":")[1]), args.k,
                                         models.vocab_size(model))
        make = lambda: drafters.ScriptedDrafter(scripts)  # noqa: E731
    elif args.drafter != "ngram":
        raise SystemExit(f"--drafter must be ngram or scripted:P, got {args.drafter!r}")
    configs = [(name, run, mode) for name, run in engines(args.k, make) if name in args.engines
               for mode in modes]
    rows = []
    for name, run, mode in configs:  # warm-up (and the compiled regions' compilation)
        for static in (False, True):
            run(model, ids, new, static, mode)
    runs = {(name, mode): {False: [], True: []} for name, _, mode in configs}
    for r in range(args.repeats):
        for name, run, mode in configs:
            for static in ((False, True) if r % 2 == 0 else (True, False)):
                (seqs, widths), wall, cpu = timed(run, model, ids, new, static, mode)
                runs[(name, mode)][static].append((wall, cpu, seqs, widths))
    for name, run, mode in configs:
        shape_counts = {}
        for static in (False, True):
            rec = Shapes(model)
            try:
                run(model, ids, new, static, mode)
            finally:
                rec.remove()
            shape_counts[static] = (len(rec.shapes), rec.forwards)
        graphs = {s: cold_graphs(run, model, ids, new, s, mode) for s in (False, True)} \
            if mode is not None else None
        for static in (False, True):
            mine, other = runs[(name, mode)][static], runs[(name, mode)][not static]
            tokens = sum(len(s) for s in mine[0][2])
            wall = statistics.median(m[0] for m in mine)
            ratios = [m[0] / o[0] for m, o in zip(mine, other)]
            cpu_ratios = [m[1] / o[1] for m, o in zip(mine, other)]
            exact = sum(a == b for m in mine for a, b in zip(m[2], reference)) / (len(ids) * len(mine))
            rows.append((f"{name}{'' if mode is None else '+' + mode}", "static" if static else "eager",
                         tokens / wall, ratios, cpu_ratios, shape_counts[static], mine[0][3],
                         None if graphs is None else graphs[static], exact))
    print(f"model {args.model}, {len(ids)} prompts, batch {len(ids)}, {new} new tokens, k {args.k}, "
          f"{args.repeats} interleaved repeats, {args.threads} thread(s)")
    print(f"{'engine':<28}{'shapes':<8}{'tok/s':>7}  {'vs other: wall (min-max)':<26}{'cpu':>6}  "
          f"{'fwd shapes':>11}  {'graphs':>6}  {'exact':>6}  widths")
    for eng, kind, tps, ratios, cpu_ratios, (shp, fwd), widths, graphs, exact in rows:
        span = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        print(f"{eng:<28}{kind:<8}{tps:>7.1f}  {span:<26}{statistics.median(cpu_ratios):>6.2f}  "
              f"{f'{shp}/{fwd}':>11}  {'-' if graphs is None else graphs:>6}  {exact:>6.0%}  "
              f"{widths if widths != {1: None} else '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
