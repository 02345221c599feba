"""Where a rank of the job computes, and with which backend: the choice torchrun users expect.

    one GPU per local rank (GPUs >= local ranks)   NCCL, cuda:LOCAL_RANK
    fewer GPUs than local ranks                    gloo, the ranks sharing the GPUs (cuda:LOCAL_RANK % GPUs)
    no GPU                                         gloo on the CPU

NCCL refuses two ranks on one GPU, so with fewer GPUs than ranks the job runs gloo, which
moves CUDA tensors through host memory: the lessons' `ZEROKIT_DEVICE=cuda`. --device cpu
keeps the job on the CPU where there are GPUs; --device cuda is auto that refuses a machine
without one.

`placement` decides the backend from (local rank, local world size, GPU count, --device)
alone, a pure function the tests call with any GPU count. The device itself is then what
`zerokit.rank_device()` (the launcher's rule, the lessons' too) says for that backend and
`ZEROKIT_DEVICE`, and `take_place` checks that the two agree: one policy, not two.
"""

import os
from dataclasses import dataclass

import torch

DEVICE_ENV = "ZEROKIT_DEVICE"  # the lessons' switch (zerokit.launcher.backend): where gloo's ranks compute


@dataclass(frozen=True)
class Placement:
    backend: str  # "nccl" or "gloo"
    device: torch.device  # this rank's
    why: str  # the line the job prints first

    @property
    def env(self):
        """The environment that makes zerokit.rank_device() give `device` under `backend`."""
        return {DEVICE_ENV: self.device.type}


def placement(local_rank, local_world_size, gpus, want="auto"):
    """Placement of local rank `local_rank` of `local_world_size` on a machine with `gpus` GPUs.
    want: --device ("auto", "cpu" or "cuda")."""
    if want not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, not {want!r}")
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"local rank {local_rank} is not one of {local_world_size} local ranks")
    cpu = torch.device("cpu")
    if want == "cpu":
        idle = f"; the {gpus} GPU{'s' if gpus > 1 else ''} stay idle" if gpus else ""
        return Placement("gloo", cpu, f"--device cpu: gloo on the CPU{idle}")
    if gpus == 0:
        if want == "cuda":
            raise RuntimeError(f"--device cuda, but this torch ({torch.__version__}, CUDA build "
                               f"{torch.version.cuda}) sees no CUDA GPU: leave out --device or give --device cpu")
        return Placement("gloo", cpu, "no CUDA GPU visible: gloo on the CPU")
    ranks = f"{local_world_size} local rank{'s' if local_world_size > 1 else ''}"
    if gpus >= local_world_size:
        return Placement("nccl", torch.device("cuda", local_rank),
                         f"{gpus} GPU{'s' if gpus > 1 else ''} for {ranks}: NCCL, one GPU per rank (cuda:LOCAL_RANK)")
    share = -(-local_world_size // gpus)
    return Placement("gloo", torch.device("cuda", local_rank % gpus),
                     f"{gpus} GPU{'s' if gpus > 1 else ''} for {ranks}: NCCL needs a GPU per rank, so gloo with up to "
                     f"{share} ranks sharing each GPU (cuda:LOCAL_RANK % {gpus}; {DEVICE_ENV}=cuda, as the lessons "
                     f"run)")


def local_placement(want="auto"):
    """placement() of this process under torchrun (LOCAL_RANK, LOCAL_WORLD_SIZE) and the GPUs torch sees."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return placement(int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1)), gpus, want)


def prepare(place):
    """Before the process group: make zerokit.rank_device() answer `place.device`, and make it the
    current CUDA device (NCCL binds a rank to it; FSDP2 and new CUDA tensors default to it)."""
    os.environ.update(place.env)
    if place.device.type == "cuda":
        torch.cuda.set_device(place.device)


def take_place(want="auto"):
    """This rank's device, once its process group is up: zerokit.rank_device(), held to --device."""
    import zerokit

    device = zerokit.rank_device()
    if want != "auto" and device.type != want:
        raise RuntimeError(f"--device {want}, but this rank's process group puts it on {device} "
                           f"(zerokit.rank_device(): {DEVICE_ENV}={os.environ.get(DEVICE_ENV, 'unset')}); under "
                           f"zerokit.launch give "
                           f"env={{'{DEVICE_ENV}': '{want}'}}, or run python -m zerokit.train --device {want}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device
