"""What fully_shard makes of a module (PyTorch's test_fully_shard_init.py), on `torch` and `zerokit`
alike (tests/fsdp2_scenarios.py: one launch per world size and system, checks that record and go
on, public API only): each parameter an nn.Parameter holding a DTensor sharded Shard(0) on the
mesh ((Replicate(), Shard(0)) on a 2-D HSDP mesh) with torch.chunk's dim-0 layout, ranks past the
last chunk holding an empty shard; meta-device initialisation; meshes from process groups.

Public stand-ins for what PyTorch's bodies read privately:
- `param._local_tensor` / `param._spec.placements`: `p.to_local()`, `p.placements`;
- `_get_managed_modules` / `_get_managed_states` (which module's group owns which parameter):
  the all-gathers' sizes (CommSpy), each N times the padded dim-0 shards of the parameters that
  group manages: shared parameters counted once, a nested fully_shard's parameters not in the
  parent's;
- `fully_shard.state(m)._lazy_init()` (a second root, a multi-module root): the first forward,
  which runs the lazy init, and its error;
- `_init_intra_node_process_group` / `_init_inter_node_process_group`: dist.new_group.
Left out: the device-moving tests (CUDA), tensor parallel meshes (2-D with TP, _StridedShard),
ParamModuleInfo and FQN internals, HSDP custom all-reduce hooks (set_all_reduce_hook, streams).

Scenarios (name, world size N, <- the PyTorch test it ports; then what it asserts):

- shard_tensor_parameters_N2 (N=2) <- test_fully_shard_init.py::TestFullyShardShardedParameterTensor.test_shard_tensor_parameters
    each parameter an nn.Parameter DTensor on the world mesh, global size and stride kept, (Shard(0),),
    local shard = torch.chunk(dim 0)[rank] (empty past the last chunk), full_tensor() the original
- shard_tensor_parameters_N4 (N=4) <- test_fully_shard_init.py::TestFullyShardShardedParameterTensor.test_shard_tensor_parameters
    each parameter an nn.Parameter DTensor on the world mesh, global size and stride kept, (Shard(0),),
    local shard = torch.chunk(dim 0)[rank] (empty past the last chunk), full_tensor() the original
- uneven_dim0_padding (N=4) <- derived from test_fully_shard_init.py::TestFullyShardShardedParameterTensor (odd sizes) and test_fully_shard_training.py (uneven shapes)
    dims 5, 7, 1 and 9 on 4 ranks: shard rows 2/2/1/0, 2/2/2/1, 1/0/0/0, 3/3/3/0 (torch.chunk); inside
    forward the parameter is the full plain tensor with storage for at least the padded size; after an
    Adam step the shards keep their shapes and equal the replicated reference's
- raise_scalar_parameter (N=2) <- test_fully_shard_init.py::TestFullyShardShardedParameterTensor.test_raise_scalar_parameter
    a 0-d parameter: fully_shard raises ValueError
- raise_noncontiguous_parameter (N=2) <- test_fully_shard_init.py::TestFullyShardShardedParameterTensor.test_raise_noncontiguous_parameter
    a channels_last (non-contiguous) conv weight: fully_shard raises NotImplementedError
- invalid_mesh_ndim (N=2) <- test_fully_shard_init.py::TestFullyShardMeshArg.test_invalid_mesh_ndim
    a 3-D mesh: fully_shard raises ValueError
- 2d_mesh_without_mesh_dim_names (N=4) <- test_fully_shard_init.py::TestFullyShardMeshArg.test_2d_mesh_without_mesh_dim_names
    a 2-D mesh without mesh_dim_names: fully_shard refuses it (torch: AssertionError; ValueError
    accepted)
- fsdp_module_class_and_return (N=2) <- derived from test_fully_shard_init.py::(FSDPModule) and _fully_shard.py's contract
    fully_shard returns the module itself, its class a subclass of FSDPModule and of the original; a
    list call makes each an FSDPModule; the original class's methods still work
- managed_states_by_all_gather_size (N=2) <- test_fully_shard_init.py::TestFullyShardManagedModulesAndStates (nested, shared params, list of modules)
    what each group manages, read from its all-gather's size: a nested fully_shard's parameters not in
    the parent's, shared parameters once, a list call one all-gather for both modules
- lazy_init_errors (N=2) <- test_fully_shard_init.py::TestFullyShardLazyInit (double_lazy_init, multi_module_root)
    forwarding a non-root FSDP module first, then the root: RuntimeError; a list call with no root above
    (two modules as the root group): RuntimeError at the first forward
- meta_device_1d_init_dim8 (N=4) <- test_fully_shard_init.py::TestFullyShardMetaDeviceInit.test_meta_device_1d_init
    built on meta, sharded there, to_empty on CPU: DTensors on CPU; reset_parameters fills every
    non-empty shard and the buffer; a training step runs
- meta_device_1d_init_dim8_bf16 (N=4) <- test_fully_shard_init.py::TestFullyShardMetaDeviceInit.test_meta_device_1d_init
    built on meta, sharded there, to_empty on CPU: DTensors on CPU; reset_parameters fills every
    non-empty shard and the buffer; a training step runs (bf16 policy)
- meta_device_1d_init_dim3 (N=4) <- test_fully_shard_init.py::TestFullyShardMetaDeviceInit.test_meta_device_1d_init
    built on meta, sharded there, to_empty on CPU: DTensors on CPU; reset_parameters fills every
    non-empty shard and the buffer; a training step runs
- meta_device_1d_init_dim3_bf16 (N=4) <- test_fully_shard_init.py::TestFullyShardMetaDeviceInit.test_meta_device_1d_init
    built on meta, sharded there, to_empty on CPU: DTensors on CPU; reset_parameters fills every
    non-empty shard and the buffer; a training step runs (bf16 policy)
- meta_device_1d_init_dim1 (N=4) <- test_fully_shard_init.py::TestFullyShardMetaDeviceInit.test_meta_device_1d_init
    built on meta, sharded there, to_empty on CPU: DTensors on CPU; reset_parameters fills every
    non-empty shard and the buffer; a training step runs
- meta_device_1d_init_dim1_bf16 (N=4) <- test_fully_shard_init.py::TestFullyShardMetaDeviceInit.test_meta_device_1d_init
    built on meta, sharded there, to_empty on CPU: DTensors on CPU; reset_parameters fills every
    non-empty shard and the buffer; a training step runs (bf16 policy)
- invalid_meta_device_init (N=2) <- test_fully_shard_init.py::TestFullyShardMetaDeviceInit.test_invalid_meta_device_init
    a forward with model[0] still on meta: RuntimeError
- rank0_broadcast_meta_device_init (N=2) <- test_fully_shard_init.py::TestFullyShardMetaDeviceInit.test_rank0_broadcast_meta_device_init
    a meta-device sharded model loaded (assign=True) from rank 0's full state dict by broadcast and
    distribute_tensor: the same shards, loss and gradients as a model sharded from the full weights
- reset_sharded_param_in_lazy_init (N=2) <- test_fully_shard_init.py::TestFullyShardLazyInit.test_reset_sharded_param_in_lazy_init
    a parameter replaced after fully_shard by one computed from the sharded weights (meta model,
    to_empty): forward/backward run with its values, it is a DTensor with a gradient
- 1d_process_group_init (N=4) <- test_fully_shard_init.py::TestFullyShardProcessGroupInit.test_1d_process_group_init
    a DP mesh made by DeviceMesh.from_group(dp group) equals the sub-mesh of a (dp, tp) mesh, and
    fully_shard on it gives the same loss, shards and gradient shards
- 2d_process_group_init (N=4) <- test_fully_shard_init.py::TestFullyShardProcessGroupInit.test_2d_process_group_init
    an HSDP mesh built by DeviceMesh.from_group from replicate and shard groups (dist.new_group) equals
    init_device_mesh's, and fully_shard on it gives the same loss, parameters and gradients
- hsdp_broadcast_across_replicas (N=4) <- test_fully_shard_init.py::TestFullyShardHSDPBroadcast.test_hsdp_broadcast_across_replicas
    HSDP shards (and a buffer) made to differ across replicas, then broadcast over the replicate group
    from its first rank: replicas equal, an iteration runs
"""

import copy
import itertools
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp2_scenarios import (MLP, CommSpy, Outcomes, Scenarios, Transformer, expected_local, is_dtensor,
                             shard_blocks, tokens)

SC = Scenarios()
SRC = "test_fully_shard_init.py::"


def _check_1d_sharded(s, orig_params, sharded_params, what):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    s.check.equal(len(sharded_params), len(orig_params), f"{what}: parameter count")
    mesh = init_device_mesh("cpu", (s.world_size,))
    for orig, p in zip(orig_params, sharded_params):
        if not is_dtensor(p):
            s.check.fail(f"{what}: a {type(p).__name__}, not a DTensor")
            continue
        s.check.true(isinstance(p, nn.Parameter), f"{what}: not an nn.Parameter")
        s.check.true(p.device_mesh == mesh, f"{what}: mesh {p.device_mesh} is not {mesh}")
        s.check.equal(p.size(), orig.size(), f"{what}: global size")
        s.check.equal(p.stride(), orig.stride(), f"{what}: global stride")
        s.check.equal(tuple(p.placements), (Shard(0),), f"{what}: placements")
        chunks = torch.chunk(orig, s.world_size, dim=0)
        local = chunks[s.rank] if s.rank < len(chunks) else orig.new_empty((0, *orig.shape[1:]))
        s.check.equal(p.to_local(), local, f"{what}: local shard (torch.chunk's)")
        s.check.equal(tuple(p.to_local().shape), tuple(local.shape), f"{what}: local shape")
        s.check.equal(p.full_tensor(), orig, f"{what}: full_tensor()")


def shard_tensor_parameters(s):
    model = nn.Sequential(*[MLP(3, dim_multiplier=3) for _ in range(3)])  # odd sizes: uneven shards
    orig = [p.detach().clone() for p in model.parameters()]
    s.fully_shard(model)
    _check_1d_sharded(s, orig, list(model.parameters()), "MLPs")
    model = nn.Sequential(*[MLP(3, dim_multiplier=3) for _ in range(3)])
    model[0].in_proj = model[1].in_proj  # a shared module: its parameters once
    orig = [p.detach().clone() for p in model.parameters()]
    s.fully_shard(model)
    _check_1d_sharded(s, orig, list(model.parameters()), "shared in_proj")
    s.check.true(model[0].in_proj.weight is model[1].in_proj.weight, "the shared parameter was split")


for n in (2, 4):
    SC.add(f"shard_tensor_parameters_N{n}", n,
           SRC + "TestFullyShardShardedParameterTensor.test_shard_tensor_parameters",
           "each parameter an nn.Parameter DTensor on the world mesh, global size and stride kept, (Shard(0),), "
           "local shard = torch.chunk(dim 0)[rank] (empty past the last chunk), full_tensor() the original",
           shard_tensor_parameters)


@SC.register("uneven_dim0_padding", 4, "derived from " + SRC + "TestFullyShardShardedParameterTensor "
             "(odd sizes) and test_fully_shard_training.py (uneven shapes)",
             "dims 5, 7, 1 and 9 on 4 ranks: shard rows 2/2/1/0, 2/2/2/1, 1/0/0/0, 3/3/3/0 (torch.chunk); inside "
             "forward the parameter is the full plain tensor with storage for at least the padded size; after an "
             "Adam step the shards keep their shapes and equal the replicated reference's")
def uneven_dim0_padding(s):
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 7), nn.Linear(7, 1), nn.Linear(1, 9))
    ref = copy.deepcopy(model)
    for layer in model:
        s.fully_shard(layer)
    s.fully_shard(model)
    rows = {0: [2, 2, 1, 0], 1: [2, 2, 2, 1], 2: [1, 0, 0, 0], 3: [3, 3, 3, 0]}
    for i, layer in enumerate(model):
        s.check.equal(layer.weight.to_local().shape[0], rows[i][s.rank], f"layer {i} weight shard rows")
        s.check.equal(layer.bias.to_local().shape[0], rows[i][s.rank], f"layer {i} bias shard rows")
    seen = {}

    def look(module, args, i):
        w = module.weight
        seen[i] = (is_dtensor(w), tuple(w.shape), w.detach().clone() if not is_dtensor(w) else None,
                   w.untyped_storage().nbytes() // w.element_size() if not is_dtensor(w) else 0)

    hooks = [layer.register_forward_pre_hook(lambda m, a, i=i: look(m, a, i)) for i, layer in enumerate(model)]
    full = {i: layer.weight.full_tensor() for i, layer in enumerate(model)}
    optim, ref_optim = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(ref.parameters(), lr=1e-2)
    torch.manual_seed(42 + s.rank)
    inp = torch.randn(4, 3)
    model(inp).sum().backward()
    for h in hooks:
        h.remove()
    for i, layer in enumerate(model):
        dt, shape, value, storage = seen[i]
        s.check.true(not dt, f"layer {i}: a DTensor inside forward (not unsharded)")
        s.check.equal(shape, tuple(full[i].shape), f"layer {i}: unsharded shape")
        if value is not None:
            s.check.equal(value, full[i], f"layer {i}: unsharded value")
        padded = math.ceil(full[i].shape[0] / s.world_size) * s.world_size * math.prod(full[i].shape[1:])
        s.check.true(storage >= padded, f"layer {i}: unsharded storage {storage} < padded {padded}")
    ref(inp).sum().backward()
    for p in ref.parameters():
        dist.all_reduce(p.grad)
        p.grad.div_(s.world_size)
    optim.step()
    ref_optim.step()
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        s.check.close(p.to_local(), expected_local(r.detach(), p), f"{name} after a step")
        s.check.true(p.to_local().is_contiguous() and p.grad.to_local().is_contiguous(), f"{name} not contiguous")


@SC.register("raise_scalar_parameter", 2, SRC + "TestFullyShardShardedParameterTensor.test_raise_scalar_parameter",
             "a 0-d parameter: fully_shard raises ValueError")
def raise_scalar_parameter(s):
    model = nn.Sequential(*[MLP(3, dim_multiplier=3) for _ in range(3)])
    model.register_parameter("scalar_p", nn.Parameter(torch.tensor(1.0)))
    s.check.raises(ValueError, lambda: s.fully_shard(model), "fully_shard of a scalar parameter")


@SC.register("raise_noncontiguous_parameter", 2,
             SRC + "TestFullyShardShardedParameterTensor.test_raise_noncontiguous_parameter",
             "a channels_last (non-contiguous) conv weight: fully_shard raises NotImplementedError")
def raise_noncontiguous_parameter(s):
    conv2d = nn.Conv2d(8, 8, 3).to(memory_format=torch.channels_last)
    s.check.raises(NotImplementedError, lambda: s.fully_shard(conv2d), "fully_shard of a non-contiguous parameter")


@SC.register("invalid_mesh_ndim", 2, SRC + "TestFullyShardMeshArg.test_invalid_mesh_ndim",
             "a 3-D mesh: fully_shard raises ValueError")
def invalid_mesh_ndim(s):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (s.world_size, 1, 1))
    s.check.raises(ValueError, lambda: s.fully_shard(MLP(8), mesh=mesh), "fully_shard on a 3-D mesh")


@SC.register("2d_mesh_without_mesh_dim_names", 4, SRC + "TestFullyShardMeshArg.test_2d_mesh_without_mesh_dim_names",
             "a 2-D mesh without mesh_dim_names: fully_shard refuses it (torch: AssertionError; ValueError accepted)")
def mesh_without_names(s):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (s.world_size // 2, 2))
    s.check.raises((AssertionError, ValueError), lambda: s.fully_shard(MLP(8), mesh=mesh),
                   "fully_shard on an unnamed 2-D mesh")


@SC.register("fsdp_module_class_and_return", 2, "derived from " + SRC + "(FSDPModule) and _fully_shard.py's contract",
             "fully_shard returns the module itself, its class a subclass of FSDPModule and of the original; a "
             "list call makes each an FSDPModule; the original class's methods still work")
def fsdp_module_class_and_return(s):
    model = nn.Sequential(MLP(4), MLP(4), MLP(4))
    returned = s.fully_shard(model[2])
    s.check.true(returned is model[2], "fully_shard did not return the module")
    s.check.true(isinstance(model[2], s.FSDPModule) and isinstance(model[2], MLP), f"class {type(model[2]).__mro__}")
    s.fully_shard([model[0], model[1]])
    s.check.true(all(isinstance(m, s.FSDPModule) for m in model[:2]), "a listed module is not an FSDPModule")
    s.fully_shard(model)
    s.check.true(isinstance(model, nn.Sequential) and isinstance(model, s.FSDPModule), "root class")
    s.check.true(not isinstance(model[0].in_proj, s.FSDPModule), "a child became an FSDPModule")
    s.check.equal(len(model), 3, "Sequential.__len__")
    model[2].reset_parameters()  # MLP's own method
    out = model(torch.randn(2, 4))
    s.check.equal(tuple(out.shape), (2, 4), "output shape")


@SC.register("managed_states_by_all_gather_size", 2,
             SRC + "TestFullyShardManagedModulesAndStates (nested, shared params, list of modules)",
             "what each group manages, read from its all-gather's size: a nested fully_shard's parameters not in "
             "the parent's, shared parameters once, a list call one all-gather for both modules")
def managed_states(s):
    n = s.world_size

    def padded(params):
        seen, total = set(), 0
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                total += math.ceil(p.shape[0] / n) * math.prod(p.shape[1:]) * n
        return total

    inp = torch.randn(2, 8)
    model = nn.Sequential(*[MLP(8) for _ in range(2)])
    s.fully_shard(model[0])
    s.fully_shard(model)
    with CommSpy() as spy:
        model(inp)
    s.check.equal([e.numel for e in spy.of("AG")], [padded(model[1].parameters()), padded(model[0].parameters())],
                  "nested: the root gathers model[1]'s parameters, model[0] its own")
    model = nn.Sequential(*[MLP(8, with_buffer=True) for _ in range(3)])
    model[0].in_proj.weight = model[1].in_proj.weight
    model[2].in_proj.weight = model[1].in_proj.weight
    model[1].buffer = model[2].buffer
    expected = padded(model.parameters())
    s.fully_shard(model)
    with CommSpy() as spy:
        model(inp)
    s.check.equal([e.numel for e in spy.of("AG")], [expected], "shared weight: gathered once")
    s.check.true(not is_dtensor(model[1].buffer) and model[1].buffer is model[2].buffer, "the shared buffer")
    model = nn.Sequential(*[MLP(8) for _ in range(5)])
    s.fully_shard([model[0], model[1], model[2]])
    s.fully_shard(model)
    with CommSpy() as spy:
        model(inp)
    s.check.equal([e.numel for e in spy.of("AG")], [padded(itertools.chain(model[3].parameters(),
                                                                            model[4].parameters())),
                                                     padded(itertools.chain(*(m.parameters() for m in model[:3])))],
                  "list of modules: the root gathers model[3:], the group model[:3] in one all-gather")


@SC.register("lazy_init_errors", 2, SRC + "TestFullyShardLazyInit (double_lazy_init, multi_module_root)",
             "forwarding a non-root FSDP module first, then the root: RuntimeError; a list call with no root above "
             "(two modules as the root group): RuntimeError at the first forward")
def lazy_init_errors(s):
    model = nn.Sequential(MLP(8), MLP(8))
    s.fully_shard(model[0].in_proj)
    s.fully_shard(model[0].out_proj)
    s.fully_shard(model)
    x = torch.randn(2, 8)
    model[0].in_proj(x)  # lazily initialised as a root of its own
    s.check.raises(RuntimeError, lambda: model(x), "the root's forward after a non-root's")
    model = nn.Sequential(MLP(8), MLP(8))
    s.fully_shard([model[0], model[1]])
    s.check.raises(RuntimeError, lambda: model(x), "a forward with a two-module root group")


def meta_device_init(s, mlp_dim, mp):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = init_device_mesh("cpu", (s.world_size,))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp
              else MixedPrecisionPolicy())
    with torch.device("meta"):
        model = nn.Sequential(MLP(mlp_dim, dim_multiplier=1, with_buffer=True, bias=False),
                              MLP(mlp_dim, dim_multiplier=1, bias=False))
    s.check.true(all(p.device.type == "meta" for p in model.parameters()), "not on meta before")
    for module in (model[0], model[1], model):
        s.fully_shard(module, mesh=mesh, mp_policy=policy)
    s.check.true(all(p.device.type == "meta" for p in model.parameters()), "not on meta after fully_shard")
    model.to_empty(device="cpu")
    s.check.true(all(p.device.type == "cpu" and is_dtensor(p) for p in model.parameters()), "after to_empty")
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    const = 1337
    for t in itertools.chain(model.parameters(), model.buffers()):
        t.detach().fill_(const)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    for p in model.parameters():
        local = p.to_local()
        if local.numel() > 0:
            s.check.true(not torch.equal(local, torch.full_like(local, const)), "reset_parameters left a shard")
    for b in model.buffers():
        s.check.true(not torch.equal(b, torch.full_like(b, const)), "reset_parameters left a buffer")
    model(torch.randn((4, mlp_dim))).sum().backward()
    optim.step()
    s.check.true(all(torch.isfinite(p.to_local()).all() for p in model.parameters()), "a non-finite shard")


for dim, mp in itertools.product((8, 3, 1), (False, True)):
    SC.add(f"meta_device_1d_init_dim{dim}{'_bf16' if mp else ''}", 4,
           SRC + "TestFullyShardMetaDeviceInit.test_meta_device_1d_init",
           "built on meta, sharded there, to_empty on CPU: DTensors on CPU; reset_parameters fills every "
           "non-empty shard and the buffer; a training step runs" + (" (bf16 policy)" if mp else ""),
           meta_device_init, mlp_dim=dim, mp=mp)


@SC.register("invalid_meta_device_init", 2, SRC + "TestFullyShardMetaDeviceInit.test_invalid_meta_device_init",
             "a forward with model[0] still on meta: RuntimeError")
def invalid_meta_device_init(s):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (s.world_size,))
    with torch.device("meta"):
        model = nn.Sequential(MLP(8, with_buffer=True), MLP(8))
    for module in (model[0], model[1], model):
        s.fully_shard(module, mesh=mesh)
    model[1].to_empty(device="cpu")
    s.check.raises(RuntimeError, lambda: model(torch.randn((4, 8))), "forward with meta parameters")


@SC.register("rank0_broadcast_meta_device_init", 2, SRC + "TestFullyShardMetaDeviceInit.test_rank0_broadcast_meta_device_init",
             "a meta-device sharded model loaded (assign=True) from rank 0's full state dict by broadcast and "
             "distribute_tensor: the same shards, loss and gradients as a model sharded from the full weights")
def rank0_broadcast_meta_device_init(s):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    if s.rank == 0:
        torch.manual_seed(42)
        full_sd = Transformer(n_layers=2).state_dict()
    mesh = init_device_mesh("cpu", (s.world_size,))
    with torch.device("meta"):
        model = Transformer(n_layers=2)
    shard_blocks(s, model, mesh=mesh)
    s.check.true(all(p.device.type == "meta" for p in model.parameters()), "not on meta")
    meta_sd = model.state_dict()
    sharded_sd = {}
    for name, meta in meta_sd.items():
        full = full_sd[name].detach().clone() if s.rank == 0 else torch.empty(meta.size(), dtype=meta.dtype)
        dist.broadcast(full, src=0)
        sharded_sd[name] = nn.Parameter(distribute_tensor(full, meta.device_mesh, meta.placements))
    model.load_state_dict(sharded_sd, assign=True)
    s.check.true(all(is_dtensor(p) and p.device.type == "cpu" for p in model.parameters()), "after the load")
    torch.manual_seed(42)
    ref = Transformer(n_layers=2)
    with torch.no_grad():
        for p in ref.parameters():
            dist.broadcast(p, src=0)
    shard_blocks(s, ref, mesh=mesh)
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        s.check.equal(p.to_local(), r.to_local(), f"{name} shard")
    inp = tokens(model, 2, seed=s.rank)
    loss, ref_loss = model(inp).sum(), ref(inp).sum()
    loss.backward()
    ref_loss.backward()
    s.check.equal(loss, ref_loss, "loss")
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        s.check.equal(p.grad.to_local(), r.grad.to_local(), f"{name} gradient shard")


@SC.register("reset_sharded_param_in_lazy_init", 2, SRC + "TestFullyShardLazyInit.test_reset_sharded_param_in_lazy_init",
             "a parameter replaced after fully_shard by one computed from the sharded weights (meta model, "
             "to_empty): forward/backward run with its values, it is a DTensor with a gradient")
def reset_sharded_param_in_lazy_init(s):
    class MyModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer1 = nn.Linear(3, 3, bias=False)
            self.layer2 = nn.Linear(3, 3, bias=False)
            self.weight_norm = nn.Parameter(torch.empty(3))

        def forward(self, inp):
            return self.layer2(self.layer1(inp)).sum() + self.weight_norm.sum()

    with torch.device("meta"):
        model = MyModel()
    s.fully_shard(model.layer1)
    s.fully_shard(model.layer2)
    s.fully_shard(model)
    model.layer1.to_empty(device="cpu")
    model.layer2.to_empty(device="cpu")
    with torch.no_grad():
        model.layer1.weight.fill_(0.5)
        model.layer2.weight.fill_(0.25)
        # PyTorch's init_weight_norm: a new parameter computed from the sharded weights (a DTensor)
        weight_norm = torch.linalg.norm(model.layer1.weight, dim=1) + torch.linalg.norm(model.layer2.weight, dim=1)
    model.weight_norm = nn.Parameter(weight_norm)
    w1, w2 = torch.full((3, 3), 0.5), torch.full((3, 3), 0.25)
    expected = (torch.ones(3, 3) @ w1.T @ w2.T).sum() + (torch.linalg.norm(w1, dim=1) + torch.linalg.norm(w2, dim=1)).sum()
    loss = model(torch.ones(3, 3))
    s.check.close(loss, expected, "loss with the new parameter's values")
    loss.backward()
    s.check.true(is_dtensor(model.weight_norm) and model.weight_norm.grad is not None,
                 f"weight_norm after backward: {type(model.weight_norm).__name__}")


@SC.register("1d_process_group_init", 4, SRC + "TestFullyShardProcessGroupInit.test_1d_process_group_init",
             "a DP mesh made by DeviceMesh.from_group(dp group) equals the sub-mesh of a (dp, tp) mesh, and "
             "fully_shard on it gives the same loss, shards and gradient shards")
def process_group_init_1d(s):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    global_mesh = init_device_mesh("cpu", (2, s.world_size // 2), mesh_dim_names=("dp", "tp"))
    ref_dp_mesh, tp_mesh = global_mesh["dp"], global_mesh["tp"]
    dp_mesh = DeviceMesh.from_group(ref_dp_mesh.get_group(0), "cpu", mesh_dim_names=("dp",))
    s.check.equal(dp_mesh.mesh, ref_dp_mesh.mesh, "mesh tensor")
    torch.manual_seed(42)
    ref = MLP(8)
    with torch.no_grad():
        for p in ref.parameters():
            dist.broadcast(p, src=0)
    model = copy.deepcopy(ref)
    for module in (ref.in_proj, ref.out_proj, ref):
        s.fully_shard(module, mesh=ref_dp_mesh)
    for module in (model.in_proj, model.out_proj, model):
        s.fully_shard(module, mesh=dp_mesh)
    inp = torch.randn((4, 8))
    dist.broadcast(inp, src=tp_mesh.mesh[0].item(), group=tp_mesh.get_group(0))  # the same within a TP pair
    ref_loss = ref(inp).sum()
    ref_loss.backward()
    loss = model(inp).sum()
    loss.backward()
    s.check.equal(loss, ref_loss, "loss")
    for p, r in zip(model.parameters(), ref.parameters()):
        s.check.equal(p.to_local(), r.to_local(), "shard")
        s.check.equal(p.device_mesh.mesh, r.device_mesh.mesh, "mesh")
        s.check.equal(p.grad.to_local(), r.grad.to_local(), "gradient shard")


@SC.register("2d_process_group_init", 4, SRC + "TestFullyShardProcessGroupInit.test_2d_process_group_init",
             "an HSDP mesh built by DeviceMesh.from_group from replicate and shard groups (dist.new_group) equals "
             "init_device_mesh's, and fully_shard on it gives the same loss, parameters and gradients")
def process_group_init_2d(s):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    shard_size, names = 2, ("replicate", "shard")
    replicate_size = s.world_size // shard_size
    ref_mesh = init_device_mesh("cpu", (replicate_size, shard_size), mesh_dim_names=names)
    shard_group = replicate_group = None
    for r in range(replicate_size):  # shard groups: consecutive ranks
        ranks = list(range(r * shard_size, (r + 1) * shard_size))
        g = dist.new_group(ranks)
        shard_group = g if s.rank in ranks else shard_group
    for c in range(shard_size):  # replicate groups: strided ranks
        ranks = list(range(c, s.world_size, shard_size))
        g = dist.new_group(ranks)
        replicate_group = g if s.rank in ranks else replicate_group
    mesh_tensor = torch.arange(s.world_size, dtype=torch.int).view(replicate_size, shard_size)
    mesh = DeviceMesh.from_group([replicate_group, shard_group], "cpu", mesh_dim_names=names, mesh=mesh_tensor)
    s.check.equal(mesh.mesh, ref_mesh.mesh, "mesh tensor")
    for name in names:
        s.check.equal(dist.get_process_group_ranks(mesh[name].get_group()),
                      dist.get_process_group_ranks(ref_mesh[name].get_group()), f"{name} group ranks")
    torch.manual_seed(42)
    ref = MLP(8)
    with torch.no_grad():
        for p in ref.parameters():
            dist.broadcast(p, src=0)
    model = copy.deepcopy(ref)
    for module in (ref.in_proj, ref.out_proj, ref):
        s.fully_shard(module, mesh=ref_mesh)
    for module in (model.in_proj, model.out_proj, model):
        s.fully_shard(module, mesh=mesh)
    inp = torch.randn((4, 8))
    ref_loss = ref(inp).sum()
    ref_loss.backward()
    loss = model(inp).sum()
    loss.backward()
    s.check.equal(loss, ref_loss, "loss")
    for p, r in zip(model.parameters(), ref.parameters()):
        s.check.equal(tuple(p.placements), tuple(r.placements), "placements")
        s.check.equal(p.to_local(), r.to_local(), "shard")
        s.check.equal(p.grad.to_local(), r.grad.to_local(), "gradient shard")


@SC.register("hsdp_broadcast_across_replicas", 4, SRC + "TestFullyShardHSDPBroadcast.test_hsdp_broadcast_across_replicas",
             "HSDP shards (and a buffer) made to differ across replicas, then broadcast over the replicate group "
             "from its first rank: replicas equal, an iteration runs")
def hsdp_broadcast_across_replicas(s):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = Transformer(n_layers=2)
    model.buf = torch.nn.Buffer(torch.randn((16,)))
    shard_blocks(s, model, mesh=mesh)
    if mesh.get_local_rank("replicate") > 0:
        for t in itertools.chain(model.parameters(), model.buffers()):
            t.detach().fill_(1337)
    group = mesh.get_group("replicate")

    def replicas(t):
        local = t.to_local() if is_dtensor(t) else t
        out = [torch.empty_like(local) for _ in range(mesh["replicate"].size())]
        dist.all_gather(out, local.contiguous(), group=group)
        return out

    for t in itertools.chain(model.parameters(), model.buffers()):
        gathered = replicas(t)
        s.check.true(all(not torch.equal(o, gathered[0]) for o in gathered[1:] if o.numel()),
                     "replicas equal before the broadcast")
    src = dist.get_process_group_ranks(group)[0]
    for t in itertools.chain(model.parameters(), model.buffers()):
        dist.broadcast(t.to_local() if is_dtensor(t) else t, src=src, group=group)
    for t in itertools.chain(model.parameters(), model.buffers()):
        gathered = replicas(t)
        s.check.true(all(torch.equal(o, gathered[0]) for o in gathered[1:]), "replicas differ after the broadcast")
    model(tokens(model, 2)).sum().backward()
    s.check.true(all(p.grad is not None for p in model.parameters()), "no gradient after the iteration")


OUT = Outcomes(SC, timeout=240)


def test_the_docstring_table_lists_every_scenario():
    assert SC.missing_from(__doc__) == []


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize("system,name,world_size", SC.cases())
def test_scenario(system, name, world_size):
    failures = OUT.failures(system, name, world_size)
    assert failures is None, failures
