"""Lesson 00's checks, validated on the solution and on deliberately broken all-reduces.

The solution is the code in solutions/00_collectives (its exercise cell, executed here).
Every broken version is one classic bug; it fails exactly the checks listed beside it, with
a message that names the problem, and a passing check says only what its counters saw.

| defect | fails | message |
|---|---|---|
| all-gathers whole tensors and sums locally (no reduce-scatter) | numerics; traffic at N = 3 | "made no reduce-scatter" |
| chunks gathered in the wrong order | numerics | "wrong places" |
| the mean, not the sum | numerics | "the mean" |
| calls dist.all_reduce | numerics | "called dist.all_reduce" |
| two elements off, a little early and a lot late | numerics | the first (#1) and the largest (#6), each named |
| the untouched student notebook | every check | "NotImplementedError" |

And the notebook: its visible traffic test runs at N = 3 too (at N = 2 the gather-and-sum
version moves exactly what dist.all_reduce moves), and its "Try it" input shows a wrong
chunk order (a constant tensor would sum to the same values in any order).
"""

import json
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from conftest import ROOT, UNFINISHED, exercise_module, fails, fails_exactly, source_module
from zerokit.grading import lesson00
from zerokit.grading.harness import CheckFailed

pytestmark = pytest.mark.distributed

LESSON = "00_collectives"
PRELUDE = "import torch\nimport torch.distributed as dist\n"

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SOLUTION = exercise_module(LESSON, "solutions", ["my_all_reduce"], PRELUDE)
STUDENT = exercise_module(LESSON, "lessons", ["my_all_reduce"], PRELUDE)

CHECKS = {  # the visible tests' configurations
    "numerics": lambda fn: lesson00.check_numerics(fn, world_size=2, sizes=[8, 7]),
    "traffic": lambda fn: lesson00.check_traffic(fn, world_size=3, size=1000),
}


def gathers_and_sums(tensor):
    """Every rank's whole tensor gathered, then summed locally: right values, no reduce-scatter,
    N x the tensor moved (at N = 2 exactly what dist.all_reduce moves)."""
    n = dist.get_world_size()
    everything = torch.empty(n * tensor.numel(), dtype=tensor.dtype)
    dist.all_gather_single(everything, tensor.contiguous())
    return everything.view(n, -1).sum(0)


def _gathered_sum(tensor):
    """The right collectives and volume: the padded sum on every rank, (sum, N, numel)."""
    n = dist.get_world_size()
    numel = tensor.numel()
    chunk = -(-numel // n)
    padded = torch.zeros(chunk * n, dtype=tensor.dtype)
    padded[:numel] = tensor
    mine = torch.empty(chunk, dtype=tensor.dtype)
    dist.reduce_scatter_single(mine, padded)
    dist.all_gather_single(padded, mine)
    return padded, n, numel


def wrong_chunk_order(tensor):
    """Right collectives and volume; the gathered chunks put back in reverse order."""
    padded, n, numel = _gathered_sum(tensor)
    return torch.cat(list(reversed(padded.chunk(n))))[:numel]


def mean_not_sum(tensor):
    """Right collectives and volume, then divided by N."""
    padded, n, numel = _gathered_sum(tensor)
    return padded[:numel] / n


def shifted_by_a_chunk(tensor):
    """The sum's elements shifted by one chunk (an off-by-one in the chunk index), padding kept at
    the end: a tensor whose elements are all equal looks right."""
    n = dist.get_world_size()
    chunk = -(-tensor.numel() // n)
    out = tensor.clone()
    dist.all_reduce(out)
    return out.roll(chunk)


def two_elements_off(tensor):
    """Right collectives and volume; element 1 a little off, element 6 (of 8) a lot: the reason
    names both, the first one that differs and the largest difference, not only the largest."""
    padded, n, numel = _gathered_sum(tensor)
    out = padded[:numel].clone()
    out[1] += 1e-3
    if numel > 6:
        out[6] += 5.0
    return out


def uses_all_reduce(tensor):
    out = tensor.clone()
    dist.all_reduce(out)
    return out


DEFECTS = [
    (gathers_and_sums, {"numerics": "made no reduce-scatter", "traffic": "made no reduce-scatter"}),
    (wrong_chunk_order, {"numerics": "wrong places"}),
    (mean_not_sum, {"numerics": "the mean"}),
    (uses_all_reduce, {"numerics": "called dist.all_reduce"}),
]


@pytest.mark.timeout(60)
def test_a_wrong_result_names_its_first_bad_element_and_its_largest_difference():
    message = fails(lesson00.check_numerics, two_elements_off, world_size=2, sizes=[8], match="2 of 8 elements")
    first, largest = message.split("the first, ")[1].split("; the largest difference, ")
    assert first.startswith("element #1: expected") and "(|difference| 0.001)" in first, message
    assert largest.startswith("5 at element #6: expected"), message


@pytest.mark.timeout(60)
def test_the_solution_passes_and_the_untouched_notebook_fails_every_check(capsys):
    for check in CHECKS.values():
        check(SOLUTION.my_all_reduce)
    assert capsys.readouterr().out.count("✓") == len(CHECKS)
    for check in CHECKS.values():
        fails(check, STUDENT.my_all_reduce, match=UNFINISHED)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fn, expected", DEFECTS, ids=lambda v: getattr(v, "__name__", ""))
def test_each_defect_fails_exactly_its_checks(fn, expected, capsys):
    fails_exactly(CHECKS, fn, expected, capsys)


@pytest.mark.timeout(60)
def test_a_passing_traffic_check_names_only_the_collectives_it_counted(capsys):
    """At N = 2 gathering every rank's whole tensor moves 2 x size, as dist.all_reduce does: the
    check passes there, but must not claim a reduce-scatter that never ran."""
    lesson00.check_traffic(gathers_and_sums, world_size=2, size=1001)
    said = capsys.readouterr().out
    assert "reduce-scatter" not in said and "all-gather x1 (2002" in said, said
    lesson00.check_traffic(SOLUTION.my_all_reduce, world_size=2, size=1001)
    said = capsys.readouterr().out
    assert "reduce-scatter x1 (1002" in said and "all-gather x1 (1002" in said, said


def _cell(folder, grade_id=None, contains=None):
    nb = json.loads((ROOT / folder / LESSON / f"{LESSON}.ipynb").read_text())
    for c in nb["cells"]:
        src = "".join(c["source"])
        if grade_id and c["metadata"].get("nbgrader", {}).get("grade_id") == grade_id:
            return src
        if contains and c["cell_type"] == "code" and contains in src:
            return src
    raise KeyError(grade_id or contains)


@pytest.mark.timeout(90)
def test_the_visible_traffic_test_catches_gathering_whole_tensors():
    source = _cell("lessons", grade_id="test_same_volume")
    with pytest.raises(CheckFailed, match="made no reduce-scatter"):
        exec(source, {"my_all_reduce": gathers_and_sums})


@pytest.mark.timeout(90)
def test_the_try_it_input_shows_a_wrong_chunk_order():
    """The "Try it" cell's own input, through the solution and through a version that returns
    the chunks in the wrong order: a student must be able to see the difference."""
    import zerokit

    source = _cell("solutions", contains="def try_it(")
    results = {}
    for name, fn in (("right", SOLUTION.my_all_reduce), ("wrong", shifted_by_a_chunk)):
        module = source_module("try_it", source.split("\nfor rank")[0], PRELUDE + "import zerokit\n")
        module.my_all_reduce = fn
        results[name] = zerokit.launch(module.try_it, 2, launcher="forkserver", backend="gloo", timeout=60,
                                       echo=False)
    (right, expected), (wrong, _) = results["right"][0], results["wrong"][0]
    assert right == expected and wrong != expected, (right, wrong, expected)
