"""Figures shared by the audit and the throughput benchmark (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path


def phase_shares(seconds: dict, phases=None) -> dict:
    """Each phase's share of the time in ``seconds`` ({phase: seconds}) summed over
    ``phases`` (default: every phase in ``seconds``); absent phases count 0."""
    phases = tuple(seconds) if phases is None else tuple(phases)
    part = {p: seconds.get(p, 0.0) for p in phases}
    total = sum(part.values()) or 1.0
    return {p: v / total for p, v in part.items()}


def save(fig, ax, path: Path, *, title: str, legend_size: int, grid: bool = True) -> None:
    """Title, legend (and grid) on ``ax``, then write ``fig`` to ``path`` and close it."""
    import matplotlib.pyplot as plt

    ax.set_title(title)
    ax.legend(fontsize=legend_size)
    if grid:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def stacked_phase_shares(path: Path, labels: list, shares: list, phases, *, ylabel: str,
                         width_per_bar: float, min_width: float, label_size: int,
                         rotation: int = 0) -> None:
    """A stacked bar per entry (``labels[i]``: its tick label; ``shares[i]``: {phase:
    share}) of ``phases``, saved to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(min_width, width_per_bar * len(labels)), 4.5))
    bottom = [0.0] * len(labels)
    for phase in phases:
        vals = [s.get(phase, 0.0) for s in shares]
        ax.bar(range(len(labels)), vals, bottom=bottom, label=phase)
        bottom = [a + b for a, b in zip(bottom, vals)]
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=rotation, ha="right" if rotation else "center",
                       fontsize=label_size)
    ax.set_ylabel(ylabel)
    save(fig, ax, path, title="Phase shares", legend_size=7, grid=False)
