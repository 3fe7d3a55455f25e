"""DPOMinTrainer: transformers.Trainer whose loss is DPO over one concatenated chosen+rejected forward.

`compute_loss` is the design card: one policy forward (`sequence_logps`, logps.py), the reference's log-probs,
`.chunk(2)` into chosen and rejected, and DPO's loss as the paper writes it, `-F.logsigmoid(beta * logits)` of the
log-ratios' difference; any other loss type (or label smoothing, f-DPO, WPO, CPO's term) goes through the loss table,
`dpo_loss` (losses.py). The reference's forward runs in `reference_model`, the one context manager of the reference
`choose_reference` (reference.py) decided at construction. Every `Trainer` method this class overrides is written in
its body; a default run also calls Trainer's own (`training_step`, `evaluate`, `save_model`, ...). What a default
run never calls lives beside, each named where it is called: trl_surface.py (TRL's attributes and card, a base of the
class), precompute.py (`precompute_ref_log_probs`), collator_packed.py (the packed layouts), losses.py and
loss_family.py (the loss table). The constructor's phases are trainer_setup.py's.
"""

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from accelerate.utils import extract_model_from_parallel
from datasets import Dataset, IterableDataset
from torch.utils.data import DataLoader
from transformers import EvalPrediction, PreTrainedModel, Trainer, TrainerCallback, set_seed

from . import checkpoints, grouping, precompute, trainer_setup
from .collator import NON_MODEL_KEYS, REFERENCE_COLUMNS
from .compat import trl_hub_tags
from .config import DPOMinConfig
from .logps import SequenceLogps, sequence_logps
from .losses import LossSettings, dpo_loss
from .metrics import StepMetrics
from .reference import SyncReferenceCallback, choose_reference
from .scale.offload import OffloadActivations
from .trl_surface import TRLSurface

logger = logging.getLogger(__name__)


class DPOMinTrainer(TRLSurface, Trainer):
    """Direct Preference Optimization on `transformers.Trainer`; the constructor is TRL 1.16 `DPOTrainer`'s (see
    README, "Coming from TRL"). Which reference applies is decided once, in `reference.choose_reference`;
    `precompute_ref_log_probs=True` computes its log-probs once, up front (cached on disk).

    The `Trainer` methods it overrides, all in this body: `compute_loss` and `prediction_step` (the loss of a batch,
    training and evaluating), `evaluation_loop` and `log` (the metrics, means over every pair since the last log or
    over an evaluation's pairs), `train`,
    `get_train_dataloader`, `get_eval_dataloader` and `get_test_dataloader` (a dataset passed to `evaluate` or
    `predict` tokenized; the precompute pass, when asked for; plackett_luce's batches of whole groups),
    `_get_train_sampler` (group_by_prompt's order, grouping.py), `_clip_grad_norm` and
    `_get_grad_norm` (a non-finite gradient stops the run), `_save_checkpoint` and `_save` (each checkpoint staged,
    then renamed; a sharded model saved whole); and `args`, where the loss's settings are read when the trainer is
    given a config. A default run also calls methods it inherits as they are: `training_step`,
    `evaluate`, `save_model` and the rest of Trainer's loop. Its base `TRLSurface` (trl_surface.py) overrides two
    more that a default run never calls: `_set_signature_columns_if_needed` (`remove_unused_columns=True`) and
    `create_model_card` (a push)."""

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
        args.read_loss_settings()  # before the reference is chosen by them
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
                         train_dataset=trainer_setup.tokenized(train_dataset, tokenizer, args, model),
                         eval_dataset=trainer_setup.tokenized(eval_dataset, tokenizer, args, model),
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
    def args(self) -> DPOMinConfig:
        """The config, as Trainer keeps it (`vars(trainer)` lists it, as TRL's)."""
        return self.__dict__["args"]

    @args.setter
    def args(self, args: DPOMinConfig) -> None:
        # Given by Trainer.__init__, or by a script that assigns another config (TRL's trainer reads its attributes
        # once; a script changes the loss by giving another config): the loss's settings, and what a step asks of
        # them as plain values, set here. (Trainer's hyperparameter search, which edits `args` in place, needs a
        # `model_init`, which this constructor does not take.)
        self.__dict__["args"] = args
        self.loss_settings: LossSettings = args.read_loss_settings()
        self.reads_reference = self.loss_settings.reads_reference  # whether a step runs the reference
        self.dpo_alone = self.loss_settings.dpo_alone  # whether the loss is DPO's alone (the default), written out

    @property
    def aux_loss_enabled(self) -> bool:
        """TRL's attribute: a mixture-of-experts model whose router load-balancing loss joins the loss."""
        return self.router_aux_loss_coef != 0.0

    @property
    def eval_margins(self) -> list[float]:
        """Each held-out pair's reward margin at the latest evaluation, in order."""
        return self.step_metrics.eval_margins

    @property
    def maybe_activation_offload_context(self) -> contextlib.AbstractContextManager:
        """TRL's attribute, and what `compute_loss` runs the policy's forward in: activation offloading while training
        with gradients, when `activation_offloading`."""
        offload = self.args.activation_offloading and self.model.training and torch.is_grad_enabled()
        return OffloadActivations(self.model) if offload else contextlib.nullcontext()

    # ---- loss ---------------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        settings = self.loss_settings
        with self.maybe_activation_offload_context:
            policy = sequence_logps(model, inputs, with_sum_sq_probs=settings.use_weighting,
                                    with_aux_loss=self.aux_loss_enabled)
        # [2B] per-sequence values: the B chosen completions, then the B rejected ones (collator.py); chunk(2) splits.
        logps = policy.summed_logps(settings.ld_alpha)
        chosen_logps, rejected_logps = logps.chunk(2)
        if not self.reads_reference:  # reference_free, or a loss of the policy alone: no reference at all
            ref_chosen_logps = ref_rejected_logps = None
        elif REFERENCE_COLUMNS[0] in inputs:  # precomputed once, up front (precompute.py), carried by the collator
            ref_chosen_logps, ref_rejected_logps = (inputs[name] for name in REFERENCE_COLUMNS)
        else:  # one forward without gradient, in `reference_model`
            ref_chosen_logps, ref_rejected_logps = self.reference_logps(inputs).summed_logps(settings.ld_alpha).chunk(2)
        if self.dpo_alone:  # the default: DPO, arXiv 2305.18290, eq. 7; the implicit rewards are beta * log-ratios
            beta = settings.beta
            chosen_logratios, rejected_logratios = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
            logits = chosen_logratios - rejected_logratios
            losses = -F.logsigmoid(beta * logits)
            chosen_rewards, rejected_rewards = beta * chosen_logratios.detach(), beta * rejected_logratios.detach()
        else:  # any other loss type, label smoothing, f-DPO, WPO, CPO's term, plackett_luce: the loss table (losses.py)
            chosen_lengths, rejected_lengths = policy.lengths.chunk(2)
            # plackett_luce's groups, as the grouped layout ranks them (collator_groups.py); one loss per group
            groups = (inputs["group_ranking"], inputs["group_sizes"]) if "group_ranking" in inputs else None
            losses, chosen_rewards, rejected_rewards = dpo_loss(
                chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, settings,
                chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths, chosen_nll=-policy.logps.chunk(2)[0],
                pair_weights=policy.wpo_weights() if settings.use_weighting else None, groups=groups)
        if policy.aux_loss is not None:  # each pair's (group's) loss carries its forward's router term
            losses = losses + self.router_aux_loss_coef * policy.aux_loss
        loss = losses.mean()
        if not torch.isfinite(loss):
            _raise_non_finite(self.state.global_step, loss, chosen_logps, rejected_logps, ref_chosen_logps,
                              ref_rejected_logps)
        self.step_metrics.record(self.accelerator, self.state, "train" if self.model.training else "eval", policy,
                                 (chosen_logps, rejected_logps), (chosen_rewards, rejected_rewards),
                                 (ref_chosen_logps, ref_rejected_logps), inputs, losses)
        if return_outputs:
            return loss, {"chosen_rewards": chosen_rewards, "rejected_rewards": rejected_rewards}
        return loss

    def reference_logps(self, inputs: dict[str, torch.Tensor]) -> SequenceLogps:
        """Reference log-probs of a collated batch: a forward of the model `reference_model` gives."""
        with torch.no_grad(), self.reference_model() as model:
            return sequence_logps(model, inputs)

    @contextlib.contextmanager
    def reference_model(self, policy: torch.nn.Module | None = None) -> Iterator[torch.nn.Module]:
        """The module whose forward is pi_ref for the block, by the kind of `self.reference` (a reference_mode word,
        decided once by `reference.choose_reference`); `policy` is the trained model (default `self.model`)."""
        policy, reference = self.model if policy is None else policy, self.reference
        match reference.kind:
            case "ref_model":  # a separate frozen model, given
                yield reference.model
            case "policy_at_start":  # a frozen copy made at construction; precomputed, the policy before its first step
                yield policy if reference.before_first_step else reference.model
            case "adapter_off":  # the default with LoRA: no second copy of the weights (torchtune's)
                with extract_model_from_parallel(policy).disable_adapter():
                    yield policy
            case "adapter_at_start":  # another adapter of the policy, frozen, active for the block
                peft_model = extract_model_from_parallel(policy)
                active = peft_model.active_adapter
                peft_model.set_adapter(reference.adapter, inference_mode=True)
                try:
                    yield policy
                finally:
                    peft_model.set_adapter(active)
            case None:
                raise ValueError("this loss reads no reference log-probs")

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

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        # The loss is ours, the mean over pairs (groups): Trainer's repeats each batch's mean eval_batch_size times, a
        # mean of batch means once a batch is short (whole groups; a process's last batch, padded with another's).
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        metrics = self.step_metrics.averages("eval", margins=description == "Evaluation")
        if "loss" in metrics:
            output.metrics[f"{metric_key_prefix}_loss"] = metrics.pop("loss")
        # The others under TRL's names (eval_rewards/..., whichever held-out set); predict()'s, which logs none, too.
        prefix = "eval" if description == "Evaluation" else metric_key_prefix
        output.metrics.update({f"{prefix}_{key}": value for key, value in metrics.items()})
        return output

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # Every pair since the last log counts, not only the last batch's (an evaluation's come with its loop's output,
        # `evaluation_loop`). In place: Trainer.evaluate returns logs.
        mode = "train" if self.model.training else "eval"
        prefix = "eval_" if mode == "eval" else ""
        logs.update({f"{prefix}{key}": value for key, value in self.step_metrics.averages(mode).items()})
        super().log(logs, start_time)

    # ---- the precompute pass (precompute.py): before the first step, only with precompute_ref_log_probs ----------
    def precompute_reference(self, eval_dataset: Any = None, method: str = "evaluate") -> Any:
        """The precompute pass's one entry point: the train and eval datasets, and `eval_dataset` when given (returned),
        gain the reference's log-probs (once each; cached on disk). A no-op without `precompute_ref_log_probs`.
        `method` names the call that passed `eval_dataset` ("evaluate" or "predict") in a refusal."""
        if not self.args.precompute_ref_log_probs:
            return eval_dataset
        return precompute.precompute_reference(self, None if eval_dataset is None else self._tokenized(eval_dataset),
                                               method)

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any):
        if resume_from_checkpoint:
            # Before Trainer loads the checkpoint's weights: the reference is the model as given, not as trained.
            self.precompute_reference()
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def get_train_dataloader(self) -> DataLoader:
        # The eval data too, now: for full fine-tuning the reference is the model before its first step.
        self.precompute_reference()
        # plackett_luce reads whole groups: per_device_train_batch_size groups a batch (it needs group_by_prompt)
        if self.args.group_by_prompt and self.args.listwise:
            shuffle = self.args.train_sampling_strategy == "random"
            return grouping.whole_group_loader(self, self.train_dataset, self.args.per_device_train_batch_size,
                                               shuffle)
        return super().get_train_dataloader()

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        # group_by_prompt: a prompt's pairs together, the groups shuffled (grouping.py); a stream keeps its order.
        dataset = self.train_dataset if train_dataset is None else train_dataset
        if self.args.group_by_prompt and isinstance(dataset, Dataset):
            shuffle = self.args.train_sampling_strategy == "random"
            return grouping.GroupedSampler(grouping.dataset_groups(dataset), grouping.data_seed(self.args), shuffle)
        return super()._get_train_sampler(train_dataset)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        if isinstance(eval_dataset, str) and self.args.precompute_ref_log_probs:
            eval_dataset = self.eval_dataset[eval_dataset]
        if eval_dataset is None:
            self.precompute_reference()
        elif not isinstance(eval_dataset, str):
            eval_dataset = self._passed(eval_dataset, "evaluate")
        if self.args.group_by_prompt and self.args.listwise:  # whole groups, in the order of their first pairs
            data = self.eval_dataset if eval_dataset is None else eval_dataset
            data = self.eval_dataset[data] if isinstance(data, str) else data
            return grouping.whole_group_loader(self, data, self.args.per_device_eval_batch_size, False)
        return super().get_eval_dataloader(eval_dataset)

    def get_test_dataloader(self, test_dataset: Any) -> DataLoader:
        # predict() reads its pairs as evaluate() does; Trainer's would give raw rows to the collator, and precomputed
        # ones no reference log-probs (the policy then scored against itself: ln 2 after any training).
        test_dataset = self._passed(test_dataset, "predict")
        if self.args.group_by_prompt and self.args.listwise:  # whole groups, as evaluate() reads them
            return grouping.whole_group_loader(self, test_dataset, self.args.per_device_eval_batch_size, False)
        return super().get_test_dataloader(test_dataset)

    def _passed(self, dataset: Any, method: str) -> Any:
        """A dataset passed to `evaluate()` or `predict()`: tokenized as the constructor tokenizes its own, and under
        `precompute_ref_log_probs` with the reference's log-probs (refused where they can no longer be computed)."""
        if self.args.precompute_ref_log_probs:
            return self.precompute_reference(dataset, method)
        return self._tokenized(dataset)

    def _tokenized(self, dataset: Dataset) -> Dataset:
        """A dataset passed to `evaluate()` or `predict()`, tokenized as the constructor tokenizes its own."""
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        return trainer_setup.tokenized(dataset, tokenizer, self.args, self.model)

    # ---- faults stop the run: a non-finite gradient, before the optimizer step -----------------------------------
    def _clip_grad_norm(self, model):
        self._check_finite_gradients(model)  # before clipping, which would smear one non-finite gradient over all
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:  # no clipping this run: the check has not happened yet
            self._check_finite_gradients(model)
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def _check_finite_gradients(self, model) -> None:
        if self.accelerator.scaler is not None:  # fp16's loss scaler expects overflowing steps and skips them
            return
        grads = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
        if grads and not torch.stack([torch.isfinite(g).all() for _, g in grads]).all():
            culprit = next(name for name, g in grads if not torch.isfinite(g).all())
            raise FloatingPointError(f"step {self.state.global_step + 1}: non-finite gradient in {culprit}; "
                                     "training stopped before the optimizer step, earlier checkpoints kept")

    # ---- checkpoints are all-or-nothing (checkpoints.py) ---------------------------------------------------------
    def _save_checkpoint(self, model, trial):
        if trial is not None:  # hyperparameter search keeps Trainer's own layout
            return super()._save_checkpoint(model, trial)
        checkpoints.save_whole(self)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        super()._save(output_dir, state_dict=checkpoints.whole_state_dict(self.model, state_dict))


def _raise_non_finite(step: int, loss: torch.Tensor, *logps: torch.Tensor | None) -> None:
    """Stop on a non-finite loss, naming the step and the first non-finite of the four log-probs."""
    names = ("policy chosen logps", "policy rejected logps", "reference chosen logps", "reference rejected logps")
    culprit = next((name for name, value in zip(names, logps)
                    if value is not None and not torch.isfinite(value).all()), "loss")
    raise FloatingPointError(f"step {step + 1}: the DPO loss is {loss.item()} "
                             f"(first non-finite quantity: {culprit}); training stopped, earlier checkpoints kept")
