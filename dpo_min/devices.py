"""Whether this machine has an accelerator: the package's one check, read by the command (a CPU-only machine gets
use_cpu) and by the rounds (several CPU processes join over gloo)."""

import os

import torch


def has_accelerator() -> bool:
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6 knows every backend; older ones, CUDA
    return accelerator.is_available() if accelerator is not None else torch.cuda.is_available()


def several_on_cpu() -> bool:
    """One of several launched processes on a machine with no accelerator: accelerate leaves each such process alone
    unless told cpu=True, and then each would sample, write and train the whole run by itself."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and not has_accelerator()
