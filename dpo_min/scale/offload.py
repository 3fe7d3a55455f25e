"""Activation offloading: tensors the forward saves for backward wait in CPU memory instead of accelerator memory.

A smaller cousin of TRL's `OffloadActivations` (no side stream): each saved tensor on an accelerator, bigger than
`min_bytes` and not a parameter, is copied to pinned CPU memory when saved and copied back when backward needs it.
Tensors already on the CPU are left alone, so on a CPU run this changes nothing but the bookkeeping.
"""

import torch
from torch.autograd.graph import saved_tensors_hooks


class OffloadActivations(saved_tensors_hooks):
    """Context manager around a forward whose saved activations should live in CPU memory until backward."""

    def __init__(self, model: torch.nn.Module, min_bytes: int = 1024, keep_on: tuple[str, ...] = ("cpu",)):
        """`keep_on`: device types whose tensors stay where they are (a test passes () to offload CPU tensors)."""
        # Weights are saved for backward too (by every linear layer); they stay where they are.
        parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.offloaded = 0  # tensors moved, for tests and curiosity

        def pack(tensor: torch.Tensor):
            if (tensor.device.type in keep_on or tensor.numel() * tensor.element_size() < min_bytes
                    or tensor.untyped_storage().data_ptr() in parameter_storages):
                return tensor
            host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout,
                               pin_memory=tensor.device.type == "cuda")
            host.copy_(tensor, non_blocking=True)
            self.offloaded += 1
            return tensor.device, host

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            device, host = packed
            return host.to(device, non_blocking=True)

        super().__init__(pack, unpack)
