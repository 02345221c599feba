"""The course's diagrams, drawn with matplotlib so a lesson can show them inline.

collectives_figure()            who holds what before and after each collective
partition_figure(world_size)    who holds what under data parallel and each ZeRO stage
memory_bars(rows, title)        measured bytes per category beside theory
reshard_figure(numel, n, n2)    a flat buffer saved by n ranks, loaded by n2: who reads what (lesson 07)
"""

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

__all__ = ["collectives_figure", "partition_figure", "memory_bars", "reshard_figure"]

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


def memory_bars(rows, title="bytes per rank", categories=("parameters", "gradients", "optimizer_states")):
    """Stacked bars of measured bytes per category, with a marker at the theoretical total.

    rows: list of (label, measured: {category: bytes}, theory_total_bytes or None).
    """
    fig, ax = plt.subplots(figsize=(1.4 * len(rows) + 3, 4))
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
    ax.set_ylabel("MiB per rank")
    ax.set_title(title)
    ax.legend(frameon=False)
    fig.tight_layout()
    return fig


def reshard_figure(numel, old_world, new_world, reads=None, sizes=None):
    """A flat buffer of `numel` elements saved by old_world ranks (top) and loaded by new_world ranks
    (bottom): each new rank's shard is filled with the pieces `reads` names, in the colour of the
    old rank they come from; padding is hatched. `sizes`: the parameters' sizes, drawn above.

    reads(numel, old_world, new_world, new_rank) -> [(old_rank, lo, hi)]; default
    zerokit.checkpoint.shard_reads. Pass your own to see what it does.
    """
    if reads is None:
        from .checkpoint import shard_reads as reads
    s_old, s_new = -(-numel // old_world), -(-numel // new_world)
    width = max(s_old * old_world, s_new * new_world)
    rows = 3 if sizes else 2
    fig, ax = plt.subplots(figsize=(11, 0.9 * rows + 0.9))
    y = rows - 1
    if sizes:
        x = 0
        for k, n in enumerate(sizes):
            ax.add_patch(Rectangle((x, y), n, 0.7, facecolor="#dddddd", edgecolor="black", linewidth=0.8))
            ax.text(x + n / 2, y + 0.35, f"p{k} ({n})", ha="center", va="center", fontsize=8)
            x += n
        ax.text(-width * 0.01, y + 0.35, "parameters", ha="right", va="center", fontsize=9)
        y -= 1
    for q in range(old_world):  # the saved shards
        lo, hi = q * s_old, (q + 1) * s_old
        real = min(hi, numel) - lo
        if real > 0:
            ax.add_patch(Rectangle((lo, y), real, 0.7, facecolor=_COLORS[q % len(_COLORS)], edgecolor="black"))
        if hi > numel:
            ax.add_patch(Rectangle((max(lo, numel), y), hi - max(lo, numel), 0.7, facecolor="white",
                                   edgecolor="black", hatch="///"))
        ax.text(lo + s_old / 2, y + 0.35, f"rank {q}", ha="center", va="center", fontsize=8, color="white")
    ax.text(-width * 0.01, y + 0.35, f"saved on {old_world}", ha="right", va="center", fontsize=9)
    y -= 1
    for r in range(new_world):  # the new shards, filled by the reads
        lo = r * s_new
        ax.add_patch(Rectangle((lo, y), s_new, 0.7, facecolor="white", edgecolor="black", linewidth=1.5,
                               hatch="///" if lo + s_new > numel else None))
        for q, a, b in reads(numel, old_world, new_world, r):
            ax.add_patch(Rectangle((a, y + 0.08), b - a, 0.54, facecolor=_COLORS[q % len(_COLORS)], edgecolor="black"))
            ax.text((a + b) / 2, y + 0.35, f"{q}", ha="center", va="center", fontsize=8, color="white")
        ax.text(lo + s_new / 2, y - 0.18, f"rank {r}: [{lo}, {min(lo + s_new, numel)})", ha="center", va="center",
                fontsize=7)
    ax.text(-width * 0.01, y + 0.35, f"loaded on {new_world}", ha="right", va="center", fontsize=9)
    ax.set_xlim(-width * 0.16, width * 1.01)
    ax.set_ylim(-0.5, rows)
    ax.set_title(f"{numel} elements: {old_world} shards of {s_old} -> {new_world} shards of {s_new} "
                 "(colour: the old rank each piece is read from; hatched: padding)", fontsize=10)
    ax.axis("off")
    fig.tight_layout()
    return fig
