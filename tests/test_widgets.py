"""The lessons' widgets: they show the numbers the course computes, live and as a picture.

The memory calculator must show zerokit.theory_bytes (checked against the ZeRO paper's own
figures), the shard map must show what a shard_range really owns (the numel // N bug drops
elements), the step timeline must place each stage's collectives in the phase where a
real step issued them, and every widget must leave a picture where no browser runs it.
"""

import json

import nbformat
import pytest
from nbclient import NotebookClient
from nbconvert import HTMLExporter

from zerokit import widgets
from zerokit.comm import trace_step
from zerokit.memory import theory_bytes
from conftest import run_ranks


def _shown_total(calculator):
    """The per-rank bytes the calculator's summary shows now (its data-bytes attribute)."""
    text = calculator.widget.children[6].value
    return float(text.split('data-bytes="')[1].split('"')[0])


@pytest.mark.parametrize("stage, paper_gb", [("ddp", 120), ("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.9)])
def test_the_paper_preset_shows_the_papers_numbers(stage, paper_gb):
    calc = widgets.memory_calculator(stage=stage)
    calc.widget.children[0].value = "ZeRO paper: 7.5B on 64 GPUs"
    assert _shown_total(calc) / 1e9 == pytest.approx(paper_gb, rel=0.02)  # the paper rounds


def test_moving_a_control_redraws_with_theory_bytes():
    calc = widgets.memory_calculator(psi=1e9, world_size=8, stage="zero2", precision="fp32", device_gb=24)
    before = calc.widget.children[7].value
    n_slider, stage_buttons, precision = calc.widget.children[2], calc.widget.children[3], calc.widget.children[4]
    for n in (1, 3, 1024):
        n_slider.value = n
        assert _shown_total(calc) == pytest.approx(theory_bytes(1e9, "zero2", n, "fp32")["total"])
    stage_buttons.value, precision.value = "zero3", "mixed"
    assert _shown_total(calc) == pytest.approx(theory_bytes(1e9, "zero3", 1024, "mixed")["total"])
    assert calc.widget.children[7].value != before  # the picture was redrawn
    assert "fits" in calc.widget.children[6].value


def test_the_shard_map_marks_what_a_floor_division_shard_range_drops():
    def floor_shards(numel, n, rank):
        size = numel // n
        return rank * size, (rank + 1) * size

    right = widgets.shard_figure([5, 2, 4], 3)
    wrong = widgets.shard_figure([5, 2, 4], 3, shard_range=floor_shards)
    assert "every element has one owner" in right.axes[0].get_title()
    assert "2 element(s) belong to no rank: 9..10" in wrong.axes[0].get_title()
    shown = widgets.shard_map([5, 2, 4], 3, shard_range=floor_shards)
    first = shown.widget.children[1].value
    shown.widget.children[0].value = 4  # 11 elements on 4 ranks: 3 dropped
    assert shown.widget.children[1].value != first


def test_every_widget_carries_a_static_picture_beside_its_live_view():
    for shown in (widgets.memory_calculator(), widgets.shard_map()):
        bundle = shown._repr_mimebundle_()
        assert "application/vnd.jupyter.widget-view+json" in bundle
        assert bundle["text/html"].startswith("<div><img src=\"data:image/png;base64,")


@pytest.mark.timeout(120)
def test_nbconvert_shows_the_pictures_where_no_browser_runs_the_widgets(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "from zerokit import widgets\nwidgets.memory_calculator()")])
    NotebookClient(nb, timeout=60, kernel_name="python3").execute()
    page, _ = HTMLExporter().from_notebook_node(nb)
    assert "zerokit-memory-total" in page and "data:image/png;base64," in page


def _traced(rank, world_size, stage):
    import torch

    import zerokit
    from zerokit.models import build_model, model_batch, model_loss

    model = build_model("mlp")
    opt = {"zero2": lambda: zerokit.ZeRO2Adam(model.parameters(), bucket_mb=0.001),
           "zero3": lambda: zerokit.ZeRO3Adam(model)}[stage]()
    batch = model_batch("mlp", 4, seed=rank)
    loss_fn = lambda out, y: model_loss("mlp", out, y)  # noqa: E731
    trace_step(model, opt, batch, loss_fn)  # Adam's state exists after the first step
    torch.manual_seed(0)
    return trace_step(model, opt, batch, loss_fn)


def _phase_of(trace, t):
    return next(name for name, start, end in trace["phases"] if start <= t <= end)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_traced_step_puts_each_stages_collectives_in_their_phase():
    zero2, zero3 = (run_ranks(_traced, 2, stage)[0] for stage in ("zero2", "zero3"))
    assert {_phase_of(zero2, t) for op, _, t in zero2["calls"] if op == "reduce_scatter"} == {"backward"}
    assert {_phase_of(zero2, t) for op, _, t in zero2["calls"] if op == "all_gather"} == {"step"}
    gathers = [_phase_of(zero3, t) for op, _, t in zero3["calls"] if op == "all_gather"]
    assert "forward" in gathers and "backward" in gathers and "step" not in gathers
    figure = widgets.timeline_figure(zero2, "ZeRO-2")
    assert figure.axes[0].get_title() == "ZeRO-2"
    assert json.dumps(widgets.step_timeline({"ZeRO-2": zero2, "ZeRO-3": zero3})._repr_mimebundle_()["text/plain"])


_FAKE_TRACES = """
def _trace(k):
    return {"phases": [("forward", 0, 1), ("backward", 1, 3), ("step", 3, 4)], "calls": [("all_gather", 10 * k, 3.5)]}


traces = {"your MyZeRO2Adam": _trace(1), "zerokit.ZeRO2Adam": _trace(2), "ZeRO-1": _trace(3)}
"""


@pytest.mark.timeout(120)
def test_a_saved_notebook_shows_the_finished_bar_and_every_traced_step(monkeypatch):
    """Rendered without its kernel (nbconvert, the feedback HTML), a notebook once showed each
    finished progress bar as "0/3" (the closed widget's first text) and only the first traced step
    (the widget's saved state held one picture). Now the bar's output ends as text with the final
    count, and the timeline's saved state holds a tab, with its picture, per configuration."""
    monkeypatch.delenv("CI", raising=False)  # CI silences bars; the kernel inherits this environment
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("from zerokit import widgets\n"
                                  "for i in widgets.progress(range(3), desc='N = 2, 3, 4'):\n    pass"),
        nbformat.v4.new_code_cell("from zerokit import widgets\n" + _FAKE_TRACES + "widgets.step_timeline(traces)")])
    NotebookClient(nb, timeout=60, kernel_name="python3").execute()
    (bar,) = nb.cells[0].outputs
    assert bar["data"]["text/plain"].startswith("N = 2, 3, 4: 3/3 done in"), bar
    assert "application/vnd.jupyter.widget-view+json" not in bar["data"]
    page, _ = HTMLExporter().from_notebook_node(nb)
    assert "N = 2, 3, 4: 3/3 done" in page and "0/3" not in page
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    (tabs,) = [m for m in state.values() if m["model_name"] == "TabModel"]
    assert tabs["state"]["titles"] == ["your MyZeRO2Adam", "zerokit.ZeRO2Adam", "ZeRO-1"]
    assert tabs["state"]["selected_index"] == 0
    pictures = [m for m in state.values() if m["model_name"] == "ImageModel"]
    assert len(pictures) == 3 and all(m.get("buffers") for m in pictures)


def test_progress_is_silent_where_it_would_flood_a_log(capsys, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    assert list(widgets.progress(range(3), desc="x")) == [0, 1, 2]
    assert capsys.readouterr().err == ""  # pytest's captured stderr is not a terminal


def test_progress_shows_in_a_kernel_and_in_a_terminal_but_not_under_ci(monkeypatch):
    """A kernel's stderr is no terminal (tqdm's own test would hide the bar in every notebook)."""
    monkeypatch.delenv("CI", raising=False)
    shell = type("Shell", (), {"kernel": object()})()
    monkeypatch.setattr("IPython.get_ipython", lambda: shell)
    assert widgets.progress(range(3)).disable is False
    monkeypatch.setenv("CI", "true")
    assert widgets.progress(range(3)).disable is True
    monkeypatch.setattr("IPython.get_ipython", lambda: None)
    monkeypatch.delenv("CI")
    monkeypatch.setattr("sys.stderr", type("Tty", (), {"isatty": lambda self: True, "write": lambda self, s: None,
                                                         "flush": lambda self: None})())
    assert widgets.progress(range(3)).disable is False


def test_the_cut_map_counts_what_each_cut_gives_and_draws_it():
    """Lesson 12's picture: the flat cut splits a row of W1 between ranks 0 and 1, the dim-0 cut gives
    every rank whole rows (torch.chunk's, by the reference dim0_chunk or a student's), padded."""
    import torch

    shapes = [(5, 4), (5,), (3, 5), (3,)]
    counts = widgets.cut_counts(shapes, 3)
    assert (counts["flat"]["shard"], counts["flat"]["rows_cut"], counts["flat"]["padding"]) == (15, 1, 2)
    for i, shape in enumerate(shapes):  # torch.chunk's rows, rank by rank
        lengths = [t.size(0) for t in torch.empty(shape).chunk(3)] + [0, 0, 0]
        assert [counts["dim0"]["rows"][r][i][1] for r in range(3)] == lengths[:3]
    assert (counts["dim0"]["shard"], counts["dim0"]["padding"]) == (16, 5)
    title = widgets.cut_figure(shapes, 3).axes[0].get_title()
    assert "1 row(s) cut between ranks" in title and "2 element(s) of padding" in title

    def floor_chunk(rows, n, r):  # a student's floor division: the remainder's rows belong to no rank
        c = rows // n
        return min(r * c, rows), c, c

    assert widgets.cut_counts(shapes, 3, floor_chunk)["dim0"]["padding"] < 0  # fewer elements stored than exist
    shown = widgets.cut_map(shapes, 3)
    first = shown.widget.children[1].value
    shown.widget.children[0].value = 4
    assert shown.widget.children[1].value != first
