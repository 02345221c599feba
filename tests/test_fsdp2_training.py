"""FSDP2's training behaviour (PyTorch's test_fully_shard_training.py, with the ignored-parameter
composition of test_fully_shard_ignore_params.py), on `torch` and `zerokit` alike.

Every scenario is one body run on both systems (tests/fsdp2_scenarios.py says how: one launch
per world size and system, checks that record and go on, public API only). References are
independent: torch's DistributedDataParallel, or a replicated copy of the model whose gradients
are all-reduced by hand, compared with the tolerances of PyTorch's assertEqual (fp32: rtol
1.3e-6, atol 1e-5). Models are small versions of PyTorch's (fewer layers, dim 16).

Public stand-ins for what PyTorch's bodies read privately:
- `_assert_dtensor_params` / registration after forward: `isinstance(p, DTensor)` of the
  module's registered parameters (an unsharded parameter is a plain tensor);
- `check_sharded_parity`: each local shard against torch.chunk of the reference parameter;
- `param_group.is_unsharded` (reshard toggle): whether head.weight is registered as a plain
  (unsharded) tensor or a DTensor;
- comm counts of gradient accumulation: CommDebugMode, as PyTorch's test.
Left out (see the report): the CUDA-only ones (delays/device_sleep, post-optim events, CUDA
graphs, streams of share_comm_ctx), shard_placement_fn (not required), TP/EP meshes (2-D
with tensor parallel), `_set_unshard_async_op` (private), reset_iter_state and
set_unshard_in_backward (not in the contract), world size 1 and 8.

Scenarios (name, world size N, <- the PyTorch test it ports; then what it asserts):

- single_group_16_15_8 (N=2) <- test_fully_shard_training.py::TestFullyShard1DTrainingCore.test_train_parity_single_group_shard_dim0
    one fully_shard on the root: each rank's loss equals DDP's every Adam step (3)
- single_group_7_15_3 (N=2) <- test_fully_shard_training.py::TestFullyShard1DTrainingCore.test_train_parity_single_group_shard_dim0
    one fully_shard on the root: each rank's loss equals DDP's every Adam step (3)
- single_group_16_17_8 (N=2) <- test_fully_shard_training.py::TestFullyShard1DTrainingCore.test_train_parity_single_group_shard_dim0
    one fully_shard on the root: each rank's loss equals DDP's every Adam step (3)
- multi_group_reshard_True (N=2) <- test_fully_shard_training.py::TestFullyShard1DTrainingCore.test_train_parity_multi_group
    a block per fully_shard then the root: the loss equals DDP's every step
- multi_group_reshard_False (N=2) <- test_fully_shard_training.py::TestFullyShard1DTrainingCore.test_train_parity_multi_group
    a block per fully_shard then the root: the loss equals DDP's every step
- multi_group_reshard_2 (N=4) <- test_fully_shard_training.py::TestFullyShard1DTrainingCore.test_train_parity_multi_group
    reshard_after_forward=2 (hpZ, resharded to groups of 2 of 4): the loss equals DDP's every step
- multi_group_cpu_offload (N=2) <- test_fully_shard_training.py::TestFullyShard1DTrainingCore.test_train_parity_multi_group_cpu_offload_eager
    CPUOffloadPolicy(pin_memory=False) on CPU: the loss equals DDP's; shards and gradients on the CPU
- non_root_forward_backward (N=2) <- test_fully_shard_training.py::TestFullyShard1DTrainingCore.test_non_root_forward_backward
    a forward/backward through the root, then one through model[0] alone: losses equal a replicated
    model with all-reduced gradients
- multi_forward_module_reshard_True (N=2) <- test_fully_shard_training.py::TestFullyShard1DTrainingCore.test_multi_forward_module
    a module run twice in one forward: the loss equals DDP's every step (reshard_after_forward passed to
    both calls, which torch's body leaves at its default)
- multi_forward_module_reshard_False (N=2) <- test_fully_shard_training.py::TestFullyShard1DTrainingCore.test_multi_forward_module
    a module run twice in one forward: the loss equals DDP's every step (reshard_after_forward passed to
    both calls, which torch's body leaves at its default)
- multi_forward_module_reshard_2 (N=2) <- test_fully_shard_training.py::TestFullyShard1DTrainingCore.test_multi_forward_module
    a module run twice in one forward: the loss equals DDP's every step (reshard_after_forward passed to
    both calls, which torch's body leaves at its default)
- explicit_prefetching (N=2) <- test_fully_shard_training.py::TestFullyShard1DTrainingCore.test_explicit_prefetching
    set_modules_to_forward/backward_prefetch of the next/previous two blocks: the loss equals DDP's
    (AdamW) every step
- to_float64_after_init (N=2) <- test_fully_shard_training.py::TestFullyShardCastAfterInit.test_to_float64_after_init
    model.to(float64) after fully_shard: parameters, shards and gradients float64; sharded parity with a
    replicated float64 DDP model every step
- param_registration_after_forward (N=2) <- test_fully_shard_training.py::TestFullyShardRegisteredParams.test_param_registration_after_forward
    after forward the registered parameters are DTensors iff the module resharded (True, 2; False and
    None keep the root's unsharded), values unchanged; reshard() registers the DTensors again
- param_registration_after_backward (N=2) <- test_fully_shard_training.py::TestFullyShardRegisteredParams.test_param_registration_after_backward
    after backward every registered parameter is a DTensor again (True, False, 2; one group and three)
- root_no_forward_inputs (N=2) <- test_fully_shard_training.py::TestFullyShardForwardInputs.test_root_no_forward_inputs
    a root whose forward takes no inputs: output (4, 4), backward gives a DTensor gradient
- root_forward_tuple_input (N=2) <- test_fully_shard_training.py::TestFullyShardForwardInputs.test_root_move_forward_input_to_device
    a parameter-less root given a tensor and a tuple of tensors: its output is x + ys[0] + ys[1] + 1 on
    CPU
- unshard_async_handle_and_reshard (N=2) <- derived from test_fully_shard_training.py::TestFullyShardRegisteredParams and TestFullyShardGradientAccumulation.test_1f1b_microbatching (explicit unshard)
    unshard(async_op=True) returns a handle whose wait() leaves the full parameters registered (plain
    tensors equal to full_tensor()); unshard() returns None; reshard() registers the DTensors again; the
    next forward/backward equals the unsharded model's
- shared_params_reshard_False (N=2) <- test_fully_shard_training.py::TestFullyShardSharedParams.test_train_parity_with_shared_params
    output tied to the token embedding (in the root): the loss equals DDP's every step
- shared_params_reshard_True (N=2) <- test_fully_shard_training.py::TestFullyShardSharedParams.test_train_parity_with_shared_params
    output tied to the token embedding (in the root): the loss equals DDP's every step
- shared_params_uneven_shard_reshard_True (N=4) <- test_fully_shard_training.py::TestFullyShardSharedParams.test_train_shared_params_uneven_shard
    tied embedding/output of 17 rows in one grouped fully_shard([a, b]) on 4 ranks: unshard() registers
    the full weight, every row changes in 3 AdamW steps
- shared_params_uneven_shard_reshard_False (N=4) <- test_fully_shard_training.py::TestFullyShardSharedParams.test_train_shared_params_uneven_shard
    tied embedding/output of 17 rows in one grouped fully_shard([a, b]) on 4 ranks: unshard() registers
    the full weight, every row changes in 3 AdamW steps
- shared_params_separate_groups_error (N=2) <- test_fully_shard_training.py::TestFullyShardSharedParams.test_shared_params_separate_fsdp_groups_error
    a tied parameter in two separate fully_shard calls: the first forward raises ValueError
- layer_by_layer_shard (N=2) <- test_fully_shard_training.py::TestFullyShardSharedParams.test_layer_by_layer_shard_no_false_positive
    blocks built and sharded one at a time with gc in between: forward/backward runs, every gradient a
    DTensor
- gradient_accumulation_all_reshard_True (N=2) <- test_fully_shard_training.py::TestFullyShardGradientAccumulation.test_gradient_accumulation
    3 microbatches with gradient sync off but the last (mode all, raf True, rab True): losses equal a
    replicated reference, all-gather / reduce-scatter / all-reduce counts per step by torch's formula,
    sharded parity of parameters and accumulated gradients
- gradient_accumulation_all_no_reshard (N=2) <- test_fully_shard_training.py::TestFullyShardGradientAccumulation.test_gradient_accumulation
    3 microbatches with gradient sync off but the last (mode all, raf False, rab False): losses equal a
    replicated reference, all-gather / reduce-scatter / all-reduce counts per step by torch's formula,
    sharded parity of parameters and accumulated gradients
- gradient_accumulation_all_reshard_2 (N=4) <- test_fully_shard_training.py::TestFullyShardGradientAccumulation.test_gradient_accumulation
    3 microbatches with gradient sync off but the last (mode all, raf 2, rab True): losses equal a
    replicated reference, all-gather / reduce-scatter / all-reduce counts per step by torch's formula,
    sharded parity of parameters and accumulated gradients
- gradient_accumulation_root_only_reshard_True (N=2) <- test_fully_shard_training.py::TestFullyShardGradientAccumulation.test_gradient_accumulation
    3 microbatches with gradient sync off but the last (mode root_only, raf True, rab True): losses
    equal a replicated reference, all-gather / reduce-scatter / all-reduce counts per step by torch's
    formula, sharded parity of parameters and accumulated gradients
- gradient_accumulation_root_only_no_reshard (N=2) <- test_fully_shard_training.py::TestFullyShardGradientAccumulation.test_gradient_accumulation
    3 microbatches with gradient sync off but the last (mode root_only, raf False, rab False): losses
    equal a replicated reference, all-gather / reduce-scatter / all-reduce counts per step by torch's
    formula, sharded parity of parameters and accumulated gradients
- gradient_accumulation_some_mlps (N=2) <- test_fully_shard_training.py::TestFullyShardGradientAccumulation.test_gradient_accumulation
    3 microbatches with gradient sync off but the last (mode some_mlps, raf True, rab True): losses
    equal a replicated reference, all-gather / reduce-scatter / all-reduce counts per step by torch's
    formula, sharded parity of parameters and accumulated gradients
- gradient_accumulation_some_mlps_reshard_2 (N=4) <- test_fully_shard_training.py::TestFullyShardGradientAccumulation.test_gradient_accumulation
    3 microbatches with gradient sync off but the last (mode some_mlps, raf 2, rab True): losses equal a
    replicated reference, all-gather / reduce-scatter / all-reduce counts per step by torch's formula,
    sharded parity of parameters and accumulated gradients
- gradient_accumulation_cpu_offload (N=2) <- test_fully_shard_training.py::TestFullyShardGradientAccumulation.test_gradient_accumulation
    3 microbatches with gradient sync off but the last (mode all, raf True, rab True, CPU offload):
    losses equal a replicated reference, all-gather / reduce-scatter / all-reduce counts per step by
    torch's formula, sharded parity of parameters and accumulated gradients
- gradient_accumulation_hsdp_all (N=4) <- test_fully_shard_training.py::TestFullyShardGradientAccumulation.test_gradient_accumulation
    3 microbatches with gradient sync off but the last (mode all, raf True, rab True, HSDP 2x2): losses
    equal a replicated reference, all-gather / reduce-scatter / all-reduce counts per step by torch's
    formula, sharded parity of parameters and accumulated gradients
- gradient_accumulation_hsdp_reduce_scatter_only (N=4) <- test_fully_shard_training.py::TestFullyShardGradientAccumulation.test_gradient_accumulation
    3 microbatches with gradient sync off but the last (mode all, raf True, rab True, HSDP 2x2,
    set_requires_all_reduce): losses equal a replicated reference, all-gather / reduce-scatter /
    all-reduce counts per step by torch's formula, sharded parity of parameters and accumulated
    gradients
- gradient_accumulation_hsdp_root_only_no_reshard (N=4) <- test_fully_shard_training.py::TestFullyShardGradientAccumulation.test_gradient_accumulation
    3 microbatches with gradient sync off but the last (mode root_only, raf False, rab False, HSDP 2x2):
    losses equal a replicated reference, all-gather / reduce-scatter / all-reduce counts per step by
    torch's formula, sharded parity of parameters and accumulated gradients
- 1f1b_microbatching_unshard_False_reshard_after_backward_False (N=2) <- test_fully_shard_training.py::TestFullyShardGradientAccumulation.test_1f1b_microbatching
    1F1B-style microbatches (set_requires_gradient_sync/set_is_last_backward on the last,
    set_reshard_after_backward on the last): losses and the stepped shards equal a replicated reference
- 1f1b_microbatching_unshard_False_reshard_after_backward_True (N=2) <- test_fully_shard_training.py::TestFullyShardGradientAccumulation.test_1f1b_microbatching
    1F1B-style microbatches (set_requires_gradient_sync/set_is_last_backward on the last,
    set_reshard_after_backward default): losses and the stepped shards equal a replicated reference
- 1f1b_microbatching_unshard_True_reshard_after_backward_False (N=2) <- test_fully_shard_training.py::TestFullyShardGradientAccumulation.test_1f1b_microbatching
    1F1B-style microbatches (set_requires_gradient_sync/set_is_last_backward on the last,
    unshard(async_op=True) up front, set_reshard_after_backward on the last): losses and the stepped
    shards equal a replicated reference
- 1f1b_microbatching_unshard_True_reshard_after_backward_True (N=2) <- test_fully_shard_training.py::TestFullyShardGradientAccumulation.test_1f1b_microbatching
    1F1B-style microbatches (set_requires_gradient_sync/set_is_last_backward on the last,
    unshard(async_op=True) up front, set_reshard_after_backward default): losses and the stepped shards
    equal a replicated reference
- hsdp_parity_dim3_reshard_False_sync_last_True (N=4) <- test_fully_shard_training.py::TestFullyShardHSDPTraining.test_train_parity_hsdp
    HSDP on a (2, 2) mesh with CPUOffloadPolicy: placements (Replicate(), Shard(0)), 3 microbatches
    (sync on the last only), losses equal DDP's and sharded parity before and after each step
- hsdp_parity_dim16_reshard_True_sync_last_False (N=4) <- test_fully_shard_training.py::TestFullyShardHSDPTraining.test_train_parity_hsdp
    HSDP on a (2, 2) mesh with CPUOffloadPolicy: placements (Replicate(), Shard(0)), 3 microbatches
    (sync every one), losses equal DDP's and sharded parity before and after each step
- hsdp_parity_dim17_reshard_True_sync_last_True (N=4) <- test_fully_shard_training.py::TestFullyShardHSDPTraining.test_train_parity_hsdp
    HSDP on a (2, 2) mesh with CPUOffloadPolicy: placements (Replicate(), Shard(0)), 3 microbatches
    (sync on the last only), losses equal DDP's and sharded parity before and after each step
- hsdp_parity_dim17_reshard_False_sync_last_False (N=4) <- test_fully_shard_training.py::TestFullyShardHSDPTraining.test_train_parity_hsdp
    HSDP on a (2, 2) mesh with CPUOffloadPolicy: placements (Replicate(), Shard(0)), 3 microbatches
    (sync every one), losses equal DDP's and sharded parity before and after each step
- register_fsdp_forward_method (N=2) <- test_fully_shard_training.py::TestFullyShardCustomForwardMethod.test_register_fsdp_forward_method
    the parent calls vit.forward_features (not forward), registered with register_fsdp_forward_method:
    loss equals the unsharded model's, gradients equal its all-reduced ones
- ignored_params_ddp_fsdp_ddp (N=2) <- test_fully_shard_ignore_params.py::TestFullyShardIgnoreParams.test_ddp_A_fsdp_B_ddp_C
    fully_shard on module_b and lin_b with module_c's parameters ignored, DDP over the whole (ignoring
    FSDP's): FSDP modules {module_b, module_b.lin_b}, module_c plain tensors, loss and full parameters
    equal a DDP model's for 3 Adam steps
- ignored_params_stay_local (N=2) <- test_fully_shard_init.py::TestFullyShardDeviceTensor.test_move_states_to_device_ignored_param_device (the ignored-parameter half)
    ignored_params (out_proj): those stay plain nn.Parameters with each rank's own gradient, the rest
    are DTensors with the all-reduced gradient's shards
- replicate_inside_fully_shard (N=2) <- test_fully_shard_init.py::TestFullyShardManagedModulesAndStates.test_managed_modules_nested_fully_shard_and_replicate, trained as test_fully_shard_training.py's parity
    replicate(model[0]) and fully_shard(model[2]) under fully_shard(model): the root's all-gather
    carries model[1]'s parameters only, model[0]'s stay plain tensors (replicate all-reduces them), and
    the loss and every parameter equal DDP's for 3 Adam steps
- non_persistent_buffers (N=2) <- derived from test_fully_shard_training.py (train parity) and test_fully_shard_state_dict.py
    a persistent and a non-persistent buffer: both stay plain tensors, state_dict() keeps the persistent
    one only (a plain tensor), the loss equals DDP's for 3 steps
- double_forward_nested_reshard_True (N=2) <- test_fully_shard_training.py::TestFullyShard1DTrainingCompose.test_double_forward_with_nested_fsdp_and_checkpoint (without checkpointing)
    nested fully_shard (attention, feed-forward, block, root), two forwards then one backward of a
    DPO-style loss: every parameter gets a gradient, its shard equals the replicated model's all-reduced
    one (rtol 1e-5, atol 1e-4: a squared difference of sums)
- double_forward_nested_reshard_False (N=2) <- test_fully_shard_training.py::TestFullyShard1DTrainingCompose.test_double_forward_with_nested_fsdp_and_checkpoint (without checkpointing)
    nested fully_shard (attention, feed-forward, block, root), two forwards then one backward of a
    DPO-style loss: every parameter gets a gradient, its shard equals the replicated model's all-reduced
    one (rtol 1e-5, atol 1e-4: a squared difference of sums)
- double_partial_forward_then_backward (N=2) <- test_fully_shard_training.py::TestFullyShard1DTrainingCompose.test_double_partial_forward_then_backward
    two forwards that skip the head of a grouped fully_shard([norm, head]) before one backward: embed
    and norm get finite gradients, head none
- partial_group_standalone_reshard_True_tied_False_none (N=2) <- test_fully_shard_training.py::TestFullyShard1DTrainingCompose.test_partial_group_forward_then_standalone
    the forward skips head (grouped with norm), then head runs alone per chunk: each chunk adds to
    head's gradient, output dtype per policy, loss, head gradient and shards equal a replicated
    reference
- partial_group_standalone_reshard_False_tied_True_none (N=2) <- test_fully_shard_training.py::TestFullyShard1DTrainingCompose.test_partial_group_forward_then_standalone
    the forward skips head (grouped with norm), then head runs alone per chunk: each chunk adds to
    head's gradient, output dtype per policy, loss, head gradient and shards equal a replicated
    reference
- partial_group_standalone_reshard_True_tied_False_bf16_inner_only (N=2) <- test_fully_shard_training.py::TestFullyShard1DTrainingCompose.test_partial_group_forward_then_standalone
    the forward skips head (grouped with norm), then head runs alone per chunk: each chunk adds to
    head's gradient, output dtype per policy
- partial_group_grad_accum_chunked_reshard_True (N=2) <- test_fully_shard_training.py::TestFullyShard1DTrainingCompose.test_partial_group_forward_grad_accum_chunked
    chunked head and 3 microbatches with set_requires_gradient_sync/set_is_last_backward: grouped
    fully_shard([norm, head]) accumulates the same gradient shards as separate calls
- partial_group_grad_accum_chunked_reshard_False (N=2) <- test_fully_shard_training.py::TestFullyShard1DTrainingCompose.test_partial_group_forward_grad_accum_chunked
    chunked head and 3 microbatches with set_requires_gradient_sync/set_is_last_backward: grouped
    fully_shard([norm, head]) accumulates the same gradient shards as separate calls
- partial_group_reshard_toggle_tied_False_initial_False (N=2) <- test_fully_shard_training.py::TestFullyShard1DTrainingCompose.test_partial_group_reshard_toggle
    set_reshard_after_forward/backward(False) on head for a chunk loop, then True and head.reshard():
    head stays unsharded (a plain tensor) through the loop, a DTensor after reshard(), every parameter
    gets a gradient
- partial_group_reshard_toggle_tied_True_initial_True (N=2) <- test_fully_shard_training.py::TestFullyShard1DTrainingCompose.test_partial_group_reshard_toggle
    set_reshard_after_forward/backward(False) on head for a chunk loop, then True and head.reshard():
    head stays unsharded (a plain tensor) through the loop, a DTensor after reshard(), every parameter
    gets a gradient
- activation_checkpointing_reshard_True (N=2) <- test_fully_shard_training.py::TestFullyShard1DTrainingCompose.test_train_parity_with_activation_checkpointing (utils, block grouping)
    blocks under torch.utils.checkpoint, tied output: loss and sharded parity with DDP every step
- activation_checkpointing_reshard_False (N=2) <- test_fully_shard_training.py::TestFullyShard1DTrainingCompose.test_train_parity_with_activation_checkpointing (utils, block grouping)
    blocks under torch.utils.checkpoint, tied output: loss and sharded parity with DDP every step
"""

import copy
import functools
import gc
import itertools
from collections import defaultdict

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fsdp2_scenarios import (ITERATIONS, MLP, Outcomes, Scenarios, Transformer, all_reduce_grads, broadcast_module,
                             comm_counts, ddp, is_dtensor, shard_blocks, sharded_parity, tokens, train_parity)

SC = Scenarios()
SRC = "test_fully_shard_training.py::"


def _mesh(world_size, hsdp=False):
    from torch.distributed.device_mesh import init_device_mesh

    if hsdp:
        return init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    return init_device_mesh("cpu", (world_size,))


def _offload(cpu):
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    return CPUOffloadPolicy(pin_memory=False) if cpu else OffloadPolicy()


def _adam(model, **kw):
    return torch.optim.Adam(model.parameters(), lr=1e-2, **kw)


# ---- train parity with DDP


def single_group(s, lin_shapes):
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(*lin_shapes[0]), nn.ReLU(), nn.Linear(*lin_shapes[1]))
    ref = ddp(copy.deepcopy(model))
    ref_optim = _adam(ref)
    s.fully_shard(model)
    optim = _adam(model)
    torch.manual_seed(42 + s.rank + 1)
    inp = torch.randn((4, lin_shapes[0][0]))
    train_parity(s, ref, ref_optim, model, optim, lambda it: inp, what=f"{lin_shapes}")


for shapes in ([(16, 15), (15, 8)], [(7, 15), (15, 3)], [(16, 17), (17, 8)]):
    SC.add(f"single_group_{shapes[0][0]}_{shapes[0][1]}_{shapes[1][1]}", 2,
           SRC + "TestFullyShard1DTrainingCore.test_train_parity_single_group_shard_dim0",
           "one fully_shard on the root: each rank's loss equals DDP's every Adam step (3)", single_group,
           lin_shapes=shapes)


def multi_group(s, reshard_after_forward, cpu_offload=False):
    torch.manual_seed(42)
    model = Transformer(vocab_size=32, n_layers=2)
    ref = ddp(copy.deepcopy(model))
    ref_optim = _adam(ref)
    shard_blocks(s, model, mesh=_mesh(s.world_size), reshard_after_forward=reshard_after_forward,
                 offload_policy=_offload(cpu_offload))
    optim = _adam(model)
    torch.manual_seed(42 + s.rank + 1)
    train_parity(s, ref, ref_optim, model, optim, lambda it: tokens(model, 3), what=f"raf={reshard_after_forward}")
    if cpu_offload:  # FSDP2 on a CPU device with CPUOffloadPolicy: shards and gradients stay on the CPU
        model(tokens(model, 3)).sum().backward()
        s.check.true(all(p.to_local().device.type == "cpu" and p.grad.to_local().device.type == "cpu"
                         for p in model.parameters()), "offloaded shards or gradients off the CPU")


for raf in (True, False):
    SC.add(f"multi_group_reshard_{raf}", 2, SRC + "TestFullyShard1DTrainingCore.test_train_parity_multi_group",
           "a block per fully_shard then the root: the loss equals DDP's every step", multi_group,
           reshard_after_forward=raf)
SC.add("multi_group_reshard_2", 4, SRC + "TestFullyShard1DTrainingCore.test_train_parity_multi_group",
       "reshard_after_forward=2 (hpZ, resharded to groups of 2 of 4): the loss equals DDP's every step",
       multi_group, reshard_after_forward=2)
SC.add("multi_group_cpu_offload", 2,
       SRC + "TestFullyShard1DTrainingCore.test_train_parity_multi_group_cpu_offload_eager",
       "CPUOffloadPolicy(pin_memory=False) on CPU: the loss equals DDP's; shards and gradients on the CPU",
       multi_group, reshard_after_forward=True, cpu_offload=True)


@SC.register("non_root_forward_backward", 2, SRC + "TestFullyShard1DTrainingCore.test_non_root_forward_backward",
             "a forward/backward through the root, then one through model[0] alone: losses equal a "
             "replicated model with all-reduced gradients")
def non_root_forward_backward(s):
    torch.manual_seed(42)
    lin_dim = 16
    model = nn.Sequential(*[MLP(lin_dim) for _ in range(3)])
    ref = copy.deepcopy(model)
    ref_optim = _adam(ref)
    for mlp in model:
        s.fully_shard(mlp)
    s.fully_shard(model)
    optim = _adam(model, foreach=True)
    torch.manual_seed(42 + s.rank)
    inp = torch.randn((8, lin_dim))

    ref_root_loss = ref(inp).sum()
    ref_root_loss.backward()
    all_reduce_grads(ref)
    ref_optim.step()
    ref_optim.zero_grad()
    ref_nonroot_loss = ref[0](inp).sum()
    ref_nonroot_loss.backward()
    all_reduce_grads(ref)
    ref_optim.step()

    root_loss = model(inp).sum()
    root_loss.backward()
    optim.step()
    optim.zero_grad()
    nonroot_loss = model[0](inp).sum()
    nonroot_loss.backward()
    optim.step()
    s.check.close(root_loss, ref_root_loss, "root loss")
    s.check.close(nonroot_loss, ref_nonroot_loss, "non-root loss")
    s.check.close(model(inp).sum(), ref(inp).sum(), "loss after both steps")


class MultiForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.outer = nn.Linear(4, 5)

    def forward(self, x):
        return self.outer(self.inner(x) + self.inner(x))


def multi_forward_module(s, reshard_after_forward):
    torch.manual_seed(42)
    model = MultiForward()
    ref = ddp(copy.deepcopy(model))
    ref_optim = _adam(ref)
    s.fully_shard(model.inner, reshard_after_forward=reshard_after_forward)
    s.fully_shard(model, reshard_after_forward=reshard_after_forward)
    optim = _adam(model)
    torch.manual_seed(42 + s.rank)
    inp = torch.randn((32, 4))
    train_parity(s, ref, ref_optim, model, optim, lambda it: inp, what=f"raf={reshard_after_forward}")


for raf in (True, False, 2):
    SC.add(f"multi_forward_module_reshard_{raf}", 2, SRC + "TestFullyShard1DTrainingCore.test_multi_forward_module",
           "a module run twice in one forward: the loss equals DDP's every step (reshard_after_forward passed "
           "to both calls, which torch's body leaves at its default)", multi_forward_module,
           reshard_after_forward=raf)


@SC.register("explicit_prefetching", 2, SRC + "TestFullyShard1DTrainingCore.test_explicit_prefetching",
             "set_modules_to_forward/backward_prefetch of the next/previous two blocks: the loss equals DDP's "
             "(AdamW) every step")
def explicit_prefetching(s):
    torch.manual_seed(42)
    model = Transformer(n_layers=4)
    ref = ddp(copy.deepcopy(model))
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    shard_blocks(s, model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    n = 2
    for i, layer in enumerate(model.layers):
        if i < len(model.layers) - n:
            layer.set_modules_to_forward_prefetch([model.layers[i + j] for j in range(1, n + 1)])
    for i, layer in enumerate(model.layers):
        if i >= n:
            layer.set_modules_to_backward_prefetch([model.layers[i - j] for j in range(1, n + 1)])
    torch.manual_seed(42 + s.rank)
    inp = tokens(model, 2)
    for _ in range(ITERATIONS):
        losses = []
        for m, o in ((ref, ref_optim), (model, optim)):
            o.zero_grad()
            losses.append(m(inp).sum())
            losses[-1].backward()
            o.step()
        s.check.close(losses[1], losses[0], "loss")


@SC.register("to_float64_after_init", 2, SRC + "TestFullyShardCastAfterInit.test_to_float64_after_init",
             "model.to(float64) after fully_shard: parameters, shards and gradients float64; sharded parity with "
             "a replicated float64 DDP model every step")
def to_float64_after_init(s):
    torch.manual_seed(42)
    dim, dtype = 4, torch.float64
    model = MLP(dim)
    broadcast_module(model)
    ref_model = copy.deepcopy(model).to(dtype)
    ref = ddp(ref_model)
    ref_optim = _adam(ref)
    for module in (model.in_proj, model.out_proj, model):
        s.fully_shard(module)
    model.to(dtype)
    for p in model.parameters():
        s.check.true(p.dtype == dtype and p.to_local().dtype == dtype, f"after .to: {p.dtype} {p.to_local().dtype}")
    optim = _adam(model, foreach=True)
    sharded_parity(s, ref_model, model, "before training")
    torch.manual_seed(42 + s.rank + 1)
    inp = torch.randn((2, dim), dtype=dtype)
    for it in range(ITERATIONS):
        losses = []
        for m in (ref, model):
            losses.append(m(inp).sum())
            losses[-1].backward()
        s.check.close(losses[1], losses[0], f"loss {it}")
        sharded_parity(s, ref_model, model, f"iteration {it}")
        for p in model.parameters():
            s.check.true(p.dtype == dtype and p.grad.dtype == dtype and p.grad.to_local().dtype == dtype,
                         f"gradient dtype {p.grad.dtype}")
        for o in (ref_optim, optim):
            o.step()
            o.zero_grad(set_to_none=it % 2 == 0)


# ---- which parameters are registered when


def _same_params(s, params, ref_params, what):
    params, ref_params = list(params), list(ref_params)
    s.check.equal(len(params), len(ref_params), f"{what}: parameter count")
    for p, r in zip(params, ref_params):
        full = p.full_tensor() if is_dtensor(p) else p
        s.check.close(full.detach(), r.detach(), f"{what}: values")


def _all_dtensor(s, params, want, what):
    params = list(params)
    s.check.true(len(params) > 0, f"{what}: no parameters")
    kinds = [is_dtensor(p) for p in params]
    s.check.true(all(k == want for k in kinds), f"{what}: DTensor {kinds}, expected all {want}")


@SC.register("param_registration_after_forward", 2,
             "test_fully_shard_training.py::TestFullyShardRegisteredParams.test_param_registration_after_forward",
             "after forward the registered parameters are DTensors iff the module resharded (True, 2; False and "
             "None keep the root's unsharded), values unchanged; reshard() registers the DTensors again")
def param_registration_after_forward(s):
    for raf in (True, False, 2, None):  # one group: the root only
        torch.manual_seed(42)
        model = MLP(3)
        broadcast_module(model)
        ref = copy.deepcopy(model)
        s.fully_shard(model, reshard_after_forward=raf)
        inp = torch.randn((2, 3))
        _all_dtensor(s, model.parameters(), True, f"root {raf}, before forward")
        _same_params(s, model.parameters(), ref.parameters(), f"root {raf}, before forward")
        model(inp)
        _all_dtensor(s, model.parameters(), bool(raf), f"root {raf}, after forward")
        _same_params(s, model.parameters(), ref.parameters(), f"root {raf}, after forward")
        model.reshard()
        _all_dtensor(s, model.parameters(), True, f"root {raf}, after reshard()")
        _same_params(s, model.parameters(), ref.parameters(), f"root {raf}, after reshard()")
    for raf in (True, False, 2, None):  # three groups
        torch.manual_seed(42)
        model = nn.Sequential(MLP(3), MLP(3))
        broadcast_module(model)
        ref = copy.deepcopy(model)
        s.fully_shard(model[0].in_proj, reshard_after_forward=raf)
        s.fully_shard(model[0].out_proj, reshard_after_forward=raf)
        s.fully_shard(model, reshard_after_forward=raf)
        _all_dtensor(s, model.parameters(), True, f"groups {raf}, before forward")
        model(torch.randn((2, 3)))
        non_root = list(model[0].in_proj.parameters()) + list(model[0].out_proj.parameters())
        root = [p for p in model.parameters() if all(p is not q for q in non_root)]
        if raf is None:
            _all_dtensor(s, non_root, True, "groups None, non-root after forward")
            _all_dtensor(s, root, False, "groups None, root after forward")
        else:
            _all_dtensor(s, non_root, bool(raf), f"groups {raf}, non-root after forward")
            _all_dtensor(s, root, bool(raf), f"groups {raf}, root after forward")
        _same_params(s, model.parameters(), ref.parameters(), f"groups {raf}, after forward")
        for module in model.modules():
            if isinstance(module, s.FSDPModule):
                module.reshard()
        _all_dtensor(s, model.parameters(), True, f"groups {raf}, after reshard()")
        _same_params(s, model.parameters(), ref.parameters(), f"groups {raf}, after reshard()")


@SC.register("param_registration_after_backward", 2,
             "test_fully_shard_training.py::TestFullyShardRegisteredParams.test_param_registration_after_backward",
             "after backward every registered parameter is a DTensor again (True, False, 2; one group and three)")
def param_registration_after_backward(s):
    for raf in (True, False, 2):
        model = MLP(8)
        s.fully_shard(model, reshard_after_forward=raf)
        inp = torch.randn((2, 8))
        model(inp).sum().backward()
        _all_dtensor(s, model.parameters(), True, f"root {raf}")
        model = MLP(8)
        s.fully_shard(model.in_proj, reshard_after_forward=raf)
        s.fully_shard(model.out_proj, reshard_after_forward=raf)
        s.fully_shard(model, reshard_after_forward=raf)
        model(inp).sum().backward()
        _all_dtensor(s, model.parameters(), True, f"groups {raf}")


@SC.register("root_no_forward_inputs", 2, SRC + "TestFullyShardForwardInputs.test_root_no_forward_inputs",
             "a root whose forward takes no inputs: output (4, 4), backward gives a DTensor gradient")
def root_no_forward_inputs(s):
    class ParameterOnly(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 4))

        def forward(self):
            return self.weight @ self.weight

    model = ParameterOnly()
    s.fully_shard(model)
    out = model()
    s.check.equal(tuple(out.shape), (4, 4), "output shape")
    out.sum().backward()
    s.check.true(is_dtensor(model.weight.grad), f"gradient {type(model.weight.grad).__name__}")


@SC.register("root_forward_tuple_input", 2, SRC + "TestFullyShardForwardInputs.test_root_move_forward_input_to_device",
             "a parameter-less root given a tensor and a tuple of tensors: its output is x + ys[0] + ys[1] + 1 on CPU")
def root_forward_tuple_input(s):
    class Paramless(nn.Module):
        def forward(self, x, ys):
            return x + (ys[0] + ys[1]) + 1

    model = Paramless()
    s.fully_shard(model)
    x, ys = torch.randn(3), (torch.randn(3), torch.randn(3))
    out = model(x, ys)
    s.check.close(out, x + (ys[0] + ys[1]) + 1, "output")
    s.check.equal(out.device.type, "cpu", "output device")


@SC.register("unshard_async_handle_and_reshard", 2, "derived from " + SRC + "TestFullyShardRegisteredParams and "
             "TestFullyShardGradientAccumulation.test_1f1b_microbatching (explicit unshard)",
             "unshard(async_op=True) returns a handle whose wait() leaves the full parameters registered (plain "
             "tensors equal to full_tensor()); unshard() returns None; reshard() registers the DTensors again; the "
             "next forward/backward equals the unsharded model's")
def unshard_async_handle_and_reshard(s):
    torch.manual_seed(42)
    model = Transformer(n_layers=2)
    ref = copy.deepcopy(model)
    shard_blocks(s, model)
    block = model.layers[0]
    full = {n: p.full_tensor() for n, p in block.named_parameters()}
    handle = block.unshard(async_op=True)
    s.check.true(handle is not None and hasattr(handle, "wait"), f"unshard(async_op=True) returned {handle!r}")
    handle.wait()
    for name, p in block.named_parameters():
        s.check.true(not is_dtensor(p), f"{name} still a DTensor after wait()")
        s.check.equal(p.detach(), full[name], f"{name}: the unsharded value")
    block.reshard()
    _all_dtensor(s, block.parameters(), True, "after reshard()")
    s.check.true(model.layers[1].unshard() is None, "unshard() without async_op returned a handle")
    _all_dtensor(s, model.layers[1].parameters(), False, "after unshard()")
    model.layers[1].reshard()
    inp = tokens(model, 2, seed=s.rank)
    loss, ref_loss = model(inp).sum(), ref(inp).sum()
    s.check.close(loss, ref_loss, "loss after the manual unshard/reshard")
    loss.backward()
    ref_loss.backward()
    all_reduce_grads(ref)
    sharded_parity(s, ref, model, "after backward")


# ---- shared (tied) parameters


def shared_params(s, reshard_after_forward):
    torch.manual_seed(42)
    model = Transformer(n_layers=3, weight_tying=True)
    ref = ddp(copy.deepcopy(model))
    ref_optim = _adam(ref)
    shard_blocks(s, model, reshard_after_forward=reshard_after_forward)
    optim = _adam(model)
    s.check.true(model.output.weight is model.tok_embeddings.weight, "the tie did not survive fully_shard")
    torch.manual_seed(42 + s.rank + 1)
    train_parity(s, ref, ref_optim, model, optim, lambda it: tokens(model, 2), what=f"raf={reshard_after_forward}")


for raf in (False, True):
    SC.add(f"shared_params_reshard_{raf}", 2, SRC + "TestFullyShardSharedParams.test_train_parity_with_shared_params",
           "output tied to the token embedding (in the root): the loss equals DDP's every step", shared_params,
           reshard_after_forward=raf)


class Tied(nn.Module):
    def __init__(self, vocab_size, hidden=16):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, hidden)
        self.output = nn.Linear(hidden, vocab_size, bias=False)
        self.output.weight = self.tok_embeddings.weight

    def forward(self, ids):
        return self.output(self.tok_embeddings(ids))


def shared_params_uneven(s, reshard_after_forward):
    vocab_size = s.world_size * 4 + 1  # not divisible by N: the last rank's shard is padded
    torch.manual_seed(42)
    model = Tied(vocab_size)
    s.fully_shard([model.tok_embeddings, model.output], reshard_after_forward=reshard_after_forward)
    s.fully_shard(model, reshard_after_forward=reshard_after_forward)
    model.tok_embeddings.unshard()
    initial = model.tok_embeddings.weight.detach().clone()
    model.tok_embeddings.reshard()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(42 + s.rank)
    for _ in range(ITERATIONS):
        ids = torch.randint(0, vocab_size, (2, 8))
        F.cross_entropy(model(ids).view(-1, vocab_size).float(), ids.view(-1)).backward()
        optim.step()
        optim.zero_grad()
    model.tok_embeddings.unshard()
    final = model.tok_embeddings.weight
    s.check.equal(tuple(initial.shape), (vocab_size, 16), "the unsharded weight's shape")
    s.check.true(not is_dtensor(final), "unshard() left a DTensor registered")
    stale = [row for row in range(vocab_size) if torch.equal(initial[row], final[row])]
    s.check.equal(stale, [], "rows never updated (the padded last shard included)")
    model.tok_embeddings.reshard()


for raf in (True, False):
    SC.add(f"shared_params_uneven_shard_reshard_{raf}", 4,
           SRC + "TestFullyShardSharedParams.test_train_shared_params_uneven_shard",
           "tied embedding/output of 17 rows in one grouped fully_shard([a, b]) on 4 ranks: unshard() registers "
           "the full weight, every row changes in 3 AdamW steps", shared_params_uneven, reshard_after_forward=raf)


@SC.register("shared_params_separate_groups_error", 2,
             SRC + "TestFullyShardSharedParams.test_shared_params_separate_fsdp_groups_error",
             "a tied parameter in two separate fully_shard calls: the first forward raises ValueError")
def shared_params_separate_groups_error(s):
    model = Tied(17)
    s.fully_shard(model.tok_embeddings)
    s.fully_shard(model.output)
    s.fully_shard(model)
    ids = torch.randint(0, 17, (2, 8))
    s.check.raises(ValueError, lambda: model(ids), "forward with a parameter in two groups")


@SC.register("layer_by_layer_shard", 2, SRC + "TestFullyShardSharedParams.test_layer_by_layer_shard_no_false_positive",
             "blocks built and sharded one at a time with gc in between: forward/backward runs, every gradient a "
             "DTensor")
def layer_by_layer_shard(s):
    dim = 16

    class SimpleBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.linear = nn.LayerNorm(dim), nn.Linear(dim, dim, bias=False)

        def forward(self, x):
            return self.linear(self.norm(x))

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList()

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    model = Stack()
    for _ in range(8):
        block = SimpleBlock()
        model.blocks.append(block)
        s.fully_shard(block)
        gc.collect()
    s.fully_shard(model)
    model(torch.randn(2, 4, dim)).sum().backward()
    s.check.true(all(is_dtensor(p.grad) for p in model.parameters()), "a gradient missing or not a DTensor")


# ---- gradient accumulation, microbatching, HSDP


def gradient_accumulation(s, hsdp, reshard_after_forward, mode, reshard_after_backward, cpu_offload=False,
                          reduce_scatter_only=False):
    mesh = _mesh(s.world_size, hsdp)
    torch.manual_seed(42)
    batch_size, lin_dim, num_mlps, num_microbatches = 2, 32, 3, 3
    disabled = 2  # MLPs without gradient sync in mode "some_mlps"
    model = nn.Sequential(nn.Linear(lin_dim, lin_dim), *[MLP(lin_dim) for _ in range(num_mlps)])
    ref = copy.deepcopy(model)
    shard = functools.partial(s.fully_shard, mesh=mesh, reshard_after_forward=reshard_after_forward,
                              offload_policy=_offload(cpu_offload))
    for mlp in model[1:]:
        shard(mlp)
    shard(model)  # the root gets the first linear
    ref_optim, optim = _adam(ref), _adam(model)

    def set_sync(module, last, recurse=True):
        if reduce_scatter_only:
            module.set_requires_all_reduce(last, recurse=recurse)
        else:
            module.set_requires_gradient_sync(last, recurse=recurse)

    def set_flags(last):
        if mode == "all":
            set_sync(model, last)
            if not reshard_after_backward:
                model.set_reshard_after_backward(last)
        elif mode == "some_mlps":
            for mlp in model[1:1 + disabled]:
                set_sync(mlp, last)
                if not reshard_after_backward:
                    mlp.set_reshard_after_backward(last)
        elif mode == "root_only":
            set_sync(model, last, recurse=False)
            if not reshard_after_backward:
                model.set_reshard_after_backward(last, recurse=False)

    from torch.distributed.tensor.debug import CommDebugMode

    torch.manual_seed(42 + s.rank + 1)
    for it in range(2):
        counts = defaultdict(int)
        for mb in range(num_microbatches):
            last = mb == num_microbatches - 1
            set_flags(last)
            inp = torch.randn(batch_size, lin_dim)
            losses = []
            losses.append(ref(inp).sum())
            losses[-1].backward()
            with CommDebugMode() as comm_mode:
                losses.append(model(inp).sum())
                losses[-1].backward()
            for k, v in comm_counts(comm_mode).items():
                counts[k] += v
            s.check.close(losses[1], losses[0], f"iteration {it} microbatch {mb} loss")
        expected_rs = num_mlps + 1
        if mode == "some_mlps":
            expected_rs += (num_mlps - disabled + 1) * (num_microbatches - 1)
        elif mode == "root_only":
            expected_rs += num_mlps * (num_microbatches - 1)
        expected_ar = expected_rs if hsdp else 0
        if reduce_scatter_only:
            expected_rs = (num_mlps + 1) * num_microbatches
        s.check.equal(counts["reduce_scatter"], expected_rs, f"iteration {it} reduce-scatters")
        s.check.equal(counts["all_reduce"], expected_ar, f"iteration {it} all-reduces")
        expected_ag = num_mlps + 1
        if reshard_after_forward is not False:
            expected_ag = 2 * (num_mlps + 1) * num_microbatches
        elif reshard_after_backward:
            expected_ag *= num_microbatches
        elif mode == "root_only":
            expected_ag += num_mlps * (num_microbatches - 1)
        s.check.equal(counts["all_gather"], expected_ag, f"iteration {it} all-gathers")
        all_reduce_grads(ref)
        sharded_parity(s, ref, model, f"iteration {it}")
        for o in (optim, ref_optim):
            o.step()
            o.zero_grad(set_to_none=bool(it % 2))


GA = SRC + "TestFullyShardGradientAccumulation.test_gradient_accumulation"
GA_ASSERTS = ("3 microbatches with gradient sync off but the last ({}): losses equal a replicated reference, "
              "all-gather / reduce-scatter / all-reduce counts per step by torch's formula, sharded parity of "
              "parameters and accumulated gradients")
for label, world_size, kw in [
        ("all_reshard_True", 2, dict(hsdp=False, reshard_after_forward=True, mode="all", reshard_after_backward=True)),
        ("all_no_reshard", 2, dict(hsdp=False, reshard_after_forward=False, mode="all", reshard_after_backward=False)),
        ("all_reshard_2", 4, dict(hsdp=False, reshard_after_forward=2, mode="all", reshard_after_backward=True)),
        ("root_only_reshard_True", 2, dict(hsdp=False, reshard_after_forward=True, mode="root_only",
                                           reshard_after_backward=True)),
        ("root_only_no_reshard", 2, dict(hsdp=False, reshard_after_forward=False, mode="root_only",
                                         reshard_after_backward=False)),
        ("some_mlps", 2, dict(hsdp=False, reshard_after_forward=True, mode="some_mlps", reshard_after_backward=True)),
        ("some_mlps_reshard_2", 4, dict(hsdp=False, reshard_after_forward=2, mode="some_mlps",
                                        reshard_after_backward=True)),
        ("cpu_offload", 2, dict(hsdp=False, reshard_after_forward=True, mode="all", reshard_after_backward=True,
                                cpu_offload=True)),
        ("hsdp_all", 4, dict(hsdp=True, reshard_after_forward=True, mode="all", reshard_after_backward=True)),
        ("hsdp_reduce_scatter_only", 4, dict(hsdp=True, reshard_after_forward=True, mode="all",
                                             reshard_after_backward=True, reduce_scatter_only=True)),
        ("hsdp_root_only_no_reshard", 4, dict(hsdp=True, reshard_after_forward=False, mode="root_only",
                                              reshard_after_backward=False))]:
    what = f"mode {kw['mode']}, raf {kw['reshard_after_forward']}, rab {kw['reshard_after_backward']}"
    what += ", HSDP 2x2" if kw["hsdp"] else ""
    what += ", set_requires_all_reduce" if kw.get("reduce_scatter_only") else ""
    what += ", CPU offload" if kw.get("cpu_offload") else ""
    SC.add(f"gradient_accumulation_{label}", world_size, GA, GA_ASSERTS.format(what), gradient_accumulation, **kw)


def one_f_one_b(s, use_explicit_unshard, reshard_after_backward):
    torch.manual_seed(42)
    model = Transformer(n_layers=2)
    ref = copy.deepcopy(model)
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    shard_blocks(s, model, reshard_after_forward=False)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(42 + s.rank + 1)
    inps = [tokens(model, 2) for _ in range(3)]
    if use_explicit_unshard:
        for module in model.modules():
            if isinstance(module, s.FSDPModule):
                module.unshard(async_op=True)
    losses, ref_losses = [], []
    for i, inp in enumerate(inps):
        last = i == len(inps) - 1
        model.set_requires_gradient_sync(last)
        model.set_is_last_backward(last)
        if not reshard_after_backward:
            model.set_reshard_after_backward(last)
        losses.append(model(inp).sum())
        losses[-1].backward()
        ref_losses.append(ref(inp).sum())
        ref_losses[-1].backward()
    all_reduce_grads(ref)
    for i, (loss, ref_loss) in enumerate(zip(losses, ref_losses)):
        s.check.close(loss, ref_loss, f"microbatch {i} loss")
    optim.step()
    ref_optim.step()
    sharded_parity(s, ref, model, "after the step")


for unshard, rab in itertools.product((False, True), (False, True)):
    SC.add(f"1f1b_microbatching_unshard_{unshard}_reshard_after_backward_{rab}", 2,
           SRC + "TestFullyShardGradientAccumulation.test_1f1b_microbatching",
           "1F1B-style microbatches (set_requires_gradient_sync/set_is_last_backward on the last, "
           f"{'unshard(async_op=True) up front, ' if unshard else ''}set_reshard_after_backward "
           f"{'default' if rab else 'on the last'}): losses and the stepped shards equal a replicated reference",
           one_f_one_b, use_explicit_unshard=unshard, reshard_after_backward=rab)


def hsdp_parity(s, mlp_dim, reshard_after_forward, sync_gradients_at_last_batch):
    mesh = _mesh(s.world_size, hsdp=True)
    torch.manual_seed(42)
    model = nn.Sequential(nn.LayerNorm(mlp_dim, bias=False), MLP(mlp_dim, dim_multiplier=3), MLP(mlp_dim),
                          MLP(mlp_dim, dim_multiplier=3))
    ref_model = copy.deepcopy(model)
    ref = ddp(ref_model)
    ref_optim = _adam(ref)
    for mlp in model:
        s.fully_shard(mlp, mesh=mesh, reshard_after_forward=reshard_after_forward, offload_policy=_offload(True))
    s.fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, offload_policy=_offload(True))
    optim = _adam(model)
    from torch.distributed.tensor import Replicate, Shard

    s.check.true(all(tuple(p.placements) == (Replicate(), Shard(0)) for p in model.parameters()),
                 f"placements {[tuple(p.placements) for p in model.parameters()][:2]}")
    sharded_parity(s, ref_model, model, "before training")
    torch.manual_seed(42 + s.rank + 1)
    for it in range(2):
        for mb in range(3):
            last = mb == 2
            if sync_gradients_at_last_batch:
                model.set_requires_gradient_sync(last)
            inp = torch.randn((8, mlp_dim))
            losses = []
            for m in (ref, model):
                losses.append(m(inp).sum())
                losses[-1].backward()
            s.check.close(losses[1], losses[0], f"iteration {it} microbatch {mb} loss")
        sharded_parity(s, ref_model, model, f"iteration {it} before the step")
        for o in (ref_optim, optim):
            o.step()
            o.zero_grad(set_to_none=it % 2 == 0)
        sharded_parity(s, ref_model, model, f"iteration {it} after the step")


for dim, raf, sync in ((3, False, True), (16, True, False), (17, True, True), (17, False, False)):
    SC.add(f"hsdp_parity_dim{dim}_reshard_{raf}_sync_last_{sync}", 4,
           SRC + "TestFullyShardHSDPTraining.test_train_parity_hsdp",
           "HSDP on a (2, 2) mesh with CPUOffloadPolicy: placements (Replicate(), Shard(0)), 3 microbatches "
           f"({'sync on the last only' if sync else 'sync every one'}), losses equal DDP's and sharded parity "
           "before and after each step", hsdp_parity, mlp_dim=dim, reshard_after_forward=raf,
           sync_gradients_at_last_batch=sync)


@SC.register("register_fsdp_forward_method", 2, SRC + "TestFullyShardCustomForwardMethod.test_register_fsdp_forward_method",
             "the parent calls vit.forward_features (not forward), registered with register_fsdp_forward_method: "
             "loss equals the unsharded model's, gradients equal its all-reduced ones")
def register_fsdp_forward_method(s):
    class VisionTransformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.patch_proj = nn.Conv2d(3, 32, kernel_size=4, stride=4)

        def forward_features(self, imgs):
            return self.patch_proj(imgs).flatten(2).transpose(1, 2)

        def forward(self, imgs):
            return self.forward_features(imgs).sum(dim=1)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.vit, self.projector = VisionTransformer(), nn.Linear(32, 8)

        def forward(self, imgs):
            return self.projector(self.vit.forward_features(imgs))

    torch.manual_seed(42)
    model = Model()
    ref = copy.deepcopy(model)
    s.fully_shard(model.vit)
    s.fully_shard(model.projector)
    s.fully_shard(model)
    s.register_fsdp_forward_method(model.vit, "forward_features")
    torch.manual_seed(42 + s.rank + 1)
    inp = torch.randn(4, 3, 16, 16)
    ref_loss, loss = ref(inp).sum(), model(inp).sum()
    s.check.close(loss, ref_loss, "loss")
    ref_loss.backward()
    loss.backward()
    all_reduce_grads(ref)
    sharded_parity(s, ref, model)


# ---- ignored parameters, buffers


class C(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin_c = nn.Linear(dim, dim)

    def forward(self, x):
        return self.lin_c(x)


class B(nn.Module):
    def __init__(self, dim, subtrahend):
        super().__init__()
        self.lin_b, self.module_c = nn.Linear(dim, dim), C(dim)
        self.subtrahend = nn.Parameter(subtrahend)

    def forward(self, x):
        return self.lin_b(self.module_c(x)) - self.subtrahend


class A(nn.Module):
    def __init__(self, dim, addend, subtrahend):
        super().__init__()
        self.module_b, self.addend = B(dim, subtrahend), nn.Parameter(addend)

    def forward(self, x):
        return (self.module_b(x) + self.addend).sum()


def _abc():
    dim = 8
    torch.manual_seed(42)
    addend = torch.randn((dim, dim))
    torch.manual_seed(70)
    subtrahend = torch.randn((dim, dim))
    model = A(dim, addend, subtrahend)
    torch.manual_seed(84)
    return model, torch.randn((dim, dim))


@SC.register("ignored_params_ddp_fsdp_ddp", 2, "test_fully_shard_ignore_params.py::TestFullyShardIgnoreParams."
             "test_ddp_A_fsdp_B_ddp_C",
             "fully_shard on module_b and lin_b with module_c's parameters ignored, DDP over the whole (ignoring "
             "FSDP's): FSDP modules {module_b, module_b.lin_b}, module_c plain tensors, loss and full parameters "
             "equal a DDP model's for 3 Adam steps")
def ignored_params_ddp_fsdp_ddp(s):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import implicit_replication

    mesh = init_device_mesh("cpu", (s.world_size,))
    ref_model, ref_inp = _abc()
    ref = ddp(ref_model)
    ref_optim = _adam(ref)
    test_model, test_inp = _abc()
    ignored = set(test_model.module_b.module_c.parameters())
    s.fully_shard(test_model.module_b.lin_b, mesh=mesh, ignored_params=ignored)
    s.fully_shard(test_model.module_b, mesh=mesh, ignored_params=ignored)
    fsdp_names = {n for n, m in test_model.named_modules() if isinstance(m, s.FSDPModule)}
    s.check.equal(fsdp_names, {"module_b", "module_b.lin_b"}, "FSDP modules")
    s.check.true(all(not is_dtensor(p) for p in ignored), "an ignored parameter became a DTensor")
    managed = [n for n, p in test_model.named_parameters() if is_dtensor(p)]
    s.check.equal(sorted(managed), ["module_b.lin_b.bias", "module_b.lin_b.weight", "module_b.subtrahend"],
                  "sharded parameters")
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(test_model, managed)
    test = ddp(test_model, broadcast_buffers=False)
    test_optim = _adam(test)

    def compare(what):
        for (name, r), (_, t) in zip(ref.module.named_parameters(), test.module.named_parameters()):
            s.check.close(t.full_tensor() if is_dtensor(t) else t, r, f"{what}: {name}")

    compare("before training")
    for step in range(3):
        ref_loss, test_loss = ref(ref_inp), test(test_inp)
        s.check.close(test_loss, ref_loss, f"step {step} loss")
        ref_loss.backward()
        test_loss.backward()
        with implicit_replication():
            for o in (ref_optim, test_optim):
                o.step()
                o.zero_grad()
            compare(f"after step {step}")


@SC.register("ignored_params_stay_local", 2, "test_fully_shard_init.py::TestFullyShardDeviceTensor."
             "test_move_states_to_device_ignored_param_device (the ignored-parameter half)",
             "ignored_params (out_proj): those stay plain nn.Parameters with each rank's own gradient, the rest are "
             "DTensors with the all-reduced gradient's shards")
def ignored_params_stay_local(s):
    torch.manual_seed(42)
    model = MLP(8, with_buffer=True)
    ref = copy.deepcopy(model)
    ignored = {model.out_proj.weight, model.out_proj.bias}
    s.fully_shard(model, ignored_params=ignored)
    for name, p in model.named_parameters():
        want = not name.startswith("out_proj")
        s.check.equal(is_dtensor(p), want, f"{name} a DTensor")
        s.check.true(isinstance(p, nn.Parameter), f"{name} not an nn.Parameter")
    s.check.true(not is_dtensor(model.buffer), "the buffer became a DTensor")
    torch.manual_seed(42 + s.rank)
    inp = torch.randn(4, 8)
    model(inp).sum().backward()
    ref(inp).sum().backward()
    for name, p in model.named_parameters():
        r = dict(ref.named_parameters())[name]
        if name.startswith("out_proj"):
            s.check.close(p.grad, r.grad, f"{name}: the local (unreduced) gradient")
    ref.out_proj.weight.grad = ref.out_proj.bias.grad = None
    all_reduce_grads(ref.in_proj)
    for name in ("in_proj.weight", "in_proj.bias"):
        p, r = dict(model.named_parameters())[name], dict(ref.named_parameters())[name]
        from fsdp2_scenarios import expected_local

        s.check.close(p.grad.to_local(), expected_local(r.grad, p), f"{name} gradient shard")


@SC.register("replicate_inside_fully_shard", 2, "test_fully_shard_init.py::TestFullyShardManagedModulesAndStates."
             "test_managed_modules_nested_fully_shard_and_replicate, trained as test_fully_shard_training.py's parity",
             "replicate(model[0]) and fully_shard(model[2]) under fully_shard(model): the root's all-gather carries "
             "model[1]'s parameters only, model[0]'s stay plain tensors (replicate all-reduces them), and the loss "
             "and every parameter equal DDP's for 3 Adam steps")
def replicate_inside_fully_shard(s):
    import math

    from torch.distributed._composable import replicate

    from fsdp2_scenarios import CommSpy

    torch.manual_seed(42)
    model = nn.Sequential(*[MLP(8) for _ in range(3)])
    ref = ddp(copy.deepcopy(model))
    ref_optim = _adam(ref)
    replicate(model[0])
    s.fully_shard(model[2])
    s.fully_shard(model)
    optim = _adam(model)
    s.check.true(all(not is_dtensor(p) for p in model[0].parameters()), "a replicated parameter became a DTensor")
    s.check.true(all(is_dtensor(p) for m in model[1:] for p in m.parameters()), "a sharded parameter is plain")
    n = s.world_size
    padded = sum(math.ceil(p.shape[0] / n) * math.prod(p.shape[1:]) * n for p in model[1].parameters())
    torch.manual_seed(42 + s.rank + 1)
    for it in range(ITERATIONS):
        inp = torch.randn(4, 8)
        losses = []
        for m, o in ((ref, ref_optim), (model, optim)):
            o.zero_grad(set_to_none=it % 2 == 0)
            with CommSpy() as spy:
                losses.append(m(inp).sum())
            if m is model:
                s.check.equal([e.numel for e in spy.of("AG")][:1], [padded], "the root's all-gather: model[1] only")
            losses[-1].backward()
            o.step()
        s.check.close(losses[1], losses[0], f"iteration {it} loss")
        for (name, r), (_, p) in zip(ref.module.named_parameters(), model.named_parameters()):
            s.check.close(p.full_tensor() if is_dtensor(p) else p, r, f"iteration {it}: {name}")


class WithBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(6, 10), nn.Linear(10, 6)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 10), persistent=False)
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, 6))

    def forward(self, x):
        return self.lin2(torch.relu(self.lin1(x)) * self.scale) + self.shift


@SC.register("non_persistent_buffers", 2, "derived from test_fully_shard_training.py (train parity) and "
             "test_fully_shard_state_dict.py",
             "a persistent and a non-persistent buffer: both stay plain tensors, state_dict() keeps the persistent "
             "one only (a plain tensor), the loss equals DDP's for 3 steps")
def non_persistent_buffers(s):
    torch.manual_seed(42)
    model = WithBuffers()
    ref = ddp(copy.deepcopy(model))
    ref_optim = _adam(ref)
    s.fully_shard(model.lin1)
    s.fully_shard(model)
    optim = _adam(model)
    s.check.true(not is_dtensor(model.scale) and not is_dtensor(model.shift), "a buffer became a DTensor")
    sd = model.state_dict()
    s.check.equal(sorted(sd), ["lin1.bias", "lin1.weight", "lin2.bias", "lin2.weight", "shift"], "state_dict keys")
    s.check.true(not is_dtensor(sd["shift"]), "the buffer's state_dict value is a DTensor")
    torch.manual_seed(42 + s.rank + 1)
    train_parity(s, ref, ref_optim, model, optim, lambda it: torch.randn(4, 6))


# ---- forwards that do not end in one backward


def double_forward(s, reshard_after_forward):
    torch.manual_seed(42)
    model = Transformer(n_layers=2)
    ref = copy.deepcopy(model)
    for layer in model.layers:
        s.fully_shard(layer.attention, reshard_after_forward=reshard_after_forward)
        s.fully_shard(layer.feed_forward, reshard_after_forward=reshard_after_forward)
        s.fully_shard(layer, reshard_after_forward=reshard_after_forward)
    s.fully_shard(model, reshard_after_forward=reshard_after_forward)
    torch.manual_seed(42 + s.rank)
    inp1, inp2 = tokens(model, 2), tokens(model, 2)
    out1, out2 = model(inp1), model(inp2)
    (out1.sum() - out2.sum()).pow(2).backward()
    ref_out1, ref_out2 = ref(inp1), ref(inp2)
    (ref_out1.sum() - ref_out2.sum()).pow(2).backward()
    s.check.true(all(p.grad is not None for p in model.parameters()), "a parameter without a gradient")
    all_reduce_grads(ref)
    sharded_parity(s, ref, model, "two forwards, one backward", rtol=1e-5, atol=1e-4)


for raf in (True, False):
    SC.add(f"double_forward_nested_reshard_{raf}", 2,
           "test_fully_shard_training.py::TestFullyShard1DTrainingCompose."
           "test_double_forward_with_nested_fsdp_and_checkpoint (without checkpointing)",
           "nested fully_shard (attention, feed-forward, block, root), two forwards then one backward of a "
           "DPO-style loss: every parameter gets a gradient, its shard equals the replicated model's all-reduced "
           "one (rtol 1e-5, atol 1e-4: a squared difference of sums)", double_forward, reshard_after_forward=raf)


class ChunkedHead(nn.Module):
    def __init__(self, dim=32, vocab_size=128, tie=False):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.body = nn.Linear(dim, dim, bias=False)
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, tokens, *, skip_head=False):
        h = self.norm(self.body(self.embed(tokens)))
        return h if skip_head else self.head(h)


def _chunked_model(tie=False):
    torch.manual_seed(42)
    model = ChunkedHead(tie=tie)
    broadcast_module(model)
    return model


@SC.register("double_partial_forward_then_backward", 2,
             SRC + "TestFullyShard1DTrainingCompose.test_double_partial_forward_then_backward",
             "two forwards that skip the head of a grouped fully_shard([norm, head]) before one backward: "
             "embed and norm get finite gradients, head none")
def double_partial_forward_then_backward(s):
    model = _chunked_model()
    s.fully_shard([model.norm, model.head])
    s.fully_shard(model)
    t1, t2 = torch.randint(0, 128, (2, 16)), torch.randint(0, 128, (2, 16))
    h1, h2 = model(t1, skip_head=True), model(t2, skip_head=True)
    (h1.sum() + h2.sum()).backward()
    params = dict(model.named_parameters())
    for name in ("embed.weight", "norm.weight"):
        g = params[name].grad
        s.check.true(g is not None and torch.isfinite(g.to_local() if is_dtensor(g) else g).all().item(),
                     f"{name}: no finite gradient")
    s.check.true(model.head.weight.grad is None, "head.weight got a gradient")


def _chunked_run(model, tokens_, n_chunks, snapshot=True):
    h = model(tokens_, skip_head=True)
    h_grads, total = [], torch.tensor(0.0)
    head_grads = []
    for chunk in torch.chunk(h.detach().float(), n_chunks, dim=1):
        chunk = chunk.contiguous().detach().requires_grad_(True)
        loss = model.head(chunk).sum()
        total += loss.detach()
        loss.backward()
        h_grads.append(chunk.grad.detach())
        if snapshot:  # head's gradient so far (full), to see each chunk add to it
            g = model.head.weight.grad
            head_grads.append(g.full_tensor() if is_dtensor(g) else g.clone())
    h.backward(torch.cat(h_grads, dim=1).to(h.dtype))
    return h, total, head_grads


def partial_group_standalone(s, reshard_after_forward, weight_tying, mp_policy_mode):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    bf16_out = {"param_dtype": torch.float32, "output_dtype": torch.bfloat16}
    if mp_policy_mode == "bf16_inner_only":
        inner_mp, root_mp, h_dtype = MixedPrecisionPolicy(**bf16_out), MixedPrecisionPolicy(param_dtype=torch.float32), \
            torch.bfloat16
    else:
        inner_mp = root_mp = MixedPrecisionPolicy()
        h_dtype = torch.float32
    kw = {"reshard_after_forward": reshard_after_forward}
    torch.manual_seed(42)
    tokens_ = torch.randint(0, 128, (2, 16))
    ref = _chunked_model(weight_tying)
    ref_optim = _adam(ref)
    model = _chunked_model(weight_tying)
    if weight_tying:
        s.fully_shard(model.body, mp_policy=root_mp, **kw)
        s.fully_shard([model.embed, model.norm, model.head], mp_policy=inner_mp, **kw)
    else:
        s.fully_shard(model.embed, mp_policy=root_mp, **kw)
        s.fully_shard(model.body, mp_policy=root_mp, **kw)
        s.fully_shard([model.norm, model.head], mp_policy=inner_mp, **kw)
    s.fully_shard(model, mp_policy=root_mp, **kw)
    optim = _adam(model)
    for it in range(3):
        h, loss, head_grads = _chunked_run(model, tokens_, 4)
        s.check.equal(h.dtype, h_dtype, f"iteration {it}: h dtype")
        for i in range(1, len(head_grads)):
            s.check.true((head_grads[i] - head_grads[i - 1]).norm().item() > 0, f"chunk {i} added no head gradient")
        if mp_policy_mode == "none":
            _, ref_loss, ref_head_grads = _chunked_run(ref, tokens_, 4)
            all_reduce_grads(ref)
            ref_head = ref_head_grads[-1].clone()
            dist.all_reduce(ref_head)
            s.check.close(head_grads[-1], ref_head / s.world_size, f"iteration {it}: head gradient")
            s.check.close(loss, ref_loss, f"iteration {it}: loss")
            sharded_parity(s, ref, model, f"iteration {it}")
            ref_optim.step()
            ref_optim.zero_grad(set_to_none=it % 2 == 0)
        optim.step()
        optim.zero_grad(set_to_none=it % 2 == 0)


for raf, tie, mp in ((True, False, "none"), (False, True, "none"), (True, False, "bf16_inner_only")):
    SC.add(f"partial_group_standalone_reshard_{raf}_tied_{tie}_{mp}", 2,
           SRC + "TestFullyShard1DTrainingCompose.test_partial_group_forward_then_standalone",
           "the forward skips head (grouped with norm), then head runs alone per chunk: each chunk adds to head's "
           "gradient, output dtype per policy" + (", loss, head gradient and shards equal a replicated reference"
                                                   if mp == "none" else ""),
           partial_group_standalone, reshard_after_forward=raf, weight_tying=tie, mp_policy_mode=mp)


def partial_group_grad_accum(s, reshard_after_forward):
    kw = {"reshard_after_forward": reshard_after_forward}

    def setup(grouped):
        m = _chunked_model()
        s.fully_shard(m.embed, **kw)
        s.fully_shard(m.body, **kw)
        if grouped:
            s.fully_shard([m.norm, m.head], **kw)
        else:
            s.fully_shard(m.norm, **kw)
            s.fully_shard(m.head, **kw)
        s.fully_shard(m, **kw)
        return m

    ungrouped, grouped = setup(False), setup(True)
    batches = [torch.randint(0, 128, (2, 16)) for _ in range(3)]
    for m in (ungrouped, grouped):
        for i, toks in enumerate(batches):
            last = i == len(batches) - 1
            m.set_requires_gradient_sync(last)
            m.set_is_last_backward(last)
            _chunked_run(m, toks, 2, snapshot=False)
    for (name, a), (_, b) in zip(ungrouped.named_parameters(), grouped.named_parameters()):
        s.check.close(b.grad.to_local(), a.grad.to_local(), f"{name}: grouped against ungrouped gradient")


for raf in (True, False):
    SC.add(f"partial_group_grad_accum_chunked_reshard_{raf}", 2,
           SRC + "TestFullyShard1DTrainingCompose.test_partial_group_forward_grad_accum_chunked",
           "chunked head and 3 microbatches with set_requires_gradient_sync/set_is_last_backward: grouped "
           "fully_shard([norm, head]) accumulates the same gradient shards as separate calls",
           partial_group_grad_accum, reshard_after_forward=raf)


def partial_group_reshard_toggle(s, weight_tying, initial_reshard):
    model = _chunked_model(weight_tying)
    if weight_tying:
        s.fully_shard(model.body)
        s.fully_shard([model.embed, model.norm, model.head], reshard_after_forward=initial_reshard)
    else:
        s.fully_shard(model.embed)
        s.fully_shard(model.body)
        s.fully_shard([model.norm, model.head], reshard_after_forward=initial_reshard)
    s.fully_shard(model)
    optim = _adam(model)
    toks = torch.randint(0, 128, (2, 16))
    for it in range(3):
        h = model(toks, skip_head=True)
        model.head.set_reshard_after_forward(False)
        model.head.set_reshard_after_backward(False)
        h_grads = []
        for chunk in torch.chunk(h.detach(), 4, dim=1):
            chunk = chunk.contiguous().detach().requires_grad_(True)
            model.head(chunk).sum().backward()
            h_grads.append(chunk.grad.detach())
            s.check.true(not is_dtensor(model.head.weight), f"iteration {it}: head resharded mid-chunk")
        model.head.set_reshard_after_forward(True)
        model.head.set_reshard_after_backward(True)
        model.head.reshard()
        s.check.true(is_dtensor(model.head.weight), f"iteration {it}: head.reshard() left it unsharded")
        h.backward(torch.cat(h_grads, dim=1).to(h.dtype))
        s.check.true(all(p.grad is not None for p in model.parameters()), f"iteration {it}: a gradient missing")
        optim.step()
        optim.zero_grad(set_to_none=it % 2 == 0)


for tie, initial in ((False, False), (True, True)):
    SC.add(f"partial_group_reshard_toggle_tied_{tie}_initial_{initial}", 2,
           SRC + "TestFullyShard1DTrainingCompose.test_partial_group_reshard_toggle",
           "set_reshard_after_forward/backward(False) on head for a chunk loop, then True and head.reshard(): "
           "head stays unsharded (a plain tensor) through the loop, a DTensor after reshard(), every parameter "
           "gets a gradient", partial_group_reshard_toggle, weight_tying=tie, initial_reshard=initial)


class CheckpointedTransformer(Transformer):
    """The small Transformer with each block run under torch.utils.checkpoint (PyTorch's
    checkpoint_activations=True, the "utils" implementation)."""

    def forward(self, tokens_):
        from torch.utils.checkpoint import checkpoint

        h = self.tok_embeddings(tokens_) + self.pos_embeddings(torch.arange(tokens_.shape[1]))
        for layer in self.layers:
            h = checkpoint(layer, h, use_reentrant=False)
        return self.output(self.norm(h))


def activation_checkpointing(s, reshard_after_forward):
    torch.manual_seed(42)
    model = CheckpointedTransformer(n_layers=3, weight_tying=True)
    ref_model = copy.deepcopy(model)
    ref = ddp(ref_model)
    ref_optim = _adam(ref)
    shard_blocks(s, model, reshard_after_forward=reshard_after_forward)
    optim = _adam(model)
    torch.manual_seed(42 + s.rank)
    inp = tokens(model, 3)
    sharded_parity(s, ref_model, model, "before training")
    for it in range(3):
        losses = [m(inp).sum() for m in (ref, model)]
        for loss in losses:
            loss.backward()
        sharded_parity(s, ref_model, model, f"iteration {it}")
        s.check.close(losses[1], losses[0], f"iteration {it} loss")
        for o in (ref_optim, optim):
            o.step()
            o.zero_grad(set_to_none=it % 2 == 0)


for raf in (True, False):
    SC.add(f"activation_checkpointing_reshard_{raf}", 2,
           "test_fully_shard_training.py::TestFullyShard1DTrainingCompose.test_train_parity_with_activation_"
           "checkpointing (utils, block grouping)",
           "blocks under torch.utils.checkpoint, tied output: loss and sharded parity with DDP every step",
           activation_checkpointing, reshard_after_forward=raf)


OUT = Outcomes(SC, timeout=240)


def test_the_docstring_table_lists_every_scenario():
    assert SC.missing_from(__doc__) == []


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize("system,name,world_size", SC.cases())
def test_scenario(system, name, world_size):
    failures = OUT.failures(system, name, world_size)
    assert failures is None, failures
