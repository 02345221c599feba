"""The check kit: the pieces every lesson's checks share, written once.

- the class guard: `check_class` (in the notebook's process, before any rank starts) says
  why a class cannot be graded as the exercise: not a class, zerokit's own under another
  name, not built on the scaffold's base, or borrowing zerokit's methods;
- `refusing(...)`: inside a check, zerokit's own answer to the exercise raises instead of
  working, so a student's code cannot hand the work to it;
- the reference: `adamw_reference` runs torch.optim.AdamW (foreach=False) in a one-rank
  launch of its own and caches what it recorded after each step (the ranks that run the
  student's code have torch's Adam disabled, and the notebook's process may have rebound it);
- the hyperparameter sets the checks run Adam at (`ADAM_HYPER`, `SHARDED_HYPER`), and why each;
- data: `rank_batch` cuts this rank's slice out of the global batch of a step, `batch_backward`
  runs a step's forward and backward on it (or, as the reference's gradient, on the whole batch);
- `launch_size`: the ranks to launch for a job on a subgroup of a larger world;
- small readers every check needs: `trainable`, `snapshot`, `gather_object`, `bucket_label`,
  `state_shard`, `assert_changed`;
- asynchrony made visible: `LazyWork` and `lazy_transfers` stand in for a slow transfer, whose
  data arrives only when its work is waited for;
- the fixture matrix: `SITUATIONS`, the situations student code meets in real training. Each
  lesson's module declares, in its own `SITUATIONS` table, which of its checks meets each one
  in the hidden tests, or why none applies (tests/test_situations.py holds it to that).

Models come from the zoo in zerokit.models (`build_model`, `model_batch`, `model_loss`).
"""

import contextlib
import functools
import gc
import inspect
import sys
import time
import types

import torch
import torch.distributed as dist

from ..models import build_model, model_batch, model_loss
from ..reference import rank_slice
from .compare import assert_close
from .harness import CheckFailed, run_on_ranks

__all__ = ["SITUATIONS", "check_class", "refusing", "intact", "ADAM_HYPER", "SHARDED_HYPER", "adamw_reference",
           "global_batch", "rank_batch", "branch_used", "batch_backward", "ranks_backward", "launch_size",
           "build_optimizer", "trainable", "psi_of", "snapshot", "gather_object", "bucket_label", "state_shard",
           "assert_changed", "optimizer_held_bytes", "assert_adam_shards", "alias", "renamed_args", "try_stretch",
           "LazyWork", "lazy_transfers", "census_after_gloo_lets_go"]


# ---------------------------------------------------------------------------------------
# the fixture matrix: one name per situation; a lesson's table maps each name to
# "check_name" or "check_name: model-or-setting" (a check whose hidden tests meet it), or to
# "n/a: why" where the lesson's code cannot meet it

SITUATIONS = {
    "zero-grad-shard": "a whole shard whose gradient is zeros, not None (model sparse-embed)",
    "frozen": "frozen parameters (model edge)",
    "tied": "a parameter used twice (models edge, awkward)",
    "unused": "a parameter no rank has a gradient for (models edge, branch)",
    "tuple-output": "a unit returning a tuple or a dict (model awkward)",
    "root-params": "a root unit that owns parameters: a tied embedding (model awkward)",
    "eval-no-grad": "an eval forward under torch.no_grad, then the state at rest checked",
    "subgroup": "a process subgroup instead of the default group",
    "n3": "N = 3, with sizes not divisible by N",
    "sits-out": "a layer that sits out a step: per-parameter step counts differ (model branch)",
    "fp16-scale": "fp16 at a loss scale other than 1",
    "zero3": "ZeRO-3 as well as ZeRO-1 and 2, where the lesson's code touches the stages",
    "peak-memory": "peak memory, not only bytes held or written, where the lesson states a memory rule",
    "out-of-order": "gradients arriving out of bucket order",
}


# ---------------------------------------------------------------------------------------
# the class guard (in the notebook's process: CheckFailed, no harness turns AssertionError into one)


def _code(fn):
    # unwrap: every @torch.no_grad() method shares the decorator's own code object
    return getattr(inspect.unwrap(fn), "__code__", None)


def check_class(cls, expected, *, refuse=(), base=torch.optim.Optimizer,
                base_hint="keep the scaffold's base class", methods=(), written_in=()):
    """Raise CheckFailed unless `cls` can be graded as the student's class.

    expected:   how to name what was expected ("your optimizer class (MyZeRO2Adam)").
    refuse:     (zerokit class, why) pairs: subclassing one of these is not doing the exercise.
    base:       the scaffold's base class(es), a class or a tuple.
    methods:    the methods the student writes: each must exist and be their own, not one of
                the classes in `written_in` (zerokit's reference) under the same name.
    """
    if not isinstance(cls, type):
        raise CheckFailed(f"expected {expected}, got {type(cls).__name__}")
    for forbidden, why in refuse:
        if issubclass(cls, forbidden):
            raise CheckFailed(f"{cls.__name__} subclasses {_display(forbidden)}: {why}")
    if not issubclass(cls, base):
        bases = base if isinstance(base, tuple) else (base,)
        names = " or ".join(_display(b) for b in bases)
        raise CheckFailed(f"{cls.__name__} is not a {names}: {base_hint}")
    for name in methods:
        mine = getattr(cls, name, None)
        if mine is None:
            raise CheckFailed(f"{cls.__name__} has no method {name}: keep the scaffold's method names")
        for ref_cls in written_in:
            owner = next((k for k in ref_cls.__mro__ if name in vars(k)), None)  # where zerokit defines it
            theirs = vars(owner)[name] if owner is not None else None
            if theirs is not None and (mine is theirs or _code(mine) is _code(theirs)):
                raise CheckFailed(f"{cls.__name__}.{name} is {_display(owner)}.{name}: write it yourself")


def _display(cls):
    if cls.__module__.startswith("zerokit."):
        public = getattr(sys.modules["zerokit"], cls.__name__, None)
        return f"zerokit.{cls.__name__}" if public is cls else f"{cls.__module__}.{cls.__name__}"
    if cls.__module__.startswith("torch."):
        return {torch.optim.Optimizer: "torch.optim.Optimizer"}.get(cls, f"torch.optim.{cls.__name__}")
    return cls.__name__


# ---------------------------------------------------------------------------------------
# zerokit's own answer refuses to work inside a check

REFUSALS = {}  # code name -> message; public: _refused_code reads it as kit.REFUSALS, from another module's globals


def _refused_code(*args, **kwargs):
    # Its __code__ (renamed per target) replaces a zerokit function's, so it runs with *that*
    # function's globals: it finds its message through an absolute import, not a name of ours.
    import inspect as _inspect

    from zerokit.grading import kit as _kit

    raise AssertionError(_kit.REFUSALS[_inspect.currentframe().f_code.co_name])


@contextlib.contextmanager
def refusing(*targets, everywhere=False):
    """Inside the block each (owner, attribute, message) raises AssertionError(message) when called.

    The attribute is replaced on its owner, so what the check itself took earlier (a
    reference version it hands the student's class) keeps working. everywhere=True swaps a
    plain function's code instead, so a reference the student's code already holds (`from
    zerokit.adam import adamw_update_`) is caught too.
    """
    saved = []
    try:
        for owner, name, message in targets:
            value = getattr(owner, name)
            fn = getattr(value, "__wrapped__", value)
            if everywhere and inspect.isfunction(fn) and not fn.__code__.co_freevars:
                key = next((k for k, m in REFUSALS.items() if m == message), f"_refused_{len(REFUSALS)}")
                REFUSALS[key] = message
                saved.append((fn, "__code__", fn.__code__))
                fn.__code__ = _refused_code.__code__.replace(co_name=key, co_qualname=key)
            else:
                def refuse(*_a, _message=message, **_k):
                    raise AssertionError(_message)

                saved.append((owner, name, value))
                setattr(owner, name, refuse)
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def intact(fn):
    """A function of its own with fn's code: refusing(..., everywhere=True) swaps the code of zerokit's
    function object itself (to catch a student's call), and the checks still need the original."""
    fn = inspect.unwrap(fn)
    return types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


# ---------------------------------------------------------------------------------------
# data


def global_batch(model, step, size, stream=0):
    """The global batch of `step`: every rank and the reference see the same one."""
    return model_batch(model, size, stream + step)


def rank_batch(model, step, size, rank, world_size, stream=0):
    """This rank's equal slice of the global batch of `step`."""
    x, y = global_batch(model, step, size, stream)
    return rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)


def branch_used(step, rank):
    """Whether `rank` runs BranchNet's branch in `step`: every rank, none, every rank, even ranks only."""
    return (True, False, True, rank % 2 == 0)[step % 4]


def batch_backward(net, step, model, size, stream=0, rank=None, world_size=None):
    """Forward and backward of the global batch of `step` (rank None: one process has it all),
    or of this rank's slice of it. With rank None it is adamw_reference's `backward` for a lesson
    whose ranks each take an equal slice of one batch: args (model, size, stream)."""
    if rank is None:
        x, y = global_batch(model, step, size, stream)
    else:
        x, y = rank_batch(model, step, size, rank, world_size, stream)
    model_loss(model, net(x), y).backward()


def ranks_backward(net, step, model, size, stream, world_size, rank=None, accumulation=1, same_data=False):
    """batch_backward where BranchNet ("branch") runs its branch on the ranks branch_used says.
    rank None: one process, the mean of every rank's loss (the whole batch at once on other models).
    Else this rank's slice (the whole batch with same_data), in `accumulation` micro-batches, each
    loss divided by their number."""
    def loss_of(x, y, r):
        return model_loss(model, net(x, use_branch=branch_used(step, r)) if model == "branch" else net(x), y)

    if rank is None and model != "branch":
        batch_backward(net, step, model, size, stream)
    elif rank is None:
        for r in range(world_size):
            (loss_of(*rank_batch(model, step, size, r, world_size, stream), r) / world_size).backward()
    else:
        x, y = (global_batch(model, step, size, stream) if same_data else
                rank_batch(model, step, size, rank, world_size, stream))
        for xs, ys in zip(x.chunk(accumulation), y.chunk(accumulation)):
            loss = loss_of(xs, ys, rank)
            (loss / accumulation if accumulation > 1 else loss).backward()


# ---------------------------------------------------------------------------------------
# the hyperparameters the checks run Adam at, named once. A check's numbers (its tolerances, the
# hints that redo a step) were measured at its lesson's set, so a lesson's HYPER names one of these
# and keeps it; where a lesson changes a value, it says why.

# torch.optim.AdamW's defaults but lr 1e-2 (a few steps move every weight well clear of rounding):
# lessons 01-03, whose weight decay is each check's argument (lesson 01's default 0.01); lesson 06
# at lr 1e-3
ADAM_HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
# the sharded stages against AdamW on one process, on a transformer (lessons 04, 05, 07, 08, 11):
# eps 1e-6, not 1e-8. Adam divides each gradient element by sqrt(v) + eps, so an element that is
# ~1e-9 by cancellation (the transformer has a few) turns the rounding of a different summation
# order into weight differences of ~1e-4 at eps = 1e-8; at 1e-6, ~1e-6.
SHARDED_HYPER = dict(lr=1e-2, weight_decay=0.1, eps=1e-6)


# ---------------------------------------------------------------------------------------
# the reference: torch.optim.AdamW on one process, in a launch of its own

_REFERENCES = {}


def _reference_case(_rank, _world_size, model, steps, hyper, backward, args, seed, optimizer):
    net = build_model(model, seed)
    named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    make = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}[optimizer]
    opt = make([p for _, p in named], foreach=False, **hyper)
    out = []
    for step in range(steps):
        backward(net, step, *args)
        record = {"grads": {n: None if p.grad is None else p.grad.clone() for n, p in named}}
        opt.step()
        opt.zero_grad(set_to_none=True)
        record["params"] = snapshot(net)
        state = {n: opt.state[p] for n, p in named if opt.state.get(p)}
        for key in ("exp_avg", "exp_avg_sq"):
            record[key] = {n: s[key].clone() for n, s in state.items()}
        record["step"] = {n: int(s["step"]) for n, s in state.items()}
        out.append(record)
    return out


def adamw_reference(model, steps, hyper, backward, args=(), *, seed=0, optimizer="adamw", timeout=60.0):
    """What one process running torch.optim.AdamW records after each of `steps` steps.

    `backward(net, step, *args)` computes the gradients of a step on the model (built from the
    zoo with `seed`): the mean loss over every rank's data, as the ranks will see it between
    them. Each record holds "grads" (before the step; None where a parameter got none),
    "params" (after it), and Adam's "exp_avg", "exp_avg_sq" and "step" per parameter name.
    optimizer="adam": torch.optim.Adam (L2 weight decay), to recognise that mistake.
    Cached per configuration: a lesson's visible and hidden checks share the runs they can.
    """
    key = (model, steps, tuple(sorted(hyper.items())), backward.__module__, backward.__qualname__, args, seed,
           optimizer)
    if key not in _REFERENCES:
        _REFERENCES[key] = run_on_ranks(_reference_case, 1, args=(model, steps, hyper, backward, args, seed, optimizer),
                                        timeout=timeout, forbid_adam=False,
                                        what="the reference (torch.optim.AdamW)")[0]
    return _REFERENCES[key]


# ---------------------------------------------------------------------------------------
# small readers


def build_optimizer(cls, params, **hyper):
    """The student's cls(params, **hyper), which must be a torch.optim.Optimizer (the scaffold's base)."""
    opt = cls(params, **hyper)
    if not isinstance(opt, torch.optim.Optimizer):
        raise AssertionError(f"{type(opt).__name__} is not a torch.optim.Optimizer")
    return opt


def trainable(model):
    """(name, parameter) of every parameter that trains."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def psi_of(model):
    """Ψ: the number of trainable parameter elements."""
    return sum(p.numel() for _, p in trainable(model))


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def launch_size(world_size, group_ranks):
    """How many ranks to launch for a job of world_size ranks on the global ranks `group_ranks` of
    a larger world (a subgroup; None: the whole launch is the job)."""
    if group_ranks is None:
        return world_size
    if len(group_ranks) != world_size or sorted(group_ranks) != list(group_ranks):
        raise ValueError(f"group_ranks must be world_size = {world_size} increasing global ranks, not {group_ranks}")
    return max(group_ranks) + 1


def gather_object(obj):
    """Every rank's `obj`, by rank (also a collective of the check's own: no rank leaves early)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def bucket_label(bi, bucket, name_of):
    """'bucket 2 (layers.1.weight, layers.1.bias)': a bucket as a student can find it."""
    names = [name_of[p] for p in bucket.params]
    return f"bucket {bi} ({', '.join(names[:3]) + (', ...' if len(names) > 3 else '')})"


def state_shard(bucket, per_name, name_of):
    """This rank's shard of a {parameter name: tensor} record (zeros where a parameter has none)."""
    return bucket.shard_of([per_name.get(name_of[p]) for p in bucket.params])


def assert_adam_shards(shards, buckets, record, name_of, when):
    """Adam's m and v of this rank's shard of each bucket (`shards[bi].exp_avg`, `.exp_avg_sq`)
    against AdamW's record. v gets a looser relative tolerance: it squares the gradient, and
    the different summation order of a reduce-scatter shows in its last bits."""
    for bi, (bucket, state) in enumerate(zip(buckets, shards)):
        label = bucket_label(bi, bucket, name_of)
        assert_close(state.exp_avg, state_shard(bucket, record["exp_avg"], name_of),
                     f"{when}: Adam's m (exp_avg) for this rank's shard of {label}", atol=1e-6, rtol=1e-4)
        assert_close(state.exp_avg_sq, state_shard(bucket, record["exp_avg_sq"], name_of),
                     f"{when}: Adam's v (exp_avg_sq) for this rank's shard of {label}", atol=1e-10, rtol=1e-3)


def assert_changed(model, initial):
    """The steps did something: parameters moved and stayed finite (a no-op scores nothing)."""
    now = [p.detach() for p in model.parameters()]
    if not all(bool(torch.isfinite(p).all()) for p in now):
        raise AssertionError("after your steps some parameters are NaN or inf")
    if all(torch.equal(a, b) for a, b in zip(now, initial)):
        raise AssertionError("your step() left every parameter unchanged")


# ---------------------------------------------------------------------------------------
# what an optimizer keeps alive, however it stores it


def _live_tensors():
    """Every tensor Python can reach in this process, one per storage (the largest view)."""
    out = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and not obj.is_meta:
            try:
                s = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            if s.nbytes():
                key = (s.device.type, s.data_ptr())
                if key not in out or out[key][0] < s.nbytes():
                    # the storage object too: a parameter whose .data is replaced would otherwise free
                    # its old memory, and a new tensor there would pass for one that existed before
                    out[key] = (s.nbytes(), obj, s)
    return out


def _held_by_cxx_alone(entry):
    """No Python object refers to the tensor of census entry (nbytes, tensor, storage), the entry
    itself and frames aside: only C++ holds it."""
    for r in gc.get_referrers(entry[1]):  # a loop, not a generator: its closure cell would refer to the tensor
        if r is not entry and not inspect.isframe(r):
            return False
    return True


def census_after_gloo_lets_go(exclude, patience=0.5):
    """_live_tensors(), taken again (every 10 ms, for up to `patience` s) while a tensor not in
    `exclude` is held by C++ alone. gloo's worker thread lets go of a finished collective's tensors
    a moment after wait() has returned, and on a busy machine that moment can outlast the census:
    the buffer of an all-reduce long over then looks kept (seen once in CI, lesson 03's check of a
    correct optimizer). What C++ still holds after `patience` (a work never waited for, an autograd
    graph) is counted."""
    deadline = time.monotonic() + patience
    while True:
        gc.collect()
        census = _live_tensors()
        if time.monotonic() > deadline or not any(
                _held_by_cxx_alone(entry) for k, entry in census.items() if k not in exclude):
            return census
        del census
        time.sleep(0.01)


def optimizer_held_bytes(model, run_steps):
    """Bytes of tensor storage that appear while `run_steps(model)` runs and are neither the model's
    parameters nor its gradients: what an optimizer built and stepped inside it keeps alive.

    Returns (bytes, [(nbytes, numel of the largest tensor on that storage)], largest first).
    Tensors alive before are held meanwhile, so new ones cannot reuse their memory and hide.
    """
    gc.collect()
    before = _live_tensors()
    keep = run_steps(model)
    exclude = set(before)
    for p in model.parameters():
        exclude.add((p.device.type, p.untyped_storage().data_ptr()))
        if p.grad is not None:
            exclude.add((p.grad.device.type, p.grad.untyped_storage().data_ptr()))
    after = census_after_gloo_lets_go(exclude)
    held = sorted(((nbytes, t.numel()) for k, (nbytes, t, _) in after.items() if k not in exclude), reverse=True)
    del keep, before, after
    return sum(n for n, _ in held), held


# ---------------------------------------------------------------------------------------
# asynchrony made visible: a transfer whose data arrives only at wait()


class LazyWork:
    """The work of an asynchronous collective whose data arrives only when it is waited for.

    Built from a real work and its output tensor: the real transfer is completed, its result
    kept aside, and the output overwritten with NaN (or -1 for integers); `wait()` writes the
    result back. Code that reads the output without waiting reads NaN every time, where on a
    real network it reads whatever the transfer had written so far (on gloo and a small buffer,
    usually everything: the bug hides). `waited` says whether wait() was called, and
    `released_first` whether the output's memory was released before it was.
    """

    def __init__(self, work, output):
        work.wait()
        self._work, self.output = work, output
        self._data = output.detach().clone()
        with torch.no_grad():
            output.fill_(float("nan") if output.is_floating_point() else -1)
        self.waited = False
        self.released_first = False

    def wait(self, *args, **kwargs):
        if not self.waited:
            self.waited = True
            if self.output.untyped_storage().nbytes() == 0:
                self.released_first = True  # the buffer was released while the transfer was "writing"
            else:
                with torch.no_grad():
                    self.output.copy_(self._data)
            self._data = None
        return True

    def is_completed(self):
        return self.waited

    def __getattr__(self, name):
        return getattr(self._work, name)


@contextlib.contextmanager
def lazy_transfers(obj, start="start_gather", table="gathering"):
    """Inside: each transfer `obj.<start>(key)` leaves in `obj.<table>[key]` as a tuple
    (work, output, ...) gets a `LazyWork` in place of its work. Yields {key: the LazyWork of the
    latest transfer started for that key}, to ask afterwards whether it was waited for."""
    started = {}
    original = getattr(obj, start)

    def start_lazily(key, *args, **kwargs):
        table_now = getattr(obj, table, None)
        before = table_now.get(key) if isinstance(table_now, dict) else None
        out = original(key, *args, **kwargs)
        table_now = getattr(obj, table, None)
        entry = table_now.get(key) if isinstance(table_now, dict) else None
        if (entry is not None and entry is not before and isinstance(entry, tuple) and len(entry) >= 2
                and hasattr(entry[0], "wait") and isinstance(entry[1], torch.Tensor)):
            started[key] = LazyWork(entry[0], entry[1])
            table_now[key] = (started[key], *entry[1:])
        return out

    setattr(obj, start, start_lazily)
    try:
        yield started
    finally:
        obj.__dict__.pop(start, None)


# ---------------------------------------------------------------------------------------
# old names of checks, kept for a term


def renamed_args(**renamed):
    """A check that also takes its keyword arguments' old names (old="new", e.g. kind="model")."""
    def wrap(check):
        @functools.wraps(check)
        def with_old_names(*args, **kwargs):
            __tracebackhide__ = True
            for was, now in renamed.items():
                if was in kwargs:
                    kwargs[now] = kwargs.pop(was)
            return check(*args, **kwargs)

        return with_old_names

    return wrap


def alias(check, old_name, **renamed):
    """`check` under the name a notebook released before the rename calls (with old keyword
    names translated, as renamed_args does)."""
    old = renamed_args(**renamed)(check)
    old.__name__ = old.__qualname__ = old_name
    old.__doc__ = f"The old name of {check.__name__} (kept for notebooks released before the rename)."
    return old


# ---------------------------------------------------------------------------------------
# a stretch exercise's cell (ungraded)


def try_stretch(check, obj, name):
    """Run `check(obj)` if the student defined `name` (obj not None) and print ✓ or the reason;
    never raise: the cell is not graded, so a skipped or unfinished stretch costs nothing."""
    if obj is None:
        print(f"· stretch not attempted: define {name} above and run this cell to have it checked "
              "(no points either way)")
        return False
    try:
        check(obj)
    except AssertionError as exc:  # CheckFailed, or an assertion before the ranks start
        print(f"✗ stretch: {str(exc).splitlines()[0]}")
        return False
    except Exception as exc:  # noqa: BLE001  (not graded: say what happened, never fail the cell)
        print(f"✗ stretch: {type(exc).__name__}: {exc}")
        return False
    return True
