"""Rows of k scored answers to one prompt -> every strictly better answer against every worse one (k(k-1)/2 pairs at
most), the pairs of a row carrying its prompt, so that `group_by_prompt` trains them as one group.

The `ranked` layout reads `prompt`, `completions` (answers, as text or as message lists) and `scores` (one finite
number per answer, higher better); Nectar and UltraFeedback (raw) become such rows under `every_ranked_pair`
(labelled.py). Equal scores are not a pair, and neither is an answer against the same text.
"""

import math
from collections.abc import Mapping, Sequence
from typing import Any

from .options import LayoutOptions


def every_better_pair(prompt: Any, answers: Sequence[Any], scores: Sequence[float]) -> list[dict[str, Any]]:
    """Each answer against each answer scored strictly lower, best answers first (stable among equal scores); a
    conversational prompt's text answers become one assistant message each."""
    if isinstance(prompt, list):
        answers = [[{"role": "assistant", "content": a}] if isinstance(a, str) else a for a in answers]
    order = sorted(range(len(answers)), key=lambda position: -scores[position])
    return [{"prompt": prompt, "chosen": answers[better], "rejected": answers[worse]}
            for rank, better in enumerate(order) for worse in order[rank + 1:]
            if scores[better] > scores[worse] and answers[better] != answers[worse]]


def check_scores(scores: Any, count: int, index: int | str, field: str = "scores") -> list[float]:
    """One finite number per answer, at least two distinct; else a one-line ValueError naming row and field."""
    if not isinstance(scores, list) or len(scores) != count:
        got = f"{len(scores)} scores" if isinstance(scores, list) else type(scores).__name__
        raise ValueError(f"row {index}: field '{field}' must be a list of one score per completion ({count}), "
                         f"got {got}")
    for position, score in enumerate(scores):
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
            raise ValueError(f"row {index}: field '{field}' holds {score!r} at {position}, not a finite number")
    if len(set(scores)) < 2:
        raise ValueError(f"row {index}: field '{field}' has fewer than two distinct scores: no answer is better "
                         "than another")
    return [float(score) for score in scores]


def ranked(row: Mapping[str, Any], index: int | str, options: LayoutOptions) -> list[dict[str, Any]] | None:
    """The `ranked` layout: {prompt, completions: [answer, ...], scores: [number, ...]} -> its pairs."""
    for name in ("prompt", "completions", "scores"):
        if row.get(name) is None:
            raise ValueError(f"row {index}: field '{name}' is missing")
    completions = row["completions"]
    if not isinstance(completions, list) or len(completions) < 2 or not all(
            isinstance(answer, (str, list)) for answer in completions):
        raise ValueError(f"row {index}: field 'completions' must be a list of two or more answers (text or "
                         "message lists)")
    # None: its differently scored answers are all one text (a tie, skipped and counted)
    return every_better_pair(row["prompt"], completions, check_scores(row["scores"], len(completions), index)) or None
