"""The policy across rounds, and its reference.

Full fine-tuning trains the model's own weights round after round. With LoRA the model stays bare between rounds
and the adapter's weights are kept aside: each round wraps the model again and loads them, because the trainer
picks its reference from what it is given (reference.choose_reference):
- reference `initial` (pi_0): LoRA gives the trainer the bare model and the peft_config, so the reference is the
  adapter switched off (free); full fine-tuning gives it a frozen copy of the model taken before round 1 as
  ref_model (precompute_ref_log_probs in `training` then scores pi_0 once per round and the copy does nothing else);
- reference `previous` (the last round's policy, as Self-Rewarding and SPIN): LoRA gives it the model already
  wrapped with last round's adapter, which it copies frozen; full fine-tuning gives it the model alone, which it
  copies (or, with precompute_ref_log_probs, scores before the round's first step).
"""

import contextlib
import copy
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

try:
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
except ImportError:  # peft is a dependency; full fine-tuning needs none of it
    get_peft_model = get_peft_model_state_dict = set_peft_model_state_dict = None


class Policy:
    def __init__(self, model: torch.nn.Module, peft_config: Any, reference: str):
        self.model, self.peft_config, self.reference = model, peft_config, reference
        self.adapter: dict[str, torch.Tensor] | None = None  # LoRA: the adapter after the last round; None: fresh
        self.handed: torch.nn.Module | None = None  # LoRA, after the call's last round: the model wrapped for good
        # Taken before any checkpoint is loaded: on a resume too, the model passed in is pi_0.
        self.initial = copy.deepcopy(model).eval().requires_grad_(False) \
            if peft_config is None and reference == "initial" else None

    def restore(self, checkpoint: Path) -> None:
        """Take the weights a finished round left (a resume)."""
        if self.peft_config is not None:
            self.adapter = load_file(str(checkpoint / "adapter_model.safetensors"))
        else:
            saved = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=next(self.model.parameters()).dtype)
            self.model.load_state_dict(saved.state_dict())

    def _wrapped(self) -> torch.nn.Module:
        wrapped = get_peft_model(self.model, copy.deepcopy(self.peft_config))
        if self.adapter is not None:
            set_peft_model_state_dict(wrapped, self.adapter)
        return wrapped

    @contextlib.contextmanager
    def current(self) -> Iterator[torch.nn.Module]:
        """The policy as it stands, to sample from."""
        if self.peft_config is None or self.handed is not None:
            yield self.model if self.handed is None else self.handed
            return
        wrapped = self._wrapped()
        try:
            yield wrapped
        finally:
            self.model = wrapped.unload()

    def trainer_models(self) -> dict[str, Any]:
        """DPOMinTrainer's model, ref_model and peft_config for this round (see the module's docstring)."""
        if self.peft_config is None:
            return {"model": self.model, "ref_model": self.initial, "peft_config": None}
        if self.reference == "previous" and self.adapter is not None:
            return {"model": self._wrapped(), "ref_model": None, "peft_config": None}
        return {"model": self.model, "ref_model": None, "peft_config": copy.deepcopy(self.peft_config)}

    def warm_start(self, trainer: Any) -> None:
        """After the trainer wrapped the bare model in a fresh adapter: last round's adapter weights into it."""
        if self.peft_config is not None and self.adapter is not None and self.reference == "initial":
            set_peft_model_state_dict(trainer.model, self.adapter)

    def finish(self, trainer: Any, checkpoint: Path) -> None:
        """Save the round's policy whole (staged, then renamed) and keep it for the next round."""
        staging = checkpoint.with_name(f".staging-{checkpoint.name}")
        if trainer.args.should_save:  # only the main process writes: another must not clear what it writes
            shutil.rmtree(staging, ignore_errors=True)
        trainer.save_model(str(staging))
        if trainer.args.should_save:
            shutil.rmtree(checkpoint, ignore_errors=True)
            os.replace(staging, checkpoint)
        trainer.accelerator.wait_for_everyone()
        if self.peft_config is not None:
            self.adapter = {name: tensor.detach().cpu().clone()
                            for name, tensor in get_peft_model_state_dict(trainer.model).items()}
            self.model = trainer.model.unload()

    def hand_to(self, trainer: Any) -> None:
        """After the call's last round, the trainer handed back (RoundsResult.trainer) gets the trained policy: with
        LoRA `finish` took the adapter off its model for the next round (its save_model() would write an empty
        adapter), so the model is wrapped again with the trained adapter, and `current` gives that same model."""
        if self.peft_config is None or trainer is None:
            return
        self.handed = self._wrapped()
        trainer.model = trainer.model_wrapped = self.handed
