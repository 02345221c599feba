"""zerokit's references read as their lesson's exercise plus what is labelled beyond it.

A student opening zerokit/zero2.py beside lesson 04 (or zero3.py beside lesson 05,
zeropp.py, hpZ, beside lesson 11, or fully_shard/param.py and collectives.py beside
lesson 12) should recognise every line of the methods and functions they wrote. The references mark what the exercise leaves out with a comment, "beyond the
exercise", and this test holds them to it: strip what is so labelled from each exercise method
of the reference, and what remains is, statement for statement (ast, comments and docstrings
aside), the solution notebook's method.

The convention the references follow:
- a statement whose line carries the label is left out, with its block if it opens one;
- a comment line carrying the label leaves out the statement after it; where that comment
  also says "the exercise: `CODE`", the exercise's statement is CODE (a line the reference
  generalises, e.g. lesson 06's reduce dtype).

The one method that does not read this way says why below (EXCEPTIONS), so a new difference
fails here until someone labels it or explains it.
"""

import ast
import json
import re
import textwrap
from pathlib import Path

import pytest

import zerokit.zero2
import zerokit.zero3
from zerokit.fully_shard import collectives as fsdp_collectives  # (zerokit.fully_shard is the function)
from zerokit.fully_shard import param as fsdp_param
from zerokit.zeropp import ZeROppAdam

ROOT = Path(__file__).resolve().parent.parent
LABEL = "beyond the exercise"

CASES = [
    ("04_zero2", "MyZeRO2Adam", zerokit.zero2.ZeRO2Adam, ["_on_grad_ready", "send", "_end_of_backward"]),
    ("05_zero3", "ShardedParameters", zerokit.zero3.ZeRO3Adam, ["start_gather", "finish_gather", "free"]),
    ("11_zeropp", "MyHpZAdam", ZeROppAdam, ["keep_secondary", "start_gather", "free"]),
]
# lessons whose exercises are functions: (lesson, the reference's module, [functions])
FUNCTION_CASES = [
    ("12_fsdp2", fsdp_param, ["dim0_chunk", "shard_param"]),
    ("12_fsdp2", fsdp_collectives, ["all_gather_copy_in", "all_gather_copy_out", "reduce_scatter_copy_in",
                                    "shard_grads"]),
]
# method: why the reference's body differs from the exercise's beyond a label
EXCEPTIONS = {
    ("04_zero2", "_end_of_backward"): "the exercise's waiting loop is the body of _receive(), which the max_in_flight "
                                      "cap (beyond the exercise) also calls from send",
}


def _opens_block(code):
    code = code.rstrip()
    return code.endswith(":") or code.count("(") > code.count(")") or code.count("[") > code.count("]")


def _block_end(lines, i):
    """The index after statement i and its block (or its continuation lines)."""
    indent = len(lines[i]) - len(lines[i].lstrip())
    j = i + 1
    if _opens_block(lines[i].partition("#")[0]):
        while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent):
            j += 1
    return j


def strip_labelled(source):
    """The source with what is labelled "beyond the exercise" left out (see the module docstring)."""
    lines, out, i = source.split("\n"), [], 0
    while i < len(lines):
        code, _, comment = lines[i].partition("#")
        if LABEL not in comment.lower():
            out.append(lines[i])
            i += 1
        elif code.strip():  # a labelled statement
            i = _block_end(lines, i)
        else:  # a labelled comment: the statement after it
            j = i
            while j < len(lines) and lines[j].strip().startswith("#"):
                j += 1
            comments = " ".join(c.strip().removeprefix("#").strip() for c in lines[i:j])  # code may wrap lines
            said = re.search(r"the exercise: `([^`]+)`", comments)
            if said:
                out.append(" " * (len(lines[j]) - len(lines[j].lstrip())) + said.group(1))
            i = _block_end(lines, j)
    return "\n".join(out)


def _body(source):
    """A function's statements as ast.unparse writes them, without docstring and decorators."""
    fn = ast.parse(textwrap.dedent(source)).body[0]
    body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else fn.body
    return [ast.unparse(s) for s in body]


def solution_methods(lesson, cls):
    """{name: source} of the methods of class `cls` in solutions/<lesson>, solution markers removed."""
    nb = json.loads((ROOT / "solutions" / lesson / f"{lesson}.ipynb").read_text())
    for cell in nb["cells"]:
        source = re.sub(r"^[ \t]*### (BEGIN|END) SOLUTION[ \t]*\n", "", "".join(cell["source"]), flags=re.M)
        if cell["cell_type"] == "code" and f"class {cls}(" in source:
            tree = ast.parse(source)
            node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
            return {n.name: ast.get_source_segment(source, n) for n in node.body if isinstance(n, ast.FunctionDef)}
    raise AssertionError(f"no class {cls} in solutions/{lesson}")


def solution_functions(lesson):
    """{name: source} of the top-level functions of solutions/<lesson>'s code cells, solution markers removed."""
    nb = json.loads((ROOT / "solutions" / lesson / f"{lesson}.ipynb").read_text())
    found = {}
    for cell in nb["cells"]:
        if cell["cell_type"] != "code" or "### BEGIN SOLUTION" not in "".join(cell["source"]):
            continue
        source = re.sub(r"^[ \t]*### (BEGIN|END) SOLUTION[ \t]*\n", "", "".join(cell["source"]), flags=re.M)
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        found.update({n.name: ast.get_source_segment(source, n) for n in tree.body if isinstance(n, ast.FunctionDef)})
    return found


def reference_method(cls, name):
    import inspect

    return textwrap.dedent(inspect.getsource(cls.__dict__[name]))


@pytest.mark.parametrize("lesson, cls, reference, method",
                         [(lesson, c, ref, m) for lesson, c, ref, methods in CASES for m in methods])
def test_each_exercise_method_is_the_solution_plus_what_is_labelled(lesson, cls, reference, method):
    theirs = _body(solution_methods(lesson, cls)[method])
    ours = _body(strip_labelled(reference_method(reference, method)))
    if (lesson, method) in EXCEPTIONS:
        assert ours != theirs, f"{reference.__name__}.{method} now reads as the exercise: drop its exception"
        return
    assert ours == theirs, (f"{reference.__name__}.{method}, labelled lines left out, is not lesson {lesson}'s "
                            f"{cls}.{method}:\nreference: {ours}\nsolution:  {theirs}\nlabel the difference "
                            f"'{LABEL}' (with 'the exercise: `...`' where a line is generalised) or explain it")


def test_stripping_leaves_out_labelled_statements_blocks_and_replacements():
    source = textwrap.dedent('''\
        def f(self, x):
            a = 1
            b = 2  # beyond the exercise: dropped
            if x:  # beyond the exercise: dropped with its block
                c = 3
            # beyond the exercise: the next statement, generalised;
            # the exercise: `d = h(x,
            #     2)`
            d = g(x,
                  1)
            # beyond the exercise: the next block
            for i in x:
                pass
            return a
        ''')
    assert _body(strip_labelled(source)) == ["a = 1", "d = h(x, 2)", "return a"]


@pytest.mark.parametrize("lesson, module, function",
                         [(lesson, m, f) for lesson, m, functions in FUNCTION_CASES for f in functions])
def test_each_exercise_function_is_the_solution_plus_what_is_labelled(lesson, module, function):
    import inspect

    theirs = _body(solution_functions(lesson)[function])
    ours = _body(strip_labelled(textwrap.dedent(inspect.getsource(getattr(module, function)))))
    assert ours == theirs, (f"{module.__name__}.{function}, labelled lines left out, is not lesson {lesson}'s "
                            f"{function}:\nreference: {ours}\nsolution:  {theirs}\nlabel the difference "
                            f"'{LABEL}' (with 'the exercise: `...`' where a line is generalised) or explain it")
