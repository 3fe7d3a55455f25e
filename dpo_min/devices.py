"""Whether this machine has an accelerator: the package's one check, read by the command (a CPU-only machine gets
use_cpu, and DeepSpeed is told so) and by the rounds (several CPU processes join over gloo)."""

import os

import torch


def has_accelerator() -> bool:
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6 knows every backend; older ones, CUDA
    return accelerator.is_available() if accelerator is not None else torch.cuda.is_available()


def several_on_cpu() -> bool:
    """One of several launched processes on a machine with no accelerator: accelerate leaves each such process alone
    unless told cpu=True, and then each would sample, write and train the whole run by itself."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and not has_accelerator()


def deepspeed_on_cpu() -> None:
    """On a machine without an accelerator, DS_ACCELERATOR=cpu (unless set): accelerate imports DeepSpeed whenever it
    is installed (the `test` extra installs it), and DeepSpeed, left to find out itself, prints "[WARNING] ... Setting
    accelerator to CPU" on stdout in every run. CPU is what it finds there; named, it says nothing."""
    if not has_accelerator():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
