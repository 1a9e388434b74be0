"""A strategy plugin that exists only for tests/test_strategy_plugin.py: EQSPEC's layout
over batches formed from length-sorted prompts (rows of one batch then have similar
lengths, so less padding). It is this one module plus one registry line,
``strategies.register("by_length", "by_length_strategy")``; no other file knows it."""

from __future__ import annotations

from specdec.strategies import Option
from specdec.strategies.eqspec import EqSpec


class ByLength(EqSpec):
    name = "by_length"
    options = (Option("sort_window", int,
                      "prompts sorted by length within windows of this many (default: all)"),)

    def check_options(self, options: dict, *, batch_size: int) -> dict:
        window = options.get("sort_window")
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"sort_window must be an integer >= 1, got {window!r}")
        return {"sort_window": window}

    def batches(self, ctx, ids: list, batch_size: int) -> list[list[int]]:
        window = ctx.options["sort_window"] or len(ids)
        order = [i for s in range(0, len(ids), window)
                 for i in sorted(range(s, min(s + window, len(ids))), key=lambda i: len(ids[i]))]
        return [order[s : s + batch_size] for s in range(0, len(order), batch_size)]


STRATEGY = ByLength()
