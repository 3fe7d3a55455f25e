"""Rows of k scored answers to one prompt -> every strictly better answer against every worse one (k(k-1)/2 pairs at
most), the pairs of a row carrying its prompt, so that `group_by_prompt` trains them as one group.

The `ranked` layout reads `prompt`, `completions` (answers, as text or as message lists) and `scores` (one finite
number per answer, higher better); Nectar and UltraFeedback (raw) become such rows under `every_ranked_pair`
(labelled.py). Every one of them is paired here, by one rule (`every_better_pair`), its scores checked by one check
(`finite_score`): equal scores are no pair, and an answer given twice is one answer, paired over another only where
each of its scores is above each of the other's (as `--pair_rule every` pairs sampled texts, rounds/pairs.py).
"""

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from .options import LayoutOptions
from .validation import validate_answer

CSV_CELL = "a CSV cell is text: write ranked rows as JSON lines or Parquet"


def every_better_pair(prompt: Any, answers: Sequence[Any], scores: Sequence[float], index: int | str,
                      name: str = "completions[{}]") -> list[dict[str, Any]]:
    """Each answer against each answer scored strictly lower, best answers first (stable among equal scores). Each
    answer is checked (validation.py), named by `name` with its position; a conversational prompt's text answers
    become one assistant message each, so that a text and a message list that hold the same answer are one answer.
    An answer given twice is paired by its lowest and highest score: never both better and worse than another."""
    answers = _scored_answers(prompt, answers, scores, index, name)
    answers.sort(key=lambda answer: -answer["high"])
    return [{"prompt": prompt, "chosen": better["answer"], "rejected": worse["answer"]}
            for rank, better in enumerate(answers) for worse in answers[rank + 1:] if better["low"] > worse["high"]]


def _scored_answers(prompt: Any, answers: Sequence[Any], scores: Sequence[float], index: int | str,
                    name: str) -> list[dict[str, Any]]:
    """Each distinct answer once, in the order they first appear, with its lowest and highest score."""
    conversational = isinstance(prompt, list)
    found: dict[str, dict[str, Any]] = {}
    for position, (answer, score) in enumerate(zip(answers, scores)):
        if not isinstance(answer, (str, list)):
            raise ValueError(f"row {index}: field '{name.format(position)}' must be text or a message list, "
                             f"got {type(answer).__name__}")
        if conversational and isinstance(answer, str):
            answer = [{"role": "assistant", "content": answer}]
        validate_answer(answer, index, name.format(position), conversational)
        one = found.setdefault(_answer_key(answer), {"answer": answer, "low": score, "high": score})
        one["low"], one["high"] = min(one["low"], score), max(one["high"], score)
    return list(found.values())


def _answer_key(answer: str | list) -> str:
    # A message list read from Parquet or a datasets table has every key of every message, the missing ones None.
    if isinstance(answer, str):
        return answer
    return json.dumps([{key: value for key, value in turn.items() if value is not None} for turn in answer],
                      sort_keys=True, default=str)


def finite_score(score: Any, index: int | str, name: str) -> float:
    """A score as a float: a real number (not a bool: `true` is no score), finite (NaN would drop its answer from
    every comparison, inf outrank every other); else a one-line ValueError naming row and field."""
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
        raise ValueError(f"row {index}: field '{name}' is {score!r}, not a finite number")
    return float(score)


def shown(value: Any) -> str:
    """A value as an error shows it: a text (a CSV cell, where a list was meant) as text, and how to write it."""
    return f"the text {value[:80]!r} ({CSV_CELL})" if isinstance(value, str) else repr(value)[:80]


def check_scores(scores: Any, count: int, index: int | str) -> list[float]:
    """One finite number per answer, at least two distinct; else a one-line ValueError naming row and field."""
    if not isinstance(scores, list) or len(scores) != count:
        got = f"{len(scores)} scores" if isinstance(scores, list) else shown(scores)
        raise ValueError(f"row {index}: field 'scores' must be a list of one score per completion ({count}), "
                         f"got {got}")
    scores = [finite_score(score, index, f"scores[{position}]") for position, score in enumerate(scores)]
    if len(set(scores)) < 2:
        raise ValueError(f"row {index}: field 'scores' has fewer than two distinct scores: no answer is better "
                         "than another")
    return scores


def ranked(row: Mapping[str, Any], index: int | str, options: LayoutOptions) -> list[dict[str, Any]] | None:
    """The `ranked` layout: {prompt, completions: [answer, ...], scores: [number, ...]} -> its pairs."""
    for name in ("prompt", "completions", "scores"):
        if row.get(name) is None:
            raise ValueError(f"row {index}: field '{name}' is missing")
    completions = row["completions"]
    if not isinstance(completions, list) or len(completions) < 2:
        got = f"{len(completions)} answer" if isinstance(completions, list) else shown(completions)
        raise ValueError(f"row {index}: field 'completions' must be a list of two or more answers (text or message "
                         f"lists), got {got}")
    scores = check_scores(row["scores"], len(completions), index)
    # None: no answer is below another in all its scores (one text, or a text given twice around the others): skipped
    return every_better_pair(row["prompt"], completions, scores, index) or None
