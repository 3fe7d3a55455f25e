"""DeepSpeed ZeRO (accelerate's DeepSpeed plugin, or `TrainingArguments(deepspeed=...)`): what the reference needs.

Trainer builds DeepSpeed's engine for the policy only, inside train(). The frozen reference model gets an engine of
its own here, as TRL's `prepare_deepspeed` does: under ZeRO-3 it is partitioned like the policy (each process
holds 1/N of its weights); under ZeRO-1/2, which partition only optimizer state and gradients, it gets stage 0
(whole on every process, placed on the device). The precompute pass runs before train() has built the policy's
engine, so the policy (with its adapter disabled, or untrained) gets an inference engine first: it places the
weights and, under ZeRO-3, gathers each layer's shards for its forward on every process.
"""

import copy
from typing import Any

import torch


def zero_stage(args: Any) -> int | None:
    """The ZeRO stage of this run, or None without DeepSpeed."""
    plugin = getattr(args, "deepspeed_plugin", None)
    return None if plugin is None else plugin.zero_stage


def is_partitioned(model: torch.nn.Module) -> bool:
    """True once ZeRO-3 has partitioned the weights (zero.Init at load time, or an engine)."""
    return any(hasattr(parameter, "ds_id") for parameter in model.parameters())


def inference_engine(model: torch.nn.Module, accelerator: Any) -> torch.nn.Module:
    """A DeepSpeed engine for forwards only (no optimizer), in eval mode: ZeRO-3 keeps the run's stage, any other
    stage becomes 0."""
    import deepspeed  # only where DeepSpeed runs: importing it initialises its accelerator

    config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
    # No optimizer goes to this engine: without these blocks DeepSpeed would build one, or a scheduler, or an
    # offloaded CPUAdam for it.
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    zero = config.setdefault("zero_optimization", {})
    zero.pop("offload_optimizer", None)
    hidden_size = getattr(getattr(model, "config", None), "hidden_size", None)
    if zero.get("stage") == 3 and hidden_size is not None:
        # Buckets sized to the model rather than left "auto", which only Trainer's own engine would fill in.
        zero.update({"reduce_bucket_size": hidden_size * hidden_size,
                     "stage3_param_persistence_threshold": 10 * hidden_size,
                     "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size)})
    if zero.get("stage") != 3:
        zero["stage"] = 0
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if config.get(key) == "auto":
            config[key] = 1  # unused by a forward-only engine, but DeepSpeed's config check wants numbers
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


def gathered_copy(parameter: torch.Tensor) -> torch.Tensor:
    """A ZeRO-3 parameter made whole on every process (every process must call it, in the same order)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters([parameter]):
        return parameter.detach().clone()

