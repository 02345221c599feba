"""The figure beside the JSON: step time against the floor, memory at its peak by category,
and communication against theory, one bar per configuration."""

from .accounting import MODEL_STATE
from .table import mib


def plot(summary, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = summary["configs"]
    names = [c["label"] for c in configs]
    palette = {"torch": "#4e79a7", "zerokit": "#f28e2b", "wrapper": "#edc948"}
    colors = [palette[c["system"]] for c in configs]
    x = range(len(configs))
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    ax = axes[0]
    ax.bar(x, [c["step_time_s"]["median"] * 1e3 for c in configs], color=colors)
    ax.scatter(x, [c["floor_s"] * 1e3 for c in configs], marker="_", s=600, color="black", label="floor", zorder=3)
    ax.set_ylabel("median step time (ms)")
    ax.set_title("step time (blue: PyTorch, orange: zerokit's lessons, yellow: zerokit in PyTorch's shape)")
    ax.legend()
    ax = axes[1]
    # what was live at the moment of the peak, on the rank with the highest peak: sums to it
    at_peak = [max(c["memory_at_peak_per_rank"], key=lambda m: m.get("total", 0)) for c in configs]
    bottom = [0.0] * len(configs)
    for cat, col in zip(MODEL_STATE + ("other",), ("#59a14f", "#e15759", "#76b7b2", "#bab0ac")):
        vals = [mib(m.get(cat, 0)) for m in at_peak]
        ax.bar(x, vals, bottom=bottom, color=col, label=cat)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("MiB per rank")
    ax.set_title("memory per rank at its peak, by category")
    ax.legend(fontsize=8)
    ax = axes[2]
    ax.bar(x, [mib(c["comm"]["volume_bytes"]) for c in configs], color=colors)
    ax.scatter(x, [mib(c["comm"]["theory_volume_bytes"]) for c in configs], marker="_", s=600, color="black",
               label="theory (2Ψ / 3Ψ)", zorder=3)
    ax.set_ylabel("MiB per rank per step (paper convention)")
    ax.set_title("communication")
    ax.legend()
    for ax in axes:
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
    meta = summary["meta"]
    fig.suptitle(f"zerokit vs PyTorch, world size {meta['world_size']} ({meta['backend']}), "
                 f"{meta['model']['parameters'] / 1e6:.2f} M parameters")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
