"""The training text and its batches: bytes of the Python standard library's own source.

The batch of step s is a function of (seed, s) alone, so every world size trains on the same
samples and a checkpoint's step is its data position."""

import sysconfig
import zlib
from pathlib import Path

import torch

def corpus(megabytes):
    """The training text as a uint8 tensor: stdlib .py files in sorted order, up to `megabytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    limit, chunks, size = int(megabytes * 2**20), [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data[:limit - size])
        size += len(chunks[-1])
        if size >= limit:
            break
    if size < 2**16:
        raise RuntimeError(f"only {size} bytes of Python source under {root}: too little to train on")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


def checksum(text):
    """CRC-32 of the training text: two Pythons' standard libraries differ, and a data position
    (a step) on one text is not the same samples on another."""
    return zlib.crc32(text.to(torch.uint8).numpy().tobytes())


def texts(args):
    """(training text, validation text: its last 5%, the whole text's checksum)."""
    text = corpus(args.data_mb)
    cut = int(len(text) * 0.95)
    return text[:cut], text[cut:], checksum(text)


def global_batch(text, step, batch, seq_len, seed):
    """(inputs, targets) of `step`, the same on every rank and at every world size."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(text) - seq_len - 1, (batch,), generator=g)
    rows = torch.stack([text[s:s + seq_len + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]
