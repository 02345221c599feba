"""OfflineMath: the feedback's formulas rendered when it is made, as MathML, not by MathJax.

nbconvert's HTML loads MathJax from a CDN to typeset $...$ in the browser: a feedback file
opened without network (a lab machine, a grader behind a firewall, a file sent by e-mail)
shows raw TeX, `$8\\Psi/N$`. Here every formula of the markdown cells becomes MathML
(latex2mathml) before the HTML is written; browsers draw MathML themselves. Code (fenced
blocks, `inline code`) is left as written, and so is a formula latex2mathml cannot read
(with a warning naming it): a student's own markdown must not stop their feedback.
"""

from __future__ import annotations

import re

from latex2mathml.converter import convert
from nbconvert.preprocessors import Preprocessor
from traitlets import Bool

__all__ = ["OfflineMath", "tex_to_mathml"]

_CODE = re.compile(r"(```.*?```|`[^`\n]*`)", re.S)
# $$display$$, or $inline$: not \$, no space just inside the dollars, no digit right after
# the closing one ("costs $5 and $6" is not math)
_MATH = re.compile(r"\$\$(.+?)\$\$|(?<![\\$])\$(?![\s$])([^$\n]+?)(?<![\s\\])\$(?!\d)", re.S)


def tex_to_mathml(markdown, failed=None):
    """`markdown` with each formula outside code replaced by its MathML; the TeX of formulas
    that do not convert is appended to `failed` (a list) and left in place."""
    def render(m):
        display = m.group(1) is not None
        tex = (m.group(1) if display else m.group(2)).strip()
        try:
            return convert(tex, display="block" if display else "inline")
        except Exception:  # latex2mathml raises many types; the formula stays as TeX
            if failed is not None:
                failed.append(tex)
            return m.group(0)

    parts = _CODE.split(markdown)
    parts[::2] = [_MATH.sub(render, prose) for prose in parts[::2]]  # odd parts are code
    return "".join(parts)


class OfflineMath(Preprocessor):
    """Markdown cells' $...$ and $$...$$ as MathML, so the feedback needs no network."""

    # nbconvert's preprocessors are off unless enabled (nbgrader's own are on): on, as theirs
    enabled = Bool(True, help="Typeset the formulas of markdown cells as MathML").tag(config=True)

    def preprocess_cell(self, cell, resources, cell_index):
        if cell.cell_type == "markdown":
            failed = []
            cell.source = tex_to_mathml(cell.source, failed)
            for tex in failed:
                self.log.warning("feedback: cell %d keeps a formula as TeX (not convertible to MathML): %s",
                                 cell_index, tex)
        return cell, resources
