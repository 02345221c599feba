r"""Activations: the memory that is not model state, counted, estimated, and recomputed.

ZeRO shards the model states (parameters, gradients, optimizer state). The other large
consumer is what autograd keeps from forward for backward: the **activations**. They grow
with the batch $b$ and the sequence length $s$, not with $N$, so they are the same on
every rank whatever the ZeRO stage, and past some $b\cdot s$ they outweigh ZeRO-3's
$16\Psi/N$.

Counting. `torch.autograd.graph.saved_tensors_hooks(pack, unpack)` calls `pack(t)` for
every tensor an operation saves for its backward. Several saved tensors are often views
of one storage (a linear layer saves a 2-D view of its 3-D input; attention saves q, k
and v, three views of one projection output), and a storage costs its bytes once, so
`SavedActivations` counts each storage once. Parameters are saved too (a linear layer
keeps its weight) but they are model state, not activations: storages that back a
parameter when they are saved are left out.

The estimate, per transformer layer of `zerokit.models.Block` (pre-norm, no dropout,
fp32, $b$ sequences of $s$ tokens, width $h$, $a$ heads), element by element of what
autograd saves (the lesson derives it):

$$A_{\text{layer}} = \underbrace{4bs\cdot 16h}_{\text{16 } bsh \text{ elements}} +
\underbrace{16bs}_{\text{2 LayerNorms' mean, rstd}} + \underbrace{4abs}_{\text{attention's logsumexp}}$$

The 16 $bsh$: each LayerNorm's input (2), the qkv projection's input (1), q, k, v (3),
the attention output, which is also the output projection's input (1), the MLP's input
(1), the GELU's input (4) and the second MLP layer's input (4). Korthikanti et al.
(*Reducing Activation Recomputation in Large Transformer Models*, 2022) count
$sbh(34 + 5as/h)$ bytes in 16 bits: the same 16 $bsh$ elements, plus dropout masks
($2sbh$ bytes) and the attention matrix, $5as^2b$ bytes (softmax output, its dropout mask
and output). We have no dropout, and PyTorch's attention kernel (flash attention, also on
CPU) never stores the $s\times s$ matrix: it keeps a logsumexp per row and recomputes the
scores in backward.

Recomputation (activation checkpointing). `checkpoint_modules` makes chosen modules run
under `torch.utils.checkpoint` (non-reentrant): their forward keeps only its inputs, and
backward runs the forward again to rebuild the rest, one block at a time. Memory per
block drops from $A_{\text{layer}}$ to its input ($4bsh$), for about one more forward of
compute. Under ZeRO-3 the recomputed forward needs the block's parameters gathered again:
see zerokit.zero3 ("recomputation"), which uses `in_backward()` (zerokit.hooks) to tell a
recomputation from a forward.
"""

import functools

import torch
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

__all__ = ["SavedActivations", "layer_activation_bytes", "korthikanti_layer_bytes",
           "transformer_activation_bytes", "checkpoint_modules"]


def _storage_key(t):
    s = t.untyped_storage()
    return s.device.type, s.data_ptr()


@torch.no_grad()  # to_local() would record an autograd node
def _local(t):
    """The tensor that holds t's bytes: a DTensor's local tensor (fully_shard's parameters), else t itself."""
    return t.to_local() if isinstance(t, DTensor) else t


class SavedActivations:
    """Bytes autograd saves for backward inside the `with` block, each storage counted once.

        with SavedActivations(model, layers={"block 0": model.blocks[0], ...}) as acts:
            loss = loss_fn(model(x), y)
        acts.bytes        # all saved storages, parameters excluded
        acts.per_layer    # {name: bytes saved while that layer's forward ran}; "other": outside them
        acts.tensors      # how many tensors were saved (views of one storage included)

    model: its parameters are not activations; a saved tensor whose storage backs one of
        them when it is saved (ZeRO-3 swaps a parameter's storage, so this is looked up then)
        is left out. None: nothing is excluded.
    layers: modules to attribute the bytes to (a dict name -> module, or a list, named by
        position): a storage goes to the layer whose forward was running when it was first
        saved (the outermost one, if layers nest).
    """

    def __init__(self, model=None, layers=None):
        self.model = model
        if layers is None:
            layers = {}
        elif not isinstance(layers, dict):
            layers = {f"layer {i}": m for i, m in enumerate(layers)}
        self.layers = layers
        self.bytes, self.tensors = 0, 0
        self.per_layer = dict.fromkeys(list(layers) + ["other"], 0)
        self._seen = {}  # storage key -> a weak reference to the storage (alive: a view of it again)
        self._running = []  # names of the layers whose forward is running, outermost first
        self._handles, self._hooks = [], None

    def _parameter_keys(self):
        if self.model is None:
            return set()
        params = [_local(p) for p in self.model.parameters()]  # a sharded parameter (a DTensor): its local rows
        return {_storage_key(p) for p in params if p.untyped_storage().nbytes()}

    def _pack(self, t):
        if t.device.type == "meta" or t.untyped_storage().nbytes() == 0:
            return t
        self.tensors += 1
        key = _storage_key(t)
        if key in self._parameter_keys():
            return t
        seen = self._seen.get(key)
        if seen is None or seen.expired():  # a new storage (or a freed one's address, reused)
            self._seen[key] = StorageWeakRef(t.untyped_storage())
            nbytes = t.untyped_storage().nbytes()  # the whole storage stays alive, not just the view
            self.bytes += nbytes
            self.per_layer[self._running[0] if self._running else "other"] += nbytes
        return t  # autograd keeps the tensor itself: counting changes nothing

    @staticmethod
    def _unpack(t):
        return t

    # forward hooks: they return None (a forward hook's return value would replace the output)
    def _enter_layer(self, name, *_):
        self._running.append(name)

    def _leave_layer(self, *_):
        self._running.pop()

    def __enter__(self):
        for name, module in self.layers.items():
            self._handles.append(module.register_forward_pre_hook(functools.partial(self._enter_layer, name)))
            self._handles.append(module.register_forward_hook(self._leave_layer, always_call=True))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._seen.clear()
        return False


# ---------------------------------------------------------------------------------------
# the closed form


def layer_activation_bytes(b, s, h, a, element_bytes=4, stat_bytes=4):
    """Bytes one zerokit.models.Block saves for backward (see the module docstring).

    element_bytes: bytes per activation element (4 in fp32, 2 in bf16/fp16); stat_bytes:
    bytes per LayerNorm statistic and logsumexp element (fp32 in every precision here).
    """
    return element_bytes * 16 * b * s * h + stat_bytes * (4 * b * s + a * b * s)


def korthikanti_layer_bytes(b, s, h, a):
    """Korthikanti et al.'s activation bytes of one transformer layer in 16 bits, with
    dropout and the attention matrix stored: $sbh(34 + 5as/h)$."""
    return 34 * s * b * h + 5 * a * s * s * b  # = sbh(34 + 5as/h), in integers


def transformer_activation_bytes(b, s, h, a, n_layers, vocab, element_bytes=4):
    """What zerokit.models.TinyTransformer saves for a batch of b sequences of s tokens,
    by part, with the cross-entropy loss of zerokit.models (fp32; int64 token ids).

    Outside the blocks: the embeddings keep the token ids and the positions (int64), the
    final LayerNorm its input and statistics, the output layer its input, cross-entropy
    its log-softmax (b s vocab) and the targets. The token ids are zerokit.models.make_batch's:
    inputs and targets cut from one (b, s + 1) tensor, whose whole storage the embedding keeps.
    """
    e = element_bytes
    blocks = n_layers * layer_activation_bytes(b, s, h, a, e)
    embeddings = 8 * b * (s + 1) + 8 * s  # see below
    head = (e * b * s * h + 4 * 2 * b * s) + e * b * s * h  # final norm (input, mean, rstd) + output layer
    # the targets: a slice of each row of the same ids, which the loss's reshape copies when
    # b > 1 (rows sliced are not contiguous); with b = 1 they stay a view of the ids, counted above
    loss = 4 * b * s * vocab + (8 * b * s if b > 1 else 0) + 4  # log-softmax output, targets, nll's total weight
    return {"blocks": blocks, "embeddings": embeddings, "head": head, "loss": loss,
            "total": blocks + embeddings + head + loss}


# ---------------------------------------------------------------------------------------
# recomputation


def checkpoint_modules(modules, early_stop=True):
    """Run each module's forward under torch.utils.checkpoint (non-reentrant): it keeps only
    its inputs, and backward recomputes the rest. Returns a function that undoes it.

    The module's own forward hooks run once, outside the checkpointed region (a ZeRO-3 unit
    that is the whole module gathers for backward as usual); the hooks of modules inside it
    run again during the recomputation, inside backward. Parameter names do not change.
    early_stop: stop the recomputation as soon as it has rebuilt what backward needs
    (PyTorch's default); False runs the whole forward again.
    """
    modules = list(modules)
    for m in modules:
        if "forward" in vars(m):
            raise ValueError(f"{type(m).__name__} already has a forward of its own (checkpointed twice?)")
        # an instance attribute: nn.Module.__call__ finds it before the class's forward
        m.forward = functools.partial(checkpoint, type(m).forward.__get__(m), use_reentrant=False,
                                      early_stop=early_stop)

    def undo():
        for m in modules:
            vars(m).pop("forward", None)

    return undo
