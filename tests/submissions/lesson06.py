"""Example students for lesson 06 (mixed precision): MyLossScaler and MyMixedPrecisionAdam.

Points: test_unscale 2, test_overflow_agreed 3, test_scale_schedule 2, test_master_update 3,
test_overflow_step 2, test_understanding 2 (the questions; the defects below answer them right,
but for rounded_answer). The optimizer's checks run it with zerokit's scaler, so a defect in one
exercise costs only that exercise's checks.
"""

from . import SOLUTION, Student, correct, full_marks, one_per_exercise, solution_with, untouched

LESSON = "06_mixed_precision"
KEEP = ("import zerokit",)  # the imports cell (it also picks the forkserver launcher)

FULL = full_marks(LESSON)
ZERO = dict.fromkeys(FULL, 0)

# The classic: multiplies the scaled gradient by the scale instead of dividing (the rest is right).
MULTIPLIES = '''class MyLossScaler:
    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.clean_steps = 0
        self.found_inf = False

    def scale_loss(self, loss):
        return loss * self.scale

    @torch.no_grad()
    def unscale(self, grads):
        out = [g.float() * self.scale for g in grads]  # BUG: multiplied, not divided
        flag = torch.tensor([float(any(not bool(torch.isfinite(g).all()) for g in out))])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.found_inf = bool(flag.item())
        return out

    def update(self):
        if self.found_inf:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            return False
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0
        return True
'''

# AdamW applied to the 16-bit parameters; the fp32 masters exist but never move.
UPDATES_HALF = '''class MyMixedPrecisionAdam(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 dtype=torch.bfloat16, scaler=None):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.scaler = scaler if scaler is not None else MyLossScaler(init_scale=1.0, growth_factor=1.0)
        self.params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    dist.broadcast(p.data, src=0)
        self.steps = [0] * len(self.params)
        self.masters = [p.detach().float().clone() for p in self.params]
        self.exp_avgs = [torch.zeros_like(m) for m in self.masters]
        self.exp_avg_sqs = [torch.zeros_like(m) for m in self.masters]
        for group in self.param_groups:
            for p in group["params"]:
                p.data = p.data.to(dtype)

    def scale_loss(self, loss):
        return self.scaler.scale_loss(loss)

    @torch.no_grad()
    def step(self, closure=None):
        group = self.param_groups[0]
        with_grad = [i for i, p in enumerate(self.params) if p.grad is not None]
        for i in with_grad:
            dist.all_reduce(self.params[i].grad, op=dist.ReduceOp.AVG)
        grads = self.scaler.unscale([self.params[i].grad for i in with_grad])
        if not self.scaler.update():
            return None
        for i, grad in zip(with_grad, grads):
            self.steps[i] += 1
            adamw_update_(self.params[i].data, grad, self.exp_avgs[i], self.exp_avg_sqs[i], self.steps[i],  # BUG
                          lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
                          weight_decay=group["weight_decay"])
        return None
'''

# The master copies taken after the cast: they hold the rounded weights (the rest is right).
_MASTERS_FIRST = """        self.masters = [p.detach().to(torch.float32, copy=True) for p in self.params]
        self.exp_avgs = [torch.zeros_like(m) for m in self.masters]
        self.exp_avg_sqs = [torch.zeros_like(m) for m in self.masters]
        for group in self.param_groups:
            for p in group["params"]:
                p.data = p.data.to(dtype)
"""
_CAST_FIRST = """        for group in self.param_groups:
            for p in group["params"]:
                p.data = p.data.to(dtype)
        self.masters = [p.detach().to(torch.float32, copy=True) for p in self.params]  # BUG: after the cast
        self.exp_avgs = [torch.zeros_like(m) for m in self.masters]
        self.exp_avg_sqs = [torch.zeros_like(m) for m in self.masters]
"""
# Only the trainable parameters made 16-bit: a frozen layer computes in fp32 among 16-bit ones.
_EVERY_PARAMETER = """        for group in self.param_groups:
            for p in group["params"]:
                p.data = p.data.to(dtype)
"""
_TRAINABLE_ONLY = """        for p in self.params:  # BUG: the frozen parameters stay fp32
            p.data = p.data.to(dtype)
"""

# Skips the overflow step, but counts it: each self.steps[i] advances before the verdict. Nothing
# changes on the skipped step itself; every later step's bias correction uses a t one too large.
COUNTS_SKIPPED = solution_with("""        if not self.scaler.update():
            return None  # an inf or nan on some rank: every rank skips
        for i, grad in zip(with_grad, grads):
            self.steps[i] += 1
""", """        for i in with_grad:
            self.steps[i] += 1  # BUG: counted before the verdict
        if not self.scaler.update():
            return None
        for i, grad in zip(with_grad, grads):
""")

# Divides in place after .float(): right values, but an fp32 gradient's .float() is the gradient itself,
# so the caller's tensor is divided too (16-bit ones are copied first, and stay as they were).
UNSCALES_IN_PLACE = solution_with("out = [g.float() / self.scale for g in grads]",
                                  "out = [g.float().div_(self.scale) for g in grads]  # BUG: fp32 inputs divided")

STUDENTS = [
    correct(LESSON, "loss_scaler", "master_adam", "understanding"),
    untouched(LESSON, "still the stub"),
    Student("multiplies_by_scale", "unscale multiplies the gradient by the loss scale instead of dividing",
            {**FULL, "test_unscale": 0}, reason="times the scale",
            cells={"loss_scaler": MULTIPLIES, "master_adam": SOLUTION, "understanding": SOLUTION}),
    Student("unscales_in_place", "unscale divides after .float() in place: the fp32 gradients it was given change",
            {**FULL, "test_unscale": 0}, reason="you were given changed",
            cells={"loss_scaler": UNSCALES_IN_PLACE, "master_adam": SOLUTION, "understanding": SOLUTION}),
    Student("updates_half_params", "AdamW applied to the 16-bit parameters; the fp32 masters never move",
            {**FULL, "test_master_update": 0}, reason="did not change",
            cells={"loss_scaler": SOLUTION, "master_adam": UPDATES_HALF, "understanding": SOLUTION}),
    Student("masters_after_cast", "the fp32 master copies taken after the model was cast to 16 bits",
            {**FULL, "test_master_update": 0}, reason="hold the weights rounded to",
            cells={"loss_scaler": SOLUTION, "master_adam": solution_with(_MASTERS_FIRST, _CAST_FIRST),
                   "understanding": SOLUTION}),
    Student("frozen_left_fp32", "only the trainable parameters made 16-bit; the frozen ones stay fp32",
            {**FULL, "test_master_update": 0}, reason="frozen ones too",
            cells={"loss_scaler": SOLUTION, "master_adam": solution_with(_EVERY_PARAMETER, _TRAINABLE_ONLY),
                   "understanding": SOLUTION}),
    Student("rounded_answer", "the questions answered, but the bf16 spacing rounded to 0.002 (2**-9 is "
            "0.001953125)", {**FULL, "test_understanding": 0}, reason="bf16_spacing (you gave 0.002)",
            cells={"loss_scaler": SOLUTION, "master_adam": SOLUTION,
                   "understanding": solution_with('"bf16_spacing": 2.0**-9,', '"bf16_spacing": 0.002,')}),
    Student("counts_skipped_step", "skips the overflow step but still advances the step count t",
            {**FULL, "test_overflow_step": 0}, reason="step 2 was skipped (rank 1's gradient of",
            cells={"loss_scaler": SOLUTION, "master_adam": COUNTS_SKIPPED, "understanding": SOLUTION}),
]

# Each mistake above is one student; graded as few notebooks as their cells allow, one mistake per exercise
# in each (one_per_exercise: the checks grade an exercise with zerokit's versions of the others).
STUDENTS = [*STUDENTS[:2], *one_per_exercise(FULL, STUDENTS[2:])]
