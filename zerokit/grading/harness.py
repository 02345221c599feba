"""Running a student's code on several ranks and turning every failure into one clear line.

The notebooks' test cells call `run_on_ranks(check, world_size, args)`: `check(rank,
world_size, *args)` runs in fresh worker processes (zerokit.launch, forkserver launcher:
the kernel's own modules, and whatever a cell did to them, are not inherited), compares the
student's results with a reference there, and raises AssertionError with a readable
message when they differ. Whatever goes wrong becomes a `CheckFailed` (an AssertionError,
so nbgrader scores the cell 0) whose first line says why, in words a student understands:

- an assertion of the check            -> its message, with the rank named;
- an exception in the student's code   -> "your code raised ValueError on rank 1 (your cell, line 7): ...";
- a hang (a collective on some ranks)  -> "... did not finish within 60 s (...): rank 0: never finished:
                                           inside torch.distributed.barrier (your cell, line 9); rank 1: ...";
- a crash, os._exit, runaway memory     -> "... failed on 1 of 2 ranks: rank 1: exited without returning
                                           (exit code 3) ...", "... out of memory ...: rank 1: used 4.1 GiB ...".

Nothing is written to stderr (nbgrader fails a test cell that writes there): workers'
output is echoed on stdout, and warnings raised here are printed, not emitted.

Inside the workers the check is *guarded*: torch.optim.Adam/AdamW (and their functional
forms: the module attributes, and the code of torch's Python implementations themselves)
are replaced by tripwires, so a "hand-written" optimizer that calls them fails; and what a
check relies on (the check modules' and zerokit's module globals, torch's functions and
torch.Tensor's methods) is snapshotted before the student's code runs and verified
afterwards, so monkeypatching it fails too. The modules it runs on must be the installed
files (origins.py): a package planted beside the notebook fails the check, with its name.
"""

import contextlib
import io
import os
import tempfile
import warnings

import torch

from ..launcher import LaunchError, LaunchTimeout, launch
from . import origins

__all__ = ["CheckFailed", "run_on_ranks", "passed", "torch_adam_allowed", "GUARDED", "TIMEOUT_ENV", "MEMORY_ENV"]

TIMEOUT_ENV = "ZEROKIT_CHECK_TIMEOUT"  # seconds; caps every check's own timeout when set
MEMORY_ENV = "ZEROKIT_CHECK_MEMORY_GB"  # GiB; caps every check's memory limit per rank when set


class CheckFailed(AssertionError):
    """A check did not pass; the message's first line is the reason.

    In a notebook IPython shows `_render_traceback_()` instead of its own traceback: the
    reason first, then the lines of the student's code that led to the check (the notebook
    cell that called it). The grader's own frames (run_on_ranks, the line that raised) say
    nothing about the student's code and come before the reason in IPython's traceback, so
    they are left out; ZEROKIT_FULL_TRACEBACK=1 shows IPython's full traceback instead.
    """

    def _render_traceback_(self):
        if os.environ.get("ZEROKIT_FULL_TRACEBACK"):
            from IPython import get_ipython

            return get_ipython().InteractiveTB.structured_traceback(type(self), self, self.__traceback__)
        first, _, rest = str(self).partition("\n")
        lines = [f"\x1b[31m{type(self).__name__}\x1b[39m: {first}"] + (rest.splitlines() if rest else [])
        frames = _students_frames(self.__traceback__)
        if frames:
            lines.append("")
            lines += frames
        return lines


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # zerokit/


def _students_frames(tb):
    """'Cell In[3], line 2: <source>' for each frame of the student's code in a traceback:
    notebook cells and files outside zerokit, Python and its installed packages, unless the
    frame hides itself (`__tracebackhide__`, as IPython and pytest honour it)."""
    import linecache
    import sysconfig
    import traceback

    library = {os.path.abspath(sysconfig.get_paths()[k]) for k in ("stdlib", "purelib", "platlib")}
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:
        shell = None
    out = []
    for frame, lineno in traceback.walk_tb(tb):
        filename = frame.f_code.co_filename
        path = os.path.abspath(filename)
        if (frame.f_locals.get("__tracebackhide__") or path.startswith(_PACKAGE_DIR + os.sep)
                or any(path.startswith(d + os.sep) for d in library)):
            continue
        cell = shell.compile.format_code_name(filename) if shell is not None else None
        where = f"{cell[0]} {cell[1]}, line {lineno}" if cell else f"File {filename}, line {lineno}"
        out.append(f"\x1b[36m{where}\x1b[39m: {linecache.getline(filename, lineno).strip()}".rstrip())
    return out


def passed(message):
    """What a passing check prints (on stdout)."""
    print(f"✓ {message}")


# ---------------------------------------------------------------------------------------
# inside the workers


class ForbiddenCall(RuntimeError):
    pass


def _tripwire(name):
    def call(*args, **kwargs):
        raise ForbiddenCall(f"the exercise asks for a hand-written optimizer, but your code called {name}")

    return call


def _adam_code_tripwire(*args, **kwargs):
    # Its __code__ replaces that of torch's Python Adam functions, so it runs with *their*
    # globals (torch.optim.adam's): no free variables, and an absolute import, not a name of ours.
    from zerokit.grading.harness import ForbiddenCall

    raise ForbiddenCall("the exercise asks for a hand-written optimizer, but your code called torch's Adam "
                        "(torch.optim.Adam/AdamW or its functional forms)")


# What a check relies on; a student's code must not replace any of these.
GUARDED = [
    (torch, "allclose"), (torch, "equal"), (torch, "isclose"), (torch.testing, "assert_close"),
    (torch.Tensor, "allclose"), (torch.Tensor, "equal"), (torch.Tensor, "__eq__"), (torch.Tensor, "__sub__"),
    (torch.Tensor, "abs"), (torch.Tensor, "max"), (torch.Tensor, "item"), (torch.Tensor, "numel"),
    (torch.Tensor, "tolist"),
]
_FORBIDDEN = [("torch.optim", "Adam"), ("torch.optim", "AdamW"), ("torch.optim.adam", "adam"),
              ("torch.optim.adamw", "adamw"), ("torch.optim.adam", "Adam"), ("torch.optim.adamw", "AdamW"),
              ("torch", "_fused_adam_"), ("torch", "_fused_adamw_")]
# Replacing module attributes does not reach a function or class the student's code already
# holds (`from torch.optim import AdamW`, torch.optim.adam._single_tensor_adam called directly):
# the bodies of torch's Python implementations are swapped too, wherever they are referenced from.
_FORBIDDEN_CODE = [("torch.optim.adam", "adam"), ("torch.optim.adam", "_single_tensor_adam"),
                   ("torch.optim.adam", "_multi_tensor_adam"), ("torch.optim.adam", "_fused_adam"),
                   ("torch.optim.adamw", "adamw")]


def _real_adam():
    """torch's Adam attributes and the functions whose __code__ the tripwire replaces, as imported."""
    import importlib
    import inspect

    attrs = [(importlib.import_module(m), n) for m, n in _FORBIDDEN]
    attrs = [(mod, name, getattr(mod, name, None)) for mod, name in attrs]
    functions = []
    for m, n in _FORBIDDEN_CODE:
        fn = getattr(importlib.import_module(m), n, None)
        fn = inspect.unwrap(fn) if fn is not None else None  # torch.optim.adam.adam is a decorator's wrapper
        if inspect.isfunction(fn) and not fn.__code__.co_freevars and fn not in [f for f, _ in functions]:
            functions.append((fn, fn.__code__))
    return attrs, functions


# captured when the harness is imported in a worker, before any student code runs there
_REAL_ATTRS, _REAL_CODE = _real_adam()


def _forbid_adam():
    for mod, name, fn in _REAL_ATTRS:
        if fn is not None:
            setattr(mod, name, _tripwire(f"{mod.__name__}.{name}"))
    for fn, _ in _REAL_CODE:
        fn.__code__ = _adam_code_tripwire.__code__


def _adam_now():
    """What torch's Adam attributes and functions' code are now, for _put_back."""
    return ([(mod, name, getattr(mod, name, None)) for mod, name, _ in _REAL_ATTRS],
            [(fn, fn.__code__) for fn, _ in _REAL_CODE])


def _put_back(state):
    attrs, codes = state
    for mod, name, value in attrs:
        if value is not None:
            setattr(mod, name, value)
    for fn, code in codes:
        fn.__code__ = code


@contextlib.contextmanager
def torch_adam_allowed():
    """Lift the tripwires on torch's Adam for a check's own reference (no student code inside the
    block), and put back whatever was there."""
    before = _adam_now()
    _put_back((_REAL_ATTRS, _REAL_CODE))
    try:
        yield
    finally:
        _put_back(before)


# Whose contents a check relies on besides GUARDED: the checks' own modules (a module global such
# as assert_close, or a builtin's name shadowed there), what they import from zerokit, and torch.
_TRUSTED_MODULES = ("zerokit.comm", "zerokit.memory", "zerokit.reference", "zerokit.models", "zerokit.activations",
                    "zerokit.hooks", "zerokit.offload")


def _snapshot():
    """(label, namespace, copy of its contents, whether added names count) for every namespace a
    check trusts; a few dict copies, well under a millisecond."""
    import sys

    modules = [m for name, m in list(sys.modules.items())
               if m is not None and (name.startswith("zerokit.grading") or name in _TRUSTED_MODULES)]
    out = [(m.__name__, vars(m), dict(vars(m)), True) for m in modules]
    # torch.Tensor: a new name shadows TensorBase's method (torch.Tensor.any = ...), so it counts
    out.append(("torch.Tensor", vars(torch.Tensor), dict(vars(torch.Tensor)), True))
    for mod in (torch, torch.testing):  # only the functions: torch adds submodules etc. lazily
        out.append((mod.__name__, vars(mod), {k: v for k, v in vars(mod).items() if callable(v)}, False))
    return out


# caches Python itself adds: copyreg's on a class it copies or pickles, warnings' on a module that warns
_CACHES = {"__slotnames__", "__warningregistry__"}


def _replaced(snapshot):
    names = []
    for label, namespace, before, added_counts in snapshot:
        keys = set(before) | (set(namespace) - _CACHES if added_counts else set())
        names += sorted(f"{label}.{k}" for k in keys if namespace.get(k) is not before.get(k))
    return names


def _installed_only():
    """CheckFailed if a module the check runs on (zerokit, torch, ...) was not loaded from its installed files."""
    planted = origins.planted_modules()
    if planted:
        raise CheckFailed(origins.describe(planted))


def _guarded(rank, world_size, check, args, forbid_adam):
    _installed_only()  # what unpickling the check imported
    originals = [(obj, name, getattr(obj, name)) for obj, name in GUARDED]
    snapshot = _snapshot()
    before = _adam_now()
    if forbid_adam:
        _forbid_adam()
    try:
        result = check(rank, world_size, *args)
    finally:
        _put_back(before)
    label = {torch.Tensor: "torch.Tensor"}  # named as the snapshot names it, so nothing is listed twice
    tampered = [f"{label.get(obj, getattr(obj, '__name__', obj))}.{name}"
                for obj, name, fn in originals if getattr(obj, name) is not fn]
    tampered += [name for name in _replaced(snapshot) if name not in tampered]
    if tampered:
        raise CheckFailed(f"your code replaced {', '.join(tampered)}: checks must run on the real functions")
    _installed_only()  # and what the check and the student's code imported since
    return result


# ---------------------------------------------------------------------------------------
# in the notebook


def run_on_ranks(check, world_size, args=(), *, timeout=60.0, memory_limit_gb=4.0, forbid_adam=True,
                 what="the check"):
    """Run `check(rank, world_size, *args)` on `world_size` ranks; return the per-rank results.

    Any failure is raised as CheckFailed with a one-line reason first (see module docstring).
    """
    __tracebackhide__ = True  # IPython and pytest: show the reason, not this frame
    if os.environ.get(TIMEOUT_ENV):  # the autograder's --check-timeout: a cap, so a hang costs less
        timeout = min(timeout, float(os.environ[TIMEOUT_ENV]))
    if os.environ.get(MEMORY_ENV):  # --check-memory-limit-gb: a runaway rank is stopped sooner
        memory_limit_gb = min(memory_limit_gb, float(os.environ[MEMORY_ENV]))
    caught = []
    with warnings.catch_warnings(record=True) as caught, _stdout_only():
        warnings.simplefilter("always")
        try:
            # cwd: the ranks work outside the notebook's folder (-P keeps it off their sys.path too)
            results = launch(_guarded, world_size, args=(check, tuple(args), forbid_adam),
                             launcher="forkserver", backend="gloo", timeout=timeout,
                             memory_limit_gb=memory_limit_gb, cwd=tempfile.gettempdir())
        except LaunchTimeout as exc:
            raise CheckFailed(f"{what} did not finish within {timeout:g} s (a deadlock or an endless loop?): "
                              + _per_rank(exc) + "\n" + _indent(str(exc))) from None
        except LaunchError as exc:
            summary = str(exc).splitlines()[0].rstrip(":") if str(exc) else type(exc).__name__
            first = f"{what} {summary}: {_per_rank(exc)}" if exc.failures else f"{what} could not run: {summary}"
            raise CheckFailed(first + "\n" + _indent(str(exc))) from None
        except CheckFailed:
            raise
        except AssertionError as exc:
            raise CheckFailed(_rank_prefix(exc, world_size) + str(exc)) from None
        except ForbiddenCall as exc:
            raise CheckFailed(_rank_prefix(exc, world_size) + str(exc)) from None
        except Exception as exc:  # the student's code raised
            notes = getattr(exc, "__notes__", [])
            where = notes[0] if notes else ""
            raise CheckFailed(f"your code raised {_describe(exc)}" + (f"\n  ({where})" if where else "")
                              + "".join(f"\n  {n}" for n in notes[1:])) from None
    for w in caught:
        print(f"warning: {w.message}")
    return results


def _describe(exc):
    name = type(exc).__name__
    text = str(exc).strip()
    if text:
        return f"{name}: {text}"
    if isinstance(exc, NotImplementedError):
        # the released stub: `raise NotImplementedError()` has no message of its own
        return f"{name} (is the exercise still the stub that raises NotImplementedError?)"
    return f"{name} (with no message)"


def _per_rank(exc):
    """The launcher's per-rank reasons on one line: 'rank 0: never finished: inside ...; rank 1: ...'."""
    return "; ".join(f"rank {rank}: {why}" for rank, why in sorted(exc.failures.items())) or "no rank said why"


def _rank_prefix(exc, world_size):
    """'[rank 1] ' before a rank's message, unless there is one rank or the message names it already."""
    rank = getattr(exc, "rank", None)
    if rank is None or world_size == 1 or f"rank {rank}" in str(exc):
        return ""
    return f"[rank {rank}] "


def _indent(text):
    return "\n".join("  " + line for line in text.splitlines())


@contextlib.contextmanager
def _stdout_only():
    """Anything the harness itself would print to stderr goes to stdout instead."""
    buf = io.StringIO()
    with contextlib.redirect_stderr(buf):
        try:
            yield
        finally:
            if buf.getvalue():
                print(buf.getvalue(), end="")
