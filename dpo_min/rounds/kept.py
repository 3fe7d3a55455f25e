"""What a sampling pass had finished when it stopped, kept batch by batch so that the same call goes on from it.

A round's sampling and each held-out greedy pass generate in batches of prompts, batch b seeded `seed + b`: a batch
generated again is the batch generated before, token for token. So a Ctrl-C (or a kill) loses at most the batch in
hand. Each finished batch is written (whole, dpo_min.files) to a `*.partial.jsonl` beside the phase's own file,
one line per batch: its index, its prompts and their completions; the phase's file, once written, replaces it.
One process only: several deal the batches out and gather them, and keep nothing.
"""

import json
from pathlib import Path
from typing import Any

from . import store
from .sampling import Completion


def partial_of(path: Path) -> Path:
    """Where the finished batches of the phase that writes `path` are kept: round-K/generated.partial.jsonl."""
    return path.with_name(f"{path.name.removesuffix('.jsonl')}.partial.jsonl")


def read(path: Path | None, batches: list[tuple[int, list[int]]]) -> dict[int, list[list[Completion]]]:
    """The kept batches that are batches of this pass (the same index, the same prompts), by index."""
    if path is None or not path.exists():
        return {}
    wanted = {index: prompts for index, prompts in batches}
    kept = {}
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:  # written whole, so never cut; a file edited by hand is read as far as it goes
            break
        if wanted.get(entry.get("batch")) == entry.get("prompts"):
            kept[entry["batch"]] = [[Completion(**one) for one in group] for group in entry["completions"]]
    return kept


def write(path: Path, kept: dict[int, list[list[Completion]]], batches: list[tuple[int, list[int]]]) -> None:
    prompts = dict(batches)
    store.write_jsonl(path, [_line(index, prompts[index], groups) for index, groups in sorted(kept.items())])


def _line(index: int, prompts: list[int], groups: list[list[Completion]]) -> dict[str, Any]:
    return {"batch": index, "prompts": prompts,
            "completions": [[completion.__dict__ for completion in group] for group in groups]}
