"""FSDP2 sharding applied by dpo_min itself (`DPOMinConfig(shard_with_fsdp2=True)`), so that it really shards on CPU.

accelerate engages its FSDP plugin only on accelerators: with `use_cpu` (or `accelerate launch --config_file
fsdp.yaml` on a CPU machine) it falls back to DDP and every process holds the whole model. Here torch's
`fully_shard` is applied to every decoder layer and then to the model, over all processes of the run (gloo on
CPU, NCCL on GPUs). The policy and, for full fine-tuning, the frozen reference copy are sharded alike, so the
reference costs 1/N of its weights per process and TR-DPO's mixing runs shard by shard.

The model is then marked the way transformers marks a model it sharded itself at load time
(`from_pretrained(distributed_config=...)`): Trainer does not wrap it in DDP, reshards it before making the
optimizer, and defers FSDP's gradient reduction over accumulation steps. `full_state_dict` gathers the weights
for saving (rank 0 writes); `gathered` turns sharded tensors back into full ones for the reference cache key.
"""

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a PeftModel (which itself holds no parameters of its own), or the model."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def shard_model(model: torch.nn.Module, device_type: str) -> None:
    """Apply FSDP2 in place: each decoder layer (the model's `_no_split_modules`) is one unit, the rest the root."""
    if not dist.is_initialized():
        raise ValueError("shard_with_fsdp2 needs several processes (torchrun or accelerate launch); this run has one")
    base = _base_model(model)
    layer_classes = set(getattr(base, "_no_split_modules", None) or ())
    if not layer_classes:
        raise ValueError(f"shard_with_fsdp2: {type(base).__name__} names no decoder layer class (_no_split_modules)")
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    layers = [module for module in base.modules() if type(module).__name__ in layer_classes]
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(base, mesh=mesh)
    # What from_pretrained(distributed_config=...) sets: Trainer then leaves the placement and gradient reduction to
    # FSDP instead of wrapping the model in DDP (which would fail on DTensor parameters).
    base._is_distributed_loading_by_transformers = True


def is_sharded(model: torch.nn.Module) -> bool:
    return any(isinstance(module, FSDPModule) for module in model.modules())


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full, unsharded state dict on CPU on rank 0 ({} elsewhere); every rank must call it (it gathers)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def gathered(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Sharded tensors (FSDP2's DTensors, DeepSpeed ZeRO-3's partitioned parameters) made whole, one at a time
    (every rank must call it, in the same order); others as they are."""
    return [(name, _whole(tensor)) for name, tensor in named_tensors]


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    if isinstance(tensor, DTensor):
        return tensor.full_tensor()
    if hasattr(tensor, "ds_id"):  # a ZeRO-3 parameter: a placeholder that DeepSpeed gathers
        from .zero import gathered_copy

        return gathered_copy(tensor)
    return tensor


def reshard(*models: torch.nn.Module) -> None:
    """Put every FSDP unit back to its shards: after a forward the root unit keeps its parameters whole, and mixing
    one model's parameters into another's (TR-DPO) needs both sharded alike."""
    for model in models:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
