"""The grader's own files, verified around every notebook: changed, added or deleted ones are
reported and put back.

Defence in depth behind the sandbox (which makes them read-only for a submission), and the
only defence with --no-sandbox: a notebook that rewrites a check (zerokit/grading/...), the
hidden tests (solutions/), the released notebooks (lessons/), the course's nbgrader config,
or plants a startup hook in this Python's site-packages (a .pth file runs in every later
Python process) would otherwise pass checks it should fail, and make every notebook graded
after it pass too.

What is covered: every file under the installed zerokit package (its __pycache__ too: a
planted .pyc with the right header is imported instead of the source; the baseline first
compiles the package, so Python has no reason to write there during grading), solutions/,
lessons/, nbgrader_config.py, and site-packages' .pth, editable-install and *customize files.
The baseline holds their bytes in memory (a few MB): restoring needs no copy on disk that a
submission could reach.
"""

from __future__ import annotations

import compileall
import hashlib
import os
import shutil
import site
from pathlib import Path

from ..lessons import LESSONS, ROOT, SOLUTIONS

__all__ = ["Baseline", "course_files"]


def _package_dir():
    import zerokit

    return Path(zerokit.__file__).resolve().parent


def _site_hooks():
    """Files in site-packages that run or redirect code in every Python process started later."""
    dirs = {Path(p) for p in getattr(site, "getsitepackages", lambda: [])()}
    found = []
    for d in dirs:
        if d.is_dir():
            found += [p for p in d.iterdir() if p.is_file() and (
                p.suffix == ".pth" or p.name.startswith("__editable__")
                or p.name in ("sitecustomize.py", "usercustomize.py"))]
    return found


def course_files():
    """(folders walked whole, single files): what the grader relies on."""
    return [_package_dir(), SOLUTIONS, LESSONS], [ROOT / "nbgrader_config.py", *_site_hooks()]


def _read_tree(folders, files):
    contents = {}
    for folder in folders:
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames.sort()
            for name in filenames:
                path = Path(dirpath) / name
                contents[path] = _read(path)
    for path in files:
        if path.exists():
            contents[Path(path)] = _read(path)
    return contents


def _read(path):
    try:
        return Path(path).read_bytes() if not Path(path).is_symlink() else b"symlink:" + os.readlink(path).encode()
    except OSError as exc:
        return f"unreadable: {exc}".encode()


class Baseline:
    """The bytes of the grader's files as grading began; `changes()` and `restore()` against them."""

    def __init__(self, folders, files):
        self.folders, self.files = [Path(f) for f in folders], [Path(f) for f in files]
        self.contents = _read_tree(self.folders, self.files)

    def fingerprint(self):
        """sha256 over every file's path and bytes: one line an instructor can compare between runs."""
        h = hashlib.sha256()
        for path in sorted(self.contents):
            h.update(_show(path).encode() + b"\0" + hashlib.sha256(self.contents[path]).digest())
        return f"{len(self.contents)} files, sha256 {h.hexdigest()[:16]}"

    @classmethod
    def course(cls):
        folders, files = course_files()
        # compiled first, so that importing the package in a kernel writes nothing there
        compileall.compile_dir(str(folders[0]), quiet=2)
        return cls(folders, files)

    def changes(self):
        """['zerokit/grading/compare.py (changed)', ...] relative to the repository where possible."""
        now = _read_tree(self.folders, [*self.files, *_site_hooks()])
        out = []
        for path in sorted(set(now) | set(self.contents)):
            before, after = self.contents.get(path), now.get(path)
            if before == after:
                continue
            what = "added" if before is None else "deleted" if after is None else "changed"
            out.append(f"{_show(path)} ({what})")
        return out

    def restore(self):
        """Put every file back as it was, and remove files that were added; what it did, as changes() says it."""
        done = self.changes()
        now = _read_tree(self.folders, [*self.files, *_site_hooks()])
        for path in now:
            if path not in self.contents:
                _remove(path)
        for path, data in self.contents.items():
            if now.get(path) != data:
                _write(path, data)
        return done


def _show(path):
    try:
        return str(Path(path).relative_to(ROOT))
    except ValueError:
        return str(path)


def _remove(path):
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        pass


def _write(path, data):
    if data.startswith(b"symlink:"):
        _remove(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(data[len(b"symlink:"):].decode(), path)
        return
    if path.is_symlink() or path.is_dir():
        _remove(path)  # never write through a planted link
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.zerokit-restore")
    tmp.write_bytes(data)
    os.replace(tmp, path)
