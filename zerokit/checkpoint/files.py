"""The bytes of a checkpoint: files written without copies, read straight into place, renamed at once.

What zerokit.checkpoint (lesson 07) stands on, in three parts:

- **raw tensors.** A rank file is tensors end to end as raw bytes, nothing else: where a
  tensor lies follows from the metadata (sizes and order), so a reader can seek to any
  element of any shard and read just that (`read_into`), straight into the tensor that
  needs it. `write_tensors` hands the file a CPU tensor's own memory (no copy); a GPU
  tensor goes through a bounded staging buffer (CHUNK bytes). torch.save would not do:
  it writes a view's whole storage (ZeRO-1's shard is a view of the full flat buffer) and
  cannot be read in pieces.
- **atomic directories.** A save writes into `<path>.partial`, and only when every rank has
  written and synced its file does rank 0 write the COMPLETE marker and rename the directory
  to `<path>` (a rename is atomic). A save killed halfway leaves `<path>` as it was.
- **agreement.** Whatever a rank finds wrong (a missing file, another model), every rank must
  raise, or the others would wait forever in the next collective. `agree()` gathers each
  rank's verdict and raises the same one-line CheckpointError everywhere (CheckpointMismatch,
  also a ValueError, where the checkpoint is of another model or optimizer).
"""

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["CheckpointError", "CheckpointMismatch", "METADATA", "COMPLETE", "REPLICATED", "rank_file", "write_tensors",
           "read_into", "Reader", "write_json", "read_json", "partial_dir", "commit", "agree"]

METADATA, COMPLETE, REPLICATED = "metadata.json", "COMPLETE", "replicated.bin"
CHUNK = 1 << 22  # bytes: the most a copy between a GPU and the file holds at once


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message says why, in one line."""


class CheckpointMismatch(CheckpointError, ValueError):
    """The checkpoint is sound but not for this job: another model, another optimizer class or
    other optimizer state keys. A ValueError too, as the check that found it raised."""


def rank_file(rank):
    """The name of rank's file: rank00000.bin, rank00001.bin, ..."""
    return f"rank{rank:05d}.bin"


def _byte_view(t):
    """A contiguous CPU tensor's memory as a numpy uint8 array: the same bytes, no copy."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def write_tensors(path, tensors):
    """Write `tensors` (any dtypes, any devices) end to end as raw bytes into a new file; return its size.

    `tensors` may be a generator: each tensor is written and dropped before the next is made,
    so a caller that builds copies one at a time holds one at a time. The file is synced to
    disk before this returns.
    """
    written = 0
    with open(path, "wb") as f:
        for t in tensors:
            if t.device.type == "cpu" and t.is_contiguous():
                f.write(memoryview(_byte_view(t)))
            else:  # a GPU tensor (or a strided one): CHUNK bytes at a time through the CPU
                flat = t.detach().reshape(-1).contiguous().view(torch.uint8)
                for a in range(0, flat.numel(), CHUNK):
                    f.write(memoryview(flat[a:a + CHUNK].cpu().numpy()))
            written += t.numel() * t.element_size()
            del t  # before the generator makes the next one: one at a time
        f.flush()
        os.fsync(f.fileno())
    return written


def read_into(f, offset, dest):
    """Fill `dest` (a contiguous tensor) with the bytes at `offset` of the open binary file f."""
    f.seek(offset)
    if dest.device.type == "cpu":
        buf = memoryview(_byte_view(dest))
        _readinto(f, buf)
        return
    flat = dest.reshape(-1).view(torch.uint8)  # a GPU tensor: through a bounded CPU buffer
    for a in range(0, flat.numel(), CHUNK):
        part = torch.empty(min(CHUNK, flat.numel() - a), dtype=torch.uint8)
        _readinto(f, memoryview(part.numpy()))
        flat[a:a + part.numel()].copy_(part)


def _readinto(f, buf):
    done = 0
    while done < len(buf):
        n = f.readinto(buf[done:])
        if not n:
            raise CheckpointError(f"{f.name} ends early: {len(buf) - done} bytes missing at offset {f.tell()}")
        done += n


class Reader:
    """Open files of one checkpoint, each opened once: `reader.read(name, offset, dest)`."""

    def __init__(self, directory):
        self.directory, self.files = Path(directory), {}

    def read(self, name, offset, dest):
        if name not in self.files:
            self.files[name] = open(self.directory / name, "rb")
        read_into(self.files[name], offset, dest)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for f in self.files.values():
            f.close()
        return False


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_json(path):
    with open(path) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------
# a directory that appears whole or not at all


def partial_dir(path):
    """Where a save of `path` writes before it is complete: `<path>.partial`, beside it."""
    path = Path(path)
    return path.with_name(path.name + ".partial")


def commit(partial, path):
    """Mark `partial` complete and put it in place of `path` (rank 0 only, after every rank wrote).

    The marker is written and synced first, so a directory named `path` without it was never
    made by this function. Replacing an existing checkpoint takes two renames: the old one is
    moved aside, the new one moved in, the old one removed. Between the two a crash leaves the
    old checkpoint, whole, at `<path>.old`.
    """
    partial, path = Path(partial), Path(path)
    write_json(partial / COMPLETE, {"complete": True})
    _sync_dir(partial)
    old = path.with_name(path.name + ".old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(partial, path)
    _sync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def _sync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------
# every rank raises, or none does


def agree(what, fn, group=None):
    """fn() on every rank; if it raised on any rank, raise one CheckpointError on every rank.

    The message is `what: <reason>`, the reason of the lowest rank that failed (its rank named
    when the ranks disagree); a CheckpointMismatch where that reason was a ValueError. A
    collective: every rank must call it, also the ones that succeed.
    """
    result, reason = None, None
    try:
        result = fn()
    except CheckpointError as exc:
        reason = (str(exc), isinstance(exc, ValueError))
    except Exception as exc:  # noqa: BLE001 (any failure, or the other ranks would hang)
        why = f"{type(exc).__name__}: {exc}" if str(exc) else f"{type(exc).__name__} (with no message)"
        reason = (why, isinstance(exc, ValueError))  # a ValueError: a mismatch (CheckpointMismatch)
    reasons = [reason]
    if dist.is_initialized():
        reasons = [None] * dist.get_world_size(group)
        dist.all_gather_object(reasons, reason, group=group)
    failed = [(r, why) for r, why in enumerate(reasons) if why is not None]
    if failed:
        rank, (why, mismatch) = failed[0]
        same = len(failed) == len(reasons) and len({w for _, w in failed}) == 1
        error = CheckpointMismatch if mismatch else CheckpointError
        raise error(f"{what}: {why}" + ("" if same or len(reasons) == 1 else f" (on rank {rank})"))
    return result
