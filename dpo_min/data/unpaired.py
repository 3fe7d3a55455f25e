"""Rows that are well formed but cannot be preference pairs (an empty answer, no common prompt, chosen identical
to rejected: the published Anthropic/hh-rlhf files hold such rows). A layout raises `Unpaired` for such a row;
`pairs` drops and counts them by reason, as ties are, unless `strict_pairs`; most rows being such is a wrong layout
or wrong columns, and refused."""

import logging
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger("dpo_min.data")

NO_ANSWER = "with an empty answer"
NO_COMMON_PROMPT = "whose chosen and rejected share no prompt"
SAME_ANSWERS = "with chosen identical to rejected"
UNPAIRED = (NO_ANSWER, NO_COMMON_PROMPT, SAME_ANSWERS)
LeftOut = dict[str, list[tuple[Any, str]]]  # reason -> [(the row's label, the layout's message)]


class Unpaired(ValueError):
    """A row that cannot be a preference pair, for `reason` (one of UNPAIRED); any other ValueError of a layout is a
    malformed row, always refused. Its text is the layout's message, naming the row and field."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> tuple:  # raised in a datasets worker (num_proc), it pickles back to the main process
        return Unpaired, (self.reason, str(self))


def refuse_most_unpaired(first: str, left_out: Mapping[str, int], read: int) -> None:
    """Most rows unpaired is a wrong layout or wrong columns, not a few bad pairs: refused, naming the first."""
    if 2 * sum(left_out.values()) > read:
        listed = ", ".join(f"{number} {reason}" for reason, number in left_out.items() if number)
        raise ValueError(f"{first}; {sum(left_out.values())} of {read} rows cannot be preference pairs ({listed}): "
                         "too many to drop, check the layout and columns")


def note_in_stream(unpaired: LeftOut, counts: Any) -> None:
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
