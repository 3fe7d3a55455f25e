"""Checkpoints are all-or-nothing: what `DPOMinTrainer._save_checkpoint` and `_save` call at every save.

`save_whole` takes Trainer's `_save_checkpoint` steps (transformers 5.21 to 5.25, whose `_save_checkpoint` is the same
source, `SAVE_CHECKPOINT_SHA256`) in an order that keeps checkpoint-N whole
or absent: Trainer's own savers write its files into a staging folder, which is renamed onto checkpoint-N when whole;
only then is that path recorded, pushed and rotated. Trainer is never lent a path that will not exist: the trainer
state names the real best checkpoint, `training_args.bin` the real output folder, and a push uploads checkpoint-N,
not a staging folder about to be deleted. A sharded (FSDP2) model is saved whole. tests/test_trainer.py fails if
transformers stops calling these hooks, and tests/test_checkpoints.py if its `_save_checkpoint` takes other steps or
is another source than the one these steps were read from. Trainer exposes no public way to save a checkpoint into
a folder of the caller's choosing (`save_model` writes weights, not the optimizer, scheduler, RNG and state).
"""

import os
import shutil
from typing import Any

import torch
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, rotate_checkpoints

from .files import writing
from .scale import sharding

# sha256 of `inspect.getsource(Trainer._save_checkpoint)` in the transformers releases whose steps `save_whole` takes
# (5.21.1, 5.22.2, 5.23.0, 5.24.0 and 5.25.0 hold this same source): a release that changes it fails
# tests/test_checkpoints.py until save_whole is read against it again and its hash added here.
SAVE_CHECKPOINT_SHA256 = {"a9111e30faa9933986e022e56b5af81fd990356db64d727b4c320c852283bf3b"}


def whole_state_dict(model: torch.nn.Module, state_dict: dict | None) -> dict | None:
    """The state dict to save: a sharded (FSDP2) model's gathered whole (every rank joins; rank 0 writes)."""
    if state_dict is None and sharding.is_sharded(model):
        return sharding.full_state_dict(model)
    return state_dict


def save_whole(trainer: Any) -> None:
    """checkpoint-N written into `.staging-checkpoint-N` and renamed into place: a kill mid-save leaves the previous
    checkpoints and no half-written checkpoint-N that `resume_from_checkpoint` could pick; a save cut short (a full
    disk) leaves no staging folder to hold the space. Then pushed from checkpoint-N and the old ones rotated out."""
    args, state = trainer.args, trainer.state
    run_dir = args.output_dir
    name = f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
    final, staging = os.path.join(run_dir, name), os.path.join(run_dir, f".staging-{name}")
    if trainer.hp_search_backend is None:
        trainer.store_flos()
    if args.should_save:  # what a killed save of this step left
        shutil.rmtree(staging, ignore_errors=True)
    trainer.accelerator.wait_for_everyone()
    try:
        with writing(f"{name} to {run_dir}"):
            _write(trainer, staging, final)
    except Exception:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    trainer.accelerator.wait_for_everyone()  # every process has written its part (its RNG state at least)
    if args.should_save:
        if os.path.exists(final):  # the same step saved again
            shutil.rmtree(final)
        os.replace(staging, final)
    trainer.accelerator.wait_for_everyone()
    if args.push_to_hub:
        trainer._push_from_checkpoint(final)
    if args.should_save:
        rotate_checkpoints(output_dir=run_dir, save_total_limit=args.save_total_limit,
                           best_model_checkpoint=state.best_model_checkpoint, use_mtime=False)


def _write(trainer: Any, staging: str, final: str) -> None:
    """Trainer's savers, into `staging`; the trainer state recorded as it will be read, from `final`."""
    args, state = trainer.args, trainer.state
    trainer.save_model(staging, _internal_call=True)
    if args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) and state.best_global_step:
        best = os.path.join(os.path.dirname(final), f"{PREFIX_CHECKPOINT_DIR}-{state.best_global_step}")
        if best == final or os.path.exists(best):  # Trainer: "if it exists", and this one will, once renamed
            state.best_model_checkpoint = best
    if not args.save_only_model:
        trainer._save_optimizer_and_scheduler(staging)
        trainer._save_scaler(staging)
        trainer._save_rng_state(staging)
    if args.should_save:
        for callback in [*trainer.callback_handler.callbacks, trainer.control]:
            if isinstance(callback, ExportableState):  # what Trainer records of them, as it records it
                exported, saved = callback.state(), state.stateful_callbacks[type(callback).__name__]
                if isinstance(saved, list):
                    saved.append(exported)
                else:
                    state.stateful_callbacks[type(callback).__name__] = exported
        state.save_to_json(os.path.join(staging, TRAINER_STATE_NAME))
