"""FSDP2's mixed precision (PyTorch's test_fully_shard_mixed_precision.py, with the grouped
cast_forward_inputs case of test_fully_shard_training.py), on `torch` and `zerokit` alike, with
torch's own MixedPrecisionPolicy objects passed to both (tests/fsdp2_scenarios.py: one launch per
world size and system, checks that record and go on, public API only).

The references are PyTorch's: a low-precision copy of a replicated model for forward and
backward, its gradients reduced as FSDP2 reduces them (in the reduce dtype: reduce-scatter then
all-gather, or an fp32 all-reduce), an fp32 optimizer step on an fp32 copy, compared with the
tolerances of PyTorch's assertEqual for the dtype. Where PyTorch reads FSDP2's internals:
- `_get_gradient_divide_factors` (how FSDP2 divides by N): its rule written out here (AVG for
  fp32/bf16; for fp16 a pre-divide by the power of two below sqrt(N) and a post-divide);
- `reduce_scatter_with_assert` on `dist.reduce_scatter_single`: CommSpy (it also sees
  reduce_scatter_tensor), asserting each reduce-scatter's dtype.
PyTorch runs these tests on GPUs only (NCCL, or skip_if_lt_x_gpu); on CPU gloo torch passes them
too, bf16 and fp16 collectives included, except test_reduce_dtype_after_frozen_first_forward, whose
backward torch 2.13 refuses on CPU ("attempting to assign a gradient with dtype 'c10::BFloat16' to
a tensor with grad_dtype 'Float'"): left out. BatchNorm with fp32 running stats under a 16-bit
param_dtype raises on CPU (PyTorch expects that on CUDA/XPU only); asserted as such. Left out too: the JVP test (meta-device + torch.func.jvp with
CUDA generators), set_gradient_divide_factor (not in the contract), shard_placement_fn variants.

Scenarios (name, world size N, <- the PyTorch test it ports; then what it asserts):

- compute_dtype_bfloat16_reshard_False (N=2) <- test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionTraining.test_compute_dtype
    param_dtype bfloat16, reduce_dtype None: loss in bfloat16, every reduce-scatter in bfloat16, loss
    and fp32 shards equal a low-precision replicated reference with an fp32 step
- compute_dtype_bfloat16_reshard_True (N=2) <- test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionTraining.test_compute_dtype
    param_dtype bfloat16, reduce_dtype None: loss in bfloat16, every reduce-scatter in bfloat16, loss
    and fp32 shards equal a low-precision replicated reference with an fp32 step
- compute_dtype_bfloat16_reshard_2 (N=2) <- test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionTraining.test_compute_dtype
    param_dtype bfloat16, reduce_dtype None: loss in bfloat16, every reduce-scatter in bfloat16, loss
    and fp32 shards equal a low-precision replicated reference with an fp32 step
- compute_dtype_float16_reshard_True (N=2) <- test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionTraining.test_compute_dtype
    param_dtype float16, reduce_dtype None: loss in float16, every reduce-scatter in float16, loss and
    fp32 shards equal a low-precision replicated reference with an fp32 step
- reduce_dtype_fp32_reshard_False (N=2) <- test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionTraining.test_reduce_dtype (fp32 reduce)
    bf16 compute, reduce_dtype fp32: reduce-scatters in fp32, loss and shards equal a bf16 reference
    all-reducing in fp32
- reduce_dtype_bf16_reshard_False (N=2) <- test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionTraining.test_reduce_dtype (bf16 reduce)
    fp32 compute, reduce_dtype bf16: reduce-scatters in bf16, loss and shards equal an fp32 reference
    reducing in bf16
- reduce_dtype_fp32_reshard_True (N=2) <- test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionTraining.test_reduce_dtype (fp32 reduce)
    bf16 compute, reduce_dtype fp32: reduce-scatters in fp32, loss and shards equal a bf16 reference
    all-reducing in fp32
- reduce_dtype_bf16_reshard_True (N=2) <- test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionTraining.test_reduce_dtype (bf16 reduce)
    fp32 compute, reduce_dtype bf16: reduce-scatters in bf16, loss and shards equal an fp32 reference
    reducing in bf16
- reduce_dtype_fp32_reshard_2 (N=2) <- test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionTraining.test_reduce_dtype (fp32 reduce)
    bf16 compute, reduce_dtype fp32: reduce-scatters in fp32, loss and shards equal a bf16 reference
    all-reducing in fp32
- reduce_dtype_bf16_reshard_2 (N=2) <- test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionTraining.test_reduce_dtype (bf16 reduce)
    fp32 compute, reduce_dtype bf16: reduce-scatters in bf16, loss and shards equal an fp32 reference
    reducing in bf16
- grad_acc_with_reduce_dtype_reshard_True (N=2) <- test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionTraining.test_grad_acc_with_reduce_dtype
    bf16 compute, fp32 reduce, 4 microbatches without sync but the last: no reduce-scatter until the
    last (in fp32), the accumulated gradients equal a reference accumulating bf16 gradients in fp32
- grad_acc_with_reduce_dtype_reshard_False (N=2) <- test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionTraining.test_grad_acc_with_reduce_dtype
    bf16 compute, fp32 reduce, 4 microbatches without sync but the last: no reduce-scatter until the
    last (in fp32), the accumulated gradients equal a reference accumulating bf16 gradients in fp32
- structured_dataclass_fp32 (N=2) <- test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionTraining.test_structured_input_output
    activations passed between FSDP modules as a dataclass, fp32: the global loss equals one process's
    on the global batch, sharded parity
- structured_dataclass_bf16_reduce_bfloat16 (N=2) <- test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionTraining.test_structured_input_output
    activations passed between FSDP modules as a dataclass, bf16 reduce bfloat16: the global loss equals
    one process's on the global batch
- structured_dataclass_bf16_reduce_float32 (N=2) <- test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionTraining.test_structured_input_output
    activations passed between FSDP modules as a dataclass, bf16 reduce float32: the global loss equals
    one process's on the global batch
- structured_nested_dataclass_fp32 (N=2) <- test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionTraining.test_structured_input_output
    activations passed between FSDP modules as a nested dataclass, fp32: the global loss equals one
    process's on the global batch, sharded parity
- structured_nested_dataclass_bf16_reduce_bfloat16 (N=2) <- test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionTraining.test_structured_input_output
    activations passed between FSDP modules as a nested dataclass, bf16 reduce bfloat16: the global loss
    equals one process's on the global batch
- structured_nested_dataclass_bf16_reduce_float32 (N=2) <- test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionTraining.test_structured_input_output
    activations passed between FSDP modules as a nested dataclass, bf16 reduce float32: the global loss
    equals one process's on the global batch
- structured_namedtuple_fp32 (N=2) <- test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionTraining.test_structured_input_output
    activations passed between FSDP modules as a namedtuple, fp32: the global loss equals one process's
    on the global batch, sharded parity
- structured_namedtuple_bf16_reduce_bfloat16 (N=2) <- test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionTraining.test_structured_input_output
    activations passed between FSDP modules as a namedtuple, bf16 reduce bfloat16: the global loss
    equals one process's on the global batch
- structured_namedtuple_bf16_reduce_float32 (N=2) <- test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionTraining.test_structured_input_output
    activations passed between FSDP modules as a namedtuple, bf16 reduce float32: the global loss equals
    one process's on the global batch
- float16_on_one_submodule (N=2) <- test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionCasts.test_float16_on_one_submodule
    fp16 on one child only: (1) c2's inputs cast to fp16 by its policy, (2) not with
    cast_forward_inputs=False (the module casts), (3) c1 with output_dtype fp32 hands c2 fp32
- submodules_with_external_inputs_cast_False (N=2) <- test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionCasts.test_submodules_with_external_inputs
    a child's input made inside the root's forward is left fp32 by the child's cast_forward_inputs
- submodules_with_external_inputs_cast_True (N=2) <- test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionCasts.test_submodules_with_external_inputs
    a child's input made inside the root's forward is cast to fp16 by the child's cast_forward_inputs
- checkpoint_recompute_casts_input (N=2) <- test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionCasts.test_checkpoint_recompute_casts_forward_inputs
    under torch.utils.checkpoint the recompute casts the input as the forward did (bf16 in / fp32 out)
- checkpoint_recompute_casts_output (N=2) <- test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionCasts.test_checkpoint_recompute_casts_outputs
    under torch.utils.checkpoint the recompute casts the output as the forward did (bf16 in / fp32 out)
- norm_modules_bfloat16 (N=2) <- test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionCasts.test_norm_modules_bf16
    param_dtype bfloat16: LayerNorm runs in bfloat16; BatchNorm1d/2d with fp32 running stats raise CPU's
    dtype error (buffers are not cast); with the stats cast, or the norm in fp32 with output_dtype,
    bfloat16 out and backward runs
- norm_modules_float16 (N=2) <- test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionCasts.test_norm_modules_fp16
    param_dtype float16: LayerNorm runs in float16; BatchNorm1d/2d with fp32 running stats raise CPU's
    dtype error (buffers are not cast); with the stats cast, or the norm in fp32 with output_dtype,
    float16 out and backward runs
- clamp_reduce_dtype (N=2) <- test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionCasts.test_clamp_reduce_dtype
    bf16 param and reduce dtype on a model built in bf16 then moved to fp32: the reduce-scatters stay
    bf16
- grouped_module_cast_forward_inputs (N=2) <- test_fully_shard_training.py::TestFullyShard1DTrainingCompose.test_grouped_module_cast_forward_inputs
    fully_shard([a, b]) with bf16 and cast_forward_inputs: b's fp32 input is cast too, output bf16,
    every parameter gets a gradient
"""

import copy
import dataclasses
import itertools
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp2_scenarios import ITERATIONS, MLP, CommSpy, Outcomes, Scenarios, broadcast_module, sharded_parity

SC = Scenarios()
SRC = "test_fully_shard_mixed_precision.py::"
TRAINING = SRC + "TestFullyShardMixedPrecisionTraining."
CASTS = SRC + "TestFullyShardMixedPrecisionCasts."


def _policy(**kw):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(**kw)


def _init(s, reshard_after_forward, param_dtype, reduce_dtype):
    torch.manual_seed(42)
    model = nn.Sequential(*[MLP(16) for _ in range(3)])
    ref = copy.deepcopy(model)
    ref_optim = torch.optim.Adam(ref.parameters(), lr=1e-2)
    kw = dict(reshard_after_forward=reshard_after_forward, mp_policy=_policy(param_dtype=param_dtype,
                                                                             reduce_dtype=reduce_dtype))
    for mlp in model:
        s.fully_shard(mlp, **kw)
    s.fully_shard(model, **kw)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    return ref, ref_optim, model, optim


def _scatter_dtypes(s, spy, dtype, what):
    scatters = spy.of("RS")
    s.check.true(len(scatters) > 0, f"{what}: no reduce-scatter")
    s.check.equal(sorted({str(e.dtype) for e in scatters}), [str(dtype)], f"{what}: reduce-scatter dtypes")


def _divide_factors(dtype, n):
    """FSDP2's rule for dividing a gradient sum by N (None: the collective averages)."""
    if dtype in (torch.float32, torch.bfloat16):
        return None, None
    pre = 1
    while n % pre == 0 and n / pre > pre:
        pre *= 2
    return pre, n / pre


def _reduce_as_fsdp(grad, dtype, n):
    """The reference's reduction in `dtype`: reduce-scatter then all-gather (PyTorch's test uses it
    instead of an all-reduce, whose numerics differ), with FSDP2's division."""
    pre, post = _divide_factors(dtype, n)
    grad = grad.to(dtype)
    if pre is not None and pre > 1:
        grad.div_(pre)
    out = torch.zeros_like(torch.chunk(grad, n)[0])
    dist.reduce_scatter_single(out, grad, op=dist.ReduceOp.SUM if pre is not None else dist.ReduceOp.AVG)
    dist.all_gather_single(grad, out)
    if post is not None and post > 1:
        grad.div_(post)
    return grad


def _step_low_precision_reference(ref, ref_low, ref_optim, reduced):
    """fp32 optimizer step on the fp32 copy from the reduced low-precision gradients, then copy back."""
    for p32, plow, g in zip(ref.parameters(), ref_low.parameters(), reduced):
        p32.grad = g.to(p32.dtype)
        plow.grad = None
    ref_optim.step()
    for p32, plow in zip(ref.parameters(), ref_low.parameters()):
        plow.detach().copy_(p32)


def compute_dtype(s, param_dtype, reshard_after_forward):
    ref, ref_optim, model, optim = _init(s, reshard_after_forward, param_dtype, None)
    ref_low = copy.deepcopy(ref).to(param_dtype)
    torch.manual_seed(42 + s.rank + 1)
    inp = torch.randn((4, 16), dtype=param_dtype)
    for it in range(ITERATIONS):
        optim.zero_grad(set_to_none=it % 2 == 0)
        loss = model(inp).sum()
        s.check.equal(loss.dtype, param_dtype, "loss dtype")
        with CommSpy() as spy:
            loss.backward()
        _scatter_dtypes(s, spy, param_dtype, f"iteration {it} (reduce_dtype=None: the compute dtype)")
        optim.step()
        ref_optim.zero_grad(set_to_none=it % 2 == 0)
        ref_loss = ref_low(inp).sum()
        ref_loss.backward()
        reduced = [_reduce_as_fsdp(p.grad, param_dtype, s.world_size) for p in ref_low.parameters()]
        _step_low_precision_reference(ref, ref_low, ref_optim, reduced)
        s.check.close(loss, ref_loss, f"iteration {it} loss")
        sharded_parity(s, ref, model, f"iteration {it}")


for dtype, raf in [(torch.bfloat16, False), (torch.bfloat16, True), (torch.bfloat16, 2), (torch.float16, True)]:
    name = str(dtype).split(".")[1]
    SC.add(f"compute_dtype_{name}_reshard_{raf}", 2, TRAINING + "test_compute_dtype",
           f"param_dtype {name}, reduce_dtype None: loss in {name}, every reduce-scatter in {name}, loss and "
           "fp32 shards equal a low-precision replicated reference with an fp32 step", compute_dtype,
           param_dtype=dtype, reshard_after_forward=raf)


def reduce_dtype_fp32(s, reshard_after_forward):
    param_dtype, reduce_dtype = torch.bfloat16, torch.float32
    ref, ref_optim, model, optim = _init(s, reshard_after_forward, param_dtype, reduce_dtype)
    ref_low = copy.deepcopy(ref).to(param_dtype)
    torch.manual_seed(42 + s.rank + 1)
    inp = torch.randn((4, 16), dtype=param_dtype)
    for it in range(ITERATIONS):
        optim.zero_grad(set_to_none=it % 2 == 0)
        loss = model(inp).sum()
        with CommSpy() as spy:
            loss.backward()
        _scatter_dtypes(s, spy, reduce_dtype, f"iteration {it}")
        optim.step()
        ref_optim.zero_grad(set_to_none=it % 2 == 0)
        ref_loss = ref_low(inp).sum()
        ref_loss.backward()
        reduced = []
        for p in ref_low.parameters():
            g = p.grad.to(torch.float32)
            dist.all_reduce(g)  # fp32 reduction
            reduced.append(g / s.world_size)
        _step_low_precision_reference(ref, ref_low, ref_optim, reduced)
        s.check.close(loss, ref_loss, f"iteration {it} loss")
        sharded_parity(s, ref, model, f"iteration {it}")


def reduce_dtype_bf16(s, reshard_after_forward):
    param_dtype, reduce_dtype = torch.float32, torch.bfloat16
    ref, ref_optim, model, optim = _init(s, reshard_after_forward, param_dtype, reduce_dtype)
    torch.manual_seed(42 + s.rank + 1)
    inp = torch.randn((4, 16), dtype=param_dtype)
    for it in range(ITERATIONS):
        optim.zero_grad(set_to_none=it % 2 == 0)
        loss = model(inp).sum()
        with CommSpy() as spy:
            loss.backward()
        _scatter_dtypes(s, spy, reduce_dtype, f"iteration {it}")
        optim.step()
        ref_optim.zero_grad(set_to_none=it % 2 == 0)
        ref_loss = ref(inp).sum()
        ref_loss.backward()
        for p in ref.parameters():  # bf16 reduction, upcast to fp32
            p.grad = _reduce_as_fsdp(p.grad, reduce_dtype, s.world_size).to(p.dtype)
        ref_optim.step()
        s.check.close(loss, ref_loss, f"iteration {it} loss")
        sharded_parity(s, ref, model, f"iteration {it}")


for raf in (False, True, 2):
    SC.add(f"reduce_dtype_fp32_reshard_{raf}", 2, TRAINING + "test_reduce_dtype (fp32 reduce)",
           "bf16 compute, reduce_dtype fp32: reduce-scatters in fp32, loss and shards equal a bf16 reference "
           "all-reducing in fp32", reduce_dtype_fp32, reshard_after_forward=raf)
    SC.add(f"reduce_dtype_bf16_reshard_{raf}", 2, TRAINING + "test_reduce_dtype (bf16 reduce)",
           "fp32 compute, reduce_dtype bf16: reduce-scatters in bf16, loss and shards equal an fp32 reference "
           "reducing in bf16", reduce_dtype_bf16, reshard_after_forward=raf)


def grad_acc_with_reduce_dtype(s, reshard_after_forward):
    torch.manual_seed(42)
    param_dtype, reduce_dtype = torch.bfloat16, torch.float32
    policy = _policy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    model = nn.Sequential(*[MLP(16) for _ in range(3)])
    ref = copy.deepcopy(model)  # fp32 for the optimizer
    ref_compute = copy.deepcopy(ref).to(param_dtype)  # bf16 for forward/backward
    ref_optim = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for mlp in model:
        s.fully_shard(mlp, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    s.fully_shard(model, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(42 + s.rank + 1)
    num_microbatches = 4
    inp = torch.randn((2 * num_microbatches, 16), dtype=param_dtype)
    for it in range(3):
        microbatches = torch.chunk(inp, num_microbatches)
        for mb in range(num_microbatches):
            last = mb == num_microbatches - 1
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last or reshard_after_forward)
            losses = []
            with CommSpy() as spy:
                for m in (ref_compute, model):
                    losses.append(m(microbatches[mb].detach()).sum())
                    s.check.equal(losses[-1].dtype, param_dtype, "loss dtype")
                    losses[-1].backward()
            if last:
                _scatter_dtypes(s, spy, reduce_dtype, f"iteration {it}, last microbatch")
            else:
                s.check.equal(len(spy.of("RS")), 0, f"iteration {it} microbatch {mb}: reduce-scatters without sync")
            s.check.close(losses[1], losses[0], f"iteration {it} microbatch {mb} loss")
            for p, pc in zip(ref.parameters(), ref_compute.parameters()):  # accumulate in fp32
                if p.grad is not None:
                    p.grad += pc.grad
                else:
                    p.grad = pc.grad.to(p.dtype)
                pc.grad = None
            if last:
                for p in ref.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= s.world_size
        sharded_parity(s, ref, model, f"iteration {it}")
        ref_optim.step()
        optim.step()
        ref_optim.zero_grad(set_to_none=it % 2 == 0)
        optim.zero_grad(set_to_none=it % 2 == 0)
        for p, pc in zip(ref.parameters(), ref_compute.parameters()):
            pc.detach().copy_(p)


for raf in (True, False):
    SC.add(f"grad_acc_with_reduce_dtype_reshard_{raf}", 2, TRAINING + "test_grad_acc_with_reduce_dtype",
           "bf16 compute, fp32 reduce, 4 microbatches without sync but the last: no reduce-scatter until the last "
           "(in fp32), the accumulated gradients equal a reference accumulating bf16 gradients in fp32",
           grad_acc_with_reduce_dtype, reshard_after_forward=raf)


# ---- structured activations (dataclass, nested dataclass, NamedTuple)


@dataclasses.dataclass
class DC:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class Inner:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class Outer:
    inner: Inner
    z: torch.Tensor


class TensorPair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


class ContainerModule(nn.Module):
    def __init__(self, ctype, dim):
        super().__init__()
        self.ctype, self._layer = ctype, nn.Linear(dim, dim)

    def forward(self, inp):
        if self.ctype == "dataclass":
            return DC(x=self._layer(inp.x), y=self._layer(inp.y))
        if self.ctype == "nested_dataclass":
            return Outer(inner=Inner(x=self._layer(inp.inner.x), y=self._layer(inp.inner.y)), z=self._layer(inp.z))
        return TensorPair(x=self._layer(inp.x), y=self._layer(inp.y))


class ToStructure(nn.Module):
    def __init__(self, ctype):
        super().__init__()
        self.ctype = ctype

    def forward(self, x):
        if self.ctype == "dataclass":
            return DC(x=x, y=x.clone())
        if self.ctype == "nested_dataclass":
            return Outer(inner=Inner(x=x, y=x.clone()), z=x.clone())
        return TensorPair(x=x, y=x.clone())


class FromStructure(nn.Module):
    def __init__(self, ctype):
        super().__init__()
        self.ctype = ctype

    def forward(self, inp):
        if self.ctype == "nested_dataclass":
            return inp.inner.x + inp.inner.y + inp.z
        return inp.x + inp.y


def structured_input_output(s, container_type, param_dtype, reduce_dtype):
    torch.manual_seed(42)
    dim, local_batch_size = 16, 2
    global_batch_size = s.world_size * local_batch_size
    model = nn.Sequential(ToStructure(container_type), ContainerModule(container_type, dim),
                          ContainerModule(container_type, dim), FromStructure(container_type))
    ref = copy.deepcopy(model)
    policy = _policy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for module in model:
        s.fully_shard(module, mp_policy=policy)
    s.fully_shard(model, mp_policy=policy)
    ref_compute = copy.deepcopy(ref).to(param_dtype) if param_dtype is not None else None
    ref_optim = torch.optim.Adam(ref.parameters(), lr=1e-2)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(1)  # the same on all ranks
    for it in range(ITERATIONS):
        global_inp = torch.rand((global_batch_size, dim))
        local_inp = global_inp[s.rank * local_batch_size:(s.rank + 1) * local_batch_size].detach()
        optim.zero_grad(set_to_none=it % 2 == 0)
        loss = model(local_inp).sum()
        loss.backward()
        optim.step()
        ref_optim.zero_grad(set_to_none=it % 2 == 0)
        if param_dtype is not None:
            ref_loss = ref_compute(global_inp.to(param_dtype)).sum()
            ref_loss.backward()
            for p in ref_compute.parameters():  # the global batch's gradient; FSDP2 averages the ranks'
                if reduce_dtype is not None and reduce_dtype != param_dtype:
                    p.grad.data = p.grad.to(reduce_dtype)
                    dist.all_reduce(p.grad)
                p.grad.div_(s.world_size)
            for p32, pc in zip(ref.parameters(), ref_compute.parameters()):
                p32.grad = pc.grad.to(p32.dtype)
                pc.grad = None
            ref_optim.step()
            for p32, pc in zip(ref.parameters(), ref_compute.parameters()):
                pc.detach().copy_(p32)
        else:
            ref_loss = ref(global_inp).sum()
            ref_loss.backward()
            for p in ref.parameters():
                p.grad.div_(s.world_size)
            ref_optim.step()
        dist.all_reduce(loss)  # partial -> replicated
        s.check.close(loss, ref_loss, f"iteration {it} loss")
        if param_dtype is None:  # PyTorch checks parity in fp32 only (bf16 accumulation drifts)
            sharded_parity(s, ref, model, f"iteration {it}")


for ctype, (pdt, rdt) in itertools.product(("dataclass", "nested_dataclass", "namedtuple"),
                                            ((None, None), (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32))):
    label = "fp32" if pdt is None else f"bf16_reduce_{str(rdt).split('.')[1]}"
    SC.add(f"structured_{ctype}_{label}", 2, TRAINING + "test_structured_input_output",
           f"activations passed between FSDP modules as a {ctype.replace('_', ' ')}, {label.replace('_', ' ')}: "
           "the global loss equals one process's on the global batch" + (", sharded parity" if pdt is None else ""),
           structured_input_output, container_type=ctype, param_dtype=pdt, reduce_dtype=rdt)


# ---- casts


class SaveForwardInputsModule(nn.Module):
    def __init__(self, forward_inputs, cast_forward_inputs, dim=16):
        super().__init__()
        self.l = nn.Linear(dim, dim)
        self.forward_inputs, self.cast_forward_inputs = forward_inputs, cast_forward_inputs

    def forward(self, x):
        self.forward_inputs[self] = x
        return self.l(x.to(self.l.weight.dtype) if self.cast_forward_inputs else x)


class SaveForwardInputsModel(nn.Module):
    def __init__(self, forward_inputs, cast_forward_inputs):
        super().__init__()
        self.c1 = SaveForwardInputsModule(forward_inputs, cast_forward_inputs)
        self.c2 = SaveForwardInputsModule(forward_inputs, cast_forward_inputs)
        self.forward_inputs = forward_inputs

    def forward(self, x):
        self.forward_inputs[self] = x
        return self.c2(self.c1(x))


@SC.register("float16_on_one_submodule", 2, CASTS + "test_float16_on_one_submodule",
             "fp16 on one child only: (1) c2's inputs cast to fp16 by its policy, (2) not with "
             "cast_forward_inputs=False (the module casts), (3) c1 with output_dtype fp32 hands c2 fp32")
def float16_on_one_submodule(s):
    fp16, fp32 = torch.float16, torch.float32
    x = torch.zeros(2, 16)
    inputs = {}
    model = SaveForwardInputsModel(inputs, cast_forward_inputs=False)
    s.fully_shard(model.c2, mp_policy=_policy(param_dtype=fp16))
    s.fully_shard(model)
    model(x).sum().backward()
    s.check.equal([inputs[m].dtype for m in (model, model.c1, model.c2)], [fp32, fp32, fp16], "(1) input dtypes")
    inputs = {}
    model = SaveForwardInputsModel(inputs, cast_forward_inputs=True)
    s.fully_shard(model.c2, mp_policy=_policy(param_dtype=fp16, cast_forward_inputs=False))
    s.fully_shard(model)
    model(x).sum().backward()
    s.check.equal([inputs[m].dtype for m in (model, model.c1, model.c2)], [fp32, fp32, fp32], "(2) input dtypes")
    inputs = {}
    model = SaveForwardInputsModel(inputs, cast_forward_inputs=False)
    s.fully_shard(model.c1, mp_policy=_policy(param_dtype=fp16, output_dtype=fp32))
    s.fully_shard(model)
    model(x).sum().backward()
    s.check.equal([inputs[m].dtype for m in (model, model.c1, model.c2)], [fp32, fp16, fp32], "(3) input dtypes")


def submodules_with_external_inputs(s, enable_submodule_cast):
    class ToyModule(nn.Module):
        def __init__(self, forward_inputs):
            super().__init__()
            self.l, self.forward_inputs = nn.Linear(16, 16), forward_inputs

        def forward(self, x, y):
            self.forward_inputs["l2_input_x"], self.forward_inputs["l2_input_y"] = x, y
            return self.l(x)

    class ToyModel(nn.Module):
        def __init__(self, forward_inputs):
            super().__init__()
            self.l1, self.l2, self.forward_inputs = nn.Linear(16, 16), ToyModule(forward_inputs), forward_inputs

        def forward(self, x):
            self.forward_inputs["model_input_x"] = x
            y = torch.ones(2, 16, dtype=torch.float32)  # an input from outside the root's arguments
            return self.l2(self.l1(x), y)

    inputs = {}
    model = ToyModel(inputs)
    s.fully_shard(model.l2, mp_policy=_policy(param_dtype=torch.float16, cast_forward_inputs=enable_submodule_cast))
    s.fully_shard(model, mp_policy=_policy(param_dtype=torch.float16))
    model(torch.zeros(2, 16)).sum().backward()
    s.check.equal(inputs["model_input_x"].dtype, torch.float16, "root input")
    s.check.equal(inputs["l2_input_x"].dtype, torch.float16, "l2's x")
    s.check.equal(inputs["l2_input_y"].dtype, torch.float16 if enable_submodule_cast else torch.float32, "l2's y")


for cast in (False, True):
    SC.add(f"submodules_with_external_inputs_cast_{cast}", 2, CASTS + "test_submodules_with_external_inputs",
           f"a child's input made inside the root's forward is {'cast to fp16' if cast else 'left fp32'} by the "
           "child's cast_forward_inputs", submodules_with_external_inputs, enable_submodule_cast=cast)


def checkpoint_recompute_casts(s, recompute_cast):
    from torch.utils.checkpoint import checkpoint

    class RecordingLinear(nn.Linear):
        def __init__(self):
            super().__init__(1, 1)
            self.input_dtypes = []

        def forward(self, x):
            self.input_dtypes.append(x.dtype)
            return super().forward(x)

    class Model(nn.Module):
        def __init__(self, checkpoint_input_dtype):
            super().__init__()
            self.linear1, self.checkpoint_input_dtype = RecordingLinear(), checkpoint_input_dtype
            self.linear1_output_dtypes = []

        def checkpointed_linear1(self, x):
            x = self.linear1(x)
            self.linear1_output_dtypes.append(x.dtype)
            return x

        def forward(self, x):
            x = checkpoint(self.checkpointed_linear1, x.to(self.checkpoint_input_dtype), use_reentrant=False,
                           early_stop=False)
            return x.float().sum()

    if recompute_cast == "input":
        in_dtype, policy = torch.float32, _policy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    else:
        in_dtype, policy = torch.bfloat16, _policy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                                   output_dtype=torch.float32, cast_forward_inputs=False)
    torch.manual_seed(42)
    model = Model(in_dtype)
    s.fully_shard(model.linear1, mp_policy=policy)
    s.fully_shard(model, mp_policy=policy)
    model(torch.randn(8, 1)).backward()
    if recompute_cast == "input":
        s.check.equal(model.linear1.input_dtypes, [torch.bfloat16] * 2, "linear1's inputs, forward and recompute")
    else:
        s.check.equal(model.linear1_output_dtypes, [torch.float32] * 2, "linear1's outputs, forward and recompute")


for cast in ("input", "output"):
    SC.add(f"checkpoint_recompute_casts_{cast}", 2, CASTS + f"test_checkpoint_recompute_casts_{cast}s"
           if cast == "output" else CASTS + "test_checkpoint_recompute_casts_forward_inputs",
           f"under torch.utils.checkpoint the recompute casts the {cast} as the forward did (bf16 in / fp32 out)",
           checkpoint_recompute_casts, recompute_cast=cast)


def norm_modules(s, param_dtype):
    policy = _policy(param_dtype=param_dtype)

    def inner(model, x):
        z = model(x)
        s.check.equal(z.dtype, param_dtype, f"{type(model[1]).__name__} output dtype")
        z.sum().backward()

    def sharded(*modules):
        model = nn.Sequential(*modules)
        for module in (model[0], model[1], model[2], model):
            s.fully_shard(module, mp_policy=policy)
        return model

    inner(sharded(nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 32)), torch.randn((4, 32)))
    # FSDP2 casts parameters, not buffers: a batch norm's fp32 running stats meet a low-precision input,
    # which CPU's batch_norm refuses (PyTorch's test expects this error for BatchNorm2d on CUDA and XPU)
    model = sharded(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Linear(32, 32))
    s.check.raises(RuntimeError, lambda: model(torch.randn((4, 32))), "BatchNorm1d with fp32 buffers",
                   match="expected scalar type")
    model = sharded(nn.Conv2d(1, 5, 3), nn.BatchNorm2d(5), nn.Conv2d(5, 4, 3))
    s.check.raises(RuntimeError, lambda: model(torch.randn((3, 1, 9, 9))), "BatchNorm2d with fp32 buffers",
                   match="expected scalar type")
    model = sharded(nn.Conv2d(1, 5, 3), nn.BatchNorm2d(5), nn.Conv2d(5, 4, 3))
    model[1].running_mean = model[1].running_mean.to(param_dtype)  # buffers cast by hand: backward runs
    model[1].running_var = model[1].running_var.to(param_dtype)
    inner(model, torch.randn((3, 1, 9, 9)))
    model = nn.Sequential(nn.Conv2d(1, 5, 3), nn.BatchNorm2d(5), nn.Conv2d(5, 4, 3))
    s.fully_shard(model[1], mp_policy=_policy(output_dtype=param_dtype))  # batch norm in fp32, output cast
    for module in (model[0], model[2], model):
        s.fully_shard(module, mp_policy=policy)
    inner(model, torch.randn((3, 1, 9, 9)))


for dtype in (torch.bfloat16, torch.float16):
    name = str(dtype).split(".")[1]
    SC.add(f"norm_modules_{name}", 2, CASTS + f"test_norm_modules_{'bf16' if name == 'bfloat16' else 'fp16'}",
           f"param_dtype {name}: LayerNorm runs in {name}; BatchNorm1d/2d with fp32 running stats raise CPU's "
           "dtype error (buffers are not cast); with the stats cast, or the norm in fp32 with output_dtype, "
           f"{name} out and backward runs", norm_modules, param_dtype=dtype)


@SC.register("clamp_reduce_dtype", 2, CASTS + "test_clamp_reduce_dtype",
             "bf16 param and reduce dtype on a model built in bf16 then moved to fp32: the reduce-scatters stay bf16")
def clamp_reduce_dtype(s):
    model = nn.Sequential(nn.Linear(32, 32, dtype=torch.bfloat16), nn.Linear(32, 32, dtype=torch.bfloat16))
    policy = _policy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    s.check.equal(policy.reduce_dtype, torch.bfloat16, "policy reduce_dtype")
    for module in model:
        s.fully_shard(module, mp_policy=policy)
    s.fully_shard(model, mp_policy=policy)
    model.to(torch.float32)
    with CommSpy() as spy:
        model(torch.randn((4, 32))).sum().backward()
    _scatter_dtypes(s, spy, torch.bfloat16, "after .to(float32)")


@SC.register("grouped_module_cast_forward_inputs", 2,
             "test_fully_shard_training.py::TestFullyShard1DTrainingCompose.test_grouped_module_cast_forward_inputs",
             "fully_shard([a, b]) with bf16 and cast_forward_inputs: b's fp32 input is cast too, output bf16, every "
             "parameter gets a gradient")
def grouped_module_cast_forward_inputs(s):
    dim = 32

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)

        def forward(self, x):
            return self.b(self.a(x).float())  # an fp32 intermediate: b must cast it

    policy = _policy(param_dtype=torch.bfloat16, cast_forward_inputs=True)
    torch.manual_seed(42)
    model = Model()
    broadcast_module(model)
    s.fully_shard([model.a, model.b], mp_policy=policy)
    s.fully_shard(model, mp_policy=policy)
    out = model(torch.randn(2, dim))
    s.check.equal(out.dtype, torch.bfloat16, "output dtype")
    out.sum().backward()
    for name, p in model.named_parameters():
        s.check.true(p.grad is not None, f"{name}: no gradient")


OUT = Outcomes(SC, timeout=240)


def test_the_docstring_table_lists_every_scenario():
    assert SC.missing_from(__doc__) == []


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize("system,name,world_size", SC.cases())
def test_scenario(system, name, world_size):
    failures = OUT.failures(system, name, world_size)
    assert failures is None, failures
