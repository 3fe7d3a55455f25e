"""Resuming an interrupted run: the checkpoint to resume from (`resolve_checkpoint`, whole or refused), found by the
folder phase (`RunFolder.claimed`). What the resumed run must share with the interrupted one is same_run.py's."""

import json
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

from .args import OutputDirError

# What a checkpoint needs to resume exactly, beside the model weights: file -> what it restores.
CHECKPOINT_FILES = {"optimizer.pt": "optimizer", "scheduler.pt": "scheduler", "trainer_state.json": "trainer state"}
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin", "model.safetensors", "pytorch_model.bin",
                "model.safetensors.index.json", "pytorch_model.bin.index.json")


# A checkpoint Trainer saved with save_only_model: whole weights and trainer state, and none of the optimizer's,
# scheduler's or RNG's files (a cut save is never published: checkpoints.py stages it).
MODEL_ONLY = "saved with --save_only_model: no optimizer state"
_MODEL_ONLY_CANNOT = ("holds the weights alone, no optimizer state, so it cannot resume a run: train from its weights "
                      "in a new run, or save checkpoints without --save_only_model to resume")


# ---- checkpoints ------------------------------------------------------------------------------------------------
def checkpoint_problems(checkpoint: Path) -> list[str]:
    """Why `checkpoint` cannot resume a run exactly (empty when it is whole): missing or truncated files, or
    MODEL_ONLY alone for one saved with save_only_model."""
    problems = _missing_or_cut(checkpoint)
    model_only = {"no optimizer.pt", "no scheduler.pt", "no rng_state.pth"}
    return [MODEL_ONLY] if set(problems) == model_only else problems


def _missing_or_cut(checkpoint: Path) -> list[str]:
    problems = []
    weights = [checkpoint / name for name in WEIGHT_FILES if (checkpoint / name).exists()]
    if not weights:
        problems.append("no model weights")
    problems += [f"{path.name} is truncated" for path in weights if not _is_whole(path)]
    for name in CHECKPOINT_FILES:
        path = checkpoint / name
        if not path.exists():
            problems.append(f"no {name}")
        elif not _is_whole(path):
            problems.append(f"{name} is truncated")
    if not any(checkpoint.glob("rng_state*.pth")):
        problems.append("no rng_state.pth")
    return problems


def _is_whole(path: Path) -> bool:
    """A cheap test for a file cut short: zip archives (torch.save) end with their directory, safetensors' header
    states the data's length, JSON must parse."""
    try:
        if path.suffix in (".pt", ".pth", ".bin"):
            return zipfile.is_zipfile(path)
        if path.suffix == ".json":
            json.loads(path.read_text())
            return True
        if path.suffix == ".safetensors":
            with open(path, "rb") as file:
                header_size = int.from_bytes(file.read(8), "little")
                header = json.loads(file.read(header_size))
            end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
            return path.stat().st_size == 8 + header_size + end
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


def resolve_checkpoint(resume_from_checkpoint: str | None, staging: Path,
                       warn: Callable[[str], None] = lambda text: print(text, file=sys.stderr)) -> str | None:
    """`latest` -> the newest whole checkpoint of the interrupted run, naming the incomplete ones skipped; a path ->
    itself, when it is a whole checkpoint. Raises OutputDirError."""
    if resume_from_checkpoint is None:
        return None
    if resume_from_checkpoint != "latest":
        path = Path(resume_from_checkpoint)
        if not path.is_dir():
            raise OutputDirError(f"--resume_from_checkpoint {path}: no such folder")
        problems = checkpoint_problems(path)
        if problems == [MODEL_ONLY]:
            raise OutputDirError(f"--resume_from_checkpoint {path} was saved with --save_only_model: it "
                                 f"{_MODEL_ONLY_CANNOT}")
        if problems:
            raise OutputDirError(f"--resume_from_checkpoint {path} is incomplete: {', '.join(problems)}")
        return str(path)
    checkpoints = sorted((path for path in staging.glob("checkpoint-*") if path.name.split("-")[-1].isdigit()),
                         key=lambda path: int(path.name.split("-")[-1]), reverse=True) if staging.is_dir() else []
    skipped = []
    for path in checkpoints:
        problems = checkpoint_problems(path)
        if not problems:
            if skipped:
                warn(f"--resume_from_checkpoint latest: skipped incomplete {'; '.join(skipped)}")
            return str(path)
        skipped.append(f"{path.name} ({', '.join(problems)})")
    raise OutputDirError(f"--resume_from_checkpoint latest: no whole checkpoint in {staging}"
                         + (f" (incomplete: {'; '.join(skipped)})" if skipped else "")
                         + (f"; a checkpoint saved with --save_only_model {_MODEL_ONLY_CANNOT}"
                            if any(MODEL_ONLY in entry for entry in skipped) else ""))
