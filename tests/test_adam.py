"""zerokit.Adam (AdamW written by hand) against torch.optim.AdamW, and adamw_update_ by hand.

zerokit.adamw_update_ follows torch.optim.AdamW(foreach=False)'s order of operations, so on
one process the two are bitwise equal: parameters, exp_avg and exp_avg_sq, step after step
(torch.equal, no tolerance). Before it did (m.mul_(beta1).add_(g, alpha=1 - beta1) where torch
has m.lerp_(g, 1 - beta1)), test_bitwise_equal_to_torch_200_steps_with_param_groups measured
max |zerokit - torch| of 1.9e-7 (AdamW) and 3.6e-7 (Adam) on the parameters, 1.2e-7 on m and v
(torch 2.13, CPU). On CPU torch's default (foreach=None) and foreach=True are bitwise
foreach=False too; fused=True is not (1.2e-7 and 1.5e-7 in the same test): its own kernel
computes in another order.
"""

import copy
import math

import pytest
import torch
from torch import nn

import zerokit
from zerokit import adamw_update_



class Net(nn.Module):
    """Two layers, plus `sometimes`: a parameter used only on steps divisible by 3, so its
    .grad is None (set_to_none zero_grad) in the other steps and AdamW must skip it entirely."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(7, 5)
        self.l2 = nn.Linear(5, 3)
        self.sometimes = nn.Parameter(torch.randn(3))

    def forward(self, x, step):
        y = self.l2(torch.tanh(self.l1(x)))
        if step % 3 == 0:
            y = y * self.sometimes
        return y


def make_pair(seed=0):
    torch.manual_seed(seed)
    a = Net()
    return a, copy.deepcopy(a)


def data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 7, generator=g), torch.randn(8, 3, generator=g)


def train_step(model, opt, step, sched=None):
    x, y = data(step)
    loss = ((model(x, step) - y) ** 2).mean()
    loss.backward()
    if step % 3 != 0:
        assert model.sometimes.grad is None  # the scenario really has a None grad
    opt.step()
    opt.zero_grad(set_to_none=True)
    if sched is not None:
        sched.step()


def params_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def assert_bitwise_equal(ours_model, ours, ref_model, ref, label=""):
    """Every parameter and its exp_avg and exp_avg_sq: torch.equal, no tolerance."""
    for (name, p), q in zip(ours_model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), f"{label} {name}: max abs diff {(p - q).abs().max().item():.3e}"
        assert (p in ours.state) == (q in ref.state), f"{label} {name}: state kept by one optimizer only"
        if p in ours.state:
            assert ours.state[p]["step"] == int(ref.state[q]["step"]), f"{label} {name}: step count"
            for key in ("exp_avg", "exp_avg_sq"):
                a, b = ours.state[p][key], ref.state[q][key]
                assert torch.equal(a, b), f"{label} {name} {key}: max abs diff {(a - b).abs().max().item():.3e}"


def param_groups(m, weight_decay):
    """Two groups with their own lr (and weight decay unless 0); `sometimes` skips steps."""
    return [{"params": [m.l1.weight, m.l1.bias], "lr": 1e-2, "weight_decay": 0.1 * weight_decay},
            {"params": [m.l2.weight, m.l2.bias, m.sometimes], "lr": 3e-3, "weight_decay": weight_decay}]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("torch_class,weight_decay", [(torch.optim.AdamW, 0.5), (torch.optim.Adam, 0.0)])
def test_bitwise_equal_to_torch_200_steps_with_param_groups(torch_class, weight_decay):
    """fp32, 200 steps, two param groups (different lr and weight decay): zerokit.Adam is bitwise
    torch.optim.AdamW(foreach=False), and torch.optim.Adam at weight_decay 0, after every step."""
    ours_model, ref_model = make_pair(6)
    ours = zerokit.Adam(param_groups(ours_model, weight_decay), lr=5e-3, betas=(0.9, 0.99))
    ref = torch_class(param_groups(ref_model, weight_decay), lr=5e-3, betas=(0.9, 0.99), foreach=False)
    assert [g["weight_decay"] for g in ours.param_groups] == [0.1 * weight_decay, weight_decay]
    for step in range(1, 201):
        train_step(ours_model, ours, step)
        train_step(ref_model, ref, step)
        assert_bitwise_equal(ours_model, ours, ref_model, ref, f"step {step}")
    assert ours.state[ours_model.sometimes]["step"] == 66  # a gradient every third step (3, 6, ..., 198)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("weight_decay", [0.1, 0.0])
def test_matches_torch_adamw_100_steps(weight_decay):
    ours_model, ref_model = make_pair()
    ours = zerokit.Adam(ours_model.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-8,
                            weight_decay=weight_decay, foreach=False)
    start = ours_model.sometimes.detach().clone()
    for step in range(1, 101):
        train_step(ours_model, ours, step)
        train_step(ref_model, ref, step)
        assert_bitwise_equal(ours_model, ours, ref_model, ref, f"step {step}")
        if step == 2:  # `sometimes` got no gradient in steps 1, 2: untouched, even by weight decay
            assert torch.equal(ours_model.sometimes, start)
            assert ours_model.sometimes not in ours.state
    # the skipped parameter's step count is the number of steps it had a gradient (33 of 100)
    assert ours.state[ours_model.sometimes]["step"] == 33 == int(ref.state[ref_model.sometimes]["step"])
    assert ours.state[ours_model.l1.weight]["step"] == 100


@pytest.mark.timeout(60)
def test_weight_decay_zero_is_plain_adam():
    ours_model, ref_model = make_pair(1)
    ours = zerokit.Adam(ours_model.parameters(), lr=3e-3)
    ref = torch.optim.Adam(ref_model.parameters(), lr=3e-3, foreach=False)
    for step in range(1, 31):
        train_step(ours_model, ours, step)
        train_step(ref_model, ref, step)
    assert_bitwise_equal(ours_model, ours, ref_model, ref)


@pytest.mark.timeout(60)
def test_param_groups_with_different_lr():
    ours_model, ref_model = make_pair(2)

    def groups(m):
        return [{"params": [m.l1.weight, m.l1.bias], "lr": 1e-2},
                {"params": [m.l2.weight, m.l2.bias, m.sometimes], "lr": 1e-3, "weight_decay": 0.5}]

    ours = zerokit.Adam(groups(ours_model), lr=5e-3, weight_decay=0.01)
    ref = torch.optim.AdamW(groups(ref_model), lr=5e-3, weight_decay=0.01, foreach=False)
    assert [g["lr"] for g in ours.param_groups] == [1e-2, 1e-3]
    assert [g["weight_decay"] for g in ours.param_groups] == [0.01, 0.5]
    before = copy.deepcopy(ours_model)
    for step in range(1, 41):
        train_step(ours_model, ours, step)
        train_step(ref_model, ref, step)
        assert_bitwise_equal(ours_model, ours, ref_model, ref, f"step {step}")
    # the groups really moved at different speeds: the first Adam steps are ~lr each
    moved1 = (ours_model.l1.weight - before.l1.weight).abs().mean().item()
    moved2 = (ours_model.l2.weight - before.l2.weight).abs().mean().item()
    assert moved1 > 3 * moved2


@pytest.mark.timeout(60)
def test_lr_scheduler_same_trajectory_as_adamw():
    ours_model, ref_model = make_pair(3)
    ours = zerokit.Adam(ours_model.parameters(), lr=2e-2, weight_decay=0.05)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=2e-2, weight_decay=0.05, foreach=False)
    s_ours = torch.optim.lr_scheduler.StepLR(ours, step_size=10, gamma=0.5)
    s_ref = torch.optim.lr_scheduler.StepLR(ref, step_size=10, gamma=0.5)
    for step in range(1, 51):
        train_step(ours_model, ours, step, s_ours)
        train_step(ref_model, ref, step, s_ref)
        assert_bitwise_equal(ours_model, ours, ref_model, ref, f"step {step}")
        assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"]
    assert ours.param_groups[0]["lr"] == pytest.approx(2e-2 * 0.5**5)


@pytest.mark.timeout(60)
def test_lr_scheduler_actually_changes_the_update():
    """With a scheduler the trajectory differs from a constant lr (the lr is read each step)."""
    a, b = make_pair(4)
    opt_a, opt_b = zerokit.Adam(a.parameters(), lr=2e-2), zerokit.Adam(b.parameters(), lr=2e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt_a, step_size=1, gamma=0.1)
    for step in range(1, 4):
        train_step(a, opt_a, step, sched)
        train_step(b, opt_b, step)
    assert params_diff(a, b) > 1e-3


@pytest.mark.timeout(60)
def test_state_dict_roundtrip_continues_identically():
    straight_model, first_model = make_pair(5)
    straight = zerokit.Adam(straight_model.parameters(), lr=1e-2, weight_decay=0.1)
    first = zerokit.Adam(first_model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(1, 31):
        train_step(straight_model, straight, step)
        train_step(first_model, first, step)
    saved_opt = copy.deepcopy(first.state_dict())
    saved_model = copy.deepcopy(first_model.state_dict())
    assert set(saved_opt) == {"state", "param_groups"}
    assert len(saved_opt["state"]) == 4 + 1  # every parameter has state after 30 steps

    # a brand-new model and optimizer, restored from the checkpoint
    torch.manual_seed(123)
    resumed_model = Net()
    resumed_model.load_state_dict(saved_model)
    resumed = zerokit.Adam(resumed_model.parameters(), lr=0.5)  # hyperparameters come from the checkpoint
    resumed.load_state_dict(saved_opt)
    assert resumed.param_groups[0]["lr"] == 1e-2 and resumed.param_groups[0]["weight_decay"] == 0.1
    for step in range(31, 61):
        train_step(straight_model, straight, step)
        train_step(resumed_model, resumed, step)
        assert params_diff(straight_model, resumed_model) == 0.0, f"step {step}"
    assert resumed.state[resumed_model.l1.weight]["step"] == 60
    assert resumed.state[resumed_model.sometimes]["step"] == 20  # a gradient every third step


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kwargs", [
    {"lr": -1e-3},
    {"eps": -1e-8},
    {"betas": (1.0, 0.999)},
    {"betas": (0.9, 1.5)},
    {"betas": (-0.1, 0.999)},
    {"betas": (0.9,)},
    {"weight_decay": -0.01},
])
def test_invalid_hyperparameters_raise(kwargs):
    with pytest.raises(ValueError):
        zerokit.Adam([nn.Parameter(torch.zeros(3))], **kwargs)


@pytest.mark.timeout(30)
def test_valid_edge_hyperparameters_accepted():
    zerokit.Adam([nn.Parameter(torch.zeros(3))], lr=0.0, betas=(0.0, 0.0), eps=0.0, weight_decay=0.0)


@pytest.mark.timeout(30)
def test_closure_is_called_and_loss_returned():
    p = nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = zerokit.Adam([p], lr=0.1)
    calls = []

    def closure():
        opt.zero_grad()
        loss = (p ** 2).sum()
        loss.backward()
        calls.append(1)
        return loss

    loss = opt.step(closure)
    assert calls == [1] and loss.item() == pytest.approx(5.0)
    torch.testing.assert_close(p.detach(), torch.tensor([0.9, -1.9]), rtol=0, atol=1e-6)


@pytest.mark.timeout(30)
def test_adamw_update_first_step_by_hand():
    """At t = 1, m_hat = g and sqrt(v_hat) = |g|: the step is lr * g / (|g| + eps) ~ lr * sign(g)."""
    lr, b1, b2, eps, wd = 0.1, 0.9, 0.999, 1e-8, 0.2
    g = torch.tensor([0.5, -3.0, 0.0, 1e-3, -2e-4], dtype=torch.float64)
    p0 = torch.tensor([1.0, 2.0, -3.0, 0.25, 0.0], dtype=torch.float64)
    p, m, v = p0.clone(), torch.zeros_like(g), torch.zeros_like(g)
    adamw_update_(p, g, m, v, 1, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd)

    # moments, exactly as the formula with m0 = v0 = 0
    for i in range(5):
        assert m[i].item() == pytest.approx((1 - b1) * g[i].item(), rel=1e-12, abs=1e-300)
        assert v[i].item() == pytest.approx((1 - b2) * g[i].item() ** 2, rel=1e-12, abs=1e-300)
    # parameter, computed by hand element by element
    for i in range(5):
        gi, pi = g[i].item(), p0[i].item()
        m_hat = (1 - b1) * gi / (1 - b1)
        v_hat = (1 - b2) * gi * gi / (1 - b2)
        expected = pi * (1 - lr * wd) - lr * m_hat / (math.sqrt(v_hat) + eps)
        assert p[i].item() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    # ... which is the sign rule: decay, then a step of lr against the gradient's sign
    sign_step = p0 * (1 - lr * wd) - lr * torch.sign(g)
    torch.testing.assert_close(p, sign_step, rtol=0, atol=lr * 1e-4)
    assert p[2].item() == p0[2].item() * (1 - lr * wd)  # zero gradient: only weight decay


@pytest.mark.timeout(30)
def test_adamw_update_three_steps_by_hand_moments_persist():
    """Several steps in float64 against the formula written out with Python floats: catches
    moments that are never stored (identical to correct Adam at step 1 only)."""
    lr, b1, b2, eps, wd = 0.05, 0.8, 0.95, 1e-6, 0.0
    grads = [0.3, -0.1, 0.7]
    p = torch.tensor([1.0], dtype=torch.float64)
    m, v = torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    theta, mm, vv = 1.0, 0.0, 0.0
    for t, gv in enumerate(grads, start=1):
        adamw_update_(p, torch.tensor([gv], dtype=torch.float64), m, v, t,
                      lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd)
        mm = b1 * mm + (1 - b1) * gv
        vv = b2 * vv + (1 - b2) * gv * gv
        theta -= lr * (mm / (1 - b1**t)) / (math.sqrt(vv / (1 - b2**t)) + eps)
        assert m.item() == pytest.approx(mm, rel=1e-12)
        assert v.item() == pytest.approx(vv, rel=1e-12)
        assert p.item() == pytest.approx(theta, rel=1e-12)
    # history matters: three sign-rule steps (no memory) would end at 1 - lr * (1 - 1 + 1)
    assert abs(p.item() - (1.0 - lr)) > 1e-2


@pytest.mark.timeout(30)
def test_adamw_update_works_in_place_on_a_view():
    """Shards are views of a flat buffer: the update must write through them."""
    flat = torch.ones(6)
    shard = flat[2:5]
    m, v = torch.zeros(3), torch.zeros(3)
    adamw_update_(shard, torch.tensor([1.0, -1.0, 2.0]), m, v, 1, lr=0.1, beta1=0.9, beta2=0.999,
                  eps=0.0, weight_decay=0.0)
    torch.testing.assert_close(flat, torch.tensor([1.0, 1.0, 0.9, 1.1, 0.9, 1.0]))


@pytest.mark.timeout(30)
def test_sparse_gradient_rejected():
    p = nn.Parameter(torch.zeros(4, 2))
    opt = zerokit.Adam([p])
    p.grad = torch.zeros(4, 2).to_sparse()
    with pytest.raises(RuntimeError):
        opt.step()
