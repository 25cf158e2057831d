"""The per-layer importance figure (importance.png) that `remodel score` and `remodel prune` write.

One figure for both, so a layer type has the same colour in the scores and in the pruning report.
"""
from __future__ import annotations

from remodel.models.kinds import KINDS

COLORS = {c: k.color for c, k in KINDS.items()}  # each kind's colour (its spec)
PANELS = {"block_importance": "block importance (1 - cos)", "loss_increase": "LM loss increase when removed"}


def plot_importance(path, pattern: str, scores: dict, dropped=()) -> bool:
    """Per-layer importance bars coloured by layer type, one panel per metric in `scores`; the
    `dropped` layers hatched and marked. -> False (nothing written) when `scores` has neither metric."""
    rows = [m for m in PANELS if m in scores]
    if not rows:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    L = len(pattern)
    fig, axes = plt.subplots(len(rows), 1, figsize=(max(6, 0.18 * L + 2), 2.6 * len(rows)), squeeze=False)
    for ax, m in zip(axes[:, 0], rows):
        v = scores[m].float().tolist()
        bars = ax.bar(range(L), v, color=[COLORS[c] for c in pattern], edgecolor="black", linewidth=0.3)
        for i in dropped:
            bars[i].set_hatch("xx")
            bars[i].set_alpha(0.45)
            ax.annotate("x", (i, v[i]), ha="center", va="bottom", color="red", fontsize=9, fontweight="bold")
        ax.set_ylabel(m)
        ax.set_title(PANELS[m], fontsize=9)
        ax.axhline(0, color="black", linewidth=0.5)
        ax.set_xlim(-1, L)
    axes[-1, 0].set_xlabel("layer (original index; x = dropped)" if dropped else "layer")
    handles = [Patch(color=COLORS[c], label=KINDS[c].name) for c in COLORS if c in pattern]
    fig.suptitle(f"per-layer importance ({pattern if L <= 60 else f'{L} layers'})", fontsize=9)
    fig.legend(handles=handles, ncol=len(handles), fontsize=8, loc="upper center", bbox_to_anchor=(0.5, 0.95),
               frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
