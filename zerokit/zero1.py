r"""ZeRO stage 1 ($P_{os}$): shard the optimizer state.

Data parallel Adam keeps m and v for every parameter on every rank: $K\Psi$ bytes, N times
over. ZeRO-1 gives each rank the Adam state for one shard (1/N) of the parameters only:

1. backward, as in data parallel: every rank has the full gradient of its micro-batch;
2. **reduce-scatter** the gradients (average): rank r receives the mean gradient of its
   shard only, $\Psi$ elements in the paper's count;
3. rank r runs Adam on its shard (its m, v and its slice of the weights);
4. **all-gather** the updated shards into every rank's full parameters ($\Psi$ again).

$2\Psi$ in all, the same volume as data parallel's all-reduce (which is itself a
reduce-scatter plus an all-gather): the optimizer state shrinks from $K\Psi$ to $K\Psi/N$
per rank for free.

To make step 4 one collective, the trainable parameters of each param group are moved
into one flat buffer (`FlatBucket`) and the model's parameters become views of it; the
shard a rank updates is a view of the same buffer, so with fp32 weights there is no
separate master copy. With mixed precision (`precision=`, lesson 06) the buffer is 16-bit
and each rank keeps the fp32 master of its own shard beside m and v: the master copy is
sharded with the optimizer state.
"""

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from .adam import adamw_update_, check_hyperparameters
from .collectives import all_gather, device_flags, reduce_scatter  # torch's, but direct on gloo (the ring's bytes)
from .ddp import broadcast_parameters, precision_state
from .flat import FlatBucket, make_buckets
from .hooks import weak_hook
from .multi_tensor import adamw_multi_tensor_, default_foreach

__all__ = ["ZeRO1Adam", "ShardedAdamState", "StateShard", "InMemory", "state_place", "register_offload"]


class InMemory:
    """The place of an optimizer's state without offload (lesson 08's offload= left None): the state
    where the parameters are, as plain tensors. What every place of zerokit.offload does (DiskPlace,
    PinnedPlace), done the plain way, so that an optimizer without offload needs no branch of its own."""

    offloaded = False
    needs_master = False
    chunk_numel = None  # the optimizer's own (ShardedAdamState.update: chunks on a CPU, the whole shard on a GPU)

    def __init__(self, device):
        self.device = torch.device(device)

    def new_tensor(self, name, numel, init=None):
        return torch.zeros(numel, dtype=torch.float32, device=self.device)

    def hold(self, name, tensor):
        return tensor  # a master made for this optimizer: already where it belongs

    def begin(self, state, param_shard, grad_shard):
        return param_shard, grad_shard

    def before_chunk(self, a, b):
        pass

    def after_chunk(self, state, param_shard, a, b):
        pass

    def end(self):
        pass

    def copy_master(self, master, shard):
        shard.copy_(master)


_OFFLOAD = []  # lesson 08's offload_place, once zerokit.offload is imported (zerokit's __init__ imports it)


def register_offload(offload_place):
    """Lesson 08's zerokit.offload hands its `offload_place(offload, param_device) -> Place` here
    when it is imported: offload= then takes "disk", "cpu" and an Offload too, and this lesson's
    module needs no import of that later one."""
    _OFFLOAD[:] = [offload_place]


def state_place(offload, param_device):
    """The Place for an optimizer's offload= argument: None, InMemory (no offload); anything else
    lesson 08's offload_place answers (see register_offload)."""
    if offload is None:
        return InMemory(param_device)
    if not _OFFLOAD:
        raise ValueError("offload= needs zerokit.offload (lesson 08), which is not imported")
    return _OFFLOAD[0](offload, param_device)


class ShardedAdamState:
    """Adam's m and v for one rank's shard of a FlatBucket, and a step count per parameter.

    Per-parameter step counts keep the bias correction right when a parameter has no
    gradient in some step (torch.optim.AdamW then skips it, state and all).
    foreach (beyond the exercise): update the shard's runs with one multi-tensor call (zerokit.multi_tensor),
    as torch.optim.AdamW(foreach=True) would update the parameters (None: AdamW's default for these parameters).
    """

    CPU_CHUNK = 1 << 16  # elements per Adam call on a CPU (see update)

    def __init__(self, bucket: FlatBucket, place, foreach=False):
        self.bucket = bucket
        self.foreach = default_foreach(bucket.params) if foreach is None else foreach
        # lesson 08: where m, v and the master live (InMemory: here; zerokit.offload: on disk, in pinned host memory)
        self.place = place
        self.exp_avg = place.new_tensor("exp_avg", bucket.shard_numel)
        self.exp_avg_sq = place.new_tensor("exp_avg_sq", bucket.shard_numel)
        self.steps = [0] * len(bucket.params)
        self.master = None  # lesson 06: the fp32 master of this shard's weights (fp32 runs: none)

    def keep_master(self, master, weights):
        """Hold the fp32 master of this shard (lesson 06; None: fp32 weights are their own),
        where the state lives (lesson 08). A place that runs Adam away from the weights (pinned
        host memory) needs a master in fp32 too: a copy of `weights`, this shard's weights."""
        if master is None and self.place.needs_master:
            master = weights
        self.master = None if master is None else self.place.hold("master", master)

    def tensors(self):
        """What this state holds, for the memory census: the master (if any), m and v."""
        return [self.master, self.exp_avg, self.exp_avg_sq]

    def copy_master(self, shard):
        """Write the master's values into `shard` (a 16-bit shard of the weights)."""
        self.place.copy_master(self.master, shard)

    @torch.no_grad()
    def update(self, param_shard, grad_shard, present, group):
        """Adam on this rank's shard; `present[i]`: parameter i had a gradient on some rank."""
        for i, has_grad in enumerate(present):
            if has_grad:
                self.steps[i] += 1
        beta1, beta2 = group["betas"]
        if self.foreach and not self.place.offloaded:  # beyond the exercise: every run at once
            runs = list(self._runs(present))
            adamw_multi_tensor_(*([t[lo:hi] for lo, hi, _ in runs]
                                  for t in (param_shard, grad_shard, self.exp_avg, self.exp_avg_sq)),
                                [step for _, _, step in runs], lr=group["lr"], beta1=beta1, beta2=beta2,
                                eps=group["eps"], weight_decay=group["weight_decay"])
            return
        place = self.place  # lesson 08: offloaded state is streamed, a chunk at a time
        param_shard, grad_shard = place.begin(self, param_shard, grad_shard)
        # On a CPU, cut the shard into chunks. adamw_update_ allocates temporaries as large as
        # its input (sqrt, division): on a whole shard each is a fresh multi-MiB block that the
        # C library maps and the kernel faults in again every step, and each of its eight passes
        # streams the shard through main memory. A chunk's four tensors stay in the cache and
        # its temporaries are small and reused: about 3x faster on one core. On a GPU one
        # kernel per operation over the whole shard is best. An offload place sets its own.
        chunk = place.chunk_numel or (self.CPU_CHUNK if grad_shard.device.type == "cpu" else None)
        for lo, hi, step in self._runs(present):
            for a in range(lo, hi, chunk or hi - lo):
                b = min(a + chunk, hi) if chunk else hi
                place.before_chunk(a, b)
                adamw_update_(
                    param_shard[a:b], grad_shard[a:b], self.exp_avg[a:b], self.exp_avg_sq[a:b], step,
                    lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"],
                )
                place.after_chunk(self, param_shard, a, b)
        place.end()

    def _runs(self, present):
        """[lo, hi) ranges of the shard whose segments follow one another and share one step count:
        usually one. A run spans the alignment's padding between two segments (zerokit.flat): its
        weights, gradient, m and v are zeros, and Adam leaves zeros there (m = v = 0, an update of
        0 / eps), so one call covers the shard instead of one per parameter."""
        run = None
        for s in self.bucket.segments:
            if not present[s.index]:
                if run:  # a parameter without a gradient sits between: it is not stepped
                    yield tuple(run)
                run = None
                continue
            step = self.steps[s.index]
            if run and run[2] == step:
                run[1] = s.shard_hi
            else:
                if run:
                    yield tuple(run)
                run = [s.shard_lo, s.shard_hi, step]
        if run:
            yield tuple(run)


def any_rank(flag_lists, device, group, read_if_all_true=True):
    """Lists of flags, each True where it is True on some rank: one all-reduce (MAX) for them all.

    read_if_all_true=False: where every flag is True here, the answer is every flag True, known
    without reading the all-reduced flags back (on a GPU a read waits for everything queued)."""
    local = [f for fs in flag_lists for f in fs]
    flags = device_flags(local, torch.uint8, device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    # every rank takes part in the all-reduce, whether or not it reads the result
    every = local if all(local) and not read_if_all_true else flags.bool().tolist()
    out, i = [], 0
    for fs in flag_lists:
        out.append(every[i:i + len(fs)])
        i += len(fs)
    return out


class FlatGradients:
    """ZeRO-1's gradients until step(), each bucket's in one flat buffer that autograd writes into.

    Otherwise step() copies the gradients into a new flat buffer to reduce-scatter them, and at that moment
    they are held twice (2 G Psi bytes). As views, the buffer *is* the gradients (PyTorch DDP's
    gradient_as_bucket_view). Not where gradients are reduced in another dtype than they are computed in:
    step() converts them by copying.
    hooked: False where a stage reduces the gradients in backward and needs no such buffer.
    bucket_mb (beyond the exercise): not None, each bucket is reduce-scattered once backward completes it.
    """

    def __init__(self, group, reduce_dtype, hooked, bucket_mb=None):
        self.group, self.reduce_dtype, self.hooked = group, reduce_dtype, hooked
        self.early = hooked and bucket_mb is not None  # beyond the exercise: see _arrived
        self.buckets, self._buffers = [], []  # flat gradients of this step, per bucket
        self._early = []  # beyond the exercise (bucket_mb): per bucket, (work, shard, flat, hooked) sent in backward
        self._agreed = None  # beyond the exercise: the presence flags sent_shards agreed on with the other ranks

    def add(self, buckets):
        """Hold these new buckets' gradients, as autograd writes them."""
        for bi, bucket in enumerate(buckets, len(self.buckets)):
            if self.hooked and self.reduce_dtype in (None, bucket.params[0].dtype):
                for j, p in enumerate(bucket.params):
                    p.register_post_accumulate_grad_hook(partial(weak_hook(self._into_buffer), bi, j))
        self.buckets += buckets
        self._buffers += [None] * len(buckets)
        self._early += [None] * len(buckets)
        self._begin_window()

    @torch.no_grad()
    def _into_buffer(self, bi, j, param):
        if param.grad.requires_grad:  # backward(create_graph=True): leave the graph intact
            return
        if self._buffers[bi] is None:  # the first gradient of this bucket since the last step
            self._buffers[bi] = self.buckets[bi].scratch()  # every view is written before it is read
        offset, numel = self.buckets[bi].offsets[j], param.numel()
        view = self._buffers[bi][offset:offset + numel].view_as(param)
        if param.grad.data_ptr() != view.data_ptr():  # a new gradient, not one accumulated in place
            view.copy_(param.grad)
            param.grad = view  # the original is freed now
        if self.early:  # beyond the exercise: send each bucket once backward completes it
            self._arrived(bi)

    def flat(self, i):
        """Bucket i's gradients in one flat buffer: the views' buffer, completed, or a new copy."""
        bucket, flat = self.buckets[i], self._buffers[i]
        self._buffers[i] = None  # the next backward starts a new buffer; .grad keeps this one
        if flat is None:
            return bucket.flatten([p.grad for p in bucket.params], dtype=self.reduce_dtype)
        for p, view in zip(bucket.params, bucket.views(flat)):
            if p.grad is None:
                view.zero_()  # no gradient on this rank counts as zero
            elif p.grad.data_ptr() != view.data_ptr():  # set by hand, not by backward
                view.copy_(p.grad)
        return flat

    def presence(self, has_grad, group):
        """Which parameters got a gradient on at least one rank of `group`: one tiny all-reduce (MAX).
        Beyond the exercise (bucket_mb): sent_shards has already asked, with its own flags."""
        present, self._agreed = self._agreed, None
        return present if present is not None else any_rank(has_grad, self.buckets[0].params[0].device, group,
                                                            read_if_all_true=False)

    def clear(self):
        """Gradients dropped without a step: so are their buffers, presence flags and transfers."""
        self._buffers = [None] * len(self.buckets)
        self._agreed = None
        for i, sent in enumerate(self._early):
            if sent is not None:
                sent[0].wait()  # issued on every rank: finish it before its buffers go
                self._early[i] = None
        self._begin_window()

    def tensors(self):
        """The gradients held, for the memory census: the buffers and (bucket_mb) the transfers in flight."""
        return [b for b in self._buffers if b is not None] + [
            t for sent in self._early if sent is not None for t in sent[1:3]]

    # ---- beyond the exercise (bucket_mb): the reduce-scatter overlaps backward ---------------
    # As DDP's all-reduce: a bucket whose every gradient has arrived is reduce-scattered at once, asynchronously,
    # while backward computes the rest; step() waits for it. Buckets go out in order (0, 1, ...), so every rank
    # issues the same collectives in the same order, and step() first sends what backward did not (a parameter
    # without a gradient on this rank holds its bucket back). The full gradients stay (ZeRO-1 keeps them until the
    # step); the cost is the reduced shards, 1/N of the gradients, held from backward on instead of made in step().
    # A gradient that arrives after its bucket went out (a second backward: accumulation) makes that transfer
    # stale; step() then reduces the bucket again from the accumulated buffer.

    def _begin_window(self):
        self._arrivals = [0] * len(self.buckets)  # gradients arrived per bucket since the last step
        self._next_send = 0  # buckets go out in order
        self._stale = [False] * len(self.buckets)

    def _arrived(self, bi):
        if self._early[bi] is not None:
            self._stale[bi] = True
            return
        self._arrivals[bi] += 1
        while self._next_send < len(self.buckets) and \
                self._arrivals[self._next_send] == len(self.buckets[self._next_send].params):
            self._send(self._next_send)

    def _send(self, i):
        hooked = self._buffers[i] is not None  # .grad are views of this buffer (else: a copy, made now)
        flat = self.flat(i)
        shard = torch.empty_like(self.buckets[i].shard(flat))
        work = reduce_scatter(shard, flat, op=dist.ReduceOp.AVG, group=self.group, async_op=True)
        self._early[i] = (work, shard, flat, hooked)  # the input must outlive the transfer
        self._next_send = i + 1

    def sent_shards(self, presence, flag_group, grad_shard):
        """Every bucket's reduced shard: the transfer backward started, or grad_shard(i) where a
        gradient changed after it (on any rank: they must agree, or their collectives differ).
        `presence` goes in the same all-reduce, over flag_group: presence() returns it."""
        while self._next_send < len(self.buckets):  # what backward could not send, in order
            self._send(self._next_send)
        for i, (_work, _shard, flat, hooked) in enumerate(self._early):  # .grad set anew after its bucket left
            params, views = self.buckets[i].params, self.buckets[i].views(flat) if hooked else ()
            if any(p.grad is not None and p.grad.data_ptr() != v.data_ptr() for p, v in zip(params, views)):
                self._stale[i] = True
        # the presence flags step() needs go in the same all-reduce: every collective is a round that
        # each rank must reach, and with more ranks than cores a round of a few bytes costs milliseconds
        stale, *self._agreed = any_rank([self._stale] + presence, self.buckets[0].params[0].device, flag_group)
        shards = []
        for i, again in enumerate(stale):
            (work, shard, _flat, _hooked), self._early[i] = self._early[i], None
            work.wait()
            shards.append(grad_shard(i) if again else shard)  # again: from the accumulated gradients
        self._begin_window()
        return shards


@torch.no_grad()
def clip_shards_(shards, max_norm, device, group=None):
    """Scale the shards so that the gradient they are pieces of has an L2 norm of at most max_norm; return the
    norm. Each rank's shards are disjoint pieces of the gradient, so the squared norm is the sum over ranks of
    each rank's local sum of squares: one all-reduce of one number."""
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in shards:
        sq += g.float().pow(2).sum()
    dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=group)
    norm = sq.sqrt()
    coef = max_norm / (norm.item() + 1e-6)  # the same rule as torch.nn.utils.clip_grad_norm_
    if coef < 1:
        for g in shards:
            g.mul_(coef)
    return norm


class ZeRO1Adam(torch.optim.Optimizer):
    """AdamW with its state sharded across the ranks of a process group (ZeRO stage 1).

    Same constructor and training loop as zerokit.Adam. Parameters are broadcast from rank 0 at construction,
    and the trainable ones become views of one flat buffer per param group (frozen ones, requires_grad=False,
    are left alone).
    precision: a zerokit.MixedPrecision for 16-bit weights and gradients (None: fp32).
    offload: where the optimizer state lives (lesson 08): None (here), "disk" (memory-mapped files, streamed
        through Adam), "cpu" (pinned host memory, the step on the CPU; GPU runs), or a zerokit.offload.Offload.
    foreach: as torch.optim.AdamW's. None: its default for these parameters, the multi-tensor update on a GPU
        (zerokit.multi_tensor) and lesson 01's update per run of the shard on a CPU. An offloaded state is
        always streamed through lesson 01's update.
    """

    # Whether a subclass reduce-scatters the gradients during backward (ZeRO-2 and 3 do). ZeRO-1 reduces them in
    # step(), and until then lets autograd write them into one flat buffer per bucket (FlatGradients).
    reduces_in_backward = False
    # None: one bucket per param group, reduce-scattered in step() (lesson 03's shape). Beyond the exercise: buckets
    # of bucket_mb MiB, each reduce-scattered as soon as backward completes it, so the transfer overlaps the rest
    # of backward as DDP's all-reduce does (see FlatGradients).
    bucket_mb = None

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, group=None,
                 precision=None, offload=None, bucket_mb=None, foreach=None):
        check_hyperparameters(lr, betas, eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        if bucket_mb is not None:  # else the class's, or what a subclass set before calling this
            self.bucket_mb = bucket_mb
        self.foreach = foreach
        self._shard(group, precision, offload)

    def _shard(self, group, precision, offload):
        """Cut the param groups into flat buckets and keep this rank's shard of the state of each."""
        if not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__} needs torch.distributed to be initialised (see zerokit.launch)")
        self.group, self.world_size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        # lesson 06: the dtypes, the loss scale and the master copies (fp32: FullPrecision, which does nothing)
        self.precision = precision_state(precision, group)
        self.reduce_dtype = self.precision.reduce_dtype  # None: the gradients' own
        first = next((p for g in self.param_groups for p in g["params"]), None)
        # lesson 08: where the optimizer state lives (InMemory: beside the parameters, no offload)
        self.offload = state_place(offload, first.device if first is not None else "cpu")
        self.buckets, self.bucket_group, self.shards, self.flat_params = [], [], [], []
        # the gradients until step(); beyond the exercise (bucket_mb): sent as backward completes each bucket
        self.grads = FlatGradients(group, self.reduce_dtype, not self.reduces_in_backward, self.bucket_mb)
        self._grad_cache = None  # this step's reduced gradient shards, once reduced (see _reduced_gradients)
        self._published = []  # beyond the exercise: the all-gathers _publish started, until step() waits
        self._shard_groups(0)

    def _shard_groups(self, first):
        """Shard param groups first, first + 1, ... (all of them at construction; beyond the exercise:
        the one add_param_group added). Returns the indices of the new buckets."""
        new = []
        for gi, param_group in enumerate(self.param_groups[first:], first):
            trainable = [p for p in param_group["params"] if p.requires_grad]
            # every parameter, frozen ones too: ranks that start apart in a frozen layer stay apart
            broadcast_parameters(param_group["params"], self.group)
            # lesson 06: frozen parameters compute in 16 bits too, and need no master
            self.precision.cast_parameters_([p for p in param_group["params"] if not p.requires_grad])
            by_dtype = {}  # a flat buffer holds one dtype on one device
            for p in trainable:
                by_dtype.setdefault((p.dtype, p.device), []).append(p)
            for bucket in (b for ps in by_dtype.values() for b in self._make_buckets(ps)):
                new.append(len(self.buckets))
                self.buckets.append(bucket)
                self.bucket_group.append(gi)
                self.shards.append(self._new_state(bucket))
        self.flat_params += [self._install_flat_params(i) for i in new]
        self.grads.add([self.buckets[i] for i in new])
        return new

    def _new_state(self, bucket):
        """This rank's optimizer state for one bucket: Adam's m and v of its shard."""
        return ShardedAdamState(bucket, place=self.offload, foreach=self.foreach)

    def _make_buckets(self, params):
        # align_bytes=None: each parameter and shard on zerokit.flat.ALIGN_BYTES (16 bytes), as
        # production buffers are (lesson 03's exercise lays them end to end: the same arithmetic)
        if self.bucket_mb is None:
            return [FlatBucket(params, self.world_size, self.rank, align_bytes=None)] if params else []
        # beyond the exercise (lesson 06): sized in the dtype the gradients will have, 16 bits
        # under mixed precision, while the parameters are still fp32 here
        numel = int(self.bucket_mb * 2**20) // (self.precision.param_dtype or params[0].dtype).itemsize
        return make_buckets(params, self.world_size, self.rank, numel, align_bytes=None)

    @torch.no_grad()
    def _install_flat_params(self, i):
        """Move bucket i's parameters into one flat buffer; they become views of it. Mixed precision (lesson 06):
        the buffer is 16-bit, and this rank's shard keeps an fp32 master copy, taken before the weights are
        rounded (fp32: no copy, flat as it is)."""
        bucket = self.buckets[i]
        flat = bucket.flatten([p.data for p in bucket.params])
        self.shards[i].keep_master(self.precision.master_copy(bucket.shard(flat)), bucket.shard(flat))
        flat = self.precision.to_half(flat)
        for p, view in zip(bucket.params, bucket.views(flat)):
            p.data = view
        return flat

    def _presence(self, has_grad):
        """Which parameters got a gradient on at least one rank (see FlatGradients.presence)."""
        return self.grads.presence(has_grad, self._flag_group())

    def _flag_group(self):
        """The ranks whose gradients decide whether a parameter got one (lesson 11's hybrid sharding: all nodes)."""
        return self.group

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.buckets:
            return loss
        grad_shards = self._reduced_gradients()  # before the flags: backward may have sent some already
        present = self._presence(self._local_presence())
        if self.precision.should_step():  # lesson 06: not where some rank has inf/nan: every rank skips
            for i, state in enumerate(self.shards):  # Adam on this rank's shard of each bucket, then publish it
                state.update(self._param_shard(i), grad_shards[i], present[i], self.param_groups[self.bucket_group[i]])
                self._publish(i)
            self._wait_published()
        self._grad_cache = None
        return loss

    def _reduced_gradients(self):
        """This rank's shard of the mean gradient, per bucket (reduced once per step)."""
        if self._grad_cache is None:
            if self.grads.early:  # beyond the exercise (bucket_mb): backward has sent them
                shards = self.grads.sent_shards(self._local_presence(), self._flag_group(), self._grad_shard)
            else:
                shards = [self._grad_shard(i) for i in range(len(self.buckets))]
            # lesson 06: in fp32, divided by the loss scale, checked for inf on all ranks (fp32: as they are)
            self._grad_cache = self.precision.fp32_gradients(shards)
        return self._grad_cache

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm):
        """Scale the mean gradient so its global L2 norm is at most max_norm; return the norm. Call it between
        backward() and step(), instead of torch.nn.utils.clip_grad_norm_ (which would see only local, unreduced
        or already-freed gradients): see clip_shards_."""
        device = self.buckets[0].params[0].device if self.buckets else "cpu"
        return clip_shards_(self._reduced_gradients(), max_norm, device, self.group)

    # The four steps below are what later stages change.

    def _local_presence(self):
        return [[p.grad is not None for p in b.params] for b in self.buckets]

    def _grad_shard(self, i):
        """The mean gradient of this rank's shard: a reduce-scatter of the flat gradients."""
        flat_grad = self.grads.flat(i)
        grad_shard = torch.empty_like(self.buckets[i].shard(flat_grad))
        reduce_scatter(grad_shard, flat_grad, op=dist.ReduceOp.AVG, group=self.group)
        return grad_shard

    def _param_shard(self, i):
        """The weights this rank updates: a view of the flat buffer, so the model sees them
        (mixed precision: the fp32 master of that view)."""
        master = self.shards[i].master
        return self.buckets[i].shard(self.flat_params[i]) if master is None else master

    def weight_shard(self, i):
        """This rank's shard of bucket i's weights as Adam updates it in step(): the tensor itself, not a copy
        (the fp32 master under mixed precision; in host memory or a file, a DiskTensor, when offloaded).
        ZeRO-3's is its shard at rest."""
        return self._param_shard(i)

    def _publish(self, i):
        """Every rank gets every updated shard; the input is a view of the output (in place). Beyond the
        exercise: asynchronous, so that bucket i's all-gather travels while the next bucket's shard is updated;
        step() waits for them all (_wait_published) before it returns."""
        shard = self.buckets[i].shard(self.flat_params[i])
        if self.shards[i].master is not None:  # lesson 06: round the updated fp32 master to 16 bits
            self.shards[i].copy_master(shard)
        self._published.append(all_gather(self.flat_params[i], shard, group=self.group, async_op=True))

    def _wait_published(self):
        """Beyond the exercise: wait for every all-gather _publish started; the weights are whole again."""
        while self._published:
            self._published.pop(0).wait()

    def scale_loss(self, loss):
        """loss times the loss scale (mixed precision fp16); the loss itself otherwise."""
        return self.precision.scale_loss(loss)

    def zero_grad(self, set_to_none=True):
        super().zero_grad(set_to_none=set_to_none)
        self._grad_cache = None  # a clipped-but-not-stepped gradient must not reach the next step
        self.grads.clear()  # nor its buffers, its presence flags or (bucket_mb) its transfers

    def memory_categories(self):
        """The tensors this optimizer holds, by category, for zerokit.memory.census.
        The fp32 master weights (mixed precision) are optimizer state: the paper's K = 12."""
        return {"parameters": list(self.flat_params), "gradients": self.grads.tensors(),
                "optimizer_states": [t for s in self.shards for t in s.tensors() if t is not None]}

    # ---- lesson 07: what a checkpoint saves and restores -------------------------------

    def state_shards(self):
        """This rank's part of the optimizer state, one StateShard per bucket (see StateShard.of)."""
        return StateShard.of(self)

    @torch.no_grad()
    def loaded(self):
        """The shards were overwritten in place (a checkpoint was loaded): publish them, so the model every rank
        computes with is the loaded one (ZeRO-1/2: round into the 16-bit buffer and all-gather; ZeRO-3: drop any
        gathered copy). A collective: every rank calls it."""
        for i in range(len(self.buckets)):
            self._publish(i)
        self._wait_published()

    def state_dict(self):
        raise NotImplementedError(f"{type(self).__name__} holds only this rank's shard of the optimizer state, so a "
                                  "state_dict() of one rank would be a sliver of it. Save the whole job with "
                                  "zerokit.checkpoint.save(path, model, opt) on every rank (opt.state_shards() is "
                                  "this rank's part).")

    def load_state_dict(self, state_dict):
        raise NotImplementedError(f"{type(self).__name__} is sharded: load with zerokit.checkpoint.load(path, model, "
                                  "opt) on every rank (any world size, any stage).")


@dataclass
class StateShard:
    """One bucket's optimizer state on this rank, as a checkpoint sees it (lesson 07).

    bucket: the FlatBucket (which parameters, at which offsets; this rank's shard range).
    group: the index of the bucket's param group.
    weights, exp_avg, exp_avg_sq: this rank's shards, fp32, bucket.shard_numel elements each:
        the weights Adam updates (the fp32 master under mixed precision), m and v.
    steps: Adam's step count per parameter of the bucket (the same on every rank).
    """

    bucket: FlatBucket
    group: int
    weights: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    steps: list

    @classmethod
    def of(cls, opt):
        """opt.state_shards() (ZeRO1Adam's and its stages'). The tensors are the optimizer's own (views, not
        copies): a checkpoint writes them as they are, and a load writes into them and then calls opt.loaded()."""
        if opt.offload.offloaded:  # lesson 08: the state is in files or host memory, not tensors here
            raise NotImplementedError(f"{type(opt).__name__}(offload=...) cannot be checkpointed yet: its m, v and "
                                      "master live in zerokit.offload's files or host memory; build it without "
                                      "offload= to save or load")
        return [cls(bucket, opt.bucket_group[i], opt.weight_shard(i), s.exp_avg, s.exp_avg_sq, s.steps)
                for i, (bucket, s) in enumerate(zip(opt.buckets, opt.shards))]
