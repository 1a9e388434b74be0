"""``python -m proofs``: check every obligation and print one line per obligation.

    python -m proofs [--max-batch 16] [--max-requests N] [--k-max 8] [--only TEXT]
                     [--mutant NAME] [--save-trace FILE] [--list] [--list-mutants]

Each line: obligation name, bound, status (proved / counterexample / unknown / vacuous),
seconds. A counterexample is printed below its line as a concrete small batch. The exit
status is 0 when every obligation is proved and 1 otherwise (so with ``--mutant`` a
caught mutant exits 1). ``--save-trace FILE`` writes the first counterexample as JSON
(the first replayable one, a realignment batch, when there is one); replay it on the
engine with ``specdec replay FILE`` (``specdec.forensics.counterexample``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from . import DEFAULT_MAX_BATCH, run
from .core import Result

TRACE_KIND = "proof-counterexample"
TRACE_VERSION = 1


def format_counterexample(cex: dict) -> str:
    """A counterexample as a few readable lines (indented)."""
    if not cex:
        return "    (no model)"
    if "reason" in cex:
        return f"    {cex['reason']}"
    if cex.get("model") == "pool":
        return "    " + json.dumps(cex)
    if cex.get("model") in ("holes", "exspec"):
        return _format_rows(cex)
    lines = []
    if "old_width" in cex or "new_width" in cex:
        head = f"B={cex['batch_size']} k={cex['k']}"
        if "old_width" in cex:
            head += f" W={cex['old_width']}"
        head += f" -> W'={cex['new_width']}"
        if cex.get("slots"):
            head += "  slots " + " ".join(f"{s}={v}" for s, v in cex["slots"].items())
        lines.append(head)
        bad = set(cex.get("violating_rows", []))
        for b, r in enumerate(cex["rows"]):
            extra = "" if "kept" not in r else (" kept" if r["kept"] else " finished")
            mark = "   <- violates" if b in bad else ""
            lines.append(f"row {b}: n={r['n']} m={r['m']}{extra}{mark}")
    else:  # acceptance
        lines.append(f"B={cex['batch_size']} k={cex['k']}")
        bad = set(cex.get("violating_rows", []))
        for b, r in enumerate(cex["rows"]):
            bits = lambda xs: "".join("1" if x else "0" for x in xs)  # noqa: E731
            mark = "   <- violates" if b in bad else ""
            lines.append(f"row {b}: budget={r['budget']} generated={r['generated']} "
                         f"match={bits(r['match']) or '-'} stop={bits(r['stop'])} -> "
                         f"limit={r['limit']} accepted={r['accepted']} "
                         f"committed={r['committed']}{mark}")
    return "\n".join("    " + line for line in lines)


def _format_rows(cex: dict) -> str:
    """A holes/exspec counterexample: its scalars on one line, then one line per row
    (valid bits as 0/1 strings, positions and destinations as lists)."""
    show = lambda v: " ".join(map(str, v)) if isinstance(v, list) else str(v)  # noqa: E731
    head = [f"{k}={v}" for k, v in cex.items()
            if k not in ("model", "rows", "violating_rows") and not isinstance(v, (list, dict))]
    lines = [f"{cex['model']} " + " ".join(head)]
    bad = set(cex.get("violating_rows", []))
    for b, r in enumerate(cex.get("rows", [])):
        mark = "   <- violates" if b in bad else ""
        lines.append(f"row {b}: " + "  ".join(f"{k}=[{show(v)}]" if isinstance(v, list) else
                                              f"{k}={v}" for k, v in r.items()) + mark)
    return "\n".join("    " + line for line in lines)


def replayable(cex: dict | None) -> bool:
    return bool(cex) and "strategy" in cex and "old_width" in cex and all(
        "n" in r and "m" in r for r in cex.get("rows", []))


def trace_of(result: Result, mutant: str | None, max_batch: int) -> dict:
    """The JSON document ``--save-trace`` writes (and ``specdec replay`` reads)."""
    return {"kind": TRACE_KIND, "version": TRACE_VERSION, "obligation": result.name,
            "property": result.doc, "bound": result.bound, "mutant": mutant,
            "max_batch": max_batch, "size": result.size, "replayable": replayable(result.counterexample),
            "counterexample": result.counterexample}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m proofs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH,
                    help="check batch sizes 1..MAX_BATCH (default %(default)s)")
    ap.add_argument("--max-requests", type=int, default=None,
                    help="pool: requests 1..N (default: --max-batch)")
    ap.add_argument("--k-max", type=int, default=None, help="acceptance: k in 0..K (default 8)")
    ap.add_argument("--only", default=None, help="only obligations whose name contains TEXT")
    ap.add_argument("--mutant", default=None, help="run against a mutated layout (see --list-mutants)")
    ap.add_argument("--save-trace", default=None, metavar="FILE",
                    help="write the first counterexample as JSON (replay: specdec replay FILE)")
    ap.add_argument("--timeout-ms", type=int, default=60_000, help="z3 timeout per query")
    ap.add_argument("--list", action="store_true", help="list the obligations and exit")
    ap.add_argument("--list-mutants", action="store_true", help="list the mutants and exit")
    args = ap.parse_args(argv)

    if args.list_mutants:
        from specdec import mutants

        for m in mutants.CATALOGUE.values():
            print(f"{m.name:26s} layout.{m.target:20s} {m.description}")
        return 0
    if args.list:
        from . import registry

        for ob in registry.obligations():
            print(f"{ob.name:52s} {ob.doc}")
        return 0
    if args.max_batch < 1:
        ap.error("--max-batch must be >= 1")

    width = 52
    print(f"{'obligation':{width}s} {'bound':48s} {'status':14s} {'seconds':>7s}")
    t0 = time.perf_counter()

    def show(r: Result) -> None:
        status = r.status if r.ok or r.size is None else f"{r.status}"
        print(f"{r.name:{width}s} {r.bound:48s} {status:14s} {r.seconds:7.2f}", flush=True)
        if not r.ok:
            where = f" at {r.bound.split('<=')[0]}={r.size}" if r.size is not None else ""
            print(f"    {r.status}{where}: {r.doc}")
            print(format_counterexample(r.counterexample or {}), flush=True)

    try:
        results = run(args.max_batch, mutant=args.mutant, only=args.only,
                      max_requests=args.max_requests, k_max=args.k_max,
                      timeout_ms=args.timeout_ms, on_result=show)
    except ValueError as e:  # unknown mutant
        print(f"error: {e}", file=sys.stderr)
        return 2
    total = time.perf_counter() - t0
    failed = [r for r in results if not r.ok]
    label = f" (mutant {args.mutant})" if args.mutant else ""
    print(f"{len(results) - len(failed)}/{len(results)} proved{label} in {total:.1f}s")
    if args.save_trace:
        cexs = [r for r in failed if r.status == "counterexample"]
        pick = next((r for r in cexs if replayable(r.counterexample)), cexs[0] if cexs else None)
        if pick is None:
            print("no counterexample to save")
        else:
            with open(args.save_trace, "w") as f:
                json.dump(trace_of(pick, args.mutant, args.max_batch), f, indent=1)
            print(f"saved the counterexample of {pick.name!r} to {args.save_trace}")
    if not results:
        print("no obligation matched", file=sys.stderr)
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
