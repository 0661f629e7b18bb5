"""Device choice and seeding for notebooks and scripts.

Taught in lesson 00 (welcome & setup).
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

__all__ = ["pick_device", "seed_everything", "describe_device"]


def pick_device(prefer: str | None = None) -> torch.device:
    """The best available device: CUDA, then Apple's MPS, then CPU.

    ``prefer`` (``"cuda"``, ``"mps"``, ``"cpu"``) or the environment variable
    ``ATTN_COURSE_DEVICE`` overrides the choice; asking for a device that is not
    available raises ``ValueError`` saying which ones are.
    """
    prefer = prefer or os.environ.get("ATTN_COURSE_DEVICE") or None
    available = ["cpu"]
    if torch.cuda.is_available():
        available.insert(0, "cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        available.insert(0 if "cuda" not in available else 1, "mps")
    if prefer is None:
        return torch.device(available[0])
    kind = torch.device(prefer).type
    if kind not in available:
        raise ValueError(f"device {prefer!r} is not available here; available: {available}")
    return torch.device(prefer)


def seed_everything(seed: int = 0) -> torch.Generator:
    """Seed Python's ``random``, NumPy and PyTorch (CPU and all GPUs); return a seeded CPU generator."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def describe_device(device: torch.device | str) -> str:
    """One line naming the device, e.g. ``cpu (2 threads)`` or ``cuda: NVIDIA H200``."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    if device.type == "mps":
        return "mps: Apple GPU"
    threads = torch.get_num_threads()
    return f"cpu ({threads} thread{'s' if threads != 1 else ''})"
