"""The precompute pass (`precompute_ref_log_probs=True`): the reference's log-probs of every pair, once, up front.

`DPOMinTrainer.precompute_reference` is its one entry point; it calls `precompute_reference` below only when
`precompute_ref_log_probs` is set (a default run never enters this file). It runs before the first step (or before a
resumed run loads its checkpoint), so that for full fine-tuning the reference is the model as given. Each dataset
gains the columns `ref_chosen_logps` and `ref_rejected_logps`, which the collator carries and `compute_loss` reads in
place of a reference forward. The log-probs are cached on disk (ref_cache.py), keyed by the reference's weights and
the data; a pass stopped part-way (Ctrl-C, SIGTERM, a kill) keeps the batches it finished, and the next one goes on
from them (one process only: several gather each batch together).
"""

import contextlib
import time
from typing import Any

import torch
from accelerate.utils import broadcast_object_list
from datasets import Dataset, IterableDataset
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from . import ref_cache
from .collator import REFERENCE_COLUMNS
from .compat import TRL_ITERABLE_REFUSAL
from .grouping import GroupBatchSampler, GroupedSampler, data_seed, dataset_groups
from .scale import zero


def precompute_reference(trainer: Any, eval_dataset: Dataset | None = None,
                         method: str = "evaluate") -> Dataset | None:
    """`eval_dataset` (tokenized, passed to `method`: "evaluate" or "predict") with the reference's log-probs, when
    given; otherwise the trainer's train and eval datasets gain them, in place (once each; cached on disk)."""
    if eval_dataset is not None:
        return with_reference_logps(trainer, eval_dataset, "eval" if method == "evaluate" else "test", method)
    trainer.train_dataset = with_reference_logps(trainer, trainer.train_dataset, "train")
    if isinstance(trainer.eval_dataset, dict):
        trainer.eval_dataset = {name: with_reference_logps(trainer, data, name)
                                for name, data in trainer.eval_dataset.items()}
    else:
        trainer.eval_dataset = with_reference_logps(trainer, trainer.eval_dataset, "eval")
    return None


def with_reference_logps(trainer: Any, dataset: Dataset, description: str, method: str = "evaluate") -> Dataset:
    """`dataset` with `ref_chosen_logps` / `ref_rejected_logps` columns: one reference pass over it, or the cache.
    Refused (in TRL's words, naming `method`) once training has started where the reference is the untrained policy:
    its log-probs exist only before the first step, and the trained policy scored against itself gives ln 2."""
    if isinstance(dataset, IterableDataset):
        raise ValueError(TRL_ITERABLE_REFUSAL)
    if dataset is None or REFERENCE_COLUMNS[0] in dataset.column_names:
        return dataset
    reference = trainer.reference
    if reference.before_first_step and trainer.state.global_step > 0:
        raise ValueError(f"Cannot compute reference log-probs for a dataset passed to `{method}()` after training "
                         f"has started (the {description} data): full fine-tuning without ref_model uses the "
                         "untrained model as reference; pass eval_dataset at construction or a ref_model")
    key = ref_cache.cache_key(reference.weights(trainer.model), dataset, reference.cache_settings(trainer.args))
    cached = ref_cache.load(key, len(dataset))
    if trainer.accelerator.num_processes > 1:  # all processes must take the same branch: the pass below gathers
        cached = broadcast_object_list([cached])[0]
    if cached is None:
        cached = _reference_pass(trainer, dataset, key)
        if trainer.accelerator.is_main_process:
            ref_cache.save(key, *cached)
    for name, logps in zip(REFERENCE_COLUMNS, cached):
        dataset = dataset.add_column(name, logps.tolist())
    return dataset


# How often a pass keeps the batches it has finished: a stop loses at most this much of the pass.
KEEP_EVERY_S = 10.0


def _reference_pass(trainer: Any, dataset: Dataset, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    args, accelerator = trainer.args, trainer.accelerator
    loader, order = _loader(trainer, dataset)
    alone = accelerator.num_processes == 1
    chosen, rejected = ref_cache.load_partial(key) if alone else ([], [])
    was_training = trainer.model.training
    trainer.model.eval()
    if trainer.reference.model is None and trainer.is_deepspeed_enabled and trainer._precompute_engine is None \
            and trainer.model_wrapped is trainer.model:
        # Before train() builds the policy's engine: this one places the weights (and gathers ZeRO-3's shards).
        trainer._precompute_engine = zero.inference_engine(trainer.model, accelerator)
    loader = accelerator.prepare(loader)
    # The pass runs before the first step and can take minutes: a bar on the main process says how many.
    bar = tqdm(total=len(loader), desc="reference log-probs", unit="batch", leave=False, initial=len(chosen),
               disable=args.disable_tqdm or not trainer.is_local_process_zero())
    kept, finished_before = time.monotonic(), len(chosen)
    # The batches the stopped pass computed (the same batches, the same weights) are skipped unread, as Trainer skips
    # a resumed epoch's.
    remaining = accelerator.skip_first_batches(loader, finished_before) if finished_before else loader
    try:
        for batch in remaining:
            ref = accelerator.gather_for_metrics(trainer.reference_logps(batch).summed_logps(args.ld_alpha).chunk(2))
            chosen.append(ref[0].float().cpu())
            rejected.append(ref[1].float().cpu())
            bar.update()
            if alone and time.monotonic() - kept > KEEP_EVERY_S:
                ref_cache.save_partial(key, chosen, rejected)
                kept = time.monotonic()
    except BaseException as stop:  # a stop (KeyboardInterrupt, SIGTERM as the command raises it) or a failure
        if alone and chosen:
            with contextlib.suppress(OSError, RuntimeError):  # a full disk: the stop itself is what to report
                ref_cache.save_partial(key, chosen, rejected)
                stop.kept_work = f"the reference log-probs of {len(chosen)} of {len(loader)} batches cached"
        raise
    finally:
        bar.close()
    trainer.model.train(was_training)
    if order is None:
        return torch.cat(chosen), torch.cat(rejected)
    # Back to the dataset's order; several processes may have repeated the first batches to end together.
    positions = torch.tensor(order)
    return tuple(torch.empty(len(order)).index_copy_(0, positions, torch.cat(values)[:len(order)])
                 for values in (chosen, rejected))


def _loader(trainer: Any, dataset: Dataset) -> tuple[DataLoader, list[int] | None]:
    """The pass's loader, and under group_by_prompt the dataset position of each pair it yields, in order: batches
    of whole groups (precompute_ref_batch_size groups each), so that each distinct completion runs once; with several
    processes, which must gather batches of one size, batches of pairs with a prompt's pairs together."""
    args = trainer.args
    size, collate = args.precompute_ref_batch_size or args.per_device_eval_batch_size, trainer.data_collator
    if not args.group_by_prompt:
        return DataLoader(dataset, batch_size=size, shuffle=False, collate_fn=collate,
                          num_workers=args.dataloader_num_workers), None
    if trainer.accelerator.num_processes == 1:
        batches = GroupBatchSampler(dataset_groups(dataset), size, data_seed(args), shuffle=False)
        return DataLoader(dataset, batch_sampler=batches, collate_fn=collate,
                          num_workers=args.dataloader_num_workers), [p for batch in batches for p in batch]
    order = GroupedSampler(dataset_groups(dataset), data_seed(args), shuffle=False)
    return DataLoader(dataset, batch_size=size, sampler=order, collate_fn=collate,
                      num_workers=args.dataloader_num_workers), list(order)
