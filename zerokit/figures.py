"""The course's diagrams, drawn with matplotlib so a lesson can show them inline.

collectives_figure()            who holds what before and after each collective
partition_figure(world_size)    who holds what under data parallel and each ZeRO stage
memory_bars(rows, title)        measured bytes per category beside theory (legend outside)
"""

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

__all__ = ["collectives_figure", "partition_figure", "memory_bars"]

_COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948"]
_SUM = "#7f7f7f"


def _row(ax, y, blocks, x0=0.0, width=0.9):
    """Draw one rank's blocks: each block is (colour or None, label)."""
    for k, (color, label) in enumerate(blocks):
        x = x0 + k * width
        ax.add_patch(Rectangle((x, y), width * 0.95, 0.8, facecolor=color or "white",
                               edgecolor="black", linewidth=0.8, alpha=0.9 if color else 1.0))
        if label:
            ax.text(x + width * 0.47, y + 0.4, label, ha="center", va="center", fontsize=8,
                    color="white" if color else "black")


def collectives_figure(world_size=4):
    """Four panels: broadcast, all-reduce, reduce-scatter, all-gather on world_size ranks.

    Rank r starts with its own data x_r cut in world_size chunks x_r[0..N-1]; Σ marks a sum
    over ranks. Left of each arrow: before; right: after.
    """
    n = world_size
    fig, axes = plt.subplots(1, 4, figsize=(16, 0.9 * n + 1.2))
    panels = {
        "broadcast (from rank 0)": (
            lambda r: [(_COLORS[r], f"x{r}")], lambda r: [(_COLORS[0], "x0")]),
        "all-reduce (sum)": (
            lambda r: [(_COLORS[r], f"x{r}")], lambda r: [(_SUM, "Σx")]),
        "reduce-scatter (sum)": (
            lambda r: [(_COLORS[r], f"x{r}[{c}]") for c in range(n)],
            lambda r: [(None, "")] * r + [(_SUM, f"Σx[{r}]")] + [(None, "")] * (n - r - 1)),
        "all-gather": (
            lambda r: [(None, "")] * r + [(_COLORS[r], f"y{r}")] + [(None, "")] * (n - r - 1),
            lambda r: [(_COLORS[c], f"y{c}") for c in range(n)]),
    }
    for ax, (title, (before, after)) in zip(axes, panels.items()):
        width = 0.9
        cols = max(len(before(0)), 1)
        for r in range(n):
            y = n - 1 - r
            ax.text(-0.15, y + 0.4, f"rank {r}", ha="right", va="center", fontsize=9)
            _row(ax, y, before(r), 0.0, width)
            ax.annotate("", xy=(cols * width + 0.75, y + 0.4), xytext=(cols * width + 0.15, y + 0.4),
                        arrowprops=dict(arrowstyle="->", lw=1))
            _row(ax, y, after(r), cols * width + 0.9, width)
        ax.set_xlim(-1.2, 2 * cols * width + 1.2)
        ax.set_ylim(-0.3, n + 0.1)
        ax.set_title(title, fontsize=11)
        ax.axis("off")
    fig.tight_layout()
    return fig


def partition_figure(world_size=4):
    """Who holds what: parameters, gradients and optimizer state per rank, for each stage.

    A full-width bar is a full copy; a bar with one coloured slice is a 1/N shard.
    """
    stages = [("data parallel", 0), ("ZeRO-1 (P_os)", 1), ("ZeRO-2 (P_os+g)", 2), ("ZeRO-3 (P_os+g+p)", 3)]
    parts = [("parameters", 2, "#4e79a7", 3), ("gradients", 2, "#f28e2b", 2), ("optimizer state", 12, "#59a14f", 1)]
    n = world_size
    fig, axes = plt.subplots(1, 4, figsize=(16, 0.55 * n + 1.4), sharey=True)
    total = sum(w for _, w, _, _ in parts)
    for ax, (title, level) in zip(axes, stages):
        for r in range(n):
            y = n - 1 - r
            x = 0.0
            for name, w, color, sharded_from in parts:
                width = w / total * 10
                if level >= sharded_from:  # sharded: only this rank's 1/N slice is held
                    ax.add_patch(Rectangle((x, y), width, 0.7, facecolor="white", edgecolor="#bbbbbb"))
                    ax.add_patch(Rectangle((x + r * width / n, y), width / n, 0.7, facecolor=color, edgecolor="black"))
                else:
                    ax.add_patch(Rectangle((x, y), width, 0.7, facecolor=color, edgecolor="black"))
                x += width
            ax.text(-0.2, y + 0.35, f"rank {r}", ha="right", va="center", fontsize=9)
        ax.set_xlim(-1.6, 10.2)
        ax.set_ylim(-0.9, n)
        ax.set_title(title, fontsize=11)
        ax.axis("off")
    handles = [Rectangle((0, 0), 1, 1, facecolor=c, edgecolor="black") for _, _, c, _ in parts]
    fig.legend(handles, [f"{name} ({w}Ψ bytes in mixed precision)" for name, w, _, _ in parts],
               loc="lower center", ncol=3, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def memory_bars(rows, title="bytes per rank", categories=("parameters", "gradients", "optimizer_states"),
                ylabel="MiB per rank"):
    """Stacked bars of measured bytes per category, with a marker at the theoretical total.

    rows: list of (label, measured: {category: bytes}, theory_total_bytes or None).
    ylabel: what a bar measures ("MiB" where one process ran, not ranks).
    The legend sits outside the axes, right of the bars, so it covers none of them.
    """
    fig, ax = plt.subplots(figsize=(1.4 * len(rows) + 5, 4))
    for k, (label, measured, theory) in enumerate(rows):
        bottom = 0.0
        for c, color in zip(categories, _COLORS):
            v = measured.get(c, 0) / 2**20
            ax.bar(k, v, bottom=bottom, color=color, edgecolor="black", label=c if k == 0 else None)
            bottom += v
        if theory is not None:
            ax.plot([k - 0.4, k + 0.4], [theory / 2**20] * 2, color="black", lw=2, ls="--",
                    label="theory" if k == 0 else None)
    ax.set_xticks(range(len(rows)), [r[0] for r in rows])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    return fig
