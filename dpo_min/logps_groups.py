"""The grouped layout's log-probs (collator_groups.py): its forward scores each distinct completion once, and this
gathers them into the 2B sequences of its pairs, so that the loss reads them as in the padded layout (logps.py)."""

import dataclasses
from typing import Any

import torch


def pairs_of_completions(completions: Any, completion_index: torch.Tensor) -> Any:
    """The `SequenceLogps` of C distinct completions as that of the 2B sequences of the pairs: sequence s is
    completion `completion_index[s]` ([2B]). Per-token values are repeated for each sequence a completion is, so that
    what reads tokens per pair (LD-DPO, WPO) reads them as in the padded layout."""
    counts = completions.lengths.long()
    order = torch.argsort(completions.token_sequence, stable=True)  # the tokens completion by completion, in order
    starts = torch.cumsum(counts, 0) - counts
    per_pair = counts[completion_index]
    token_sequence = torch.repeat_interleave(torch.arange(len(completion_index), device=counts.device), per_pair)
    offsets = torch.arange(len(token_sequence), device=counts.device) - (torch.cumsum(per_pair, 0) - per_pair)[
        token_sequence]
    tokens = order[starts[completion_index][token_sequence] + offsets]

    def gathered(values: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
        return None if values is None else values[index]

    return dataclasses.replace(
        completions, logps=completions.logps[completion_index], lengths=completions.lengths[completion_index],
        logits_sums=completions.logits_sums[completion_index], token_logps=completions.token_logps[tokens],
        token_sequence=token_sequence, token_positions=completions.token_positions[tokens],
        token_log_sum_sq_probs=gathered(completions.token_log_sum_sq_probs, tokens),
        entropy_sums=gathered(completions.entropy_sums, completion_index),
        top1_counts=gathered(completions.top1_counts, completion_index))
