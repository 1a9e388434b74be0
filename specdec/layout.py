"""Index math of every realignment strategy, written once over a small ops interface.

Every function here is an element-wise expression. With ``TORCH`` the arguments are
tensors that broadcast (rows as ``[B, 1]``, slots as ``[1, W]``); with the z3 ops of
``proofs/`` they are z3 integer terms for one (row, slot) pair. The engine executes these
functions; the proofs prove properties of the very same functions. Do not restate any of
these formulas elsewhere: import them.

Layout vocabulary (see DESIGN.md): a row of the rectangular batch has width ``W``; its ``n``
real tokens are right-aligned (left padding ``W - n``) and its pending token sits in slot
``W - 1``. The target cache holds slots ``0 .. W - 2`` (width ``C = W - 1``).

After a verify step over ``pending ++ k drafts`` the extended row has width ``W + k + 1``
for tokens (old slots, then the ``k + 1`` target predictions ``y_0 .. y_k``) and ``W + k``
for the cache (old slots, then pending, then drafts ``d_1 .. d_k``). A row that commits
``m`` tokens (``1 <= m <= k + 1``: accepted drafts then the correction or bonus) keeps
tokens in extended slots ``W - n .. W + m - 1``; those committed tokens equal
``y_0 .. y_{m-1}`` because an accepted draft equals the target's prediction.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol


class Ops(Protocol):
    """What the index math needs from a backend.

    Element-wise: ``where``, ``clamp``, ``minimum``, ``maximum``. Reductions over one axis (``dim``),
    torch semantics (``keepdim`` keeps the axis with size 1): ``amax``, ``amin``, ``any``.
    Arithmetic and comparisons are the operands' own operators (``+ - * >= < & ~``).
    """

    def where(self, cond: Any, a: Any, b: Any) -> Any: ...
    def clamp(self, x: Any, lo: Any, hi: Any) -> Any: ...
    def minimum(self, a: Any, b: Any) -> Any: ...
    def maximum(self, a: Any, b: Any) -> Any: ...
    def amax(self, x: Any, dim: int, keepdim: bool = False) -> Any: ...
    def amin(self, x: Any, dim: int, keepdim: bool = False) -> Any: ...
    def any(self, x: Any, dim: int, keepdim: bool = False) -> Any: ...


class _TorchOps:
    def where(self, cond, a, b):
        import torch

        return torch.where(cond, a, b)

    def clamp(self, x, lo, hi):
        import torch

        return torch.clamp(x, min=lo, max=hi)

    def minimum(self, a, b):
        import torch

        if isinstance(a, torch.Tensor) and isinstance(b, (int, float)):  # no upload of b
            return torch.clamp(a, max=b)
        return torch.minimum(torch.as_tensor(a), torch.as_tensor(b))

    def maximum(self, a, b):
        import torch

        if isinstance(a, torch.Tensor) and isinstance(b, (int, float)):  # no upload of b
            return torch.clamp(a, min=b)
        return torch.maximum(torch.as_tensor(a), torch.as_tensor(b))

    def amax(self, x, dim, keepdim=False):
        import torch

        return torch.amax(x, dim=dim, keepdim=keepdim)

    def amin(self, x, dim, keepdim=False):
        import torch

        return torch.amin(x, dim=dim, keepdim=keepdim)

    def any(self, x, dim, keepdim=False):
        import torch

        return torch.any(x, dim=dim, keepdim=keepdim)


TORCH: Ops = _TorchOps()


class _HostOps:
    """Python numbers (sizes the host computes once per batch); reductions take a
    sequence and ``dim=0``."""

    def where(self, cond, a, b):
        return a if cond else b

    def clamp(self, x, lo, hi):
        return min(max(x, lo), hi)

    def minimum(self, a, b):
        return min(a, b)

    def maximum(self, a, b):
        return max(a, b)

    def _reduce(self, fn, x, dim, keepdim):
        if dim != 0:
            raise ValueError(f"host ops reduce a flat sequence over dim 0, got dim={dim}")
        out = fn(x)
        return [out] if keepdim else out

    def amax(self, x, dim, keepdim=False):
        return self._reduce(max, x, dim, keepdim)

    def amin(self, x, dim, keepdim=False):
        return self._reduce(min, x, dim, keepdim)

    def any(self, x, dim, keepdim=False):
        return self._reduce(any, x, dim, keepdim)


HOST: Ops = _HostOps()


# ---------------------------------------------------------------------------------------
# Contiguous profile (EQSPEC): left padding, gather to a new minimal width.
# ---------------------------------------------------------------------------------------

def new_length(n, committed):
    """Real tokens of a row after it commits ``committed`` tokens."""
    return n + committed


def new_padding(new_width, n_new):
    """Left padding of a row of ``n_new`` real tokens in a batch of width ``new_width``.

    ``new_width`` is the maximum of ``n_new`` over the rows that stay in the batch, so the
    minimum padding is 0 (I2, minimal width).
    """
    return new_width - n_new


def source_shift(old_width, new_width, committed):
    """Offset from a destination slot to its source slot in the extended row.

    Destination slot ``j`` (``j >= new padding``) takes extended slot ``j + shift``:
    the last destination slot ``new_width - 1`` maps to ``old_width + committed - 1``,
    the slot of the newest committed token (the new pending token).
    """
    return old_width - new_width + committed


def source_slot(ops: Ops, j, pad_new, shift, ext_width):
    """Source slot in the extended row for destination slot ``j``.

    Valid destination slots map to ``j + shift``; padding slots read slot 0 (any in-range
    slot would do: they are masked). The result is clamped into ``[0, ext_width - 1]`` so
    the gather never reads out of range; for valid slots the clamp is the identity (proved
    in ``proofs/``).
    """
    raw = ops.where(j >= pad_new, j + shift, 0 * j)
    return ops.clamp(raw, 0, ext_width - 1)


def slot_valid(j, pad):
    """valid[b, j] of the contiguous profile: ``0^pad 1^(W - pad)``."""
    return j >= pad


def slot_position(ops: Ops, j, pad):
    """Position id of slot ``j`` in a row with left padding ``pad`` (0 on padding slots)."""
    return ops.where(j >= pad, j - pad, 0 * j)


def cache_width(width):
    """Cache width of a batch of token width ``width``: every pending token is uncached."""
    return width - 1


def ext_token_width(width, k):
    """Token width of the extended row after a verify step: old slots, then ``y_0 .. y_k``."""
    return width + k + 1


def ext_cache_width(width, k):
    """Cache width after the verify forward: old cached slots, then pending, ``d_1 .. d_k``."""
    return width + k


def cache_source_shift(ops: Ops, old_width, new_width, committed):
    """Shift of the cache gather (the cache crop of a row).

    The extended cache holds, at slot ``s < W + k``, the KV of the token at extended token
    slot ``s`` (old tokens, pending, then the drafts, of which the accepted ones equal
    ``y_0 .. y_{m-2}``). So the cache keeps each row's own ``m - 1`` newly computed slots
    (the new pending token, slot ``W + m - 1``, is not computed yet) by using the tokens'
    shift row by row; ``ops`` is there for mutants that reduce over rows.
    """
    return source_shift(old_width, new_width, committed)


def new_width(ops: Ops, n, committed, keep):
    """Width after realignment: the longest row that stays (0 when none stays).

    n, committed, keep: [B] (or [B, 1]); reduces over dim 0. Rows that finished (``keep``
    false) leave the batch and do not count, so the minimum padding is 0 (I2).
    """
    return ops.amax(ops.where(keep, new_length(n, committed), 0 * n), dim=0)


class RealignPlan(NamedTuple):
    """Per (row, destination slot) plan of one realignment; every field broadcasts to
    ``[B, W']`` (torch) or is a z3 term (proofs)."""

    pad: Any         # new left padding of the row
    valid: Any       # valid[b, j] after realignment
    positions: Any   # position id of slot j
    src_tokens: Any  # extended token slot that destination slot j reads
    src_cache: Any   # extended cache slot that destination cache slot j reads (j < W' - 1)


def realign_plan(ops: Ops, j, n, committed, old_width, new_width, k) -> RealignPlan:
    """The EQSPEC realignment of rows of ``n`` tokens (old width ``old_width``) that commit
    ``committed`` tokens after a verify step with ``k`` drafts, to width ``new_width``."""
    n_new = new_length(n, committed)
    pad = new_padding(new_width, n_new)
    src_tokens = source_slot(ops, j, pad, source_shift(old_width, new_width, committed),
                             ext_token_width(old_width, k))
    src_cache = source_slot(ops, j, pad, cache_source_shift(ops, old_width, new_width, committed),
                            ext_cache_width(old_width, k))
    return RealignPlan(pad, slot_valid(j, pad), slot_position(ops, j, pad), src_tokens, src_cache)


# ---------------------------------------------------------------------------------------
# Verify step: where the pending token and the drafts sit.
# ---------------------------------------------------------------------------------------

def verify_position(n, i):
    """Position id of verify input ``i`` (0 = pending, 1..k = drafts) of a row of ``n`` tokens."""
    return n - 1 + i


def draft_limit(ops: Ops, k_b, remaining):
    """Drafts a row may use: ``min(k_b, remaining - 1)`` (the last budgeted token is always
    the target's own), never below 0. ``k_b`` is the row's own draft length this step (an
    integer for every row, or ``[B]``/``[B, 1]`` per row, each in ``0 .. k``)."""
    return ops.minimum(ops.maximum(remaining - 1, 0 * remaining), k_b)


def draft_width(ops: Ops, k_b, keep):
    """Drafts the verify forward carries: ``max k_b`` over the rows in the step (``keep``),
    0 when none drafts (a plain decode step of width 1). The verify width is this plus
    one; reduces over dim 0 like ``new_width``."""
    return ops.amax(ops.where(keep, k_b, 0 * k_b), dim=0)


def realign_is_identity(old_width, new_width, committed):
    """EQSPEC's plan moves nothing in a row whose ``source_shift`` is 0: every row that
    stays committed ``new_width - old_width`` tokens (with the longest row still filling
    the width, which ``new_width`` guarantees then). The plan then keeps each destination
    slot's own token and KV, and the cache gather is a crop to ``cache_width(new_width)``
    (proved in ``proofs/eqspec.py``; the host decides it from the step's one read)."""
    return source_shift(old_width, new_width, committed) == 0


# ---------------------------------------------------------------------------------------
# Greedy acceptance (see specdec/acceptance.py for the layout of drafts and predictions).
# ---------------------------------------------------------------------------------------

def accepted_from_matches(ops: Ops, match, i, limit):
    """Accepted drafts per row: the first draft index that fails to match or reaches the
    row's limit (``limit`` when every usable draft matches).

    match: [B, k] bool, ``d_{i+1} == y_i``; i: [1, k] draft index ``0 .. k-1``;
    limit: [B, 1] in ``[0, k]``. Returns [B, 1] in ``[0, limit]``.
    """
    if match.shape[-1] == 0:  # no drafts: nothing to accept
        return 0 * limit
    ok = match & (i < limit)
    return ops.amin(ops.where(ok, limit, i), dim=1, keepdim=True)


def committed_from_accepted(ops: Ops, is_stop, i, accepted, remaining):
    """Tokens committed per row, and whether the row stopped on a stop token.

    is_stop: [B, k+1] bool, ``y_i`` is a stop token; i: [1, k+1] index ``0 .. k``;
    accepted, remaining: [B, 1] (remaining >= 1). The row commits ``y_0 .. y_accepted``
    cut at its remaining budget and after its first stop token.
    Returns (committed [B, 1] in ``[1, k+1]``, stopped [B, 1] bool).
    """
    upto = ops.minimum(accepted + 1, remaining)
    stop_in = is_stop & (i < upto)
    committed = ops.amin(ops.where(stop_in, i + 1, upto), dim=1, keepdim=True)
    return committed, ops.any(stop_in, dim=1, keepdim=True)


def committed_plain(ops: Ops, is_stop, remaining):
    """``committed_from_accepted`` of a plain step (``k = 0``: one prediction, no draft,
    so ``accepted = 0``), without its index arithmetic: a row commits ``min(1,
    remaining)`` tokens and stopped when that token is a stop token (proved equal in
    ``proofs/acceptance.py``).

    is_stop: [B, 1] bool; remaining: [B, 1]. Returns (committed [B, 1], stopped [B, 1] bool).
    """
    upto = ops.minimum(remaining, 1)
    return upto, is_stop & (upto > 0)


def row_finished(finished, stopped, generated, budgets):
    """A row leaves the batch once it stopped or spent its budget (it stays only with
    ``generated < budgets``, so every row in a step has ``remaining >= 1``)."""
    return finished | stopped | (generated >= budgets)


# ---------------------------------------------------------------------------------------
# Hole profile (HOLES): no copy after a step; compaction only past a slack threshold.
# ---------------------------------------------------------------------------------------
# After a verify step over ``pending ++ d_1 .. d_k`` a row of width ``W`` (cache ``W - 1``)
# grows to width ``W + k + 1`` without moving anything: extended slot ``W + i`` holds draft
# ``d_{i+1}`` for ``i < k`` (its KV is already in cache slot ``W + i``) and slot ``W + k``
# the new pending token ``y_{m-1}`` (not cached). Accepted drafts stay valid, rejected ones
# become holes. Preconditions (I2/I3 of the hole profile before the step): the valid slots
# of a row carry positions ``0 .. n-1`` in increasing slot order and the pending token
# sits in slot ``W - 1`` with position ``n - 1``; ``1 <= m <= k + 1``.

def holes_width(old_width, k):
    """Width after a holes step: old slots, ``k`` draft slots, the new pending slot."""
    return old_width + k + 1


def holes_slot_valid(i, k, committed):
    """valid of extended slot ``W + i`` (``i`` in ``0 .. k``) after a row commits
    ``committed`` tokens: draft ``d_{i+1}`` is kept iff it was accepted and committed
    (``i < committed - 1``); slot ``W + k`` (the new pending token) is always valid."""
    return (i < committed - 1) | (i == k)


def holes_slot_position(ops: Ops, i, k, n, committed):
    """Position of extended slot ``W + i``: draft ``d_{i+1}`` sits at ``n + i`` (its verify
    position), the new pending token at ``n + committed - 1 = n' - 1``; 0 on holes."""
    pos = ops.where(i == k, new_length(n, committed) - 1, n + i)
    return ops.where(holes_slot_valid(i, k, committed), pos, 0 * i)


def compact_dest_slot(ops: Ops, valid, pos, pad_new, trash):
    """Compaction as a scatter: the destination of source slot ``s`` is ``pad_new + pos``
    when ``s`` is valid, else the (discarded) slot ``trash``.

    Preconditions: the row's valid slots carry positions ``0 .. n-1``, each once, in
    increasing slot order (I3); ``pad_new = W_c - n >= 0`` (``new_padding``) and
    ``trash >= W_c``. Then the valid slots map one-to-one, order-preserving, onto
    ``pad_new .. W_c - 1`` (the contiguous profile at width ``W_c``), the pending token
    (position ``n - 1``) onto ``W_c - 1``, and no valid slot reaches ``trash``. With
    ``pad_new = 0`` it is the left-aligned per-request storage of EXSPEC (slot = position).
    """
    return ops.where(valid, pad_new + pos, trash + 0 * pos)


def slack(width, max_n):
    """Slots per row that compaction would reclaim: width minus the longest row."""
    return width - max_n


def compaction_due(width, max_n, threshold):
    """Compact when the reclaimable share of the width passes ``threshold``:
    ``(W - max n) > threshold * W``. (Left padding of shorter rows is not counted: no
    compaction can remove it, so counting it would compact every step on mixed lengths.)"""
    return slack(width, max_n) > threshold * width


def verify_fits(width, k, capacity):
    """A verify step from width ``width`` writes cache slots up to ``width + k - 1``:
    it fits a cache of ``capacity`` slots iff ``width + k <= capacity``."""
    return width + k <= capacity


# ---------------------------------------------------------------------------------------
# EXSPEC pool: per-request storage is left-aligned (slot = position); a compute batch is
# right-aligned (contiguous profile, or grouped: no padding at all).
# ---------------------------------------------------------------------------------------
# Loading row b (``n`` tokens) into a compute batch of width ``W``: destination slot ``j``
# reads pool slot ``slot_position(ops, j, W - n)`` (``j - pad``, 0 on padding). Writing a
# verify step back: verify input ``i`` (pending, drafts) goes to pool slot
# ``verify_position(n, i)``. Storing a prefill: ``compact_dest_slot(valid, pos, 0, trash)``.

def grouped(ops: Ops, n):
    """True when every row of ``n`` ([B] or [B, 1], reduced over dim 0) has the same
    length: the compute batch then has no padding (grouped profile)."""
    return ops.amax(n, dim=0) == ops.amin(n, dim=0)


# ---------------------------------------------------------------------------------------
# Sizing: how many slots each buffer needs. Host integers in the engine; the proofs
# (``proofs/sizing.py``) evaluate the same functions on z3 terms and prove that every
# write of a step lands inside the buffer.
# ---------------------------------------------------------------------------------------
# A row takes part in a step only while ``generated < budget`` (``row_finished``), so it
# has at most ``prompt + budget - 1`` real tokens then, and a batch whose prompts have
# width ``width`` never steps from a width above ``width + max_budget - 1``.

def output_width(max_budget, k):
    """Columns of the output buffer: a step writes columns ``generated .. generated + k``
    (committed tokens, then zeros) with ``generated <= max_budget - 1``."""
    return max_budget + k + 1


def contiguous_capacity(width, max_budget, k):
    """Cache slots of a contiguous batch whose prompts have width ``width``: the batch
    steps from a width of at most ``width + max_budget - 1`` and a verify writes ``k + 1``
    slots past its cache (``verify_fits``). Also the reference decoder's need (``k = 0``)."""
    return width + max_budget + k + 1


def widest_before_compaction(longest, threshold):
    """HOLES: the widest batch the compaction threshold lets through, ``ceil(longest /
    (1 - threshold))`` (the slack share stays at most ``threshold``), or None for a
    threshold of 1 (never compact unless the cache is full). Host floats only."""
    import math

    return None if threshold >= 1 else math.ceil(longest / (1 - threshold))


def holes_capacity(ops: Ops, width, max_budget, k, widest):
    """Cache slots of a HOLES batch whose prompts have width ``width``: room for the
    widest batch the threshold lets through (``widest``, from ``widest_before_compaction``;
    None: never compact, and since every step commits at least one token the widest batch
    is ``width + max_budget (k + 1) - 1``) plus a verify, but never less than the
    contiguous need: a batch that would not fit compacts to its longest row first, which
    then fits (proved)."""
    never = width + max_budget * (k + 1)
    cap = never if widest is None else ops.minimum(never, widest + k + 1)
    return ops.maximum(cap, contiguous_capacity(width, max_budget, k))


def pool_capacity(longest, k):
    """EXSPEC pool slots per request of at most ``longest`` tokens (prompt + budget):
    a step writes pool slots up to position ``n + k <= longest - 1 + k``; the last slot
    is the trash slot that discarded scatters write to."""
    return longest + k + 2


def pool_compute_capacity(longest, k):
    """EXSPEC compute-cache slots: a verify from width ``W <= longest - 1`` writes up to
    slot ``W + k - 1``."""
    return longest + k
