r"""What a ZeRO-3 unit keeps between its forward and its backward: FSDP2's `reshard_after_forward`.

Lesson 05's ZeRO-3 frees every unit after its forward and all-gathers it again for its
backward, except the root, which stays gathered (its backward comes first). That is one point
of a trade between memory and communication; `reshard_after_forward` names the others. With
$\Psi$ elements, N ranks and P bytes per gathered element (4 in fp32, 2 in 16-bit compute):

| value | held per rank between forward and backward | backward's all-gather | volume a step |
|---|---|---|---|
| `True` | the shard, $P\Psi/N$ | $\Psi$ over all N ranks | $3\Psi$ |
| `False` | the shard and every unit full, $P\Psi(1 + 1/N)$ | none | $2\Psi$ |
| `k` (hpZ) | the shard and a secondary shard, $P\Psi/N + P\Psi/k$ | $\Psi$ inside a node of k ranks | $3\Psi$ |
| `None` | `True` for every unit but the root, `False` for the root | | |

(The shard is fp32, $4\Psi/N$, whatever the compute dtype; the table's P is for what forward
gathered. Each row's memory is at its peak when forward ends, with every unit held.)

`k`, a divisor of N, is ZeRO++'s hpZ (Wang et al., 2023): after a unit's forward each rank
keeps its 1/k of the unit's gathered weights, where the k ranks are those of its "node", k
consecutive ranks of the group (FSDP2 cuts its mesh the same way; torchrun numbers the ranks of
a node consecutively). Backward then all-gathers the unit from those k secondary shards, inside
the node: of the $3\Psi$, the $\Psi$ of backward's gathers never cross the slow links between
nodes; forward's all-gather and the gradients' reduce-scatter still span all N ranks. The
arithmetic is the same as ZeRO-3's (the same weights gathered, the same gradients reduced), so
the numbers are bit for bit ZeRO-3's. `k = N` is `True`, and `k = 1` is `False` (a "secondary
shard" over one rank is the whole unit), as in FSDP2.

`None` is ZeRO3Adam's own behaviour and FSDP2's default. The machinery is ZeRO3Adam's, with
two hooks changed: what `post_forward` leaves (free, keep, or keep a secondary shard) and
where `start_gather` gathers from (the shards over all N ranks, or the secondary shards over
the node's k). Lesson 11's hpZ is this class with an int (`zerokit.zeropp.ZeROppAdam` adds qwZ to
it), and its exercise, `MyHpZAdam`, writes `keep_secondary`, `start_gather` and `free` as they
are here, less what is labelled beyond the exercise (tests/test_reference_reads_as_lesson.py).
"""

from functools import partial

import torch
import torch.distributed as dist
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from ..collectives import all_gather  # torch's, but direct on gloo
from ..comm import group_ranks
from ..hooks import in_backward, weak_hook
from ..zero3 import ZeRO3Adam, members

__all__ = ["ReshardZeRO3Adam", "node_group", "unit_policies"]

_NODE_GROUPS = {}  # (default group, ranks of the group, k) -> this rank's node group


def node_ranks(k, group=None, who="node_group"):
    """The global ranks of `group` (None: the default group), checked to cut into nodes of k
    consecutive ranks: the layout node_group and lesson 11's replica groups share."""
    ranks = group_ranks(group)
    if ranks is None:
        raise ValueError(f"{who}: the group is not one this process made with dist.new_group")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1 or len(ranks) % k:
        raise ValueError(f"a node size must be an int that divides the group's {len(ranks)} ranks, not {k!r}")
    return ranks


def node_group(k, group=None):
    """This rank's "node": the process group of the k consecutive ranks of `group` (None: the
    default group) that contain it. Made once per (group, k) and kept, as FSDP2 keeps its mesh;
    only the ranks of a node take part in making its group."""
    ranks = node_ranks(k, group)
    key = (dist.group.WORLD, ranks, k)  # the default group's object: a new one after re-initialising
    if key not in _NODE_GROUPS:
        i = ranks.index(dist.get_rank()) // k
        _NODE_GROUPS[key] = dist.new_group(list(ranks[i * k:(i + 1) * k]), use_local_synchronization=True)
    return _NODE_GROUPS[key]


def unit_policies(reshard_after_forward, n_units, world_size):
    """Per unit (unit 0 the root): True (free), False (keep) or an int k (hpZ), from the
    user's value; an int is validated against the group's size and k = 1 or N made a bool."""
    value = reshard_after_forward
    if value is not None and not isinstance(value, (bool, int)):
        raise TypeError(f"reshard_after_forward must be True, False, None or an int (a node's size), not {value!r}")
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1 or world_size % value:
            raise ValueError(f"reshard_after_forward={value}: a node's size must divide the {world_size} ranks "
                             f"of the group (FSDP2's rule too)")
        value = False if value == 1 else True if value == world_size else value
    if value is None:  # FSDP2's default: the root's backward comes first, so it is kept
        return [False] + [True] * (n_units - 1)
    return [value] * n_units


class ReshardZeRO3Adam(ZeRO3Adam):
    """ZeRO3Adam with FSDP2's `reshard_after_forward` (see the module's docstring): True, False,
    None (the default: ZeRO3Adam itself) or k, the size of a node (hpZ).

    The ranks of `group` form nodes of k consecutive ranks; zerokit.CommCounter's
    node_split(k) shows backward's all-gathers inside them.
    """

    def __init__(self, module, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, units=None,
                 prefetch=True, group=None, precision=None, offload=None, reshard_after_forward=None, foreach=None):
        super().__init__(module, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, units=units,
                         prefetch=prefetch, group=group, precision=precision, offload=offload, foreach=foreach)
        self.set_reshard_after_forward(reshard_after_forward)
        self.secondary = [None] * len(self.buckets)  # bucket -> (its secondary shard, node group), while held
        self._ran = [set() for _ in self.units]  # a group's modules whose forward ran in this forward

    def set_reshard_after_forward(self, value, units=None):
        """Change the policy (all units, or those indices of self.units) from the next forward on."""
        policies = unit_policies(value, len(self.units), self.world_size)
        if not hasattr(self, "after_forward"):
            self.after_forward = policies
        for u in (range(len(self.units)) if units is None else units):
            self.after_forward[u] = policies[u]
        sizes = {p for p in self.after_forward if not isinstance(p, bool)}
        self.node_groups = {k: node_group(k, self.group) for k in sizes}

    def record_order(self, u, module, args):
        if u == 0 and not in_backward():  # a new forward
            self._ran = [set() for _ in self.units]
        super().record_order(u, module, args)

    def post_forward(self, u, module, args, output):
        """Unit u's forward is done: hook its outputs for the backward gather (ZeRO-3), and leave
        it as its policy says: free (True), full (False), or a secondary shard (k). A group (FSDP2's
        fully_shard([a, b])) is left so once all of its modules' forwards have run."""
        if in_backward() or not torch.is_grad_enabled():  # a recomputation; or no backward to come: free it
            return super().post_forward(u, module, args, output)
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:  # as ZeRO3Adam.post_forward
            register_multi_grad_hook(tensors, partial(weak_hook(self.pre_backward), u), mode="any")
        self._ran[u].add(id(module))
        if len(self._ran[u]) < len(members(self.units[u])):
            return  # a group whose other modules are still to run: it stays gathered for them
        policy = self.after_forward[u]
        for bi in self.buckets_of_unit[u]:
            if policy is True:
                self.free(bi)
            elif policy is not False:
                self.keep_secondary(bi, self.node_groups[policy])

    @torch.no_grad()
    def keep_secondary(self, bi, node):
        """Keep this rank's 1/k of bucket bi's gathered buffer (k = the node's size), free the rest."""
        if self.full[bi] is None:  # not gathered (a unit that did not compute): nothing to keep
            return
        k, j = dist.get_world_size(node), dist.get_rank(node)
        piece = self.buckets[bi].padded_numel // k  # N divides the padded size, and k divides N
        secondary = self.full[bi][j * piece:(j + 1) * piece].clone()
        self.free(bi)
        self.secondary[bi] = (secondary, node)

    def start_gather(self, bi):
        """Gather bucket bi from its secondary shards inside the node if it has them, else from the
        shards over all ranks (ShardedParameters.start_gather)."""
        if self.secondary[bi] is None or self.full[bi] is not None or bi in self.gathering:
            return super().start_gather(bi)
        for other in list(self.gathering):  # beyond the exercise (lesson 11): one transfer at a time, as
            self.finish_gather(other)  # ShardedParameters.start_gather
        while self._in_flight:  # beyond the exercise (lesson 11)
            self._receive()
        (secondary, node), self.secondary[bi] = self.secondary[bi], None  # the gather holds it until done
        full = self.gather_buffer(bi, secondary)
        work = all_gather(full, secondary, group=node, async_op=True)
        self.gathering[bi] = (work, full, secondary)

    def free(self, bi):
        """Bucket bi back to its shard only: its secondary shard goes too."""
        self.secondary[bi] = None
        super().free(bi)

    def memory_categories(self):
        cats = super().memory_categories()
        cats["parameters"] = cats["parameters"] + [s for s, _ in filter(None, self.secondary)]
        return cats
