"""Example students for lesson 03 (ZeRO-1): shard_range and MyZeRO1Adam.

Points: test_shard_range 2, test_zero1_numerics 4, test_zero1_unused_parameters 2, test_zero1_memory 2,
test_zero1_collectives 2, test_questions 2 (the stretch exercise's cell is not graded).
Each defect is in one exercise and must cost only the checks meant to catch it.
"""

from . import SOLUTION, Student, correct, full_marks, one_per_exercise, solution_with, untouched

LESSON = "03_zero1"
KEEP = ("import zerokit",)  # the imports cell (it also picks the forkserver launcher)

FULL = full_marks(LESSON)
ZERO = dict.fromkeys(FULL, 0)

# The solution's class with m and v allocated for the whole flat buffer and sliced in step():
# the same numbers as ZeRO-1, the memory of plain data parallel.
FULL_STATE = '''class MyZeRO1Adam(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        trainable = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        with torch.no_grad():
            for p in self.param_groups[0]["params"]:
                dist.broadcast(p.data, src=0)
        self.bucket = FlatBucket(trainable, self.world_size, self.rank)
        self.flat_params = self.bucket.flatten([p.data for p in trainable])
        for p, view in zip(trainable, self.bucket.views(self.flat_params)):
            p.data = view
        self.exp_avg = torch.zeros(self.bucket.padded_numel)  # BUG: the whole model's m and v
        self.exp_avg_sq = torch.zeros(self.bucket.padded_numel)
        self.steps = [0] * len(trainable)

    @torch.no_grad()
    def step(self, closure=None):
        group, b = self.param_groups[0], self.bucket
        flat_grad = b.flatten([p.grad for p in b.params])
        grad_shard = torch.empty(b.shard_numel)
        dist.reduce_scatter_single(grad_shard, flat_grad, op=dist.ReduceOp.AVG)
        has_grad = torch.tensor([p.grad is not None for p in b.params], dtype=torch.uint8)
        dist.all_reduce(has_grad, op=dist.ReduceOp.MAX)
        param_shard = b.shard(self.flat_params)
        m, v = b.shard(self.exp_avg), b.shard(self.exp_avg_sq)
        for s in b.segments:
            if has_grad[s.index]:
                self.steps[s.index] += 1
                lo, hi = s.shard_lo, s.shard_hi
                adamw_update_(param_shard[lo:hi], grad_shard[lo:hi], m[lo:hi], v[lo:hi], self.steps[s.index],
                              lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1],
                              eps=group["eps"], weight_decay=group["weight_decay"])
        dist.all_gather_single(self.flat_params, param_shard)

    def memory_categories(self):
        return {"parameters": [self.flat_params], "optimizer_states": [self.exp_avg, self.exp_avg_sq]}
'''

# A "hand-written" optimizer that lets torch.optim.AdamW do the update on its shard.
CALLS_ADAMW = '''class MyZeRO1Adam(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        trainable = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        with torch.no_grad():
            for p in self.param_groups[0]["params"]:
                dist.broadcast(p.data, src=0)
        self.bucket = FlatBucket(trainable, self.world_size, self.rank)
        self.flat_params = self.bucket.flatten([p.data for p in trainable])
        for p, view in zip(trainable, self.bucket.views(self.flat_params)):
            p.data = view
        self.shard = torch.nn.Parameter(self.bucket.shard(self.flat_params).clone())
        self.inner = torch.optim.AdamW([self.shard], lr=lr, betas=betas, eps=eps,  # BUG: not hand-written
                                       weight_decay=weight_decay)

    @torch.no_grad()
    def step(self, closure=None):
        b = self.bucket
        flat_grad = b.flatten([p.grad for p in b.params])
        self.shard.grad = torch.empty(b.shard_numel)
        dist.reduce_scatter_single(self.shard.grad, flat_grad, op=dist.ReduceOp.AVG)
        self.inner.step()
        b.shard(self.flat_params).copy_(self.shard)
        dist.all_gather_single(self.flat_params, b.shard(self.flat_params))

    def memory_categories(self):
        state = [t for s in self.inner.state.values() for t in s.values() if torch.is_tensor(t)]
        return {"parameters": [self.flat_params], "optimizer_states": state}
'''

# The step without AdamW's skip: a parameter no rank has a gradient for is updated as if its
# gradient were zero, so weight decay (and momentum) move it (what the lesson's text used to lead to).
DECAYS_UNUSED = solution_with("            if not has_grad[s.index]:\n                continue\n", "")

# The skip decided by the values: a segment of the shard whose mean gradient is all zeros is taken
# for one without a gradient. Right on edge and branch (a None gradient is zeros after the
# reduce-scatter), wrong on sparse-embed, whose unused embedding rows have a gradient of zeros.
SKIPS_ZERO_SEGMENTS = solution_with(
    "            if not has_grad[s.index]:\n                continue\n",
    "            if not grad_shard[s.shard_lo:s.shard_hi].any():  # BUG: zero is a gradient, not a missing one\n"
    "                continue\n")

STUDENTS = [
    correct(LESSON, "shard_range", "zero1_class", "answers", "stretch_param_groups"),
    # the stubs' reason and the questions' both ask whether the cell is still the stub
    untouched(LESSON, "still the stub"),
    Student("no_answers", "every exercise solved, the check-your-understanding answers left as released",
            {**FULL, "test_questions": 0}, reason="no answer yet",
            cells={"shard_range": SOLUTION, "zero1_class": SOLUTION}),
    Student("full_state", "right numbers, but m and v for the whole model on every rank (the point missed)",
            {**FULL, "test_zero1_memory": 0}, reason="as large as the whole model",
            cells={"shard_range": SOLUTION, "zero1_class": FULL_STATE, "answers": SOLUTION}),
    Student("decays_unused", "updates parameters that no rank has a gradient for (weight decay where AdamW skips)",
            {**FULL, "test_zero1_unused_parameters": 0}, reason="leaves it alone",
            cells={"shard_range": SOLUTION, "zero1_class": DECAYS_UNUSED, "answers": SOLUTION}),
    Student("skips_zero_segments", "skips a segment of its shard whose mean gradient is all zeros, as if no rank "
            "had a gradient (AdamW still decays it)", {**FULL, "test_zero1_unused_parameters": 0},
            reason="a segment whose gradient is all zeros was skipped",
            cells={"shard_range": SOLUTION, "zero1_class": SKIPS_ZERO_SEGMENTS, "answers": SOLUTION}),
    Student("calls_adamw", "MyZeRO1Adam hands its shard to torch.optim.AdamW (cheat)",
            {**ZERO, "test_shard_range": 2, "test_questions": FULL["test_questions"]}, reason="torch.optim.AdamW",
            cells={"shard_range": SOLUTION, "zero1_class": CALLS_ADAMW, "answers": SOLUTION}),
]

# Each mistake above is one student; graded as few notebooks as their cells allow, one mistake per exercise
# in each (one_per_exercise: the checks grade an exercise with zerokit's versions of the others).
STUDENTS = [*STUDENTS[:2], *one_per_exercise(FULL, STUDENTS[2:])]
