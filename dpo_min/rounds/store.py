"""What a run leaves under its output folder, and how a resume reads it back:

    settings.json            the settings a resume must share (refused otherwise)
    held_out.jsonl           the held-out greedy reward: round 0 (pi_0), then after each round
    rounds.jsonl             one line per finished round
    held_out.png             the held-out reward against the round, with its 95% interval
    rounds.png               that, beside each round's completions by their prompt's outcome (spend.py)
    round-K/draw.json        with dynamic_sampling or skip_saturated: the prompts skipped, the refills, the generate()
                             calls (draws.py); written before generated.jsonl
    round-K/generated.jsonl  the round's samples before scoring (a kill while scoring does not regenerate them)
    round-K/generated.partial.jsonl, held_out-K.partial.jsonl
                             the batches a stopped sampling or held-out pass finished (kept.py), until replaced
    round-K/samples.jsonl    every sample with its reward per function and the sum
    round-K/pairs.jsonl      the round's pairs, in the explicit-prompt layout the command reads back
    round-K/train/           the round's DPO run (its checkpoint-N folders: a half-trained round resumes there)
    round-K/checkpoint/      the policy after the round (the adapter with LoRA)

Every file is written whole (dpo_min.files, the package's one writer): a kill leaves it complete or absent.

The folder's lock and its checks are the command's (dpo_min.train.run_dir.RunFolder, for `--rounds` as for an offline
run); `RoundFiles` is only the rounds' layout in it and their resume record.
"""

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..files import staged, write_failure, write_whole
from ..records import ABSENT, changes
from ..tokenizing import template_fingerprint
from .config import RoundsError

# Settings an earlier version's settings.json lacks: a resume of such a run compares them only once recorded.
RECORDED_SINCE = ("model", "reward_identity")
# Keys of each reward_identity entry that an earlier version's lacks (rewards.Rewards.identity): compared once recorded.
IDENTITY_SINCE = ("code (sha256)", "weights (sha256)")
# Settings a resume may lengthen: one temperature (or step count) per round, a list that rounds added to the run
# extend (the old list its start); settings.json then records the longer one.
EXTENDABLE = ("temperature", "round_max_steps")


@contextmanager
def writing(target: Path) -> Iterator[None]:
    """A full or failing disk while writing `target` is one line naming it (RoundsError), not a traceback from deep in
    the writer (safetensors', torch's short write): the offline command's words, dpo_min.files.write_failure. The
    file it was writing is left absent or whole (each is staged, then renamed)."""
    try:
        yield
    except Exception as error:
        message = write_failure(error, str(target))
        if message is None:
            raise
        raise RoundsError(message) from None


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    with writing(path):
        write_whole(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def write_json(path: Path, value: Any) -> None:
    with writing(path):
        write_whole(path, json.dumps(value))


@contextmanager
def written_whole(path: Path) -> Iterator[Path]:
    """Where a writer of its own (matplotlib, save_model) puts `path`, staged and renamed (dpo_min.files.staged),
    a full disk one line naming it."""
    with writing(path), staged(path) as staging:
        yield staging


def model_record(model: Any, tokenizer: Any) -> dict[str, Any]:
    """What the numbers depend on that a library caller's model and tokenizer say of themselves: the weights' name or
    folder, their dtype, and the chat template by sha256 (a resume on another base would put the finished rounds'
    adapter on it)."""
    return {"name_or_path": getattr(getattr(model, "config", None), "_name_or_path", None),
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "chat_template (sha256)": template_fingerprint(tokenizer)}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _extends(old: Any, new: Any) -> bool:
    """Whether one list of per-round values starts with the other: the rounds both name are sampled alike (a
    resume with more rounds, or with fewer, where the rounds past the shorter are not run)."""
    if not (isinstance(old, list) and isinstance(new, list)):
        return False
    shorter, longer = sorted((old, new), key=len)
    return longer[:len(shorter)] == shorter


def _as_recorded(saved: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """`settings` with each reward_identity entry without the IDENTITY_SINCE keys that the saved entry lacks."""
    old, new = saved.get("reward_identity"), settings.get("reward_identity")
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return settings
    trimmed = {name: {key: value for key, value in entry.items()
                      if key not in IDENTITY_SINCE or key in old.get(name, {key: None})}
               for name, entry in new.items()}
    return {**settings, "reward_identity": trimmed}


class RoundFiles:
    """The rounds' files under output_dir (the module's docstring lists them) and their resume record,
    settings.json. Not the folder's lock or checks: the command's RunFolder owns those."""

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
            settings = _as_recorded(saved, settings)
            extended = {name: settings[name] for name in EXTENDABLE if _extends(saved.get(name), settings.get(name))}
            changed = [change for name in sorted(set(saved) | set(settings))
                       if (name in saved or name not in RECORDED_SINCE) and name not in extended
                       for change in changes(name, saved.get(name, ABSENT), settings.get(name, ABSENT))]
            if changed:
                raise RoundsError(f"{self.root} holds a run with other settings ({'; '.join(changed)}): resume it "
                                  "with the same ones, or give another output_dir")
            if any(len(value) > len(saved[name]) for name, value in extended.items()):
                with writing(path):
                    write_whole(path, json.dumps({**saved, **extended}, indent=1) + "\n")
            return True
        self.root.mkdir(parents=True, exist_ok=True)
        with writing(path):
            write_whole(path, json.dumps(settings, indent=1) + "\n")
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
