"""What any decoding engine hands to the checker after every phase.

An engine builds a ``StepView`` after each phase (``PHASES``) and calls every hook with
``hook(phase, view)``. The view is read-only: hooks must not modify its tensors. All
tensors stay on the engine's device; nothing here moves data to the host.

Cache-width convention (I1), ``W`` the token width of the view:
- phases ``prefill``, ``draft`` and ``realign``: the target cache has width ``W - 1``
  (every row's pending token in slot ``W - 1`` is not yet cached);
- phases ``verify`` and ``commit``: the verify forward appended ``k + 1`` slots (pending and
  k drafts), so the target cache has width ``W + k``; realignment then brings it back.
A drafter that keeps a cache states its own convention in ``draft_cache_lag``: its cache
width is ``W - 1 + draft_cache_lag`` (``ModelDrafter``: ``k + 1`` at draft/verify/commit,
0 at prefill/realign).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

PHASES = ("prefill", "draft", "verify", "commit", "realign")
PROFILES = ("contiguous", "holes", "grouped")


@dataclass(frozen=True)
class ForwardRecord:
    """The inputs of the last target forward, exactly as given to the model."""

    # [B, q] long
    input_ids: torch.Tensor
    # [B, q] long: explicit position ids
    positions: torch.Tensor
    # [B, cache_width + q]: the 2-D mask over cache slots ++ new tokens
    attention_mask: torch.Tensor
    # cache width before the forward
    cache_width: int
    # the model's sliding window in positions (a query at position p attends keys at
    # positions p - window + 1 .. p); None: full attention (I4.window)
    window: int | None = None
    # the attention mask as the model got it, when it is not ``attention_mask`` itself: a
    # 4-D mask [B or 1, H or 1, q, cache_width + q] (bool: True attends; float: additive),
    # or a dict layer type -> such a mask (``"sliding_attention"`` holds the window).
    # None: the model was given ``attention_mask`` and built its causal mask and window
    # from it over slot indices (I4.window)
    model_mask: Any = None

    def __post_init__(self):
        w = self.window
        if w is not None and (type(w) is not int or w < 1):
            raise ValueError(f"a forward's sliding window is a positive number of positions "
                             f"(None: full attention), got {w!r}")


@dataclass(frozen=True)
class StepView:
    # verify steps completed before this phase (0 at prefill)
    step: int
    # one of PHASES
    phase: str
    # one of PROFILES: which layout rule I2 applies
    profile: str
    # drafts proposed per step (the verify forward covers k + 1 tokens)
    k: int
    # [B, W] long
    tokens: torch.Tensor
    # [B, W] bool
    valid: torch.Tensor
    # [B, W] long
    positions: torch.Tensor
    # [B] long: real tokens per row (prompt + committed output)
    lengths: torch.Tensor
    # [B] long
    prompt_lengths: torch.Tensor
    # [B] long: most new tokens per row
    budgets: torch.Tensor
    # [B] long: new tokens committed so far
    generated: torch.Tensor
    # [B] bool
    finished: torch.Tensor
    # [B] long: request index served by each row
    row_ids: torch.Tensor
    # [B, T] long: committed output, output[b, :generated[b]] is real
    output: torch.Tensor
    # stop token ids (from the target's generation config)
    stop_token_ids: tuple[int, ...]
    # width of every target cache layer, and its batch size
    cache_widths: tuple[int, ...]
    cache_batch_sizes: tuple[int, ...]
    # drafter cache widths per layer (empty when the drafter keeps no cache)
    draft_cache_widths: tuple[int, ...] = ()
    draft_cache_lag: int = 0
    # -- phase-specific -------------------------------------------------------------
    # [B, k] long (draft and later phases of a step)
    drafts: torch.Tensor | None = None
    # [B] long: drafts each row may use (min(k, remaining - 1))
    draft_limit: torch.Tensor | None = None
    # the last target forward (prefill and verify)
    forward: ForwardRecord | None = None
    # [B, k+1] long (verify, commit): the target's choice at pending and each draft: its
    # argmax (greedy), its coupled choice (``sampling.mode == "coupled"``), or the step's
    # choice of rejection sampling (the draft where accepted, else the residual sample;
    # the bonus sample last), for which the greedy acceptance rule holds too
    predictions: torch.Tensor | None = None
    # [B] long (commit)
    accepted: torch.Tensor | None = None
    # [B] long (commit): tokens committed this step
    committed: torch.Tensor | None = None
    # [B] long (commit, realign): generated before this step's commit
    generated_before: torch.Tensor | None = None
    # -- for deep checks ----------------------------------------------------------------
    # the target model (deep mode recomputes KV and reference tokens with it)
    model: Any = None
    # () -> list of (K, V), each [B, H, C, D]: the target cache's tensors per layer
    cache_tensors: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]] | None = None
    # () -> list of (K, V), each [B, H, C', D]: the drafter's cache per layer (None: the
    # drafter keeps none); KV provenance (invariants/provenance.py) checks it like the target's
    draft_cache_tensors: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]] | None = None
    # free-form engine facts shown in traces (strategy name, batch index, ...)
    info: dict = field(default_factory=dict)
    # how the engine chooses tokens; None: greedy (argmax). Otherwise an object with
    # ``mode`` ("coupled" | "rejection"), ``as_dict()`` and, for coupled sampling,
    # ``scores(logits [..., V], row_ids, t) -> [..., V]``: the coupled choice at output
    # position t of request row_ids is the argmax of these scores (``specdec.Sampling``)
    sampling: Any = None

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def expected_cache_width(self) -> int:
        """Target cache width this phase must show (see the module docstring)."""
        if self.phase in ("verify", "commit"):
            return self.width + self.k
        return self.width - 1


def _field_defaults(cls) -> tuple:
    """(names, plain defaults, default factories, required names) of a dataclass."""
    plain, factories, required = {}, {}, []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            plain[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            factories[f.name] = f.default_factory
        else:
            required.append(f.name)
    return frozenset(plain) | frozenset(factories) | frozenset(required), plain, factories, \
        tuple(required)


_VIEW_NAMES, _VIEW_PLAIN, _VIEW_FACTORIES, _VIEW_REQUIRED = _field_defaults(StepView)


def build_view(fields: dict) -> StepView:
    """``StepView(**fields)``, the same view, built without the dataclass ``__init__``
    (a frozen dataclass sets its 30-odd fields one ``object.__setattr__`` at a time: some
    7 us per view on a CPU, a cost an engine pays after every phase). ``fields`` is taken
    over (not copied); unknown or missing names raise ``TypeError`` as ``__init__`` does."""
    values = {**_VIEW_PLAIN, **fields}
    for name, make in _VIEW_FACTORIES.items():
        if name not in fields:
            values[name] = make()
    if values.keys() != _VIEW_NAMES:  # one set comparison on the common path
        unknown = fields.keys() - _VIEW_NAMES
        if unknown:
            raise TypeError(f"StepView got unexpected fields {sorted(unknown)}")
        missing = [n for n in _VIEW_REQUIRED if n not in values]
        raise TypeError(f"StepView is missing required fields {missing}")
    view = object.__new__(StepView)
    object.__setattr__(view, "__dict__", values)
    return view
