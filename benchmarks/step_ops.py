"""What one plain decode step dispatches: the project's plain batched loop
(``reference_generate``) next to Hugging Face's ``generate``, per step at steady state.

A CPU proxy for GPU cost (issue #19, point 4): on a GPU every aten op that computes is a
kernel launch, and every host read a stream synchronisation. Counts the aten ops (by
name) and the host reads (``invariants.testing.no_host_transfers``) of two runs that
differ only in their number of new tokens, and divides the difference by the extra steps,
so prefill and per-call work cancel out. Counts, not times: they do not depend on the
machine's load.

    python benchmarks/step_ops.py                          # tiny Llama, fp32, batch 8
    python benchmarks/step_ops.py --dtype bfloat16 --model tiny:qwen3 --top 30
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import specdec  # noqa: E402
from invariants.testing import no_host_transfers  # noqa: E402
from specdec import models  # noqa: E402
from specdec.reference import hf_generate  # noqa: E402


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched inside the block, by name."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def per_step(decode, short: int, long: int) -> tuple[dict, float]:
    """({op: count per step}, host reads per step) of ``decode(new_tokens)``."""
    runs = []
    for new in (short, long):
        with no_host_transfers(raise_on_transfer=False) as log, OpCounter() as counter:
            decode(new)
        runs.append((counter.ops, log.reads))
    (ops_a, reads_a), (ops_b, reads_b) = runs
    steps = long - short
    ops = {k: (ops_b[k] - ops_a[k]) / steps for k in set(ops_a) | set(ops_b)}
    return {k: v for k, v in ops.items() if v}, (reads_b - reads_a) / steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny:llama", help="tiny:FAMILY (default tiny:llama)")
    ap.add_argument("--dtype", default="float32", choices=tuple(models.DTYPES))
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--top", type=int, default=20, help="op names to list (default 20)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    target, _ = models.resolve(args.model, dtype=args.dtype)
    vocab = models.vocab_size(target)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(10, 40, (args.batch_size,), generator=g).tolist()
    ids = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    loops = {
        "plain loop": lambda new: specdec.reference_generate(
            target, ids, max_new_tokens=new, batch_size=args.batch_size, stop_token_ids=[]),
        "hf generate": lambda new: hf_generate(target, ids, max_new_tokens=new,
                                               batch_size=args.batch_size, stop_token_ids=[]),
    }
    for decode in loops.values():  # warm-up: lazy initialisation out of the counts
        decode(2)
    got = {name: per_step(decode, 9, 17) for name, decode in loops.items()}
    names = list(got)
    print(f"{args.model} ({args.dtype}), batch {args.batch_size}: per decode step")
    print(f"{'':32} " + " ".join(f"{n:>12}" for n in names))
    print(f"{'aten ops':32} " + " ".join(f"{sum(got[n][0].values()):>12.1f}" for n in names))
    print(f"{'host reads':32} " + " ".join(f"{got[n][1]:>12.1f}" for n in names))
    every = collections.Counter()
    for ops, _ in got.values():
        every.update(ops)
    for op, _ in every.most_common(args.top):
        print(f"  {op:30} " + " ".join(f"{got[n][0].get(op, 0):>12.1f}" for n in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
