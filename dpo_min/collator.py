"""Collators: B tokenized pairs -> one forward batch of 2B sequences; the padded layout, the default.

The batch is the seam between data and model. Whatever the layout, it holds
- the model inputs (`input_ids` and `attention_mask`; other layouts use `position_ids` or a 4D mask),
- `labels`: the token id at completion tokens, -100 elsewhere (aligned with `input_ids`, not shifted: position t
  predicts the label at t + 1 of the same row),
- `sequence_index`: for each label, which of the 2B sequences it belongs to: chosen i -> i, rejected i -> B + i,
so the trainer sums log-probs per sequence without knowing how the rows were laid out. The columns' names are in
batch.py. `DPODataCollator` pads the 2B rows to the longest (as TRL); `make_collator` picks the padding-free and
shared-prompt layouts of collator_packed.py when the config asks for them.
"""

from dataclasses import dataclass
from typing import Any

import torch

from .batch import IGNORE_INDEX, NON_MODEL_KEYS, REFERENCE_COLUMNS, TOKEN_COLUMNS, add_reference_logps
from .collator_packed import PackedDPODataCollator

__all__ = ["IGNORE_INDEX", "NON_MODEL_KEYS", "REFERENCE_COLUMNS", "TOKEN_COLUMNS", "DPODataCollator",
           "PackedDPODataCollator", "add_reference_logps", "make_collator"]


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


def make_collator(pad_token_id: int, padding_free: bool = False, share_prompt: bool = False,
                  dense_mask: bool = True, pad_to_multiple_of: int | None = None
                  ) -> DPODataCollator | PackedDPODataCollator:
    """The collator of a layout: padded unless `padding_free` or `share_prompt`."""
    if padding_free or share_prompt:
        return PackedDPODataCollator(pad_token_id, padding_free=padding_free, share_prompt=share_prompt,
                                     dense_mask=dense_mask, pad_to_multiple_of=pad_to_multiple_of)
    return DPODataCollator(pad_token_id, pad_to_multiple_of=pad_to_multiple_of)
