"""A model too large for one rank, built from a full checkpoint unit by unit (lesson 07).

    with torch.device("meta"):
        model = Net()                                   # no memory at all
    zerokit.checkpoint.placeholders(model)              # CPU stand-ins: one number per tensor
    opt = zerokit.ZeRO3Adam(model, lr=1e-4)             # allocates this rank's shards, nothing full
    zerokit.checkpoint.stream_load("full.pt", model, opt)   # unit by unit, each rank its own pieces

A meta-device parameter cannot be given real data in place (PyTorch refuses to set a CPU
tensor into a meta parameter), and replacing the parameter objects would leave every
reference ZeRO-3 keeps to them (param groups, buckets, hooks) pointing at the old ones. So
the meta model gets placeholders first: CPU tensors of the right shape that hold one number
(a 0-d zero expanded, stride 0). ZeRO3Adam cuts them into zero-filled shards without ever
copying them whole (a shard is filled through a stride-0 view), and skips broadcasting them.
Then stream_load fills each unit's shards from the file.
"""

import torch
from torch import nn

from ..zero3 import ZeRO3Adam
from .files import agree
from .state import parameter_names, replicated, trained_shapes

__all__ = ["placeholders", "stream_load"]


def placeholders(model):
    """Give a model built on the meta device CPU placeholders: every parameter and buffer becomes a
    tensor of its shape and dtype that holds one number (a zero expanded), no memory. Then
    ZeRO3Adam(model) allocates this rank's shards only, and stream_load (or load) fills them."""
    made = {}
    for module in model.modules():
        for kind in ("_parameters", "_buffers"):
            tensors = getattr(module, kind)
            for name, t in list(tensors.items()):
                if t is None or not t.is_meta:
                    continue
                if t not in made:
                    empty = torch.zeros((), dtype=t.dtype).expand(t.shape)
                    made[t] = nn.Parameter(empty, requires_grad=t.requires_grad) if kind == "_parameters" else empty
                    made[t].zerokit_placeholder = True
                tensors[name] = made[t]
    return model


def stream_load(source, model, opt):
    """Fill a ZeRO-3 optimizer's shards from a full state_dict file (torch.save of consolidate()'s
    result, or any plain checkpoint of the model), one unit at a time: each rank maps the file,
    copies the pieces of one unit's parameters that its shard holds, and lets the mapping go
    before the next unit. No rank ever holds more than its shards and one unit's pieces.
    Adam's state starts afresh (m = v = 0, step 0); frozen parameters and buffers are read whole.
    A collective: every rank calls it."""
    if not isinstance(opt, ZeRO3Adam):
        raise TypeError(f"stream_load fills ZeRO-3's shards; {type(opt).__name__} holds whole parameters: use load()")
    names = parameter_names(model)

    def check():
        full = torch.load(source, mmap=True, weights_only=True, map_location="cpu")
        shapes = {p: shape for sh in opt.state_shards() for p, shape in zip(sh.bucket.params, sh.bucket.shapes)}
        want = {n: list(shapes.get(t, t.shape)) for n, t in model.state_dict(keep_vars=True).items()}
        wrong = sorted(n for n in want if n not in full or list(full[n].shape) != want[n])
        if wrong:
            raise ValueError(f"{source} lacks {wrong[:4]} or holds them in other shapes: "
                             f"{[list(full[n].shape) if n in full else None for n in wrong[:4]]} for {[want[n] for n in wrong[:4]]}")

    agree(f"cannot stream-load {source}", check)
    with torch.no_grad():
        for sh in opt.state_shards():  # ZeRO-3: one bucket per unit
            full = torch.load(source, mmap=True, weights_only=True, map_location="cpu")  # maps; reads nothing yet
            for s in sh.bucket.segments:
                piece = full[names[sh.bucket.params[s.index]]].reshape(-1)[s.param_lo:s.param_hi]
                sh.weights[s.shard_lo:s.shard_hi].copy_(piece)
            sh.exp_avg.zero_(), sh.exp_avg_sq.zero_()
            sh.steps[:] = [0] * len(sh.steps)
            for p in sh.bucket.params:
                p.__dict__.pop("zerokit_placeholder", None)  # it has its values now (in the shards)
            piece = full = None  # unmapped: the pages this unit touched leave the process
        full = torch.load(source, mmap=True, weights_only=True, map_location="cpu")
        for name, t in replicated(model, trained_shapes(model, opt)):
            if getattr(t, "zerokit_placeholder", False):
                t.data = full[name].to(t.dtype, copy=True)  # a copy: the mapping must not stay alive
                del t.zerokit_placeholder
            else:
                t.data.copy_(full[name])
        del full
    opt.loaded()
