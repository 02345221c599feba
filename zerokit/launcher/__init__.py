"""Run a Python callable on N ranks and hand back what each rank returned."""

from .runner import LaunchError, LaunchTimeout, describe_frames, launch, rank_device, resolve_backend

__all__ = ["launch", "LaunchError", "LaunchTimeout", "resolve_backend", "rank_device", "describe_frames"]
