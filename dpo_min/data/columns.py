"""The user's column mapping: `columns={"prompt": "question", ...}` in `load_preference_dataset`, `--prompt_column`,
`--chosen_column`, `--rejected_column` and `--system_column` on the command line, each naming the source column that
holds one of ours. It is checked once, on the first row's columns, before any row is read through it."""

from collections.abc import Mapping
from typing import Any

MAPPABLE = ("prompt", "chosen", "rejected", "system")


def rename_columns(row: Mapping[str, Any], columns: Mapping[str, str]) -> dict[str, Any]:
    """A row with the user's columns under our names (columns maps ours -> theirs); the other columns stay."""
    renamed = {key: value for key, value in row.items() if key not in columns.values() and key not in columns}
    renamed.update({ours: row.get(theirs) for ours, theirs in columns.items()})
    return renamed


def check_mapping(columns: Mapping[str, str], found: list[str]) -> None:
    unknown = sorted(set(columns) - set(MAPPABLE))
    if unknown:
        raise ValueError(f"columns: unknown key(s) {unknown}; map {', '.join(MAPPABLE)} to your column names")
    missing = [theirs for theirs in columns.values() if theirs not in found]
    if missing:
        raise ValueError(f"columns: no column named {', '.join(map(repr, missing))} in [{', '.join(found)}]")
    check_no_clash(columns, found)


def check_no_clash(columns: Mapping[str, str], found: list[str]) -> None:
    """Refuses a name mapped from one column where the data has a column of that name too, itself mapped nowhere:
    which of the two is meant is not said, and renaming would drop the other unseen (datasets' `rename_column`
    refuses the same)."""
    for ours, theirs in columns.items():
        if ours != theirs and ours in found and ours not in columns.values():
            raise ValueError(f"columns: {ours!r} is mapped from the column {theirs!r} (--{ours}_column {theirs}), "
                             f"and the data has a {ours!r} column too: which one is meant is not said; drop or "
                             "rename one of them")
