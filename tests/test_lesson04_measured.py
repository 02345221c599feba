"""Lesson 04's measured sections show what their text says (issue 18).

- Section 8 measures the student's own ZeRO-2 beside a capped one: without a cap every bucket's
  flat copy is in flight at the end of backward (a gradient peak of 4Ψ(1 + 1/N), above ZeRO-1's
  4Ψ), with a cap of two about two buckets are (below ZeRO-1). zerokit.ZeRO2Adam caps itself
  (max_in_flight = 2), so measuring only it showed two identical rows.
- Section 6's timeline labels each bucket's send; labels of sends close in time must not overlap.

The code is the notebook's own (solutions/04_zero2, its cells picked by what they define), run
here with the solution's MyZeRO2Adam.
"""

import json
import sys
import types

import cloudpickle
import matplotlib
import pytest

from conftest import ROOT

matplotlib.use("Agg")


def _cells(*markers):
    """The imports cell, the exercise cell, and every code cell that contains one of `markers`, in order."""
    nb = json.loads((ROOT / "solutions" / "04_zero2" / "04_zero2.ipynb").read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    picked = [code[0]]
    for c in code[1:]:
        src = "".join(c["source"])
        if c["metadata"].get("nbgrader", {}).get("grade_id") == "my_zero2" or any(m in src for m in markers):
            picked.append(c)
    return ["".join(c["source"]).replace("%matplotlib inline", "") for c in picked]


def _run(*markers, until=None):
    """The picked cells executed as one module (sent to the ranks by value, as a notebook's code is)."""
    module = types.ModuleType("lesson04_notebook")
    sys.modules[module.__name__] = module
    cloudpickle.register_pickle_by_value(module)
    try:
        for src in _cells(*markers):
            exec(compile(src, "<lesson 04 cell>", "exec"), module.__dict__)
            if until and until in module.__dict__:
                break
    finally:
        del sys.modules[module.__name__]
    return module


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_section_8_measures_the_students_class_uncapped_and_capped():
    nb = _run("def medium_model(", "def gradient_bytes(", "class CappedZeRO2", "def measure(")
    for n, m in nb.measured.items():
        rows, four_psi = m["rows"], 4 * m["psi"]
        assert "your MyZeRO2Adam" in rows and "yours, 2 in flight" in rows, sorted(rows)
        uncapped, capped = rows["your MyZeRO2Adam"]["peak"] / four_psi, rows["yours, 2 in flight"]["peak"] / four_psi
        zero1 = rows["ZeRO-1"]["peak"] / four_psi
        # every bucket's flat copy and output shard alive at the last gradient: 4Ψ(1 + 1/N), padding aside
        assert uncapped == pytest.approx(1 + 1 / n, abs=0.02), (n, uncapped)
        assert capped < zero1 < uncapped, (n, capped, zero1, uncapped)


def test_section_6_bucket_labels_do_not_overlap():
    nb = _run("def draw_timeline(", until="draw_timeline")
    # sends 0.2 ms apart on a 120 ms axis: far closer than a label is wide
    sends = [("send", b, 60 + 0.2 * b, 60.1 + 0.2 * b) for b in range(14)]
    runs = {"zero1": {"backward": 100.0, "step": 120.0, "arrivals": [], "buckets": 1,
                      "events": [("reduce-scatter", 0, 101.0, 110.0), ("all-gather", 0, 110.0, 119.0)]},
            "zero2": {"backward": 100.0, "step": 120.0, "arrivals": [], "buckets": 14,
                      "events": sends + [("wait", None, 99.0, 100.0), ("all-gather", 0, 101.0, 110.0)]}}
    fig = nb.draw_timeline(runs)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in ax.texts if t.get_text().strip()]
        shown = sorted(text for text, _ in boxes)
        for i, (a, box_a) in enumerate(boxes):
            for b, box_b in boxes[i + 1:]:
                assert not box_a.overlaps(box_b), f"labels {a} and {b} overlap"
        if ax is fig.axes[-1]:  # as many as fit, the first send's among them; the rest are printed below it
            assert "0" in shown and len(shown) >= 3 and set(shown) <= {str(b) for b in range(14)}, shown
