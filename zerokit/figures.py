"""The course's diagrams, drawn with matplotlib so a lesson can show them inline.

collectives_figure()            who holds what before and after each collective
partition_figure(world_size)    who holds what under data parallel and each ZeRO stage
memory_bars(rows, title)        measured bytes per category beside theory (legend outside)
reshard_figure(numel, n, n2)    a flat buffer saved by n ranks, loaded by n2: who reads what (lesson 07)
unit_state_figure()             ZeRO-3: the states of a unit's buffer, and what moves it between them
"""

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

__all__ = ["collectives_figure", "partition_figure", "memory_bars", "reshard_figure", "unit_state_figure"]

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


def unit_state_figure():
    """ZeRO-3 (lesson 05): the four states of one unit's full-size buffer, what holds memory in
    each, and on every edge the method that moves it (exercise 1) and the hooks that call it
    (exercise 2). The edge gathering -> freed is a prefetch nobody used: released there too.
    """
    states = [  # (title, what is true in it, colour)
        ("shard only", "flat_params[bi]: Ψu/N elements\nparameters empty\nno buffer yet", "white"),
        ("gathering", "gathering[bi] =\n  (work, buffer, shard)\nbuffer: Ψu elements, arriving\n"
                      "parameters still empty", _COLORS[5]),
        ("full", "full[bi] = buffer\nparameters = views of it\nautograd may save views", _COLORS[0]),
        ("freed", "buffer storage resize_(0):\n0 bytes, under autograd's\nsaved views too\n"
                  "params empty, full[bi] = None", "#dddddd"),
    ]
    fig, ax = plt.subplots(figsize=(15, 6))
    xs, y, w, h = [0.0, 4.3, 8.6, 12.9], 0.0, 2.7, 1.7
    for x, (title, body, color) in zip(xs, states):
        ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="black", linewidth=1.2,
                               alpha=0.9 if color != "white" else 1.0))
        ink = "white" if color == _COLORS[0] else "black"
        ax.text(x + w / 2, y + h - 0.25, title, ha="center", va="center", fontsize=12, fontweight="bold", color=ink)
        ax.text(x + w / 2, y + 0.7, body, ha="center", va="center", fontsize=8, family="monospace", color=ink)

    def arrow(x0, x1, yy, rad, label, color="black", dy=0.0):
        ax.annotate("", xy=(x1, yy), xytext=(x0, yy),
                    arrowprops=dict(arrowstyle="-|>", lw=1.4, color=color, connectionstyle=f"arc3,rad={rad}"))
        ax.text((x0 + x1) / 2, yy + dy, label, ha="center", va="center", fontsize=8.5, color=color)

    mid = y + h / 2
    for k, label in enumerate(("start_gather\nasync all-gather\ninto gather_buffer",
                               "finish_gather\nwork.wait(),\ninstall the views",
                               "free\nempty params,\nresize_(0)")):
        arrow(xs[k] + w + 0.05, xs[k + 1] - 0.05, mid - 0.1, 0.0, label, dy=0.55)
    # freed -> gathering, over the top: the same buffer, its memory allocated again
    arrow(xs[3] + w / 2, xs[1] + w / 2, y + h, 0.3,
          "start_gather again: the SAME buffer, re-allocated by gather_buffer "
          "(autograd's saved views see the weights again)", color=_COLORS[0], dy=1.62)
    # gathering -> freed, under the bottom: a prefetch nobody used
    arrow(xs[1] + w / 2, xs[3] + w / 2, y, 0.3,
          "free() of a prefetch nobody used (a unit the forward skipped; the end of backward): "
          "work.wait(), then resize_(0) this buffer too", color=_COLORS[3], dy=-1.62)
    hooks = ["who calls them (exercise 2):",
             "  start_gather    <- gather_unit: in this unit's pre_forward or pre_backward, or ahead of time in "
             "the previous unit's (prefetch)",
             "  finish_gather   <- gather_unit of this unit: its pre_forward, its pre_backward",
             "  free            <- post_forward (after its forward; not the root), send (its gradients are on their "
             "way), _end_of_backward (the root, unused prefetches)"]
    ax.text(xs[0], y - 2.05, "\n".join(hooks), ha="left", va="top", fontsize=8.5, family="monospace")
    ax.set_xlim(-0.3, xs[3] + w + 0.3)
    ax.set_ylim(y - 3.3, y + h + 2.0)
    ax.set_title("ZeRO-3: one unit's buffer (bucket bi) through a step: the method on each edge, the hooks that "
                 "call it below", fontsize=11)
    ax.axis("off")
    fig.tight_layout()
    return fig
