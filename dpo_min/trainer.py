"""DPOMinTrainer: transformers.Trainer whose loss is DPO over one concatenated chosen+rejected forward.

`compute_loss` is the design card: one policy forward, the reference's log-probs, `.chunk(2)` into chosen and
rejected, `dpo_loss`. What the default run does not need lives beside, each named in the class's bases or called by
name: trl_surface.py (TRL's attributes, `prediction_step`, the card's tags), precompute.py (the dataloaders' hooks
for `precompute_ref_log_probs`), safe_steps.py (non-finite checks, staged checkpoints), metrics.py (TRL's metrics),
trainer_setup.py (the phases of the constructor), reference.py (which reference, decided once).
"""

import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from datasets import Dataset, IterableDataset
from transformers import EvalPrediction, PreTrainedModel, Trainer, TrainerCallback, set_seed

from . import safe_steps, trainer_setup
from .collator import REFERENCE_COLUMNS
from .compat import trl_hub_tags
from .config import DPOMinConfig
from .logps import SequenceLogps, sequence_logps
from .losses import dpo_loss
from .metrics import StepMetrics
from .precompute import PrecomputeHooks
from .reference import SyncReferenceCallback, choose_reference
from .safe_steps import SafeStepsHooks
from .scale.offload import OffloadActivations
from .trl_surface import TRLSurface

logger = logging.getLogger(__name__)


class DPOMinTrainer(TRLSurface, PrecomputeHooks, SafeStepsHooks, Trainer):
    """Direct Preference Optimization on `transformers.Trainer`; the constructor is TRL 1.16 `DPOTrainer`'s (see
    README, "Coming from TRL"). Which reference applies is decided once, in `reference.choose_reference`;
    `precompute_ref_log_probs=True` computes its log-probs once, up front (cached on disk)."""

    def __init__(
        self,
        model: "str | PreTrainedModel",
        ref_model: "str | PreTrainedModel | None" = None,
        args: DPOMinConfig | None = None,
        data_collator: Callable | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Dataset | IterableDataset | dict[str, Dataset | IterableDataset] | None = None,
        processing_class: Any = None,
        compute_metrics: Callable[[EvalPrediction], dict] | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,  # a peft.PeftConfig
    ):
        # TRL 1.16's signature, positional order included. `model` and `ref_model` may be hub ids or paths.
        args = trainer_setup.validated_args(model, ref_model, args, train_dataset, eval_dataset, compute_metrics,
                                            quantization_config)
        # The adapter's random init (and any weight a checkpoint lacks) must depend on the seed alone, as in TRL.
        set_seed(args.seed)
        model, ref_model, processing_class = trainer_setup.load_models_and_tokenizer(
            model, ref_model, args, processing_class, quantization_config)
        trainer_setup.agree_on_pad_token(model, processing_class)
        self.router_aux_loss_coef = trainer_setup.check_model(model, args)
        # A loss that reads no reference gets none: no copy of the model or adapter, no reference forward.
        model, self.reference = choose_reference(model, ref_model, args, peft_config,
                                                 args.loss_settings.reads_reference)
        logger.info("reference: %s", self.reference.description)
        trainer_setup.prepare_models([model, *self.reference.modules()], args)
        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        collator = data_collator or trainer_setup.default_collator(model, tokenizer, args)
        super().__init__(model=model, args=args, data_collator=collator,
                         train_dataset=trainer_setup.tokenized(train_dataset, tokenizer, args),
                         eval_dataset=trainer_setup.tokenized(eval_dataset, tokenizer, args),
                         processing_class=processing_class,
                         compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers)
        if hasattr(self.model, "add_model_tags"):  # Trainer puts the model's tags on the card it pushes
            self.model.add_model_tags(trl_hub_tags(model, os.environ))
        # The loss is a mean over pairs; Trainer must divide it by the accumulation steps itself.
        self.model_accepts_loss_kwargs = False
        self.reference.prepare(self.accelerator, self.is_deepspeed_enabled)
        self._precompute_engine = None  # DeepSpeed: the policy's forward-only engine for the precompute pass
        self.step_metrics = StepMetrics()
        self._metrics = self.step_metrics.by_mode  # TRL's name
        if args.sync_ref_model:
            self.add_callback(SyncReferenceCallback(self.sync_reference))

    @property
    def maybe_activation_offload_context(self) -> contextlib.AbstractContextManager:
        """TRL's attribute, and what `compute_loss` runs the policy's forward in: activation offloading while training
        with gradients, when `activation_offloading`."""
        offload = self.args.activation_offloading and self.model.training and torch.is_grad_enabled()
        return OffloadActivations(self.model) if offload else contextlib.nullcontext()

    # ---- loss ---------------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        settings = self.args.loss_settings
        with self.maybe_activation_offload_context:
            policy = sequence_logps(model, inputs, with_sum_sq_probs=settings.use_weighting,
                                    with_aux_loss=self.aux_loss_enabled)
        # Each [2B] per-sequence value holds the B chosen completions, then the B rejected ones: chunk(2) splits it.
        chosen_logps, rejected_logps = policy.summed_logps(settings.ld_alpha).chunk(2)
        if not settings.reads_reference:  # reference_free, or a loss of the policy alone: no reference at all
            ref_chosen_logps = ref_rejected_logps = None
        elif REFERENCE_COLUMNS[0] in inputs:  # precomputed once, up front (precompute.py), carried by the collator
            ref_chosen_logps, ref_rejected_logps = (inputs[name] for name in REFERENCE_COLUMNS)
        else:  # one forward without gradient: ref_model, or the policy with its adapter off (`reference_logps`)
            ref_chosen_logps, ref_rejected_logps = self.reference_logps(inputs).summed_logps(settings.ld_alpha).chunk(2)
        chosen_lengths, rejected_lengths = policy.lengths.chunk(2)
        pair_weights = policy.wpo_weights() if settings.use_weighting else None
        losses, chosen_rewards, rejected_rewards = dpo_loss(
            chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, settings, chosen_lengths=chosen_lengths,
            rejected_lengths=rejected_lengths, chosen_nll=-policy.logps.chunk(2)[0], pair_weights=pair_weights)
        loss = losses.mean()
        if policy.aux_loss is not None:
            loss = loss + self.router_aux_loss_coef * policy.aux_loss
        if not torch.isfinite(loss):
            safe_steps.raise_non_finite(self.state.global_step, loss, chosen_logps, rejected_logps, ref_chosen_logps,
                                        ref_rejected_logps)
        self.step_metrics.record(self.accelerator, self.state, "train" if self.model.training else "eval", policy,
                                 (chosen_logps, rejected_logps), (chosen_rewards, rejected_rewards),
                                 (ref_chosen_logps, ref_rejected_logps), inputs)
        if return_outputs:
            return loss, {"chosen_rewards": chosen_rewards, "rejected_rewards": rejected_rewards}
        return loss

    @torch.no_grad()
    def reference_logps(self, inputs: dict[str, torch.Tensor]) -> SequenceLogps:
        """Reference log-probs of a collated batch: a forward of the model `self.reference` names, chosen once by
        `reference.choose_reference` (ref_model, a copy, the policy with its adapter off, or a reference adapter)."""
        # The default (LoRA, no ref_model) is the policy itself under `model.disable_adapter()`, as reference.AdapterOff
        # enters it: no second copy of the weights.
        with self.reference.computing(self.model) as model:
            return sequence_logps(model, inputs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # Every micro-batch since the last log counts, not only the last one. In place: Trainer.evaluate returns logs.
        mode = "train" if self.model.training else "eval"
        prefix = "eval_" if mode == "eval" else ""
        logs.update({f"{prefix}{key}": value for key, value in self.step_metrics.averages(mode).items()})
        super().log(logs, start_time)
