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


# ---- the layout: the course up front, the machinery in its wings, imports pointing down only

PACKAGE = ROOT / "zerokit"
# what a student reads beside the lessons, and the small instruments the lessons measure with
COURSE_MODULES = {"adam", "ddp", "flat", "zero1", "zero2", "zero3", "mixed_precision", "activations", "offload",
                  "comm", "collectives", "memory", "models", "reference", "figures", "widgets",
                  # the lessons' stages in PyTorch's shapes (issue 24)
                  "elementwise", "data_parallel",
                  "muon",  # lesson 09's reference
                  "zeropp",  # lesson 11's reference: hpZ (FSDP2's reshard_after_forward on lesson 05's buckets), qwZ, hybrid sharding
                  "alphabeta",  # lesson 11's time model: collectives on NVLink and NICs, the schemes in seconds
                  "multi_tensor",  # Adam on many tensors at once, what DistributedAdam and ZeRO run on a GPU
                  "hooks",  # weak_hook and in_backward, what the stages that hook autograd share
                  "stages"}  # the four stages as records, which the capstone, checkpoints and the bench ask
# a lesson whose reference needs more than one file gets a package of its own (its __init__
# is the reference, the rest are its parts)
COURSE_PACKAGES = {"checkpoint",
                   "fully_shard",  # FSDP2's design (lesson 12): param, collectives, group, state, api, wrapper
                   "train"}  # the capstone's script: the course's pieces in one training job
COURSE = COURSE_MODULES | COURSE_PACKAGES
WINGS = {"launcher", "grading", "bench"}


def _module_imports():
    """{module: the zerokit modules it imports (at any depth of its code)}, read from the source."""
    import ast

    graph = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("zerokit")}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                if base.startswith("zerokit"):
                    found |= {f"{base}.{a.name}" for a in node.names} | {base}
        graph[name] = found
    # keep only names that are modules of the package (drop imported functions and classes)
    return {m: {i for i in deps if i in graph and i != m} for m, deps in graph.items()}


def test_the_top_level_holds_the_course_and_the_machinery_lives_in_wings():
    top = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    dirs = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert top == COURSE_MODULES, f"top-level modules beyond the course: {sorted(top - COURSE_MODULES)}"
    assert dirs == WINGS | COURSE_PACKAGES


def test_no_import_circle_and_the_course_never_imports_the_machinery():
    graph = _module_imports()
    for module, deps in graph.items():
        if module.split(".")[1:2] and module.split(".")[1] in COURSE:
            wings = sorted(d for d in deps if d.split(".")[1:2] and d.split(".")[1] in WINGS)
            assert not wings, f"{module} (a course module) imports the machinery: {wings}"
    # depth-first search for a cycle; `from . import x` inside a package names the package
    # itself, which is an edge to its __init__ and not a circle of the code
    state = {}

    def visit(module, path):
        state[module] = "open"
        for dep in graph[module]:
            if dep == module.rpartition(".")[0]:
                continue
            if state.get(dep) == "open":
                raise AssertionError("import circle: " + " -> ".join(path[path.index(dep):] + [dep]))
            if dep not in state:
                visit(dep, path + [dep])
        state[module] = "done"

    for module in graph:
        if module not in state:
            visit(module, [module])



# ---- the lesson-03 reference reads beside its exercise

def test_zero1adam_stays_short_enough_to_read_beside_lesson_03():
    """Lesson 03's MyZeRO1Adam is ~60 lines; zerokit.ZeRO1Adam is what a student opens beside it. What goes
    beyond the exercise lives in small collaborators the class holds (FlatGradients: the gradient buffers and
    bucket_mb's early reduce-scatters; any_rank: the presence flags; StateShard.of: the checkpoint's view),
    so the class itself stays at most 220 lines, docstrings and comments included."""
    import inspect

    from zerokit.zero1 import ZeRO1Adam

    lines, _ = inspect.getsourcelines(ZeRO1Adam)
    assert len(lines) <= 220, f"ZeRO1Adam is {len(lines)} lines: move what goes beyond lesson 03 into a collaborator"


# ---- lesson order: a student reading lesson k's module never meets a later lesson's

# the lesson of each course module (a package's submodule by its dotted name: the longest prefix
# decides); None: a foundational module, no lesson's, which any module may import and which
# imports only foundational ones; DISPLAYS draw every lesson's figures (notebooks call them, no
# course module does) and may import any lesson's module
LESSON = {"adam": 1, "ddp": 2, "data_parallel": 2, "zero1": 3, "zero2": 4,
          "elementwise": 4,  # ZeRO1 (lesson 03's stage) and ZeRO2 (lesson 04's): as late as its latest
          "zero3": 5,
          "mixed_precision": 6, "checkpoint": 7, "offload": 8, "activations": 8, "muon": 9, "train": 10,
          "alphabeta": 11, "zeropp": 11,
          "fully_shard": 12,
          "stages": 12,  # builds every stage, FullyShard (lesson 12's) included: as late as the last it builds
          **dict.fromkeys(["flat", "collectives", "comm", "memory", "multi_tensor", "models", "reference",
                           "hooks"])}
DISPLAYS = {"figures", "widgets"}


def _lesson_of(module):
    """(the table's key for a zerokit module's dotted name below zerokit, its lesson)."""
    parts = module.split(".")
    for k in range(len(parts), 0, -1):
        key = ".".join(parts[:k])
        if key in LESSON or key in DISPLAYS:
            return key, LESSON.get(key)
    raise KeyError(module)


def _top_level_imports(path):
    """[(line, the zerokit module it imports, below zerokit)] for one zerokit/*.py file, imports inside
    functions included; `from .fully_shard import param` names the submodule fully_shard.param."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name.partition(".")[2]) for a in node.names
                      if a.name.startswith("zerokit.")]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 1:
                base = node.module or ""
            elif node.level == 0 and (node.module or "").startswith("zerokit."):
                base = node.module.partition(".")[2]
            else:
                continue  # torch, the standard library; `zerokit` itself is the package's index
            for a in node.names:
                sub = f"{base}.{a.name}" if base else a.name
                as_file = PACKAGE.joinpath(*sub.split("."))
                if as_file.with_suffix(".py").exists() or (as_file / "__init__.py").exists():
                    found.append((node.lineno, sub))
                elif base:
                    found.append((node.lineno, base))
    return found


def test_no_module_imports_a_later_lessons_module():
    problems = []
    for path in sorted(PACKAGE.glob("*.py")):
        if path.stem == "__init__":
            continue  # the package's index imports every lesson
        assert path.stem in LESSON or path.stem in DISPLAYS, f"zerokit/{path.name}: give it a lesson in LESSON"
        _, mine = _lesson_of(path.stem)
        for line, module in _top_level_imports(path):
            key, theirs = _lesson_of(module)
            if key in DISPLAYS and path.stem not in DISPLAYS:
                problems.append(f"zerokit/{path.name}:{line} imports zerokit.{module}, a display (figures, widgets)")
            elif theirs is not None and path.stem not in DISPLAYS and (mine is None or theirs > mine):
                where = "foundational" if mine is None else f"lesson {mine:02d}"
                problems.append(f"zerokit/{path.name}:{line} ({where}) imports zerokit.{module} (lesson {theirs:02d})")
    assert not problems, "a module imports a later lesson's module:\n" + "\n".join(problems)


def test_every_cell_no_grade_reads_is_marked_as_a_measurement():
    """Grading skips measurement cells (zerokit.grading.autograde.execute): every ungraded code cell
    is one, but for the setup cells the graded ones need (the imports, the launcher choice), which
    the lean example submissions keep (tests/submissions KEEP). An unmarked new demo cell would
    silently cost every graded notebook its run time; a marked setup cell would break grading."""
    import json

    from tests.submissions import lesson_modules
    from zerokit.grading.autograde.execute import MEASUREMENT

    for lesson, mod in lesson_modules().items():
        nb = json.loads((ROOT / "solutions" / lesson / f"{lesson}.ipynb").read_text())
        for i, cell in enumerate(nb["cells"]):
            if cell["cell_type"] != "code" or "nbgrader" in cell["metadata"]:
                continue
            source = "".join(cell["source"])
            setup = any(k in source for k in mod.KEEP)
            marked = source.split("\n", 1)[0].strip() == MEASUREMENT
            assert setup != marked, (f"{lesson} cell {i} ({source[:50]!r}): "
                                     + ("a setup cell must not be marked" if setup else f"mark it: {MEASUREMENT}"))


def test_grading_does_not_run_a_measurement_cell():
    import nbformat

    from zerokit.grading.autograde.execute import MEASUREMENT, GradingExecute

    cell = nbformat.v4.new_code_cell(MEASUREMENT + "\nraise SystemExit('ran')")
    out, _ = GradingExecute().preprocess_cell(cell, {}, 0)  # no kernel started: it never reaches one
    assert [o["text"] for o in out.outputs] == ["(not run while grading: a measurement cell, which no grade reads)\n"]
    graded = nbformat.v4.new_code_cell(MEASUREMENT + "\nx = 1", metadata={"nbgrader": {"grade": True,
                                                                                      "grade_id": "t", "points": 1}})
    from zerokit.grading.autograde.execute import is_measurement

    assert not is_measurement(graded)  # a test cell is always run, whatever its first line says


# ---- the wings use the course's classes through their public names

# the packages that drive the course's objects from outside: the graders, checkpointing, the
# benchmarks and the training script (the launcher and fully_shard touch none of them)
OUTSIDE = ("grading", "checkpoint", "bench", "train")


def _private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _zerokit_private_names():
    """Every private name zerokit defines: at a module's top level, in a class body, or as
    `self._x = ...` in a class's methods."""
    import ast

    names = set()

    def targets(node):
        found = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {n.id for t in found for n in ast.walk(t) if isinstance(n, ast.Name)}

    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        bodies = [tree.body] + [n.body for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
        for body in bodies:
            for node in body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                    names |= targets(node)
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            names |= {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                      and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")}
    return {n for n in names if _private(n)}


def test_the_wings_use_no_private_name_of_zerokit_on_another_object():
    """No `obj._name` in the graders, checkpointing, the benchmarks or the training script, where
    obj is not self, cls or super() and zerokit defines `_name`, and no `from zerokit... import
    _name`: what they call on the course's optimizers (an exercise's contract included) is public,
    and so is what one module reads of another. (torch's own private names are not zerokit's.)"""
    import ast

    private = _zerokit_private_names()
    assert len(private) > 100, f"the scan of zerokit found {len(private)} private names"

    def own(value):
        return (isinstance(value, ast.Name) and value.id in ("self", "cls")) or (
            isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super")

    found = []
    for wing in OUTSIDE:
        for path in sorted((PACKAGE / wing).rglob("*.py")):
            where = path.relative_to(ROOT)
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr in private and not own(node.value):
                    found.append((str(where), node.lineno, ast.unparse(node)))
                elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("zerokit")):
                    found += [(str(where), node.lineno, f"import {a.name}") for a in node.names if a.name in private]
    assert not found, "private names of zerokit used outside their class or module:\n" + "\n".join(
        f"{path}:{line}: {what}" for path, line, what in sorted(found))


def _zerokit_classes():
    """Every class zerokit defines (the wings included), imported."""
    import importlib
    import inspect
    import pkgutil

    import zerokit

    classes = set()
    for info in pkgutil.walk_packages(zerokit.__path__, "zerokit."):
        if ".grading.autograde" in info.name or info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        classes |= {c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == info.name}
    return classes


def test_zerokit_classes_derive_from_one_another_at_most_four_deep():
    """The longest chain of zerokit classes deriving from one another: ZeRO1Adam > ZeRO2Adam >
    ZeRO3Adam > ZeROppAdam, each lesson's reference a subclass of the one before (issue 48 asks
    for 3: the next step composes lesson 04's reducer instead of inheriting it). Was 6, with
    ShardedParameters and ReshardZeRO3Adam in the chain."""
    classes = _zerokit_classes()
    assert len(classes) > 50, f"found only {len(classes)} zerokit classes"

    def chain(c):
        bases = [b for b in c.__bases__ if b in classes]
        return [c] + max((chain(b) for b in bases), key=len, default=[])

    longest = max((chain(c) for c in classes), key=len)
    assert len(longest) <= 4, " > ".join(c.__qualname__ for c in reversed(longest))


def test_the_adam_optimizers_share_one_set_of_defaults_and_all_take_foreach():
    """Each lesson's Adam (01-05, 11) either writes AdamW's hyperparameters with zerokit.Adam's
    defaults, or takes its parent's arguments as they are (**options): no copy drifts, and
    foreach= reaches every one that updates shards (the copies once lost it)."""
    import inspect

    import zerokit
    from zerokit.zeropp import HybridShardAdam, ZeROppAdam

    def params_of(cls):
        """{name: default} that cls's constructor accepts, following **options to its parent's."""
        sig = inspect.signature(cls.__init__).parameters
        own = {n: p.default for n, p in sig.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        if any(p.kind is p.VAR_KEYWORD for p in sig.values()):
            parent = next(b for b in cls.__mro__[1:] if "__init__" in vars(b))
            return {**params_of(parent), **own}
        return own

    adam = params_of(zerokit.Adam)
    hyper = ("lr", "betas", "eps", "weight_decay")
    for cls in (zerokit.DistributedAdam, zerokit.ZeRO1Adam, zerokit.ZeRO2Adam, zerokit.ZeRO3Adam, ZeROppAdam,
                HybridShardAdam):
        accepted = params_of(cls)
        assert {k: accepted.get(k) for k in hyper} == {k: adam[k] for k in hyper}, cls.__name__
        assert "foreach" in accepted, f"{cls.__name__} takes no foreach="
