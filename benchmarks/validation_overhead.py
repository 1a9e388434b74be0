"""Cost of the run-time validation (issue 11): drafts checked every step, hooks' writes.

Compares, in one process, interleaved repetition by repetition (the order rotates), the
engine as shipped with the engine without its run-time checks, under three hook settings
(no hooks, a fast Monitor, a strict Monitor):

- ``validated``: as shipped: ``validation.checked_drafts`` after every ``propose`` (clamp
  and flag on the device, the flag read with the step's one host read) and
  ``validation.HookWatch`` around every hook (version counters);
- ``unvalidated``: the same engine with its run-time checks taken out: drafts checked for
  shape only (as before issue 11), ``sync`` without the flag, no HookWatch. The up-front
  checks of ``generate`` run in both (they are per call, not per step).

Then the choice of the read-only view, under a fast Monitor with drafts checked:
``unprotected`` (no protection), ``version`` (as shipped), ``clone`` (hooks get copies of
every view tensor), ``subclass`` (hooks get tensors of a subclass that refuses in-place
ops in ``__torch_function__``).

The default setting is the checker issue's cheap-model one: tiny Llama, one thread, 16
seeded prompts of 1-30 tokens, batch 8, k=4, 32 new tokens, n-gram drafter. Outputs of
every configuration are compared with each other (``same``).

    python benchmarks/validation_overhead.py --repeats 9
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import specdec  # noqa: E402
from invariants import Monitor  # noqa: E402
from invariants.view import StepView  # noqa: E402
from specdec import batch as batch_mod  # noqa: E402
from specdec import drafters, layout, models, phases, validation  # noqa: E402


def sync_without_flag(ctx, state, batch, spec):
    """``phases.sync`` as shipped, without the out-of-vocabulary flag in its one read."""
    b = batch.batch_size
    max_n = layout.new_width(layout.TORCH, batch.lengths, spec.committed, ~batch.finished)
    scalars = torch.stack([max_n, spec.limit.sum(), spec.accepted.sum(), spec.committed.sum()])
    host = torch.cat([batch.finished.long(), spec.committed, scalars]).tolist()
    st = state.stats
    st.steps += 1
    st.drafted += host[2 * b + 1]
    st.accepted += host[2 * b + 2]
    st.committed += host[2 * b + 3]
    if ctx.hooks:
        st.accepted_history.append(spec.accepted.tolist())
    state.step += 1
    return phases.HostStep([bool(f) for f in host[:b]], host[2 * b], host[b : 2 * b])


def shape_only(drafts, b, k, device, vocab, step):
    if tuple(drafts.shape) != (b, k):
        raise ValueError(f"drafter returned drafts of shape {list(drafts.shape)}, expected [{b}, {k}]")
    return drafts, None


class NoWatch:
    def __init__(self, view, stores=()):
        pass

    def check(self, hook):
        pass


class ReadOnly(torch.Tensor):
    """A tensor that refuses in-place ops (results are plain tensors)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inplace = (name.endswith("_") and not name.endswith("__")) \
            or name in ("__setitem__", "__iadd__", "__isub__", "__imul__")
        if (inplace and args and isinstance(args[0], ReadOnly)) \
                or isinstance(kwargs.get("out"), ReadOnly):
            raise RuntimeError(f"hooks must not modify the view: {name}")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _view_factory(wrap):
    """A StepView constructor whose tensor fields (and forward record) are ``wrap``ped."""
    names = set(validation.VIEW_TENSORS)

    def make(**kw):
        for n in names & kw.keys():
            if kw[n] is not None:
                kw[n] = wrap(kw[n])
        fwd = kw.get("forward")
        if fwd is not None:
            kw["forward"] = type(fwd)(wrap(fwd.input_ids), wrap(fwd.positions),
                                      wrap(fwd.attention_mask), fwd.cache_width)
        return StepView(**kw)
    return make


@contextlib.contextmanager
def variant(validate: str, protect: str):
    """Patch the engine for one run: ``validate`` in validated|unvalidated, ``protect``
    in version|unprotected|clone|subclass."""
    saved = (phases.sync, validation.checked_drafts, validation.HookWatch, batch_mod.StepView)
    try:
        if validate == "unvalidated":
            phases.sync, validation.checked_drafts = sync_without_flag, shape_only
        if protect != "version":
            validation.HookWatch = NoWatch
        if protect == "clone":
            batch_mod.StepView = _view_factory(lambda t: t.clone())
        elif protect == "subclass":
            batch_mod.StepView = _view_factory(lambda t: t.as_subclass(ReadOnly))
        yield
    finally:
        phases.sync, validation.checked_drafts, validation.HookWatch, batch_mod.StepView = saved


CONFIGS = {  # name: (hooks, validate, protect)
    "none/unvalidated": ("none", "unvalidated", "unprotected"),
    "none/validated": ("none", "validated", "version"),
    "fast/unvalidated": ("fast", "unvalidated", "unprotected"),
    "fast/validated": ("fast", "validated", "version"),
    "strict/unvalidated": ("strict", "unvalidated", "unprotected"),
    "strict/validated": ("strict", "validated", "version"),
    "fast/unprotected": ("fast", "validated", "unprotected"),
    "fast/clone": ("fast", "validated", "clone"),
    "fast/subclass": ("fast", "validated", "subclass"),
}
#: (validated config, its baseline): the acceptance figures
PAIRS = [("none/validated", "none/unvalidated"), ("fast/validated", "fast/unvalidated"),
         ("strict/validated", "strict/unvalidated"), ("fast/validated", "fast/unprotected"),
         ("fast/clone", "fast/unprotected"), ("fast/subclass", "fast/unprotected")]


def run_once(config, target, ids, args):
    hooks_kind, validate, protect = CONFIGS[config]
    mon = Monitor(hooks_kind) if hooks_kind != "none" else None
    with variant(validate, protect):
        t0, c0 = time.perf_counter(), time.process_time()
        res = specdec.generate(target, ids, drafter=drafters.NGramDrafter(), k=args.k,
                               batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                               hooks=[mon] if mon else [], strategy=args.strategy)
        if mon is not None:
            mon.check()
        clock = time.process_time() - c0 if args.clock == "cpu" else time.perf_counter() - t0
        return clock, res.sequences, res.stats.steps


def count_ops(config, target, ids, args) -> int:
    """aten ops dispatched by one run of ``config`` (a TorchDispatchMode counter)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args_=(), kwargs=None):
            Count.n += 1
            return func(*args_, **(kwargs or {}))

    with Count():
        run_once(config, target, ids, args)
    return Count.n


COMPONENT_ROUNDS = 7


def _timed(fn, clock, loops: int) -> float:
    """Seconds per call of ``fn``: median over rounds of a tight loop."""
    rounds = []
    for _ in range(COMPONENT_ROUNDS):
        t0 = clock()
        for _ in range(loops):
            fn()
        rounds.append((clock() - t0) / loops)
    return statistics.median(rounds)


def measure_components(target, ids, args) -> dict:
    """Each run-time check alone, on the tensors of a real step (per step: one drafts
    check, one sync with the extra flag, one HookWatch per phase and hook)."""
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    n = args.component_loops
    views = []
    ctx = phases.Context(target=target, drafter=drafters.NGramDrafter(), k=args.k,
                         hooks=(lambda phase, view: views.append(view),),
                         stop_ids=torch.tensor([2]), max_position=10**6)
    state = phases.State()
    with torch.no_grad():
        rows = min(args.batch_size, len(ids))
        batch = phases.prefill(ctx, state, ids[:rows], list(range(rows)), [args.max_new_tokens] * rows)
        spec = phases.speculate(ctx, state, batch)
    proposed = spec.proposed
    b, k, dev, vocab = batch.batch_size, args.k, batch.device, ctx.vocab
    stores = batch.stores()

    def new_sync():
        phases.sync(ctx, state, batch, spec)

    def old_sync():
        sync_without_flag(ctx, state, batch, spec)

    def watch_all_phases():
        for v in views:  # prefill, draft, verify, commit
            validation.HookWatch(v, stores).check(None)
    out = {
        "checked_drafts (dtype, device, shape, clamp, flag)":
            _timed(lambda: validation.checked_drafts(proposed, b, k, dev, vocab, 0), clock, n),
        "sync: extra flag in the one read": _timed(new_sync, clock, n) - _timed(old_sync, clock, n),
        f"HookWatch, {len(views)} phases x 1 hook": _timed(watch_all_phases, clock, n),
    }
    out["total per step"] = sum(out.values())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny:llama")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=1)
    ap.add_argument("--max-len", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--strategy", default="eqspec")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--clock", default="cpu", choices=("cpu", "wall"),
                    help="cpu: process CPU time (one thread; less disturbed by other processes "
                         "on a shared machine than wall time); wall: perf_counter")
    ap.add_argument("--component-loops", type=int, default=2000,
                    help="calls per round when timing each check alone")
    ap.add_argument("--json", default=None, help="write the results to this JSON file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    target, _ = models.resolve(args.model)
    vocab = models.vocab_size(target)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.prompts,), generator=g).tolist()
    ids = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]

    configs = args.configs
    for c in configs:  # warm-up
        run_once(c, target, ids[:2], args)
    times: dict = {c: [] for c in configs}
    outputs: dict = {}
    steps = 0
    for rep in range(args.repeats):
        order = configs[rep % len(configs):] + configs[: rep % len(configs)]
        for c in order:
            secs, seqs, steps = run_once(c, target, ids, args)
            times[c].append(secs)
            outputs.setdefault(c, seqs)
    first = outputs[configs[0]]
    tokens = sum(len(s) for s in first)
    print(f"model {args.model}, {args.threads} thread(s), {len(ids)} prompts of "
          f"{min(lengths)}-{max(lengths)} tokens, batch {args.batch_size}, k={args.k}, "
          f"{args.max_new_tokens} new tokens, {args.strategy}, n-gram drafter, "
          f"{args.repeats} interleaved repeats, {tokens} tokens and {steps} steps per run, "
          f"{args.clock} time")
    head = f"{'config':<20} {'median s':>9} {'min s':>8} {'same':>5}"
    print(head)
    print("-" * len(head))
    rows = []
    for c in configs:
        med, low = statistics.median(times[c]), min(times[c])
        same = outputs[c] == first
        rows.append({"config": c, "median_seconds": med, "min_seconds": low, "identical": same,
                     "seconds": times[c]})
        print(f"{c:<20} {med:>9.4f} {low:>8.4f} {'yes' if same else 'NO':>5}")
    print()
    print(f"{'cost of':<20} {'against':<20} {'median':>8} {'min':>8} {'paired':>8}")
    pairs = []
    for a, b in PAIRS:
        if a in times and b in times:
            med = statistics.median(times[a]) / statistics.median(times[b]) - 1
            low = min(times[a]) / min(times[b]) - 1
            # per repeat ratio (both ran in the same round), then the median over rounds
            paired = statistics.median(x / y for x, y in zip(times[a], times[b])) - 1
            pairs.append({"config": a, "baseline": b, "median": med, "min": low, "paired": paired})
            print(f"{a:<20} {b:<20} {med * 100:>7.1f}% {low * 100:>7.1f}% {paired * 100:>7.1f}%")
    ops = {c: count_ops(c, target, ids, args) for c in configs if CONFIGS[c][2] in
           ("version", "unprotected") and c.endswith("validated")}
    if any(a in ops and b in ops for a, b in PAIRS[:3]):
        print(f"\naten ops dispatched per step (deterministic; on a GPU about one kernel launch "
              f"each):")
        for a, b in PAIRS[:3]:
            if a in ops and b in ops:
                print(f"  {a:<20} {ops[a] / steps:>8.1f}   {b:<20} {ops[b] / steps:>8.1f}   "
                      f"+{(ops[a] - ops[b]) / steps:.1f} per step ({(ops[a] / ops[b] - 1) * 100:+.2f}%)")
    components = measure_components(target, ids, args)
    base = statistics.median(times[configs[0]]) / steps
    print(f"\nper-step cost of each run-time check, timed alone ({args.clock} time, median of "
          f"{COMPONENT_ROUNDS} rounds of {args.component_loops} calls), against {base * 1e3:.2f} ms "
          f"per step of {configs[0]}:")
    for name, secs in components.items():
        print(f"  {name:<44} {secs * 1e6:>7.1f} us  {secs / base * 100:>5.2f}%")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        meta = {k: v for k, v in vars(args).items() if k != "json"}
        meta.update(tokens=tokens, torch=torch.__version__, lengths=lengths)
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows, "pairs": pairs,
                                               "ops_per_run": ops, "components": components},
                                              indent=2))
        print(f"wrote {args.json}")
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
