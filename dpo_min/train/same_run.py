"""One run, resumed: what a resumed run must share with the interrupted one, the settings the run folder records
(`RunFolder.begin`) and compares on resume, once, after the data is read, its digest included (`checked_settings`)."""

import hashlib
import json
import os
from contextlib import suppress
from pathlib import Path
from typing import Any

from ..data.mixtures import held_out_size
from ..losses import LossSettings
from ..records import changes
from .args import OutputDirError
from .run_dir import read_manifest

# What a resumed run must share with the interrupted one (recorded with the run, compared on resume): what decides
# the run's numbers, each as the plan decides it (`Plan.decided_settings`), else as given, and (`resume_keys`) every
# config field the loss reads, as LossSettings lists them. The pairs themselves are recorded too, as PAIRS_DIGEST
# (`pairs_digest`). Any other option (logging, evaluation, saving, speed and memory) may change on resume.
ADAPTER_SETTINGS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_modules_to_save",
                    "lora_task_type", "use_rslora", "use_dora")
RESUME_SETTINGS = (
    # the model, as loaded, and the adapter trained on it
    "model", "model_revision", "dtype", "load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "use_bnb_nested_quant",
    "use_peft", *ADAPTER_SETTINGS,
    # the order of the pairs
    "per_device_train_batch_size", "gradient_accumulation_steps", "world_size", "max_steps", "num_train_epochs",
    "seed", "data_seed", "train_sampling_strategy", "dataloader_drop_last", "group_by_prompt",
    # the data and its held-out split
    "dataset", "dataset_config", "split", "datasets", "eval_split", "eval_fraction", "max_eval_samples",
    "dataset_mixture", "dataset_mixer", "dataset_splits", "dataset_configs", "test_split_size",
    # tokenization and truncation
    "chat_template", "chat_template_kwargs", "max_length", "max_prompt_length", "truncation_mode",
    # the optimizer and the schedule
    "optim", "optim_args", "optim_target_modules", "learning_rate", "weight_decay", "adam_beta1", "adam_beta2",
    "adam_epsilon", "max_grad_norm", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps",
    # the arithmetic and the reference
    "bf16", "fp16", "disable_dropout", "neftune_noise_alpha", "sync_ref_model", "ref_model_mixup_alpha",
    "ref_model_sync_steps",
)
# Settings read only when another holds: recorded as None otherwise, so a resume may spell them any way.
READ_ONLY_WHEN = {
    "use_peft": ADAPTER_SETTINGS, "load_in_4bit": ("bnb_4bit_quant_type", "use_bnb_nested_quant"),
    "sync_ref_model": ("ref_model_mixup_alpha", "ref_model_sync_steps"),
}
# Settings an earlier record left to the plan (None) and a record now holds as decided: not compared with None.
LEFT_TO_THE_PLAN = ("data_seed", "eval_fraction")
PAIRS_DIGEST = "pairs (sha256)"


def resume_keys() -> tuple[str, ...]:
    """RESUME_SETTINGS and the loss's config fields, read now: a loss type added with a field of its own joins."""
    return (*RESUME_SETTINGS, *LossSettings.config_fields())


def resume_settings(*option_sets: Any, decided: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `resume_keys` of a run, each as `decided` holds it (the plan's decisions), else taken from the first of
    `option_sets` (model, data, training options) that has it, in the form that compares what the run does: a local
    model or dataset by its absolute path (a resume from another working folder names the same one), test_split_size
    as the number it spells, a chat template by its sha256, and what is not read (READ_ONLY_WHEN; a data file's
    one config "default"; num_train_epochs beside max_steps) as None."""
    decided = decided or {}
    settings = {}
    for name in resume_keys():
        value = decided[name] if name in decided else next(
            (getattr(options, name) for options in option_sets if hasattr(options, name)), None)
        settings[name] = json.loads(json.dumps(_recorded(name, value), default=str))  # as the manifest gives it back
    return _as_read(settings)


def _as_read(settings: dict[str, Any]) -> dict[str, Any]:
    """`settings` with what the run does not read set to None (a record's too, an earlier version's included)."""
    settings = dict(settings)
    for condition, names in READ_ONLY_WHEN.items():
        if condition in settings and not settings[condition]:
            settings.update(dict.fromkeys(names))
    dataset = settings.get("dataset")
    if isinstance(dataset, str) and os.path.isfile(dataset) and settings.get("dataset_config") == "default":
        settings["dataset_config"] = None  # the loader reads a data file's one config by either name
    if isinstance(settings.get("max_steps"), int) and settings["max_steps"] > 0 and "num_train_epochs" in settings:
        settings["num_train_epochs"] = None  # Trainer stops at max_steps, whatever the epochs
    return settings


def _recorded(name: str, value: Any) -> Any:
    """One setting's value in the form a resume compares."""
    if name in ("model", "dataset") and isinstance(value, str) and os.path.exists(value):
        return os.path.abspath(value)
    if name == "test_split_size":  # text on the command line, a number in a recipe: the number either way
        with suppress(ValueError):  # one the mixture refuses is refused when it is read
            return held_out_size(value)
    if name == "chat_template" and isinstance(value, str):  # pages of Jinja: the message shows 12 hex digits
        return hashlib.sha256(value.encode()).hexdigest()
    if name in ("lr_scheduler_kwargs", "chat_template_kwargs"):  # none given is none at all
        return _parsed(value) or {}
    if name in ("lora_target_modules", "lora_modules_to_save") and isinstance(value, list):  # peft reads a set
        return sorted(value)
    return value


def pairs_digest(*datasets: Any) -> str:
    """sha256 of the pairs' text, in order (train, then held-out pairs; None and streamed data skipped): a data file
    replaced in place, or another file under the same name, gives another digest."""
    digest = hashlib.sha256()
    for dataset in datasets:
        if dataset is None or not hasattr(dataset, "__len__"):
            continue
        digest.update(f"{len(dataset)}|".encode())
        for batch in dataset.iter(batch_size=1000):
            digest.update(json.dumps(batch, sort_keys=True, ensure_ascii=False, default=str).encode())
    return digest.hexdigest()


def checked_settings(settings: dict[str, Any], checkpoint: str | None, pairs: tuple[Any, ...] = ()) -> dict[str, Any]:
    """The settings this run records (`RunFolder.begin`): the plan's `settings`, with the digest of `pairs` (train,
    then held-out) where given (a run with checkpoints, `Plan.records_pairs`); when the run resumes `checkpoint`,
    checked once against the interrupted run's record, the pairs included."""
    if pairs:
        settings = {**settings, PAIRS_DIGEST: pairs_digest(*pairs)}
    check_same_run(checkpoint, settings)
    return settings


def check_same_run(checkpoint: str | None, settings: dict[str, Any]) -> None:
    """Refuse to resume with settings that would train another run: another model or adapter, other pairs or the
    same pairs in another order, cut or rendered otherwise, another loss, optimizer or schedule; only what both the
    record and `settings` hold is compared (a record from an earlier version holds fewer)."""
    if checkpoint is None:
        return
    recorded = read_manifest(Path(checkpoint).parent).get("data_settings")
    if not recorded:
        return
    recorded, settings = _as_read(recorded), _as_read(settings)
    changed = [change for name, value in settings.items()
               if name in recorded and not (name in LEFT_TO_THE_PLAN and recorded[name] is None)
               for change in changes(name, *map(_parsed, (recorded[name], value)))]
    if changed:
        raise OutputDirError(f"cannot resume {checkpoint} with other settings ({', '.join(changed)}): they decide "
                             "what the run trains; resume with the interrupted run's values, or start a new run in "
                             "another folder")


def _parsed(value: Any) -> Any:
    """A mixture as its JSON text (a record from before flags were parsed) -> the list or mapping it spells."""
    if isinstance(value, str) and value.lstrip()[:1] in ("[", "{"):
        with suppress(ValueError):
            return json.loads(value)
    return value
