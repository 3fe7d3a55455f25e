"""DPOMinTrainer: transformers.Trainer whose loss is DPO over one concatenated chosen+rejected forward."""

import contextlib
import copy
from collections import defaultdict
from typing import Any

import torch
from datasets import Dataset
from torch.utils.data import DataLoader
from transformers import PreTrainedModel, Trainer, set_seed

from .attention import SEGMENTED_SDPA, use_segmented_attention
from .collator import make_collator
from .config import DPOMinConfig
from .data import is_tokenized, tokenize_dataset
from .logps import SequenceLogps, sequence_logps
from .losses import dpo_loss

try:
    from peft import PeftConfig, PeftModel, get_peft_model
except ImportError:  # peft is a dependency, but keep the full fine-tuning path importable without it
    PeftConfig = PeftModel = get_peft_model = None

REF_ADAPTER = "ref"
# Attention implementations that build the block-diagonal mask from position_ids and take a 4D additive mask.
PACKED_ATTENTION = ("sdpa", "eager", SEGMENTED_SDPA)


def _is_peft(model: Any) -> bool:
    return PeftModel is not None and isinstance(model, PeftModel)


def _check_layout(model_config: Any, args: DPOMinConfig) -> None:
    if not (args.padding_free or args.share_prompt):
        return
    attention = getattr(model_config, "_attn_implementation", None)
    if attention not in PACKED_ATTENTION:
        raise ValueError(f"padding_free and share_prompt need attention in {PACKED_ATTENTION} (the ones tested to "
                         f"keep packed sequences apart), got {attention!r}")
    layer_types = getattr(model_config, "layer_types", None) or ["sliding_attention"]
    if args.share_prompt and getattr(model_config, "sliding_window", None) and "sliding_attention" in layer_types:
        raise ValueError("share_prompt's 4D attention mask has no sliding window, and this model uses one "
                         f"(sliding_window={model_config.sliding_window})")


class DPOMinTrainer(Trainer):
    """Direct Preference Optimization on `transformers.Trainer`.

    The reference is, in this order of preference: the same PEFT model with its adapter disabled (or, for a
    PeftModel that arrives with a trained adapter, a frozen copy of that adapter); `ref_model`; precomputed
    log-probs (`precompute_ref_log_probs=True`); otherwise a frozen copy of `model` made here.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        args: DPOMinConfig | None = None,
        train_dataset: Dataset | None = None,
        eval_dataset: Dataset | dict[str, Dataset] | None = None,
        processing_class: Any = None,
        ref_model: PreTrainedModel | None = None,
        peft_config: "PeftConfig | None" = None,
        data_collator: Any = None,
        **kwargs: Any,
    ):
        args = args if args is not None else DPOMinConfig(output_dir="dpo_min_output")
        if not isinstance(args, DPOMinConfig):
            raise TypeError(f"args must be a DPOMinConfig, got {type(args).__name__}")
        if train_dataset is None:
            raise ValueError("train_dataset is required")
        if processing_class is None:
            raise ValueError("processing_class (the tokenizer) is required to tokenize the pairs")
        if ref_model is not None and ref_model is model:
            raise ValueError("ref_model must be another object than model (omit it to get a frozen copy)")
        _check_layout(model.config, args)
        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        if tokenizer.pad_token is None:
            # Padding never reaches the loss (labels are -100 there), so any token id serves; EOS is the usual one.
            tokenizer.pad_token = tokenizer.eos_token

        # The adapter's random init must depend on the seed alone, as in TRL.
        set_seed(args.seed)
        self.ref_adapter_name: str | None = None
        if peft_config is not None:
            if _is_peft(model):
                raise ValueError("pass either a PeftModel or a peft_config, not both")
            model = get_peft_model(model, peft_config)
        elif _is_peft(model) and ref_model is None:
            # An adapter may arrive already trained: the reference is that adapter as it starts, kept frozen.
            self.ref_adapter_name = REF_ADAPTER
            active = model.active_adapter
            model.add_adapter(REF_ADAPTER, model.peft_config[active])
            for name, param in model.named_parameters():
                if f".{active}." in name:
                    model.get_parameter(name.replace(f".{active}.", f".{REF_ADAPTER}.")).data.copy_(param.data)
            model.set_adapter(active)

        if ref_model is None and not _is_peft(model) and not args.precompute_ref_log_probs:
            ref_model = copy.deepcopy(model)
        if ref_model is not None:
            ref_model.eval().requires_grad_(False)
        if args.padding_free:
            for module in [model] + ([ref_model] if ref_model is not None else []):
                use_segmented_attention(module)
        if args.disable_dropout:
            for module in [model] + ([ref_model] if ref_model is not None else []):
                for submodule in module.modules():
                    if isinstance(submodule, torch.nn.Dropout):
                        submodule.p = 0.0

        def prepare(dataset: Any) -> Any:
            if dataset is None or is_tokenized(dataset):
                return dataset
            return tokenize_dataset(dataset, tokenizer, args.max_length, args.max_prompt_length, args.truncation_mode)

        train_dataset = prepare(train_dataset)
        if isinstance(eval_dataset, dict):
            eval_dataset = {name: prepare(dataset) for name, dataset in eval_dataset.items()}
        else:
            eval_dataset = prepare(eval_dataset)
        data_collator = data_collator or make_collator(tokenizer.pad_token_id, args.padding_free, args.share_prompt)

        super().__init__(model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, data_collator=data_collator, **kwargs)
        # The loss is a mean over pairs; Trainer must divide it by the accumulation steps itself.
        self.model_accepts_loss_kwargs = False
        self.ref_model = None if ref_model is None else self.accelerator.prepare_model(ref_model, evaluation_mode=True)
        self._metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}

    # ---- reference --------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _reference_context(self):
        """Make `self.model` compute the reference: adapter disabled, or the frozen reference adapter active."""
        unwrapped = self.accelerator.unwrap_model(self.model)
        if not _is_peft(unwrapped):
            yield
        elif self.ref_adapter_name is None:
            with unwrapped.disable_adapter():
                yield
        else:
            active = unwrapped.active_adapter
            unwrapped.set_adapter(self.ref_adapter_name)
            try:
                yield
            finally:
                unwrapped.set_adapter(active)

    @torch.no_grad()
    def reference_logps(self, inputs: dict[str, torch.Tensor]) -> SequenceLogps:
        """Reference log-probs of a collated batch."""
        if self.ref_model is not None:
            return sequence_logps(self.ref_model, inputs)
        with self._reference_context():
            return sequence_logps(self.model, inputs)

    def _with_reference_logps(self, dataset: Dataset, description: str) -> Dataset:
        """Add `ref_chosen_logps` / `ref_rejected_logps` columns: one reference pass over the data, up front."""
        if dataset is None or "ref_chosen_logps" in dataset.column_names:
            return dataset
        if self.ref_model is None and not _is_peft(self.accelerator.unwrap_model(self.model)) \
                and self.state.global_step > 0:
            raise ValueError(f"cannot precompute reference log-probs for the {description} data after training "
                             "started: full fine-tuning without ref_model uses the untrained model as reference. "
                             "Pass eval_dataset at construction or a ref_model.")
        loader = DataLoader(dataset, batch_size=self.args.per_device_eval_batch_size, shuffle=False,
                            collate_fn=self.data_collator, num_workers=self.args.dataloader_num_workers)
        chosen, rejected = [], []
        was_training = self.model.training
        self.model.eval()
        for batch in self.accelerator.prepare(loader):
            ref = self.reference_logps(batch).logps.chunk(2)
            ref = self.accelerator.gather_for_metrics(ref)
            chosen.append(ref[0].float().cpu())
            rejected.append(ref[1].float().cpu())
        self.model.train(was_training)
        dataset = dataset.add_column("ref_chosen_logps", torch.cat(chosen).tolist())
        return dataset.add_column("ref_rejected_logps", torch.cat(rejected).tolist())

    def _precompute_all(self) -> None:
        self.train_dataset = self._with_reference_logps(self.train_dataset, "train")
        if isinstance(self.eval_dataset, dict):
            self.eval_dataset = {name: self._with_reference_logps(data, name) for name, data in self.eval_dataset.items()}
        else:
            self.eval_dataset = self._with_reference_logps(self.eval_dataset, "eval")

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
                eval_dataset = self._with_reference_logps(self._tokenized(eval_dataset), "eval")
        elif eval_dataset is not None and not isinstance(eval_dataset, str):
            eval_dataset = self._tokenized(eval_dataset)
        return super().get_eval_dataloader(eval_dataset)

    def _tokenized(self, dataset: Dataset) -> Dataset:
        if is_tokenized(dataset):
            return dataset
        args, tokenizer = self.args, getattr(self.processing_class, "tokenizer", self.processing_class)
        return tokenize_dataset(dataset, tokenizer, args.max_length, args.max_prompt_length, args.truncation_mode)

    # ---- loss ---------------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        policy = sequence_logps(model, inputs)
        chosen_logps, rejected_logps = policy.logps.chunk(2)
        if "ref_chosen_logps" in inputs:
            ref_chosen_logps, ref_rejected_logps = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
        else:
            ref_chosen_logps, ref_rejected_logps = self.reference_logps(inputs).logps.chunk(2)
        losses, chosen_rewards, rejected_rewards = dpo_loss(
            chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
            beta=self.args.beta, label_smoothing=self.args.label_smoothing,
        )
        loss = losses.mean()
        self._record_metrics(policy, chosen_rewards, rejected_rewards)
        if return_outputs:
            return loss, {"chosen_rewards": chosen_rewards, "rejected_rewards": rejected_rewards}
        return loss

    def _record_metrics(self, policy: SequenceLogps, chosen_rewards: torch.Tensor,
                        rejected_rewards: torch.Tensor) -> None:
        mode = "train" if self.model.training else "eval"
        gather = self.accelerator.gather_for_metrics
        chosen_rewards, rejected_rewards = gather((chosen_rewards, rejected_rewards))
        logps = gather(policy.logps.detach()).chunk(2)
        # Mean logit over completion tokens, token-weighted across the batch (as TRL).
        logits_sums, counts = (gather(t).chunk(2) for t in (policy.logits_sums, policy.token_counts))
        metrics = self._metrics[mode]
        metrics["rewards/chosen"].append(chosen_rewards.mean().item())
        metrics["rewards/rejected"].append(rejected_rewards.mean().item())
        metrics["rewards/accuracies"].append((chosen_rewards > rejected_rewards).float().mean().item())
        metrics["rewards/margins"].append((chosen_rewards - rejected_rewards).mean().item())
        metrics["logps/chosen"].append(logps[0].mean().item())
        metrics["logps/rejected"].append(logps[1].mean().item())
        metrics["logits/chosen"].append((logits_sums[0].sum() / counts[0].sum()).item())
        metrics["logits/rejected"].append((logits_sums[1].sum() / counts[1].sum()).item())

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # Every micro-batch since the last log counts, not only the last one.
        mode = "train" if self.model.training else "eval"
        prefix = "eval_" if mode == "eval" else ""
        # In place: Trainer.evaluate returns this very dict.
        logs.update({f"{prefix}{key}": sum(values) / len(values) for key, values in self._metrics[mode].items() if values})
        self._metrics[mode].clear()
        super().log(logs, start_time)
