"""The feedback's formulas are MathML when it is written: it reads right with no network."""

import json
import re
import xml.etree.ElementTree as ET

import nbformat
from nbconvert import HTMLExporter

from zerokit.grading.autograde.offline_math import OfflineMath, tex_to_mathml
from zerokit.grading.lessons import LESSONS, lesson_ids

MATHML = "{http://www.w3.org/1998/Math/MathML}"


def _markdown_cells():
    for lesson in lesson_ids():
        nb = json.loads((LESSONS / lesson / f"{lesson}.ipynb").read_text())
        for cell in nb["cells"]:
            if cell["cell_type"] == "markdown":
                yield lesson, "".join(cell["source"])


def test_every_formula_of_every_lesson_becomes_mathml():
    formulas = 0
    for lesson, text in _markdown_cells():
        failed = []
        out = tex_to_mathml(text, failed)
        assert failed == [], f"{lesson}: not convertible: {failed}"
        formulas += out.count("<math ")
        prose = re.sub(r"```.*?```|`[^`\n]*`", "", out, flags=re.S)
        assert not re.search(r"\$[^$\s][^$\n]*\$", prose), f"{lesson}: TeX left outside code: {prose[:300]}"
    assert formulas > 500  # the lessons hold about a thousand


def test_the_mathml_is_well_formed_and_keeps_the_symbols():
    out = tex_to_mathml(r"each rank holds $\lceil\Psi/N\rceil$ elements: $$2\Psi + 2\Psi + K\Psi$$")
    inline, block = re.findall(r"<math .*?</math>", out)
    assert 'display="inline"' in inline and 'display="block"' in block
    tree = ET.fromstring(inline)
    text = "".join(tree.itertext())
    assert "\u03a8" in text and "\u2308" in text and "N" in text  # Ψ and the ceiling
    assert ET.fromstring(block).find(f".//{MATHML}mo") is not None
    assert out.startswith("each rank holds <math")


def test_code_money_and_escaped_dollars_are_left_alone():
    text = "run `echo $HOME $PATH` then\n```\nx = '$a$'\n```\nit costs $5 and $6, and \\$x\\$ is literal"
    assert tex_to_mathml(text) == text


def test_a_formula_that_does_not_convert_stays_tex_and_is_reported():
    failed = []
    out = tex_to_mathml(r"fine $x^2$, broken $\frac{1}{$ end", failed)
    assert "<math" in out
    assert failed == [r"\frac{1}{"] and r"$\frac{1}{$" in out


def test_listed_among_an_exporters_preprocessors_it_runs():
    """As GenerateFeedback lists it (settings.FEEDBACK_PREPROCESSORS): no `enabled` to set."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(r"per rank: $8\Psi/N$ bytes")])
    exporter = HTMLExporter(template_name="classic", preprocessors=[OfflineMath])
    body, _ = exporter.from_notebook_node(nb)
    assert "<math " in body and r"\Psi" not in body
