"""Example students for lesson 02 (data parallel Adam): one defect each, named by the student id.

Points: test_average_gradients 3, test_ddp_numerics 3, test_ddp_collectives 2, test_questions 2.
The class checks use a reference average_gradients in place of the student's, so a wrong
mean costs exercise (a)'s 3 points only. Every defect student answers the questions right.
"""

from . import SOLUTION, Student, correct, full_marks, one_per_exercise, solution_with, untouched

LESSON = "02_distributed_adam"
KEEP = ("import zerokit", 'os.environ["ZEROKIT_LAUNCHER"]')

FULL = full_marks(LESSON)
ZERO = dict.fromkeys(FULL, 0)

SUMS = '''@torch.no_grad()
def average_gradients(params):
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)  # BUG: the sum of the ranks' gradients, never divided by N
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
'''

AVERAGES_TWICE = SUMS.replace(
    "    dist.all_reduce(flat)  # BUG: the sum of the ranks' gradients, never divided by N\n",
    "    dist.all_reduce(flat, op=dist.ReduceOp.AVG)\n    flat.div_(dist.get_world_size())  # BUG: AVG divided already\n")

# A missing gradient made a zero one before the all-reduce: the parameter the forward never
# uses then has a .grad, and Adam decays it and counts a step where AdamW skips it.
ZEROS_FOR_NONE = '''@torch.no_grad()
def average_gradients(params):
    grads = []
    for p in params:
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # BUG: no gradient is not a zero gradient
            grads.append(p.grad)
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(dist.get_world_size())
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
'''

# The broadcast of __init__ limited to the parameters that train: every rank keeps its own
# frozen weights, so the replicas are different models from the start.
TRAINABLE_ONLY = solution_with(
    "            for p in self.all_params():\n                dist.broadcast(p.data, src=0)\n",
    "            for p in self.all_params():\n"
    "                if p.requires_grad:  # BUG: the frozen ones take part in the forward too\n"
    "                    dist.broadcast(p.data, src=0)\n")

CLASS = '''class MyDistributedAdam(Adam):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        with torch.no_grad():
            for p in self.all_params():
                dist.broadcast(p.data, src=0)

    def all_params(self):
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure=None):
{body}        return None
'''
AFTER_STEP = CLASS.format(body="        super().step()\n"
                          "        average_gradients(self.all_params())  # BUG: too late\n")
BROADCASTS = CLASS.format(body="        average_gradients(self.all_params())\n        super().step()\n"
                          "        for p in self.all_params():\n"
                          "            dist.broadcast(p.data, src=0)  # BUG: twice the traffic, for nothing\n")

WRONG_ANSWERS = '''answers = {
    "bytes_per_rank_n8": 16 * 280_583 / 8,  # BUG: data parallel does not divide the model state by N
    "ring_bytes_per_step_n8": 2 * 280_583 * 4 * 7 / 8,
    "v_factor_sum_bug": 16,
    "step_factor_sum_bug": 1,
    "redundant_fraction": 63 / 64,
}
'''

STUDENTS = [
    correct(LESSON, "average_gradients", "distributed_adam_class", "answers"),
    untouched(LESSON, "still the stub"),
    Student("sums_gradients", "all-reduce without dividing by N (the class is right)",
            {**FULL, "test_average_gradients": 0}, reason="the ranks' gradients were summed",
            cells={"average_gradients": SUMS, "distributed_adam_class": SOLUTION, "answers": SOLUTION}),
    Student("averages_twice", "ReduceOp.AVG, then divided by N as well: 1/N of the mean (the class is right)",
            {**FULL, "test_average_gradients": 0}, reason="the ranks' gradients were averaged twice",
            cells={"average_gradients": AVERAGES_TWICE, "distributed_adam_class": SOLUTION, "answers": SOLUTION}),
    Student("zeros_for_none", "a parameter without a gradient given a .grad of zeros (the class is right)",
            {**FULL, "test_average_gradients": 0}, reason="a missing gradient was turned into one",
            cells={"average_gradients": ZEROS_FOR_NONE, "distributed_adam_class": SOLUTION, "answers": SOLUTION}),
    Student("broadcasts_trainable_only", "__init__ broadcasts the trainable parameters only: every rank keeps its "
            "own frozen weights", {**FULL, "test_ddp_numerics": 0}, reason="left the frozen ones out",
            cells={"average_gradients": SOLUTION, "distributed_adam_class": TRAINABLE_ONLY, "answers": SOLUTION}),
    Student("averages_after_step", "step() updates with the local gradient, then averages",
            {**FULL, "test_ddp_numerics": 0}, reason="but after the update",
            cells={"average_gradients": SOLUTION, "distributed_adam_class": AFTER_STEP, "answers": SOLUTION}),
    Student("broadcasts_every_step", "right numbers, but broadcasts the weights after every step",
            {**FULL, "test_ddp_collectives": 0}, reason="every step is not needed",
            cells={"average_gradients": SOLUTION, "distributed_adam_class": BROADCASTS, "answers": SOLUTION}),
    Student("wrong_answers", "the exercises right; the memory per rank divided by N, as if data parallel sharded",
            {**FULL, "test_questions": 0}, reason="1 of 5 answers are not right yet: bytes_per_rank_n8",
            cells={"average_gradients": SOLUTION, "distributed_adam_class": SOLUTION, "answers": WRONG_ANSWERS}),
]

# Each mistake above is one student; graded as few notebooks as their cells allow, one mistake per exercise
# in each (one_per_exercise: the checks grade an exercise with zerokit's versions of the others).
STUDENTS = [*STUDENTS[:2], *one_per_exercise(FULL, STUDENTS[2:])]
