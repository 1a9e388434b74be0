"""Greedy acceptance.

Layout: a verify forward over ``pending ++ d_1 .. d_k`` gives target predictions
``y_0 .. y_k`` (``y_i`` follows pending and ``d_1 .. d_i``). Row ``b`` accepts
``a = max{i <= limit[b] : d_1..d_i == y_0..y_(i-1)}`` drafts and commits ``y_0 .. y_a``
(accepted drafts equal the predictions, and ``y_a`` is the correction, or the bonus when
``a = k``), cut after the first stop token and at the row's remaining budget. So
``1 <= committed <= k + 1`` for every row with budget left.
All functions are tensor ops over the batch (no loop over rows, no host sync); the
formulas are ``specdec.layout.accepted_from_matches`` and ``committed_from_accepted``
(proved in ``proofs/acceptance.py``).
"""

from __future__ import annotations

import torch

from . import layout


def accepted_count(drafts: torch.Tensor, predictions: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """Accepted drafts per row.

    drafts:      [B, k] long
    predictions: [B, k+1] long (argmax of the target at pending and each draft)
    limit:       [B] long, drafts the row may use (0..k)
    Returns [B] long in [0, limit].
    """
    k = drafts.shape[1]
    if k == 0:  # a plain step: nothing to accept (``accepted_from_matches`` reads no match)
        return layout.accepted_from_matches(layout.TORCH, drafts, None, limit[:, None])[:, 0]
    idx = torch.arange(k, device=drafts.device)[None, :]
    match = drafts == predictions[:, :k]
    return layout.accepted_from_matches(layout.TORCH, match, idx, limit[:, None])[:, 0]


def committed_count(predictions: torch.Tensor, accepted: torch.Tensor, remaining: torch.Tensor,
                    stop_ids: torch.Tensor):
    """Tokens committed per row and whether the row stopped on a stop token.

    predictions: [B, k+1] long
    accepted:    [B] long
    remaining:   [B] long, budget left (>= 1 for rows in the batch)
    stop_ids:    [S] long (may be empty)
    Returns (committed [B] long in [1, k+1], stopped [B] bool).
    """
    kp1 = predictions.shape[1]
    if stop_ids.numel():
        is_stop = torch.isin(predictions, stop_ids)
    else:
        is_stop = torch.zeros_like(predictions, dtype=torch.bool)
    if kp1 == 1:  # a plain step: the same counts without the index arithmetic
        committed, stopped = layout.committed_plain(layout.TORCH, is_stop, remaining[:, None])
    else:
        idx = torch.arange(kp1, device=predictions.device)[None, :]
        committed, stopped = layout.committed_from_accepted(
            layout.TORCH, is_stop, idx, accepted[:, None], remaining[:, None])
    return committed[:, 0], stopped[:, 0]
