"""The precompute pass (`precompute_ref_log_probs=True`): the reference's log-probs of every pair, once, up front.

`DPOMinTrainer.precompute_reference` is its one entry point; it runs before the first step (or before a resumed run
loads its checkpoint), so that for full fine-tuning the reference is the model as given. Each dataset gains the
columns `ref_chosen_logps` and `ref_rejected_logps`, which the collator carries and `compute_loss` reads in place of
a reference forward. The log-probs are cached on disk (ref_cache.py), keyed by the reference's weights and the data.
"""

from typing import Any

import torch
from accelerate.utils import broadcast_object_list
from datasets import Dataset, IterableDataset
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from . import ref_cache, trainer_setup
from .collator import REFERENCE_COLUMNS
from .compat import TRL_ITERABLE_REFUSAL
from .scale import zero


class PrecomputeHooks:
    """DPOMinTrainer's dataloaders and `train`, each starting the precompute pass through its one entry point,
    `precompute_reference`, before Trainer's own: the reference's log-probs are taken before the first step."""

    def precompute_reference(self, eval_dataset: Any = None) -> Any:
        """The precompute pass's one entry point: the train and eval datasets, and `eval_dataset` when given (returned),
        gain the reference's log-probs (once each; cached on disk). A no-op without `precompute_ref_log_probs`."""
        if not self.args.precompute_ref_log_probs:
            return eval_dataset
        if eval_dataset is not None:
            return with_reference_logps(self, self._tokenized_eval(eval_dataset), "eval")
        self.train_dataset = with_reference_logps(self, self.train_dataset, "train")
        if isinstance(self.eval_dataset, dict):
            self.eval_dataset = {name: with_reference_logps(self, data, name)
                                 for name, data in self.eval_dataset.items()}
        else:
            self.eval_dataset = with_reference_logps(self, self.eval_dataset, "eval")
        return None

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any):
        if resume_from_checkpoint:
            # Before Trainer loads the checkpoint's weights: the reference is the model as given, not as trained.
            self.precompute_reference()
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def _tokenized_eval(self, dataset: Dataset) -> Dataset:
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        return trainer_setup.tokenized(dataset, tokenizer, self.args)

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


def with_reference_logps(trainer: Any, dataset: Dataset, description: str) -> Dataset:
    """`dataset` with `ref_chosen_logps` / `ref_rejected_logps` columns: one reference pass over it, or the cache."""
    if isinstance(dataset, IterableDataset):
        raise ValueError(TRL_ITERABLE_REFUSAL)
    if dataset is None or REFERENCE_COLUMNS[0] in dataset.column_names:
        return dataset
    reference = trainer.reference
    if reference.fixed_before_training() and trainer.state.global_step > 0:
        raise ValueError(f"Cannot compute reference log-probs for a dataset passed to `evaluate()` after training "
                         f"has started (the {description} data): full fine-tuning without ref_model uses the "
                         "untrained model as reference; pass eval_dataset at construction or a ref_model")
    key = ref_cache.cache_key(reference.weights(trainer.model), dataset, reference.cache_settings(trainer.args))
    cached = ref_cache.load(key, len(dataset))
    if trainer.accelerator.num_processes > 1:  # all processes must take the same branch: the pass below gathers
        cached = broadcast_object_list([cached])[0]
    if cached is None:
        cached = _reference_pass(trainer, dataset)
        if trainer.accelerator.is_main_process:
            ref_cache.save(key, *cached)
    for name, logps in zip(REFERENCE_COLUMNS, cached):
        dataset = dataset.add_column(name, logps.tolist())
    return dataset


def _reference_pass(trainer: Any, dataset: Dataset) -> tuple[torch.Tensor, torch.Tensor]:
    args, accelerator = trainer.args, trainer.accelerator
    loader = DataLoader(dataset, batch_size=args.precompute_ref_batch_size or args.per_device_eval_batch_size,
                        shuffle=False, collate_fn=trainer.data_collator, num_workers=args.dataloader_num_workers)
    chosen, rejected = [], []
    was_training = trainer.model.training
    trainer.model.eval()
    if trainer.reference.model is None and trainer.is_deepspeed_enabled and trainer._precompute_engine is None \
            and trainer.model_wrapped is trainer.model:
        # Before train() builds the policy's engine: this one places the weights (and gathers ZeRO-3's shards).
        trainer._precompute_engine = zero.inference_engine(trainer.model, accelerator)
    loader = accelerator.prepare(loader)
    # The pass runs before the first step and can take minutes: a bar on the main process says how many.
    bar = tqdm(loader, desc="reference log-probs", unit="batch", leave=False,
               disable=args.disable_tqdm or not trainer.is_local_process_zero())
    for batch in bar:
        ref = accelerator.gather_for_metrics(trainer.reference_logps(batch).summed_logps(args.ld_alpha).chunk(2))
        chosen.append(ref[0].float().cpu())
        rejected.append(ref[1].float().cpu())
    trainer.model.train(was_training)
    return torch.cat(chosen), torch.cat(rejected)
