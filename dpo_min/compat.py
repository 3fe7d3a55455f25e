"""TRL compatibility: the tables of TRL 1.16's names that dpo_min answers to, in one place.

A script written for TRL runs after changing its imports, and a recipe or command line written for `trl dpo` runs
as written. What that takes, table by table:
- `TRL_FIELDS`: `DPOConfig` fields with no dpo_min field behind them, accepted at TRL's default only;
- `TRL_NEGATIONS`: TRL's `--no_<name>` flags for fields whose default here is already off;
- `TRL_NAMES`, `TRL_WITHOUT_COUNTERPART`: the command's options as TRL names them, and TRL's options with none here;
- `TRL_DTYPES`, `TRL_AUTO_PAD`: TRL's names of a dtype, and its values of `pad_to_multiple_of` that mean None;
- `TRL_ITERABLE_REFUSAL`, `trl_default_output_dir`: TRL's words for a refusal both make, and its default folder;
- `TRL_TAGS`: the hub tags TRL's trainer puts on a model;
- `RECIPE_KEYS`: the alignment-handbook's (and TRL's) recipe keys, what each means for the command (at the end).
None is silently ignored: a value dpo_min cannot honour is refused with a one-line error that names it and says
why. The fields the first two tables name are written in `DPOMinConfig`'s body, and `DPOTrainer`'s public attributes
(`beta`, `loss_types`, ...) in `trl_surface.TRLSurface`, a base of `DPOMinTrainer`. Adding a TRL name is adding
an entry (and its field); a field dpo_min implements leaves the table. One table of published names lives with its
only reader: the mixture forms' keys (`data/mixtures.py`; data/ imports nothing of the core).
"""

from dataclasses import fields
from typing import Any

import torch

# Tags TRL's DPOTrainer puts on the model and its card: people filter the hub on them.
TRL_TAGS = ("trl", "dpo")

# TRL `DPOConfig` fields with no dpo_min field behind them: why another value than TRL's default is refused. Each is a
# field of `DPOMinConfig` with TRL's type and default, so that TRL's keyword arguments and command-line flags parse.
TRL_FIELDS: dict[str, str] = {
    "pad_token": "it is deprecated in TRL; set tokenizer.pad_token on the processing_class instead",  # TRL-internal
}

# TRL's DPOConfig defaults these to True, so HfArgumentParser gives TRL's command line `--no_<name>` for them (TRL's
# own docstring commands pass --no_remove_unused_columns); `DPOMinConfig` has a `no_<name>` field for each.
TRL_NEGATIONS = ("gradient_checkpointing", "remove_unused_columns")


def apply_trl_negations(config: Any) -> None:
    """Set each `<name>` of `TRL_NEGATIONS` to False where `no_<name>` asks for it; refuse both at once."""
    for name in TRL_NEGATIONS:
        if getattr(config, f"no_{name}"):
            if getattr(config, name):
                raise ValueError(f"{name}=True and no_{name}=True contradict each other: give one")
            setattr(config, name, False)


def check_trl_fields(config: Any) -> None:
    """Refuse any TRL-only field set to another value than TRL's default (the field's default)."""
    defaults = {option.name: option.default for option in fields(config)}
    for name, refusal in TRL_FIELDS.items():
        value = getattr(config, name)
        if value != defaults[name]:
            raise ValueError(f"{name}={value!r} is not supported by dpo_min: {refusal} (TRL DPOConfig field, "
                             f"accepted at its default {defaults[name]!r} only)")


# TRL's (ScriptArguments, ModelConfig, DPOConfig) names for the command's options that dpo_min calls otherwise.
TRL_NAMES = {
    "model_name_or_path": "model",
    "dataset_name": "dataset",
    "dataset_train_split": "split",
    "dataset_test_split": "eval_split",
    "dataset_streaming": "streaming",
}

_ANY = object()  # TRL_WITHOUT_COUNTERPART: every value is accepted
# TRL options without a counterpart here: (the value accepted, why). Those that only change speed take any value;
# the others only TRL's default, so that a recipe relying on them fails instead of silently training something else.
TRL_WITHOUT_COUNTERPART: dict[str, tuple[Any, str]] = {
    "ignore_bias_buffers": (_ANY, "LoRA on every linear layer leaves no bias buffers to skip"),
    "bnb_4bit_quant_storage": (_ANY, "the storage dtype is bitsandbytes' default"),
    "lora_target_parameters": (None, "LoRA on parameters (not modules) is not exposed"),
}


def check_trl_option(name: str, value: Any) -> None:
    """Refuse a value of a TRL option in `TRL_WITHOUT_COUNTERPART` that dpo_min cannot honour."""
    accepted, why = TRL_WITHOUT_COUNTERPART[name]
    if accepted is not _ANY and value != accepted:
        raise ValueError(f"TRL's {name}={value!r} is not supported by dpo_min ({why})")


# TRL's `create_model_from_path` names: a dtype given as a string must be one of these, or "auto".
TRL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# TRL's pad_to_multiple_of defaults to "auto", None off AWS Neuron; "none" and "null" are None as a recipe writes it.
TRL_AUTO_PAD = ("auto", "none", "null")


def trl_pad_to_multiple_of(value: Any) -> Any:
    """pad_to_multiple_of as dpo_min reads it: TRL's "auto" (and None spelled as text) is None."""
    return None if isinstance(value, str) and value.lower() in TRL_AUTO_PAD else value


# TRL's own words where dpo_min refuses what TRL refuses, so that checks written against TRL's messages still match.
TRL_ITERABLE_REFUSAL = ("`precompute_ref_log_probs=True` is not supported with IterableDataset (as TRL): use a "
                        "map-style Dataset or set precompute_ref_log_probs=False")


def trl_default_output_dir(model_name: str) -> str:
    """TRL's output folder when no config is given: the model's last name, then -DPO."""
    return f"{model_name.split('/')[-1]}-DPO"


def trl_hub_tags(model: Any, environ: dict[str, str]) -> list[str]:
    """The tags TRL's DPOTrainer adds to the model card: its own, `unsloth` for an Unsloth model, `hf_jobs` inside
    a Hugging Face job."""
    tags = list(TRL_TAGS)
    if hasattr(model.config, "unsloth_version"):
        tags.append("unsloth")
    if "JOB_ID" in environ:
        tags.append("hf_jobs")
    return tags


# ---- the alignment-handbook's recipe keys --------------------------------------------------------------------------
# `RECIPE_KEYS`: keys of the alignment-handbook's recipes (written for transformers 4 and older TRL) that dpo_min spells
# otherwise: key -> its value -> the options it means here ({} when it changes nothing); the command reads a recipe's
# keys and flags through it (train/recipe.py). Each refuses, in one line that says what to write instead, a value it
# cannot honour.
def _warmup_ratio(value: Any) -> dict[str, Any]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"warmup_ratio must be in [0, 1), got {value!r} (transformers 5 reads a warmup_steps of 1 or "
                         "more as a step count: for warmup over N steps write warmup_steps: N)")
    # transformers 5 folded warmup_ratio into warmup_steps: a value below 1 is the same ratio of the training steps,
    # rounded up as transformers 4 rounded warmup_ratio.
    return {"warmup_steps": float(value)}


def _torch_dtype(value: Any) -> dict[str, Any]:
    # The handbook passes torch_dtype to from_pretrained, whose default under transformers 4 is float32: `null` meant
    # float32 weights (bf16: true then trains them in bf16 autocast).
    return {"dtype": "float32" if value is None else value}


def _overwrite_output_dir(value: Any) -> dict[str, Any]:
    if value is not True:
        raise ValueError(f"overwrite_output_dir={value!r} is not supported: dpo_min replaces an earlier run's own "
                         "files in output_dir and refuses a folder holding anything else; drop the key")
    return {}


def _do_train(value: Any) -> dict[str, Any]:
    if value is not True:
        raise ValueError(f"do_train={value!r} is not supported: the command always trains; drop the key (to evaluate "
                         "only, call DPOMinTrainer.evaluate() in Python)")
    return {}


RECIPE_KEYS: dict[str, Any] = {
    "warmup_ratio": _warmup_ratio,
    "torch_dtype": _torch_dtype,
    "overwrite_output_dir": _overwrite_output_dir,
    "do_train": _do_train,
    "hub_model_revision": lambda value: {"hub_revision": value},  # the hub branch the model is pushed to
}
