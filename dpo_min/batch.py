"""The batch's columns: what every collator writes and the log-probs and the trainer read (collator.py says how)."""

from typing import Any

import torch

TOKEN_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")  # a tokenized pair, as the collators read it
REFERENCE_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")  # a pair's precomputed reference log-probs, if any
IGNORE_INDEX = -100
# Keys of a batch that are not model inputs.
NON_MODEL_KEYS = ("labels", "sequence_index", "segment_bounds", "segment_ids", "branch_ids", *REFERENCE_COLUMNS)


def add_reference_logps(batch: dict[str, torch.Tensor], examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Carry precomputed reference log-probs, when the examples have them, as [B] float tensors."""
    for name in REFERENCE_COLUMNS:
        if name in examples[0]:
            batch[name] = torch.tensor([ex[name] for ex in examples], dtype=torch.float32)
    return batch
