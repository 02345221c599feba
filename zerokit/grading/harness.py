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
forms) are replaced by tripwires, so a "hand-written" optimizer that calls them fails;
and the functions a check compares with are captured before the student's code runs and
verified afterwards, so monkeypatching them fails too.
"""

import contextlib
import io
import os
import warnings

import torch

from ..launcher import LaunchError, LaunchTimeout, launch

__all__ = ["CheckFailed", "run_on_ranks", "passed", "GUARDED", "TIMEOUT_ENV"]

TIMEOUT_ENV = "ZEROKIT_CHECK_TIMEOUT"  # seconds; caps every check's own timeout when set


class CheckFailed(AssertionError):
    """A check did not pass; the message's first line is the reason."""


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


def _guarded(rank, world_size, check, args, forbid_adam):
    import importlib

    import zerokit.grading as grading_pkg

    originals = [(obj, name, getattr(obj, name)) for obj, name in GUARDED]
    modules = {name: importlib.import_module(name) for name in {m for m, _ in _FORBIDDEN}}
    saved = [(modules[m], n, getattr(modules[m], n, None)) for m, n in _FORBIDDEN]
    graders = {k: v for k, v in vars(grading_pkg).items()}
    if forbid_adam:
        for mod, name, _ in saved:
            setattr(mod, name, _tripwire(f"{mod.__name__}.{name}"))
    try:
        result = check(rank, world_size, *args)
    finally:
        for mod, name, value in saved:
            if value is not None:
                setattr(mod, name, value)
    tampered = [f"{getattr(obj, '__name__', obj)}.{name}" for obj, name, fn in originals if getattr(obj, name) is not fn]
    tampered += [f"zerokit.grading.{k}" for k, v in graders.items() if vars(grading_pkg).get(k) is not v]
    if tampered:
        raise CheckFailed(f"your code replaced {', '.join(tampered)}: checks must run on the real functions")
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
    caught = []
    with warnings.catch_warnings(record=True) as caught, _stdout_only():
        warnings.simplefilter("always")
        try:
            results = launch(_guarded, world_size, args=(check, tuple(args), forbid_adam),
                             launcher="forkserver", backend="gloo", timeout=timeout,
                             memory_limit_gb=memory_limit_gb)
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
            raise CheckFailed(_rank_prefix(exc) + str(exc)) from None
        except ForbiddenCall as exc:
            raise CheckFailed(_rank_prefix(exc) + str(exc)) from None
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


def _rank_prefix(exc):
    rank = getattr(exc, "rank", None)
    return f"[rank {rank}] " if rank is not None else ""


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
