"""The project's promises about itself: one environment, two commands, lessons in sync."""

import re
import tomllib
from pathlib import Path

import pytest
import yaml

from zerokit.grading import lessons

ROOT = Path(__file__).resolve().parents[1]


def _normalise(requirement):
    return re.sub(r"\s+", "", requirement).lower()


def test_environment_yml_lists_the_same_dependencies_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = set(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        declared |= set(extra)
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    assert {_normalise(r) for r in pip_section} == {_normalise(r) for r in declared}


def test_torch_is_pinned_in_every_place_that_installs_it():
    pins = {
        "pyproject.toml": re.findall(r'"(torch[^"]*)"', (ROOT / "pyproject.toml").read_text()),
        "environment.yml": re.findall(r"- (torch\S*)", (ROOT / "environment.yml").read_text()),
        "Makefile": re.findall(r"TORCH_SPEC\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text()),
    }
    assert {where: set(found) for where, found in pins.items()} == {
        where: {"torch==2.13.0"} for where in pins}


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make lab" in readme
    assert re.search(r"^exec make test$", (ROOT / ".ci" / "run").read_text(), re.M)


@pytest.mark.timeout(300)
def test_lessons_are_what_nbgrader_makes_of_solutions():
    problems = lessons.drift()
    assert problems == [], "\n\n".join(problems)


def test_every_lesson_has_graded_cells_with_points_and_hidden_tests():
    import json

    for lesson in lessons.lesson_ids():
        nb = json.loads((ROOT / "solutions" / lesson / f"{lesson}.ipynb").read_text())
        graded = [c for c in nb["cells"] if c.get("metadata", {}).get("nbgrader", {}).get("grade")]
        assert graded, f"{lesson} has no graded test cell"
        assert all(c["metadata"]["nbgrader"].get("points", 0) > 0 for c in graded)
        assert any("### BEGIN HIDDEN TESTS" in "".join(c["source"]) for c in graded), lesson
        ids = [c["metadata"]["nbgrader"]["grade_id"] for c in nb["cells"] if "nbgrader" in c.get("metadata", {})]
        assert len(ids) == len(set(ids)), f"{lesson}: duplicate grade_id"
