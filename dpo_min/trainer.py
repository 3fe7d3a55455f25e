"""DPOMinTrainer: transformers.Trainer whose loss is DPO over one concatenated chosen+rejected forward."""

import contextlib
import logging
import os
import shutil
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from accelerate.utils import broadcast_object_list
from datasets import Dataset, IterableDataset
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import EvalPrediction, PreTrainedModel, Trainer, TrainerCallback, set_seed
from transformers.trainer_utils import rotate_checkpoints

from . import ref_cache, trainer_setup
from .collator import NON_MODEL_KEYS, REFERENCE_COLUMNS
from .compat import TRL_ITERABLE_REFUSAL, trl_hub_tags
from .config import DPOMinConfig
from .logps import SequenceLogps, computed_tokens, sequence_logps
from .losses import dpo_loss
from .reference import ModelReference, NoReference, SyncReferenceCallback, choose_reference
from .scale import sharding, zero
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
        self._metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self.eval_margins: list[float] = []  # each held-out pair's reward margin at the latest evaluation, in order
        self._pending_margins: list[torch.Tensor] = []  # ... gathered batch by batch until the evaluation logs
        if args.sync_ref_model:
            self.add_callback(SyncReferenceCallback(self.sync_reference))

    @property
    def aux_loss_enabled(self) -> bool:
        """TRL's: a mixture-of-experts model whose router load-balancing loss joins the loss."""
        return self.router_aux_loss_coef != 0.0

    @property
    def maybe_activation_offload_context(self) -> contextlib.AbstractContextManager:
        return OffloadActivations(self.model) if self.args.activation_offloading else contextlib.nullcontext()

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

    # ---- reference --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def reference_logps(self, inputs: dict[str, torch.Tensor]) -> SequenceLogps:
        """Reference log-probs of a collated batch."""
        with self.reference.computing(self.model) as model:
            return sequence_logps(model, inputs)

    def _with_reference_logps(self, dataset: Dataset, description: str) -> Dataset:
        """Add `ref_chosen_logps` / `ref_rejected_logps` columns: one reference pass over the data, up front."""
        if isinstance(dataset, IterableDataset):
            raise ValueError(TRL_ITERABLE_REFUSAL)
        if dataset is None or REFERENCE_COLUMNS[0] in dataset.column_names:
            return dataset
        if self.reference.fixed_before_training() and self.state.global_step > 0:
            raise ValueError(f"Cannot compute reference log-probs for a dataset passed to `evaluate()` after training "
                             f"has started (the {description} data): full fine-tuning without ref_model uses the "
                             "untrained model as reference; pass eval_dataset at construction or a ref_model")
        key = ref_cache.cache_key(self.reference.weights(self.model), dataset, self.reference.cache_settings(self.args))
        cached = ref_cache.load(key, len(dataset))
        if self.accelerator.num_processes > 1:  # all processes must take the same branch: the pass below gathers
            cached = broadcast_object_list([cached])[0]
        if cached is None:
            cached = self._reference_pass(dataset)
            if self.accelerator.is_main_process:
                ref_cache.save(key, *cached)
        for name, logps in zip(REFERENCE_COLUMNS, cached):
            dataset = dataset.add_column(name, logps.tolist())
        return dataset

    def _reference_pass(self, dataset: Dataset) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size = self.args.precompute_ref_batch_size or self.args.per_device_eval_batch_size
        loader = DataLoader(dataset, batch_size=batch_size, shuffle=False,
                            collate_fn=self.data_collator, num_workers=self.args.dataloader_num_workers)
        chosen, rejected = [], []
        was_training = self.model.training
        self.model.eval()
        if self.reference.model is None and self.is_deepspeed_enabled and self._precompute_engine is None \
                and self.model_wrapped is self.model:
            # Before train() builds the policy's engine: this one places the weights (and gathers ZeRO-3's shards).
            self._precompute_engine = zero.inference_engine(self.model, self.accelerator)
        loader = self.accelerator.prepare(loader)
        # The pass runs before the first step and can take minutes: a bar on the main process says how many.
        bar = tqdm(loader, desc="reference log-probs", unit="batch", leave=False,
                   disable=self.args.disable_tqdm or not self.is_local_process_zero())
        for batch in bar:
            ref = self.accelerator.gather_for_metrics(self._reference_sequence_logps(batch).chunk(2))
            chosen.append(ref[0].float().cpu())
            rejected.append(ref[1].float().cpu())
        self.model.train(was_training)
        return torch.cat(chosen), torch.cat(rejected)

    def _precompute_all(self) -> None:
        self.train_dataset = self._with_reference_logps(self.train_dataset, "train")
        if isinstance(self.eval_dataset, dict):
            self.eval_dataset = {name: self._with_reference_logps(data, name)
                                 for name, data in self.eval_dataset.items()}
        else:
            self.eval_dataset = self._with_reference_logps(self.eval_dataset, "eval")

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any):
        if self.args.precompute_ref_log_probs and resume_from_checkpoint:
            # Before Trainer loads the checkpoint's weights: the reference is the model as given, not as trained.
            self._precompute_all()
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def _tokenized_eval(self, dataset: Dataset) -> Dataset:
        return _tokenized(dataset, getattr(self.processing_class, "tokenizer", self.processing_class), self.args)

    def get_train_dataloader(self) -> DataLoader:
        if self.args.precompute_ref_log_probs:
            # The eval data too, now: for full fine-tuning the reference is the model before its first step.
            self._precompute_all()
        return super().get_train_dataloader()

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        if self.args.precompute_ref_log_probs:
            if isinstance(eval_dataset, str):
                eval_dataset = self.eval_dataset[eval_dataset]
            if eval_dataset is None:
                self._precompute_all()
            else:
                eval_dataset = self._with_reference_logps(self._tokenized_eval(eval_dataset), "eval")
        elif eval_dataset is not None and not isinstance(eval_dataset, str):
            eval_dataset = self._tokenized_eval(eval_dataset)
        return super().get_eval_dataloader(eval_dataset)

    # ---- loss ---------------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        settings = self.args.loss_settings
        offload = self.args.activation_offloading and model.training and torch.is_grad_enabled()
        with OffloadActivations(model) if offload else contextlib.nullcontext():
            policy = sequence_logps(model, inputs, with_sum_sq_probs=settings.use_weighting,
                                    with_aux_loss=self.aux_loss_enabled)
        # Each [2B] per-sequence value holds the B chosen completions, then the B rejected ones: chunk(2) splits it.
        chosen_logps, rejected_logps = policy.summed_logps(settings.ld_alpha).chunk(2)
        ref_chosen_logps, ref_rejected_logps = self._reference_sequence_logps(inputs).chunk(2) \
            if settings.reads_reference else (None, None)
        chosen_lengths, rejected_lengths = policy.lengths.chunk(2)
        pair_weights = policy.wpo_weights() if settings.use_weighting else None
        losses, chosen_rewards, rejected_rewards = dpo_loss(
            chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, settings, chosen_lengths=chosen_lengths,
            rejected_lengths=rejected_lengths, chosen_nll=-policy.logps.chunk(2)[0], pair_weights=pair_weights)
        loss = losses.mean()
        if policy.aux_loss is not None:
            loss = loss + self.router_aux_loss_coef * policy.aux_loss
        if not torch.isfinite(loss):
            self._raise_non_finite(loss, chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
        self._record_metrics(policy, (chosen_logps, rejected_logps), (chosen_rewards, rejected_rewards),
                             (ref_chosen_logps, ref_rejected_logps), inputs)
        if return_outputs:
            return loss, {"chosen_rewards": chosen_rewards, "rejected_rewards": rejected_rewards}
        return loss

    def _reference_sequence_logps(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """[2B] reference log-probs of a batch, chosen first: its precomputed columns, or one forward, LD-DPO
        weighted as the policy's."""
        if REFERENCE_COLUMNS[0] in inputs:
            return torch.cat([inputs[name] for name in REFERENCE_COLUMNS])
        return self.reference_logps(inputs).summed_logps(self.args.ld_alpha)

    def _record_metrics(self, policy: SequenceLogps, logps: tuple, rewards: tuple, reference: tuple,
                        inputs: dict[str, torch.Tensor]) -> None:
        """`logps`, `rewards`, `reference`: (chosen, rejected) [B] halves; the reference's are None without one."""
        mode = "train" if self.model.training else "eval"
        chosen_logps, rejected_logps = logps[0].detach(), logps[1].detach()
        per_pair = {"chosen_rewards": rewards[0], "rejected_rewards": rewards[1], "chosen_logps": chosen_logps,
                    "rejected_logps": rejected_logps, **policy.metric_halves()}
        if reference[0] is not None:
            per_pair |= {"chosen_drift": chosen_logps - reference[0], "rejected_drift": rejected_logps - reference[1]}
        # Only per-pair [B] tensors go through gather_for_metrics: it trims the last batch to the dataset's length.
        pairs = self.accelerator.gather_for_metrics(per_pair)
        metrics = self._metrics[mode]
        tokens = pairs["chosen_lengths"].sum() + pairs["rejected_lengths"].sum()
        # TRL's definitions: entropy over every completion token; token accuracy (argmax = label) over the chosen
        # ones; num_tokens the running count of training tokens computed, padding excluded.
        metrics["entropy"].append(((pairs["chosen_entropy"].sum() + pairs["rejected_entropy"].sum()) / tokens).item())
        metrics["mean_token_accuracy"].append((pairs["chosen_top1"].sum() / pairs["chosen_lengths"].sum()).item())
        # Kept in the trainer state, which every checkpoint saves and a resume loads, so a resumed run counts on (TRL's
        # GRPO uses state.num_input_tokens_seen, which Trainer itself adds to under include_num_input_tokens_seen).
        count = self.state.stateful_callbacks.setdefault("dpo_min", {"num_tokens": 0})
        if mode == "train":
            count["num_tokens"] += int(self.accelerator.gather(computed_tokens(inputs)).sum())
        metrics["num_tokens"] = [count["num_tokens"]]
        if policy.aux_loss is not None:
            metrics["aux_loss"].append(self.accelerator.gather_for_metrics(policy.aux_loss.detach()).mean().item())
        chosen, rejected = pairs["chosen_rewards"], pairs["rejected_rewards"]
        if mode == "eval":
            self._pending_margins.append((chosen - rejected).float().cpu())
        metrics["rewards/chosen"].append(chosen.mean().item())
        metrics["rewards/rejected"].append(rejected.mean().item())
        metrics["rewards/accuracies"].append((chosen > rejected).float().mean().item())
        metrics["rewards/margins"].append((chosen - rejected).mean().item())
        for half in ("chosen", "rejected"):
            metrics[f"logps/{half}"].append(pairs[f"{half}_logps"].mean().item())
        for half in ("chosen", "rejected"):  # mean logit over completion tokens, token-weighted across the batch (TRL)
            metrics[f"logits/{half}"].append((pairs[f"{half}_logits"].sum() / pairs[f"{half}_lengths"].sum()).item())
        for half in ("chosen", "rejected") if reference[0] is not None else ():
            # Drift from the reference: mean policy - reference log-ratio per completion token, token-weighted. A
            # model that collapses can still rank pairs "right"; this shows how far it went to do so.
            metrics[f"drift/{half}"].append((pairs[f"{half}_drift"].sum() / pairs[f"{half}_lengths"].sum()).item())

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
        # Every micro-batch since the last log counts, not only the last one.
        mode = "train" if self.model.training else "eval"
        prefix = "eval_" if mode == "eval" else ""
        # In place: Trainer.evaluate returns this very dict.
        logs.update({f"{prefix}{key}": sum(values) / len(values)
                     for key, values in self._metrics[mode].items() if values})
        self._metrics[mode].clear()
        if mode == "eval" and self._pending_margins:
            self.eval_margins, self._pending_margins = torch.cat(self._pending_margins).tolist(), []
        super().log(logs, start_time)

    # ---- faults and checkpoints -----------------------------------------------------------------------------------
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
