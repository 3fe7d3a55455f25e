"""What DPOMinTrainer answers to as TRL 1.16's `DPOTrainer`, beyond the loss and the steps: its public attributes
(`beta`, `ref_model`, ...), TR-DPO's sync, the columns kept for the collator under `remove_unused_columns=True`, the
model card's tags. Scripts written for TRL read these; a default run calls none of them (what TRL's trainer does at
every step, `prediction_step` and `aux_loss_enabled` among them, is written in trainer.py)."""

from typing import Any

import torch

from .collator import REFERENCE_COLUMNS
from .reference import NoReference, RefModel


class TRLSurface:
    """TRL DPOTrainer's public surface, mixed into DPOMinTrainer ahead of transformers.Trainer."""

    # TRL DPOTrainer's public attributes that scripts read, with TRL's meaning: the values the loss reads, taken from
    # args when the trainer is given it (`DPOMinTrainer.args`), not copied.
    beta = property(lambda self: self.loss_settings.beta)
    loss_types = property(lambda self: list(self.loss_settings.loss_types))
    loss_weights = property(lambda self: list(self.loss_settings.weights))
    label_smoothing = property(lambda self: self.loss_settings.hyperparameters["label_smoothing"])
    ld_alpha = property(lambda self: self.loss_settings.ld_alpha)
    use_weighting = property(lambda self: self.loss_settings.use_weighting)
    f_divergence_type = property(lambda self: self.loss_settings.f_divergence_type)
    f_alpha_divergence_coef = property(lambda self: self.loss_settings.f_alpha_divergence_coef)
    precompute_ref_logps = property(lambda self: self.args.precompute_ref_log_probs)
    padding_free = property(lambda self: self.args.padding_free)

    @property
    def ref_model(self) -> torch.nn.Module | None:
        """The separate reference model (prepared for the run), or None: TRL's attribute."""
        return self.reference.model

    @ref_model.setter
    def ref_model(self, model: torch.nn.Module | None) -> None:
        self.reference = NoReference("none (the loss reads no reference)") if model is None \
            else RefModel("ref_model, a separate frozen model", model=model)

    @property
    def ref_adapter_name(self) -> str | None:
        """The reference adapter of a PEFT model, or None (the adapter disabled, or no adapter reference)."""
        return self.reference.adapter

    def sync_reference(self) -> None:
        """TR-DPO: reference <- alpha * policy + (1 - alpha) * reference, for a reference model or adapter."""
        self.reference.sync(self.model, self.args.ref_model_mixup_alpha)

    def _set_signature_columns_if_needed(self) -> None:
        # The columns the collator reads, so that remove_unused_columns=True (TRL's default) keeps them, as TRL does.
        if self._signature_columns is None:
            self._signature_columns = ["prompt_ids", "chosen_ids", "rejected_ids", *REFERENCE_COLUMNS]

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None,
                          tags: str | list[str] | None = None, **kwargs: Any) -> None:
        """Trainer's card, called as TRL's (model_name, dataset_name, tags), with the model's tags (TRL's `trl`,
        `dpo` among them) added as TRL's card has them; Trainer's other keyword arguments pass through."""
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        tags += [tag for tag in getattr(self.model, "model_tags", None) or [] if tag not in tags]
        if dataset_name is not None:  # TRL's card lists it under `datasets`, which Trainer fills from dataset_tags
            kwargs.setdefault("dataset_tags", dataset_name)
            kwargs.setdefault("dataset", dataset_name)
        super().create_model_card(model_name=model_name, tags=tags, **kwargs)
