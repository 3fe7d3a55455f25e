"""Precomputed reference log-probs cached on disk, so that a second run on the same data skips the reference pass.

An entry lives in `$DPO_MIN_CACHE/ref_logps/` (default `~/.cache/dpo_min/ref_logps/`) under a key that hashes
- the weights the reference computes with: every tensor's name, shape, dtype and values; a tensor of more than
  `SAMPLE_VALUES` values contributes an evenly strided sample of about that many values (so hashing a 7B model
  takes seconds, not minutes; a fine-tune or merge changes every value of a matrix, so its sample too),
- the tokenized pairs (prompt/chosen/rejected ids, in order), after truncation,
- the settings that change the numbers (truncation settings, ld_alpha, which reference).
Entries are written to a temporary file and renamed into place: an interrupted run leaves no partial entry. What
an interrupted reference pass had finished is kept beside it, batch by batch (`<key>.partial.pt`, `save_partial`),
and the next pass with the same key starts after those batches; the whole entry replaces it.
"""

import contextlib
import hashlib
import json
import logging
import os
import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from datasets import Dataset

from .files import staged, writing
from .models import cache_dir

logger = logging.getLogger(__name__)
SAMPLE_VALUES = 1 << 20


def fingerprint_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(named_tensors, key=lambda item: item[0]):
        flat = tensor.detach().reshape(-1)
        if flat.numel() > SAMPLE_VALUES:
            flat = flat[:: flat.numel() // SAMPLE_VALUES]
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(flat.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()


def fingerprint_pairs(dataset: Dataset) -> str:
    table = dataset.with_format("arrow")[:]  # honours select()/shuffle() index mappings, unlike dataset.data
    digest = hashlib.sha256()
    for name in ("prompt_ids", "chosen_ids", "rejected_ids"):
        column = table.column(name).combine_chunks()
        for values in (column.value_lengths(), column.flatten()):
            digest.update(np.asarray(values, dtype=np.int64).tobytes())
    return digest.hexdigest()


def cache_key(reference_weights: Iterable[tuple[str, torch.Tensor]], dataset: Dataset,
              settings: dict[str, Any]) -> str:
    description = {"weights": fingerprint_tensors(reference_weights), "pairs": fingerprint_pairs(dataset), **settings}
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:32]


def _path(key: str) -> Path:
    return cache_dir() / "ref_logps" / f"{key}.pt"


def load(key: str, num_pairs: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(chosen [N], rejected [N]) reference log-probs, or None when there is no usable entry.

    An entry that cannot be read or does not hold two [N] float tensors is moved aside (to `<key>.pt.bad`, kept for
    a look) with a warning that says why, and the log-probs are recomputed."""
    path = _path(key)
    if not path.exists():
        return None
    try:
        saved = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as error:
        return _move_aside(path, f"unreadable ({str(error).strip().splitlines()[0] if str(error) else type(error)})")
    problem = _entry_problem(saved, num_pairs)
    if problem:
        return _move_aside(path, problem)
    return saved["chosen"], saved["rejected"]


def _entry_problem(saved: Any, num_pairs: int) -> str | None:
    if not isinstance(saved, dict) or set(saved) != {"chosen", "rejected"}:
        keys = sorted(map(str, saved)) if isinstance(saved, dict) else type(saved).__name__
        return f"holds {keys}, not the keys ['chosen', 'rejected']"
    for name, value in saved.items():
        if not isinstance(value, torch.Tensor) or value.shape != (num_pairs,) or not value.is_floating_point():
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            return f"{name!r} is {shape}, not a float tensor of shape ({num_pairs},)"
    return None


def _move_aside(path: Path, problem: str) -> None:
    aside = path.with_name(path.name + ".bad")
    with contextlib.suppress(FileNotFoundError):  # another process of the run moved it first
        os.replace(path, aside)
    logger.warning("reference log-prob cache %s %s: moved to %s, recomputing", path, problem, aside)
    return None


def save(key: str, chosen: torch.Tensor, rejected: torch.Tensor) -> Path:
    path = _path(key)
    _write(path, {"chosen": chosen, "rejected": rejected})
    _partial_path(key).unlink(missing_ok=True)  # the whole entry holds every batch the partial one held
    return path


def _partial_path(key: str) -> Path:
    return cache_dir() / "ref_logps" / f"{key}.partial.pt"


def save_partial(key: str, chosen: list[torch.Tensor], rejected: list[torch.Tensor]) -> None:
    """The log-probs of the batches a pass has finished, in order (one [batch] tensor each): the pass that computes
    the same key next starts after them."""
    _write(_partial_path(key), {"chosen": chosen, "rejected": rejected})


def load_partial(key: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The finished batches an interrupted pass kept (`save_partial`), or two empty lists; an entry that cannot be
    read is moved aside as a whole one is."""
    path = _partial_path(key)
    if not path.exists():
        return [], []
    try:
        saved = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as error:
        _move_aside(path, f"unreadable ({str(error).strip().splitlines()[0] if str(error) else type(error)})")
        return [], []
    batches = saved.get("chosen") if isinstance(saved, dict) else None
    if not isinstance(batches, list) or not isinstance(saved.get("rejected"), list) \
            or len(batches) != len(saved["rejected"]):
        _move_aside(path, "does not hold two equally long lists of batches")
        return [], []
    return batches, saved["rejected"]


def _write(path: Path, content: dict[str, Any]) -> None:
    with writing(f"the reference log-probs to their cache ({path.parent})"):
        path.parent.mkdir(parents=True, exist_ok=True)
        with staged(path) as staging, open(staging, "wb") as file:
            torch.save(content, file)
