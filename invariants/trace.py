"""Counterexample traces: ``InvariantViolation`` and its JSON form.

A violation carries everything needed to understand it in a CI log and to re-run it:

- ``invariant`` ("I1" .. "I7"), ``step``, ``phase`` (an engine phase, or "forward" for
  ``guard_model``), ``rows`` (batch rows), ``slots`` (per offending row, the offending slot
  indices; for I6/I7 they are output indices, for I4 columns of the forward's mask);
- ``trace``: a JSON-able dict (``TRACE_VERSION`` in its "version" field) holding the above,
  the failed rules in words, a small grid of valid/positions for the offending rows
  (``grid``: at most ``MAX_GRID_ROWS`` rows, each a few lines), the accepted-count history
  per step, the engine's ``info`` and the caller's free ``run`` dict (what ``specdec
  replay`` needs to re-run it).

``to_json``/``from_json`` round-trip exactly; nothing is ever pickled. ``str(violation)``
is the rendered trace (``render``).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

#: version of the trace dict; bump when a field changes meaning
TRACE_VERSION = 1
#: offending rows drawn in a grid (the others are listed by index only)
MAX_GRID_ROWS = 3
#: slots drawn per grid line (a window around the first offending slot)
MAX_GRID_COLUMNS = 24
#: accepted-count steps shown by ``render`` (the trace keeps them all)
RENDERED_HISTORY = 6

INVARIANT_NAMES = {
    "I1": "rectangular alignment",
    "I2": "layout",
    "I3": "position-id contiguity",
    "I4": "mask coherence",
    "I5": "KV coherence",
    "I6": "token conservation",
    "I7": "output equivalence",
    "C1": "context = prompt ++ committed tokens",
    "C2": "greedy consistency",
    "C3": "outputs",
}


class InvariantViolation(Exception):
    """An invariant failed. ``str()`` shows the rendered trace; ``.trace`` is JSON-able."""

    def __init__(self, trace: dict):
        self.trace = _jsonable(trace)
        self.trace.setdefault("version", TRACE_VERSION)
        super().__init__(render(self.trace))

    # -- fields ------------------------------------------------------------------------
    @property
    def invariant(self) -> str:
        return self.trace["invariant"]

    @property
    def step(self) -> int:
        return self.trace["step"]

    @property
    def phase(self) -> str:
        return self.trace["phase"]

    @property
    def rows(self) -> list[int]:
        return list(self.trace["rows"])

    @property
    def row_ids(self) -> list[int]:
        return list(self.trace.get("row_ids", []))

    @property
    def slots(self) -> list[list[int]]:
        return [list(s) for s in self.trace.get("slots", [])]

    @property
    def rules(self) -> list[str]:
        return list(self.trace.get("rules", []))

    # -- serialisation -----------------------------------------------------------------
    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.trace, indent=indent, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "InvariantViolation":
        trace = json.loads(text)
        version = trace.get("version")
        if version != TRACE_VERSION:
            raise ValueError(f"trace version {version!r} is not supported (expected {TRACE_VERSION})")
        return cls(trace)

    def save(self, path) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path) -> "InvariantViolation":
        with open(path, encoding="utf-8") as f:
            return cls.from_json(f.read())

    def __reduce__(self):  # keep exceptions picklable by multiprocessing, via JSON text
        return (InvariantViolation.from_json, (self.to_json(indent=None),))


# ---------------------------------------------------------------------------------------
# Building traces
# ---------------------------------------------------------------------------------------

def make_trace(*, invariant: str, step: int, phase: str, rows: Sequence[int],
               row_ids: Sequence[int] = (), slots: Sequence[Sequence[int]] = (),
               rules: Sequence[str] = (), grid: Sequence[dict] = (),
               accepted_history: Sequence[dict] = (), profile: str | None = None,
               k: int | None = None, width: int | None = None, state: dict | None = None,
               info: dict | None = None, run: dict | None = None, also: Sequence[str] = (),
               source: str = "monitor") -> dict:
    """The trace dict of one violation (all arguments already host values)."""
    return _jsonable({
        "version": TRACE_VERSION,
        "source": source,
        "invariant": invariant,
        "name": INVARIANT_NAMES.get(invariant, invariant),
        "step": int(step),
        "phase": phase,
        "profile": profile,
        "k": k,
        "width": width,
        "rows": [int(r) for r in rows],
        "row_ids": [int(r) for r in row_ids],
        "slots": [[int(s) for s in ss] for ss in slots],
        "rules": list(rules),
        "also": list(also),
        "grid": list(grid),
        "state": dict(state or {}),
        "accepted_history": list(accepted_history),
        "info": dict(info or {}),
        "run": dict(run or {}),
    })


def grid_window(width: int, bad: Sequence[int], limit: int = MAX_GRID_COLUMNS) -> list[int]:
    """Columns to draw: all when they fit, else ``limit`` columns around the first bad one
    (the last ``limit`` columns when none is bad: the newest slots matter most)."""
    if width <= limit:
        return list(range(width))
    if bad:
        start = max(0, min(min(bad) - limit // 3, width - limit))
    else:
        start = width - limit
    return list(range(start, start + limit))


def grid_row(label: str, lines: dict[str, Sequence[Any]], bad: Sequence[int],
             columns: Sequence[int]) -> dict:
    """One grid entry (one row): ``lines`` maps a line name ("valid", "pos", "want") to a
    full-width sequence; only ``columns`` (this row's window) are kept, stored as an
    ordered list of [name, cells].
    ``None`` entries draw as '.'; offending columns draw in brackets."""
    kept = []
    for name, values in lines.items():
        vals = list(values)
        kept.append([name, [None if c >= len(vals) else _cell_value(vals[c]) for c in columns]])
    return {"label": label, "columns": [int(c) for c in columns], "lines": kept,
            "bad": [int(c) for c in bad if c in set(columns)]}


def _cell_value(v):
    if v is None:
        return None
    if isinstance(v, bool):
        return int(v)
    try:
        return int(v)
    except (TypeError, ValueError):
        return str(v)


# ---------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------

def render(trace: dict) -> str:
    """The human form of a trace: header, failed rules, grid, accepted history, run."""
    inv = trace.get("invariant", "?")
    out = [f"{inv} {trace.get('name', '')} violated at step {trace.get('step')}, "
           f"phase {trace.get('phase')}"
           + (f" (profile {trace['profile']}, k={trace['k']}, width {trace['width']})"
              if trace.get("profile") is not None else "")]
    rows, ids = trace.get("rows", []), trace.get("row_ids", [])
    if rows:
        who = ", ".join(f"{r}" + (f" (request {ids[i]})" if i < len(ids) else "")
                        for i, r in enumerate(rows[:8]))
        more = f" and {len(rows) - 8} more" if len(rows) > 8 else ""
        out.append(f"rows: {who}{more}")
    for rule in trace.get("rules", [])[:6]:
        out.append(f"  failed: {rule}")
    if trace.get("also"):
        out.append(f"  also failing here: {', '.join(trace['also'])}")
    out.extend(render_grid(trace.get("grid", [])))
    hist = trace.get("accepted_history", [])
    if hist:
        shown = hist[-RENDERED_HISTORY:]
        cells = " ".join(f"s{h['step']}:{h['accepted']}" for h in shown)
        skipped = f"({len(hist) - len(shown)} earlier) " if len(hist) > len(shown) else ""
        out.append(f"accepted per step: {skipped}{cells}")
    if trace.get("run"):
        out.append(f"run: {json.dumps(trace['run'], sort_keys=True)[:200]}")
    return "\n".join(out)


def render_grid(grid: Sequence[dict]) -> list[str]:
    """Grid lines: a "slot" header (repeated only when a row's window differs from the
    previous row's), then one line per named line of each row."""
    grid = [g for g in grid if g.get("columns")]
    if not grid:
        return []
    cells = [str(c) for g in grid for c in g["columns"]]
    for g in grid:
        for _, vals in g["lines"]:
            cells.extend(_fmt(v, False) for v in vals)
    cw = max(len(c) for c in cells) + 2
    label_w = max([len("slot")] + [len(g["label"]) + 1 + max(len(n) for n, _ in g["lines"])
                                   for g in grid])
    lines, shown = [], None
    for g in grid:
        columns = g["columns"]
        lead = "…" if columns[0] > 0 else " "
        if columns != shown:
            lines.append("slot".ljust(label_w) + lead + "".join(str(c).rjust(cw) for c in columns))
            shown = columns
        bad = set(g.get("bad", []))
        for i, (name, vals) in enumerate(g["lines"]):
            head = (g["label"] if i == 0 else "").ljust(label_w - len(name)) + name
            body = "".join(_fmt(v, c in bad).rjust(cw) for v, c in zip(vals, columns))
            lines.append(head + lead + body)
    return lines


def _fmt(v, bad: bool) -> str:
    s = "." if v is None else str(v)
    return f"[{s}]" if bad else s


def _jsonable(obj):
    """A deep copy of ``obj`` made of JSON types (tuples become lists, keys strings)."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if hasattr(obj, "tolist"):  # tensors and numpy values
        return _jsonable(obj.tolist())
    return str(obj)
