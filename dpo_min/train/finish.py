"""The run's last phases: training (`run_training`: train, the held-out figures before and after, the weights saved
into the staging folder) and, on the main process, `publish_run` (metrics, curves and card written, the folder
published, pushed). Every file written here names itself when the disk refuses it (dpo_min.files.writing): `main`
says that name in one line."""

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..files import staged, write_whole, writing
from ..trainer import DPOMinTrainer
from .card import model_card
from .hub import push
from .pairs import pair_count, stream_rows_checked
from .plan import Plan
from .report import (
    all_finite,
    collapse_warnings,
    describe_change,
    describe_held_out,
    format_samples,
    logprob_margins,
    plot_training,
    tie_figures,
)
from .samples import Samples


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
    # A checkpoint and the reference log-prob cache name their own writes (the trainer has removed a cut checkpoint);
    # what else train() writes is the samples or TensorBoard events.
    with writing(f"the samples or TensorBoard events to {staging}"), stream_rows_checked(plan.data.streaming):
        train_metrics = trainer.train(resume_from_checkpoint=checkpoint).metrics
    before, after = _held_out_before_after(trainer, has_held_out, plan.ties_at_start and has_held_out, _say(plan))
    with writing(f"the final weights to {staging}"):
        model = _save_weights(trainer, plan.saved_as == "merged", staging, plan.is_main)
    return Results(train_metrics, before, after, model)


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


def publish_run(trainer: DPOMinTrainer, plan: Plan, samples: Samples, results: Results, sources: dict[str, Any],
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
    card = run_card(plan, metrics, sources, trainer.reference.description)
    with writing(f"metrics.json to {staging}"):
        write_whole(staging / "metrics.json", json.dumps(metrics, indent=2, allow_nan=True) + "\n")
    with writing(f"training_curves.png to {staging}"), staged(staging / "training_curves.png") as plot_file:
        plot_training(trainer.state.log_history, plot_file)
    policy_margins = logprob_margins(results.model, trainer.data_collator, samples.pairs,
                                     "the trained policy's margins of the samples", plan.args.disable_tqdm)
    shown = format_samples(samples.prompts, samples.reference_texts, samples.completions.latest,
                           list(zip(samples.reference_margins, policy_margins)))
    with writing(f"README.md to {staging}"):
        write_whole(staging / "README.md", card)
    plan.folder.publish()  # the folder resolved and locked at the start, wherever a link may point by now
    _say_results(say, len(samples.prompts), shown, results.after, samples.completions.latest)
    say(f"wrote {', '.join(sorted(path.name for path in plan.folder.output_dir.iterdir()))} to {plan.folder.named} "
        f"in {wall_time:.0f} s")
    if plan.push:
        say(f"pushed to {push(plan.folder, plan.repo_id, plan.args)}")


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


def _say_results(say: Any, prompt_count: int, samples: str, after: dict[str, float], completions: list[str]) -> None:
    if samples:
        say(f"\ngreedy completions of the first {prompt_count} held-out prompts, by the reference and by the trained "
            f"policy, and each pair's log-prob margin (chosen answer over rejected) under both:\n{samples}")
    if after and not all_finite(after):
        say("warning: the held-out figures are not finite")
    for warning in collapse_warnings(after, completions):
        say(f"WARNING: {warning}")


def _say(plan: Plan) -> Callable[..., None]:
    return print if plan.is_main else (lambda *_, **__: None)
