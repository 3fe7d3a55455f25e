"""Which pairs form a group and in what order they are trained (`group_by_prompt`); a default run never enters here.

Pairs whose prompt ids are equal form a group, which the grouped layout (collator_groups.py) computes as one segment.
The data stays pairs: `GroupedSampler` only orders them so that a prompt's pairs are contiguous (the groups shuffled,
seeded per epoch, the pairs of a group in dataset order), and a batch of `per_device_train_batch_size` pairs cuts a
group only where it ends. The listwise loss (`plackett_luce`) reads a group's whole ranking: its batches are whole
groups (`GroupBatchSampler`, `per_device_train_batch_size` groups a batch), and each group's pairs must give one
strict order (`strict_order`, checked for every group before training by `check_rankings`).
"""

import random
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

from torch.utils.data import DataLoader, Sampler


def prompt_groups(prompts: Sequence[Sequence[int] | str]) -> list[list[int]]:
    """The positions of pairs of equal prompt ids (or prompt texts), one list per group: groups in order of first
    appearance, each group's positions in order."""
    groups: dict[Hashable, list[int]] = {}
    for position, prompt in enumerate(prompts):
        groups.setdefault(prompt if isinstance(prompt, str) else tuple(prompt), []).append(position)
    return list(groups.values())


def strict_order(pairs: Sequence[tuple[Hashable, Hashable]]) -> list[Hashable] | str:
    """The completions of one group, best first, when its (better, worse) pairs order them in one way only (their
    transitive closure is a strict total order); else why not, as a phrase."""
    completions = list(dict.fromkeys(c for pair in pairs for c in pair))
    worse = {c: set() for c in completions}
    beaten = dict.fromkeys(completions, 0)  # how many completions are above each, counting each once
    for better, lower in pairs:
        if better == lower:
            return "a completion is paired against itself"
        if lower not in worse[better]:
            worse[better].add(lower)
            beaten[lower] += 1
    order = []
    while beaten:
        # Kahn's topological sort: the order is strict exactly when one completion is unbeaten at every step.
        top = [c for c, count in beaten.items() if count == 0]
        if not top:
            return "its pairs contradict each other (a cycle)"
        if len(top) > 1:
            return f"its pairs do not order {len(top)} of its completions against each other (a tie)"
        order.append(top[0])
        del beaten[top[0]]
        for lower in worse[top[0]]:
            beaten[lower] -= 1
    return order


def group_ids(example: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(chosen ids, rejected ids) of a tokenized pair, as the keys of its completions."""
    return tuple(example["chosen_ids"]), tuple(example["rejected_ids"])


def _cut_answers(pairs: list[tuple[tuple[int, ...], ...]], prompt_length: int, max_length: int | None) -> str:
    """Where truncation may be to blame rather than the data: answers cut at max_length, of which two cut to the
    same ids are one answer to the ranking (a tie or a cycle the data does not hold)."""
    if max_length is None or all(prompt_length + len(ids) < max_length for pair in pairs for ids in pair):
        return ""
    return (f"; max_length={max_length} cut some of its answers, and answers cut to the same ids count as one: "
            "raise max_length")


def check_rankings(dataset: Any, max_length: int | None = None) -> None:
    """Every group of a tokenized dataset gives one strict order (what `plackett_luce` reads); else a one-line
    ValueError naming the group by its first pair's row, and `max_length` where it cut some of the group's answers."""
    if dataset is None:
        return
    columns = dataset.select_columns(["prompt_ids", "chosen_ids", "rejected_ids"])[:]
    rows = dataset["source_row"] if "source_row" in dataset.column_names else range(len(dataset))
    for positions in prompt_groups(columns["prompt_ids"]):
        pairs = [(tuple(columns["chosen_ids"][p]), tuple(columns["rejected_ids"][p])) for p in positions]
        order = strict_order(pairs)
        if isinstance(order, str):
            raise ValueError(f"row {rows[positions[0]]}: the group of its prompt ({len(positions)} pairs) gives no "
                             f"single ranking for loss_type plackett_luce: {order}"
                             f"{_cut_answers(pairs, len(columns['prompt_ids'][positions[0]]), max_length)}")


def data_seed(args: Any) -> int:
    """The seed of the order the data is drawn in: `data_seed`, else `seed`, as Trainer's own sampler reads them."""
    return args.data_seed if args.data_seed is not None else args.seed


class GroupedSampler(Sampler[int]):
    """Pair positions, a prompt's pairs contiguous: the groups in a seeded random order (another each epoch), the
    pairs of a group in dataset order. `seed`: the run's `data_seed`."""

    def __init__(self, groups: list[list[int]], seed: int, shuffle: bool = True):
        self.groups, self.seed, self.shuffle, self.epoch = groups, seed, shuffle, 0

    def set_epoch(self, epoch: int) -> None:  # accelerate calls it at each epoch
        self.epoch = epoch

    def ordered_groups(self) -> list[list[int]]:
        groups = list(self.groups)
        if self.shuffle:
            # One generator per (seed, epoch), seeded by both as text (hashed with SHA-512): seed + epoch made seed
            # 48's first epoch seed 47's second.
            random.Random(f"{self.seed} {self.epoch}").shuffle(groups)
        return groups

    def __iter__(self) -> Iterator[int]:
        return (position for group in self.ordered_groups() for position in group)

    def __len__(self) -> int:
        return sum(map(len, self.groups))


class GroupBatchSampler(Sampler[list[int]]):
    """Batches of whole groups, `groups_per_batch` each (the last may hold fewer), in `GroupedSampler`'s order. No
    `batch_size` attribute: the batches differ in size, and accelerate then trims no evaluation batch."""

    def __init__(self, groups: list[list[int]], groups_per_batch: int, seed: int, shuffle: bool = True):
        self.order, self.groups_per_batch = GroupedSampler(groups, seed, shuffle), groups_per_batch

    def set_epoch(self, epoch: int) -> None:
        self.order.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        groups = self.order.ordered_groups()
        for start in range(0, len(groups), self.groups_per_batch):
            yield [position for group in groups[start:start + self.groups_per_batch] for position in group]

    def __len__(self) -> int:
        return -(-len(self.order.groups) // self.groups_per_batch)


def dataset_groups(dataset: Any) -> list[list[int]]:
    return prompt_groups(dataset.select_columns(["prompt_ids"])["prompt_ids"])


def whole_group_loader(trainer: Any, dataset: Any, groups_per_batch: int, shuffle: bool) -> DataLoader:
    """A prepared loader whose batches are whole groups (`plackett_luce`), built as Trainer builds its own."""
    args = trainer.args
    sampler = GroupBatchSampler(dataset_groups(dataset), groups_per_batch, data_seed(args), shuffle)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=trainer.data_collator,
                        num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory)
    return trainer.accelerator.prepare(loader)
