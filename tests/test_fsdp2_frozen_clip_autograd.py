"""FSDP2 with frozen parameters, torch's clip_grad_norm_, and autograd corner cases (PyTorch's
test_fully_shard_frozen.py, test_fully_shard_clip_grad_norm_.py, test_fully_shard_autograd.py),
on `torch` and `zerokit` alike (tests/fsdp2_scenarios.py: one launch per world size and system).

Public stand-ins for what PyTorch's bodies read privately:
- `RegisterPostBackwardFunction.backward` counted (post-backward ran in autograd, not in the final
  callback): a CommSpy on the reduce-scatters beside a tensor hook on each MLP's output gradient;
  the reduce-scatter of MLP i must come before backward reaches MLP i-1's output, so at least
  n - i of them precede the gradient of MLP i-1's output;
- `p._local_tensor.numel()` of the trainable biases (the reduce-scatter's size): `p.to_local()`,
  and the reduce-scatter's output size from CommSpy;
- `_reduce_1d_partial_grads` keeps its arithmetic (the reference's gradient of the global batch
  divided by N).
The clip test's 2-D case is tensor parallel in PyTorch; here it is HSDP on a (2, 2) mesh
(FSDP2 with torch's clip on a 2-D mesh: one all-reduce per mesh dimension of the norm).
Activation checkpointing in the frozen test uses torch.distributed._composable.checkpoint
(not public): left out.

Scenarios (name, world size N, <- the PyTorch test it ports; then what it asserts):

- mixed_requires_grad_per_group_reshard_False_freeze_after_init_False (N=2) <- test_fully_shard_frozen.py::TestFullyShardFrozen.test_train_mixed_requires_grad_per_group
    biases trainable, weights frozen before fully_shard: loss and sharded parity with DDP, each
    reduce-scatter the size of the biases' shards, run inside backward (before the next module's output
    gradient), frozen weights without gradients
- mixed_requires_grad_per_group_reshard_False_freeze_after_init_True (N=2) <- test_fully_shard_frozen.py::TestFullyShardFrozen.test_train_mixed_requires_grad_per_group
    biases trainable, weights frozen after fully_shard: loss and sharded parity with DDP, each
    reduce-scatter the size of the biases' shards, run inside backward (before the next module's output
    gradient), frozen weights without gradients
- mixed_requires_grad_per_group_reshard_True_freeze_after_init_False (N=2) <- test_fully_shard_frozen.py::TestFullyShardFrozen.test_train_mixed_requires_grad_per_group
    biases trainable, weights frozen before fully_shard: loss and sharded parity with DDP, each
    reduce-scatter the size of the biases' shards, run inside backward (before the next module's output
    gradient), frozen weights without gradients
- mixed_requires_grad_per_group_reshard_True_freeze_after_init_True (N=2) <- test_fully_shard_frozen.py::TestFullyShardFrozen.test_train_mixed_requires_grad_per_group
    biases trainable, weights frozen after fully_shard: loss and sharded parity with DDP, each
    reduce-scatter the size of the biases' shards, run inside backward (before the next module's output
    gradient), frozen weights without gradients
- mixed_requires_grad_per_group_reshard_2_freeze_after_init_False (N=2) <- test_fully_shard_frozen.py::TestFullyShardFrozen.test_train_mixed_requires_grad_per_group
    biases trainable, weights frozen before fully_shard: loss and sharded parity with DDP, each
    reduce-scatter the size of the biases' shards, run inside backward (before the next module's output
    gradient), frozen weights without gradients
- mixed_requires_grad_per_group_reshard_2_freeze_after_init_True (N=2) <- test_fully_shard_frozen.py::TestFullyShardFrozen.test_train_mixed_requires_grad_per_group
    biases trainable, weights frozen after fully_shard: loss and sharded parity with DDP, each
    reduce-scatter the size of the biases' shards, run inside backward (before the next module's output
    gradient), frozen weights without gradients
- mixed_requires_grad_across_groups_reshard_False_unfreeze_False (N=2) <- test_fully_shard_frozen.py::TestFullyShardFrozen.test_train_mixed_requires_grad_across_groups
    a frozen linear among trainable ones, each its own fully_shard, a no_grad iteration: losses equal
    DDP's (find_unused_parameters)
- mixed_requires_grad_across_groups_reshard_False_unfreeze_True (N=2) <- test_fully_shard_frozen.py::TestFullyShardFrozen.test_train_mixed_requires_grad_across_groups
    a frozen linear among trainable ones, each its own fully_shard, a no_grad iteration, unfrozen for
    the last step: losses equal DDP's (find_unused_parameters)
- mixed_requires_grad_across_groups_reshard_True_unfreeze_False (N=2) <- test_fully_shard_frozen.py::TestFullyShardFrozen.test_train_mixed_requires_grad_across_groups
    a frozen linear among trainable ones, each its own fully_shard, a no_grad iteration: losses equal
    DDP's (find_unused_parameters)
- mixed_requires_grad_across_groups_reshard_True_unfreeze_True (N=2) <- test_fully_shard_frozen.py::TestFullyShardFrozen.test_train_mixed_requires_grad_across_groups
    a frozen linear among trainable ones, each its own fully_shard, a no_grad iteration, unfrozen for
    the last step: losses equal DDP's (find_unused_parameters)
- mixed_requires_grad_across_groups_reshard_2_unfreeze_False (N=2) <- test_fully_shard_frozen.py::TestFullyShardFrozen.test_train_mixed_requires_grad_across_groups
    a frozen linear among trainable ones, each its own fully_shard, a no_grad iteration: losses equal
    DDP's (find_unused_parameters)
- mixed_requires_grad_across_groups_reshard_2_unfreeze_True (N=2) <- test_fully_shard_frozen.py::TestFullyShardFrozen.test_train_mixed_requires_grad_across_groups
    a frozen linear among trainable ones, each its own fully_shard, a no_grad iteration, unfrozen for
    the last step: losses equal DDP's (find_unused_parameters)
- multi_forward_mixed_requires_grad_reshard_True (N=2) <- test_fully_shard_frozen.py::TestFullyShardFrozen.test_multi_forward_mixed_requires_grad
    trainable and frozen linears each run three times, with and without grad: losses equal DDP's
- multi_forward_mixed_requires_grad_reshard_False (N=2) <- test_fully_shard_frozen.py::TestFullyShardFrozen.test_multi_forward_mixed_requires_grad
    trainable and frozen linears each run three times, with and without grad: losses equal DDP's
- multi_forward_mixed_requires_grad_reshard_2 (N=2) <- test_fully_shard_frozen.py::TestFullyShardFrozen.test_multi_forward_mixed_requires_grad
    trainable and frozen linears each run three times, with and without grad: losses equal DDP's
- clip_grad_norm_1d_norm_2 (N=2) <- test_fully_shard_clip_grad_norm_.py::TestClipGradNormWorldSize2.test_clip_grad_norm_1d
    torch.nn.utils.clip_grad_norm_ on the DTensor gradients: total norm equals DDP's, one all-reduce,
    every local gradient clipped below max_norm
- clip_grad_norm_1d_norm_1 (N=2) <- test_fully_shard_clip_grad_norm_.py::TestClipGradNormWorldSize2.test_clip_grad_norm_1d
    torch.nn.utils.clip_grad_norm_ on the DTensor gradients: total norm equals DDP's, one all-reduce,
    every local gradient clipped below max_norm
- clip_grad_norm_1d_norm_inf (N=2) <- test_fully_shard_clip_grad_norm_.py::TestClipGradNormWorldSize2.test_clip_grad_norm_1d
    torch.nn.utils.clip_grad_norm_ on the DTensor gradients: total norm equals DDP's, one all-reduce,
    every local gradient clipped below max_norm
- clip_grad_norm_hsdp_norm_2 (N=4) <- test_fully_shard_clip_grad_norm_.py::TestClipGradNormWorldSize4.test_clip_grad_norm_2d (HSDP for TP)
    HSDP (2, 2): total norm equals DDP's, one all-reduce per mesh dimension, gradients clipped
- clip_grad_norm_hsdp_norm_inf (N=4) <- test_fully_shard_clip_grad_norm_.py::TestClipGradNormWorldSize4.test_clip_grad_norm_2d (HSDP for TP)
    HSDP (2, 2): total norm equals DDP's, one all-reduce per mesh dimension, gradients clipped
- unused_forward_output_reshard_True (N=2) <- test_fully_shard_autograd.py::TestFullyShardAutograd.test_unused_forward_output
    the loss uses both outputs, then only the first: global loss and sharded parity with one process on
    the global batch
- unused_forward_output_reshard_False (N=2) <- test_fully_shard_autograd.py::TestFullyShardAutograd.test_unused_forward_output
    the loss uses both outputs, then only the first: global loss and sharded parity with one process on
    the global batch
- unused_forward_output_reshard_2 (N=2) <- test_fully_shard_autograd.py::TestFullyShardAutograd.test_unused_forward_output
    the loss uses both outputs, then only the first: global loss and sharded parity with one process on
    the global batch
- unused_forward_module_reshard_True (N=2) <- test_fully_shard_autograd.py::TestFullyShardAutograd.test_unused_forward_module
    an FSDP module never run in forward: no gradient for it, loss and sharded parity with one process
- unused_forward_module_reshard_False (N=2) <- test_fully_shard_autograd.py::TestFullyShardAutograd.test_unused_forward_module
    an FSDP module never run in forward: no gradient for it, loss and sharded parity with one process
- unused_forward_module_reshard_2 (N=2) <- test_fully_shard_autograd.py::TestFullyShardAutograd.test_unused_forward_module
    an FSDP module never run in forward: no gradient for it, loss and sharded parity with one process
- nontensor_activations_list (N=2) <- test_fully_shard_autograd.py::TestFullyShardAutograd.test_nontensor_activations
    activations passed between FSDP modules in a list: loss and sharded parity with one process
- nontensor_activations_namedtuple (N=2) <- test_fully_shard_autograd.py::TestFullyShardAutograd.test_nontensor_activations
    activations passed between FSDP modules in a namedtuple: loss and sharded parity with one process
- nontensor_activations_tuple (N=2) <- test_fully_shard_autograd.py::TestFullyShardAutograd.test_nontensor_activations
    activations passed between FSDP modules in a tuple: loss and sharded parity with one process
- nontensor_activations_dict (N=2) <- test_fully_shard_autograd.py::TestFullyShardAutograd.test_nontensor_activations
    activations passed between FSDP modules in a dict: loss and sharded parity with one process
- nontensor_args_and_outputs (N=2) <- derived from test_fully_shard_autograd.py::TestFullyShardAutograd.test_nontensor_activations
    float / str / None arguments (positional and keyword) into FSDP modules and a dict with non-tensors
    out: non-tensors pass through unchanged, loss and sharded parity with one process for 3 steps
"""

import copy
import collections
import functools
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fsdp2_scenarios import (ITERATIONS, MLP, CommSpy, DoubleLinear, Outcomes, Scenarios, Transformer, ddp, is_dtensor,
                             shard_blocks, sharded_parity, tokens)

SC = Scenarios()
FROZEN = "test_fully_shard_frozen.py::TestFullyShardFrozen."
CLIP = "test_fully_shard_clip_grad_norm_.py::"
AUTOGRAD = "test_fully_shard_autograd.py::TestFullyShardAutograd."


def _adam(model):
    return torch.optim.Adam(model.parameters(), lr=1e-2)


# ---- frozen parameters


def _output_gradient_marks(spy, model):
    """A mark in spy's log when backward reaches each module's output ("grad_out", i): FSDP2 runs a
    module's post-backward (its reduce-scatter) when the gradient of its inputs is ready, which is
    before the gradient of the previous module's output."""
    def hook(module, args, out, i):
        if out.requires_grad:
            out.register_hook(lambda g: spy.mark(("grad_out", i)))

    return [module.register_forward_hook(functools.partial(hook, i=i)) for i, module in enumerate(model)]


def frozen_per_group(s, reshard_after_forward, freeze_after_init):
    torch.manual_seed(42)
    num_mlps, lin_dim = 3, 32
    model = nn.Sequential(*[MLP(lin_dim) for _ in range(num_mlps)])
    if not freeze_after_init:  # BitFit: biases only
        for name, p in model.named_parameters():
            if "bias" not in name:
                p.requires_grad_(False)
    ref_model = copy.deepcopy(model)
    ref = ddp(ref_model, find_unused_parameters=freeze_after_init)
    ref_optim = _adam(ref)
    for mlp in model:
        s.fully_shard(mlp, reshard_after_forward=reshard_after_forward)
    s.fully_shard(model, reshard_after_forward=reshard_after_forward)
    optim = _adam(model)
    if freeze_after_init:  # freezing after fully_shard: FSDP2 must follow requires_grad as it is now
        for name, p in itertools.chain(model.named_parameters(), ref_model.named_parameters()):
            if "bias" not in name:
                p.requires_grad_(False)
    expected_numel = sum(p.to_local().numel() for n, p in model[0].named_parameters() if "bias" in n)
    torch.manual_seed(42 + s.rank + 1)
    for it in range(ITERATIONS):
        inp = torch.randn((8, lin_dim))
        ref_optim.zero_grad(set_to_none=it % 2 == 0)
        ref_loss = ref(inp).sum()
        ref_loss.backward()
        ref_optim.step()
        optim.zero_grad(set_to_none=it % 2 == 0)
        with CommSpy() as spy:
            hooks = _output_gradient_marks(spy, model)
            loss = model(inp).sum()
            loss.backward()
            for h in hooks:
                h.remove()
        optim.step()
        log = [e.name if e.kind == "MARK" else e.kind for e in spy.events if e.kind in ("MARK", "RS")]
        s.check.close(loss, ref_loss, f"iteration {it} loss")
        sharded_parity(s, ref_model, model, f"iteration {it}")
        s.check.equal([e.out_numel for e in spy.of("RS")], [expected_numel] * num_mlps,
                      f"iteration {it}: reduce-scatter output sizes (the biases' shards only)")
        for i in range(1, num_mlps):
            at = log.index(("grad_out", i - 1)) if ("grad_out", i - 1) in log else len(log)
            before = sum(1 for e in log[:at] if e == "RS")
            s.check.true(before >= num_mlps - i, f"iteration {it}: {before} reduce-scatters before MLP {i - 1}'s "
                         f"output gradient (post-backward delayed to the end of backward?): {log}")
    for name, p in model.named_parameters():
        s.check.equal(p.requires_grad, "bias" in name, f"{name}.requires_grad")
        if "bias" not in name:
            s.check.true(p.grad is None, f"frozen {name} got a gradient")


for raf, after in itertools.product((False, True, 2), (False, True)):
    SC.add(f"mixed_requires_grad_per_group_reshard_{raf}_freeze_after_init_{after}", 2,
           FROZEN + "test_train_mixed_requires_grad_per_group",
           f"biases trainable, weights frozen {'after' if after else 'before'} fully_shard: loss and sharded parity "
           "with DDP, each reduce-scatter the size of the biases' shards, run inside backward (before the next "
           "module's output gradient), frozen weights without gradients", frozen_per_group,
           reshard_after_forward=raf, freeze_after_init=after)


def frozen_across_groups(s, reshard_after_forward, unfreeze_params):
    torch.manual_seed(42)
    num_linears, lin_dim = 6, 32
    modules = []
    for _ in range(num_linears):
        modules += [nn.Linear(lin_dim, lin_dim), nn.ReLU()]
    model = nn.Sequential(*modules)
    ref = ddp(copy.deepcopy(model), find_unused_parameters=True)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            s.fully_shard(module, reshard_after_forward=reshard_after_forward)
    ref_optim, optim = _adam(ref), _adam(model)

    def set_requires_grad(seq, requires_grad):  # PyTorch's loop, which freezes seq[0] (i % 2 == 0 -> seq[0])
        for i in range(num_linears):
            if i % 2 == 0:
                for p in seq[i % 2].parameters():
                    p.requires_grad_(requires_grad)

    set_requires_grad(model, False)
    set_requires_grad(ref.module, False)
    torch.manual_seed(42 + s.rank)
    inp = torch.randn((8, lin_dim))
    for it in range(3):
        losses = []
        for m, o in ((ref, ref_optim), (model, optim)):
            if unfreeze_params and it == 2:
                set_requires_grad(m.module if m is ref else m, True)
            if it == 1:
                with torch.no_grad():
                    losses.append(m(inp).sum())
            else:
                losses.append(m(inp).sum())
                losses[-1].backward()
                o.step()
                o.zero_grad(set_to_none=it % 2 == 0)
        s.check.close(losses[1], losses[0], f"iteration {it} loss")
    final = [m(inp).sum() for m in (ref, model)]
    s.check.close(final[1], final[0], "loss after the last step")


for raf, unfreeze in itertools.product((False, True, 2), (False, True)):
    SC.add(f"mixed_requires_grad_across_groups_reshard_{raf}_unfreeze_{unfreeze}", 2,
           FROZEN + "test_train_mixed_requires_grad_across_groups",
           "a frozen linear among trainable ones, each its own fully_shard, a no_grad iteration"
           + (", unfrozen for the last step" if unfreeze else "") + ": losses equal DDP's (find_unused_parameters)",
           frozen_across_groups, reshard_after_forward=raf, unfreeze_params=unfreeze)


class MultiForwardMixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer_0 = nn.Linear(5, 5)
        self.layer_no_grad = nn.Linear(5, 5)
        self.layer_with_grad = nn.Linear(5, 5)
        self.layer_no_grad.requires_grad_(False)

    def forward(self, x):
        x = self.layer_0(x)
        for _ in range(3):
            x = self.layer_no_grad(F.relu(self.layer_with_grad(x)))
            with torch.no_grad():
                x += F.relu(self.layer_with_grad(x))
        return x


def multi_forward_mixed(s, reshard_after_forward):
    torch.manual_seed(42)
    model = MultiForwardMixed()
    ref = ddp(copy.deepcopy(model))
    ref_optim = _adam(ref)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            s.fully_shard(module, reshard_after_forward=reshard_after_forward)
    s.fully_shard(model, reshard_after_forward=reshard_after_forward)
    optim = _adam(model)
    for it in range(ITERATIONS):
        inp = torch.randn((8, 5))
        losses = []
        for m, o in ((ref, ref_optim), (model, optim)):
            o.zero_grad(set_to_none=it % 2 == 0)
            losses.append(m(inp).sum())
            losses[-1].backward()
            o.step()
        s.check.close(losses[1], losses[0], f"iteration {it} loss")


for raf in (True, False, 2):
    SC.add(f"multi_forward_mixed_requires_grad_reshard_{raf}", 2, FROZEN + "test_multi_forward_mixed_requires_grad",
           "trainable and frozen linears each run three times, with and without grad: losses equal DDP's",
           multi_forward_mixed, reshard_after_forward=raf)


# ---- clip_grad_norm_


def clip_grad_norm(s, norm_type, hsdp=False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.debug import CommDebugMode

    # PyTorch's max_norm is 1. The test's premise (every gradient, and every local shard, above max_norm
    # before clipping, so that clipping is not vacuous) needs less on this model for the 2- and inf-norms;
    # powers of two, exact in fp32, so that a clipped norm is compared with the same number
    max_norm = {1: 1.0, 2: 0.5}.get(norm_type, 0.125)
    vector_norm = functools.partial(torch.linalg.vector_norm, ord=norm_type)
    torch.manual_seed(42)
    model = Transformer(n_layers=2)
    ref = ddp(copy.deepcopy(model))
    ref_optim = _adam(ref)
    mesh = (init_device_mesh("cpu", (2, s.world_size // 2), mesh_dim_names=("dp_replicate", "dp_shard")) if hsdp
            else init_device_mesh("cpu", (s.world_size,)))
    shard_blocks(s, model, mesh=mesh)
    optim = _adam(model)
    torch.manual_seed(42 + s.rank + 1)
    inp = tokens(model, 3)
    for it in range(2):
        ref_optim.zero_grad()
        ref(inp).sum().backward()
        optim.zero_grad()
        model(inp).sum().backward()
        ref_grads = [p.grad.detach().clone() for p in ref.parameters()]
        local_grads = [p.grad.to_local().detach().clone() for p in model.parameters()]
        for ref_grad, p in zip(ref_grads, model.parameters()):
            s.check.close(p.grad.full_tensor(), ref_grad, f"iteration {it}: full gradient")
        names = [n for n, _ in model.named_parameters()]
        for name, g, lg in zip(names, ref_grads, local_grads):  # the premise: clipping is not vacuous
            s.check.true(vector_norm(g).item() > max_norm, f"iteration {it}: reference {name} gradient's norm "
                         f"{vector_norm(g).item():.3g} already at most {max_norm}")
            s.check.true(lg.numel() == 0 or vector_norm(lg).item() > max_norm, f"iteration {it}: local {name} "
                         f"gradient's norm {vector_norm(lg).item():.3g} already at most {max_norm}")
        ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=max_norm, norm_type=norm_type)
        with CommDebugMode() as comm_mode:
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_norm, norm_type=norm_type,
                                                   foreach=True)
        s.check.true(is_dtensor(total), f"total norm is a {type(total).__name__}")
        s.check.close(total.full_tensor(), ref_total, f"iteration {it}: total norm")
        sharded_dims = sum(1 for pl in next(model.parameters()).placements if isinstance(pl, Shard))
        s.check.equal(comm_mode.get_comm_counts().get(torch.ops.c10d_functional.all_reduce, 0), sharded_dims,
                      f"iteration {it}: all-reduces of the norm (one per sharded mesh dimension)")
        for p, g in zip(ref.parameters(), ref_grads):
            s.check.true(vector_norm(p.grad).item() <= max_norm, f"a reference gradient's norm "
                         f"{vector_norm(p.grad).item():.9g} above max_norm")
            if torch.count_nonzero(g):
                s.check.true(not torch.equal(p.grad, g), "a reference gradient not clipped")
        for p, g in zip(model.parameters(), local_grads):
            s.check.true(vector_norm(p.grad.to_local()).item() <= max_norm, f"a local gradient's norm "
                         f"{vector_norm(p.grad.to_local()).item():.9g} above max_norm")
            if torch.count_nonzero(g):
                s.check.true(not torch.equal(p.grad.to_local(), g), "a local gradient not clipped")
        ref_optim.step()
        optim.step()


for norm_type in (2, 1, float("inf")):
    SC.add(f"clip_grad_norm_1d_norm_{norm_type}", 2, CLIP + "TestClipGradNormWorldSize2.test_clip_grad_norm_1d",
           "torch.nn.utils.clip_grad_norm_ on the DTensor gradients: total norm equals DDP's, one all-reduce, every "
           "local gradient clipped below max_norm", clip_grad_norm, norm_type=norm_type)
for norm_type in (2, float("inf")):
    SC.add(f"clip_grad_norm_hsdp_norm_{norm_type}", 4,
           CLIP + "TestClipGradNormWorldSize4.test_clip_grad_norm_2d (HSDP for TP)",
           "HSDP (2, 2): total norm equals DDP's, one all-reduce per mesh dimension, gradients clipped",
           clip_grad_norm, norm_type=norm_type, hsdp=True)


# ---- autograd


def _global_reference_step(s, ref):
    """The replicated reference saw the whole global batch: its gradient / N is the ranks' mean."""
    for p in ref.parameters():
        if p.grad is not None:
            p.grad.div_(s.world_size)


def unused_forward_output(s, reshard_after_forward):
    torch.manual_seed(42)
    local_batch_size, dim = 2, 24
    global_batch_size = s.world_size * local_batch_size
    model = DoubleLinear(dim=dim, use_second_linear=True)
    ref = copy.deepcopy(model)
    s.fully_shard(model.lin1, reshard_after_forward=reshard_after_forward)
    s.fully_shard(model, reshard_after_forward=reshard_after_forward)
    ref_optim, optim = _adam(ref), _adam(model)
    torch.manual_seed(1)  # the same on all ranks
    for it in range(ITERATIONS):
        global_inp = torch.rand((global_batch_size, dim))
        local_inp = global_inp[s.rank * local_batch_size:(s.rank + 1) * local_batch_size].detach()
        out1, out2 = model(local_inp)
        loss = (out1 * out2).sum() if it < 3 else out1.sum()
        loss.backward()
        optim.step()
        ref_out1, ref_out2 = ref(global_inp)
        ref_loss = (ref_out1 * ref_out2).sum() if it < 3 else ref_out1.sum()
        ref_loss.backward()
        _global_reference_step(s, ref)
        ref_optim.step()
        dist.all_reduce(loss)  # partial -> replicated
        s.check.close(loss, ref_loss, f"iteration {it} loss")
        optim.zero_grad(set_to_none=bool(it % 2))
        ref_optim.zero_grad(set_to_none=bool(it % 2))
        sharded_parity(s, ref, model, f"iteration {it}")


for raf in (True, False, 2):
    SC.add(f"unused_forward_output_reshard_{raf}", 2, AUTOGRAD + "test_unused_forward_output",
           "the loss uses both outputs, then only the first: global loss and sharded parity with one process on "
           "the global batch", unused_forward_output, reshard_after_forward=raf)


def unused_forward_module(s, reshard_after_forward):
    torch.manual_seed(42)
    local_batch_size, dim = 2, 24
    global_batch_size = s.world_size * local_batch_size
    model = DoubleLinear(dim=dim, use_second_linear=False)
    ref = copy.deepcopy(model)
    s.fully_shard(model.lin1, reshard_after_forward=reshard_after_forward)
    s.fully_shard(model.lin2, reshard_after_forward=reshard_after_forward)
    s.fully_shard(model, reshard_after_forward=reshard_after_forward)
    ref_optim, optim = _adam(ref), _adam(model)
    torch.manual_seed(1)
    for it in range(ITERATIONS):
        global_inp = torch.rand((global_batch_size, dim))
        local_inp = global_inp[s.rank * local_batch_size:(s.rank + 1) * local_batch_size].detach()
        losses = []
        for m, inp in ((ref, global_inp), (model, local_inp)):
            losses.append(m(inp).sum())
            losses[-1].backward()
        _global_reference_step(s, ref)
        dist.all_reduce(losses[1])
        s.check.close(losses[1], losses[0], f"iteration {it} loss")
        sharded_parity(s, ref, model, f"iteration {it}")
        s.check.true(model.lin2.weight.grad is None, "the unused module got a gradient")
        for o in (optim, ref_optim):
            o.step()
            o.zero_grad(set_to_none=bool(it % 2))


for raf in (True, False, 2):
    SC.add(f"unused_forward_module_reshard_{raf}", 2, AUTOGRAD + "test_unused_forward_module",
           "an FSDP module never run in forward: no gradient for it, loss and sharded parity with one process",
           unused_forward_module, reshard_after_forward=raf)


def _is_namedtuple(x):
    return isinstance(x, tuple) and hasattr(x, "_fields")


NT = collections.namedtuple("NT", "x y")


class ContainerModule(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, inp):
        if isinstance(inp, list):
            return [self._forward(inp[0])]
        if _is_namedtuple(inp):
            return type(inp)(*([self._forward(inp[0])] + list(inp[1:])))
        if isinstance(inp, tuple):
            return (self._forward(inp[0]),)
        if isinstance(inp, dict):
            return {"x": self._forward(inp["x"])}
        raise NotImplementedError(type(inp))

    def _forward(self, x):
        return F.relu(self.lin2(F.relu(self.lin1(x))))


class ToContainer(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, x):
        return {"list": lambda: [x], "namedtuple": lambda: NT(x, torch.ones_like(x)), "tuple": lambda: (x,),
                "dict": lambda: {"x": x}}[self.kind]()


class FromContainer(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, x):
        return x["x"] if self.kind == "dict" else x[0]


def nontensor_activations(s, kind):
    torch.manual_seed(42)
    local_batch_size, dim = 2, 24
    global_batch_size = s.world_size * local_batch_size
    model = nn.Sequential(ToContainer(kind), ContainerModule(dim), ContainerModule(dim), ContainerModule(dim),
                          FromContainer(kind))
    ref = copy.deepcopy(model)
    for module in model:
        s.fully_shard(module)
    s.fully_shard(model)
    ref_optim, optim = _adam(ref), _adam(model)
    torch.manual_seed(1)
    for it in range(ITERATIONS):
        global_inp = torch.rand((global_batch_size, dim))
        local_inp = global_inp[s.rank * local_batch_size:(s.rank + 1) * local_batch_size].detach()
        losses = []
        for m, inp in ((ref, global_inp), (model, local_inp)):
            losses.append(m(inp).sum())
            losses[-1].backward()
        _global_reference_step(s, ref)
        dist.all_reduce(losses[1])
        s.check.close(losses[1], losses[0], f"iteration {it} loss")
        sharded_parity(s, ref, model, f"iteration {it}")
        for o in (optim, ref_optim):
            o.step()
            o.zero_grad(set_to_none=bool(it % 2))


for kind in ("list", "namedtuple", "tuple", "dict"):
    SC.add(f"nontensor_activations_{kind}", 2, AUTOGRAD + "test_nontensor_activations",
           f"activations passed between FSDP modules in a {kind}: loss and sharded parity with one process",
           nontensor_activations, kind=kind)


class Scaled(nn.Module):
    """Non-tensor arguments (a float, a str, None) in; a dict of a tensor and non-tensors out."""

    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x, scale, mode="relu", extra=None):
        h = self.lin(x) * scale
        h = F.relu(h) if mode == "relu" else torch.tanh(h)
        if extra is not None:
            h = h + extra
        return {"out": h, "mode": mode, "rows": int(h.shape[0])}


class ScaledStack(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.a, self.b = Scaled(dim), Scaled(dim)

    def forward(self, x):
        first = self.a(x, 0.5, mode="tanh")
        second = self.b(first["out"], scale=2.0, extra=None)
        return second["out"], first["mode"], second["rows"]


@SC.register("nontensor_args_and_outputs", 2, "derived from " + AUTOGRAD + "test_nontensor_activations",
             "float / str / None arguments (positional and keyword) into FSDP modules and a dict with non-tensors "
             "out: non-tensors pass through unchanged, loss and sharded parity with one process for 3 steps")
def nontensor_args_and_outputs(s):
    torch.manual_seed(42)
    dim, local_batch_size = 12, 2
    model = ScaledStack(dim)
    ref = copy.deepcopy(model)
    s.fully_shard(model.a)
    s.fully_shard(model.b)
    s.fully_shard(model)
    ref_optim, optim = _adam(ref), _adam(model)
    torch.manual_seed(1)
    for it in range(ITERATIONS):
        global_inp = torch.rand((s.world_size * local_batch_size, dim))
        local_inp = global_inp[s.rank * local_batch_size:(s.rank + 1) * local_batch_size]
        out, mode, rows = model(local_inp)
        s.check.equal((mode, rows), ("tanh", local_batch_size), "non-tensor outputs")
        loss = out.sum()
        loss.backward()
        ref_loss = ref(global_inp)[0].sum()
        ref_loss.backward()
        _global_reference_step(s, ref)
        dist.all_reduce(loss)
        s.check.close(loss, ref_loss, f"iteration {it} loss")
        sharded_parity(s, ref, model, f"iteration {it}")
        for o in (optim, ref_optim):
            o.step()
            o.zero_grad()


OUT = Outcomes(SC, timeout=240)


def test_the_docstring_table_lists_every_scenario():
    assert SC.missing_from(__doc__) == []


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize("system,name,world_size", SC.cases())
def test_scenario(system, name, world_size):
    failures = OUT.failures(system, name, world_size)
    assert failures is None, failures
