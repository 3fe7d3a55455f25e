"""The reference's samples, before training: the run said in two lines (what it is, its plan), then the reference's
greedy completions and log-prob margins of the first --num_samples held-out pairs, which the trained policy's are
set beside when the run is published."""

import json
from dataclasses import dataclass
from typing import Any

from datasets import Dataset

from .. import trainer_setup
from ..grouping import dataset_groups
from ..trainer import DPOMinTrainer
from .group_tokens import describe_train_groups
from .pairs import pair_count
from .plan import Plan
from .report import CompletionLogger, describe_plan, describe_ties, greedy_completions, logprob_margins


@dataclass
class Samples:
    """The first num_samples held-out pairs of distinct prompts (in the seeded split's order, fixed before any output
    is seen) and the reference's greedy completions and log-prob margins of them; `completions` logs the policy's at
    each evaluation."""

    prompts: list[Any]
    pairs: list[dict[str, Any]]
    reference_texts: list[str]
    reference_margins: list[float]
    completions: CompletionLogger


def sample_reference(trainer: DPOMinTrainer, plan: Plan, held_out: Dataset | None) -> Samples:
    """Say what the run is, then sample: the policy starts as the reference, so these are the reference's."""
    say = print if plan.is_main else (lambda *_, **__: None)
    model = trainer.model
    rows = _sampled_rows(trainer, held_out, plan.data.num_samples)
    prompts = [held_out[row]["prompt"] for row, _ in rows]
    pairs = [trainer.eval_dataset[pair] for _, pair in rows]  # the pairs of those rows, as the trainer kept them
    train_pairs = pair_count(trainer.train_dataset)
    say(f"model {plan.model_name} | {'streamed' if train_pairs is None else train_pairs} train pairs, "
        f"{0 if held_out is None else len(trainer.eval_dataset)} held-out | "
        f"{'LoRA r=' + str(plan.model.lora_r) if plan.trains_adapter else 'full fine-tuning'} | "
        f"output {plan.folder.named}")
    if plan.is_main and plan.args.group_by_prompt and train_pairs is not None:  # what groups save, before the plan
        say(describe_train_groups(trainer))
    if train_pairs is not None:  # plackett_luce's batches are whole groups: its epochs are counted in them
        groups = len(dataset_groups(trainer.train_dataset)) if plan.args.listwise else None
        say(describe_plan(plan.args, train_pairs, groups))
    hidden = plan.args.disable_tqdm
    texts = greedy_completions(model, trainer.processing_class, prompts, plan.data.max_new_tokens,
                               plan.args.chat_template_kwargs, "the reference's greedy completions of the samples",
                               hidden) if plan.is_main else []
    margins = logprob_margins(model, trainer.data_collator, pairs, "the reference's margins of the samples",
                              hidden) if plan.is_main else []
    if held_out is not None and plan.ties_at_start:
        say(describe_ties(len(trainer.eval_dataset), plan.args.loss_type))
    completions = CompletionLogger(plan.folder.staging / "samples.jsonl", trainer.processing_class, prompts, texts,
                                   plan.data.max_new_tokens, trainer.callback_handler.callbacks,
                                   plan.args.chat_template_kwargs)
    trainer.add_callback(completions)
    return Samples(prompts, pairs, texts, margins, completions)


def _sampled_rows(trainer: DPOMinTrainer, held_out: Dataset | None, count: int) -> list[tuple[int, int]]:
    """(held-out row, held-out pair) of the first `count` kept pairs whose prompts differ: a prompt's greedy
    completion is one text, so a second pair of it (all of a prompt's pairs are held out together under
    --group_by_prompt) would show the same sample again. Tokenizing drops the pairs that truncation leaves unusable,
    so the kept rows are asked of it over the rows that hold count + dropped prompts: at least min(count, kept
    prompts) of those are kept. No samples asked, no row is tokenized (the first rows may all be cut: tokenizing
    only those would find no pair left)."""
    if held_out is None or count <= 0:
        return []
    dropped = len(held_out) - len(trainer.eval_dataset)
    keys = [json.dumps(prompt, sort_keys=True) for prompt in held_out["prompt"]]
    kept = range(len(held_out))
    if dropped:
        reach = _rows_holding(keys, count + dropped)
        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
        kept = trainer_setup.kept_rows(held_out.select(range(reach)), tokenizer, trainer.args, trainer.model)
    shown, seen = [], set()
    for pair, row in enumerate(kept):
        if len(shown) < count and keys[row] not in seen:
            seen.add(keys[row])
            shown.append((row, pair))
    return shown


def _rows_holding(keys: list[str], prompts: int) -> int:
    """How many first rows hold `prompts` distinct prompts (all the rows where fewer are there), in one pass."""
    seen = set()
    for end, key in enumerate(keys, 1):
        seen.add(key)
        if len(seen) >= prompts:
            return end
    return len(keys)
