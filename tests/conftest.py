"""Shared helpers for the zerokit tests.

The numerics are always checked against references built here from PyTorch itself
(torch.optim.AdamW, torch.nn.utils.clip_grad_norm_), never against values recorded from
zerokit. Multi-rank code runs through zerokit.launch with the forkserver launcher (a rank
starts in ~0.1 s) and a timeout, so a deadlock fails the test instead of hanging it.
"""

import json
import os
import subprocess
import sys
import types
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import zerokit
from zerokit.grading.harness import CheckFailed
from zerokit.models import EdgeCaseNet, OddMLP, loss_for, make_batch
from zerokit.reference import rank_slice  # noqa: F401  (the tests import it from here)

# Seconds a single launch may take before it is killed and the test fails. Generous for
# a loaded 2-core machine, far below gloo's 30-minute default.
LAUNCH_TIMEOUT = 90

MODEL_CLASSES = {"mlp": OddMLP, "edge": EdgeCaseNet}

# nbmake runs the solution notebooks in zerokit's preforked kernel (tests/jupyter/kernels): the
# kernel the grader starts (grading/autograde/kernel.py), which imports torch once and forks its
# fork server from there before ipykernel starts. A plain ipykernel imports torch in the first
# cell and again in the fork server of the first launch: about 4 s of wall time per notebook
# on 2 cores (lesson 02, runs alternating: 8.3 and 8.1 s here, 12.5 and 12.2 s in python3).
# The notebooks still name python3, the kernel students get, and `pytest solutions/...` alone
# runs them in it.
KERNEL = "zerokit-preforked"
_JUPYTER_PATH = os.environ.get("JUPYTER_PATH")
os.environ["JUPYTER_PATH"] = os.pathsep.join([str(Path(__file__).resolve().parent / "jupyter"),
                                              *filter(None, [_JUPYTER_PATH])])


def students_env(**extra):
    """This environment with the kernels students get (JupyterLab in test_browser: no zerokit-preforked)."""
    env = {k: v for k, v in os.environ.items() if k != "JUPYTER_PATH"}
    if _JUPYTER_PATH:
        env["JUPYTER_PATH"] = _JUPYTER_PATH
    return {**env, **extra}


def pytest_configure(config):
    if getattr(config.option, "nbmake_kernel", "unset") is None:  # not chosen on the command line
        config.option.nbmake_kernel = KERNEL


# `make test` runs the files on two pytest-xdist workers (--dist loadfile): most tests wait more
# than they compute (process starts, rendezvous, timeouts), and the other worker fills that time.
# The two grading modules share one worker, one after the other: each checks that no grading
# process of any run is left on the machine, which the other's run would be while it lasts.
# They go first: the example submissions' grading (10 min) is the longest unit of work.
GRADING_FIRST = ("tests/test_autograde.py", "tests/test_autograde_unsandboxed.py")


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in GRADING_FIRST)  # stable: else as collected


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None  # xdist's own scheduler for the mode asked for
    from xdist.scheduler import LoadFileScheduling

    class GradingTogether(LoadFileScheduling):
        def _split_scope(self, nodeid):
            scope = super()._split_scope(nodeid)
            return GRADING_FIRST[0] if scope in GRADING_FIRST else scope

    return GradingTogether(config, log)


def run_ranks(fn, world_size, *args, timeout=LAUNCH_TIMEOUT):
    """fn(rank, world_size, *args) on world_size gloo ranks; the list of return values."""
    return zerokit.launch(fn, world_size, args=args, backend="gloo", launcher="forkserver",
                          timeout=timeout, echo=False)


def new_model(kind, seed=0):
    torch.manual_seed(seed)
    return MODEL_CLASSES[kind]()


def batch(kind, step, size, seed=0):
    """The global batch of `step` (deterministic, so every rank and the reference agree)."""
    return make_batch(kind, size, seed=1000 * seed + step + 17)


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_diff(a, b):
    """max |a - b| over every tensor of two {name: tensor} dicts with the same keys and shapes."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    worst = 0.0
    for k in a:
        assert a[k].shape == b[k].shape, (k, a[k].shape, b[k].shape)
        worst = max(worst, (a[k].double() - b[k].double()).abs().max().item() if a[k].numel() else 0.0)
    return worst


def adamw_reference(kind, steps, batch_size, *, lr=1e-2, weight_decay=0.0, clip=None, seed=0,
                    betas=(0.9, 0.999), eps=1e-8):
    """One process, torch.optim.AdamW (foreach=False) on the whole batch.

    Returns (snapshots after each step, final optimizer state {name: {...}}, grad norms
    before clipping per step (when clip is set)).
    """
    model = new_model(kind, seed)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([p for _, p in named], lr=lr, betas=betas, eps=eps,
                            weight_decay=weight_decay, foreach=False)
    snaps, norms = [], []
    for step in range(steps):
        x, y = batch(kind, step, batch_size, seed)
        loss_for(kind, model(x), y).backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_([p for _, p in named], clip).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        snaps.append(snapshot(model))
    state = {}
    for n, p in named:
        if p in opt.state:
            s = opt.state[p]
            state[n] = {"exp_avg": s["exp_avg"].clone(), "exp_avg_sq": s["exp_avg_sq"].clone(),
                        "step": int(s["step"])}
    return snaps, state, norms


def ceil_div(a, b):
    return -(-a // b)


def align():
    """zerokit.flat's alignment in elements (16 bytes of a 16-bit dtype: 8): each parameter of a flat
    buffer starts on a multiple of it, and each shard holds a multiple of it."""
    from zerokit.flat import align_numel

    return align_numel()


def padding_bound(n_params, n_buckets, world_size):
    """Elements of padding flat buffers may hold beyond their parameters, all buckets together:
    less than one alignment per parameter (the gap before it) and per shard (each bucket's end,
    cut into world_size shards that hold a multiple of the alignment). A rank's shards hold less
    than this / world_size beyond Psi / N."""
    return align() * (n_params + n_buckets * world_size)


def num_trainable(model):
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def close_rel(measured, expected, rel):
    return abs(measured - expected) <= rel * abs(expected)


# ---- the grading tests: a notebook's exercise cells, and what a check says about them

ROOT = Path(__file__).resolve().parents[1]


def source_module(name, source, prelude=""):
    """`prelude + source` executed as a module of its own (not in sys.modules, so cloudpickle sends
    what it defines to the ranks by value, as it does a notebook's classes)."""
    module = types.ModuleType(name)
    exec(prelude + source, module.__dict__)
    return module


def exercise_module(lesson, folder, grade_ids, prelude="", extra=""):
    """The named cells of lessons/ or solutions/ <lesson>, executed as one module.

    The module is not in sys.modules, so cloudpickle sends what it defines to the ranks by
    value, as it does a notebook's classes.
    """
    nb = json.loads((ROOT / folder / lesson / f"{lesson}.ipynb").read_text())
    cells = {c["metadata"].get("nbgrader", {}).get("grade_id"): "".join(c["source"]) for c in nb["cells"]}
    return source_module(f"lesson{lesson[:2]}_{folder}", "\n\n".join(cells[g] for g in grade_ids) + extra, prelude)


def fails(check, *args, match, **kwargs):
    """check(*args) fails with a message containing `match` (or one of a tuple of fragments)."""
    with pytest.raises(CheckFailed) as info:
        check(*args, **kwargs)
    assert any(m in str(info.value) for m in ((match,) if isinstance(match, str) else match)), str(info.value)
    return str(info.value)


# the released stubs raise NotImplementedError(); a check's reason must say so
UNFINISHED = ("NotImplementedError",)


def fails_exactly(checks, cls, expected, capsys, may_also_fail=(), **kw):
    """`cls` fails the checks named in `expected` ({name: message fragment}) and passes every
    other one of `checks` ({name: check(cls, **kw)}) but those in may_also_fail: one bug costs one check."""
    who = getattr(cls, "__name__", cls)
    for name, check in checks.items():
        reason, printed = _outcome_and_output(check, cls, capsys, **kw)
        if name in expected:
            # what the passing check printed: its configuration (Ψ, model, ranks) shows what it ran on
            assert reason is not None, f"{who} passed {name}: {printed.strip()}"
            assert expected[name] in reason, f"{who} failed {name} for another reason: {reason}"
        elif name not in may_also_fail:
            assert reason is None, f"{who} should pass {name}, failed: {reason}"


def fails_every_check(checks, obj, match=UNFINISHED):
    """Every one of `checks` fails on `obj` (the untouched notebook's stub) with a reason naming it."""
    for check in checks.values():
        fails(check, obj, match=match)


def outcome(check, cls, capsys, **kw):
    """None if the check passed, else the reason it gave."""
    return _outcome_and_output(check, cls, capsys, **kw)[0]


def _outcome_and_output(check, cls, capsys, **kw):
    """(None, what the check printed) if it passed, else (the reason it gave, "")."""
    try:
        check(cls, **kw)
    except CheckFailed as exc:  # also what the checks raise before the ranks start (e.g. the class itself)
        capsys.readouterr()
        return str(exc), ""
    out = capsys.readouterr().out
    assert out.startswith("✓"), out
    return None, out


# ---- the grading flow's tests: real nbgrader commands, and what grading must leave alone


# The notebooks' hidden test cells drop zerokit's modules (zerokit.grading, .launcher, .memory,
# ...) from sys.modules and import them afresh before each check (a kernel's own code cannot
# then have changed them). Where a test runs such a cell in this process, the old ones must
# come back: tests of other files (and pytest-xdist runs files in any order) hold the old
# modules' functions and classes, which cloudpickle would then send by value (a rank's
# isinstance fails), and kit's refusals would look up in the wrong copy. So after every test.
RELOADED = "zerokit."


@pytest.fixture(autouse=True)
def modules_put_back():
    """Undo, after the test, a hidden test cell's fresh import of zerokit's modules."""
    saved = {name: m for name, m in sys.modules.items() if name.startswith(RELOADED)}
    yield
    for name, module in saved.items():  # a module first imported by the test stays: there is one copy
        if sys.modules.get(name) is not module:
            sys.modules[name] = module
            parent, _, child = name.rpartition(".")
            if parent in sys.modules:  # `import a.b` also rebinds b on its package a
                setattr(sys.modules[parent], child, module)


def nbgrader(*args, cwd):
    """A real nbgrader command run in `cwd` (a course folder); its CompletedProcess."""
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    return subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def checkout_state():
    """What grading must not change: the grader's files byte for byte (zerokit, solutions/,
    lessons/, the nbgrader config, site-packages' startup hooks), and git's view of the checkout."""
    from zerokit.grading.autograde.integrity import Baseline, course_files  # here: it imports nbgrader

    files = Baseline(*course_files()).contents
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT,
                            capture_output=True, text=True).stdout if (ROOT / ".git").exists() else None
    return files, status


class LazyWork:
    """The work handle of a "lazy" collective test double: its transfer runs only at wait(),
    so code that reads an output (or writes an input) before waiting gets other numbers."""

    def __init__(self, run):
        self._run = run

    def wait(self):
        if self._run is not None:
            run, self._run = self._run, None
            run()
        return True


def poison_scratch():
    """From now on in this process, FlatBucket.scratch() buffers start as NaN outside their padding
    (a fresh allocation is often all zeros, which would hide a read before the write)."""
    from zerokit.flat import FlatBucket

    real = FlatBucket.scratch

    def poisoned(self, *args, **kwargs):
        flat = real(self, *args, **kwargs)
        for view in self.views(flat):  # the parameters' places; the padding stays the zeros scratch promises
            view.fill_(float("nan"))
        return flat

    FlatBucket.scratch = poisoned


__all__ = ["LazyWork", "poison_scratch", "LAUNCH_TIMEOUT", "run_ranks", "new_model", "batch", "rank_slice", "snapshot", "max_diff",
           "adamw_reference", "ceil_div", "align", "padding_bound", "num_trainable", "close_rel", "exercise_module",
           "source_module", "fails", "outcome",
           "UNFINISHED", "fails_exactly", "fails_every_check", "nbgrader", "checkout_state"]


# ---- a headless Chromium (tests/test_browser.py, and the feedback in tests/test_autograde.py)

CHROMIUM = os.environ.get("ZEROKIT_CHROMIUM", "/usr/bin/chromium")
# what a headless Chromium needs on a machine without a display or a network beyond localhost
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                 "--disable-background-networking", "--disable-component-update"]


@contextmanager
def chromium():
    """The system's Chromium under Playwright; fails (never skips) without one: `make test`
    installs it. Open it per module, not per session: Playwright's sync API keeps an event
    loop of its own, which must not outlive the module (nbmake runs asyncio)."""
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(f"no Chromium at {CHROMIUM}: `make test` installs it (apt-get install chromium)")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()
