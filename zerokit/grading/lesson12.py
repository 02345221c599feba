r"""Checks for lesson 12 (FSDP2): the dim-0 shard and its DTensor, the all-gather's copies, the chunk-cat.

    check_dim0_chunk(dim0_chunk)                       start, length and padded rows of every rank as
                                                       torch.chunk cuts dim 0, for many R and N (ranks past
                                                       the rows hold none)
    check_shard_param(shard_param, world_size=3, ...)  each parameter of the fixture unit: its padded flat
                                                       storage (zero padding rows, ceil(R/N) rows), and an
                                                       nn.Parameter holding a DTensor Shard(0) of the full
                                                       shape whose local tensor equals torch's
                                                       distribute_tensor's and views that storage; dtype and
                                                       requires_grad kept; no communication; then a DCP
                                                       checkpoint of the unit sharded by it, loaded into
                                                       torch's fully_shard: every full tensor equal
    check_copy_in(all_gather_copy_in, world_size=3)    the all-gather's output of N x S elements in the
                                                       compute dtype, this rank's row (a view of it, at r x S)
                                                       holding the padded shards end to end, cast; a real
                                                       all-gather from that row fills every rank's row
    check_copy_out(all_gather_copy_out, world_size=3)  each parameter's gathered buffer: column block i of
                                                       every row, so its first R rows are the parameter; the
                                                       buffers written in place, autograd's version counters
                                                       left alone (a backward that saved the unsharded
                                                       parameter runs after backward's gather refilled it)
    check_chunk_cat(reduce_scatter_copy_in, ...)       the reduce-scatter's input: row r holds rank r's
                                                       padded rows of every gradient, end to end, in the
                                                       reduce dtype; a real reduce-scatter of it gives each
                                                       rank the mean of its rows
    check_shard_grads(shard_grads, world_size=3, ...)  one DTensor gradient per parameter, Shard(0) of its
                                                       full shape, whose local tensor is its real rows and a
                                                       view of the reduce-scatter's output at the padded
                                                       offset; full_tensor() is the mean gradient

The fixture unit (UNIT) is the situations a dim-0 cut meets at N = 3 and 4: a parameter whose rows 3 does
not divide (7 x 5), one with fewer rows than ranks (2 x 4: rank 2 holds none), a 1-D and a 3-D one, a
frozen one (4 x 3: at N = 3 its last rank holds none too), and in the hidden tests bf16 (stored, gathered
in, reduced from) and a process subgroup (a mesh over ranks 1 to 3 of 4).

One bug costs one check. Every check builds its own inputs from torch alone (torch.chunk, zero rows,
torch.cat, distribute_tensor, torch's own collectives, torch's fully_shard and DCP), never from zerokit's
fully_shard, whose functions raise inside the checks (the exercises are to write them). Where a student's
function calls their own dim0_chunk (shard_param, shard_grads), the check gives it zerokit's instead, so a
dim0_chunk bug costs check_dim0_chunk only; copy-in and copy-out are checked apart, each on inputs the
check built, and so are the chunk-cat and the shard gradients.
"""

import inspect
import math
import shutil
import tempfile

import torch
import torch.distributed as dist
from torch import nn

from ..comm import CommCounter, all_gather, reduce_scatter
from ..fully_shard import collectives as _collectives
from ..fully_shard import param as _param
from .compare import assert_close
from .harness import CheckFailed, passed, run_on_ranks
from .kit import intact, launch_size, refusing

__all__ = ["check_dim0_chunk", "check_shard_param", "check_copy_in", "check_copy_out", "check_chunk_cat",
           "check_shard_grads", "UNIT"]

_NO_HOOKS = ("n/a: lesson 12's exercises are functions of tensors; the hooks that meet units, their outputs and "
             "the order of forward and backward are zerokit.fully_shard's (state.py), not the student's")
SITUATIONS = {
    "n3": "check_shard_param: world_size=3",  # sizes that 3 does not divide, ranks that hold no rows
    "frozen": "check_shard_param",  # requires_grad kept False, sharded and checkpointed with the rest
    "subgroup": "check_shard_param: group_ranks=(1, 2, 3)",  # the mesh's rank and size, not the default group's
    "zero-grad-shard": "check_chunk_cat",  # a gradient of zeros, and shards of 0 rows, laid out like the rest
    "peak-memory": "n/a: lesson 12's memory rule is the copy-in's (the all-gather's input is a row of its output, no "
                   "second buffer), checked by storage in check_copy_in; a step's peak is zerokit.fully_shard's, "
                   "measured in the notebook, not the student's code",
    "zero3": "n/a: FSDP2 is ZeRO-3 only; the student's functions are its pieces and meet no other stage",
    "tied": "n/a: a parameter two modules share is one tensor, cut once; where it sits in the model is "
            "zerokit.fully_shard's bookkeeping (ShardedParam.places), not the student's",
    "unused": "n/a: a parameter without a gradient is left out of the reduce-scatter by zerokit.fully_shard's group; "
              "the student's functions see only the gradients that exist (the frozen parameter's case)",
    "fp16-scale": "n/a: lesson 12's copies cast to bf16 (hidden tests); no loss scale reaches them",
    "tuple-output": _NO_HOOKS,
    "root-params": _NO_HOOKS,
    "eval-no-grad": _NO_HOOKS,
    "sits-out": _NO_HOOKS,
    "out-of-order": _NO_HOOKS,
}

# (name, shape, requires_grad): at N = 3, 7 rows are 3, 3, 1; 2 rows 1, 1, 0; 10 rows 4, 4, 2; 5 rows 2, 2, 1;
# the frozen 4 rows 2, 2, 0
UNIT = (("weight", (7, 5), True), ("few_rows", (2, 4), True), ("bias", (10,), True), ("kernel", (5, 2, 3), True),
        ("frozen", (4, 3), False))
_ZERO_GRAD = "few_rows"  # its gradient is zeros on every rank (rows no sample used)
_REFUSED = "your code used zerokit.fully_shard's own {}: the exercise is to write it"


_REFERENCE_DIM0_CHUNK = intact(_param.dim0_chunk)  # taken when the checks are imported, before any student code


def _refusals():
    return refusing((_param, "dim0_chunk", _REFUSED.format("dim0_chunk")),
                    (_param, "shard_param", _REFUSED.format("shard_param")),
                    (_param.ShardedParam, "__init__", _REFUSED.format("ShardedParam")),
                    (_collectives, "all_gather_copy_in", _REFUSED.format("all_gather_copy_in")),
                    (_collectives, "all_gather_copy_out", _REFUSED.format("all_gather_copy_out")),
                    (_collectives, "reduce_scatter_copy_in", _REFUSED.format("reduce_scatter_copy_in")),
                    (_collectives, "shard_grads", _REFUSED.format("shard_grads")),
                    everywhere=True)


def _with_reference_dim0_chunk(fn):
    """The student's function, calling zerokit's dim0_chunk where it calls one by that name (so that a bug in
    their own dim0_chunk costs check_dim0_chunk, not this check too)."""
    inner = inspect.unwrap(fn)
    names = getattr(getattr(inner, "__code__", None), "co_names", ())
    g = getattr(inner, "__globals__", None)
    if isinstance(g, dict) and "dim0_chunk" in names:
        g["dim0_chunk"] = _REFERENCE_DIM0_CHUNK
    return fn


def _callable(fn, name):
    if not callable(fn):
        raise CheckFailed(f"expected your function {name}, got {type(fn).__name__}")


# ---------------------------------------------------------------------------------------
# the fixture, built from torch alone


def _full(index, shape, dtype, seed=0):
    """Parameter `index` of the unit, the same on every rank: distinct values, exact in bf16 too."""
    g = torch.Generator().manual_seed(1000 * seed + index)
    return torch.randint(-120, 120, shape, generator=g).to(dtype) / 8


def _grad(index, shape, rank, dtype):
    """This rank's full local gradient of parameter `index` (its own data: different on every rank)."""
    g = torch.Generator().manual_seed(7919 * (rank + 1) + index)
    return (torch.randint(-120, 120, shape, generator=g).to(torch.float32) / 16).to(dtype)


def _rows(shape):
    return math.prod(shape[1:])


def _chunk(t, world_size, rank):
    """torch.chunk's piece `rank` of t's dim 0 (empty past the last piece): the reference cut."""
    pieces = torch.chunk(t, world_size, dim=0)
    return pieces[rank] if rank < len(pieces) else t[t.size(0):]


def _padded_shard(t, world_size, rank):
    """This rank's rows of t, padded with zero rows to ceil(R / N), flat."""
    c = -(-t.size(0) // world_size)
    out = torch.zeros(c, *t.shape[1:], dtype=t.dtype)
    piece = _chunk(t, world_size, rank)
    out[:piece.size(0)] = piece
    return out.reshape(-1)


def _layouts(rows, world_size):
    """[(start, length, c)] of every rank for a dim 0 of `rows`, read off torch.chunk's pieces."""
    c = -(-rows // world_size)
    lengths = [t.size(0) for t in torch.chunk(torch.empty(rows, 0), world_size, dim=0)]
    lengths += [0] * (world_size - len(lengths))
    return [(min(r * c, rows), lengths[r], c) for r in range(world_size)]


def _layout(shape, world_size, rank):
    """(start, length, c) of `rank`, read off torch.chunk."""
    return _layouts(shape[0], world_size)[rank]


def _unit(world_size, dtype, seed=0):
    return [(name, _full(i, shape, dtype, seed), rg) for i, (name, shape, rg) in enumerate(UNIT)]


def _mesh(group_ranks, world_size):
    """(this rank's place in the mesh or None, the mesh): a 1-D DeviceMesh over the job's ranks."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = list(group_ranks) if group_ranks is not None else list(range(world_size))
    mesh = DeviceMesh("cpu", ranks)  # every rank of the launch takes part in making it
    if dist.get_rank() not in ranks:
        return None, mesh
    return mesh.get_local_rank(), mesh


def _where(group_ranks):
    return "" if group_ranks is None else f" (a mesh over global ranks {tuple(group_ranks)}, a process subgroup)"


def _default_group_hint(shape, place, world_size, got_rows=None, got_padded=None):
    """': ... the default group's rank and size ...' where the mesh is a subgroup and what came out is what
    the default group's rank and size would give; else ''."""
    rank, size = dist.get_rank(), dist.get_world_size()
    if (rank, size) == (place, world_size):
        return ""
    start, length, c = _layout(tuple(shape), size, rank)
    if (got_rows is not None and got_rows == length) or (got_padded is not None and got_padded == c):
        return (f": that is the cut for rank {rank} of {size}, the default group's; the mesh spans a subgroup, where "
                f"this rank is {place} of {world_size}: read both from the mesh (mesh.get_local_rank(), mesh.size())")
    return ""


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def _is_view_of(t, base):
    return isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


# ---------------------------------------------------------------------------------------
# exercise 1a: dim0_chunk


_ROWS = list(range(1, 25)) + [32000, 11008]
_WORLDS = list(range(1, 9)) + [48, 384]


def _dim0_case(_rank, _world_size, fn):
    with _refusals():
        for rows in _ROWS:
            for n in _WORLDS:
                layouts = _layouts(rows, n)
                for r in range(n):
                    out = fn(rows, n, r)
                    call = f"dim0_chunk({rows}, {n}, {r})"
                    if not isinstance(out, (tuple, list)) or len(out) != 3:
                        raise AssertionError(f"{call} returned {out!r}; expected (start, length, padded)")
                    if any(isinstance(v, bool) or not isinstance(v, int) for v in out):
                        raise AssertionError(f"{call} returned {out!r}: start, length and padded must be Python "
                                             "ints")
                    want = layouts[r]
                    if tuple(out) == want:
                        continue
                    start, length, padded = out
                    c = want[2]
                    if padded != c:
                        why = (f"rows // N = {rows // n} drops the remainder: round up, ceil(R / N)"
                               if padded == rows // n else "every rank's piece is padded to ceil(R / N) rows")
                        raise AssertionError(f"{call} returned padded = {padded}, torch.chunk's pieces are {c} "
                                             f"row{'s' if c != 1 else ''}: {why}")
                    if (start, length) != want[:2]:
                        even = [rows // n + (1 if k < rows % n else 0) for k in range(n)]
                        why = ""
                        if length == even[r]:
                            why = (": that is an even split (the first R mod N ranks one row more, as "
                                   "numpy.array_split cuts); torch.chunk and DTensor's Shard(0) give every rank "
                                   "ceil(R / N) rows until the rows run out, so the last ranks hold fewer, or none")
                        elif length < 0 or start > rows:
                            why = (f": past the last row. A rank whose piece would start at r x c = {r * c} >= R "
                                   "holds no rows: its start is R and its length 0 (clamp both)")
                        elif length == c:
                            why = (f": every rank cannot hold c = {c} rows; the last rows run out, so rank {r} holds "
                                   f"R - start = {want[1]}")
                        raise AssertionError(f"{call} returned start {start}, length {length}; torch.chunk gives rank "
                                             f"{r} rows [{want[0]}, {want[0] + want[1]}): start {want[0]}, length "
                                             f"{want[1]}{why}")


def check_dim0_chunk(dim0_chunk, timeout=60.0):
    """Your dim0_chunk(rows, world_size, rank) for R = 1..24, 11008 and 32000 rows on N = 1..8, 48 and 384
    ranks, every rank: (start, length, padded) as torch.chunk cuts dim 0 (padded = ceil(R / N); the last ranks
    hold fewer rows, or none: start R, length 0), Python ints."""
    __tracebackhide__ = True
    _callable(dim0_chunk, "dim0_chunk")
    run_on_ranks(_dim0_case, 1, args=(dim0_chunk,), timeout=timeout, what="your dim0_chunk")
    empty = sum(length == 0 for rows in _ROWS for n in _WORLDS for _, length, _ in _layouts(rows, n))
    passed(f"dim0_chunk: every rank's (start, length, padded) as torch.chunk cuts dim 0, for {len(_ROWS)} row "
           f"counts on {len(_WORLDS)} world sizes up to 384, {empty} of the cases a rank with no rows")


# ---------------------------------------------------------------------------------------
# exercise 1b: shard_param, and a DCP checkpoint of a unit it sharded, loaded into torch's fully_shard


class _Unit(nn.Module):
    """The fixture's parameters on one module (and a buffer), as a model's unit holds them."""

    def __init__(self, params):
        super().__init__()
        for name, t, rg in params:
            self.register_parameter(name, nn.Parameter(t.clone(), requires_grad=rg))
        self.register_buffer("scale", torch.tensor([0.5, 2.0]))

    def forward(self, x):
        return x * self.scale.sum()


def _check_one_shard(shard_param, name, param, mesh, place, n):
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    label = f"{name} {tuple(param.shape)} {_dtype_name(param.dtype)}" + ("" if param.requires_grad else ", frozen")
    before = param.detach().clone()
    with CommCounter() as comm:
        out = shard_param(param, mesh)
    if comm.calls:
        ops = ", ".join(sorted({c.op for c in comm.calls}))
        raise AssertionError(f"shard_param({label}) communicated ({ops}): every rank holds the whole parameter, so "
                             "its rows are cut locally, with no collective (DTensor.from_local with run_check=False; "
                             "distribute_tensor scatters from rank 0)")
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise AssertionError(f"shard_param({label}) returned {type(out).__name__}; expected (padded, sharded)")
    padded, sharded = out
    start, length, c = _layout(tuple(param.shape), n, place)
    row = _rows(param.shape)
    if not isinstance(padded, torch.Tensor) or padded.dim() != 1 or padded.numel() != c * row:
        got = tuple(padded.shape) if isinstance(padded, torch.Tensor) else type(padded).__name__
        hint = ""
        if isinstance(padded, torch.Tensor) and padded.numel() % row == 0:
            hint = _default_group_hint(param.shape, place, n, got_padded=padded.numel() // row)
        raise AssertionError(f"shard_param({label}): padded must be the flat storage of this rank's ceil(R / N) = {c} "
                             f"rows, {c * row} elements in one dimension; got {got}{hint}")
    if padded.dtype != param.dtype:
        raise AssertionError(f"shard_param({label}): the storage is {_dtype_name(padded.dtype)}, the parameter "
                             f"{_dtype_name(param.dtype)}: each parameter keeps its own dtype")
    if not isinstance(sharded, nn.Parameter):
        raise AssertionError(f"shard_param({label}) returned a {type(sharded).__name__} as the sharded parameter; "
                             "expected an nn.Parameter (holding a DTensor), what a module registers and an "
                             "optimizer steps")
    if not isinstance(sharded, DTensor):
        raise AssertionError(f"shard_param({label}): the sharded parameter is a plain tensor, not a DTensor: build it "
                             "with DTensor.from_local, so that state_dict(), DCP and clip_grad_norm_ know it is this "
                             "rank's rows of a larger tensor")
    if tuple(sharded.placements) != (Shard(0),):
        raise AssertionError(f"shard_param({label}): placements {tuple(sharded.placements)}, expected (Shard(0),)")
    if tuple(sharded.shape) != tuple(param.shape) or tuple(sharded.stride()) != tuple(param.stride()):
        raise AssertionError(f"shard_param({label}): the DTensor says its full tensor has shape {tuple(sharded.shape)} "
                             f"and stride {tuple(sharded.stride())}; the parameter's are {tuple(param.shape)} and "
                             f"{tuple(param.stride())}. Without shape= and stride=, from_local takes N x the local "
                             "rows, wrong whenever N does not divide R: pass the parameter's own")
    if sharded.requires_grad != param.requires_grad:
        what = "frozen parameter came back trainable" if not param.requires_grad else "trainable parameter came back frozen"
        raise AssertionError(f"shard_param({label}): a {what} (requires_grad={sharded.requires_grad}): keep the "
                             "parameter's requires_grad, so that frozen and trainable parameters share a unit")
    if sharded.dtype != param.dtype:
        raise AssertionError(f"shard_param({label}): the DTensor is {_dtype_name(sharded.dtype)}, the parameter "
                             f"{_dtype_name(param.dtype)}")
    local = sharded.to_local()
    ref = distribute_tensor(param.detach(), mesh, [Shard(0)]).to_local()  # torch's own cut (a scatter from rank 0)
    if tuple(local.shape) != tuple(ref.shape):
        hint = (": the padding rows are storage, not part of the parameter; the DTensor's local tensor holds the real "
                "rows only" if local.size(0) == c and c != length else
                _default_group_hint(param.shape, place, n, got_rows=local.size(0) if local.dim() else None))
        raise AssertionError(f"shard_param({label}): this rank's local tensor has shape {tuple(local.shape)}, torch's "
                             f"distribute_tensor gives {tuple(ref.shape)} (rows [{start}, {start + length})){hint}")
    if not torch.equal(local, ref):
        g_start, g_length, _ = _layout(tuple(param.shape), dist.get_world_size(), dist.get_rank())
        hint = ""
        if (dist.get_rank(), dist.get_world_size()) != (place, n) and torch.equal(
                local, param.detach()[g_start:g_start + g_length]):
            hint = _default_group_hint(param.shape, place, n, got_rows=g_length)
        raise AssertionError(f"shard_param({label}): this rank's local rows differ from torch's distribute_tensor's "
                             f"(rows [{start}, {start + length}) of the parameter){hint}")
    if length and (not _is_view_of(local, padded) or local.data_ptr() != padded.data_ptr()):
        raise AssertionError(f"shard_param({label}): the DTensor's local tensor is not a view of the start of padded: "
                             "the optimizer would step a copy, and the next all-gather would send the old rows from "
                             "the storage. Slice the padded rows, do not copy them")
    pad = padded[length * row:]
    if pad.numel() and not torch.equal(pad, torch.zeros_like(pad)):
        raise AssertionError(f"shard_param({label}): the {c - length} padding rows of the storage are not zeros: they "
                             "are gathered and reduced with the real rows; start from torch.zeros")
    if not torch.equal(param.detach(), before):
        raise AssertionError(f"shard_param({label}) changed the parameter it was given")
    if not torch.equal(sharded.full_tensor(), before):  # a collective: the ranks' pieces, reassembled by DTensor
        raise AssertionError(f"shard_param({label}): the ranks' DTensors put together (full_tensor()) are not the "
                             "parameter")
    return sharded


def _dcp_round_trip(shard_param, mesh, place, n, dtype):
    """The fixture unit sharded by the student's shard_param, saved with DCP; a fresh unit under torch's
    fully_shard (other values) loads it; every full tensor must be the original."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    group = mesh.get_group()
    path = [tempfile.mkdtemp(prefix="zerokit-l12-dcp-") if place == 0 else None]
    dist.broadcast_object_list(path, group_src=0, group=group)
    try:
        params = [(name, t, rg) for name, t, rg in _unit(n, dtype, seed=1)]
        ours = _Unit(params)
        state = {name: shard_param(p, mesh)[1] for name, p in ours.named_parameters()}
        state["scale"] = ours.scale
        dcp.save(state, checkpoint_id=path[0], process_group=group)
        theirs = _Unit([(name, _full(i + 50, tuple(t.shape), dtype, seed=2), rg) for i, (name, t, rg) in
                        enumerate(params)])
        theirs.scale.fill_(-1.0)
        fully_shard(theirs, mesh=mesh)
        target = theirs.state_dict()
        dcp.load(target, checkpoint_id=path[0], process_group=group)
        for name, t, _ in params:
            got = getattr(theirs, name).full_tensor()
            if not torch.equal(got, t):
                raise AssertionError(f"a DCP checkpoint of the unit sharded by your shard_param, loaded into torch's "
                                     f"fully_shard on the same {n} ranks: {name} came back different (max |difference| "
                                     f"{float((got.double() - t.double()).abs().max()):.3g}): DCP read your DTensors' "
                                     "rows at other places of the full tensor than they hold")
        if not torch.equal(theirs.scale, ours.scale):
            raise AssertionError("a DCP checkpoint of the unit: the buffer came back different")
        dist.barrier(group=group)
    finally:
        if place == 0:
            shutil.rmtree(path[0], ignore_errors=True)


def _shard_param_case(rank, _launched, shard_param, world_size, group_ranks, dtype, checkpoint):
    place, mesh = _mesh(group_ranks, world_size)
    if place is None:
        return None
    shard_param = _with_reference_dim0_chunk(shard_param)
    with _refusals():
        for name, t, rg in _unit(world_size, dtype):
            _check_one_shard(shard_param, name, nn.Parameter(t, requires_grad=rg), mesh, place, world_size)
        if checkpoint:
            _dcp_round_trip(shard_param, mesh, place, world_size, dtype)
    return True


def check_shard_param(shard_param, world_size=3, group_ranks=None, dtype=torch.float32, checkpoint=True,
                      timeout=90.0):
    """Your shard_param(param, mesh) on `world_size` ranks, for each parameter of the fixture unit (7 x 5,
    2 x 4, 10, 5 x 2 x 3, and a frozen 4 x 3, in `dtype`): `padded`, the flat storage of ceil(R / N) rows whose
    padding rows are zeros; `sharded`, an nn.Parameter holding a DTensor placed Shard(0) on the mesh with the
    parameter's shape, stride, dtype and requires_grad, whose local tensor equals torch's distribute_tensor's
    and is a view of the start of `padded`; no collective; full_tensor() gives the parameter back. Then
    (checkpoint=True) the unit sharded by your function is saved with torch.distributed.checkpoint and loaded
    into a unit under torch's fully_shard on the same ranks: every full tensor equal.
    group_ranks: the mesh over these global ranks only (a process subgroup)."""
    __tracebackhide__ = True
    _callable(shard_param, "shard_param")
    run_on_ranks(_shard_param_case, launch_size(world_size, group_ranks),
                 args=(shard_param, world_size, group_ranks, dtype, checkpoint), timeout=timeout,
                 what="your shard_param")
    layout = "; ".join(f"{name} {'x'.join(map(str, shape))}: "
                       + ", ".join(str(_layout(shape, world_size, r)[1]) for r in range(world_size))
                       for name, shape, _ in UNIT)
    passed(f"shard_param on {world_size} ranks{_where(group_ranks)}, {_dtype_name(dtype)}: rows per rank {layout}; "
           "each a DTensor Shard(0) of the full shape equal to torch's distribute_tensor's, viewing its zero-padded "
           "storage, frozen kept frozen, no communication"
           + ("; a DCP checkpoint of the unit sharded by it loaded into torch's fully_shard, every tensor equal"
              if checkpoint else ""))


# ---------------------------------------------------------------------------------------
# exercise 2: the all-gather's copy-in and copy-out


def _unit_shards(world_size, dtype):
    """Every rank's padded shards of the unit, {rank: [1-D tensors]}: what each rank sends."""
    params = _unit(world_size, dtype)
    return params, {r: [_padded_shard(t, world_size, r) for _, t, _ in params] for r in range(world_size)}


def _copy_in_case(rank, world_size, copy_in, store_dtype, compute_dtype):
    params, shards = _unit_shards(world_size, store_dtype)
    mine = [s.clone() for s in shards[rank]]
    sizes = [s.numel() for s in mine]
    total = sum(sizes)
    with _refusals():
        out = copy_in(list(mine), world_size, rank, compute_dtype, torch.device("cpu"))
    what = f"all_gather_copy_in(shards of {len(mine)} parameters, S = {total}, N = {world_size}, rank {rank})"
    if not isinstance(out, (tuple, list)) or len(out) != 2 or not all(isinstance(t, torch.Tensor) for t in out):
        raise AssertionError(f"{what} returned {type(out).__name__}; expected (output, row), two tensors")
    output, row = out
    if output.dim() != 1 or output.numel() != world_size * total:
        raise AssertionError(f"{what}: the output has shape {tuple(output.shape)}; the all-gather's output is 1-D, "
                             f"N x S = {world_size * total} elements (every rank's S, in rank order)")
    if output.dtype != compute_dtype or row.dtype != compute_dtype:
        raise AssertionError(f"{what}: output {_dtype_name(output.dtype)}, row {_dtype_name(row.dtype)}; the all-gather "
                             f"runs in the compute dtype {_dtype_name(compute_dtype)}: the copy-in is where the shards "
                             "are cast")
    if row.dim() != 1 or row.numel() != total:
        raise AssertionError(f"{what}: the row has shape {tuple(row.shape)}; it is this rank's S = {total} elements")
    if not _is_view_of(row, output):
        raise AssertionError(f"{what}: the row is a tensor of its own, not a view of the output: the all-gather's "
                             "input is its own row of the output, so no second S-element buffer is allocated per "
                             "gather (narrow the output)")
    offset = (row.data_ptr() - output.data_ptr()) // output.element_size()
    if offset != rank * total:
        raise AssertionError(f"{what}: the row starts at element {offset} of the output; rank {rank}'s row is elements "
                             f"[r x S, (r+1) x S) = [{rank * total}, {(rank + 1) * total}): the all-gather writes rank "
                             "r's input there")
    want = torch.cat(mine).to(compute_dtype)
    if not torch.equal(row, want):
        wrong = [i for i, (a, b) in enumerate(zip(torch.split(row, sizes), torch.split(want, sizes)))
                 if not torch.equal(a, b)]
        names = ", ".join(params[i][0] for i in wrong[:3])
        raise AssertionError(f"{what}: the row is not the shards end to end in their order (cast to "
                             f"{_dtype_name(compute_dtype)}): wrong at {names}")
    if any(not torch.equal(a, b) for a, b in zip(mine, shards[rank])):
        raise AssertionError(f"{what} changed the shards it was given (the parameters' storage)")
    all_gather(output, row)  # the check's own collective, torch's, from your row into your output
    expected = torch.cat([torch.cat(shards[r]) for r in range(world_size)]).to(compute_dtype)
    if not torch.equal(output, expected):
        raise AssertionError(f"{what}: after an all-gather from your row into your output, the output is not every "
                             "rank's row in rank order")
    return total


def check_copy_in(all_gather_copy_in, world_size=3, store_dtype=torch.float32, compute_dtype=None, timeout=60.0):
    """Your all_gather_copy_in(inputs, world_size, rank, dtype, device) on `world_size` ranks, the inputs each
    rank's padded shards of the fixture unit (stored in store_dtype, gathered in compute_dtype, default the
    same): (output, row), output 1-D of N x S elements in the compute dtype, row a view of it at r x S holding
    the shards end to end, cast; the shards untouched; torch's all-gather from row into output then gives every
    rank's row in rank order."""
    __tracebackhide__ = True
    _callable(all_gather_copy_in, "all_gather_copy_in")
    compute_dtype = compute_dtype or store_dtype
    totals = run_on_ranks(_copy_in_case, world_size, args=(all_gather_copy_in, store_dtype, compute_dtype),
                          timeout=timeout, what="your all_gather_copy_in")
    passed(f"all_gather_copy_in on {world_size} ranks ({_dtype_name(store_dtype)} shards gathered in "
           f"{_dtype_name(compute_dtype)}): S = {totals[0]} elements per rank, each rank's row a view of its "
           f"{world_size * totals[0]}-element output at r x S, filled with its shards end to end; torch's all-gather "
           "from it gave every rank's row in rank order")


def _copy_out_case(rank, world_size, copy_out, dtype):
    params, shards = _unit_shards(world_size, dtype)
    output = torch.cat([torch.cat(shards[r]) for r in range(world_size)])  # the gathered output, as built here
    kept = output.clone()
    sizes = [s.numel() for s in shards[0]]
    outs = [torch.full((world_size * s,), float("nan"), dtype=dtype) for s in sizes]
    what = f"all_gather_copy_out(output of N x S = {world_size} x {sum(sizes)}, split sizes {sizes})"
    with _refusals():
        copy_out(output, list(sizes), list(outs))
    if not torch.equal(output, kept):
        raise AssertionError(f"{what} changed the all-gather's output")
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    for i, ((name, t, _), o, s) in enumerate(zip(params, outs, sizes)):
        if bool(torch.isnan(o).any()):
            raise AssertionError(f"{what}: the buffer of {name} was not (or not all) written: copy into the buffers "
                                 "you are given, in place (the unsharded parameters are views of them)")
        want = torch.stack([shards[r][i] for r in range(world_size)])
        if not torch.equal(o.view(world_size, s), want):
            # the classic: each parameter's gathered copy taken as one contiguous block of the output
            block = output[world_size * offsets[i]:world_size * (offsets[i] + s)]
            why = (": it holds N x |s_i| contiguous elements of the output, as if the output were the parameters "
                   "one after another. The output is N rows of S (row r: rank r's shards end to end), so parameter "
                   "i's gathered copy is its column block of every row" if torch.equal(o, block) else
                   ": row r of its buffer must be rank r's shard of it, the elements [r x S + offset_i, r x S + "
                   "offset_i + |s_i|) of the output")
            raise AssertionError(f"{what}: the gathered buffer of {name} {tuple(t.shape)} is wrong{why}")
        if not torch.equal(o[:t.numel()].view(t.shape), t):
            raise AssertionError(f"{what}: the first R rows of {name}'s buffer are not the parameter")
    # backward's gather refills the buffers forward computed with: autograd must not see a change
    name, t, _ = params[0]
    weight = nn.Parameter(outs[0].as_strided(t.shape, t.stride(), 0))  # the unsharded parameter: a view of the buffer
    x = torch.randn(3, t.shape[1], dtype=dtype, requires_grad=True)
    loss = (x @ weight.t()).square().sum()  # saves the weight for the gradient of x
    with _refusals():
        copy_out(output, list(sizes), list(outs))
    try:
        loss.backward()
    except RuntimeError as exc:
        if "modified by an inplace operation" in str(exc):
            raise AssertionError(f"{what}, called again between a forward that saved the unsharded {name} (a view of "
                                 "its buffer) and its backward, as backward's all-gather does: autograd refused the "
                                 "backward (\"modified by an inplace operation\"): your copy raised the buffers' "
                                 "version counters. Copy inside torch.autograd._unsafe_preserve_version_counter(outs), "
                                 "as FSDP2 does: the bytes are the same weights") from None
        raise
    if not torch.allclose(x.grad.float(), (2 * (x.detach() @ t.t()) @ t).float(), rtol=1e-2, atol=1e-2):
        raise AssertionError(f"{what}: the backward after the second copy-out computed with other weights than "
                             f"{name}'s")
    return sum(sizes)


def check_copy_out(all_gather_copy_out, world_size=3, dtype=torch.float32, timeout=60.0):
    """Your all_gather_copy_out(output, split_sizes, outs) on `world_size` ranks, the output an all-gather of
    the fixture unit's padded shards (built by the check): each buffer outs[i] (N x |s_i| elements) holds row
    r = rank r's shard of parameter i, so its first R rows are the parameter; output untouched; the buffers
    written in place; and called again between a forward that saved a view of a buffer and its backward,
    the backward runs (autograd's version counters left alone) and computes with the same weights."""
    __tracebackhide__ = True
    _callable(all_gather_copy_out, "all_gather_copy_out")
    totals = run_on_ranks(_copy_out_case, world_size, args=(all_gather_copy_out, dtype), timeout=timeout,
                          what="your all_gather_copy_out")
    passed(f"all_gather_copy_out on {world_size} ranks ({_dtype_name(dtype)}): the {world_size} x {totals[0]} "
           f"gathered output split into {len(UNIT)} parameters' buffers, row r of each rank r's shard, the first R "
           "rows the parameter; written in place, and a backward that saved a view of the buffer ran after the "
           "copy-out refilled it")


# ---------------------------------------------------------------------------------------
# exercise 3: the reduce-scatter's chunk-cat, and the shard gradients it yields


def _trainable():
    return [(i, name, shape) for i, (name, shape, rg) in enumerate(UNIT) if rg]


def _grads_of(rank, grad_dtype):
    return [torch.zeros(shape, dtype=grad_dtype) if name == _ZERO_GRAD else _grad(i, shape, rank, grad_dtype)
            for i, name, shape in _trainable()]


def _chunk_cat_rows(grads, world_size, dtype):
    """Row r of the reduce-scatter's input: rank r's padded rows of every gradient, end to end (torch.chunk)."""
    return [torch.cat([_padded_shard(g.to(dtype), world_size, r) for g in grads]) for r in range(world_size)]


def _chunk_cat_case(rank, world_size, copy_in, grad_dtype, dtype):
    grads = _grads_of(rank, grad_dtype)
    kept = [g.clone() for g in grads]
    rows = _chunk_cat_rows(grads, world_size, dtype)
    total = rows[0].numel()
    what = (f"reduce_scatter_copy_in({len(grads)} {_dtype_name(grad_dtype)} gradients, N = {world_size}, "
            f"{_dtype_name(dtype)})")
    with _refusals():
        flat = copy_in(list(grads), world_size, dtype)
    if not isinstance(flat, torch.Tensor):
        raise AssertionError(f"{what} returned {type(flat).__name__}; expected one tensor")
    if flat.dtype != dtype:
        raise AssertionError(f"{what} is {_dtype_name(flat.dtype)}: the reduce-scatter runs in the reduce dtype, "
                             f"{_dtype_name(dtype)}, and the copy-in is where the gradients are cast")
    unpadded = sum(g.numel() for g in grads)
    if flat.dim() != 1 or flat.numel() != world_size * total:
        why = (f": that is the gradients without padding ({unpadded}); each gradient's rows are padded to a multiple "
               "of N first, so that every rank's chunk of it is ceil(R / N) rows" if flat.numel() == unpadded else "")
        raise AssertionError(f"{what} has shape {tuple(flat.shape)}; the reduce-scatter's input is 1-D, N x S = "
                             f"{world_size} x {total} elements{why}")
    mine = flat.view(world_size, total)
    if not all(torch.equal(mine[r], rows[r]) for r in range(world_size)):
        by_gradient = torch.cat([torch.cat([_padded_shard(g.to(dtype), world_size, r) for r in range(world_size)])
                                 for g in grads])
        if torch.equal(flat, by_gradient):
            why = (": it holds each padded gradient whole, one after another. The reduce-scatter hands rank r the "
                   "r-th of N equal pieces of its input, so piece r must be rank r's rows of every gradient: chunk r "
                   "of each, end to end")
        else:
            r = next(r for r in range(world_size) if not torch.equal(mine[r], rows[r]))
            why = f": row {r} (what rank {r} receives) is not chunk {r} of every gradient, end to end, zero-padded"
        raise AssertionError(f"{what} is not the chunk-cat layout{why}")
    if any(not torch.equal(a, b) for a, b in zip(grads, kept)):
        raise AssertionError(f"{what} changed the gradients it was given")
    received = torch.empty(total, dtype=dtype)
    reduce_scatter(received, flat)  # the check's own collective (a sum): rank r receives row r of every rank's input
    everyone = [_chunk_cat_rows(_grads_of(r, grad_dtype), world_size, dtype)[rank] for r in range(world_size)]
    assert_close(received.float(), torch.stack(everyone).float().sum(0),
                 f"after a reduce-scatter of your input, this rank's {total} elements (the sum of its rows)")
    return total


def check_chunk_cat(reduce_scatter_copy_in, world_size=3, grad_dtype=torch.float32, dtype=None, timeout=60.0):
    """Your reduce_scatter_copy_in(grads, world_size, dtype) on `world_size` ranks, the grads each rank's own
    full gradients of the fixture unit's trainable parameters (one of them zeros), in grad_dtype, reduced in
    `dtype` (default grad_dtype): a 1-D tensor of N x S elements whose row r is chunk r of every gradient
    (torch.chunk of its dim 0, zero-padded to ceil(R / N) rows), end to end; the gradients untouched; torch's
    reduce-scatter of it gives each rank the sum of its rows over the ranks."""
    __tracebackhide__ = True
    _callable(reduce_scatter_copy_in, "reduce_scatter_copy_in")
    dtype = dtype or grad_dtype
    totals = run_on_ranks(_chunk_cat_case, world_size, args=(reduce_scatter_copy_in, grad_dtype, dtype),
                          timeout=timeout, what="your reduce_scatter_copy_in")
    passed(f"reduce_scatter_copy_in on {world_size} ranks ({_dtype_name(grad_dtype)} gradients reduced in "
           f"{_dtype_name(dtype)}): {world_size} x {totals[0]} elements, row r chunk r of every gradient end to end "
           "(a gradient of zeros, and chunks of 0 rows, among them); torch's reduce-scatter of it gave each rank the "
           "sum of its rows")


def _shard_grads_case(rank, _launched, fn, world_size, group_ranks, dtype):
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    place, mesh = _mesh(group_ranks, world_size)
    if place is None:
        return None
    fn = _with_reference_dim0_chunk(fn)
    params = []
    for i, name, shape in _trainable():
        full = _full(i, shape, dtype)
        params.append(nn.Parameter(distribute_tensor(full, mesh, [Shard(0)])))
    means = [torch.stack([_grads_of(r, dtype)[k].float() for r in range(world_size)]).mean(0).to(dtype)
             for k in range(len(params))]
    output = torch.cat([_padded_shard(m, world_size, place) for m in means])  # this rank's reduce-scatter output
    kept = output.clone()
    names = [name for _, name, _ in _trainable()]
    what = f"shard_grads(this rank's output of S = {output.numel()}, {len(params)} parameters)"
    with _refusals():
        grads = fn(output, list(params))
    if not isinstance(grads, (list, tuple)) or len(grads) != len(params):
        raise AssertionError(f"{what} returned {type(grads).__name__}"
                             + (f" of {len(grads)}" if isinstance(grads, (list, tuple)) else "")
                             + f"; expected a list of {len(params)} gradients, one per parameter")
    offset = 0
    for name, p, g, mean in zip(names, params, grads, means):
        start, length, c = _layout(tuple(p.shape), world_size, place)
        label = f"the gradient of {name} {tuple(p.shape)}"
        if not isinstance(g, DTensor):
            raise AssertionError(f"{what}: {label} is a {type(g).__name__}, not a DTensor: the sharded parameter's "
                                 ".grad must be placed as the parameter is (torch's optimizers and clip_grad_norm_ "
                                 "read it as one)")
        if tuple(g.placements) != tuple(p.placements) or g.device_mesh != p.device_mesh:
            raise AssertionError(f"{what}: {label} is placed {tuple(g.placements)}, the parameter "
                                 f"{tuple(p.placements)} on its mesh")
        if tuple(g.shape) != tuple(p.shape):
            raise AssertionError(f"{what}: {label} says its full shape is {tuple(g.shape)}; the parameter's is "
                                 f"{tuple(p.shape)} (from_local needs shape= and stride=)")
        local = g.to_local()
        if tuple(local.shape) != (length, *p.shape[1:]):
            hint = (": the padding rows belong to the reduce-scatter's layout, not to the gradient" if
                    local.size(0) == c and c != length else "")
            hint = hint or _default_group_hint(p.shape, place, world_size, got_rows=local.size(0) if local.dim() else None)
            raise AssertionError(f"{what}: {label}'s local tensor has shape {tuple(local.shape)}; this rank holds "
                                 f"{length} rows of it{hint}")
        if length and not _is_view_of(local, output):
            raise AssertionError(f"{what}: {label} is a copy, not a view of the reduce-scatter's output: one more "
                                 "buffer per step, and the output's bytes the reduce-scatter wrote go unused")
        at = (local.data_ptr() - output.data_ptr()) // output.element_size() if length else offset
        if at != offset:
            short = sum(_layout(tuple(q.shape), world_size, place)[1] * _rows(q.shape)
                        for q in params[:names.index(name)])
            why = (f": the offset advanced by the rows this rank holds of each gradient before it ({short}), not by "
                   "their padded rows; the padded shards lie end to end, ceil(R / N) rows each"
                   if at == short else "")
            raise AssertionError(f"{what}: {label} starts at element {at} of the output; it starts at {offset}{why}")
        if not torch.equal(local, _chunk(mean, world_size, place)):
            raise AssertionError(f"{what}: {label} does not hold this rank's rows [{start}, {start + length}) of the "
                                 "mean gradient")
        if not torch.equal(g.full_tensor(), mean):  # a collective: every rank's rows, reassembled by DTensor
            raise AssertionError(f"{what}: {label}, put together across the ranks (full_tensor()), is not the mean "
                                 "gradient")
        offset += c * _rows(p.shape)
    if not torch.equal(output, kept):
        raise AssertionError(f"{what} changed the reduce-scatter's output")
    return output.numel()


def check_shard_grads(shard_grads, world_size=3, group_ranks=None, dtype=torch.float32, timeout=60.0):
    """Your shard_grads(output, params) on `world_size` ranks, params the fixture unit's trainable parameters
    as torch's distribute_tensor shards them and output this rank's reduce-scatter output (their padded
    mean-gradient shards end to end, built by the check): one DTensor per parameter, placed as it is, of its
    full shape, whose local tensor is a view of the output at the sum of the padded shards before it and
    holds this rank's rows of the mean gradient; full_tensor() is the mean gradient.
    group_ranks: the mesh over these global ranks only (a process subgroup)."""
    __tracebackhide__ = True
    _callable(shard_grads, "shard_grads")
    sizes = run_on_ranks(_shard_grads_case, launch_size(world_size, group_ranks),
                         args=(shard_grads, world_size, group_ranks, dtype), timeout=timeout, what="your shard_grads")
    sizes = [s for s in sizes if s is not None]
    passed(f"shard_grads on {world_size} ranks{_where(group_ranks)} ({_dtype_name(dtype)}): {len(_trainable())} "
           f"DTensor gradients per rank, views of its {sizes[0]}-element reduce-scatter output at the padded offsets, "
           "each this rank's rows of the mean gradient, full_tensor() the whole")
