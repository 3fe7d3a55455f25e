"""Faults stop training loudly, and checkpoints are all-or-nothing: `SafeSteps`, the `Trainer` hooks that say so.

`DPOMinTrainer` inherits them (`class DPOMinTrainer(SafeSteps, Trainer)`); tests/test_trainer.py fails if transformers
stops calling a hook overridden here.
"""

import os
import shutil

import torch
from transformers import Trainer
from transformers.trainer_utils import rotate_checkpoints

from .scale import sharding


class SafeSteps(Trainer):
    """A non-finite loss or gradient stops the run naming the step and the culprit, earlier checkpoints kept; a
    checkpoint is written into a staging folder, then renamed; a sharded (FSDP2) model is saved whole."""

    def _raise_non_finite(self, loss: torch.Tensor, *logps: torch.Tensor) -> None:
        names = ("policy chosen logps", "policy rejected logps", "reference chosen logps", "reference rejected logps")
        culprit = next((name for name, value in zip(names, logps)
                        if value is not None and not torch.isfinite(value).all()), "loss")
        raise FloatingPointError(f"step {self.state.global_step + 1}: the DPO loss is {loss.item()} "
                                 f"(first non-finite quantity: {culprit}); training stopped, earlier checkpoints kept")

    def _check_finite_gradients(self, model) -> None:
        # Checked before clipping, which would smear one non-finite gradient over all of them.
        if self.accelerator.scaler is not None:  # fp16's loss scaler expects overflowing steps and skips them
            return
        grads = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
        if grads and not torch.stack([torch.isfinite(g).all() for _, g in grads]).all():
            culprit = next(name for name, g in grads if not torch.isfinite(g).all())
            raise FloatingPointError(f"step {self.state.global_step + 1}: non-finite gradient in {culprit}; "
                                     "training stopped before the optimizer step, earlier checkpoints kept")

    def _clip_grad_norm(self, model):
        self._check_finite_gradients(model)
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:  # no clipping this run: the check has not happened yet
            self._check_finite_gradients(model)
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if state_dict is None and sharding.is_sharded(self.model):
            state_dict = sharding.full_state_dict(self.model)  # every rank joins the gather; rank 0 writes
        super()._save(output_dir, state_dict=state_dict)

    def _save_checkpoint(self, model, trial):
        """Write checkpoint-N into a staging folder, then rename it: a kill mid-save leaves the previous checkpoints
        and no half-written checkpoint-N that `resume_from_checkpoint` could pick."""
        run_dir = self._get_output_dir(trial=trial)
        name = f"checkpoint-{self.state.global_step}"
        staging = os.path.join(run_dir, f".staging-{name}")
        output_dir = self.args.output_dir
        self.args.output_dir = staging if trial is None else output_dir
        try:
            super()._save_checkpoint(model, trial)
        except Exception:
            # A save cut short (a full disk) leaves no half-written checkpoint to hold the space or mislead a resume.
            shutil.rmtree(staging, ignore_errors=True)
            raise
        finally:
            self.args.output_dir = output_dir
        if trial is not None:  # hyperparameter search keeps Trainer's own layout
            return
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            final = os.path.join(run_dir, name)
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(os.path.join(staging, name), final)
            shutil.rmtree(staging, ignore_errors=True)
            if self.state.best_model_checkpoint and self.state.best_model_checkpoint.startswith(staging):
                self.state.best_model_checkpoint = os.path.join(run_dir, f"checkpoint-{self.state.best_global_step}")
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=False)
        self.accelerator.wait_for_everyone()
