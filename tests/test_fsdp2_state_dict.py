"""FSDP2's state dicts and distributed checkpoints (PyTorch's test_fully_shard_state_dict.py, and
FSDP2 under torch.distributed.checkpoint as test/distributed/checkpoint/ uses it), on `torch` and
`zerokit` alike (tests/fsdp2_scenarios.py: one launch per world size and system, checks that
record and go on, public API only).

`model.state_dict()` holds DTensors that share storage with the sharded parameters (read as
`p.to_local().data_ptr()`, PyTorch's `_local_tensor` made public); `load_state_dict` writes
DTensors back; DCP's get/set_model_state_dict, get/set_optimizer_state_dict and dcp.save/dcp.load
work on it unchanged, and training resumed from them continues bit for bit as it would have.
A checkpoint written by one system and read by the other is in tests/test_fsdp2_parity.py.
Left out: the tensor-parallel meshes (2-D with TP), `.cuda()` round trips (mutate_after_state_dict)
and pinned-memory offload (accelerator only), shard_placement_fn.

Scenarios (name, world size N, <- the PyTorch test it ports; then what it asserts):

- dp_state_dict_save_load_dim2 (N=2) <- test_fully_shard_state_dict.py::TestFullyShardStateDictMultiProcess.test_dp_state_dict_save_load
    state_dict() values are DTensors on the parameters' own storage (empty shards zero), load_state_dict
    of new DTensors writes them (in place when even), also after a reshard_after_forward=False forward
- dp_state_dict_save_load_dim3 (N=2) <- test_fully_shard_state_dict.py::TestFullyShardStateDictMultiProcess.test_dp_state_dict_save_load
    state_dict() values are DTensors on the parameters' own storage (empty shards zero), load_state_dict
    of new DTensors writes them (in place when even), also after a reshard_after_forward=False forward
- dp_state_dict_save_load_dim4 (N=2) <- test_fully_shard_state_dict.py::TestFullyShardStateDictMultiProcess.test_dp_state_dict_save_load
    state_dict() values are DTensors on the parameters' own storage (empty shards zero), load_state_dict
    of new DTensors writes them (in place when even), also after a reshard_after_forward=False forward
- dp_state_dict_save_load_dim5 (N=2) <- test_fully_shard_state_dict.py::TestFullyShardStateDictMultiProcess.test_dp_state_dict_save_load
    state_dict() values are DTensors on the parameters' own storage (empty shards zero), load_state_dict
    of new DTensors writes them (in place when even), also after a reshard_after_forward=False forward
- hsdp_state_dict_save_load_dim3 (N=4) <- test_fully_shard_state_dict.py::TestFullyShardStateDictMultiProcess.test_dp_state_dict_save_load (HSDP mesh)
    the same on a (2, 2) HSDP mesh
- hsdp_state_dict_save_load_dim5 (N=4) <- test_fully_shard_state_dict.py::TestFullyShardStateDictMultiProcess.test_dp_state_dict_save_load (HSDP mesh)
    the same on a (2, 2) HSDP mesh
- cached_state_dict (N=2) <- test_fully_shard_state_dict.py::TestFullyShardStateDictMultiProcess.test_cached_state_dict (mutate_after_state_dict=False)
    a state_dict() taken once keeps sharing storage with the weight through 5 AdamW steps (dims 2-5)
- dp_state_dict_cpu_offload (N=2) <- test_fully_shard_state_dict.py::TestFullyShardStateDictMultiProcess.test_dp_state_dict_cpu_offload (pin_memory=False, CPU state dict)
    a meta-device model under CPUOffloadPolicy loaded piece by piece (strict=False, assign=True) from
    DTensors: values loaded, forward runs, state_dict() on the CPU
- rank0_full_state_dict (N=2) <- test_fully_shard_state_dict.py::TestFullyShardStateDictMultiThread.test_rank0_offload_full_state_dict
    a sharded Transformer's state_dict gathered with full_tensor() equals the unsharded model's on rank
    0 (keys in order, CPU), nothing kept on the others
- dcp_get_set_model_and_optimizer_state_dict (N=2) <- derived from test/distributed/checkpoint/test_state_dict.py and e2e/test_e2e_save_and_load.py (FSDP2)
    get_model_state_dict / get_optimizer_state_dict of a trained model (DTensor values, Adam's step and
    moments) set into a fresh model and optimizer: shards equal, 2 more steps bit for bit alike
- dcp_save_load (N=2) <- derived from test/distributed/checkpoint/test_state_dict.py and e2e/test_e2e_save_and_load.py (FSDP2)
    dcp.save of model and optimizer state dicts, dcp.load into a fresh model: shards equal, 2 more steps
    bit for bit alike
- dcp_save_load_hsdp (N=4) <- derived from test/distributed/checkpoint/test_state_dict.py and e2e/test_e2e_save_and_load.py (FSDP2)
    the same on a (2, 2) HSDP mesh
- dcp_full_state_dict_rank0 (N=2) <- derived from test/distributed/checkpoint/test_state_dict.py and e2e/test_e2e_save_and_load.py (FSDP2) (full_state_dict, cpu_offload, broadcast_from_rank0)
    StateDictOptions(full_state_dict, cpu_offload): rank 0 gets plain CPU tensors equal to the full
    parameters; set_model_state_dict(broadcast_from_rank0) restores them into a fresh sharded model
"""

import copy
import contextlib
import functools
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp2_scenarios import ITERATIONS, MLP, Outcomes, Scenarios, Transformer, is_dtensor, shard_blocks, tokens

SC = Scenarios()
SRC = "test_fully_shard_state_dict.py::"
MULTI = SRC + "TestFullyShardStateDictMultiProcess."
DCP_SRC = "derived from test/distributed/checkpoint/test_state_dict.py and e2e/test_e2e_save_and_load.py (FSDP2)"


def _mesh(world_size, hsdp):
    from torch.distributed.device_mesh import init_device_mesh

    if hsdp:
        return init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    return init_device_mesh("cpu", (world_size,))


def _check_save_load(s, model, what):
    """PyTorch's _test_state_dict_save_load: values DTensors on the parameters' storage, and a
    load of new DTensors written into the parameters."""
    for name, p in model.named_parameters():
        s.check.true(is_dtensor(p), f"{what}: {name} is not a DTensor")
    old_fill, new_fill = 1, 42 + s.rank
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(old_fill)
    ptrs = {n: p.to_local().data_ptr() for n, p in model.named_parameters()}
    sizes = [p.size() for p in model.parameters()]
    sd = model.state_dict()
    for p, size in zip(model.parameters(), sizes):
        s.check.equal(p.size(), size, f"{what}: parameter size after state_dict()")
        s.check.true(isinstance(p, nn.Parameter), f"{what}: a parameter is no longer an nn.Parameter")
    s.check.equal(set(sd), set(ptrs), f"{what}: state_dict keys")
    for name, tensor in sd.items():
        s.check.true(is_dtensor(tensor), f"{what}: state_dict[{name!r}] is a {type(tensor).__name__}")
        if not is_dtensor(tensor):
            continue
        if ptrs[name] == 0:  # an empty shard past the last chunk
            s.check.true(s.rank > 0, f"{what}: rank 0 holds an empty shard of {name}")
            s.check.equal(torch.count_nonzero(tensor.to_local()).item(), 0, f"{what}: empty shard of {name}")
        else:
            s.check.equal(tensor.to_local().data_ptr(), ptrs[name], f"{what}: {name}'s value is not the "
                          "parameter's storage")
    new_sd = {name: dt.detach().clone().fill_(new_fill) for name, dt in sd.items()}
    for p in model.parameters():
        s.check.equal(p.to_local(), torch.ones_like(p.to_local()) * old_fill, f"{what}: the clone wrote through")
    model.load_state_dict(new_sd)
    for name, p in model.named_parameters():
        local = p.to_local()
        s.check.equal(local, torch.ones_like(local) * new_fill, f"{what}: {name} after load_state_dict")
        if local.size(0) * p.device_mesh.size() == p.size(0):  # even sharding: loaded in place
            s.check.equal(local.data_ptr(), ptrs[name], f"{what}: {name} moved on load")


def dp_state_dict_save_load(s, mlp_dim, hsdp):
    mesh = _mesh(s.world_size, hsdp)
    torch.manual_seed(42)
    base = nn.Sequential(MLP(mlp_dim), nn.Sequential(MLP(mlp_dim), nn.Linear(mlp_dim, mlp_dim)), MLP(mlp_dim))
    shard = functools.partial(s.fully_shard, mesh=mesh)
    model1 = copy.deepcopy(base)
    for module in model1:
        shard(module)
    shard(model1)
    _check_save_load(s, model1, "reshard_after_forward=True")
    model2 = copy.deepcopy(base)
    for module in model2:
        shard(module, reshard_after_forward=False)
    shard(model2, reshard_after_forward=False)
    _check_save_load(s, model2, "reshard_after_forward=False")
    ref_sd = model2.state_dict()
    model2(torch.randn((2, mlp_dim)))  # parameters stay unsharded after this forward
    sd = model2.state_dict()  # the state-dict hooks reshard
    s.check.equal(set(sd), set(ref_sd), "keys after an unsharded forward")
    for key, value in ref_sd.items():
        s.check.true(is_dtensor(sd[key]), f"{key} after an unsharded forward is not a DTensor")
        s.check.equal(sd[key].to_local(), value.to_local(), f"{key} after an unsharded forward")


for dim in (2, 3, 4, 5):
    SC.add(f"dp_state_dict_save_load_dim{dim}", 2, MULTI + "test_dp_state_dict_save_load",
           "state_dict() values are DTensors on the parameters' own storage (empty shards zero), load_state_dict "
           "of new DTensors writes them (in place when even), also after a reshard_after_forward=False forward",
           dp_state_dict_save_load, mlp_dim=dim, hsdp=False)
for dim in (3, 5):
    SC.add(f"hsdp_state_dict_save_load_dim{dim}", 4, MULTI + "test_dp_state_dict_save_load (HSDP mesh)",
           "the same on a (2, 2) HSDP mesh", dp_state_dict_save_load, mlp_dim=dim, hsdp=True)


@SC.register("cached_state_dict", 2, MULTI + "test_cached_state_dict (mutate_after_state_dict=False)",
             "a state_dict() taken once keeps sharing storage with the weight through 5 AdamW steps (dims 2-5)")
def cached_state_dict(s):
    for mlp_dim in (2, 3, 4, 5):
        torch.manual_seed(42)
        model = nn.Linear(mlp_dim, mlp_dim, bias=False)
        s.fully_shard(model, reshard_after_forward=True)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sd = model.state_dict()
        s.check.true(is_dtensor(model.weight), f"dim {mlp_dim}: weight not a DTensor")

        def same_storage():
            return (sd["weight"].to_local().untyped_storage().data_ptr()
                    == model.weight.to_local().untyped_storage().data_ptr())

        s.check.true(same_storage(), f"dim {mlp_dim}: state_dict value on other storage")
        torch.manual_seed(42 + s.rank)
        inp = torch.rand(mlp_dim, mlp_dim)
        for step in range(ITERATIONS):
            optim.zero_grad()
            model(inp).sum().backward()
            optim.step()
            s.check.true(same_storage(), f"dim {mlp_dim} step {step}: storage changed")
        s.check.equal(sd["weight"].to_local(), model.weight.to_local(), f"dim {mlp_dim}: cached value")


@SC.register("dp_state_dict_cpu_offload", 2, MULTI + "test_dp_state_dict_cpu_offload (pin_memory=False, CPU state dict)",
             "a meta-device model under CPUOffloadPolicy loaded piece by piece (strict=False, assign=True) from "
             "DTensors: values loaded, forward runs, state_dict() on the CPU")
def dp_state_dict_cpu_offload(s):
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.tensor import distribute_tensor

    mlp_dim = 4
    offload = CPUOffloadPolicy(pin_memory=False)
    torch.manual_seed(42)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(mlp_dim, mlp_dim, bias=False), nn.Linear(mlp_dim, mlp_dim, bias=False))
    for module in model:
        s.fully_shard(module, offload_policy=offload)
    s.fully_shard(model, offload_policy=offload)
    pieces, fulls = [], {}
    for name, dtensor in model.named_parameters():
        full = torch.randn(dtensor.size())
        fulls[name] = full
        pieces.append({name: distribute_tensor(full, dtensor.device_mesh, dtensor.placements).cpu()})
    for sd in pieces:
        model.load_state_dict(sd, assign=True, strict=False)
    for name, p in model.named_parameters():
        s.check.equal(p.device.type, "cpu", f"{name} device after load")
        s.check.equal(p.full_tensor(), fulls[name], f"{name} loaded")
    out = model(torch.rand((mlp_dim, mlp_dim))).sum()
    s.check.true(torch.isfinite(out).item(), "forward after the load")
    for name, tensor in model.state_dict().items():
        s.check.equal(tensor.device.type, "cpu", f"state_dict[{name!r}] device")


@SC.register("rank0_full_state_dict", 2, "test_fully_shard_state_dict.py::TestFullyShardStateDictMultiThread."
             "test_rank0_offload_full_state_dict",
             "a sharded Transformer's state_dict gathered with full_tensor() equals the unsharded model's on rank 0 "
             "(keys in order, CPU), nothing kept on the others")
def rank0_full_state_dict(s):
    torch.manual_seed(42)
    ref = Transformer(n_layers=2)
    with torch.no_grad():
        for p in ref.parameters():
            dist.broadcast(p, src=0)
    model = copy.deepcopy(ref)
    shard_blocks(s, model)
    sharded_sd = model.state_dict()
    full_sd = {}
    for name, sharded in sharded_sd.items():
        full = sharded.full_tensor()
        if s.rank == 0:
            full_sd[name] = full.cpu()
    if s.rank == 0:
        ref_sd = {k: v.cpu() for k, v in ref.state_dict().items()}
        s.check.equal(list(full_sd), list(ref_sd), "keys")
        for name in ref_sd:
            s.check.equal(full_sd[name], ref_sd[name], f"{name}")
            s.check.equal(full_sd[name].device.type, "cpu", f"{name} device")
    else:
        s.check.equal(len(full_sd), 0, "a full state dict off rank 0")


# ---- torch.distributed.checkpoint


@contextlib.contextmanager
def shared_tmpdir():
    """A folder rank 0 makes and every rank uses (DCP writes one file per rank into it)."""
    path = [tempfile.mkdtemp(prefix="fsdp2-dcp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    try:
        yield path[0]
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path[0], ignore_errors=True)


def _trained(s, steps, mesh=None):
    """A sharded Transformer and its AdamW after `steps` steps on this rank's batches."""
    torch.manual_seed(42)
    model = Transformer(n_layers=2)
    shard_blocks(s, model, **({"mesh": mesh} if mesh is not None else {}))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optim, s.rank, range(steps))
    return model, optim


def _train(model, optim, rank, steps):
    losses = []
    for step in steps:
        inp = tokens(model, 2, seed=1000 * rank + step)
        loss = model(inp).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    return losses


def _fresh(s, mesh=None):
    torch.manual_seed(7)  # other initial values: a load that did nothing shows
    model = Transformer(n_layers=2)
    shard_blocks(s, model, **({"mesh": mesh} if mesh is not None else {}))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _same_training_after(s, a, a_optim, b, b_optim, what):
    """Both continue 2 steps: the same losses and parameters, bit for bit."""
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        s.check.equal(q.to_local(), p.to_local(), f"{what}: {name} shard after the load")
    la, lb = _train(a, a_optim, s.rank, range(3, 5)), _train(b, b_optim, s.rank, range(3, 5))
    for i, (x, y) in enumerate(zip(la, lb)):
        s.check.equal(y, x, f"{what}: loss {i} after resuming")
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        s.check.equal(q.to_local(), p.to_local(), f"{what}: {name} shard after 2 more steps")


@SC.register("dcp_get_set_model_and_optimizer_state_dict", 2, DCP_SRC,
             "get_model_state_dict / get_optimizer_state_dict of a trained model (DTensor values, Adam's step and "
             "moments) set into a fresh model and optimizer: shards equal, 2 more steps bit for bit alike")
def dcp_get_set(s):
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    model, optim = _trained(s, 3)
    msd, osd = get_model_state_dict(model), get_optimizer_state_dict(model, optim)
    s.check.true(all(is_dtensor(v) for v in msd.values()), "a model state dict value is not a DTensor")
    states = osd["state"]
    s.check.equal(len(states), len(list(model.parameters())), "optimizer states")
    s.check.true(all(is_dtensor(st["exp_avg"]) and is_dtensor(st["exp_avg_sq"]) for st in states.values()),
                 "a moment is not a DTensor")
    fresh, fresh_optim = _fresh(s)
    # copies: the state dicts hold the trained optimizer's own moment tensors, which the fresh one would
    # otherwise share (load_state_dict keeps tensors of the right dtype and device), both updating them
    set_model_state_dict(fresh, copy.deepcopy(msd))
    set_optimizer_state_dict(fresh, fresh_optim, copy.deepcopy(osd))
    _same_training_after(s, model, optim, fresh, fresh_optim, "get/set")


def dcp_save_load(s, hsdp):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    mesh = _mesh(s.world_size, hsdp) if hsdp else None
    model, optim = _trained(s, 3, mesh)
    with shared_tmpdir() as path:
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)},
                 checkpoint_id=path)
        fresh, fresh_optim = _fresh(s, mesh)
        state = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, fresh_optim)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(fresh, state["model"])
        set_optimizer_state_dict(fresh, fresh_optim, state["optim"])
    _same_training_after(s, model, optim, fresh, fresh_optim, "dcp.save/dcp.load")


SC.add("dcp_save_load", 2, DCP_SRC, "dcp.save of model and optimizer state dicts, dcp.load into a fresh model: "
       "shards equal, 2 more steps bit for bit alike", dcp_save_load, hsdp=False)
SC.add("dcp_save_load_hsdp", 4, DCP_SRC, "the same on a (2, 2) HSDP mesh", dcp_save_load, hsdp=True)


@SC.register("dcp_full_state_dict_rank0", 2, DCP_SRC + " (full_state_dict, cpu_offload, broadcast_from_rank0)",
             "StateDictOptions(full_state_dict, cpu_offload): rank 0 gets plain CPU tensors equal to the full "
             "parameters; set_model_state_dict(broadcast_from_rank0) restores them into a fresh sharded model")
def dcp_full_state_dict_rank0(s):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    model, optim = _trained(s, 2)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    expected = {n: p.full_tensor() for n, p in model.named_parameters()}
    if s.rank == 0:
        s.check.equal(sorted(full), sorted(expected), "keys on rank 0")
        for name, value in full.items():
            s.check.true(not is_dtensor(value) and value.device.type == "cpu", f"{name}: not a plain CPU tensor")
            s.check.equal(value, expected[name], f"{name} full value")
    else:
        s.check.equal(len(full), 0, "a full state dict off rank 0")
    fresh, _ = _fresh(s)
    set_model_state_dict(fresh, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for name, p in fresh.named_parameters():
        s.check.true(is_dtensor(p), f"{name} not a DTensor after the load")
        s.check.equal(p.full_tensor(), expected[name], f"{name} after broadcast_from_rank0")


OUT = Outcomes(SC, timeout=240)


def test_the_docstring_table_lists_every_scenario():
    assert SC.missing_from(__doc__) == []


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize("system,name,world_size", SC.cases())
def test_scenario(system, name, world_size):
    failures = OUT.failures(system, name, world_size)
    assert failures is None, failures
