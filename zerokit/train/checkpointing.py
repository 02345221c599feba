"""The job's checkpoints: which ones a resume may use, saving with the data position, retention,
and the refusal to start over a folder of them.

A checkpoint is a folder `step<k>` in --checkpoint-dir: zerokit.checkpoint's shards and its
COMPLETE marker (written last, and the folder renamed into place whole), then this script's
train.json, the data position (the step, what the step's samples depend on, the loss scale
and the losses so far), written by rank 0 to a temporary file and renamed over `train.json`,
so that it is whole or absent. A folder that lacks either part, or whose train.json cannot be
read, is incomplete: a resume passes over it for the one before, and says so.

What stands in the folder is decided once, on rank 0, and broadcast: every rank resumes from
the same checkpoint, and a rank never reads a folder rank 0 is deleting.
"""

import json
import os
import re
import shutil
from pathlib import Path

import torch.distributed as dist

from zerokit.checkpoint.files import agree

from .options import DATA_KEYS

KILL_ENV = "ZEROKIT_TRAIN_KILL_AT"
TRAIN_JSON = "train.json"
# what a save or a deletion leaves beside step<k> while it runs (zerokit.checkpoint's .partial and .old)
LEFTOVER = re.compile(r"step(\d+)\.(partial|old|deleting)")


def _complete(path):
    return (path / "COMPLETE").exists() or any((part / "COMPLETE").exists() for part in path.glob("*/"))


def scan(directory):
    """([(step, folder, train.json's contents)] usable, oldest first; [(folder, why it is not)]) of
    the `step<k>` folders in `directory`. Not `step<k>.partial` (a save that did not finish) nor
    `step<k>.old` (one a newer save of that step is replacing): those are no checkpoints at all."""
    usable, incomplete = [], []
    for path in Path(directory).glob("step*"):
        m = re.fullmatch(r"step(\d+)", path.name)
        if m is None or not path.is_dir():
            continue
        step = int(m.group(1))
        if not _complete(path):
            incomplete.append((step, path, "no COMPLETE marker (a save that did not finish)"))
            continue
        try:
            saved = json.loads((path / TRAIN_JSON).read_text())
        except FileNotFoundError:
            incomplete.append((step, path, f"no {TRAIN_JSON} (killed between the save and its data position)"))
            continue
        except (OSError, ValueError) as exc:  # empty, truncated, not JSON, not UTF-8
            why = str(exc).splitlines()[0] if str(exc) else "empty"
            incomplete.append((step, path, f"its {TRAIN_JSON} cannot be read ({type(exc).__name__}: {why})"))
            continue
        if not isinstance(saved, dict) or not isinstance(saved.get("step"), int):
            incomplete.append((step, path, f"its {TRAIN_JSON} records no step"))
            continue
        usable.append((step, path, saved))
    return sorted(usable, key=lambda u: u[0]), [(p, why) for _, p, why in sorted(incomplete, key=lambda u: u[0])]


def checkpoints(directory):
    """The usable checkpoints in `directory`, oldest first: `step<k>` folders with zerokit.checkpoint's
    COMPLETE marker and a readable train.json that records the step (the data position, written just
    after the save: a job killed between the two left a checkpoint it cannot place in the data)."""
    return [path for _, path, _ in scan(directory)[0]]


def last_checkpoint(directory):
    done = checkpoints(directory)
    return done[-1] if done else None


def existing(directory):
    """Every folder a save or a deletion of this script leaves in `directory`: step<k>, complete or not,
    and the leftovers beside them (step<k>.partial, .old, .deleting), oldest first."""
    found = [p for p in Path(directory).glob("step*")
             if p.is_dir() and (re.fullmatch(r"step\d+", p.name) or LEFTOVER.fullmatch(p.name))]
    return sorted(found, key=lambda p: (int(re.match(r"step(\d+)", p.name).group(1)), p.name))


def delete(path):
    """Remove a checkpoint folder: first renamed out of the way (atomic), then removed. A kill in
    the middle leaves `step<k>.deleting`, which no resume reads, never a half-deleted step<k>."""
    path = Path(path)
    m = re.match(r"step(\d+)", path.name)
    doomed = path.with_name(f"step{m.group(1)}.deleting") if m and not path.name.endswith(".deleting") else path
    if doomed != path:
        shutil.rmtree(doomed, ignore_errors=True)
        os.rename(path, doomed)
    shutil.rmtree(doomed)


def _names(paths):
    names = [p.name for p in paths]
    return ", ".join(names) if len(names) <= 4 else f"{names[0]}, {names[1]} ... {names[-1]} ({len(names)} folders)"


def _decide(args, restarts):
    """Rank 0's reading of --checkpoint-dir: (the checkpoint to resume from with its train.json, or
    None; the lines to print; an error message or None; the folders --overwrite deletes)."""
    directory = args.checkpoint_dir
    if not args.resume:
        found = existing(directory) if (args.checkpoint_every or restarts) else []
        if not found:
            return None, ["no --resume: starting again at step 0"] if restarts else [], None, []
        if args.overwrite:
            return None, [f"--overwrite: deleting {_names(found)} in {directory}, starting at step 0"], None, found
        who = f"torchrun restarted this job (restart {restarts}) but it was" if restarts else "this job was"
        return None, [], (
            f"{who} launched without --resume: it would start again at step 0 and overwrite the checkpoints of "
            f"another run in {directory} ({_names(found)}), leaving a folder that mixes two runs. Go on from them "
            f"with --resume, save to a new --checkpoint-dir, or delete them first with --overwrite"), []
    usable, incomplete = scan(directory)
    if not usable:
        said = [f"--resume: no complete checkpoint in {directory}, starting at step 0"]
        return None, said + [f"--resume: passed over {p.name}: {why}" for p, why in incomplete], None, []
    step, path, saved = usable[-1]
    said = [f"--resume: passed over {p.name}, newer than {path.name}: {why}"
            for p, why in incomplete if int(p.name[4:]) > step]
    return (path, saved), said, None, []


def resume(args, model, opt, text_sum, world_size, restarts, scaler=None):
    """(step to start at, the losses of the steps before it, what to tell the user: lines).

    Under --resume the last complete checkpoint is loaded into model and opt (a collective) when
    there is one; otherwise the run starts at 0. Rank 0 reads the folder and every rank follows
    its verdict: a launch without --resume over existing checkpoints is refused on every rank,
    and --overwrite's deletions are done (by rank 0) before any rank goes on."""
    import zerokit.checkpoint
    from .build import parts

    verdict = [None]
    if dist.get_rank() == 0:
        try:
            verdict = [_decide(args, restarts)]
        except Exception as exc:  # noqa: BLE001 (every rank raises it, or the others would wait for rank 0)
            verdict = [(None, [], f"reading {args.checkpoint_dir} failed on rank 0: {type(exc).__name__}: {exc}", [])]
    dist.broadcast_object_list(verdict, src=0)
    found, said, refusal, doomed = verdict[0]
    if refusal:
        raise RuntimeError(refusal)
    if doomed:  # --overwrite: rank 0 deletes, and no rank goes on before it is done (or failed)
        agree(f"--overwrite in {args.checkpoint_dir}", lambda: [delete(p) for p in doomed] if dist.get_rank() == 0
              else None)
    if found is None:
        return 0, {}, said
    path, saved = found
    for key in DATA_KEYS:  # the data stream must be the one saved
        if saved.get(key) != getattr(args, key):
            raise ValueError(f"{path} was saved with --{key.replace('_', '-')} {saved.get(key)}, this run has "
                             f"{getattr(args, key)}: its data position would not mean the same samples")
    if saved.get("text_crc32", text_sum) != text_sum:
        raise ValueError(f"{path} was saved on another training text (CRC-32 {saved['text_crc32']:08x}, this "
                         f"one {text_sum:08x}: another Python's standard library?), so its data position would "
                         f"not mean the same samples")
    if saved["step"] > args.steps:
        raise ValueError(f"{path} is at step {saved['step']}, past --steps {args.steps}: give --steps "
                         f"{saved['step']} or more to go on from it")
    for folder, part in parts(opt):
        zerokit.checkpoint.load(path / folder, model, part)
    if scaler is not None and saved.get("loss_scaling"):
        scaler.load(saved["loss_scaling"])
    losses = {int(k): v for k, v in (saved.get("losses") or {}).items() if int(k) <= saved["step"]}
    said.append(f"resumed from {path} at step {saved['step']} (saved on N = {saved.get('world_size', '?')}, "
                f"running on N = {world_size})")
    return saved["step"], losses, said


def write_json_atomic(path, obj):
    """`obj` as JSON at `path`, whole or not at all: written and synced under a temporary name,
    then renamed over `path` (a rename within a folder is atomic), and the folder synced."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(args, model, opt, step, rank, world_size, text_sum, scaler=None, losses=None):
    """Save the state after `step` steps to --checkpoint-dir/step<step> (every rank), then its
    train.json (rank 0), then --keep's deletions (rank 0); every rank leaves together."""
    import zerokit.checkpoint
    from .build import parts

    path = args.checkpoint_dir / f"step{step}"
    for folder, part in parts(opt):
        zerokit.checkpoint.save(path / folder, model, part)
    position = {"step": step, "world_size": world_size, "text_crc32": text_sum,
                "loss_scaling": scaler.state() if scaler else None, **{k: getattr(args, k) for k in DATA_KEYS},
                # the curve so far, a resumed attempt's earlier steps included: --out draws the whole job
                "losses": {str(k): v for k, v in sorted((losses or {}).items())}}

    def finish():  # rank 0: the data position, beside the weights and optimizer state (see scan()); then --keep
        if rank == 0:
            write_json_atomic(path / TRAIN_JSON, position)
            if args.keep:
                retire(args.checkpoint_dir, args.keep, newest=step)

    # a collective: every rank leaves once rank 0 is done, and raises with it if it failed (none waits forever)
    agree(f"saving {path}", finish)


def retire(directory, keep, newest):
    """--keep: delete every complete checkpoint but the `keep` newest, and the incomplete folders and
    leftovers older than the newest complete one. Called by rank 0 once step<newest> is complete
    (its train.json written), so the checkpoint a resume would use is never among them; a kill in
    the middle leaves step<k>.deleting folders (passed over, removed by the next call) and never
    fewer than one complete checkpoint."""
    usable, incomplete = scan(directory)
    if not usable or usable[-1][0] != newest:  # another job writing here? then deleting anything is a guess
        raise RuntimeError(f"--keep: step{newest} in {directory} is not the newest complete checkpoint after its "
                           f"save ({_names([p for _, p, _ in usable]) or 'none is'}); nothing deleted")
    doomed = [path for _, path, _ in usable[:-keep]]
    doomed += [path for path, _ in incomplete if int(path.name[4:]) < newest]
    doomed += [p for p in existing(directory) if LEFTOVER.fullmatch(p.name)
               and int(LEFTOVER.fullmatch(p.name).group(1)) < newest]
    for path in doomed:
        delete(path)
    return doomed


def kill_point(rank, restarts):
    """The step after which this rank SIGKILLs itself (ZEROKIT_TRAIN_KILL_AT=STEP:RANK), or None.
    Only on a job's first attempt: a relaunched job killed at the same step again would use up
    every restart torchrun has and never finish."""
    spec = os.environ.get(KILL_ENV, "").strip()
    if not spec:
        return None
    m = re.fullmatch(r"(\d+):(\d+)", spec)
    if m is None:
        raise ValueError(f"{KILL_ENV}={spec!r}: expected STEP:RANK, for example 3:1")
    step, who = map(int, m.groups())
    return step if who == rank and restarts == 0 else None
