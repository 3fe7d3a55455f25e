"""What `group_by_prompt` is for, said before a run: the tokens the forward computes per pair in groups, against
`share_prompt` and two sequences a pair, counted from the tokenized train pairs in the batches the sampler gives
(`describe_train_groups`, printed by the command after its plan line)."""

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .report import _count


def layout_tokens(pairs: Mapping[str, Sequence[Sequence[int]]], batches: Iterable[Sequence[int]]) -> dict[str, int]:
    """Tokens the forward computes (padding excluded, as `num_tokens` counts them) for `batches` of tokenized pairs
    (`pairs`: columns prompt_ids, chosen_ids, rejected_ids; a batch: positions in them), in three layouts:
    "groups" (collator_groups.py: per prompt of a batch, prompt[:-1] once, then prompt[-1] and each distinct
    completion), "share_prompt" (collator_packed.py: the same for each pair's two answers) and "two sequences" (the
    padded and padding-free layouts: the whole prompt before each answer)."""
    counts = dict.fromkeys(("groups", "share_prompt", "two sequences"), 0)
    for batch in batches:
        answers_of: dict[tuple[int, ...], set[tuple[int, ...]]] = {}
        for position in batch:
            prompt = tuple(pairs["prompt_ids"][position])
            answers = (tuple(pairs["chosen_ids"][position]), tuple(pairs["rejected_ids"][position]))
            answers_of.setdefault(prompt, set()).update(answers)
            counts["share_prompt"] += _branched(prompt, answers)
            counts["two sequences"] += 2 * len(prompt) + sum(map(len, answers))
        counts["groups"] += sum(_branched(prompt, answers) for prompt, answers in answers_of.items())
    return counts


def _branched(prompt: Sequence[int], answers: Iterable[Sequence[int]]) -> int:
    """One segment's tokens: prompt[:-1] once, then each answer with prompt[-1] at its head (nothing for an empty
    prompt), as collator_packed.Row lays a segment out."""
    head = min(len(prompt), 1)
    return len(prompt) - head + sum(head + len(answer) for answer in answers)


def epoch_batches(ordered_groups: Sequence[Sequence[int]], batch_size: int, listwise: bool) -> list[list[int]]:
    """An epoch's batches of pair positions, from its groups in the sampler's order (grouping.GroupedSampler's
    `ordered_groups`): `batch_size` pairs a batch, cutting a group where a batch ends; for the listwise loss,
    `batch_size` whole groups a batch (grouping.GroupBatchSampler)."""
    if listwise:
        return [[position for group in ordered_groups[start:start + batch_size] for position in group]
                for start in range(0, len(ordered_groups), batch_size)]
    order = [position for group in ordered_groups for position in group]
    return [order[start:start + batch_size] for start in range(0, len(order), batch_size)]


def describe_groups(prompts: int, pairs: int, batch_size: int, tokens: Mapping[str, int],
                    listwise: bool = False) -> str:
    """'groups: 51 prompts, 625 pairs (12.3 a prompt); the first epoch's batches of 8 pairs compute 18500 tokens in
    groups (29.6 a pair), 35812 with share_prompt (57.3) and 57937 as two sequences a pair (92.7): groups compute
    0.52x share_prompt's tokens', from `layout_tokens`' counts."""
    groups, shared, apart = (tokens[layout] for layout in ("groups", "share_prompt", "two sequences"))
    batch = _count(batch_size, "group" if listwise else "pair")
    return (f"groups: {_count(prompts, 'prompt')}, {_count(pairs, 'pair')} ({pairs / prompts:.1f} a prompt); the "
            f"first epoch's batches of {batch} compute {groups} tokens in groups ({groups / pairs:.1f} a pair), "
            f"{shared} with share_prompt ({shared / pairs:.1f}) and {apart} as two sequences a pair "
            f"({apart / pairs:.1f}): groups compute {groups / shared:.2f}x share_prompt's tokens")


def describe_train_groups(trainer: Any) -> str:
    """`describe_groups` of a trainer's train pairs (group_by_prompt, data with a length), in the batches its sampler
    gives the first epoch."""
    args, dataset = trainer.args, trainer.train_dataset
    ordered = trainer._get_train_sampler().ordered_groups()  # the trainer's own order (grouping.GroupedSampler)
    batches = epoch_batches(ordered, args.per_device_train_batch_size, args.listwise)
    tokens = layout_tokens(dataset.select_columns(["prompt_ids", "chosen_ids", "rejected_ids"])[:], batches)
    return describe_groups(len(ordered), len(dataset), args.per_device_train_batch_size, tokens, args.listwise)


