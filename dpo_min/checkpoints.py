"""Checkpoints are all-or-nothing: what `DPOMinTrainer._save_checkpoint` and `_save` call at every save.

Trainer's own save of checkpoint-N runs into a staging folder, renamed onto its name when whole; a sharded (FSDP2)
model is saved whole. tests/test_trainer.py fails if transformers stops calling those hooks.
"""

import os
import shutil
from collections.abc import Callable
from typing import Any

import torch
from transformers.trainer_utils import rotate_checkpoints

from .scale import sharding


def whole_state_dict(model: torch.nn.Module, state_dict: dict | None) -> dict | None:
    """The state dict to save: a sharded (FSDP2) model's gathered whole (every rank joins; rank 0 writes)."""
    if state_dict is None and sharding.is_sharded(model):
        return sharding.full_state_dict(model)
    return state_dict


def save_staged(trainer: Any, trial: Any, save: Callable[[], None]) -> None:
    """Run Trainer's `save` of checkpoint-N into a staging folder, then rename it: a kill mid-save leaves the previous
    checkpoints and no half-written checkpoint-N that `resume_from_checkpoint` could pick."""
    run_dir = trainer._get_output_dir(trial=trial)
    name = f"checkpoint-{trainer.state.global_step}"
    staging = os.path.join(run_dir, f".staging-{name}")
    output_dir = trainer.args.output_dir
    trainer.args.output_dir = staging if trial is None else output_dir
    try:
        save()
    except Exception:
        # A save cut short (a full disk) leaves no half-written checkpoint to hold the space or mislead a resume.
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        trainer.args.output_dir = output_dir
    if trial is not None:  # hyperparameter search keeps Trainer's own layout
        return
    state = trainer.state
    trainer.accelerator.wait_for_everyone()
    if trainer.args.should_save:
        final = os.path.join(run_dir, name)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(os.path.join(staging, name), final)
        shutil.rmtree(staging, ignore_errors=True)
        if state.best_model_checkpoint and state.best_model_checkpoint.startswith(staging):
            state.best_model_checkpoint = os.path.join(run_dir, f"checkpoint-{state.best_global_step}")
        rotate_checkpoints(output_dir=run_dir, save_total_limit=trainer.args.save_total_limit,
                           best_model_checkpoint=state.best_model_checkpoint, use_mtime=False)
    trainer.accelerator.wait_for_everyone()
