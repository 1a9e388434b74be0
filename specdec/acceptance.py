"""Greedy acceptance.

Layout: a verify forward over ``pending ++ d_1 .. d_k`` gives target predictions
``y_0 .. y_k`` (``y_i`` follows pending and ``d_1 .. d_i``). Row ``b`` accepts
``a = max{i <= limit[b] : d_1..d_i == y_0..y_(i-1)}`` drafts and commits ``y_0 .. y_a``
(accepted drafts equal the predictions, and ``y_a`` is the correction, or the bonus when
``a = k``), cut after the first stop token and at the row's remaining budget. So
``1 <= committed <= k + 1`` for every row with budget left.
All functions are tensor ops over the batch (no loop over rows, no host sync).
"""

from __future__ import annotations

import torch


def accepted_count(drafts: torch.Tensor, predictions: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """Accepted drafts per row.

    drafts:      [B, k] long
    predictions: [B, k+1] long (argmax of the target at pending and each draft)
    limit:       [B] long, drafts the row may use (0..k)
    Returns [B] long in [0, limit].
    """
    k = drafts.shape[1]
    if k == 0:
        return torch.zeros(drafts.shape[0], dtype=torch.long, device=drafts.device)
    idx = torch.arange(k, device=drafts.device)[None, :]
    match = (drafts == predictions[:, :k]) & (idx < limit[:, None])
    return torch.cumprod(match.long(), dim=1).sum(dim=1)


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
    idx = torch.arange(kp1, device=predictions.device)[None, :]
    upto = torch.minimum(accepted + 1, remaining)  # before stop tokens
    in_range = idx < upto[:, None]
    if stop_ids.numel():
        is_stop = torch.isin(predictions, stop_ids) & in_range
    else:
        is_stop = torch.zeros_like(in_range)
    stopped = is_stop.any(dim=1)
    first_stop = torch.argmax(is_stop.long(), dim=1)
    committed = torch.where(stopped, first_stop + 1, upto)
    return committed, stopped
