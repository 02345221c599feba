r"""Checks for lesson 10 (the capstone): the training loop, assembled from the course's pieces.

    check_losses(loop, stage, world_size, ...)   the loss of each of the first steps of your loop, on
                                                 world_size ranks with gradient accumulation, against one
                                                 process training the same model on the whole global batch
                                                 (an independent loop: plain torch, no zerokit wrapper),
                                                 within 1e-5 relative per step
    check_data(loop, stage, world_size, ...)     which sequences each rank's model ran on: its own slice of
                                                 each step's global batch, in cfg.accum micro-batches, every
                                                 sequence of the step once across the ranks
    check_resume(loop, stage, world_size, ...)   a run checkpointed every k steps and killed (an exception
                                                 raised on every rank as the step after `stop` begins),
                                                 resumed from its last checkpoint on another world size,
                                                 continues exactly where an uninterrupted run of the same
                                                 loop goes (within 1e-5 relative per step); each step<k>
                                                 saved after k optimizer steps, and, rank 0 held 0.3 s in
                                                 each save, no rank going on before its train.json exists

The student's loop is `train_loop(rank, world_size, cfg, model, opt, text) -> {step: loss}`: cfg is
what `zerokit.train.parse_args` gives (batch, accum, seq_len, seed, steps, clip, checkpoint_every,
checkpoint_dir, resume, ...), model and opt are built by the check (a zerokit stage, as
`zerokit.train.build` builds them), text is the training text. It returns the mean loss of the
global batch of each step it trained, keyed by the number of steps done after it (1, 2, ...).

One bug costs one check. The losses cannot see which rank ran which sequences: every rank running
the whole batch gives the same mean gradient (N times the work), so check_data looks at the
sequences themselves. check_losses runs without checkpoints; check_resume compares the student's loop
with itself (uninterrupted against killed and resumed), so a loop that trains wrongly but resumes
exactly loses only check_losses; and check_resume names only what it measured: how many optimizer steps
were done at each save (zerokit.checkpoint.save and load are watched), whether the resumed run loaded,
which batch it began with, and, only when the resume is not exact, whether the loop run uninterrupted
gives the same losses on both world sizes. check_losses uses torch.optim.SGD (momentum) as well as AdamW:
Adam's update is blind to the gradient's scale (m / sqrt(v)), so a loss not divided by the number of
micro-batches trains AdamW the same to within 1e-6 and only an optimizer that reads the scale shows it.
"""

import contextlib
import json
import os
import shutil
import tempfile
import time
import types
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import train as zerokit_train
from .harness import CheckFailed, passed, run_on_ranks
from .kit import refusing

__all__ = ["check_losses", "check_data", "check_resume", "make_config", "build_stage"]

SITUATIONS = {
    "zero3": "check_losses: stage=3",  # FullyShard: DTensor parameters (their rows), gathered per block
    "n3": "check_losses: world_size=3",  # 12 sequences on 3 ranks in 2 micro-batches each
    "zero-grad-shard": "n/a: the loop hands the model's gradients to the optimizer whole; which shards are zero is "
                       "the stages' business (lessons 03-05), and a byte-level GPT uses every row it looks up anyway",
    "frozen": "n/a: the capstone's GPT trains every parameter; freezing is the optimizer's concern (lessons 01-05)",
    "tied": "n/a: the loop never touches parameters one by one; tied weights are the stages' concern (lessons 03-07)",
    "unused": "n/a: every parameter of the GPT takes part in every step; the loop calls the stage's step() as given",
    "tuple-output": "n/a: the model is the capstone's GPT, which returns one tensor of logits",
    "root-params": "n/a: the model and its FullyShard units are built by the check (zerokit.train.build's shape)",
    "eval-no-grad": "n/a: the loop only trains; the text sampled before and after training is given code",
    "subgroup": "n/a: the loop runs on the default process group, as a torchrun job does",
    "fp16-scale": "n/a: the graded loop runs in fp32 (bf16 is zerokit.train's --precision, with no loss scale)",
    "peak-memory": "n/a: the loop's memory is the stages' (measured beside theory in the lesson, graded in lessons "
                   "03-08); the loop adds one micro-batch of activations",
    "out-of-order": "n/a: the loop calls backward and step(); in which order gradients arrive is the stages' concern",
    "sits-out": "n/a: no layer of the GPT sits a step out",
}

# the checks' model and data: small enough for a check to take a second, big enough to learn
ARGS = ["--batch", "12", "--seq-len", "32", "--dim", "32", "--layers", "2", "--heads", "2", "--data-mb", "0.25",
        "--lr", "3e-3", "--weight-decay", "0.1", "--quiet", "--sample-bytes", "0"]
SGD = dict(lr=0.5, momentum=0.9)  # reads the gradient's scale (AdamW does not)
RTOL = 1e-5  # per step's loss, relative: fp32 summed in another order over the ranks and micro-batches
_TRAIN_TEXT = 0.95  # the first 95% of the corpus is the training text (zerokit.train)

_USED = ("your loop called zerokit.train's own {name}: the exercise is to write the loop from the pieces "
         "(zerokit.checkpoint.save / load, zerokit.train.last_checkpoint, global_batch, gradient_sync, clip_)")
NO_ZEROKIT_LOOP = [(zerokit_train, name, _USED.format(name=name)) for name in ("train", "resume", "save_checkpoint")]


def make_config(stage=3, accum=2, steps=4, clip=None, batch=12, checkpoint_every=0, checkpoint_dir=None,
                resume=False, seed=0):
    """The cfg a check hands the student's loop: zerokit.train.parse_args's namespace."""
    argv = ARGS + ["--stage", str(stage), "--accum", str(accum), "--steps", str(steps), "--batch", str(batch),
                   "--seed", str(seed), "--checkpoint-every", str(checkpoint_every)]
    if clip is not None:
        argv += ["--clip", str(clip)]
    if checkpoint_dir is not None:
        argv += ["--checkpoint-dir", str(checkpoint_dir)]
    if resume:
        argv.append("--resume")
    return zerokit_train.parse_args(argv)


def _text(cfg):
    text = zerokit_train.corpus(cfg.data_mb)
    return text[:int(len(text) * _TRAIN_TEXT)]


def build_stage(cfg, world_size, optimizer="adamw"):
    """(model, opt) as zerokit.train.build makes them, with torch.optim.SGD instead of AdamW if asked."""
    if optimizer == "adamw":
        model, opt, _ = zerokit_train.build(cfg, world_size)
        return model, opt
    import zerokit
    from zerokit.models import TinyTransformer

    torch.manual_seed(cfg.seed)
    model = TinyTransformer(vocab=256, dim=cfg.dim, n_layers=cfg.layers, n_heads=cfg.heads, seq_len=cfg.seq_len)
    if cfg.stage == 0:
        model = zerokit.DataParallel(model)
        return model, torch.optim.SGD(model.parameters(), **SGD)
    if cfg.stage in (1, 2):
        cls = zerokit.ZeRO1 if cfg.stage == 1 else zerokit.ZeRO2
        return model, cls(model.parameters(), torch.optim.SGD, **SGD)
    model = zerokit.FullyShard(model, units=list(model.blocks))
    return model, torch.optim.SGD(model.parameters(), **SGD)


def _run_loop(loop, rank, world_size, cfg, model, opt, text):
    with refusing(*NO_ZEROKIT_LOOP, everywhere=True):
        losses = loop(rank, world_size, cfg, model, opt, text)
    if not isinstance(losses, dict):
        raise AssertionError(f"your train_loop returned {type(losses).__name__}, not a dict {{step: loss}} (the mean "
                             "loss of each step's global batch, keyed by the number of steps done: 1, 2, ...)")
    try:
        return {int(k): float(v) for k, v in losses.items()}
    except (TypeError, ValueError):
        raise AssertionError("your train_loop's dict must map step numbers (int) to losses (float): got "
                             f"{list(losses.items())[:2]}") from None


def _close(a, b):
    return abs(a - b) <= RTOL * max(abs(b), 1e-12)


# ---------------------------------------------------------------------------------------
# the reference: one process, plain torch, the whole global batch


def _reference_case(_rank, _one, cfg, optimizer, world_size):
    """{variant: {step: loss}}: the right loop, and the loops of common mistakes (for the reason only):
    "sum" the micro-batch losses not divided by cfg.accum, "last" only the last micro-batch's gradient
    kept (zero_grad between micro-batches), "unclipped" no clipping, "rank_norm" each rank's gradient
    clipped by its own norm before the ranks' are averaged (torch.nn.utils.clip_grad_norm_ on a
    ZeRO-1 rank's unreduced .grad). And each rank's share of step 1's loss (a loss reported before
    the all-reduce)."""
    from zerokit.models import TinyTransformer

    text = _text(cfg)
    per_rank = cfg.batch // world_size
    out = {}
    variants = ["right", "sum", "last"] + (["unclipped", "rank_norm"] if cfg.clip is not None else [])
    for variant in variants:
        torch.manual_seed(cfg.seed)
        model = TinyTransformer(vocab=256, dim=cfg.dim, n_layers=cfg.layers, n_heads=cfg.heads, seq_len=cfg.seq_len)
        opt = (torch.optim.SGD(model.parameters(), **SGD) if optimizer == "sgd" else
               torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=False))
        losses = {}
        for step in range(cfg.steps):
            x, y = zerokit_train.global_batch(text, step, cfg.batch, cfg.seq_len, cfg.seed)
            loss = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
            losses[step + 1] = float(loss.detach())
            if variant == "sum":
                (loss * cfg.accum).backward()
            elif variant == "rank_norm":
                clipped = []
                for r in range(world_size):
                    rows = slice(r * per_rank, (r + 1) * per_rank)
                    model.zero_grad()
                    F.cross_entropy(model(x[rows]).reshape(-1, 256), y[rows].reshape(-1)).backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)  # this rank's norm alone
                    clipped.append([p.grad.clone() for p in model.parameters()])
                for p, *grads in zip(model.parameters(), *clipped):
                    p.grad = sum(grads) / world_size
            elif variant == "last":
                parts = []
                for r in range(world_size):
                    rows = slice(r * per_rank, (r + 1) * per_rank)
                    xs, ys = x[rows][cfg.accum - 1::cfg.accum], y[rows][cfg.accum - 1::cfg.accum]
                    parts.append(F.cross_entropy(model(xs).reshape(-1, 256), ys.reshape(-1)))
                (sum(parts) / (world_size * cfg.accum)).backward()
            else:
                loss.backward()
            if cfg.clip is not None and variant not in ("unclipped", "rank_norm"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
            opt.step()
            opt.zero_grad()
        out[variant] = losses
        if variant == "right":
            torch.manual_seed(cfg.seed)
            fresh = TinyTransformer(vocab=256, dim=cfg.dim, n_layers=cfg.layers, n_heads=cfg.heads,
                                    seq_len=cfg.seq_len)
            x, y = zerokit_train.global_batch(text, 0, cfg.batch, cfg.seq_len, cfg.seed)
            with torch.no_grad():
                out["shares"] = [float(F.cross_entropy(fresh(x[r * per_rank:(r + 1) * per_rank]).reshape(-1, 256),
                                                       y[r * per_rank:(r + 1) * per_rank].reshape(-1)))
                                 for r in range(world_size)]
    return out


def _reference(cfg, optimizer, world_size, timeout):
    return run_on_ranks(_reference_case, 1, args=(cfg, optimizer, world_size), timeout=timeout, forbid_adam=False,
                        what="the reference (one process, torch's optimizer, the whole batch)")[0]


# ---------------------------------------------------------------------------------------
# losses: the first steps against the reference


def _losses_case(rank, world_size, loop, cfg, optimizer):
    model, opt = build_stage(cfg, world_size, optimizer)
    return _run_loop(loop, rank, world_size, cfg, model, opt, _text(cfg))


def _setting(cfg, world_size, optimizer):
    return (f"stage {cfg.stage}, N = {world_size}, {cfg.batch} sequences per step in {cfg.accum} micro-batches per "
            f"rank, {'torch.optim.SGD (momentum)' if optimizer == 'sgd' else 'torch.optim.AdamW'}"
            + (f", clip {cfg.clip:g}" if cfg.clip is not None else ""))


def _steps_problem(got, steps, start=0):
    want = list(range(start + 1, steps + 1))
    if sorted(got) != want:
        return (f"your train_loop returned losses for steps {sorted(got)[:12]}; expected one per step trained, keyed "
                f"{want[0]}..{want[-1]} (the number of steps done after it)")
    return None


def check_losses(loop, stage=3, world_size=2, steps=4, accum=2, optimizer="sgd", clip=None, batch=12, timeout=60.0):
    """The first `steps` losses of loop on world_size ranks (the stage's zerokit wrapper, `accum`
    micro-batches per rank, fp32) equal one process's on the whole global batch, within 1e-5 relative."""
    __tracebackhide__ = True
    if not callable(loop):
        raise CheckFailed(f"expected your function train_loop(rank, world_size, cfg, model, opt, text), got "
                          f"{type(loop).__name__}")
    cfg = make_config(stage=stage, accum=accum, steps=steps, clip=clip, batch=batch)
    ref = _reference(cfg, optimizer, world_size, timeout)
    results = run_on_ranks(_losses_case, world_size, args=(loop, cfg, optimizer), timeout=timeout,
                           forbid_adam=False, what="your train_loop")
    setting = _setting(cfg, world_size, optimizer)
    want = ref["right"]
    for rank, got in enumerate(results):
        problem = _steps_problem(got, steps)
        if problem:
            raise CheckFailed(f"rank {rank}: {problem}")
        if not _close(got[1], want[1]):
            share = ref["shares"][rank]
            why = (f"it is rank {rank}'s share of the batch ({share:.6f}): all-reduce the loss (a sum) and divide by N "
                   "for the mean of the global batch" if _close(got[1], share) else
                   "step 1's loss comes before any update: is it the mean cross-entropy of the step's global batch "
                   "(zerokit.train.global_batch of step 0), averaged over the micro-batches and the ranks?")
            raise CheckFailed(f"rank {rank} reports a loss of {got[1]:.6f} for step 1, one process on the whole batch "
                              f"{want[1]:.6f} ({setting}): {why}")
        wrong = [k for k in range(1, steps + 1) if not _close(got[k], want[k])]
        if wrong:
            k = wrong[0]
            off = abs(got[k] - want[k]) / abs(want[k])
            what = (f"step {k}'s loss is {got[k]:.6f}, one process training on the whole batch gives {want[k]:.6f} "
                    f"(relative difference {off:.1e}, tolerance {RTOL:g}; {setting})")
            if all(_close(got[j], ref["sum"][j]) for j in range(1, steps + 1)):
                why = (f"your gradient is {cfg.accum} x too large: each micro-batch's loss must be divided by "
                       f"cfg.accum = {cfg.accum} before backward, so that the gradients the micro-batches add up "
                       "are the mean over the rank's slice (AdamW hides it, SGD does not)")
            elif all(_close(got[j], ref["last"][j]) for j in range(1, steps + 1)):
                why = ("only the last micro-batch's gradient reached the optimizer: gradients add up across "
                       "backward calls, so clear them after the optimizer step, not between micro-batches")
            elif "unclipped" in ref and all(_close(got[j], ref["unclipped"][j]) for j in range(1, steps + 1)):
                why = (f"the optimizer stepped on unclipped gradients: with cfg.clip = {cfg.clip:g} the gradient's "
                       "global norm is scaled to it before every optimizer step (clip_(cfg, model, opt))"
                       + (". At stage 2 the parameters hold no .grad after backward (ZeRO-2 keeps only its reduced "
                          "shard), so torch.nn.utils.clip_grad_norm_ on model.parameters() finds nothing to clip"
                          if stage == 2 else ""))
            elif "rank_norm" in ref and all(_close(got[j], ref["rank_norm"][j]) for j in range(1, steps + 1)):
                why = ("each rank's gradient was clipped by its own norm before the ranks' gradients were averaged "
                       "(torch.nn.utils.clip_grad_norm_ on model.parameters(): at stage 1 .grad holds this rank's "
                       "gradient, not yet reduced): clipping scales the mean gradient of the whole batch by one "
                       "number, from its global norm, the same on every rank. clip_(cfg, model, opt) computes it "
                       "for each stage (torch's clip gives it only where .grad is the mean gradient: whole under "
                       "DataParallel, FullyShard's DTensor rows at stage 3)")
            else:
                why = ("is each step's gradient the mean over the global batch (each rank its slice, each micro-batch's "
                       "loss divided by cfg.accum), cleared after each optimizer step, clipped when cfg.clip is set, "
                       "with one optimizer step per step?")
            raise CheckFailed(f"rank {rank}: {what}: {why}")
    shown = ", ".join(f"{want[k]:.4f}" for k in range(1, steps + 1))
    passed(f"your train_loop's first {steps} losses ({shown}) match one process on the whole batch within "
           f"{RTOL:g} ({setting})")


# ---------------------------------------------------------------------------------------
# data: which sequences each rank ran


def _data_case(rank, world_size, loop, cfg):
    model, opt = build_stage(cfg, world_size, "sgd")
    seen = []

    def record(_module, args, kwargs):
        x = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(x, torch.Tensor):
            seen.append(x.detach().clone())

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        _run_loop(loop, rank, world_size, cfg, model, opt, _text(cfg))
    finally:
        handle.remove()
    everyone = [None] * world_size
    dist.all_gather_object(everyone, seen)
    return everyone if rank == 0 else None


def _rows(t):
    return [tuple(r) for r in t.reshape(-1, t.shape[-1]).tolist()]


def check_data(loop, stage=1, world_size=2, steps=2, accum=2, batch=12, timeout=60.0):
    """Each rank runs its model on cfg.accum micro-batches per step, of batch / (N * accum) sequences each,
    and the ranks' sequences of a step are the step's global batch, each once: data parallel's split."""
    __tracebackhide__ = True
    if not callable(loop):
        raise CheckFailed(f"expected your function train_loop(rank, world_size, cfg, model, opt, text), got "
                          f"{type(loop).__name__}")
    cfg = make_config(stage=stage, accum=accum, steps=steps, batch=batch)
    seen = run_on_ranks(_data_case, world_size, args=(loop, cfg), timeout=timeout, forbid_adam=False,
                        what="your train_loop")[0]
    text = _text(cfg)
    micro = batch // (world_size * accum)
    for rank, calls in enumerate(seen):
        if len(calls) != steps * accum:
            raise CheckFailed(f"rank {rank} ran the model {len(calls)} times in {steps} steps; with cfg.accum = {accum} "
                              f"micro-batches per step it runs {steps * accum} forwards (and as many backwards)")
        sizes = sorted({len(_rows(c)) for c in calls})
        if sizes != [micro]:
            whole = sizes == [batch // accum]
            why = (f"every rank took the whole global batch of {batch} sequences: the mean gradient is the same (so "
                   f"the losses cannot show it), but every rank does {world_size} x the work. Rank r takes rows "
                   f"r·B/N to (r + 1)·B/N of the step's batch" if whole else
                   f"each rank takes its {batch // world_size} of the step's {batch} sequences (B / N) and cuts them "
                   f"into cfg.accum = {accum} micro-batches")
            raise CheckFailed(f"rank {rank}'s micro-batches hold {', '.join(map(str, sizes))} sequences; expected "
                              f"{micro} (batch {batch}, N = {world_size}, accum {accum}): {why}")
    for step in range(steps):
        x, _ = zerokit_train.global_batch(text, step, batch, cfg.seq_len, cfg.seed)
        want = Counter(_rows(x))
        got = Counter(row for calls in seen for c in calls[step * accum:(step + 1) * accum] for row in _rows(c))
        if got != want:
            extra, missing = sum((got - want).values()), sum((want - got).values())
            raise CheckFailed(f"step {step + 1}: the sequences the ranks ran are not the step's global batch once each "
                              f"({missing} of its {batch} sequences missing, {extra} run twice or not in it): the "
                              "batch of step s is global_batch(text, s, ...), and rank r takes its own slice of it, "
                              "the slices of the ranks not overlapping")
    passed(f"each of {world_size} ranks ran {accum} micro-batches of {micro} sequences per step, its own slice of the "
           f"step's global batch of {batch}: every sequence once across the ranks")


# ---------------------------------------------------------------------------------------
# resume: killed after step `stop`, resumed from the last checkpoint on another world size


class _JobKilled(BaseException):
    """The injected fault: raised on every rank at the same point, where no collective is in flight
    (a BaseException, so that a loop's `except Exception` cannot swallow it)."""


# While a resume check runs, zerokit.checkpoint's save and load report to the check: the code of each is
# swapped for _watched's (renamed), so a loop that took a reference to them earlier is watched too, as
# kit.refusing does; the swapped code runs with zerokit.checkpoint's globals, hence the absolute import
# (and a public name: that code reads lesson10.WATCHERS from another module).
WATCHERS = {}  # co_name -> the function that stands in for zerokit.checkpoint's one, in a rank's process
SLOW_RANK0 = 0.3  # s: rank 0 returns from each save this late, as on a busy disk (its metadata, replicated.bin)


def _watched(*args, **kwargs):
    import inspect as _inspect

    from zerokit.grading import lesson10 as _lesson10

    return _lesson10.WATCHERS[_inspect.currentframe().f_code.co_name](*args, **kwargs)


@contextlib.contextmanager
def _watching(**after):
    """Inside: zerokit.checkpoint.<name>(...) runs as before, then after[name](args, kwargs)."""
    import zerokit.checkpoint as ckpt

    swapped = []
    try:
        for name, then in after.items():
            fn = getattr(ckpt, name)
            original = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
            original.__kwdefaults__ = fn.__kwdefaults__

            def call(*args, _original=original, _then=then, **kwargs):
                out = _original(*args, **kwargs)
                _then(args, kwargs)
                return out

            key = f"_watched_{name}"
            WATCHERS[key] = call
            swapped.append((fn, fn.__code__, key))
            fn.__code__ = _watched.__code__.replace(co_name=key, co_qualname=key)
        yield
    finally:
        for fn, code, key in reversed(swapped):
            fn.__code__ = code
            WATCHERS.pop(key, None)


def _resume_case(rank, world_size, loop, cfg, kill_after=None):
    """What the loop did: {"losses", "done" (optimizer steps), "saves" [(folder, steps done when saved)],
    "loads" (calls of zerokit.checkpoint.load), "early" ((folder, what this rank did) if it went on before
    the folder's train.json existed, else None), "first" (the input of its first forward)}. Rank 0 returns
    from every save SLOW_RANK0 s late. With kill_after, the job dies at the first forward after kill_after
    optimizer steps (every rank at once: the start of the next step, before any of its collectives)."""
    model, opt = build_stage(cfg, world_size, "adamw")
    seen = {"losses": None, "done": 0, "saves": [], "loads": 0, "early": None, "first": None}
    pending = []  # the folder of the last save, until this rank has seen its train.json
    step = opt.step

    def counting_step(*args, **kwargs):
        seen["done"] += 1
        return step(*args, **kwargs)

    def saved(args, kwargs):
        path = Path(args[0] if args else kwargs["path"])
        seen["saves"].append((path.name, seen["done"]))
        pending[:] = [path]
        if rank == 0:
            time.sleep(SLOW_RANK0)

    def loaded(_args, _kwargs):
        seen["loads"] += 1

    def went_on(what):
        if pending and not (pending[0] / "train.json").exists() and seen["early"] is None:
            seen["early"] = (pending[0].name, what)
        pending.clear()

    def before_forward(_module, args):
        went_on(f"began step {seen['done'] + 1}")
        if seen["first"] is None and args and isinstance(args[0], torch.Tensor):
            seen["first"] = args[0].detach().clone()
        if kill_after is not None and seen["done"] >= kill_after:
            raise _JobKilled()

    opt.step = counting_step
    handle = model.register_forward_pre_hook(before_forward, prepend=True)  # before any hook that communicates
    try:
        with _watching(save=saved, load=loaded):
            seen["losses"] = _run_loop(loop, rank, world_size, cfg, model, opt, _text(cfg))
        went_on("returned from train_loop")
    except _JobKilled:
        pass
    finally:
        handle.remove()
    if kill_after is not None and seen["losses"] is not None:
        raise AssertionError(f"the job was to die at the first forward after {kill_after} optimizer steps, but your "
                             f"train_loop finished after {seen['done']} (cfg.steps = {cfg.steps}): one opt.step() per "
                             "step, from step 0 when there is no checkpoint to resume")
    return seen


def _saved(directory):
    """[(folder name, complete?, the step its train.json records or None)] of step<k> folders."""
    out = []
    for path in sorted(Path(directory).glob("step*")):
        step = None
        try:
            step = json.loads((path / "train.json").read_text()).get("step")
        except (OSError, ValueError, AttributeError):
            pass
        out.append((path.name, (path / "COMPLETE").exists(), step))
    return out


def check_resume(loop, stage=3, world_size=2, resume_world_size=1, every=3, stop=7, steps=9, accum=2, batch=12,
                 timeout=60.0):
    """A run of loop on world_size ranks saving every `every` steps (cfg.steps = steps) is killed as the step after
    `stop` begins (every rank raises in its first forward, before any collective of that step); resumed (cfg.resume)
    on resume_world_size ranks it must start after its last checkpoint and give, at every step to `steps`, the
    losses of an uninterrupted run of the same loop (within 1e-5 relative). AdamW, fp32. Each step<k> must be
    saved after k optimizer steps, and with rank 0 held SLOW_RANK0 s in each save, no rank may begin its next
    step, or return, before that checkpoint's train.json exists."""
    __tracebackhide__ = True
    if not callable(loop):
        raise CheckFailed(f"expected your function train_loop(rank, world_size, cfg, model, opt, text), got "
                          f"{type(loop).__name__}")
    root = Path(tempfile.mkdtemp(prefix="zerokit-lesson10-"))
    try:
        return _check_resume(loop, stage, world_size, resume_world_size, every, stop, steps, accum, batch, timeout,
                             root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _check_resume(loop, stage, world_size, resume_world_size, every, stop, steps, accum, batch, timeout, root):
    __tracebackhide__ = True
    last = stop - stop % every  # the last checkpoint before the job dies
    ckpt = root / "checkpoints"
    first = make_config(stage=stage, accum=accum, steps=steps, batch=batch, checkpoint_every=every,
                        checkpoint_dir=ckpt, resume=True)  # the first launch: nothing to resume yet
    dying = run_on_ranks(_resume_case, world_size, args=(loop, first, stop), timeout=timeout, forbid_adam=False,
                         what="your train_loop (the run that dies)")
    saved = _saved(ckpt)
    expected = [f"step{k}" for k in range(every, stop + 1, every)]
    names = [name for name, _, _ in saved]
    if not saved:
        raise CheckFailed(f"after {stop} steps with cfg.checkpoint_every = {every} there is no checkpoint in "
                          f"cfg.checkpoint_dir: save one every {every} steps, to cfg.checkpoint_dir / 'step<k>' "
                          "(k the steps done) with zerokit.checkpoint.save")
    if sorted(names, key=lambda n: (len(n), n)) != expected:
        raise CheckFailed(f"after {stop} steps with cfg.checkpoint_every = {every}, cfg.checkpoint_dir holds "
                          f"{', '.join(names)}; expected {', '.join(expected)} (step<k>: saved after k steps)")
    for name, complete, step in saved:
        if not complete:
            raise CheckFailed(f"{name} has no COMPLETE marker: was zerokit.checkpoint.save called on every rank?")
        if step is None:
            raise CheckFailed(f"{name} has no data position: write train.json beside the shards, {{\"step\": k}}, "
                              "on rank 0 after the save (zerokit.train.last_checkpoint skips a checkpoint without "
                              "it: a run that cannot place its weights in the data must not resume from them)")
        if f"step{step}" != name:
            raise CheckFailed(f"{name}/train.json records step {step}: the data position of a checkpoint saved after "
                              f"k steps is k, the step the resumed run starts at")
    for name, done in dying[0]["saves"]:
        k = int(name[4:]) if name.startswith("step") and name[4:].isdigit() else None
        if k is not None and done != k:
            raise CheckFailed(
                f"{name} was saved when your loop had made {done} optimizer step{'s' if done != 1 else ''}, not {k}: "
                f"it holds the weights and optimizer state {'before' if done < k else 'after'} the update of step "
                f"{min(done, k) + 1}, and a run resumed from it at step {k} would "
                f"{'never make that update' if done < k else 'make it twice'}. Save after opt.step()")
    _no_early_rank(dying, "the run that dies")
    resumed_cfg = make_config(stage=stage, accum=accum, steps=steps, batch=batch, checkpoint_every=every,
                              checkpoint_dir=ckpt, resume=True)
    again = run_on_ranks(_resume_case, resume_world_size, args=(loop, resumed_cfg), timeout=timeout,
                         forbid_adam=False, what=f"your train_loop (resumed on {resume_world_size} ranks)")
    resumed = again[0]["losses"]
    whole_cfg = make_config(stage=stage, accum=accum, steps=steps, batch=batch, checkpoint_dir=root / "none")
    whole = run_on_ranks(_resume_case, world_size, args=(loop, whole_cfg), timeout=timeout, forbid_adam=False,
                         what="your train_loop (the uninterrupted run)")[0]["losses"]
    where = (f"stage {stage}, killed after step {stop} on {world_size} ranks (checkpoints every {every} steps), "
             f"resumed on {resume_world_size}")
    if sorted(resumed) != list(range(last + 1, steps + 1)):
        began = min(resumed) - 1 if resumed else None
        if began == 0:
            why = (f"it started again at step 0: with cfg.resume set, load the last checkpoint (step{last}, "
                   "zerokit.train.last_checkpoint) and start at the step its train.json records")
        elif began is not None and began > last:
            why = (f"it started at step {began}, after the checkpoint's {last}: step{last} holds the state after "
                   f"{last} steps, so the next step to train is the one of index {last} (loop from {last}); "
                   f"{began - last} step{'s' if began - last > 1 else ''} of data skipped")
        else:
            why = f"expected steps {last + 1}..{steps}, from the last checkpoint (step{last}) to cfg.steps"
        raise CheckFailed(f"the resumed run ({where}) trained steps {sorted(resumed)[:12]}: {why}")
    _no_early_rank(again, f"the run resumed on {resume_world_size} rank{'s' if resume_world_size > 1 else ''}")
    wrong = [k for k in range(last + 1, steps + 1) if not _close(resumed[k], whole[k])]
    if wrong:
        k = wrong[0]
        off = abs(resumed[k] - whole[k]) / abs(whole[k])
        said = (f"step {k} of the resumed run ({where}) has loss {resumed[k]:.6f}, the uninterrupted run "
                f"{whole[k]:.6f} (relative difference {off:.1e}): resume is not exact")
        why = _why_not_exact(again[0], loop, stage, world_size, resume_world_size, steps, accum, batch, last, whole,
                             timeout, root)
        raise CheckFailed(f"{said}: {why}")
    passed(f"killed after step {stop} ({world_size} ranks, stage {stage}, a checkpoint every {every} steps) and resumed "
           f"on {resume_world_size}: steps {last + 1}-{steps} follow the uninterrupted run within {RTOL:g}; every rank "
           f"went on from a save only once its train.json existed (rank 0 held {SLOW_RANK0:g} s in each save)")


def _no_early_rank(results, run):
    """CheckFailed if a rank went on from a save (its next forward, or returning) before the train.json of
    that checkpoint existed."""
    __tracebackhide__ = True
    for rank, seen in enumerate(results):
        if seen["early"]:
            name, what = seen["early"]
            raise CheckFailed(
                f"in {run}, rank {rank} {what} while {name} had no train.json yet (the check held rank 0 "
                f"{SLOW_RANK0:g} s in its save, as a busy disk does): until rank 0 has written it the checkpoint "
                "is not usable (last_checkpoint skips it), and if the job dies then (a rank that went on fails, "
                f"and the launcher stops the others) {name} is lost though every rank saved it. After rank 0 has "
                "written train.json, every rank waits at a barrier (dist.barrier())")


def _why_not_exact(seen, loop, stage, world_size, resume_world_size, steps, accum, batch, last, whole, timeout, root):
    """What the check measured about a resumed run that does not follow the uninterrupted one: the first
    thing found wrong, or, when none is, what was found right."""
    __tracebackhide__ = True
    if not seen["loads"]:
        return (f"the resumed run never called zerokit.checkpoint.load, so it trained from step index {last} on "
                "with the weights it was built with: load the checkpoint into the model and the optimizer before "
                "the first step")
    cfg = make_config(stage=stage, accum=accum, steps=steps, batch=batch)
    x, _ = zerokit_train.global_batch(_text(cfg), last, batch, cfg.seq_len, cfg.seed)
    if seen["first"] is not None and not set(_rows(seen["first"])) <= set(_rows(x)):
        return (f"its first forward ran on sequences that are not in the batch of step index {last} "
                f"(global_batch(text, {last}, ...)), the first step after the checkpoint")
    other = make_config(stage=stage, accum=accum, steps=steps, batch=batch, checkpoint_dir=root / "none")
    there = run_on_ranks(_resume_case, resume_world_size, args=(loop, other), timeout=timeout, forbid_adam=False,
                         what=f"your train_loop (uninterrupted, on {resume_world_size} ranks)")[0]["losses"]
    differ = [k for k in sorted(whole) if k in there and not _close(there[k], whole[k])]
    if differ:
        k = differ[0]
        return (f"run uninterrupted, your loop's losses depend on the number of ranks: step {k} gives "
                f"{whole[k]:.6f} on {world_size} ranks and {there[k]:.6f} on {resume_world_size}, so no resume on "
                f"another world size can follow it (the losses and data tests say where a loop departs from the "
                "whole-batch reference)")
    return (f"what was measured right: step{last} was saved after {last} optimizer steps, the resumed run loaded "
            f"it and began with step index {last}'s batch, and uninterrupted your loop gives the same losses on "
            f"{world_size} and {resume_world_size} ranks. What differs is what the resumed run does between loading "
            "and its first step, or after")
