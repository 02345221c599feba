"""Example students for lesson 05 (sharded_parameters, my_zero3): a lean set.

Points: test_gather_free 2 (exercise 1, gather and free), test_matches_adamw 4,
test_parameters_sharded 4, test_communication 3 (exercise 2, the hooks), test_understanding 2
(the questions; every defect below but rounds_the_answer answers them right). The hook checks
run the student's hooks on zerokit's gather/free, so a defect in one exercise costs that
exercise only; and right numbers from full copies cost test_parameters_sharded.
"""

from . import SOLUTION, Student, correct, full_marks, method_replaced, one_per_exercise, untouched

LESSON = "05_zero3"
# The cell the exercises need besides their own (the launcher choice, imports); the demo
# cells are left out of the lean examples so the set grades quickly. `correct` keeps all.
KEEP = ('os.environ["ZEROKIT_LAUNCHER"]',)

FULL = full_marks(LESSON)
ZERO = dict.fromkeys(FULL, 0)

# The solution's exercise 2 with one addition: a full copy of each unit kept "just in case"
# after its forward. The numbers and the collectives are right; the memory is not.
_COPIES = '''
    def post_forward(self, u, module, args, output):
        if not hasattr(self, "_copies"):
            self._copies = {}
        # BUG: a full copy of the unit's weights outlives the step
        self._copies[u] = [p.detach().clone() for bi in self.buckets_of_unit[u] for p in self.buckets[bi].params]
        backward_coming = torch.is_grad_enabled()
        if backward_coming:
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                register_multi_grad_hook(tensors, partial(self.pre_backward, u), mode="any")
        if u != 0 or not backward_coming:
            for bi in self.buckets_of_unit[u]:
                self.free(bi)
'''
# Exercise 1 with the naive free(): the parameters emptied and every reference dropped, but
# the memory not released in place, so autograd's saved views keep each unit alive.
_NO_RESIZE = '''
    @torch.no_grad()
    def free(self, bi):
        if bi in self.gathering:
            self.gathering.pop(bi)[0].wait()
        if self.full[bi] is not None:
            for p in self.buckets[bi].params:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self.full[bi] = None  # BUG: no self.full[bi].untyped_storage().resize_(0) before
'''


# Exercise 1's free() as the text once read: a prefetch nobody used is waited for and forgotten, but
# its buffer keeps its memory: a unit a data-dependent branch skips stays allocated between steps.
_KEEPS_PREFETCH = '''
    @torch.no_grad()
    def free(self, bi):
        if bi in self.gathering:
            self.gathering.pop(bi)[0].wait()  # BUG: the buffer of a prefetch nobody used is not released
        if self.full[bi] is not None:
            for p in self.buckets[bi].params:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self.full[bi].untyped_storage().resize_(0)
            self.full[bi] = None
'''

# Exercise 1's all-gather issued without group=: right on the default group, wrong (or a crash)
# on any subgroup the optimizer is given.
_NO_GROUP = '''
    def start_gather(self, bi):
        if self.full[bi] is not None or bi in self.gathering:
            return
        shard = self.flat_params[bi]
        full = self.gather_buffer(bi, shard)
        work = all_gather(full, shard, async_op=True)  # BUG: no group=self.group
        self.gathering[bi] = (work, full, shard)
'''
# Exercise 1's free() releases a prefetch's buffer while its all-gather may still be writing into it.
_FREE_NO_WAIT = '''
    @torch.no_grad()
    def free(self, bi):
        if bi in self.gathering:
            _work, full, _shard = self.gathering.pop(bi)  # BUG: released without work.wait()
            full.untyped_storage().resize_(0)
        if self.full[bi] is not None:
            for p in self.buckets[bi].params:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self.full[bi].untyped_storage().resize_(0)
            self.full[bi] = None
'''
# Exercise 2's post_forward with one mistake each (the rest as the solution has it).
_ROOT_KEPT_AFTER_EVAL = '''
    def post_forward(self, u, module, args, output):
        if torch.is_grad_enabled():
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                register_multi_grad_hook(tensors, partial(self.pre_backward, u), mode="any")
        if u != 0:  # BUG: the root kept for a backward, even under no_grad where none comes
            for bi in self.buckets_of_unit[u]:
                self.free(bi)
'''
_ONE_TENSOR_OUTPUT = '''
    def post_forward(self, u, module, args, output):
        backward_coming = torch.is_grad_enabled()
        if backward_coming and output.requires_grad:  # BUG: the output may be a tuple or a dict
            output.register_hook(partial(self.pre_backward, u))
        if u != 0 or not backward_coming:
            for bi in self.buckets_of_unit[u]:
                self.free(bi)
'''
_FREES_ROOT = '''
    def post_forward(self, u, module, args, output):
        if torch.is_grad_enabled():
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                register_multi_grad_hook(tensors, partial(self.pre_backward, u), mode="any")
        for bi in self.buckets_of_unit[u]:  # BUG: the root too, so backward gathers it again
            self.free(bi)
'''
# A multi-grad hook with mode="all": it fires at the last output's gradient, after autograd has
# gone into a unit with several outputs (mix returns a dict of two tensors) on its empty weights.
_MODE_ALL = '''
    def post_forward(self, u, module, args, output):
        backward_coming = torch.is_grad_enabled()
        if backward_coming:
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                register_multi_grad_hook(tensors, partial(self.pre_backward, u), mode="all")  # BUG: "any"
        if u != 0 or not backward_coming:
            for bi in self.buckets_of_unit[u]:
                self.free(bi)
'''
# gather_unit waits for u's transfer before it starts the next unit's (hint 3's pitfall).
_WAITS_FIRST = '''
    def gather_unit(self, u, prefetch_next=None):
        for bi in self.buckets_of_unit[u]:
            self.start_gather(bi)
        for bi in self.buckets_of_unit[u]:
            self.finish_gather(bi)  # BUG: before the next unit's start_gather
        if self.prefetch and prefetch_next is not None:
            for bi in self.buckets_of_unit[prefetch_next]:
                self.start_gather(bi)
'''
# In backward, the prefetch takes the next unit in *forward* order: one whose backward is over.
_BACKWARD_PREFETCH_FORWARD_ORDER = '''
    def pre_backward(self, u, grad):
        self.gather_unit(u, prefetch_next=self.next_in_forward(u))  # BUG: next_in_backward
'''


def _mechanics(student_id, defect, method, code, reason):
    """A student whose exercise 1 has one bug (the hooks right): it costs test_gather_free only."""
    return Student(student_id, defect, {**FULL, "test_gather_free": 0}, reason=reason,
                   cells={"sharded_parameters": method_replaced(method, code), "my_zero3": SOLUTION,
                          "understanding": SOLUTION})


def _hooks(student_id, defect, tests, code, reason, method="post_forward"):
    """A student whose exercise 2 has one bug in `method` (exercise 1 right): it costs `tests` only."""
    tests = (tests,) if isinstance(tests, str) else tests
    return Student(student_id, defect, {**FULL, **dict.fromkeys(tests, 0)}, reason=reason,
                   cells={"sharded_parameters": SOLUTION, "my_zero3": method_replaced(method, code),
                          "understanding": SOLUTION})


STUDENTS = [
    correct(LESSON, "sharded_parameters", "my_zero3", "understanding"),
    untouched(LESSON, "still the stub"),
    Student("keeps_full_copies", "right hooks and numbers, but a full copy of every unit kept after its forward",
            {**FULL, "test_parameters_sharded": 0}, reason="something keeps full-size buffers alive",
            cells={"sharded_parameters": SOLUTION, "my_zero3": method_replaced("post_forward", _COPIES),
                   "understanding": SOLUTION}),
    Student("free_without_resize", "exercise 1's free() drops its references but does not resize_(0) the "
            "buffer (hooks right)", {**FULL, "test_gather_free": 0}, reason="release it in place",
            cells={"sharded_parameters": method_replaced("free", _NO_RESIZE),
                   "my_zero3": SOLUTION, "understanding": SOLUTION}),
    Student("keeps_unused_prefetch", "exercise 1's free() waits for a prefetch nobody used but leaves its buffer "
            "allocated (hooks right)", {**FULL, "test_gather_free": 0}, reason="a prefetch nobody used",
            cells={"sharded_parameters": method_replaced("free", _KEEPS_PREFETCH),
                   "my_zero3": SOLUTION, "understanding": SOLUTION}),
    _mechanics("gather_without_group", "exercise 1's all-gather issued without group=self.group",
               "start_gather", _NO_GROUP, "issued without group=self.group"),
    _mechanics("frees_prefetch_without_wait", "exercise 1's free() releases a prefetch's buffer without waiting "
               "for its all-gather", "free", _FREE_NO_WAIT, "without waiting for the transfer"),
    _hooks("root_kept_after_eval", "the root unit stays gathered after an eval forward under torch.no_grad()",
           "test_parameters_sharded", _ROOT_KEPT_AFTER_EVAL, "after an eval forward under torch.no_grad()"),
    _hooks("one_tensor_output", "post_forward hooks the output as one tensor: a unit returning a tuple or a "
           "dict crashes it", "test_matches_adamw", _ONE_TENSOR_OUTPUT, "the hook assumed one tensor output"),
    _hooks("frees_root_after_forward", "the root unit freed after its forward and gathered again in backward",
           "test_communication", _FREES_ROOT, "freed after its forward and gathered again for backward"),
    _hooks("mode_all_hook", 'the multi-grad hook registered with mode="all": a unit returning a dict of two '
           "tensors is entered before it fires", "test_matches_adamw", _MODE_ALL, 'mode="all" fires once the last'),
    _hooks("waits_before_prefetch", "gather_unit waits for u's transfer before it starts the next unit's",
           "test_communication", _WAITS_FIRST, "but not the wait for", method="gather_unit"),
    # a wrong prefetch target in backward costs memory (a finished unit gathered again) and the overlap
    _hooks("backward_prefetch_forward_order", "in backward, the prefetch takes the next unit in forward order",
           ("test_parameters_sharded", "test_communication"), _BACKWARD_PREFETCH_FORWARD_ORDER,
           "next_in_backward", method="pre_backward"),
    Student("rounds_the_answer", "the paper's model state given to three digits (1880 MB), the exercises right",
            {**FULL, "test_understanding": 0}, reason="zero3_mb_paper (you gave 1880)",
            cells={"sharded_parameters": SOLUTION, "my_zero3": SOLUTION,
                   "understanding": lambda solution: solution + '\nanswers["zero3_mb_paper"] = 1880  # BUG: 1875\n'}),
]

# Each mistake above is one student; graded as few notebooks as their cells allow, one mistake per exercise
# in each (one_per_exercise: the checks grade an exercise with zerokit's versions of the others).
STUDENTS = [*STUDENTS[:2], *one_per_exercise(FULL, STUDENTS[2:])]
