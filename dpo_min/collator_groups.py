"""The grouped layout (`group_by_prompt`): the pairs of one prompt computed as one segment, each distinct completion
once.

share_prompt's segment (collator_packed.py) grown from 2 branches to k: prompt[:-1], then for each distinct
completion of the group's pairs, prompt[-1] and the completion, seeing the shared prefix and itself only (the prompt's
last token is repeated at the head of each branch so that the position before a completion token predicts it, as in
every layout). The group is the batch's pairs of equal prompt ids (grouping.py orders the data so that they come
together); with `padding_free` the groups share one row, else one right-padded row each.

The batch keeps the contract of collator.py, with the completions as its sequences: `sequence_index` names the
completion of each label (0..C-1), and `completion_index` [2B] names, for each of the B chosen then B rejected
sequences of the pairs, the completion it is; `sequence_logps` gathers the C completions' log-probs into that [2B]
order, so the loss, the reference and the metrics read pairs as in every layout. For the listwise loss
(`rank_groups`): `group_ranking` [R], each group's completions best first as indices into the 2B sequences, group by
group, and `group_sizes` [G].
"""

from dataclasses import dataclass
from typing import Any

import torch

from .collator import add_reference_logps
from .collator_packed import Row, rows_to_batch
from .grouping import group_ids, prompt_groups, strict_order


@dataclass
class GroupedDPODataCollator:
    """B pairs -> one segment per group of equal prompt ids (see the module docstring).

    padding_free: the segments in one row [1, N] with `segment_bounds`; otherwise one right-padded row each.
    dense_mask: False skips the [rows, 1, T, T] boolean mask, for an attention that builds its own (flex attention).
    rank_groups: add `group_ranking` and `group_sizes` (loss_type plackett_luce); a group whose pairs give no single
        order raises (check_rankings refuses such data before training).
    """

    pad_token_id: int
    padding_free: bool = False
    pad_to_multiple_of: int | None = None
    dense_mask: bool = True
    rank_groups: bool = False

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        num_pairs = len(examples)
        rows, completion_index, ranking, sizes = [], [0] * (2 * num_pairs), [], []
        for segment, positions in enumerate(prompt_groups([ex["prompt_ids"] for ex in examples])):
            row, completions = _segment(examples, positions, segment, first=sum(sizes))
            for position in positions:
                for side, ids in enumerate(group_ids(examples[position])):
                    completion_index[side * num_pairs + position] = completions[ids]
            rows.append(row)
            sizes.append(len(completions))
            if self.rank_groups:
                ranking += self._ranking(examples, positions, num_pairs)
        batch = rows_to_batch(rows, self.pad_token_id, self.padding_free, self.pad_to_multiple_of,
                              branch_mask=self.dense_mask)
        batch["completion_index"] = torch.tensor(completion_index)
        if self.rank_groups:
            batch["group_ranking"], batch["group_sizes"] = torch.tensor(ranking), torch.tensor(sizes)
        return add_reference_logps(batch, examples)

    @staticmethod
    def _ranking(examples: list[dict[str, Any]], positions: list[int], num_pairs: int) -> list[int]:
        """The group's completions best first, each as the index of one of its sequences among the 2B."""
        order = strict_order([group_ids(examples[position]) for position in positions])
        if isinstance(order, str):
            raise ValueError(f"a batch's group of {len(positions)} pairs gives no single ranking: {order}")
        sequence_of = {}
        for position in positions:
            for side, ids in enumerate(group_ids(examples[position])):
                sequence_of.setdefault(ids, side * num_pairs + position)
        return [sequence_of[ids] for ids in order]


def _segment(examples: list[dict[str, Any]], positions: list[int], segment: int,
             first: int) -> tuple[Row, dict[tuple[int, ...], int]]:
    """One group's segment: prompt[:-1], then prompt[-1] and each distinct completion as a branch of its own; and
    each completion's index among the batch's (from `first`), by its ids."""
    prompt = examples[positions[0]]["prompt_ids"]
    row, shared = Row(), len(prompt) - 1 if prompt else 0
    row.add(prompt[:shared], 0, segment=segment, branch=0)
    completions: dict[tuple[int, ...], int] = {}
    for ids in (ids for position in positions for ids in group_ids(examples[position])):
        if ids not in completions:
            completions[ids] = first + len(completions)
            row.add(prompt[shared:], shared, segment=segment, branch=len(completions))
            row.add(list(ids), len(prompt), segment=segment, branch=len(completions), sequence=completions[ids])
    return row, completions
