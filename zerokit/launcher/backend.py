"""Which process-group backend a job uses, and which device a rank puts its tensors on.

NCCL needs one GPU per rank: it refuses two ranks on one device. With fewer GPUs than ranks
the course runs gloo, and by default gloo's ranks compute on the CPU (a laptop's setting).
`ZEROKIT_DEVICE=cuda` puts gloo's ranks on the GPU(s) instead, several ranks sharing one:
gloo then moves CUDA tensors through pinned host memory (`make gpu-check` runs every stage
that way on one GPU).
"""

import os

DEVICE_ENV = "ZEROKIT_DEVICE"  # "cpu" (default under gloo) or "cuda": where gloo's ranks compute


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
    """The device this rank should put its tensors on: cuda:<local rank> under NCCL; under gloo
    the CPU, or with ZEROKIT_DEVICE=cuda a GPU shared by several ranks (local rank modulo GPUs)."""
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", local_rank)
    choice = os.environ.get(DEVICE_ENV, "cpu")
    if choice == "cpu":
        return torch.device("cpu")
    if choice != "cuda":
        raise ValueError(f"{DEVICE_ENV} must be 'cpu' or 'cuda', not {choice!r}")
    if not torch.cuda.is_available():
        raise RuntimeError(f"{DEVICE_ENV}=cuda, but this torch ({torch.__version__}) sees no CUDA GPU")
    return torch.device("cuda", local_rank % torch.cuda.device_count())
