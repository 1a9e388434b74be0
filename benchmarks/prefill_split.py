"""What leaving the padding out of a prefill saves (``specdec.cache.prefill``).

A batch of left-padded prompts of mixed lengths computes its padding too. On a CPU the
engine and the plain batched loop split such a prefill into the forwards
``specdec.cache.prefill_groups`` chooses. This script measures, per prompt kind, in one
process with the two interleaved repeat by repeat (the order alternates):

- ``split``: the prefill as shipped (``split_cost``: ``SPLIT_FORWARD_TOKENS`` as it is);
- ``one``: one padded forward (the table emptied, as off a CPU);

for the prefill alone (``reference_generate`` with one new token: the prefill and one
choice) and for the plain batched loop end to end (``--max-new-tokens``), and prints the
padded share of the tokens, the forwards the split used, the median CPU seconds of each
and their ratio (split over one; per repeat, then the median), and whether the token ids
are equal (they should be: every row decodes from its own tokens either way; a near-tie
could flip in the last bit, and is reported, not hidden).

    python benchmarks/prefill_split.py                          # SmolLM2, built-in prompts, batch 8
    python benchmarks/prefill_split.py --kinds rag summarization --repeats 5 --json out.json
    python benchmarks/prefill_split.py --model tiny:llama --repeats 1 --max-new-tokens 4
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

from specdec import cache as cache_mod  # noqa: E402
from specdec import models, prompts  # noqa: E402
from specdec.reference import reference_generate  # noqa: E402

SHIPPED = dict(cache_mod.SPLIT_FORWARD_TOKENS)


def padded_share(ids: list[list[int]], batch: int) -> float:
    """Share of the tokens one padded forward per batch computes that are padding."""
    real = padded = 0
    for i in range(0, len(ids), batch):
        chunk = [len(p) for p in ids[i : i + batch]]
        real, padded = real + sum(chunk), padded + len(chunk) * max(chunk)
    return 1.0 - real / padded


def forwards_of(model, ids: list[list[int]], batch: int) -> int:
    """Prefill forwards of the shipped split over every batch (on a CPU)."""
    per = cache_mod.split_cost(model, torch.device("cpu"))
    n = 0
    for i in range(0, len(ids), batch):
        counts = sorted(len(p) for p in ids[i : i + batch])
        n += 1 if per is None or len(counts) == 1 else max(len(cache_mod.prefill_groups(counts, per)), 1)
    return n


def run(model, ids, new: int, batch: int, split: bool):
    cache_mod.SPLIT_FORWARD_TOKENS = dict(SHIPPED) if split else {}
    try:
        c0 = time.process_time()
        out = reference_generate(model, ids, max_new_tokens=new, batch_size=batch,
                                 stop_token_ids=[])
        return time.process_time() - c0, out
    finally:
        cache_mod.SPLIT_FORWARD_TOKENS = dict(SHIPPED)


def measure(model, ids, new: int, batch: int, repeats: int) -> dict:
    times = {True: [], False: []}
    outs = {}
    run(model, ids[:batch], 1, batch, True)  # warm-up
    for rep in range(repeats):
        for split in ((True, False) if rep % 2 == 0 else (False, True)):
            t, out = run(model, ids, new, batch, split)
            times[split].append(t)
            outs[split] = out
    ratios = [a / b for a, b in zip(times[True], times[False])]
    return {"split_s": statistics.median(times[True]), "one_s": statistics.median(times[False]),
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "same": outs[True] == outs[False]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default SmolLM2-135M-Instruct; tiny:FAMILY, ...")
    ap.add_argument("--kinds", nargs="*", default=None, help="built-in prompt kinds (default all)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = models.resolve(args.model)
    chosen = prompts.builtin_prompts()
    kinds = args.kinds or list(dict.fromkeys(p.kind for p in chosen))
    rows = []
    print(f"model {args.model or models.DEFAULT_MODEL_NAME}, batch {args.batch_size}, "
          f"{args.repeats} interleaved repeats, torch threads {args.threads}, split cost per "
          f"forward {SHIPPED}; CPU seconds, median; ratio: split / one forward, median "
          f"[min-max] of the per-repeat ratios")
    head = (f"{'kind':<14} {'padding':>8} {'fwds':>5} {'prefill split':>14} {'one':>7} {'ratio':>18}"
            f" {'loop split':>14} {'one':>7} {'ratio':>18} {'same':>5}")
    print(head)
    print("-" * len(head))
    for kind in kinds:
        group = [p for p in chosen if p.kind == kind]
        vocab = models.vocab_size(model)
        ids = prompts.encode(group, tok) if tok is not None else \
            [[3 + (7 * i + j) % (vocab - 3) for j in range(5 + 11 * i)] for i in range(len(group))]
        pre = measure(model, ids, 1, args.batch_size, args.repeats)
        end = measure(model, ids, args.max_new_tokens, args.batch_size, args.repeats)
        row = {"kind": kind, "prompts": len(ids), "padding": padded_share(ids, args.batch_size),
               "forwards": forwards_of(model, ids, args.batch_size), "prefill": pre, "end_to_end": end}
        rows.append(row)

        def fmt(m):
            return (f"{m['split_s']:>14.2f} {m['one_s']:>7.2f} "
                    f"{m['ratio']:>6.2f} [{m['ratio_min']:.2f}-{m['ratio_max']:.2f}]")
        print(f"{kind:<14} {row['padding'] * 100:>7.0f}% {row['forwards']:>5} {fmt(pre)}"
              f" {fmt(end)} {'yes' if pre['same'] and end['same'] else 'NO':>5}")
    geo = lambda key: statistics.geometric_mean([r[key]["ratio"] for r in rows])  # noqa: E731
    print(f"geometric mean over kinds: prefill {geo('prefill'):.2f}, plain loop end to end "
          f"({args.max_new_tokens} new tokens) {geo('end_to_end'):.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "split": SHIPPED, "rows": rows},
                                              indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
