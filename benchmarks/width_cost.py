"""What a wider verify step costs on this machine, and the acceptance that pays for it.

Speculation pays only when a verify step of width ``w`` (the pending token and ``w - 1``
drafts per row) costs less than the tokens it is expected to commit. This script times
one cached forward of every width ``1 .. k+1`` at each batch size, on a cache already
holding ``--context`` tokens per row, interleaved (every repeat runs every width in a
rotated order, the cache cropped back after each forward), and prints per batch size and
width:

- the median CPU milliseconds of the forward (process CPU time: steadier than wall time
  on a shared machine; the wall figure is printed next to it);
- ``r(w)``: its cost over a width-1 forward at the same batch size (median over repeats of
  the per-repeat ratio), the price ``specdec.policy.StepCosts`` learns online;
- ``p*``: the break-even acceptance per draft slot, the ``p`` with
  ``1 + p + ... + p^(w-1) = r(w)`` (a row whose drafts are each accepted with probability
  ``p`` given the ones before them commits that many tokens in expectation); "never"
  when ``r(w) >= w`` (even drafts that are always accepted do not pay).

    python benchmarks/width_cost.py                                  # SmolLM2, batch 1 and 8
    python benchmarks/width_cost.py --batch-sizes 1 4 8 16 --k 10 --repeats 9
    python benchmarks/width_cost.py --model tiny:llama --json width.json
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
from specdec import models  # noqa: E402


def break_even(ratio: float, width: int) -> float | None:
    """The acceptance ``p`` per slot at which ``width - 1`` drafts commit ``ratio`` tokens
    in expectation (``1 + p + ... + p^(width-1) = ratio``); None when ``ratio >= width``
    (no acceptance pays), 0.0 when ``ratio <= 1``."""
    if ratio >= width:
        return None
    if ratio <= 1.0 or width == 1:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(60):  # the expectation is increasing in p: bisection
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(width)) < ratio:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def time_widths(model, batch: int, widths: list[int], context: int, repeats: int,
                seed: int = 0) -> dict:
    """{width: [(cpu seconds, wall seconds) per repeat]}: one cached forward of each
    width over ``batch`` rows holding ``context`` tokens, widths rotated per repeat."""
    dev = next(model.parameters()).device
    vocab = models.vocab_size(model)
    g = torch.Generator().manual_seed(seed)
    total = context + max(widths)
    ids = torch.randint(0, vocab, (batch, total), generator=g).to(dev)  # [B, C + w]
    pos = torch.arange(total, device=dev)[None, :].expand(batch, total)  # [B, C + w]
    valid = torch.ones(batch, total, dtype=torch.bool, device=dev)  # [B, C + w]
    cache = cache_mod.new_cache(model, total)
    with torch.no_grad():
        cache_mod.forward(model, ids[:, :context], pos[:, :context], valid[:, :context], cache,
                          last_logits=True)
        out: dict = {w: [] for w in widths}
        cache_mod.forward(model, ids[:, context:context + 1], pos[:, context:context + 1],
                          valid[:, :context + 1], cache)  # warm-up, then cropped back
        cache.crop(context)
        for r in range(repeats):
            order = widths[r % len(widths):] + widths[:r % len(widths)]
            for w in order:
                sl = slice(context, context + w)
                c0, t0 = time.process_time(), time.perf_counter()
                cache_mod.forward(model, ids[:, sl], pos[:, sl], valid[:, :context + w], cache)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                out[w].append((time.process_time() - c0, time.perf_counter() - t0))
                cache.crop(context)
    return out


def summarise(times: dict) -> list[dict]:
    """Rows per width: median CPU and wall ms, r(w) (median per-repeat ratio to width 1,
    CPU time) and the break-even acceptance."""
    base = times[1]
    rows = []
    for w, runs in sorted(times.items()):
        ratio = statistics.median(c / b[0] for (c, _), b in zip(runs, base))
        rows.append({"width": w, "cpu_ms": 1e3 * statistics.median(c for c, _ in runs),
                     "wall_ms": 1e3 * statistics.median(t for _, t in runs),
                     "ratio": ratio, "break_even": break_even(ratio, w)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct; or tiny:FAMILY, a path")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--k", type=int, default=10, help="widest step: k drafts (default 10)")
    ap.add_argument("--context", type=int, default=200, help="tokens cached per row (default 200)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    for name, value, least in (("--k", args.k, 1), ("--context", args.context, 1),
                               ("--repeats", args.repeats, 1)):
        if value < least:
            raise SystemExit(f"{name} must be at least {least}, got {value}")
    if any(b < 1 for b in args.batch_sizes):
        raise SystemExit(f"--batch-sizes must be at least 1, got {args.batch_sizes}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _tok = models.resolve(args.model)
    name = args.model or models.DEFAULT_MODEL_NAME
    widths = list(range(1, args.k + 2))
    print(f"model {name}, {args.context} cached tokens per row, widths 1..{args.k + 1}, "
          f"{args.repeats} interleaved repeats, torch threads {torch.get_num_threads()}")
    report = {"model": name, "context": args.context, "repeats": args.repeats, "batches": {}}
    for b in args.batch_sizes:
        rows = summarise(time_widths(model, b, widths, args.context, args.repeats))
        report["batches"][b] = rows
        print(f"\nbatch {b}\n{'width':>5} {'cpu ms':>8} {'wall ms':>8} {'r(w)':>6} {'p*':>6}")
        for row in rows:
            p = "-" if row["width"] == 1 else "never" if row["break_even"] is None \
                else f"{row['break_even']:.2f}"
            print(f"{row['width']:>5} {row['cpu_ms']:>8.1f} {row['wall_ms']:>8.1f} "
                  f"{row['ratio']:>6.2f} {p:>6}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
