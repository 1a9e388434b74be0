"""Cost of guard_model's content rules (C1-C3) per forward, against the guard without them.

Runs, interleaved repetition by repetition (the order rotates) so that the ratios see the
same machine noise:

- ``engine``: ``specdec.generate`` (EQSPEC, the n-gram drafter, k=4, batch 8, 16 prompts
  of 1-30 random tokens, 24 new tokens) on ``--model`` (default ``tiny:llama``: where a
  forward is cheap and each checker op weighs, the CPU proxy of a GPU step);
- ``generate``: Hugging Face ``generate``, greedy, the same prompts left-padded in batches
  of 8, 24 new tokens;

each under ``guard_model(target, mode)`` without prompts (``guard``) and with prompts
(``content``: C1/C2 before every forward, the argmax record after it, the cache's wrapped
update), for ``--modes`` (default fast and strict). The time inside the guard's hooks is
measured directly (``perf_counter`` around the pre-hook, the post-hook and the learned
update; the strict mode's host read is inside the pre-hook), summed per run and divided by
the number of forwards. Printed: the median hook microseconds per forward of each, and
``content / guard``, the ratio the issue bounds by 2; also the whole run's median wall
seconds, for scale. ``--json`` writes everything.

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

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import specdec  # noqa: E402
from invariants.guard import Guard  # noqa: E402
from specdec import drafters, models  # noqa: E402

transformers.logging.set_verbosity_error()


def prompts_for(n: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 30))] for _ in range(n)]


def timed(fn, box):
    def wrapped(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            box[0] += time.perf_counter() - t
    return wrapped


def run_once(workload: str, target, prompts, budget, mode, content: bool):
    """(hook seconds, forwards, wall seconds) of one guarded run."""
    box = [0.0]
    kw = dict(prompts=prompts, max_new_tokens=budget) if content else {}
    g = Guard(target, mode, **kw)
    g._pre = timed(g._pre, box)
    if content:
        g._post = timed(g._post, box)
        g.content._learn = timed(g.content._learn, box)
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
        t0 = time.perf_counter()
        g.check()
        box[0] += time.perf_counter() - t0
    finally:
        g.remove()
    wall = time.perf_counter() - t
    if content:
        t0 = time.perf_counter()
        assert g.check_outputs(outs) == [] and g.content.skipped == 0
        box[0] += time.perf_counter() - t0
    return box[0], g.forwards, wall


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
    print(f"model {args.model}, {len(prompts)} prompts, budget {args.budget}, "
          f"{args.repeats} interleaved repeats, torch threads 1")
    print(f"{'workload':9} {'mode':7} {'forwards':>8} {'guard us/fwd':>13} "
          f"{'content us/fwd':>15} {'content/guard':>14} {'wall guard s':>13} {'wall content s':>15}")
    report = []
    for w in args.workloads:
        for m in args.modes:
            per = {}
            for c in (False, True):
                s = samples[(w, m, c)]
                per[c] = (statistics.median(h / f for h, f, _ in s), s[0][1],
                          statistics.median(x for _, _, x in s))
            ratio = per[True][0] / per[False][0]
            print(f"{w:9} {m:7} {per[True][1]:8d} {per[False][0] * 1e6:13.0f} "
                  f"{per[True][0] * 1e6:15.0f} {ratio:14.2f} {per[False][2]:13.3f} "
                  f"{per[True][2]:15.3f}")
            report.append({"workload": w, "mode": m, "forwards": per[True][1],
                           "guard_us_per_forward": per[False][0] * 1e6,
                           "content_us_per_forward": per[True][0] * 1e6, "ratio": ratio,
                           "wall_guard_s": per[False][2], "wall_content_s": per[True][2]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "repeats": args.repeats, "rows": report}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
