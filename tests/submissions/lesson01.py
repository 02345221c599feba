"""Example students for lesson 01 (Adam by hand): one defect each, named by the student id.

Points: test_adam_numerics 4, test_adam_contract 3, test_zero_grad 1, test_model_state_bytes 2,
test_questions 2 (every defect student answers the questions right).
The contract compares the student's class with itself, so a wrong update formula costs the
numerics' 4 points only; the checks clear gradients with the base class's zero_grad, so a
broken zero_grad costs test_zero_grad's point only.
"""

from . import SOLUTION, Student, correct, full_marks, one_per_exercise, untouched

LESSON = "01_adam"
KEEP = ('os.environ["ZEROKIT_LAUNCHER"]',)  # the imports (torch) and the launcher choice

FULL = full_marks(LESSON)
ZERO = dict.fromkeys(FULL, 0)

ADAM = '''class MyAdam(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.t = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.t += 1
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] {count}
                t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
                {decay}
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                {update}

    def zero_grad(self, set_to_none=True):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    {clear}
'''
RIGHT = dict(count="+= 1", decay="p.mul_(1 - lr * wd)",
             update="p.addcdiv_(m / (1 - beta1**t), (v / (1 - beta2**t)).sqrt() + eps, value=-lr)",
             clear="p.grad = None")


def adam(**change):
    return ADAM.format(**{**RIGHT, **change})


SOLUTION_ANSWERS = '''answers = {
    "bias_first_step": (1 - 0.8) / (1 - 0.95) ** 0.5,
    "decay_left": (1 - 1e-3 * 0.1) ** 1000,
    "bf16_spacing": torch.finfo(torch.bfloat16).eps,
    "optimizer_gb": 12 * 1.3e9 / 1e9,
}
'''

K8 = '''def model_state_bytes(psi, precision="fp32"):
    w = 4 if precision == "fp32" else 2
    out = {"parameters": w * psi, "gradients": w * psi, "optimizer_states": 8 * psi}  # BUG: K = 12 in mixed
    out["total"] = sum(out.values())
    return out
'''

STUDENTS = [
    correct(LESSON, "my_adam", "model_state_bytes", "answers", "loss_curve"),
    untouched(LESSON, "still the stub"),
    Student("no_bias_correction", "m / (sqrt(v) + eps): no bias correction", {**FULL, "test_adam_numerics": 0},
            reason="WITHOUT bias correction",
            cells={"my_adam": adam(update="p.addcdiv_(m, v.sqrt() + eps, value=-lr)  # BUG"),
                   "model_state_bytes": SOLUTION, "answers": SOLUTION}),
    Student("step_per_call", "t counts calls of step(), not this parameter's updates",
            {**FULL, "test_adam_contract": 0}, reason="each parameter's step count, must live in self.state[p]",
            cells={"my_adam": adam(count="= self.t  # BUG: one counter for the optimizer"),
                   "model_state_bytes": SOLUTION, "answers": SOLUTION}),
    Student("zero_grad_multiplies", "zero_grad as p.grad *= torch.zeros_like(p.grad)", {**FULL, "test_zero_grad": 0},
            reason="NaN × 0 = NaN",
            cells={"my_adam": adam(clear="p.grad *= torch.zeros_like(p.grad)  # BUG: NaN and inf survive"),
                   "model_state_bytes": SOLUTION, "answers": SOLUTION}),
    Student("k8_mixed", "K = 8 in mixed precision too (forgets the fp32 master weights)",
            {**FULL, "test_model_state_bytes": 0}, reason="bytes of optimizer_states",
            cells={"my_adam": SOLUTION, "model_state_bytes": K8, "answers": SOLUTION}),
    Student("decay_after_step", "weight decay applied after the Adam step (it decays the step too): the weights "
            "move by less than the tolerance, the gradients and so m drift from step 2",
            {**FULL, "test_adam_numerics": 0}, reason="weight decay after the Adam step",
            cells={"my_adam": adam(decay="pass  # BUG: the decay moved below",
                                   update="p.addcdiv_(m / (1 - beta1**t), (v / (1 - beta2**t)).sqrt() + eps, value=-lr)\n"
                                          "                p.mul_(1 - lr * wd)  # BUG: after the step"),
                   "model_state_bytes": SOLUTION, "answers": SOLUTION}),
    Student("wrong_answers", "the exercises right; the bias-correction answer forgets the square root",
            {**FULL, "test_questions": 0}, reason="1 of 4 answers are not right yet: bias_first_step",
            cells={"my_adam": SOLUTION, "model_state_bytes": SOLUTION,
                   "answers": SOLUTION_ANSWERS.replace("(1 - 0.95) ** 0.5", "(1 - 0.95)")}),
]

# Each mistake above is one student; graded as few notebooks as their cells allow, one mistake per exercise
# in each (one_per_exercise: the checks grade an exercise with zerokit's versions of the others).
STUDENTS = [*STUDENTS[:2], *one_per_exercise(FULL, STUDENTS[2:])]
