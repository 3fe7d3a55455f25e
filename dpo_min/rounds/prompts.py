"""The prompt-only layout: rows with a `prompt` column, a text or a message list ({role, content} dicts), all of
one kind. Every other column travels with its prompt to the reward functions (TRL's `solution`, say)."""

import hashlib
import json
import math
import random
from collections.abc import Iterable, Mapping
from typing import Any

from .config import RoundsError


def _prompt_kind(prompt: Any, index: int) -> str:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise RoundsError(f"row {index}: field 'prompt' is empty")
        return "text"
    if isinstance(prompt, list) and prompt and all(isinstance(m, Mapping) and {"role", "content"} <= set(m)
                                                   for m in prompt):
        return "messages"
    raise RoundsError(f"row {index}: field 'prompt' must be a text or a list of {{role, content}} messages, got "
                      f"{type(prompt).__name__}")


def prompt_rows(prompts: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A dataset (or any rows) as a list of dicts, checked: a prompt in each, all of one kind."""
    rows = [dict(row) for row in prompts]
    if not rows:
        raise RoundsError("prompts: no rows")
    kinds = set()
    for index, row in enumerate(rows):
        if "prompt" not in row:
            raise RoundsError(f"row {index}: no 'prompt' field (it has {', '.join(sorted(row)) or 'none'})")
        kinds.add(_prompt_kind(row["prompt"], index))
        if len(kinds) > 1:
            raise RoundsError(f"row {index}: field 'prompt' mixes texts and message lists; give one kind")
    return rows


def fingerprint(rows: list[dict[str, Any]]) -> str:
    """What a resume checks it has the same prompts by."""
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()[:16]


def split_held_out(count: int, share: float, seed: int) -> tuple[list[int], list[int]]:
    """(training, held-out) row indices: a seeded share held out, rounded up as `datasets` and the command's split
    round a fraction (so at least one row when the share is > 0), never all of them."""
    held = min(math.ceil(share * count), count - 1)
    held_out = sorted(random.Random(seed).sample(range(count), held))
    chosen = set(held_out)
    return [i for i in range(count) if i not in chosen], held_out
