"""The policy across rounds, and its reference.

Full fine-tuning trains the model's own weights round after round. With LoRA the model stays bare between rounds
and the adapter's weights are kept aside: each round wraps the model again and loads them. Each round names its
reference to the trainer (DPOMinConfig.reference_mode, `Policy.reference_mode`) and gives it the models that mode
takes, so the trainer builds that reference and refuses models that do not fit, rather than inferring one:
- reference `initial` (pi_0): LoRA, `adapter_off`: the bare model and the peft_config, the adapter switched off
  (free); full fine-tuning, `ref_model`: a frozen copy of the model taken before round 1 (precompute_ref_log_probs
  in `training` then scores pi_0 once per round and the copy does nothing else);
- reference `previous` (the last round's policy, as Self-Rewarding and SPIN): LoRA, `adapter_at_start`: the model
  wrapped with last round's adapter, copied frozen (round 1, with no adapter yet: `adapter_off`, the same pi_0);
  full fine-tuning, `policy_at_start`: the model alone, copied (or, with precompute_ref_log_probs, scored before the
  round's first step).
"""

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from ..files import staging_path
from .store import written_whole

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

    @property
    def reference_mode(self) -> str:
        """The reference this round's trainer is told to take (DPOMinConfig.reference_mode; the module's docstring)."""
        if self.peft_config is None:
            return "ref_model" if self.reference == "initial" else "policy_at_start"
        return "adapter_at_start" if self.reference == "previous" and self.adapter is not None else "adapter_off"

    def trainer_models(self) -> dict[str, Any]:
        """DPOMinTrainer's model, ref_model and peft_config for this round: what `reference_mode` takes."""
        mode = self.reference_mode
        if mode == "adapter_off":
            return {"model": self.model, "ref_model": None, "peft_config": copy.deepcopy(self.peft_config)}
        model = self._wrapped() if mode == "adapter_at_start" else self.model
        return {"model": model, "ref_model": self.initial if mode == "ref_model" else None, "peft_config": None}

    def warm_start(self, trainer: Any) -> None:
        """After the trainer wrapped the bare model in a fresh adapter: last round's adapter weights into it."""
        if self.peft_config is not None and self.adapter is not None and self.reference == "initial":
            set_peft_model_state_dict(trainer.model, self.adapter)

    def finish(self, trainer: Any, checkpoint: Path) -> None:
        """Save the round's policy whole (staged, then renamed) and keep it for the next round."""
        if trainer.args.should_save:  # the main process writes, and alone renames
            with written_whole(checkpoint) as staging:
                trainer.save_model(str(staging))
        else:  # save_model writes nothing here; it is called for what it gathers from every process
            trainer.save_model(str(staging_path(checkpoint)))
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
