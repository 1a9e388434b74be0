"""Cost of checking: specdec.generate with no hooks vs the invariants Monitor (and guard).

Two settings, side by side in one report:

- ``cheap``: where the model is cheap and each checker op weighs (the CPU proxy of a GPU
  step): a tiny Llama (``tiny:llama``), 16 prompts of 1-30 random tokens, batch 8, k=4,
  the n-gram drafter, one torch thread;
- ``real``: the shipped SmolLM2-135M-Instruct on the built-in prompts (``--model`` picks
  another: ``llama-1b-random`` is a Llama-3.2-1B-shaped config with random weights, bf16
  on CUDA, for GPU runs; ``tiny:FAMILY``, a local path or a hub name also work).

Each setting runs every strategy of ``--strategies`` (default EQSPEC and holes) under
every configuration, interleaved repetition by repetition (the order rotates every
repetition) so that ratios see the same machine noise:

- ``none``: no hooks (the engine builds no view);
- ``null-hook``: one hook that does nothing (the engine's own cost of building views);
- ``fast``, ``strict``: a Monitor in that mode (fast includes its one ``check()``);
- ``strict-phase``: strict with the per-phase read of before (``read="phase"``);
- ``guard-fast``, ``guard-strict`` with ``--guard``: guard_model around the target;
- ``deep`` with ``--deep`` (KV recompute and reference decoding: slow by design).

Every timed hook declares ``read_only``, as the Monitor does, so the engine watches it
for writes only in a run's first steps, as it watches ``hooks=[monitor]``.

Printed per setting and strategy: the median wall seconds and process CPU seconds, the
overhead of each against ``none`` (wall and CPU: the CPU figure is steadier on a shared
machine), the share of the engine's time spent inside hooks, ``mon cpu``: the Monitor's
own CPU time (its hook calls and its ``check()``, thread CPU time) against the rest of
the same run's CPU time, median over runs (measured inside each run, so it is the
steadiest figure on a loaded machine; add the null hook's overhead, the engine's cost of
building views, to compare it with a target), and whether the tokens equal the unchecked
run's (``same``). Then, from one extra run per configuration outside the
timing, what the checker does per engine step: aten ops dispatched inside the hooks (and,
after a "+", those of its ``check()`` per step: fast mode checks the views that waited
there), and host reads, uploads and data-dependent shapes seen by ``invariants.testing``.
``--replay N`` adds the steadiest figure of all, the Monitor alone: the views of one
recorded run (a recording hook, ``read_only``, that keeps a copy of the cache slots KV
provenance reads, since the caches change in place) are replayed into a new Monitor N times,
with no model between hooks, and each phase's thread CPU time, ``check()``'s and their
total are taken as their minimum over the replays (each its own: the parts may sum to a
little less than the total), per engine step, against the engine's own CPU
time per step (the median of the ``none`` runs): what the Monitor's code costs, with
the machine's noise mostly gone (a lower bound of its cost in a run, where the model's
forwards evict what the hooks would find in the caches).
``--breakdown`` (with ``--replay``) splits that time further, on the same views: what
``check()`` spends in each fusion's batched check and in KV provenance's ``detect``, and
KV provenance's whole cost, the Monitor's total less its total without ``I5`` (the
other invariants share fused checks, so no such difference is taken for them; a
diagnostic, not a configuration: no rule is optional).
``--json`` writes everything. Exit status 1 when any configuration changed the tokens.

    python benchmarks/monitor_overhead.py                          # both settings, CPU
    python benchmarks/monitor_overhead.py --settings cheap --repeats 15
    python benchmarks/monitor_overhead.py --model llama-1b-random --device cuda --guard
    python benchmarks/monitor_overhead.py --settings cheap --replay 30 --no-count
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import specdec  # noqa: E402
from invariants import Monitor, guard_model  # noqa: E402
from invariants import predicates as P  # noqa: E402
from invariants import provenance as PV  # noqa: E402
from invariants import rules as R  # noqa: E402
from invariants.provenance import cache_ends  # noqa: E402
from invariants.testing import watch_hook  # noqa: E402
from invariants.view import PHASES  # noqa: E402
from specdec import drafters, models, prompts  # noqa: E402

SETTINGS = ("cheap", "real")
#: the configurations that hook a Monitor (their "mon cpu" column)
MONITORS = ("fast", "strict", "strict-phase", "deep")
CHEAP_MODEL = "tiny:llama"
LLAMA_1B = "llama-1b-random"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def random_ids(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lengths]


def load(setting: str, args):
    """(name, model, prompt ids, device) of a setting."""
    if setting == "cheap":
        name, device = CHEAP_MODEL, "cpu" if args.cheap_on_cpu else args.device
        model = models.tiny("llama").to(device)
        return name, model, random_ids(16, 1, 30, models.TINY_VOCAB), device
    name, device = args.model or models.DEFAULT_MODEL_NAME, args.device
    if name == LLAMA_1B:
        dtype = getattr(torch, args.dtype or ("bfloat16" if device.startswith("cuda") else "float32"))
        model = models.random_llama(LLAMA_1B, dtype, device)  # Llama-3.2-1B's shape
        return name, model, random_ids(args.prompts, 16, 256, models.vocab_size(model)), device
    model, tok = models.resolve(None if name == models.DEFAULT_MODEL_NAME else name)
    model = model.to(device)
    if args.dtype:
        model = model.to(getattr(torch, args.dtype))
    chosen = prompts.builtin_prompts()[: args.prompts]
    if tok is not None:
        ids = prompts.encode(chosen, tok)
    else:
        ids = random_ids(args.prompts, 1, 30, models.vocab_size(model))
    return name, model, ids, device


def _null_hook(phase, view) -> None:
    """The null hook: does nothing, and says so (``read_only``, as the Monitor does), so
    that the engine watches it only for its first steps, as it watches a Monitor."""


_null_hook.read_only = True


def hooks_for(config: str, target):
    """(hooks, monitor or None, guard context or None) of a configuration."""
    if config == "null-hook":
        return [_null_hook], None, None
    if config in ("fast", "strict", "deep"):
        mon = Monitor(config)
        return [mon], mon, None
    if config == "strict-phase":
        mon = Monitor("strict", read="phase")
        return [mon], mon, None
    if config.startswith("guard-"):
        return [], None, guard_model(target, mode=config.split("-", 1)[1])
    return [], None, None


def run_once(config: str, target, ids, strategy: str, device: str, args, max_new=None):
    """(wall seconds, CPU seconds, sequences, seconds inside hooks, the engine's Stats, CPU
    seconds of the Monitor: its hook calls and its check) of one call."""
    hooks, mon, guard = hooks_for(config, target)
    spent = [0.0]
    if mon is not None:  # the Monitor's own CPU time, measured inside this very run
        def hook(phase, view, mon=mon):
            t0 = time.thread_time()
            mon(phase, view)
            spent[0] += time.thread_time() - t0

        # the wrapper keeps the Monitor's promise: without it the engine would watch the
        # hook for writes at every phase (some 20 version counters read twice), 1.4% of
        # the cheap setting's CPU time that a user's hooks=[monitor] never pays
        hook.read_only = mon.read_only
        hooks = [hook]
    kw = dict(drafter=drafters.NGramDrafter(), k=args.k, batch_size=args.batch_size,
              max_new_tokens=max_new or args.max_new_tokens, strategy=strategy,
              policy=args.policy)
    sync(device)
    w0, c0 = time.perf_counter(), time.process_time()
    if guard is not None:
        with guard:
            res = specdec.generate(target, ids, **kw)
    else:
        res = specdec.generate(target, ids, hooks=hooks, **kw)
        if mon is not None:
            t0 = time.thread_time()
            mon.check()  # fast mode: the run's one host read belongs to its cost
            spent[0] += time.thread_time() - t0
    sync(device)
    return (time.perf_counter() - w0, time.process_time() - c0, res.sequences,
            res.stats.seconds.get("checks", 0.0), res.stats, spent[0])


def per_step_counts(config: str, target, ids, strategy: str, args) -> dict | None:
    """Inside-hook work per engine step of one untimed run: aten ops, reads, uploads and
    data-dependent shapes (``invariants.testing``); None for configurations without a
    step hook."""
    hooks, mon, _ = hooks_for(config, target)
    if mon is None:
        return None
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    watched = watch_hook(mon)

    def hook(phase, view):
        with Count():
            watched(phase, view)

    res = specdec.generate(target, ids, drafter=drafters.NGramDrafter(), k=args.k,
                           batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                           strategy=strategy, hooks=[hook], policy=args.policy)
    in_hooks = Count.ops
    with Count():  # fast mode checks the views that waited here (device ops), then reads
        mon.check()
    steps = max(res.stats.steps, 1)
    total = watched.total()
    most = max((c["read"] for c in watched.per_step().values()), default=0)
    return {"ops_per_step": in_hooks / steps, "check_ops_per_step": (Count.ops - in_hooks) / steps,
            "reads_per_step": total["read"] / steps,
            "most_reads_in_a_step": most, "uploads": total["upload"],
            "dynamic_shapes": total["dynamic_shape"]}


def replay_costs(target, ids, strategy: str, args, engine_cpu: float) -> list[dict]:
    """The Monitor's own CPU time per engine step (fast and strict), from the views of one
    recorded run replayed ``args.replay`` times (see the module docstring): per phase and
    for ``check()``, microseconds per step (minimum over the replays), and their total
    against ``engine_cpu``, the engine's CPU seconds per run with no hooks."""
    views = []

    def record(phase, view):
        # the caches change in place as the run goes on: a replayed view shows the ends
        # KV provenance reads (layer 0's K, the last layer's V) as they were at its hook
        views.append((phase, dataclasses.replace(
            view, cache_tensors=_frozen(view.cache_tensors),
            draft_cache_tensors=_frozen(view.draft_cache_tensors))))

    record.read_only = True  # it writes nothing: the engine need not watch it
    res = specdec.generate(target, ids, drafter=drafters.NGramDrafter(), k=args.k,
                           batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                           strategy=strategy, hooks=[record], policy=args.policy)
    steps = max(res.stats.steps, 1)
    parts = [p for p in PHASES if any(p == q for q, _ in views)] + ["check"]
    rows = []
    for mode in ("fast", "strict"):
        best = {}
        for _ in range(args.replay):
            mon = Monitor(mode)
            spent = dict.fromkeys(parts, 0)
            for phase, view in views:
                t0 = time.thread_time_ns()
                mon(phase, view)
                spent[phase] += time.thread_time_ns() - t0
            t0 = time.thread_time_ns()
            mon.check()
            spent["check"] += time.thread_time_ns() - t0
            spent["total"] = sum(spent.values())
            best = {k: min(best.get(k, x), x) for k, x in spent.items()}
        row = {"strategy": strategy, "mode": mode, "replays": args.replay,
               "steps": steps, "views": len(views),
               "us_per_step": {k: x / steps / 1e3 for k, x in best.items()},
               "share_of_engine": best["total"] / 1e9 / max(engine_cpu, 1e-9)}
        if getattr(args, "breakdown", False):
            row.update(_breakdown(views, mode, args.replay, steps, engine_cpu))
        rows.append(row)
    return rows


def _replayed(views, mode: str, invariants=None, parts: dict | None = None) -> int:
    """Thread CPU nanoseconds of one replay of ``views`` into a new Monitor, ``check()``
    included; with ``parts``, what ``check()`` spends in each fusion's batched check and
    in KV provenance's ``detect`` is added to it (nanoseconds by name)."""
    mon = Monitor(mode, invariants=invariants)
    t0 = time.thread_time_ns()
    for phase, view in views:
        mon(phase, view)
    if parts is None:
        mon.check()
    else:
        with _timed_parts(parts):
            mon.check()
    return time.thread_time_ns() - t0


@contextlib.contextmanager
def _timed_parts(spent: dict):
    """While active, each ``rules.FUSIONS`` entry's ``batch`` and ``batch_refs`` and
    ``provenance.detect`` add their thread CPU nanoseconds to ``spent`` (by name)."""
    undo = []

    def timed(name, fn):
        def call(*a, **k):
            t0 = time.thread_time_ns()
            try:
                return fn(*a, **k)
            finally:
                spent[name] = spent.get(name, 0) + time.thread_time_ns() - t0
        return call

    for f in R.FUSIONS:
        for attr in ("batch", "batch_refs"):
            fn = getattr(f, attr)
            if fn is not None:
                undo.append((f, attr, fn))
                object.__setattr__(f, attr, timed("+".join(f.groups), fn))  # (frozen)
    detect = PV.detect
    PV.detect = timed("I5.provenance (detect)", detect)
    try:
        yield spent
    finally:
        PV.detect = detect
        for f, attr, fn in undo:
            object.__setattr__(f, attr, fn)


def _breakdown(views, mode: str, replays: int, steps: int, engine_cpu: float) -> dict:
    """``--breakdown``: where the Monitor's time goes, from replays of the same views
    (minimum over ``replays`` each, us per engine step): ``check()`` by part (fast mode:
    each fusion's batched check, KV provenance's ``detect``), and KV provenance's whole
    cost, the Monitor's total less its total without ``I5`` (its hooks and ``detect``;
    the other invariants share fusions, so leaving one out changes how the rest run and
    the difference would mean nothing). A diagnostic, never a configuration to run: no
    rule is optional. Shares are of the engine's CPU time with no hooks."""
    parts: dict = {}
    for _ in range(replays):
        got: dict = {}
        _replayed(views, mode, parts=got)
        for k, x in got.items():
            parts[k] = min(parts.get(k, x), x)
    full = min(_replayed(views, mode) for _ in range(replays))
    rest = tuple(i for i in P.INVARIANTS if i != "I5")
    provenance = full - min(_replayed(views, mode, rest) for _ in range(replays))
    us = lambda ns: ns / steps / 1e3  # noqa: E731
    return {"check_parts_us": {k: us(x) for k, x in sorted(parts.items())},
            "provenance_us": us(provenance),
            "breakdown_total_us": us(full),
            "breakdown_share": full / 1e9 / max(engine_cpu, 1e-9)}


def _frozen(get):
    """A ``cache_tensors`` callable over copies of what KV provenance reads of ``get()``
    now (one layer holding layer 0's K and the last layer's V), or None."""
    if get is None:
        return None
    ends = cache_ends(get)
    if ends is None:
        return get
    layers = [tuple(t.clone() for t in ends)]
    return lambda: layers


def measure(setting: str, args) -> tuple[list[dict], list[dict]]:
    """(a row per strategy and configuration, the replayed costs of ``--replay``)."""
    name, target, ids, device = load(setting, args)
    if setting == "cheap" or args.threads:
        torch.set_num_threads(1 if setting == "cheap" else args.threads)
    configs = ["none", "null-hook", "fast", "strict", "strict-phase"]
    configs += ["guard-fast", "guard-strict"] if args.guard else []
    configs += ["deep"] if args.deep else []
    rows, replays = [], []
    for strategy in args.strategies:
        for c in configs:  # warm-up: lazy initialisation stays out of every figure
            run_once(c, target, ids[:2], strategy, device, args, max_new=4)
        wall = {c: [] for c in configs}
        cpu = {c: [] for c in configs}
        inside = {c: [] for c in configs}
        mon_cpu = {c: [] for c in configs}
        outputs, steps = {}, {}
        repeats = args.repeats if setting == "cheap" or args.real_repeats is None \
            else args.real_repeats
        for rep in range(repeats):
            order = configs[rep % len(configs):] + configs[: rep % len(configs)]
            for c in order:
                w, p, seqs, hook_s, st, mon_s = run_once(c, target, ids, strategy, device, args)
                wall[c].append(w)
                cpu[c].append(p)
                inside[c].append(hook_s)
                mon_cpu[c].append(mon_s / max(p - mon_s, 1e-9))
                outputs.setdefault(c, seqs)
                steps[c] = (st.steps, st.drafted)
        tokens = sum(len(s) for s in outputs["none"])
        base_w, base_c = statistics.median(wall["none"]), statistics.median(cpu["none"])
        for c in configs:
            mw, mc = statistics.median(wall[c]), statistics.median(cpu[c])
            row = {"setting": setting, "model": name, "device": device, "repeats": repeats,
                   "dtype": str(next(target.parameters()).dtype), "strategy": strategy,
                   "config": c, "median_seconds": mw, "median_cpu_seconds": mc,
                   "tokens_per_s": tokens / mw, "overhead": mw / base_w - 1.0,
                   "cpu_overhead": mc / base_c - 1.0,
                   "hook_share": statistics.median(inside[c]) / mw,
                   "monitor_cpu_share": statistics.median(mon_cpu[c]),
                   "identical": outputs[c] == outputs["none"], "steps": steps[c][0],
                   "drafted": steps[c][1], "policy": args.policy,
                   "tokens": tokens, "seconds": wall[c], "cpu_seconds": cpu[c]}
            if args.count:
                row.update(per_step_counts(c, target, ids, strategy, args) or {})
            rows.append(row)
        if args.replay and setting == "cheap":
            replays += [{"setting": setting, "model": name, **r}
                        for r in replay_costs(target, ids, strategy, args, base_c)]
    del target
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows, replays


def report_replays(replays: list[dict]) -> None:
    """The ``--replay`` table: the Monitor's own CPU microseconds per engine step."""
    if not replays:
        return
    cols = [p for p in (*PHASES, "check", "total")
            if any(p in r["us_per_step"] for r in replays)]
    print(f"the Monitor alone (--replay: one run's views replayed {replays[0]['replays']} "
          f"times, thread CPU, each column its own minimum; us per engine step; share: the "
          f"total against the engine's CPU time with no hooks)")
    head = f"{'strategy':<8} {'mode':<7}" + "".join(f"{c:>9}" for c in cols) + f"{'share':>8}"
    print(head)
    print("-" * len(head))
    for r in replays:
        us = r["us_per_step"]
        print(f"{r['strategy']:<8} {r['mode']:<7}"
              + "".join(f"{us[c]:>9.1f}" if c in us else f"{'-':>9}" for c in cols)
              + f"{r['share_of_engine'] * 100:>7.1f}%")
    for r in replays:
        if "check_parts_us" not in r:
            continue
        print(f"--breakdown {r['strategy']} {r['mode']}: the Monitor's total "
              f"{r['breakdown_total_us']:.1f} us per step "
              f"({r['breakdown_share'] * 100:.1f}% of the engine)")
        parts = r["check_parts_us"]
        if parts:
            print("  check() by part (us/step): " + ", ".join(
                f"{k} {x:.1f}" for k, x in parts.items()))
        print(f"  KV provenance (I5), the total less the total without it: "
              f"{r['provenance_us']:.1f} us/step")


def report(rows: list[dict], args) -> None:
    print(f"{sorted({r['repeats'] for r in rows})} interleaved repeats per configuration, k={args.k}, batch "
          f"{args.batch_size}, {args.max_new_tokens} new tokens, n-gram drafter, policy "
          f"{args.policy}; overhead = median against 'none' (wall, and process CPU time)")
    for r in rows:
        if r["config"] == "none":
            print(f"  {r['setting']}/{r['strategy']}: {r['steps']} steps, {r['drafted']} drafts "
                  "per run")
    head = (f"{'setting':<7} {'model':<22} {'strategy':<7} {'config':<13} {'wall s':>8} "
            f"{'overhead':>9} {'cpu ovh':>8} {'in hooks':>9} {'mon cpu':>8} {'ops/step':>9} "
            f"{'reads/step':>10} "
            f"{'same':>5}")
    print(head)
    print("-" * len(head))
    for r in rows:
        ops = "-" if "ops_per_step" not in r else f"{r['ops_per_step']:.0f}" + (
            f"+{r['check_ops_per_step']:.0f}" if r.get("check_ops_per_step", 0) >= 0.5 else "")
        reads = f"{r['reads_per_step']:.2f}" if "reads_per_step" in r else "-"
        mon = f"{r['monitor_cpu_share'] * 100:.1f}%" if r["config"] in MONITORS else "-"
        print(f"{r['setting']:<7} {r['model'][:22]:<22} {r['strategy']:<7} {r['config']:<13} "
              f"{r['median_seconds']:>8.3f} {r['overhead'] * 100:>8.1f}% "
              f"{r['cpu_overhead'] * 100:>7.1f}% {r['hook_share'] * 100:>8.1f}% {mon:>8} {ops:>9} "
              f"{reads:>10} {'yes' if r['identical'] else 'NO':>5}")
    counted = [r for r in rows if "uploads" in r]
    if counted:
        bad = [r for r in counted if r["uploads"] or r["dynamic_shapes"]
               or (r["config"] == "fast" and r["reads_per_step"])]
        print("inside the hooks: " + ("no upload, no data-dependent shape, fast reads nothing"
                                      if not bad else
                                      "TRANSFERS: " + ", ".join(f"{r['setting']}/{r['strategy']}/"
                                                                f"{r['config']}" for r in bad)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", default="cheap,real",
                    help="comma-separated: cheap (tiny Llama, one thread), real (--model)")
    ap.add_argument("--model", default=None,
                    help=f"the real setting's model: default SmolLM2-135M-Instruct; "
                         f"{LLAMA_1B} (Llama-3.2-1B shape, random weights, bf16 on CUDA); "
                         f"tiny:FAMILY, a local path or hub name")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cheap-on-cpu", action="store_true",
                    help="run the cheap setting on the CPU even when --device is cuda")
    ap.add_argument("--dtype", default=None, choices=[None, "float32", "bfloat16", "float16"],
                    help="the real setting's dtype (llama-1b-random: bf16 on CUDA)")
    ap.add_argument("--strategies", default="eqspec,holes")
    ap.add_argument("--prompts", type=int, default=8, help="prompts of the real setting")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--policy", default="adaptive", choices=["adaptive", "fixed"],
                    help="draft lengths: the engine's default (adaptive: on the cheap "
                         "setting's random prompts it drafts next to nothing) or fixed k")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--real-repeats", type=int, default=None,
                    help="repeats of the real setting (default --repeats): a real model's "
                         "step is long, and its overhead small")
    ap.add_argument("--guard", action="store_true", help="also time guard_model (fast, strict)")
    ap.add_argument("--deep", action="store_true", help="also time deep mode")
    ap.add_argument("--no-count", dest="count", action="store_false",
                    help="skip the untimed per-step op and transfer counts")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (real setting)")
    ap.add_argument("--replay", type=int, default=0,
                    help="cheap setting: also replay one run's views this many times into a "
                         "new Monitor (fast, strict) and report its own CPU time per step")
    ap.add_argument("--breakdown", action="store_true",
                    help="with --replay: also split the Monitor's replayed time: check() by "
                         "part (each fusion's batched check, KV provenance's detect) and KV "
                         "provenance's whole cost (the total less the total without I5)")
    ap.add_argument("--json", default=None, help="write the results to this JSON file")
    args = ap.parse_args(argv)
    settings = [s for s in args.settings.split(",") if s]
    bad = [s for s in settings if s not in SETTINGS]
    if bad:
        ap.error(f"unknown settings {bad}; expected some of {SETTINGS}")
    args.strategies = [s for s in args.strategies.split(",") if s]
    rows, replays = [], []
    for s in settings:
        got, again = measure(s, args)
        rows += got
        replays += again
    report(rows, args)
    report_replays(replays)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        meta = {k: v for k, v in vars(args).items() if k != "json"}
        meta.update(torch=torch.__version__)
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows,
                                               "replays": replays}, indent=2))
        print(f"wrote {args.json}")
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
