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
    if path is None:
        return {}
    wanted = {index: prompts for index, prompts in batches}
    kept = {}
    for entry in _entries(path):  # written whole, so never cut; a file edited by hand is read as far as it goes
        if wanted.get(entry.get("batch")) == entry.get("prompts"):
            kept[entry["batch"]] = [[Completion(**one) for one in group] for group in entry["completions"]]
    return kept


def write(path: Path, kept: dict[int, list[list[Completion]]], batches: list[tuple[int, list[int]]]) -> None:
    """The pass's finished batches, beside the kept batches of its other calls (dynamic sampling's earlier waves,
    draws.py: batches numbered on across the round's calls)."""
    prompts = dict(batches)
    others = [entry for entry in _entries(path)
              if isinstance(entry.get("batch"), int) and entry["batch"] not in prompts]
    lines = others + [_line(index, prompts[index], groups) for index, groups in kept.items()]
    store.write_jsonl(path, sorted(lines, key=lambda line: line["batch"]))


def _entries(path: Path) -> list[dict[str, Any]]:
    entries = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:  # as read() does: as far as it goes
            break
        if isinstance(entry, dict):
            entries.append(entry)
    return entries


def _line(index: int, prompts: list[int], groups: list[list[Completion]]) -> dict[str, Any]:
    return {"batch": index, "prompts": prompts,
            "completions": [[completion.__dict__ for completion in group] for group in groups]}
