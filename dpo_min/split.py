"""The held-out split of the command's pairs (--eval_fraction) and of the rounds' prompts (held_out_share), a seeded
share of N rows: both are this split, so the same count, share and seed hold out the same rows whichever asks. It is
`datasets`' own `train_test_split`, as TRL and the handbook split, the share rounded up as `datasets` rounds a
fraction. A mixture's `test_split_size` is not this split: data/mixtures.py splits a mixture as TRL's and the
handbook's code do (a seeded `train_test_split(test_size=...)` of the concatenated rows, a count or a fraction),
and data/ imports nothing of the core."""

import math

from datasets import Dataset


def held_out_count(count: int, share: float) -> int:
    """How many of `count` rows `share` holds out: rounded up, as train_test_split rounds a fraction (so at least one
    row when the share is > 0)."""
    return math.ceil(count * share)


def held_out_split(count: int, share: float, seed: int) -> tuple[list[int], list[int]]:
    """(training, held-out) row indices of `count` rows, each in train_test_split's (shuffled) order; no row held out
    for a share of 0. A share that holds out every row is refused (ValueError), never capped: a capped share of one
    row would hold out none of it without a word. Each caller words the refusal with its option's name."""
    held = held_out_count(count, share)
    if held >= count:
        raise ValueError(f"a share of {share} of {count} rows holds out every one, leaving none to train on")
    if held == 0:
        return list(range(count)), []
    parts = Dataset.from_dict({"row": list(range(count))}).train_test_split(test_size=held, seed=seed)
    return parts["train"]["row"], parts["test"]["row"]
