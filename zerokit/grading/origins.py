"""Where the modules a check runs on came from: the installed files, or something planted.

A check is only as good as the code it runs: zerokit's checks and comparisons, torch, numpy.
A package named `zerokit` (or `torch`) beside a notebook, or a folder a cell put on sys.path,
could stand in for them. Safe-path mode (-P) in every process that runs a check keeps the
notebook's folder off sys.path; this is the verification behind it: every module loaded in
this process whose name belongs to the installed course or to this Python's own libraries
must have been loaded from there.

The trusted places are computed from this interpreter (its installation prefixes: the
standard library and site-packages, which a sys.path entry cannot move) and from this
file's own package, which the ranks import from the location the grader set up.
"""

from __future__ import annotations

import functools
import os
import site
import sys
from importlib.machinery import PathFinder

COURSE = "zerokit"

__all__ = ["trusted_roots", "planted_modules", "describe"]


@functools.lru_cache(maxsize=1)
def trusted_roots():
    """The folders installed code lives in: zerokit's package, and this Python's installation (its
    prefixes: the standard library, its zip, lib-dynload, site-packages)."""
    course = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # .../zerokit
    paths = {course, sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix}
    paths.update(getattr(site, "getsitepackages", lambda: [])())
    return tuple(sorted({os.path.realpath(p) for p in paths if p}))


@functools.lru_cache(maxsize=None)
def _installed_name(top):
    """Whether a top-level module name belongs to the installed course or this Python's libraries."""
    if top == COURSE or top in sys.stdlib_module_names or top in sys.builtin_module_names:
        return True
    roots = [r for r in trusted_roots() if os.path.isdir(r)]
    try:
        return PathFinder.find_spec(top, roots) is not None
    except (ImportError, ValueError):
        return False


def _inside(path, roots):
    def under(p):
        return any(p == r or p.startswith(r + os.sep) for r in roots)

    # the plain path first: realpath costs a few system calls, and a check loads ~2000 modules
    return under(path) or under(os.path.realpath(path))


def planted_modules():
    """[(module name, where it was loaded from)] for every loaded module that carries the name of
    installed code but was loaded from somewhere else."""
    roots = trusted_roots()
    found = []
    for name, module in list(sys.modules.items()):
        # What the import system loaded carries a spec saying from where; objects placed in
        # sys.modules by hand (torch.ops, torch.classes) do not, and were made by installed code.
        spec = getattr(module, "__spec__", None)
        if spec is None or not _installed_name(name.partition(".")[0]):
            continue
        if spec.has_location and spec.origin:
            places = [spec.origin]
        else:  # a namespace package (a plain folder): where its parts are
            places = list(spec.submodule_search_locations or [])
        outside = [p for p in places if not _inside(os.path.abspath(p), roots)]
        if outside:
            found.append((name, outside[0]))
    return sorted(found)


def describe(planted):
    """One line naming what shadowed the installed code, and what to do."""
    name, where = planted[0]
    top = name.partition(".")[0]
    more = f" (and {len(planted) - 1} more module(s))" if len(planted) > 1 else ""
    return (f"the check ran on `{name}` loaded from {where}{more}, not the installed `{top}`: a file or folder "
            f"named `{top}` beside your notebook (or on sys.path) stands in for it. Rename it; the checks run "
            "only on the installed files")
