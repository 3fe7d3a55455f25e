"""What each training prompt's earlier draws gave, and which prompts a round skips for it (`skip_saturated` N).

GRESO (arXiv 2506.02177) found that a prompt whose samples all scored alike in one epoch mostly does again in the
next, and skips such prompts before sampling them, with a probability that grows with how long they have been so.
Here: a prompt whose last N draws or more in a row gave no pair (pairs.gives_pair: its samples all alike, or within
min_margin) is skipped with probability 1 - 2**-(streak - N + 1) (1/2 at N, 3/4 at N + 1, ...), so that it still
comes back now and then, where the policy may have moved. Each decision is a seeded draw of (seed, prompt, round).

The history is read from the rounds' own samples.jsonl (every sampled prompt's samples and totals, the ones set
aside by dynamic sampling too), so a resume rebuilds it from the files and skips what the uninterrupted run skipped.
"""

import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from . import store
from .pairs import gives_pair


def draws(samples_files: Iterable[Path], min_margin: float, rule: str) -> dict[int, list[bool]]:
    """Each prompt's draws in round order (the files', round 1 first): True where its samples gave a pair."""
    history: dict[int, list[bool]] = {}
    for path in samples_files:
        by_prompt: dict[int, list[dict[str, Any]]] = {}
        for row in store.read_jsonl(path):
            by_prompt.setdefault(row["prompt_index"], []).append(row)
        for prompt, samples in by_prompt.items():
            history.setdefault(prompt, []).append(gives_pair(samples, min_margin, rule))
    return history


def streak(outcomes: list[bool]) -> int:
    """How many of the last draws in a row gave no pair."""
    count = 0
    for gave_pair in reversed(outcomes):
        if gave_pair:
            break
        count += 1
    return count


def skip_probability(streak_length: int, threshold: int) -> float:
    """The chance a prompt is skipped: 0 under `threshold` draws in a row without a pair (or threshold 0: off)."""
    if threshold == 0 or streak_length < threshold:
        return 0.0
    return 1.0 - 0.5 ** (streak_length - threshold + 1)


def skipped(prompt: int, outcomes: list[bool], threshold: int, seed: int, round_index: int) -> bool:
    probability = skip_probability(streak(outcomes), threshold)
    # A str seed is hashed the same in every process and every run (schedule.py draws alike).
    return probability > 0 and random.Random(f"{seed} skip {prompt} in round {round_index}").random() < probability
