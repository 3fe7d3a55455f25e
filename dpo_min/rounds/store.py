"""What a run leaves under its output folder, and how a resume reads it back:

    settings.json            the settings a resume must share (refused otherwise)
    held_out.jsonl           the held-out greedy reward: round 0 (pi_0), then after each round
    rounds.jsonl             one line per finished round
    held_out.png             the held-out reward against the round, with its 95% interval
    round-K/generated.jsonl  the round's samples before scoring (a kill while scoring does not regenerate them)
    round-K/samples.jsonl    every sample with its reward per function and the sum
    round-K/pairs.jsonl      the round's pairs, in the explicit-prompt layout the command reads back
    round-K/train/           the round's DPO run (its checkpoint-N folders: a half-trained round resumes there)
    round-K/checkpoint/      the policy after the round (the adapter with LoRA)

Every file is written whole to a temporary name, then renamed: a kill leaves it complete or absent.
"""

import json
import os
from pathlib import Path
from typing import Any

from .config import RoundsError


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    os.replace(staging, path)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


class RunFolder:
    def __init__(self, output_dir: str | os.PathLike):
        self.root = Path(output_dir)

    def round_dir(self, round_index: int) -> Path:
        folder = self.root / f"round-{round_index}"
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def claim(self, settings: dict[str, Any]) -> bool:
        """Write the settings of a new run, or check a resume's against them; True when resuming."""
        path = self.root / "settings.json"
        settings = json.loads(json.dumps(settings))  # as JSON reads it back: tuples as lists
        if path.exists():
            saved = json.loads(path.read_text())
            changed = [f"{name} {saved.get(name)!r} there, {settings.get(name)!r} now"
                       for name in sorted(set(saved) | set(settings)) if saved.get(name) != settings.get(name)]
            if changed:
                raise RoundsError(f"{self.root} holds a run with other settings ({'; '.join(changed)}): resume it "
                                  "with the same ones, or give another output_dir")
            return True
        self.root.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(settings, indent=1) + "\n")
        return False

    def finished_rounds(self) -> list[dict[str, Any]]:
        return read_jsonl(self.root / "rounds.jsonl")

    def held_out(self) -> list[dict[str, Any]]:
        return read_jsonl(self.root / "held_out.jsonl")

    def append(self, name: str, row: dict[str, Any]) -> None:
        path = self.root / name
        write_jsonl(path, [*read_jsonl(path), row])

    def last_checkpoint(self) -> Path | None:
        """The policy after the last finished round that trained (a skipped round has none)."""
        for line in reversed(self.finished_rounds()):
            folder = self.root / f"round-{line['round']}" / "checkpoint"
            if folder.is_dir():
                return folder
        return None
