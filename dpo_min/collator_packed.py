"""The packed layouts, beside the padded one of collator.py (`trainer_setup.make_collator` picks the padded by default).

- `PackedDPODataCollator(padding_free=True)`: the 2B sequences in one row, `position_ids` restarting at 0 for each;
  no `attention_mask`, from which transformers keeps each sequence to itself (a block-diagonal causal mask).
- `PackedDPODataCollator(share_prompt=True)`: one segment per pair, prompt[:-1] | prompt[-1] chosen | prompt[-1]
  rejected. Both answers continue the prompt's positions, and a 4D mask lets each answer see the shared prefix and
  itself only. The prompt's last token is repeated at the head of each answer so that, in every layout, the
  position just before a completion token predicts it; it costs one token per pair.
The forward reads them through `scale.attention.packed_forward_kwargs` (called from `logps.sequence_logps`).
"""

from dataclasses import dataclass, field
from typing import Any

import torch

from .collator import IGNORE_INDEX, add_reference_logps


@dataclass
class Row:
    """Per-token columns of one row, named as the batch names them. A token may attend to an earlier token of its
    segment whose branch is its own or 0 (the shared prompt prefix); padding is segment -1."""

    input_ids: list[int] = field(default_factory=list)
    position_ids: list[int] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    sequence_index: list[int] = field(default_factory=list)
    segment_ids: list[int] = field(default_factory=list)
    branch_ids: list[int] = field(default_factory=list)

    def add(self, ids: list[int], first_position: int, segment: int, branch: int, sequence: int | None = None) -> None:
        """Append `ids` at positions first_position, first_position + 1, ...; score them when `sequence` is given."""
        scored = sequence is not None
        self.input_ids += ids
        self.position_ids += range(first_position, first_position + len(ids))
        self.labels += ids if scored else [IGNORE_INDEX] * len(ids)
        self.sequence_index += [sequence if scored else -1] * len(ids)
        if scored and first_position == 0 and ids:
            # Nothing precedes a sequence's first token, so nothing predicts it (as in the padded layout).
            self.labels[-len(ids)], self.sequence_index[-len(ids)] = IGNORE_INDEX, -1
        self.segment_ids += [segment] * len(ids)
        self.branch_ids += [branch] * len(ids)


@dataclass
class PackedDPODataCollator:
    """The padding-free and shared-prompt layouts (see the module docstring).

    padding_free: every sequence of the batch in one row [1, N], so no pad token is computed; otherwise one row per
        sequence (or per pair with share_prompt), right-padded. Adds `segment_bounds` [S + 1], where each of the row's
        S independent segments (a sequence, or a pair with share_prompt) starts, then N: attention runs per segment.
    share_prompt: one segment per pair, the prompt computed once; adds a boolean 4D `attention_mask` [rows, 1, T, T]
        (True = may attend), which `sequence_logps` turns into the additive mask the model expects.
    dense_mask: False skips that [rows, 1, T, T] mask, for an attention that builds its own (flex attention).
    Every packed batch has `segment_ids` and `branch_ids` [rows, T]: a token may attend to an earlier token of its
    segment whose branch is its own or 0 (the shared prompt); padding is -1 in both.
    """

    pad_token_id: int
    padding_free: bool = True
    share_prompt: bool = False
    pad_to_multiple_of: int | None = None
    dense_mask: bool = True

    def __post_init__(self):
        if not (self.padding_free or self.share_prompt):
            raise ValueError("PackedDPODataCollator needs padding_free or share_prompt; DPODataCollator pads")

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        num_pairs = len(examples)
        rows = []
        for pair, ex in enumerate(examples):
            prompt, chosen, rejected = ex["prompt_ids"], ex["chosen_ids"], ex["rejected_ids"]
            if self.share_prompt:
                row, shared = Row(), len(prompt) - 1 if prompt else 0
                row.add(prompt[:shared], 0, segment=pair, branch=0)
                for branch, completion, sequence in ((1, chosen, pair), (2, rejected, num_pairs + pair)):
                    row.add(prompt[shared:], shared, segment=pair, branch=branch)
                    row.add(completion, len(prompt), segment=pair, branch=branch, sequence=sequence)
                rows.append(row)
        if not self.share_prompt:
            for sequence in range(2 * num_pairs):
                ex = examples[sequence % num_pairs]
                completion = ex["chosen_ids"] if sequence < num_pairs else ex["rejected_ids"]
                row = Row()
                row.add(ex["prompt_ids"], 0, segment=sequence, branch=1)
                row.add(completion, len(ex["prompt_ids"]), segment=sequence, branch=1, sequence=sequence)
                rows.append(row)
        batch = rows_to_batch(rows, self.pad_token_id, self.padding_free, self.pad_to_multiple_of,
                              branch_mask=self.share_prompt and self.dense_mask)
        return add_reference_logps(batch, examples)


def rows_to_batch(rows: list[Row], pad_token_id: int, padding_free: bool, pad_to_multiple_of: int | None = None,
                  branch_mask: bool = False) -> dict[str, torch.Tensor]:
    """Segments laid out as `Row`s -> the batch's tensors: with `padding_free` one row [1, N] and `segment_bounds`
    [S + 1], else one right-padded row each; `branch_mask` adds the boolean 4D `attention_mask` [rows, 1, T, T] of
    branches that see their segment's shared prefix (branch 0) and themselves. The grouped layout
    (collator_groups.py) lays its segments out with `Row` too."""
    segment_bounds = None
    if padding_free:
        segment_bounds = torch.tensor([0] + [len(row.input_ids) for row in rows]).cumsum(0)
        packed = Row()
        for row in rows:
            for name, values in vars(row).items():
                getattr(packed, name).extend(values)
        rows = [packed]
    length = max(len(row.input_ids) for row in rows)
    if pad_to_multiple_of and not padding_free:
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    pads = {"input_ids": pad_token_id, "position_ids": 0, "labels": IGNORE_INDEX, "sequence_index": -1,
            "segment_ids": -1, "branch_ids": -1}
    columns = {name: torch.tensor([getattr(row, name) + [pad] * (length - len(row.input_ids)) for row in rows])
               for name, pad in pads.items()}
    segment, branch = columns["segment_ids"], columns["branch_ids"]
    if branch_mask:
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        same_segment = segment[:, :, None] == segment[:, None, :]
        visible_branch = (branch[:, None, :] == 0) | (branch[:, :, None] == branch[:, None, :])
        columns["attention_mask"] = (causal & same_segment & visible_branch)[:, None]
    if segment_bounds is not None:
        columns["segment_bounds"] = segment_bounds
    return columns
