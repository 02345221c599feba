"""Which process-group backend a job uses, and which device a rank puts its tensors on."""

import os


def resolve_backend(backend: str, world_size: int) -> str:
    """"auto" means NCCL when there is one CUDA device per rank, gloo (CPU) otherwise."""
    if backend != "auto":
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', not {backend!r}")
        return backend
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def rank_device():
    """The device this rank should put its tensors on: cuda:<local rank> under NCCL, else cpu."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")
