r"""Adam on many tensors at once: one operation for all of them (beyond lesson 01).

Lesson 01's `adamw_update_` updates one tensor with eight elementwise operations; on a GPU each
is a kernel launch. Data parallel Adam calls it once per parameter, so a model of P parameter
tensors launches about 8P small kernels a step, and for most of them the launch costs more
than the arithmetic (the README's profile: DistributedAdam's step launched 1,365 kernels where
DDP + AdamW launched 668). torch's `_foreach_*` operations take lists of tensors and apply one
operation to all of them, in one kernel or a few (multi_tensor_apply): the same update in about
eight launches, whatever P is. A ZeRO shard is one flat tensor, so there the list is short:
the runs of the shard that share a step count (zerokit.zero1), usually one.

`adamw_multi_tensor_` is the update of torch.optim.AdamW's multi-tensor version
(torch/optim/adam.py, `_multi_tensor_adam`), operation for operation, so that it is bitwise
AdamW(foreach=True). On a CPU a `_foreach_*` operation runs the single-tensor kernel on each
tensor in turn, so there it is also bitwise `adamw_update_` and AdamW(foreach=False). On CUDA
the two versions differ in the last bit: the single-tensor `tensor / number` multiplies by the
number's reciprocal (aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu: "this may lose one bit
of precision"), the multi-tensor division divides (ForeachBinaryOpScalarList.cu, std::divides).

Which one runs is torch's rule, `foreach`: None picks what torch.optim picks for the same
tensors (`default_foreach`: the multi-tensor version on a GPU, the loop on a CPU), so a
zerokit optimizer built with defaults is bitwise torch.optim.AdamW built with defaults, on
either device; True and False force one, as they do for torch.optim.AdamW.
"""

import torch
from torch.optim.optimizer import _default_to_fused_or_foreach

__all__ = ["adamw_multi_tensor_", "default_foreach"]


def default_foreach(tensors) -> bool:
    """What torch.optim does for these tensors when foreach=None: multi-tensor where every one is on
    a device with `_foreach_*` kernels (CUDA), the per-tensor loop otherwise (a CPU)."""
    return _default_to_fused_or_foreach(list(tensors), differentiable=False, use_fused=False)[1]


@torch.no_grad()
def adamw_multi_tensor_(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps, weight_decay):
    """`zerokit.adamw_update_` on lists of tensors, in place: one `_foreach_*` call per operation.

    Each list holds one tensor per parameter (or per run of a flat shard); steps[i] is the 1-based
    count of this update of tensor i, so tensors at different step counts share the calls.
    """
    by_kind = {}  # a multi-tensor kernel takes one device and one dtype, as torch groups them
    for i, p in enumerate(params):
        by_kind.setdefault((p.device, p.dtype), []).append(i)
    for idx in by_kind.values():
        p, g, m, v = ([lst[i] for i in idx] for lst in (params, grads, exp_avgs, exp_avg_sqs))
        if weight_decay != 0:
            torch._foreach_mul_(p, 1 - lr * weight_decay)
        torch._foreach_lerp_(m, g, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, g, g, 1 - beta2)
        # the bias corrections, per tensor, in Python floats as torch computes them
        step_size = [(lr / (1 - beta1 ** steps[i])) * -1 for i in idx]
        bias_correction2_sqrt = [(1 - beta2 ** steps[i]) ** 0.5 for i in idx]
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(p, m, denom, step_size)
