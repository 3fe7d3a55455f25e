"""Faults stop training loudly, and checkpoints are all-or-nothing: what `DPOMinTrainer`'s `Trainer` hooks call.

tests/test_trainer.py fails if transformers stops calling one of those hooks.
"""

import os
import shutil
from collections.abc import Callable
from typing import Any

import torch
from transformers.trainer_utils import rotate_checkpoints

from .scale import sharding


def raise_non_finite(step: int, loss: torch.Tensor, *logps: torch.Tensor | None) -> None:
    """Stop on a non-finite loss, naming the step and the first non-finite of the four log-probs."""
    names = ("policy chosen logps", "policy rejected logps", "reference chosen logps", "reference rejected logps")
    culprit = next((name for name, value in zip(names, logps)
                    if value is not None and not torch.isfinite(value).all()), "loss")
    raise FloatingPointError(f"step {step + 1}: the DPO loss is {loss.item()} "
                             f"(first non-finite quantity: {culprit}); training stopped, earlier checkpoints kept")


def check_finite_gradients(model: torch.nn.Module, accelerator: Any, step: int) -> None:
    # Checked before clipping, which would smear one non-finite gradient over all of them.
    if accelerator.scaler is not None:  # fp16's loss scaler expects overflowing steps and skips them
        return
    grads = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
    if grads and not torch.stack([torch.isfinite(g).all() for _, g in grads]).all():
        culprit = next(name for name, g in grads if not torch.isfinite(g).all())
        raise FloatingPointError(f"step {step + 1}: non-finite gradient in {culprit}; "
                                 "training stopped before the optimizer step, earlier checkpoints kept")


def whole_state_dict(model: torch.nn.Module, state_dict: dict | None) -> dict | None:
    """The state dict to save: a sharded (FSDP2) model's gathered whole (every rank joins; rank 0 writes)."""
    if state_dict is None and sharding.is_sharded(model):
        return sharding.full_state_dict(model)
    return state_dict


def save_checkpoint_staged(trainer: Any, trial: Any, save: Callable[[], None]) -> None:
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


class SafeStepsHooks:
    """DPOMinTrainer's overrides of Trainer's hooks: the gradients checked before clipping (or before the optimizer
    step when nothing clips), a sharded model saved whole, each checkpoint staged and renamed."""

    def _check_finite_gradients(self, model) -> None:
        check_finite_gradients(model, self.accelerator, self.state.global_step)

    def _clip_grad_norm(self, model):
        self._check_finite_gradients(model)
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:  # no clipping this run: the check has not happened yet
            self._check_finite_gradients(model)
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        super()._save(output_dir, state_dict=whole_state_dict(self.model, state_dict))

    def _save_checkpoint(self, model, trial):
        save = super()._save_checkpoint
        save_checkpoint_staged(self, trial, lambda: save(model, trial))
