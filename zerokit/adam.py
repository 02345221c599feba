r"""Adam with decoupled weight decay (AdamW), written out by hand.

For a parameter $\theta$ with gradient $g_t$ at step $t = 1, 2, \dots$:

$$\theta \leftarrow \theta\,(1 - \eta\lambda) \qquad \text{(decoupled weight decay)}$$
$$m_t = \beta_1 m_{t-1} + (1-\beta_1)\,g_t \qquad v_t = \beta_2 v_{t-1} + (1-\beta_2)\,g_t^2$$
$$\hat m_t = \frac{m_t}{1-\beta_1^t} \qquad \hat v_t = \frac{v_t}{1-\beta_2^t}
  \qquad \theta \leftarrow \theta - \eta\,\frac{\hat m_t}{\sqrt{\hat v_t} + \epsilon}$$

m and v start at zero, so early averages are biased towards zero; dividing by
$1-\beta^t$ removes that bias (at t = 1 it gives exactly $\hat m_1 = g_1$). With
$\lambda = 0$ this is plain Adam. The state is two tensors the size of the parameter,
which in fp32 is 8 bytes per parameter: the K in the ZeRO paper's $K\Psi$ (K = 12 with
mixed precision, which adds a 4-byte fp32 master copy of the weights).

Every later optimizer in zerokit (data parallel, ZeRO-1/2/3, mixed precision) calls
`adamw_update_` on whatever slice of the parameters it owns.
"""

import torch

__all__ = ["Adam", "adamw_update_"]


@torch.no_grad()
def adamw_update_(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay):
    """One AdamW step, in place, on tensors of any shape (a whole parameter or a flat shard).

    `step` is the 1-based count of this update, used for the bias correction.
    """
    # The docstring's formulas in torch.optim.AdamW(foreach=False)'s order of operations
    # (torch/optim/adam.py, `_single_tensor_adam`), so the result is bitwise PyTorch's: the
    # same formula in another order can round differently in the last bit (lesson 01).
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)  # m + (1 - beta1) * (g - m), which is beta1 * m + (1 - beta1) * g
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    # sqrt(v_hat) + eps, computed without materialising v_hat; ** 0.5 as torch writes it
    # (math.sqrt differs from it in the last bit of the float64 at some steps)
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def check_hyperparameters(lr, betas, eps, weight_decay):
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"Invalid betas: {betas} (each must be in [0, 1))")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


class Adam(torch.optim.Optimizer):
    """AdamW (decoupled weight decay); equals torch.optim.Adam when weight_decay == 0.

    A `torch.optim.Optimizer`, so param_groups, state_dict()/load_state_dict() and
    learning-rate schedulers work as with any PyTorch optimizer. A parameter whose
    .grad is None is skipped, state and all, exactly as torch.optim.AdamW does.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        check_hyperparameters(lr, betas, eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._update()
        return loss

    @torch.no_grad()
    def _update(self):
        """The update itself, without step()'s hooks: subclasses that wrap it in their own
        step() (zerokit.DistributedAdam) call this, so step hooks fire once per step."""
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("zerokit.Adam does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                adamw_update_(
                    p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"],
                    lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"],
                )
