"""Every exercise of every lesson climbs the same ladder of hints: the idea first, the recipe
last, and the recipe is the steps in words, the invariant and the pitfall, never code a student
can paste (the code is the exercise). Names may appear in it (the scaffold's methods and
attributes, torch's functions, a dict key), statements may not.
"""

import json
import re

import pytest

from conftest import ROOT

LESSONS = sorted(p.name for p in (ROOT / "solutions").iterdir() if (p / f"{p.name}.ipynb").exists())
RUNG = re.compile(r"<details><summary><b>Hint (\d) — ([^<]+)</b></summary>\n\n(.*?)\n\n</details>", re.S)
# a name, an attribute path, an item of one, a literal, or a method's signature as the scaffold
# declares it (`send(bi)`): nothing that runs as a line
NAME = re.compile(r"""^([\w.\[\]"'\-]+|[\w.]+\((\w+(, \w+)*)?\))$""")


def _ladders(lesson):
    cells = json.loads((ROOT / "solutions" / lesson / f"{lesson}.ipynb").read_text())["cells"]
    for cell in cells:
        text = "".join(cell["source"])
        if cell["cell_type"] == "markdown" and "Hint 1" in text:
            yield text, RUNG.findall(text)


@pytest.mark.parametrize("lesson", LESSONS)
def test_every_ladder_goes_from_the_idea_to_a_recipe_in_words(lesson):
    ladders = list(_ladders(lesson))
    assert ladders, lesson
    for text, rungs in ladders:
        assert len(rungs) >= 2 and text.count("<details><summary><b>Hint") == len(rungs), (lesson, text[:200])
        assert [int(n) for n, _, _ in rungs] == list(range(1, len(rungs) + 1)), lesson
        assert rungs[0][1] == "the idea" and rungs[-1][1] == "the recipe", (lesson, [r[1] for r in rungs])
        for n, title, body in rungs:
            assert "```" not in body, f"{lesson}: hint {n} ({title}) holds a code block"
        recipe = rungs[-1][2]
        code = [span for span in re.findall(r"`([^`]+)`", recipe) if not NAME.match(span)]
        assert not code, f"{lesson}: the recipe ({recipe[:80]}...) holds code, not names: {code}"
        assert re.search(r"invariant", recipe, re.I) and re.search(r"pitfall", recipe, re.I), \
            f"{lesson}: the recipe ({recipe[:80]}...) names no invariant or no pitfall"
