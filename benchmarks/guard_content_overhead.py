"""Cost of guard_model's content rules (C1-C3) per forward, against the guard without them.

Runs, interleaved repetition by repetition (the order rotates) so that the ratios see the
same machine noise:

- ``engine``: ``specdec.generate`` (EQSPEC, the n-gram drafter, k=4, batch 8, 16 prompts
  of 1-30 random tokens, 24 new tokens) on ``--model`` (default ``tiny:llama``: where a
  forward is cheap and each checker op weighs, the CPU proxy of a GPU step);
- ``generate``: Hugging Face ``generate``, greedy, the same prompts left-padded in batches
  of 8, 24 new tokens;

each under ``guard_model(target, mode)`` without prompts (``guard``: the coherence
checks) and with prompts (``content``: the same plus C1/C2 before every forward, the
argmax record after it, the cache's wrapped update), for ``--modes`` (default fast and
strict). The time inside the guard's hooks is measured directly (``perf_counter`` and the
thread's CPU time around the pre-hook, the post-hook and the content rules' work in the
cache's wrapped update, whose own test of the layer, a dict lookup, is not timed; the
strict mode's host read is inside the pre-hook; the end-of-run ``check`` and
``check_outputs``, where fast mode reads and applies the rules, are added), summed per
run and divided by the number of forwards. Printed per workload and mode, from the
per-run hook microseconds per forward:

- ``guard us`` and ``content us``: the median over the repeats, and ``min`` beside it (the
  machine is shared: the minimum is the least disturbed run);
- ``rules/guard``: what the content rules add, ``(content - guard) / guard``, the ratio the
  issue bounds by 2 ("the content rules cost at most 2x the guard's current cost per
  forward"), from the medians and from the minima; ``total/guard``: ``content / guard``;
- ``ops``: aten ops per forward dispatched inside the hooks, counted in one more untimed
  run under a ``TorchDispatchMode`` (kernels, then views/scalars apart): the cost a GPU
  pays per launch, independent of the machine's load;

also the whole run's median wall seconds, for scale. ``--json`` writes everything.

    python benchmarks/guard_content_overhead.py --repeats 7
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import specdec  # noqa: E402
from invariants.guard import Guard  # noqa: E402
from specdec import drafters, models  # noqa: E402

transformers.logging.set_verbosity_error()


def prompts_for(n: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 30))] for _ in range(n)]


def timed(fn, box):
    """``fn``, adding its wall seconds to ``box[0]`` and its thread CPU seconds (what the
    hook computed, without the waits of a shared machine) to ``box[1]``."""
    def wrapped(*a, **k):
        t, c = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            box[0] += time.perf_counter() - t
            box[1] += time.thread_time() - c
    return wrapped


class OpCount(TorchDispatchMode):
    """Counts the aten ops dispatched while ``on`` is set: kernels, and views or host
    scalars (an alias of an input, ``scalar_tensor``: no kernel on a GPU) apart."""

    def __init__(self):
        super().__init__()
        self.on, self.kernels, self.views = False, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on:
            ret = func._schema.returns
            alias = ret and ret[0].alias_info is not None and not ret[0].alias_info.is_write
            if alias or func._schema.name == "aten::scalar_tensor":
                self.views += 1
            else:
                self.kernels += 1
        return func(*args, **(kwargs or {}))


def counted(fn, ops):
    def wrapped(*a, **k):
        was, ops.on = ops.on, True
        try:
            return fn(*a, **k)
        finally:
            ops.on = was
    return wrapped


def run_once(workload: str, target, prompts, budget, mode, content: bool, ops=None):
    """((hook wall seconds, hook CPU seconds), forwards, run wall seconds) of one guarded
    run; with ``ops`` (an active ``OpCount``) the hooks' ops are counted instead."""
    box = [0.0, 0.0]
    kw = dict(prompts=prompts, max_new_tokens=budget) if content else {}
    g = Guard(target, mode, **kw)
    wrap = (lambda fn: counted(fn, ops)) if ops is not None else (lambda fn: timed(fn, box))
    g._pre = wrap(g._pre)
    if content:
        g._post = wrap(g._post)
        g.content._learn = wrap(g.content._learn)
        g.content._watching = wrap(g.content._watching)
    g.install()
    t = time.perf_counter()
    try:
        if workload == "engine":
            res = specdec.generate(target, prompts, drafter=drafters.NGramDrafter(), k=4,
                                   batch_size=8, max_new_tokens=budget, stop_token_ids=[])
            outs = res.sequences
        else:
            outs = []
            for i in range(0, len(prompts), 8):
                chunk = prompts[i: i + 8]
                w = max(len(p) for p in chunk)
                ids = torch.tensor([[2] * (w - len(p)) + p for p in chunk])
                mask = torch.tensor([[0] * (w - len(p)) + [1] * len(p) for p in chunk])
                # outputs are not cut at the eos of generate; prompts only share the budget
                gen = target.generate(ids, attention_mask=mask, max_new_tokens=budget,
                                      do_sample=False, pad_token_id=2, eos_token_id=None)
                outs += gen[:, w:].tolist()
        check = wrap(g.check)
        check()
    finally:
        g.remove()
    wall = time.perf_counter() - t
    if content:
        outputs = wrap(g.check_outputs)
        assert outputs(outs) == [] and g.content.skipped == 0 and g.content.unknown == 0
    return tuple(box), g.forwards, wall


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny:llama")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--budget", type=int, default=24)
    ap.add_argument("--modes", nargs="+", default=["fast", "strict"])
    ap.add_argument("--workloads", nargs="+", default=["engine", "generate"])
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    target = models.tiny(args.model.split(":", 1)[1]) if args.model.startswith("tiny:") \
        else models.load(args.model)[0]
    vocab = target.config.get_text_config().vocab_size
    prompts = prompts_for(16, min(vocab, 128))
    configs = [(w, m, c) for w in args.workloads for m in args.modes for c in (False, True)]
    for cfg in configs:  # warm up
        run_once(cfg[0], target, prompts[:8], 4, cfg[1], cfg[2])
    samples = {cfg: [] for cfg in configs}
    for r in range(args.repeats):
        order = configs[r % len(configs):] + configs[: r % len(configs)]
        for cfg in order:
            samples[cfg].append(run_once(cfg[0], target, prompts, args.budget, cfg[1], cfg[2]))
    opcounts = {}
    with OpCount() as ops:
        for cfg in configs:
            ops.kernels = ops.views = 0
            _, f, _ = run_once(cfg[0], target, prompts, args.budget, cfg[1], cfg[2], ops)
            opcounts[cfg] = (ops.kernels / f, ops.views / f)
    print(f"model {args.model}, {len(prompts)} prompts, budget {args.budget}, "
          f"{args.repeats} interleaved repeats, torch threads 1")
    print("hook microseconds per forward (median over the repeats; min: the least disturbed "
          "run; cpu: the hooks' thread CPU time, median)")
    print(f"{'workload':9} {'mode':7} {'fwds':>4} | {'guard':>6} {'min':>5} {'cpu':>5} | "
          f"{'content':>7} {'min':>5} {'cpu':>5} | {'rules/guard':>11} {'min':>5} {'cpu':>5} | "
          f"{'ops guard':>10} {'ops content':>11}")
    report = []
    for w in args.workloads:
        for m in args.modes:
            per = {}
            for c in (False, True):
                s = samples[(w, m, c)]
                us = [h[0] / f * 1e6 for h, f, _ in s]
                cpu = [h[1] / f * 1e6 for h, f, _ in s]
                per[c] = (statistics.median(us), min(us), statistics.median(cpu), s[0][1],
                          statistics.median(x for _, _, x in s), opcounts[(w, m, c)])
            g, c = per[False], per[True]
            rules = [(c[i] - g[i]) / g[i] for i in range(3)]
            print(f"{w:9} {m:7} {c[3]:4d} | {g[0]:6.0f} {g[1]:5.0f} {g[2]:5.0f} | "
                  f"{c[0]:7.0f} {c[1]:5.0f} {c[2]:5.0f} | {rules[0]:11.2f} {rules[1]:5.2f} "
                  f"{rules[2]:5.2f} | {g[5][0]:4.1f}+{g[5][1]:<5.1f} {c[5][0]:5.1f}+{c[5][1]:<5.1f}")
            report.append({"workload": w, "mode": m, "forwards": c[3],
                           "guard_us_per_forward": g[0], "guard_us_min": g[1],
                           "guard_cpu_us": g[2],
                           "content_us_per_forward": c[0], "content_us_min": c[1],
                           "content_cpu_us": c[2],
                           "rules_over_guard": rules[0], "rules_over_guard_min": rules[1],
                           "rules_over_guard_cpu": rules[2],
                           "total_over_guard": c[0] / g[0],
                           "guard_kernels_per_forward": g[5][0],
                           "guard_views_per_forward": g[5][1],
                           "content_kernels_per_forward": c[5][0],
                           "content_views_per_forward": c[5][1],
                           "wall_guard_s": g[4], "wall_content_s": c[4]})
    print("rules/guard = (content - guard) / guard: what the content rules add per forward, "
          "in units of the guard's own cost (the issue's bound: 2); ops = kernels+views per "
          "forward inside the hooks (and the end-of-run reads)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "repeats": args.repeats, "rows": report}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
