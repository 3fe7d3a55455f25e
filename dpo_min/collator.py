"""Collators: B tokenized pairs -> one forward batch of 2B sequences; the padded layout, the default.

The batch is the seam between data and model. Whatever the layout, it holds
- the model inputs (`input_ids` and `attention_mask`; other layouts use `position_ids` or a 4D mask),
- `labels`: the token id at completion tokens, -100 elsewhere (aligned with `input_ids`, not shifted: position t
  predicts the label at t + 1 of the same row),
- `sequence_index`: for each label, which of the 2B sequences it belongs to: chosen i -> i, rejected i -> B + i,
so the trainer sums log-probs per sequence without knowing how the rows were laid out. The columns' names are
below, read by every collator, the log-probs and the trainer. `DPODataCollator` pads the 2B rows to the longest (as
TRL), the default; the padding-free and shared-prompt layouts are collator_packed.py's (`trainer_setup.make_collator`
picks a layout from the config).
"""

from dataclasses import dataclass
from typing import Any

import torch

TOKEN_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")  # a tokenized pair, as the collators read it
REFERENCE_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")  # a pair's precomputed reference log-probs, if any
IGNORE_INDEX = -100
# Keys of a batch that are not model inputs.
NON_MODEL_KEYS = ("labels", "sequence_index", "segment_bounds", "segment_ids", "branch_ids", *REFERENCE_COLUMNS,
                  "completion_index", "group_ranking", "group_sizes")  # the last three: collator_groups.py


def add_reference_logps(batch: dict[str, torch.Tensor], examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Carry precomputed reference log-probs, when the examples have them, as [B] float tensors."""
    for name in REFERENCE_COLUMNS:
        if name in examples[0]:
            batch[name] = torch.tensor([ex[name] for ex in examples], dtype=torch.float32)
    return batch


@dataclass
class DPODataCollator:
    """Right-pads the B chosen sequences (prompt+chosen), then the B rejected ones, into one [2B, T] batch.

    `pad_to_multiple_of` rounds T up (useful for tensor cores).
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        sequences = [(ex["prompt_ids"], ex["chosen_ids"]) for ex in examples]
        sequences += [(ex["prompt_ids"], ex["rejected_ids"]) for ex in examples]
        length = max(len(prompt) + len(completion) for prompt, completion in sequences)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        rows = len(sequences)
        input_ids = torch.full((rows, length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((rows, length), dtype=torch.long)
        labels = torch.full((rows, length), IGNORE_INDEX, dtype=torch.long)
        sequence_index = torch.full((rows, length), -1, dtype=torch.long)
        for row, (prompt, completion) in enumerate(sequences):
            start, end = len(prompt), len(prompt) + len(completion)
            input_ids[row, :end] = torch.tensor(prompt + completion, dtype=torch.long)
            attention_mask[row, :end] = 1
            labels[row, start:end] = input_ids[row, start:end]
            sequence_index[row, start:end] = row
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels,
                 "sequence_index": sequence_index}
        return add_reference_logps(batch, examples)

