"""DPOMinTrainer: transformers.Trainer whose loss is DPO over one concatenated chosen+rejected forward.

`compute_loss` is the design card: one policy forward, the reference's log-probs, `.chunk(2)` into chosen and
rejected, `dpo_loss`. What the default run does not need lives beside: precompute.py (`precompute_ref_log_probs`),
metrics.py (TRL's metrics), safe_steps.py (non-finite checks, staged checkpoints), trainer_setup.py (the phases of
the constructor), reference.py (which reference, decided once).
"""

import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from datasets import Dataset, IterableDataset
from torch.utils.data import DataLoader
from transformers import EvalPrediction, PreTrainedModel, Trainer, TrainerCallback, set_seed

from . import precompute, safe_steps, trainer_setup
from .collator import NON_MODEL_KEYS, REFERENCE_COLUMNS
from .compat import trl_hub_tags
from .config import DPOMinConfig
from .logps import SequenceLogps, sequence_logps
from .losses import dpo_loss
from .metrics import StepMetrics
from .reference import ModelReference, NoReference, SyncReferenceCallback, choose_reference
from .scale.offload import OffloadActivations
from .tokenizing import is_tokenized, tokenize_dataset

logger = logging.getLogger(__name__)


def _tokenized(dataset: Any, tokenizer: Any, args: DPOMinConfig) -> Any:
    """Raw rows -> tokenized pairs, with the config's truncation; None and tokenized data pass through."""
    if isinstance(dataset, dict):
        return {name: _tokenized(split, tokenizer, args) for name, split in dataset.items()}
    if dataset is None or is_tokenized(dataset):
        return dataset
    # The main process tokenizes first; the others then read its datasets cache instead of tokenizing again.
    with args.main_process_first(desc="tokenizing the pairs"), \
            trainer_setup.datasets_progress_bars(not args.disable_tqdm and args.local_process_index == 0):
        return tokenize_dataset(dataset, tokenizer, args.max_length, args.max_prompt_length, args.truncation_mode,
                                num_proc=args.dataset_num_proc, chat_template_kwargs=args.chat_template_kwargs)


class DPOMinTrainer(Trainer):
    """Direct Preference Optimization on `transformers.Trainer`; the constructor is TRL 1.16 `DPOTrainer`'s (see
    README, "Coming from TRL"). Which reference applies is decided once, in `reference.choose_reference`;
    `precompute_ref_log_probs=True` computes its log-probs once, up front (cached on disk)."""

    # TRL DPOTrainer's public attributes that scripts read, with TRL's meaning: read from args each time, not copied.
    beta = property(lambda self: self.args.beta)
    loss_types = property(lambda self: self.args.loss_type)
    loss_weights = property(lambda self: self.args.loss_weights or [1.0] * len(self.args.loss_type))
    label_smoothing = property(lambda self: self.args.label_smoothing)
    ld_alpha = property(lambda self: self.args.ld_alpha)
    use_weighting = property(lambda self: self.args.use_weighting)
    f_divergence_type = property(lambda self: self.args.f_divergence_type)
    f_alpha_divergence_coef = property(lambda self: self.args.f_alpha_divergence_coef)
    precompute_ref_logps = property(lambda self: self.args.precompute_ref_log_probs)
    padding_free = property(lambda self: self.args.padding_free)

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
                         train_dataset=_tokenized(train_dataset, tokenizer, args),
                         eval_dataset=_tokenized(eval_dataset, tokenizer, args), processing_class=processing_class,
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
    def eval_margins(self) -> list[float]:
        """Each held-out pair's reward margin at the latest evaluation, in order."""
        return self.step_metrics.eval_margins

    @property
    def aux_loss_enabled(self) -> bool:
        """TRL's: a mixture-of-experts model whose router load-balancing loss joins the loss."""
        return self.router_aux_loss_coef != 0.0

    @property
    def maybe_activation_offload_context(self) -> contextlib.AbstractContextManager:
        """TRL's attribute, and what `compute_loss` runs the policy's forward in: activation offloading while training
        with gradients, when `activation_offloading`."""
        offload = self.args.activation_offloading and self.model.training and torch.is_grad_enabled()
        return OffloadActivations(self.model) if offload else contextlib.nullcontext()

    @property
    def ref_model(self) -> torch.nn.Module | None:
        """The separate reference model (prepared for the run), or None: TRL's attribute."""
        return self.reference.model

    @ref_model.setter
    def ref_model(self, model: torch.nn.Module | None) -> None:
        self.reference = NoReference() if model is None else ModelReference(model)

    @property
    def ref_adapter_name(self) -> str | None:
        """The reference adapter of a PEFT model, or None (the adapter disabled, or no adapter reference)."""
        return self.reference.adapter

    def sync_reference(self) -> None:
        """TR-DPO: reference <- alpha * policy + (1 - alpha) * reference, for a reference model or adapter."""
        self.reference.sync(self.model, self.args.ref_model_mixup_alpha)

    # ---- the precompute pass (precompute.py), before the first step ------------------------------------------
    def precompute_reference(self, eval_dataset: Any = None) -> Any:
        """The precompute pass's one entry point: the train and eval datasets, and `eval_dataset` when given (returned),
        gain the reference's log-probs (once each; cached on disk). A no-op without `precompute_ref_log_probs`."""
        if not self.args.precompute_ref_log_probs:
            return eval_dataset
        if eval_dataset is not None:
            return precompute.with_reference_logps(self, self._tokenized_eval(eval_dataset), "eval")
        self.train_dataset = precompute.with_reference_logps(self, self.train_dataset, "train")
        if isinstance(self.eval_dataset, dict):
            self.eval_dataset = {name: precompute.with_reference_logps(self, data, name)
                                 for name, data in self.eval_dataset.items()}
        else:
            self.eval_dataset = precompute.with_reference_logps(self, self.eval_dataset, "eval")
        return None

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any):
        if resume_from_checkpoint:
            # Before Trainer loads the checkpoint's weights: the reference is the model as given, not as trained.
            self.precompute_reference()
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def _tokenized_eval(self, dataset: Dataset) -> Dataset:
        return _tokenized(dataset, getattr(self.processing_class, "tokenizer", self.processing_class), self.args)

    def get_train_dataloader(self) -> DataLoader:
        # The eval data too, now: for full fine-tuning the reference is the model before its first step.
        self.precompute_reference()
        return super().get_train_dataloader()

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        if isinstance(eval_dataset, str) and self.args.precompute_ref_log_probs:
            eval_dataset = self.eval_dataset[eval_dataset]
        if eval_dataset is None:
            self.precompute_reference()
        elif self.args.precompute_ref_log_probs:
            eval_dataset = self.precompute_reference(eval_dataset)
        elif not isinstance(eval_dataset, str):
            eval_dataset = self._tokenized_eval(eval_dataset)
        return super().get_eval_dataloader(eval_dataset)

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
        with self.reference.computing(self.model) as model:
            return sequence_logps(model, inputs)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The loss; with `compute_metrics`, also what TRL 1.16 passes it: the logits of a plain forward of the
        [2B, T] batch (chosen rows, then rejected) as predictions, and its `input_ids` as label_ids."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs).detach()
            if prediction_loss_only or self.compute_metrics is None:
                return loss, None, None
            model_inputs = {name: value for name, value in inputs.items() if name not in NON_MODEL_KEYS}
            logits = model(**model_inputs, use_cache=False).logits
        return loss, logits, inputs["input_ids"]

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

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # Every micro-batch since the last log counts, not only the last one. In place: Trainer.evaluate returns logs.
        mode = "train" if self.model.training else "eval"
        prefix = "eval_" if mode == "eval" else ""
        logs.update({f"{prefix}{key}": value for key, value in self.step_metrics.averages(mode).items()})
        super().log(logs, start_time)

    # ---- Trainer's hooks for faults and checkpoints (safe_steps.py) ----------------------------------------------
    def _check_finite_gradients(self, model) -> None:
        safe_steps.check_finite_gradients(model, self.accelerator, self.state.global_step)

    def _clip_grad_norm(self, model):
        self._check_finite_gradients(model)
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:  # no clipping this run: the check has not happened yet
            self._check_finite_gradients(model)
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        super()._save(output_dir, state_dict=safe_steps.whole_state_dict(self.model, state_dict))

    def _save_checkpoint(self, model, trial):
        save = super()._save_checkpoint
        safe_steps.save_checkpoint_staged(self, trial, lambda: save(model, trial))
