"""Example students for lesson 09 (Muon on ZeRO-1): MyZeRO1Muon.

Points: test_muon_numerics 4, test_muon_state 2, test_muon_traffic 2, test_muon_balance 2, test_questions 2.
Each defect must cost only the checks meant to catch it (the flat-shard student's design misses two targets).
The visible numerics test runs BranchNet too: in its step 4 one rank has no gradient for a matrix the other has.
"""

from . import SOLUTION, Student, correct, full_marks, method_replaced, solution_with, untouched

LESSON = "09_muon"
KEEP = ("import zerokit",)  # the imports cell (it also picks the forkserver launcher)

FULL = full_marks(LESSON)
SOLVED = {"answers": SOLUTION}  # the check-your-understanding answers, right

# ZeRO-1's flat shards for Muon, as DeepSpeed's first version: each rank orthogonalises its own piece of
# every matrix it holds. Right on the matrices a shard holds whole, wrong on those a boundary cuts; its
# work follows the elements a rank holds, so it also misses the balance target.
SLICED_SHARDS = '''class MyZeRO1Muon(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov))
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.params = [p for p in self.param_groups[0]["params"] if p.requires_grad]
        self.bucket = FlatBucket(self.params, self.world_size, self.rank)
        self.flat = self.bucket.flatten([p.data for p in self.params])
        for p, view in zip(self.params, self.bucket.views(self.flat)):
            p.data = view
        self.momentum = torch.zeros(self.bucket.shard_numel)

    @torch.no_grad()
    def step(self, closure=None):
        group, b = self.param_groups[0], self.bucket
        grad = torch.empty(b.shard_numel)
        dist.reduce_scatter_single(grad, b.flatten([p.grad for p in self.params]), op=dist.ReduceOp.AVG)
        present = torch.tensor([p.grad is not None for p in self.params], dtype=torch.uint8)
        dist.all_reduce(present, op=dist.ReduceOp.MAX)
        shard = b.shard(self.flat)
        for s in b.segments:
            if not present[s.index]:
                continue
            lo, hi = s.shard_lo, s.shard_hi
            rows, cols = self.params[s.index].shape
            m = self.momentum[lo:hi]
            m.lerp_(grad[lo:hi], 1 - group["momentum"])
            u = grad[lo:hi].lerp(m, group["momentum"])
            piece = u.view(-1, cols) if (hi - lo) % cols == 0 else u.view(1, -1)  # BUG: this rank's piece only
            shard[lo:hi].mul_(1 - group["lr"] * group["weight_decay"])
            shard[lo:hi].add_(newton_schulz(piece).reshape(-1).float(), alpha=-group["lr"] * max(1, rows / cols) ** 0.5)
        dist.all_gather_single(self.flat, shard)
'''

# Owners balanced by element count, ZeroRedundancyOptimizer's rule for its partitions.
ELEMENT_BALANCED = solution_with(
    "order = sorted(range(len(self.params)), key=lambda i: -newton_schulz_cost(self.params[i].shape))\n"
    "        for i in order:\n"
    "            rank = load.index(min(load))\n"
    "            self.owners[i] = rank\n"
    "            load[rank] += newton_schulz_cost(self.params[i].shape)",
    "order = sorted(range(len(self.params)), key=lambda i: -self.params[i].numel())\n"
    "        for i in order:\n"
    "            rank = load.index(min(load))\n"
    "            self.owners[i] = rank\n"
    "            load[rank] += self.params[i].numel()  # BUG: elements, not m·n·min(m, n)")

# Every rank all-reduces every gradient, keeps every matrix's momentum and updates every matrix: data
# parallel Muon (layout A). Right numbers, 2Ψ of volume, even work; N copies of the momentum.
MOMENTUM_EVERYWHERE = method_replaced("step", '''
    @torch.no_grad()
    def step(self, closure=None):
        group = self.param_groups[0]
        present = torch.tensor([p.grad is not None for p in self.params], dtype=torch.uint8)
        dist.all_reduce(present, op=dist.ReduceOp.MAX)
        for p, has in zip(self.params, present.tolist()):
            if not has:
                continue
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad)
            state = self.state[p]  # BUG: on every rank, for every matrix
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            muon_update_(p, grad.div_(self.world_size), state["momentum_buffer"], lr=group["lr"],
                         weight_decay=group["weight_decay"], momentum=group["momentum"], nesterov=group["nesterov"])
''')

# The owner uses the sum of the ranks' gradients: the weights are the same (Newton-Schulz normalises),
# the momentum is N times torch's.
SUMS_GRADIENTS = solution_with("muon_update_(p, grads[p].div_(self.world_size),",
                               "muon_update_(p, grads[p],  # BUG: a sum, not the mean\n                        ")

# No flags: each rank skips the matrices it has no .grad for. Right while every rank has a gradient for
# every matrix; in BranchNet's step 4 rank 1 has none for the branch, and its collectives fall out of step.
SKIPS_OWN_GRAD = method_replaced("step", '''
    @torch.no_grad()
    def step(self, closure=None):
        group = self.param_groups[0]
        live = [(p, owner) for p, owner in zip(self.params, self.owners) if p.grad is not None]  # BUG: no flags
        for p, owner in live:
            dist.reduce(p.grad, dst=owner, op=dist.ReduceOp.SUM)
        for p, owner in live:
            if owner != self.rank:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            muon_update_(p, p.grad.div_(self.world_size), state["momentum_buffer"], lr=group["lr"],
                         weight_decay=group["weight_decay"], momentum=group["momentum"], nesterov=group["nesterov"])
        for p, owner in live:
            dist.broadcast(p.data, src=owner)
''')

# The momentum created on every rank, updated by the owner only: right numbers, zeros kept on N - 1 ranks.
MOMENTUM_CREATED_EVERYWHERE = solution_with(
    "            if owner != self.rank:\n"
    "                continue\n"
    "            state = self.state[p]\n"
    "            if \"momentum_buffer\" not in state:\n"
    "                state[\"momentum_buffer\"] = torch.zeros_like(p)\n",
    "            state = self.state[p]\n"
    "            if \"momentum_buffer\" not in state:\n"
    "                state[\"momentum_buffer\"] = torch.zeros_like(p)  # BUG: on every rank\n"
    "            if owner != self.rank:\n"
    "                continue\n")

# The reduces started asynchronously and never waited for: the owner may read its sum before it arrives.
UNWAITED_REDUCE = solution_with("dist.reduce(grads[p], dst=owner, op=dist.ReduceOp.SUM)",
                                "dist.reduce(grads[p], dst=owner, op=dist.ReduceOp.SUM, async_op=True)  # BUG: no wait")

# Each rank orthogonalises its own rows of every matrix: the mean of its rows reduced to it (Ψ in all), its
# rows' momentum kept, its rows broadcast back (Ψ): ZeRO-1's traffic and balance, Newton-Schulz on slices.
ROWS_PER_RANK = method_replaced("step", '''
    @torch.no_grad()
    def step(self, closure=None):
        group = self.param_groups[0]
        present = torch.tensor([p.grad is not None for p in self.params], dtype=torch.uint8)
        dist.all_reduce(present, op=dist.ReduceOp.MAX)
        for p, has in zip(self.params, present.tolist()):
            if not has:
                continue
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            edges = [len(rows) for rows in torch.arange(p.shape[0]).tensor_split(self.world_size)]
            starts = [sum(edges[:r]) for r in range(self.world_size)]
            for r, (lo, n) in enumerate(zip(starts, edges)):
                dist.reduce(grad[lo:lo + n], dst=r)
            lo, n = starts[self.rank], edges[self.rank]
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p[lo:lo + n])  # BUG: this rank's rows only
            muon_update_(p.data[lo:lo + n], grad[lo:lo + n].div_(self.world_size), state["momentum_buffer"],
                         lr=group["lr"], weight_decay=group["weight_decay"], momentum=group["momentum"],
                         nesterov=group["nesterov"])
            for r, (lo, n) in enumerate(zip(starts, edges)):
                dist.broadcast(p.data[lo:lo + n], src=r)
''')

STUDENTS = [
    correct(LESSON, "muon_class", "answers"),
    # the stub's reason and the questions' both ask whether the cell is still the stub
    untouched(LESSON, "still the stub"),
    Student("sliced_shards", "Muon on ZeRO-1's flat shards: each rank orthogonalises its piece of a cut matrix",
            {**FULL, "test_muon_numerics": 0, "test_muon_balance": 0}, reason="Give each matrix one owner",
            cells={"muon_class": SLICED_SHARDS, **SOLVED}),
    Student("element_balanced", "owners balanced by element count, not by Newton-Schulz cost",
            {**FULL, "test_muon_balance": 0}, reason="balanced by element count",
            cells={"muon_class": ELEMENT_BALANCED, **SOLVED}),
    Student("momentum_everywhere", "every rank all-reduces, keeps every matrix's momentum and updates every matrix",
            {**FULL, "test_muon_state": 0}, reason="is kept on",
            cells={"muon_class": MOMENTUM_EVERYWHERE, **SOLVED}),
    Student("sums_gradients", "the owner updates with the sum of the ranks' gradients, not their mean",
            {**FULL, "test_muon_numerics": 0}, reason="summed, not averaged",
            cells={"muon_class": SUMS_GRADIENTS, **SOLVED}),
    Student("skips_own_grad", "a matrix skipped where this rank has no .grad, no flags exchanged",
            {**FULL, "test_muon_numerics": 0}, reason="a skip decided from this rank's own .grad",
            cells={"muon_class": SKIPS_OWN_GRAD, **SOLVED}),
    Student("momentum_created_everywhere", "the momentum created on every rank, updated by the owner only",
            {**FULL, "test_muon_state": 0}, reason="on all but one as zeros",
            cells={"muon_class": MOMENTUM_CREATED_EVERYWHERE, **SOLVED}),
    Student("unwaited_reduce", "the reduces started with async_op=True and never waited for",
            {**FULL, "test_muon_numerics": 0}, reason="had not been waited for",
            cells={"muon_class": UNWAITED_REDUCE, **SOLVED}),
    Student("rows_per_rank", "each rank orthogonalises its own rows of every matrix (reduce and broadcast by rows)",
            {**FULL, "test_muon_numerics": 0}, reason="Newton-Schulz of a slice",
            cells={"muon_class": ROWS_PER_RANK, **SOLVED}),
]
