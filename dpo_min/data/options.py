"""What the data cannot say about itself, given by the user: the options every layout reads (`layouts.py`) and
the adapters of labelled pairs too (`labelled.py`)."""

from dataclasses import dataclass

PREFERENCE_LABELS = ("better_response_id", "safer_response_id")


@dataclass(frozen=True)
class LayoutOptions:
    """What the data cannot say about itself: which label decides (PKU-SafeRLHF), whether string pairs have no
    prompt, whether string pairs become one user and one assistant turn, which rows of a file that holds several
    splits in a `split` column are read (HelpSteer2's preference file: train, val), and how to read a label column
    of mapped data (label_column, and its values that mean the chosen or the rejected column is the better one), and
whether the ranked layouts that are published binarized (Nectar, UltraFeedback raw) keep every ranked answer."""

    preference_label: str = "better_response_id"
    no_prompt: bool = False
    as_messages: bool = False
    row_split: str = "train"
    label_column: str | None = None
    label_chosen: str | None = None
    label_rejected: str | None = None
    every_ranked_pair: bool = False  # Nectar, UltraFeedback (raw): every ranked answer kept (ranked.py)

    def __post_init__(self):
        if self.preference_label not in PREFERENCE_LABELS:
            raise ValueError(f"preference_label must be one of {PREFERENCE_LABELS}, got {self.preference_label!r}")
        given = [self.label_column, self.label_chosen, self.label_rejected]
        if any(value is not None for value in given) and (None in given or self.label_chosen == self.label_rejected):
            raise ValueError("label_column, label_chosen and label_rejected go together (two different values), got "
                             f"{self.label_column!r}, {self.label_chosen!r}, {self.label_rejected!r}")
