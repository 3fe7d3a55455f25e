"""How a resume names what changed: the one comparison of a recorded run's settings with a resume's, used by the
command's resume (train/same_run.py) and by DPO in rounds (rounds/store.py), so both refuse in the same words."""

import json
from itertools import zip_longest
from typing import Any

ABSENT = "(absent)"


def changes(name: str, old: Any, new: Any) -> list[str]:
    """`name old -> new`; for a mapping, one per key that differs (`training[learning_rate] 0.005 -> 0.001`), and
    for a list of entries (a mixture's datasets) one per entry that differs, each shown whole:
    `datasets[1] {"path": "b.jsonl"} -> {"path": "c.jsonl"}`."""
    if old == new:
        return []
    if isinstance(old, dict) and isinstance(new, dict):
        return [change for key in dict.fromkeys([*old, *new])
                for change in changes(f"{name}[{key}]", old.get(key, ABSENT), new.get(key, ABSENT))]
    if isinstance(old, list) and isinstance(new, list) and any(isinstance(item, dict) for item in old + new):
        return [f"{name}[{index}] {shown(before)} -> {shown(after)}"
                for index, (before, after) in enumerate(zip_longest(old, new, fillvalue=ABSENT)) if before != after]
    return [f"{name} {shown(old)} -> {shown(new)}"]


def shown(value: Any) -> str:
    if value == "":
        return '""'
    text = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return text[:12] if len(text) == 64 and text.isalnum() else text  # a digest: its first 12 hex digits
