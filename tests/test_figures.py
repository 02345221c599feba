"""The lessons' figures: what they draw is readable (nothing covers a bar) and labelled truly."""

import json

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from conftest import ROOT  # noqa: E402
from zerokit.figures import memory_bars  # noqa: E402

MIB = 2**20
# lesson 02's chart: 7 equal bars (N = 1, 2, 4, every rank), each at its theory line
EQUAL = {"parameters": 1.1 * MIB, "gradients": 1.1 * MIB, "optimizer_states": 2.1 * MIB}
LESSON02 = [(f"N = {n}\nrank {r}", EQUAL, 4.3 * MIB) for n in (1, 2, 4) for r in range(n)]
LESSON01 = [("fp32 (measured)", {"parameters": 7e6, "gradients": 7e6, "optimizer_states": 14e6}, 28e6),
            ("mixed (measured)", {"parameters": 3.5e6, "gradients": 3.5e6, "optimizer_states": 21e6}, 28e6)]


def _overlaps(a, b):
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.mark.parametrize("rows", [LESSON02, LESSON01, LESSON02[:1]], ids=["lesson02", "lesson01", "one bar"])
def test_the_legend_covers_no_bar(rows):
    fig = memory_bars(rows, title="t")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    legend = (ax.get_legend() or fig.legends[0]).get_window_extent(renderer)
    bars = [patch.get_window_extent(renderer) for patch in ax.patches]
    assert bars
    covered = [i for i, bar in enumerate(bars) if _overlaps(legend, bar)]
    plt.close(fig)
    assert not covered, f"the legend covers bar segments {covered}"


def test_the_y_label_says_per_rank_only_where_there_are_ranks():
    fig = memory_bars(LESSON01, title="t", ylabel="MiB")
    assert fig.axes[0].get_ylabel() == "MiB"
    plt.close(fig)
    fig = memory_bars(LESSON02, title="t")
    assert fig.axes[0].get_ylabel() == "MiB per rank"
    plt.close(fig)


def test_lesson_01_runs_on_one_process_and_its_chart_says_so():
    nb = json.loads((ROOT / "solutions" / "01_adam" / "01_adam.ipynb").read_text())
    source = next("".join(c["source"]) for c in nb["cells"]
                  if c["cell_type"] == "code" and "memory_bars(" in "".join(c["source"]))
    measured = {"fp32": LESSON01[0][1], "mixed": LESSON01[1][1]}
    names = {"memory_bars": memory_bars, "psi": 1_744_776, "measured": measured,
             "model_state_bytes": lambda psi, p: {"total": 16 * psi}}
    exec(source, names)
    fig = plt.gcf()
    assert "rank" not in fig.axes[0].get_ylabel(), fig.axes[0].get_ylabel()
    plt.close("all")
