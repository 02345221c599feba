"""Each lesson's checks declare which situations of the fixture matrix they meet.

kit.SITUATIONS names the situations student code meets in real training (a shard of zero
gradient, a unit returning a tuple, a subgroup, ...). Every lesson's grading module holds a
table with one entry per situation: the check (and the model or setting) whose hidden tests
meet it, or "n/a: why". Here the table is held to what the notebook's hidden tests run:
the check is called there, with that model or setting in the same hidden block.
"""

import importlib
import json
import re
from pathlib import Path

import pytest

from zerokit.grading import kit
from zerokit.grading.lessons import lesson_ids

ROOT = Path(__file__).resolve().parents[1]
HIDDEN = re.compile(r"### BEGIN HIDDEN TESTS\n(.*?)### END HIDDEN TESTS", re.S)


def _hidden_blocks(lesson):
    nb = json.loads((ROOT / "solutions" / lesson / f"{lesson}.ipynb").read_text())
    return [block for c in nb["cells"] if c["cell_type"] == "code" for block in HIDDEN.findall("".join(c["source"]))]


@pytest.mark.parametrize("lesson", lesson_ids())
def test_every_situation_is_met_by_a_hidden_check_or_says_why_not(lesson):
    module = importlib.import_module(f"zerokit.grading.lesson{lesson[:2]}")
    table = getattr(module, "SITUATIONS", None)
    assert isinstance(table, dict), f"zerokit.grading.lesson{lesson[:2]} has no SITUATIONS table"
    assert set(table) == set(kit.SITUATIONS), f"{lesson}: missing {sorted(set(kit.SITUATIONS) - set(table))}, " \
                                              f"unknown {sorted(set(table) - set(kit.SITUATIONS))}"
    blocks = _hidden_blocks(lesson)
    wrong = []
    for situation, entry in table.items():
        if entry.startswith("n/a:"):
            if len(entry) < 16:
                wrong.append(f"{situation}: say why it does not apply, not just {entry!r}")
            continue
        check, _, setting = (part.strip() for part in entry.partition(":"))
        if not callable(getattr(module, check, None)):
            wrong.append(f"{situation}: {check} is no check of lesson {lesson[:2]}")
        elif not any(re.search(rf"\b{check}\(", b) and setting in b for b in blocks):
            wrong.append(f"{situation}: no hidden test calls {check}" + (f" with {setting!r}" if setting else ""))
    assert not wrong, f"{lesson}:\n" + "\n".join(wrong)


def test_the_matrix_is_met_somewhere():
    """Every situation is met by at least one lesson's hidden tests (not n/a everywhere)."""
    met = set()
    for lesson in lesson_ids():
        table = getattr(importlib.import_module(f"zerokit.grading.lesson{lesson[:2]}"), "SITUATIONS", {})
        met |= {s for s, entry in table.items() if not entry.startswith("n/a:")}
    assert met == set(kit.SITUATIONS), sorted(set(kit.SITUATIONS) - met)
