r"""Interactive figures for the lessons, drawn from the same functions the checks use.

    memory_calculator()          model-state bytes per rank: Ψ, N, stage, precision, device
    shard_map(sizes, N)          the flat buffer, its padding, and which rank owns what
    cut_map(shapes, N)           the same parameters cut flat (lessons 03-05) and on dim 0 (FSDP2, lesson 12)
    step_timeline(traces)        one real training step per configuration: the collectives in order, by phase
    link_time_explorer()         lesson 11: each scheme's communication per step against the bandwidth between nodes
    progress(iterable, desc)     a progress bar (a widget in JupyterLab, text in a terminal)

The numbers are never computed here: the calculator shows `zerokit.theory_bytes`, the shard
map cuts with `zerokit.flat.shard_range` (or the student's own), the cut map with it and
`zerokit.fully_shard.param.dim0_chunk` (or the student's own), the timeline draws what
`zerokit.comm.trace_step` recorded. So a widget cannot disagree with a graded number.

Each widget is also a picture: its display carries a static HTML rendering of its first
state beside the live view, so nbconvert (the feedback HTML, a notebook run without a
browser) shows the figure where JupyterLab shows the controls.
"""

import base64
import html
import io
import math
import os
import sys

from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from .flat import padded_numel
from .flat import shard_range as reference_shard_range
from .memory import STAGES, theory_bytes

__all__ = ["memory_calculator", "shard_map", "step_timeline", "cut_map", "progress", "memory_figure", "shard_figure",
           "timeline_figure", "cut_figure", "cut_counts", "PRESETS", "link_time_explorer", "link_time_figure"]

_CATEGORIES = (("parameters", "weights", "#4e79a7"), ("gradients", "gradients", "#f28e2b"),
               ("optimizer_states", "optimizer state", "#59a14f"))
_STAGE_NAMES = {"ddp": "data parallel", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}
# name -> (Ψ, N): the ZeRO paper's example, and two models people ask about
PRESETS = {"ZeRO paper: 7.5B on 64 GPUs": (7.5e9, 64), "GPT-3: 175B on 1024 GPUs": (175e9, 1024),
           "a 7B model on 8 GPUs": (7e9, 8)}
GB = 1e9  # the paper's gigabytes (decimal), as its 120 GB / 31.4 / 16.6 / 1.9 GB are
# Ψ on a log scale, 1M to 1T, through exact values (a FloatLogSlider rounds its exponent to its
# step, and 7.5e9 would come back as 7.585e9: the bytes shown would not be the paper's)
PSI_STEPS = sorted({m * 10**k for k in range(6, 12) for m in (1, 1.5, 2, 3, 5, 7, 7.5)} | {175e9, 1e12})


def _psi_label(psi):
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if psi >= size:
            return f"{psi / size:g}{unit}"
    return f"{psi:g}"


def progress(iterable=None, desc=None, total=None):
    """A tqdm bar over `iterable`: a widget in a notebook, text in a terminal; silent under CI
    (CI=true) and where stderr is a log file, where a redrawn bar would only flood it.

    In a notebook the finished bar becomes a line of text, "N = 2, 4: 2/2 done in 12.3 s": a
    saved notebook rendered without its kernel (nbconvert, the feedback HTML) shows how far it
    got, where a closed widget left only its first state, "0/2"."""
    from tqdm.auto import tqdm

    shows = _shows_progress()
    if shows and _in_kernel():
        return _kernel_bar()(iterable, desc=desc, total=total, leave=False)
    return tqdm(iterable, desc=desc, total=total, disable=not shows, leave=False)


def _in_kernel():
    # a Jupyter kernel's stderr says it is no terminal, yet there the bar is a widget, not text
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and getattr(shell, "kernel", None) is not None


def _shows_progress():
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        return False
    return _in_kernel() or (sys.stderr is not None and sys.stderr.isatty())


def _kernel_bar():
    """tqdm's notebook bar, shown through a display handle so that closing it can leave text."""
    from IPython.display import display
    from tqdm.notebook import tqdm as notebook_tqdm

    class KernelBar(notebook_tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, display=False, **kwargs)
            self._handle = None
            if not self.disable:
                self._handle = display(self.container._repr_mimebundle_(), raw=True, display_id=True)
                self.displayed = True

        def close(self):
            handle, self._handle = getattr(self, "_handle", None), None
            if handle is None:  # disabled, or closed already (tqdm closes again when collected)
                return super().close()
            elapsed = self.format_dict["elapsed"]
            total = f"/{self.total:g}" if self.total else ""
            how = "done" if not self.total or self.n >= self.total else "stopped"
            line = f"{self.desc + ': ' if self.desc else ''}{self.n:g}{total} {how} in {elapsed:.1f} s"
            super().close()
            handle.update({"text/plain": line, "text/html": f'<div class="zerokit-progress">{html.escape(line)}</div>'},
                          raw=True)

    return KernelBar


# ---------------------------------------------------------------------------------------
# the figures (matplotlib Figures, not pyplot's: no global state, nothing shown twice; a
# notebook cell that returns one shows it)


def memory_figure(psi, world_size, stage, precision="mixed", device_gb=80):
    """Stacked bars of model-state bytes per rank for every stage (the chosen one in full
    colour), the device's memory as a line, from zerokit.theory_bytes."""
    fig = Figure(figsize=(7.5, 3.6))
    ax = fig.subplots()
    for k, s in enumerate(STAGES):
        t = theory_bytes(psi, s, world_size, precision)
        bottom = 0.0
        for key, label, color in _CATEGORIES:
            ax.bar(k, t[key] / GB, bottom=bottom, color=color, edgecolor="black", alpha=1.0 if s == stage else 0.3)
            bottom += t[key] / GB
        ax.text(k, bottom, f"{bottom:.3g} GB", ha="center", va="bottom", fontsize=9,
                fontweight="bold" if s == stage else "normal")
    line = ax.axhline(device_gb, color="#e15759", ls="--", lw=1.5)
    ax.set_xticks(range(len(STAGES)), [_STAGE_NAMES[s] for s in STAGES])
    ax.set_ylabel("GB of model state per rank")
    ax.set_title(f"Ψ = {psi:.3g} parameters, N = {world_size}, {precision}", fontsize=10)
    handles = [Patch(facecolor=color, edgecolor="black") for _, _, color in _CATEGORIES] + [line]
    ax.legend(handles, [label for _, label, _ in _CATEGORIES] + [f"device: {device_gb:g} GB"], frameon=False,
              fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig


def _memory_summary(psi, world_size, stage, precision, device_gb):
    t = theory_bytes(psi, stage, world_size, precision)
    fits = t["total"] <= device_gb * GB
    parts = " + ".join(f"{t[key] / GB:.3g} ({label})" for key, label, _ in _CATEGORIES)
    verdict = "fits" if fits else "does not fit"
    return (f'<span class="zerokit-memory-total" data-bytes="{t["total"]:.0f}"><b>{_STAGE_NAMES[stage]}: '
            f'{t["total"] / GB:.4g} GB per rank</b></span> = {parts} GB; '
            f'<span class="zerokit-memory-fits">{verdict}</span> in {device_gb:g} GB')


def shard_figure(sizes, world_size, shard_range=None, names=None):
    """The flat buffer of parameters of `sizes`, padded for world_size ranks, and what each
    rank's shard_range(numel, N, rank) owns; elements no rank owns are marked."""
    shard_range = shard_range or reference_shard_range
    names = list(names) if names is not None else [f"p{i}" for i in range(len(sizes))]
    numel, n = sum(sizes), world_size
    padded = padded_numel(numel, n)
    fig = Figure(figsize=(9, 0.5 * n + 1.6))
    ax = fig.subplots()
    top = n + 0.3
    x = 0
    for i, size in enumerate(sizes):  # the flat buffer: parameters end to end
        color = colormaps["tab10"](i % 10)
        ax.add_patch(Rectangle((x, top), size, 0.6, facecolor=color, edgecolor="black", lw=0.6))
        ax.text(x + size / 2, top + 0.3, f"{names[i]} ({size})", ha="center", va="center", fontsize=7)
        x += size
    if padded > numel:
        ax.add_patch(Rectangle((numel, top), padded - numel, 0.6, facecolor="white", edgecolor="black", hatch="//",
                               lw=0.6))
        ax.text(padded, top + 0.75, "padding", ha="right", va="bottom", fontsize=7)
    ax.text(-0.01 * padded, top + 0.3, "flat buffer", ha="right", va="center", fontsize=8)
    owned = [False] * max(numel, 1)
    for r in range(n):
        start, end = shard_range(numel, n, r)
        y = n - 1 - r
        ax.add_patch(Rectangle((start, y), max(end - start, 0), 0.6, facecolor="#bab0ac", edgecolor="black"))
        ax.text(-0.01 * padded, y + 0.3, f"rank {r}", ha="right", va="center", fontsize=8)
        ax.text(start + (end - start) / 2, y + 0.3, f"[{start}, {end})", ha="center", va="center", fontsize=7)
        for e in range(max(start, 0), min(end, numel)):
            owned[e] = True
    dropped = [e for e in range(numel) if not owned[e]]
    for e in dropped:
        ax.add_patch(Rectangle((e, -0.9), 1, 0.5, facecolor="#e15759", edgecolor="none"))
    if dropped:
        ax.text(-0.01 * padded, -0.65, "no owner", ha="right", va="center", fontsize=8, color="#e15759")
    caption = (f"{len(dropped)} element(s) belong to no rank: {dropped[0]}..{dropped[-1]}" if dropped else
               f"{numel} elements, padded to {padded} = {n} x {padded // n}: every element has one owner")
    ax.set_title(caption, fontsize=10, color="#e15759" if dropped else "black")
    ax.set_xlim(-0.12 * padded, padded * 1.02)
    ax.set_ylim(-1.1, top + 0.8)
    ax.axis("off")
    fig.tight_layout()
    return fig


def cut_counts(shapes, world_size, dim0_chunk=None):
    """What the two cuts of parameters of `shapes` over N ranks give, per rank (lists) and in all:
    flat (lesson 03's buffer, end to end, S = ceil(numel / N)): each rank's pieces (index, lo, hi) of
    flattened parameters, the rows a shard boundary cuts, the padding; dim 0 (FSDP2): each rank's
    (start, length, c) of every parameter, its storage S = sum c_i w_i, the padding N S - numel."""
    if dim0_chunk is None:
        from .fully_shard.param import dim0_chunk  # here: fully_shard imports torch.distributed.tensor
    n = world_size
    widths = [math.prod(s[1:]) for s in shapes]
    numels = [s[0] * w for s, w in zip(shapes, widths)]
    offsets = [sum(numels[:i]) for i in range(len(numels))]
    total = sum(numels)
    flat_s = padded_numel(total, n) // n
    pieces = [[(i, max(o, r * flat_s) - o, min(o + m, (r + 1) * flat_s) - o)
               for i, (o, m) in enumerate(zip(offsets, numels)) if max(o, r * flat_s) < min(o + m, (r + 1) * flat_s)]
              for r in range(n)]
    cut = sum(1 for r in range(1, n) for i, (o, m, w) in enumerate(zip(offsets, numels, widths))
              if o < r * flat_s < o + m and (r * flat_s - o) % w)
    rows = [[tuple(dim0_chunk(s[0], n, r)) for s in shapes] for r in range(n)]
    dim0_s = sum(c * w for (_, _, c), w in zip(rows[0], widths))
    return {"flat": {"shard": flat_s, "pieces": pieces, "rows_cut": cut, "padding": n * flat_s - total},
            "dim0": {"shard": dim0_s, "rows": rows, "rows_cut": 0, "padding": n * dim0_s - total},
            "numel": total, "widths": widths}


def cut_figure(shapes, world_size, names=None, dim0_chunk=None):
    """The same parameters cut two ways over N ranks: the flat buffer in N equal pieces (lessons 03-05),
    and each parameter on dim 0 (FSDP2): what every rank holds, row boundaries as thin lines, padding
    hatched, and in red a row that a flat shard boundary cuts in two."""
    counts = cut_counts(shapes, world_size, dim0_chunk)
    names = list(names) if names is not None else [f"p{i}" for i in range(len(shapes))]
    n, widths = world_size, counts["widths"]
    flat, dim0 = counts["flat"], counts["dim0"]
    width = max(flat["shard"], dim0["shard"])
    fig = Figure(figsize=(10, 1.1 * n + 1.8))
    axes = fig.subplots(1, 2, sharey=True)
    colors = [colormaps["tab10"](i % 10) for i in range(len(shapes))]

    def block(ax, x, y, length, i, row_from):
        """length elements of parameter i from its element row_from on, at x: colour, and a line at each row."""
        ax.add_patch(Rectangle((x, y), length, 0.6, facecolor=colors[i], edgecolor="black", lw=0.5))
        w = widths[i]
        for e in range(row_from + 1, row_from + length):
            if e % w == 0:
                ax.plot([x + e - row_from] * 2, [y, y + 0.6], color="white", lw=0.8)

    for r in range(n):
        y = n - 1 - r
        x = 0
        for i, lo, hi in flat["pieces"][r]:
            block(axes[0], x, y, hi - lo, i, lo)
            for edge, at in ((lo, x), (hi, x + hi - lo)):
                if edge % widths[i] and 0 < edge < shapes[i][0] * widths[i]:  # a row cut at a shard boundary
                    axes[0].plot([at, at], [y - 0.05, y + 0.65], color="#e15759", lw=2.5)
            x += hi - lo
        if x < flat["shard"]:
            axes[0].add_patch(Rectangle((x, y), flat["shard"] - x, 0.6, facecolor="white", edgecolor="black",
                                        hatch="//", lw=0.5))
        x = 0
        for i, (_, length, c) in enumerate(dim0["rows"][r]):
            if length:
                block(axes[1], x, y, length * widths[i], i, 0)
            if c > length:
                axes[1].add_patch(Rectangle((x + length * widths[i], y), (c - length) * widths[i], 0.6,
                                            facecolor="white", edgecolor=colors[i], hatch="//", lw=0.8))
            x += c * widths[i]
        axes[0].text(-0.02 * width, y + 0.3, f"rank {r}", ha="right", va="center", fontsize=8)
    axes[0].set_title(f"flat buffer, N = {n}: {flat['shard']} elements a rank\n{flat['rows_cut']} row(s) cut between "
                      f"ranks (red), {flat['padding']} element(s) of padding", fontsize=9)
    axes[1].set_title(f"dim 0 (FSDP2), N = {n}: {dim0['shard']} elements a rank\nno row cut, "
                      f"{dim0['padding']} element(s) of padding (hatched)", fontsize=9)
    for ax in axes:
        ax.set_xlim(-0.01 * width, width * 1.01)
        ax.set_ylim(-0.2, n + 0.1)
        ax.set_yticks([])
        ax.set_xlabel("elements of the rank's storage")
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)
    handles = [Patch(facecolor=colors[i], edgecolor="black", label=f"{names[i]} {'x'.join(map(str, s))}")
               for i, s in enumerate(shapes)]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(shapes), 6), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0.03, 0.12, 1, 1))
    return fig


_OP_COLORS = {"all_gather": "#4e79a7", "reduce_scatter": "#f28e2b", "all_reduce": "#e15759", "broadcast": "#76b7b2"}
_PHASE_COLORS = {"forward": "#d4e6f1", "backward": "#dddddd", "step": "#c7e9c0"}


def timeline_figure(trace, title=""):
    """One step as zerokit.comm.trace_step recorded it: the phases as bars, each collective a
    tick on its own lane at the moment it was issued, labelled with its size."""
    fig = Figure(figsize=(10, 2.4))
    ax = fig.subplots()
    for name, start, end in trace["phases"]:
        ax.barh(1, end - start, left=start, color=_PHASE_COLORS.get(name, "#eeeeee"), edgecolor="black")
        ax.text(start + (end - start) / 2, 1, name, ha="center", va="center", fontsize=8)
    lanes = sorted({op for op, _, _ in trace["calls"]})
    for op, numel, t in trace["calls"]:
        lane = -lanes.index(op) * 0.5
        ax.vlines(t, lane - 0.2, lane + 0.2, color=_OP_COLORS.get(op, "black"), lw=2)
    for k, op in enumerate(lanes):
        calls = [c for c in trace["calls"] if c[0] == op]
        ax.text(-0.01 * max(e for _, _, e in trace["phases"]), -k * 0.5,
                f"{op.replace('_', '-')} ×{len(calls)}, {sum(c[1] for c in calls):,} el.", ha="right", va="center",
                fontsize=8)
    end = max(e for _, _, e in trace["phases"])
    ax.set_xlim(-0.35 * end, end * 1.02)
    ax.set_xticks([t for t in ax.get_xticks() if 0 <= t <= end])  # the left margin holds the lane labels
    ax.set_ylim(-0.5 * len(lanes) - 0.2, 1.6)
    ax.set_yticks([])
    ax.set_xlabel("ms since forward began (issue times; the recorder itself slows each operation)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------
# live views (ipywidgets) with a static fallback


def _png(fig):
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return buf.getvalue()


class _Shown:
    """A widget whose display also carries a static HTML picture of its first state.

    JupyterLab renders the widget; nbconvert, which cannot run it, falls back to the HTML
    (its exporter skips a widget view when the notebook holds no widget state).
    """

    def __init__(self, widget, static_html):
        self.widget, self.static_html = widget, static_html

    def _repr_mimebundle_(self, **kwargs):
        bundle = self.widget._repr_mimebundle_(**kwargs) or {}
        return {**bundle, "text/html": self.static_html}


def _static(png, caption):
    data = base64.b64encode(png).decode()
    return f'<div><img src="data:image/png;base64,{data}"/><div>{caption}</div></div>'


def _image_widget(png):
    import ipywidgets as w

    return w.Image(value=png, format="png")


def memory_calculator(psi=7.5e9, world_size=64, stage="zero3", precision="mixed", device_gb=80):
    """Model-state memory per rank by the ZeRO paper's formulas (zerokit.theory_bytes)."""
    import ipywidgets as w

    presets = w.Dropdown(options=["(your own)", *PRESETS], description="preset")
    steps = sorted(set(PSI_STEPS) | {psi})
    psi_w = w.SelectionSlider(options=[(_psi_label(v), v) for v in steps], value=psi, description="Ψ")
    n_w = w.IntSlider(value=world_size, min=1, max=1024, description="N (ranks)", continuous_update=False)
    stage_w = w.ToggleButtons(options=[(_STAGE_NAMES[s], s) for s in STAGES], value=stage, description="stage")
    prec_w = w.ToggleButtons(options=["fp32", "mixed"], value=precision, description="precision")
    dev_w = w.Dropdown(options=[24, 40, 80, 141], value=device_gb, description="device GB")
    image = _image_widget(_png(memory_figure(psi, world_size, stage, precision, device_gb)))
    summary = w.HTML(_memory_summary(psi, world_size, stage, precision, device_gb))

    def redraw(_=None):
        args = (psi_w.value, n_w.value, stage_w.value, prec_w.value, dev_w.value)
        image.value = _png(memory_figure(*args))
        summary.value = _memory_summary(*args)

    def preset(change):
        if change["new"] in PRESETS:
            psi_w.value, n_w.value = PRESETS[change["new"]]

    presets.observe(preset, names="value")
    for control in (psi_w, n_w, stage_w, prec_w, dev_w):
        control.observe(redraw, names="value")
    box = w.VBox([presets, psi_w, n_w, stage_w, prec_w, dev_w, summary, image])
    box.add_class("zerokit-memory-calculator")
    return _Shown(box, _static(image.value, _memory_summary(psi, world_size, stage, precision, device_gb)))


def shard_map(sizes=(5, 2, 4), world_size=3, shard_range=None, names=None):
    """The flat buffer of these parameter sizes cut for N ranks; pass your own shard_range to
    see what it owns (a numel // N shard drops the remainder: those elements turn red)."""
    import ipywidgets as w

    n_w = w.IntSlider(value=world_size, min=1, max=8, description="N (ranks)")
    image = _image_widget(_png(shard_figure(sizes, world_size, shard_range, names)))
    n_w.observe(lambda change: setattr(image, "value", _png(shard_figure(sizes, change["new"], shard_range, names))),
                names="value")
    box = w.VBox([n_w, image])
    box.add_class("zerokit-shard-map")
    caption = html.escape(f"shard map of {list(sizes)} on {world_size} ranks")
    return _Shown(box, _static(image.value, caption))


def cut_map(shapes=((5, 4), (5,), (3, 5), (3,)), world_size=3, names=None, dim0_chunk=None):
    """The same parameters cut flat and on dim 0 for N ranks (a slider); pass your own dim0_chunk to see
    what it gives each rank."""
    import ipywidgets as w

    n_w = w.IntSlider(value=world_size, min=1, max=8, description="N (ranks)")
    image = _image_widget(_png(cut_figure(shapes, world_size, names, dim0_chunk)))
    n_w.observe(lambda change: setattr(image, "value", _png(cut_figure(shapes, change["new"], names, dim0_chunk))),
                names="value")
    box = w.VBox([n_w, image])
    box.add_class("zerokit-cut-map")
    caption = html.escape(f"the flat cut and the dim-0 cut of {len(shapes)} parameters on {world_size} ranks")
    return _Shown(box, _static(image.value, caption))


def step_timeline(traces):
    """One recorded step per configuration ({label: zerokit.comm.trace_step(...)}), a tab each:
    which collectives each stage issues, and in which phase.

    Every configuration's picture is in the widget itself (the tabs switch in the page, with no
    kernel behind them), so a saved notebook shows each of them, the first one open, as the
    static picture (all of them, one under the other) does."""
    import ipywidgets as w

    labels = list(traces)
    pngs = [_png(timeline_figure(traces[label], label)) for label in labels]
    tabs = w.Tab(children=[_image_widget(png) for png in pngs], titles=labels, selected_index=0)
    tabs.add_class("zerokit-step-timeline")
    pictures = "".join(_static(png, html.escape(label)) for png, label in zip(pngs, labels))
    return _Shown(tabs, pictures)



# ---------------------------------------------------------------------------------------
# lesson 11: time against the bandwidth between nodes (zerokit.alphabeta)

_SCHEME_COLORS = {"ZeRO-3": "#4e79a7", "hpZ": "#f28e2b", "qwZ": "#59a14f", "qwZ + hpZ": "#e15759",
                  "hybrid sharding": "#76b7b2", "ZeRO++ (qwZ + hpZ + qgZ)": "#b07aa1"}
NIC_GBS = [1, 1.5, 2, 3, 5, 7, 10, 12.5, 15, 20, 25, 30, 40, 50, 70, 100, 200, 400]  # per NIC, one direction


def _link_times(cluster, psi, units, block):
    from .alphabeta import SCHEMES, step_time

    return {s: step_time(s, psi, cluster, units=units, block=block)["total"].total for s in SCHEMES}


def link_time_figure(cluster, psi=7.5e9, units=32, block=32, tokens_per_gpu=2048, mfu=0.4):
    """Each scheme's communication per step (zerokit.alphabeta.step_time: no overlap, the
    quantisation kernels included) against the bandwidth of one NIC, the rest of `cluster` as
    it is; the cluster's own NIC marked, and the compute of a step as a dashed line."""
    from .alphabeta import GB, SCHEMES, compute_time

    fig = Figure(figsize=(8, 3.8))
    ax = fig.subplots()
    curves = {s: [] for s in SCHEMES}
    for gbs in NIC_GBS:
        for s, t in _link_times(cluster.with_(nic_bandwidth=gbs * GB), psi, units, block).items():
            curves[s].append(t)
    here = _link_times(cluster, psi, units, block)
    for s in SCHEMES:
        ax.loglog(NIC_GBS, curves[s], "-", color=_SCHEME_COLORS[s], label=s, lw=1.6)
        ax.plot([cluster.nic.bandwidth / GB], [here[s]], "o", color=_SCHEME_COLORS[s], ms=5)
    ax.axvline(cluster.nic.bandwidth / GB, color="0.6", lw=0.8, ls=":")
    compute = compute_time(cluster, psi, tokens_per_gpu, mfu)
    ax.axhline(compute, color="k", ls="--", lw=1)
    ax.text(NIC_GBS[0], compute, f" compute: {tokens_per_gpu} tokens per GPU at {mfu:.0%} MFU", va="bottom",
            fontsize=8)
    ax.set_xlabel("bandwidth of one NIC, GB/s per direction (dotted: this cluster's)")
    ax.set_ylabel("communication per step, s")
    rails = "rails: one NIC per GPU" if cluster.rails else f"{cluster.nics} NIC(s) per node of {cluster.gpus_per_node}"
    ax.set_title(f"Ψ = {psi:.3g}, {cluster.nodes} x {cluster.gpus_per_node} GPUs, {rails}, "
                 f"NVLink {cluster.nvlink.bandwidth / GB:g} GB/s", fontsize=9)
    ax.legend(frameon=False, fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig


def _link_summary(cluster, psi, units, block):
    from .alphabeta import GB

    times = sorted(_link_times(cluster, psi, units, block).items(), key=lambda kv: kv[1])
    rows = "".join(f'<tr><td>{html.escape(s)}</td><td class="zerokit-link-time" data-scheme="{html.escape(s)}" '
                   f'data-seconds="{t:.9g}">{t * 1e3:.4g} ms</td></tr>' for s, t in times)
    return (f"<div>at {cluster.nic.bandwidth / GB:g} GB/s per NIC, {cluster.nics} NIC(s) per node: communication "
            f"per step, fastest first</div><table>{rows}</table>")


def link_time_explorer(psi=7.5e9, preset=None, units=32, block=32, tokens_per_gpu=2048):
    """The α-β model of lesson 11 (zerokit.alphabeta): every scheme's communication per step
    against the bandwidth between nodes, on a preset cluster whose NICs, nodes and NIC
    bandwidth the controls change."""
    import ipywidgets as w

    from .alphabeta import GB, PRESETS as CLUSTERS

    preset = preset or next(iter(CLUSTERS))
    base = CLUSTERS[preset]
    preset_w = w.Dropdown(options=list(CLUSTERS), value=preset, description="cluster",
                          layout=w.Layout(width="520px"))
    nics_w = w.ToggleButtons(options=[1, 2, 4, 8], value=base.nics, description="NICs/node")
    gbs_w = w.SelectionSlider(options=NIC_GBS, value=base.nic.bandwidth / GB, description="GB/s per NIC")
    nodes_w = w.IntSlider(value=base.nodes, min=2, max=64, description="nodes", continuous_update=False)
    psi_w = w.SelectionSlider(options=[(_psi_label(v), v) for v in sorted(set(PSI_STEPS) | {psi})], value=psi,
                              description="Ψ")

    def cluster():
        return CLUSTERS[preset_w.value].with_(nics=nics_w.value, nic_bandwidth=gbs_w.value * GB,
                                              nodes=nodes_w.value)

    image = _image_widget(_png(link_time_figure(cluster(), psi_w.value, units, block, tokens_per_gpu)))
    summary = w.HTML(_link_summary(cluster(), psi_w.value, units, block))
    first = (image.value, summary.value)

    def redraw(_=None):
        image.value = _png(link_time_figure(cluster(), psi_w.value, units, block, tokens_per_gpu))
        summary.value = _link_summary(cluster(), psi_w.value, units, block)

    def choose(change):
        c = CLUSTERS[change["new"]]
        nics_w.value, gbs_w.value, nodes_w.value = c.nics, c.nic.bandwidth / GB, c.nodes
        redraw()

    preset_w.observe(choose, names="value")
    for control in (nics_w, gbs_w, nodes_w, psi_w):
        control.observe(redraw, names="value")
    box = w.VBox([preset_w, nics_w, gbs_w, nodes_w, psi_w, summary, image])
    box.add_class("zerokit-link-time")
    return _Shown(box, _static(first[0], first[1]))
