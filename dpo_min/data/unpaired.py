"""Rows that are well formed but cannot be preference pairs (an empty answer, no common prompt, chosen identical
to rejected: the published Anthropic/hh-rlhf files hold such rows). `loading` drops and counts them by reason, as
ties are, unless `strict_pairs`; most rows being such is a wrong layout or wrong columns, and refused."""

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from datasets import Dataset

from .layouts import Layout, LayoutOptions, rename_columns, to_pair

logger = logging.getLogger("dpo_min.data")

NO_ANSWER = "with an empty answer"
NO_COMMON_PROMPT = "whose chosen and rejected share no prompt"
SAME_ANSWERS = "with chosen identical to rejected"
UNPAIRED = (NO_ANSWER, NO_COMMON_PROMPT, SAME_ANSWERS)
# The layouts' words (layouts.py) for such a row; any other ValueError is a malformed row, always refused.
_SIGNS = (("is an empty completion", NO_ANSWER), ("before the last Assistant turn", NO_COMMON_PROMPT),
          ("shares no prompt with", NO_COMMON_PROMPT), ("is identical to 'chosen'", SAME_ANSWERS))
Unpaired = dict[str, list[tuple[Any, str]]]  # reason -> [(the row's label, the layout's message)]


def pair_or_reason(layout: Layout, row: Mapping[str, Any], label: Any, options: LayoutOptions,
                   strict_pairs: bool, validate: bool = True) -> dict[str, Any] | tuple[str, str] | None:
    """The row's pair, None for a tie, or (reason, the layout's message) for a row that cannot be a pair."""
    try:
        return to_pair(layout, row, label, options) if validate else layout.to_pair(row, label, options)
    except ValueError as error:
        reason = next((reason for sign, reason in _SIGNS if sign in str(error)), None)
        if strict_pairs or reason is None:
            raise
        return reason, str(error)


def refuse_most_unpaired(first: str, left_out: Mapping[str, int], read: int) -> None:
    """Most rows unpaired is a wrong layout or wrong columns, not a few bad pairs: refused, naming the first."""
    if 2 * sum(left_out.values()) > read:
        listed = ", ".join(f"{number} {reason}" for reason, number in left_out.items() if number)
        raise ValueError(f"{first}; {sum(left_out.values())} of {read} rows cannot be preference pairs ({listed}): "
                         "too many to drop, check the layout and columns")


def note_in_stream(unpaired: Unpaired, counts: Any) -> None:
    """A stream's rows that cannot be pairs, once `counts` (its StreamCounts) hold them: each logged while its
    reason has fewer than ten, and most of the rows read so far being such refused."""
    if not unpaired:
        return
    now = counts.snapshot()
    for reason, rows in unpaired.items():
        for number, (label, _) in enumerate(rows, start=now[reason] - len(rows)):
            if number < 10:
                logger.warning("dropped row %s %s", label, reason)
    refuse_most_unpaired(next(iter(unpaired.values()))[0][1], {reason: now[reason] for reason in UNPAIRED},
                         now["read"])


def left_out_rows(dataset: Dataset, labels: Sequence[Any], kept_labels: Sequence[Any], layout: Layout,
                  options: LayoutOptions, columns: Mapping[str, str] | None) -> Unpaired:
    """The rows of `dataset` (labelled `labels`) that a map kept no pair of (`kept_labels`), other than ties. A
    cached map says nothing, so the missing rows are read again: ties and unpaired rows only, few."""
    kept, missing = Counter(kept_labels), []
    for position, label in enumerate(labels):
        if kept[label]:
            kept[label] -= 1
        else:
            missing.append(position)
    left_out: Unpaired = {}
    for position, row in zip(missing, dataset.select(missing)):
        label = labels[position]
        found = pair_or_reason(layout, rename_columns(row, columns) if columns else row, label, options, False)
        if isinstance(found, tuple):
            left_out.setdefault(found[0], []).append((label, found[1]))
    return left_out
