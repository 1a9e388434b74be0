"""Realignment strategies: the interface every strategy implements, and the registry.

A strategy decides what happens to the batch layout between verify steps (and, if it
likes, how requests are batched at all). It is a plugin: a module that defines a
``Strategy`` subclass and an instance of it named ``STRATEGY``, plus one ``register``
line below. Everything that names strategies reads them from here: ``engine.generate``
(``get``), the command line (``--strategy`` choices and each strategy's options as flags),
the audit (its correct engines), the throughput benchmark (``NAME:VALUE`` options) and
the proofs (``proof_modules``). Adding a strategy touches no other file.

The interface (``Strategy``):

- ``name``: the registry key, the value of ``generate(strategy=...)``;
- ``profile``: the layout profile (``invariants.view.PROFILES``) its views carry, which
  selects the I2 rule the Monitor applies; a strategy whose profile changes during a run
  sets ``state.profile`` itself;
- ``refills``: whether a row that finishes hands its place in the running batch to a
  request that waits (EXSPEC's pool: True); a strategy that decodes fixed batches does
  not (default False): each batch then ends with its slowest row, which the draft-length
  policy weighs (``specdec.policy``, ``refills``);
- ``options``: the keyword options of ``generate`` it takes (``Option``: name, type,
  help), also offered as ``--name`` flags by ``specdec generate``; ``generate`` refuses an
  option of another strategy before calling the strategy;
- ``check_options(options, batch_size=)``: validate the options given (absent ones are
  left out), raise ``ValueError`` stating the rule and the value, and return them with
  defaults filled in (they reach the run as ``ctx.options``);
- ``check_models(target, drafter)``: refuse models the strategy cannot serve;
- ``run(ctx, state, ids, batch_size=, max_new_tokens=, done=)``: decode every prompt of
  ``ids`` with the shared phases (``specdec.phases``) and append each finished row's
  ``(row_ids, output, generated)`` to ``done``.

``FixedBatches`` is the base of the strategies that decode the prompts in batches of
``batch_size``, one batch after the other (EQSPEC, HOLES): they implement ``capacity``
and ``after_step`` instead of ``run`` (and may choose which prompts form each batch:
``batches``). EXSPEC implements ``run`` (its own pool loop).

Registry lines name a module (imported on first use, so reading the names costs no
torch import) or pass a ``Strategy`` instance; ``proofs=`` names the ``proofs/`` module
that proves the strategy's index math, if one does.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: this module imports nothing heavy at run time
    from ..batch import RaggedBatch
    from ..phases import Context, HostStep, Spec, State


@dataclass(frozen=True)
class Option:
    """One strategy option: a keyword of ``generate`` and the flag ``--name-with-dashes``."""

    name: str
    type: type  # int or float: how the command line and the benchmark parse a value
    help: str   # one line, naming the default

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


class Strategy:
    """The interface of a strategy (see the module docstring)."""

    name: str = ""
    profile: str = "contiguous"
    refills: bool = False
    options: tuple[Option, ...] = ()

    def check_options(self, options: dict, *, batch_size: int) -> dict:
        """The options given (only this strategy's, absent ones left out), checked, with
        defaults filled in."""
        return dict(options)

    def check_models(self, target, drafter) -> None:
        """Refuse a target or drafter this strategy cannot serve (default: any is fine)."""

    def run(self, ctx: Context, state: State, ids: list, *, batch_size: int,
            max_new_tokens: int, done: list) -> None:
        raise NotImplementedError(f"strategy {self.name!r} implements neither run() nor "
                                  "FixedBatches' capacity() and after_step()")


class FixedBatches(Strategy):
    """A strategy that decodes the prompts in batches of ``batch_size`` (``batches``), one
    after the other: prefill a batch, then step it (``phases.step``) until every row
    finished, calling ``after_step`` for the layout after each step."""

    def capacity(self, ctx: Context, width: int, max_budget: int) -> int:
        """Cache slots of a batch whose prompts have width ``width`` (``layout``)."""
        raise NotImplementedError

    def after_step(self, ctx: Context, state: State, batch: RaggedBatch, spec: Spec,
                   host: HostStep) -> RaggedBatch:
        """The next batch: finished rows dropped, the layout made ready for a step."""
        raise NotImplementedError

    def batches(self, ctx: Context, ids: list, batch_size: int) -> list[list[int]]:
        """The prompt indices of each batch, in decoding order (default: consecutive runs
        of ``batch_size`` prompts)."""
        return [list(range(s, min(s + batch_size, len(ids)))) for s in range(0, len(ids), batch_size)]

    def run(self, ctx, state, ids, *, batch_size, max_new_tokens, done):
        from ..phases import begin_static, run_batch

        batches = self.batches(ctx, ids, batch_size)
        if ctx.static_shapes:  # one cache and one set of buffers for the widest batch
            begin_static(ctx, state, max(map(len, batches)), max(
                self.capacity(ctx, max(len(ids[r]) for r in rows), max_new_tokens)
                for rows in batches))
        for index, rows in enumerate(batches):
            state.batch_index = index
            run_batch(ctx, state, [ids[r] for r in rows], rows, [max_new_tokens] * len(rows),
                      done, capacity=lambda w, mb: self.capacity(ctx, w, mb),
                      after_step=self.after_step)


# ---------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------

@dataclass
class _Entry:
    where: object        # "module.path" (defines STRATEGY) or a Strategy instance
    proofs: str | None   # the proofs/ module of its index math


_REGISTRY: dict[str, _Entry] = {}


def register(name: str, where, *, proofs: str | None = None) -> None:
    """Add strategy ``name``: ``where`` is a module path (imported on first use; it must
    define ``STRATEGY``, a ``Strategy`` whose name is ``name``) or a ``Strategy``."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a strategy name must be an identifier, got {name!r}")
    if name in _REGISTRY:
        raise ValueError(f"strategy {name!r} is registered already")
    if not isinstance(where, (str, Strategy)):
        raise TypeError(f"register {name!r} with a module path or a Strategy, got {type(where).__name__}")
    if isinstance(where, Strategy) and where.name != name:
        raise ValueError(f"strategy {where.name!r} registered under another name, {name!r}")
    _REGISTRY[name] = _Entry(where, proofs)


def unregister(name: str) -> None:
    """Remove strategy ``name`` (tests that register one clean up with this)."""
    _REGISTRY.pop(name)


def names() -> tuple[str, ...]:
    """Every registered strategy, in registration order."""
    return tuple(_REGISTRY)


def get(name: str) -> Strategy:
    """The strategy registered as ``name`` (its module imported on first use)."""
    entry = _REGISTRY.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ValueError(f"strategy must be one of {names()}, got {name!r}")
    if isinstance(entry.where, str):
        strategy = getattr(importlib.import_module(entry.where), "STRATEGY", None)
        if not isinstance(strategy, Strategy) or strategy.name != name:
            raise TypeError(f"module {entry.where} must define STRATEGY, a Strategy named "
                            f"{name!r}, got {strategy!r}")
        entry.where = strategy
    return entry.where


def proof_modules() -> dict[str, str]:
    """``{strategy: proofs module}`` of the strategies whose index math ``proofs/`` proves."""
    return {n: e.proofs for n, e in _REGISTRY.items() if e.proofs}


# -- one line per strategy ----------------------------------------------------------------
register("eqspec", "specdec.strategies.eqspec", proofs="proofs.eqspec")
register("exspec", "specdec.strategies.exspec", proofs="proofs.exspec")
register("holes", "specdec.strategies.holes", proofs="proofs.holes")
