"""What the command shows and writes besides the model: held-out figures, a plot of the run, greedy samples."""

import dataclasses
import json
import math
import unicodedata
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import ProgressCallback, TrainerCallback
from transformers.trainer_utils import has_length

from ..data.streams import describe_stream_counts, stream_counts
from ..intervals import mean_interval, wilson_interval
from ..logps import sequence_logps
from ..losses import LossSettings
from ..rounds.progress import TokenSteps, phase_bar
from ..tokenizing import render_prompts, template_kwargs_of

# The held-out figures the command prints and compares (TRL's names) and how they are shown.
HEADLINE = {"reward accuracy": ("eval_rewards/accuracies", ".4f"), "mean margin": ("eval_rewards/margins", "+.4f"),
            "loss": ("eval_loss", ".4f"), "drift chosen": ("eval_drift/chosen", "+.4f"),
            "drift rejected": ("eval_drift/rejected", "+.4f")}
# |drift| per token above which the policy has left the reference behind: e^-1 of the reference's probability per
# token, on average; DPO runs that stay useful move a few hundredths.
DRIFT_ALARM = 1.0
PLOTTED = {"loss": "loss", "reward accuracy": "rewards/accuracies", "reward margin": "rewards/margins"}


class LiveLossBar(ProgressCallback):
    """Trainer's progress bars, labelled (Trainer's own say only "0/12"), with the latest loss, accuracy and margin in
    the training bar instead of a line of logs."""

    # ProgressCallback's two bars, each labelled as it is made: a bar prints itself when made.
    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.training_bar = tqdm(total=state.max_steps, desc="training", dynamic_ncols=True)
        self.current_step = 0

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if state.is_world_process_zero and has_length(eval_dataloader):
            if self.prediction_bar is None:
                self.prediction_bar = tqdm(total=len(eval_dataloader), desc="held-out evaluation",
                                           leave=self.training_bar is None, dynamic_ncols=True)
            self.prediction_bar.update(1)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None and logs and "loss" in logs:
            self.training_bar.set_postfix(loss=f"{logs['loss']:.4f}", acc=f"{logs.get('rewards/accuracies', 0):.2f}",
                                          margin=f"{logs.get('rewards/margins', 0):+.3f}")


class HeldOutPrinter(TrainerCallback):
    """Prints the headline held-out figures after each evaluation before the last step, above the progress bar (the
    command's closing block says the final ones, with their intervals: `describe_held_out`)."""

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if not state.is_world_process_zero or not metrics or 0 < state.max_steps <= state.global_step:
            return
        when = "before training" if state.global_step == 0 else f"at step {state.global_step}"
        with_reference = args.loss_settings.reads_reference  # reference-free rewards start at log p
        note = "  (the policy starts as the reference: rewards are 0)" if state.global_step == 0 and with_reference \
            else ""
        tqdm.write(f"held-out {when}: {describe(metrics)}{note}")


def describe_plan(args: Any, train_pairs: int, train_groups: int | None = None) -> str:
    """'training: 8 steps (0.01 epochs of 2196 pairs), global batch 4 (...), learning rate 0.0005 ...' before a run.
    `train_groups` where a batch counts whole groups (plackett_luce): the epochs and the batch are counted in them."""
    global_batch = args.global_batch_size
    units = train_pairs if train_groups is None else train_groups
    batches = math.ceil(units / (args.per_device_train_batch_size * args.world_size))
    steps_per_epoch = max(batches // args.gradient_accumulation_steps, 1)  # as Trainer counts them
    if args.max_steps > 0:
        steps, epochs = args.max_steps, args.max_steps / steps_per_epoch
    else:
        steps, epochs = math.ceil(args.num_train_epochs * steps_per_epoch), args.num_train_epochs
    data = f"{train_pairs} pairs" if train_groups is None else f"{_count(train_groups, 'group')}, {train_pairs} pairs"
    batch = f"{global_batch}" if train_groups is None else _count(global_batch, "group")
    return (f"training: {_count(steps, 'step')} ({_count(f'{epochs:.3g}', 'epoch')} of {data}), global batch {batch} "
            f"({args.per_device_train_batch_size} per device x {args.gradient_accumulation_steps} "
            f"accumulation x {_count(args.world_size, 'process', 'processes')}), learning rate "
            f"{args.learning_rate:g} ({args.lr_scheduler_type.value}, warmup {_warmup(args, steps)})")


def describe_rounds_plan(plan: Any, config: Any, train_prompts: int, held_out: int) -> str:
    """'model ... | 3 rounds of 32 of 2936 training prompts, 8 samples each | 64 held-out prompts | LoRA r=16 |
    output ...': a rounds run's one line before it starts, as `describe_plan` and the model line of an offline run."""
    drawn = "all" if config.prompts_per_round is None else config.prompts_per_round
    trained = f"LoRA r={plan.model.lora_r}" if plan.trains_adapter else "full fine-tuning"
    return (f"model {plan.model_name} | {_count(config.rounds, 'round')} of {drawn} of {train_prompts} training "
            f"prompts, {config.num_generations} samples each | {held_out} held-out prompts | {trained} | output "
            f"{plan.folder.named}")


def _count(number: Any, noun: str, plural: str | None = None) -> str:
    """'1 epoch', '0.5 epochs', '2 processes': the noun as the number reads."""
    return f"{number} {noun if str(number) == '1' else plural or noun + 's'}"


def _warmup(args: Any, steps: int) -> str:
    """'8' or, for a ratio (warmup_steps below 1, the handbook's warmup_ratio), '1 step (0.1 of 8)'."""
    if args.warmup_steps >= 1 or args.warmup_steps == 0:
        return f"{int(args.warmup_steps)}"
    count = args.get_warmup_steps(steps)
    return f"{count} step{'s' if count != 1 else ''} ({args.warmup_steps:g} of {steps})"


def describe(metrics: dict[str, float]) -> str:
    """'reward accuracy 0.625, mean margin +0.041, loss 0.6812' from an evaluation's metrics."""
    return ", ".join(f"{name} {metrics[key]:{style}}" for name, (key, style) in HEADLINE.items() if key in metrics)


def describe_change(before: dict[str, float], after: dict[str, float]) -> str:
    """'reward accuracy 0.0000 -> 0.6250, ...' from two evaluations."""
    return ", ".join(f"{name} {_shown(before[key]):{style}} -> {_shown(after[key]):{style}}"
                     for name, (key, style) in HEADLINE.items() if key in before and key in after)


def _shown(value: float) -> float:
    """`value` as 4 decimals show it, with no negative zero: a mean of ties, or -0.00001, is never "-0.0000"."""
    return round(value, 4) + 0.0


def is_empty_completion(text: str) -> bool:
    """True when no character would show: whitespace, zero-width and other format or control characters only."""
    return not any(unicodedata.category(char)[0] not in "CZ" for char in text)


def collapse_warnings(after: dict[str, float], policy_texts: list[str]) -> list[str]:
    """Signs that the trained policy collapsed, which the reward figures do not show."""
    warnings = []
    empty = sum(map(is_empty_completion, policy_texts))
    if empty:
        warnings.append(f"{empty} of {len(policy_texts)} completions of the trained policy are empty: it may have "
                        "collapsed (try a lower --learning_rate)")
    for name in ("chosen", "rejected"):
        drift = after.get(f"eval_drift/{name}")
        if drift is not None and not abs(drift) <= DRIFT_ALARM:
            warnings.append(f"the policy drifted {drift:+.2f} nats per token from the reference on {name} "
                            f"completions (alarm at {DRIFT_ALARM}): the reward figures say little about such a model")
    return warnings


def describe_ties(pairs: int, loss_type: Any) -> str:
    """Before training, when the policy is the reference: what every held-out figure is by definition."""
    tie = tie_loss(loss_type)
    loss = f", loss ln 2 = {tie:.4f}" if tie is not None else ""
    return (f"held-out before training: all {pairs} pairs are ties by definition (the policy starts as the reference, "
            f"so every reward is 0): reward accuracy 0/{pairs}, mean margin 0{loss}; no pass is spent measuring it")


def tie_loss(loss_type: Any) -> float | None:
    """The loss of a pair whose policy is its reference, as the loss table gives it (`LossSettings.tie_loss`: ln 2
    for sigmoid alone), or None."""
    return LossSettings.of([loss_type] if isinstance(loss_type, str) else loss_type).tie_loss


def tie_figures(loss_type: Any) -> dict[str, float]:
    """The held-out figures of a policy that is its reference, stated instead of measured (TRL's names)."""
    figures = {key: 0.0 for key in ("eval_rewards/chosen", "eval_rewards/rejected", "eval_rewards/accuracies",
                                     "eval_rewards/margins", "eval_drift/chosen", "eval_drift/rejected")}
    if tie_loss(loss_type) is not None:
        figures["eval_loss"] = tie_loss(loss_type)
    return figures


def describe_held_out(after: dict[str, float], margins: list[float]) -> str:
    """After training: the reward accuracy with its Wilson interval, the mean margin with its interval over pairs."""
    pairs = len(margins)
    wins = sum(margin > 0 for margin in margins)
    low, high = wilson_interval(wins, pairs)
    verdict = "chance (0.5) is outside it" if low > 0.5 or high < 0.5 else "it contains chance (0.5)"
    mean, mean_low, mean_high = mean_interval(margins)
    lines = [f"held-out after training, {pairs} pairs:",  # never trained on, unless load_pairs warned
             f"  reward accuracy {wins}/{pairs} = {wins / pairs:.3f}, 95% interval [{low:.3f}, {high:.3f}] (Wilson): "
             f"{verdict}",
             f"  mean margin {_shown(mean):+.4f}, 95% interval [{_shown(mean_low):+.4f}, {_shown(mean_high):+.4f}] "
             f"over the {pairs} pairs "
             "(reward of chosen minus reward of rejected, each beta x the summed log-ratio policy / reference)"]
    if "eval_loss" in after:
        lines.append(f"  loss {after['eval_loss']:.4f}" + "".join(
            f", drift {name} {after[f'eval_drift/{name}']:+.4f}" for name in ("chosen", "rejected")
            if f"eval_drift/{name}" in after) + (" nats per token" if "eval_drift/chosen" in after else ""))
    return "\n".join(lines)


def all_finite(metrics: dict[str, float]) -> bool:
    return all(math.isfinite(metrics[key]) for key, _ in HEADLINE.values() if key in metrics)


def smoothed(values: list[float], weight: float = 0.6) -> list[float]:
    """TensorBoard's smoothing: an exponential running mean, debiased so that the first points are not pulled
    towards 0 (TensorBoard's default weight is 0.6)."""
    running, out = 0.0, []
    for count, value in enumerate(values, start=1):
        running = running * weight + (1 - weight) * value
        out.append(running / (1 - weight ** count))
    return out


def plot_training(log_history: list[dict[str, Any]], path: Path) -> None:
    """Loss, reward accuracy and reward margin over steps: training logs as faint points under their running mean
    (at a few pairs a batch a single step is mostly noise), evaluations as points."""
    from matplotlib.figure import Figure  # imported here: only the command needs matplotlib

    figure = Figure(figsize=(13, 3.6), layout="constrained")
    train = [entry for entry in log_history if "loss" in entry and "rewards/margins" in entry]
    evals = [entry for entry in log_history if "eval_loss" in entry]
    for axis, (title, key) in zip(figure.subplots(1, 3), PLOTTED.items()):
        steps, values = [e["step"] for e in train], [e[key] for e in train]
        points = axis.plot(steps, values, ".", alpha=0.35, label="train, per step")[0]
        axis.plot(steps, smoothed(values), color=points.get_color(), label="train, running mean")
        axis.plot([e["step"] for e in evals], [e[f"eval_{key}"] for e in evals], "o--", label="held-out")
        axis.set(title=title, xlabel="step")
        axis.grid(alpha=0.3)
    axis.legend()
    figure.savefig(path, dpi=110, format="png")  # `path` may be a staging name (dpo_min.files)


@torch.no_grad()
def greedy_completions(model: torch.nn.Module, tokenizer: Any, prompts: list[Any], max_new_tokens: int,
                       chat_template_kwargs: dict[str, Any] | None = None, label: str = "greedy completions",
                       hidden: bool = True) -> list[str]:
    """Greedy completion of each prompt (strings, or messages), rendered as the DPO pass renders them, in one batch:
    on a CPU each new token reads every weight once, so three prompts together take about the time of one. A bar
    named `label` unless `hidden`, moving at each new token."""
    if not prompts:
        return []
    prompt_ids = render_prompts(tokenizer, prompts, template_kwargs_of({}, chat_template_kwargs))
    was_training = model.training
    model.eval()
    # Padded on the left: every prompt ends where generation starts.
    inputs = tokenizer.pad([{"input_ids": ids} for ids in prompt_ids], padding=True, padding_side="left",
                           return_tensors="pt")
    inputs = {name: tensor.to(model.device) for name, tensor in inputs.items()}
    with phase_bar(label, len(prompts), "prompt", hidden) as bar:  # one batch: the postfix counts its tokens
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                pad_token_id=tokenizer.pad_token_id, streamer=TokenSteps(bar, max_new_tokens))
        bar.update(len(prompts))
    model.train(was_training)
    return [text.strip() for text in tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1]:],
                                                             skip_special_tokens=True)]


def prompt_text(prompt: Any) -> str:
    """The last user turn of a conversational prompt, or the prompt string itself."""
    if isinstance(prompt, str):
        return prompt
    return next((turn["content"] for turn in reversed(prompt) if turn["role"] == "user"), prompt[-1]["content"])


class CompletionLogger(TrainerCallback):
    """TRL's LogCompletionsCallback at each evaluation: greedy completions of held-out prompts by the policy.

    Each evaluation appends one line per prompt, {"step", "prompt", "reference", "policy"}, to `path` (the
    reference's completions are computed once, before training, and repeated for comparison), and sends the same
    rows as a table to the report_to backends that can show one (BACKEND_TABLES)."""

    def __init__(self, path: Path, tokenizer: Any, prompts: list[Any], reference: list[str], max_new_tokens: int,
                 backends: list[TrainerCallback], chat_template_kwargs: dict[str, Any] | None = None):
        self.path, self.tokenizer, self.prompts, self.reference = path, tokenizer, prompts, reference
        self.chat_template_kwargs = chat_template_kwargs
        self.backends = backends  # the trainer's callbacks, among them its report_to integrations
        self.max_new_tokens = max_new_tokens
        self.latest: list[str] = []
        self.rows: list[tuple[int, str, str, str]] = []  # every evaluation so far, as TRL's table keeps them

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        if not state.is_world_process_zero or not self.prompts:
            return
        self.latest = greedy_completions(model, self.tokenizer, self.prompts, self.max_new_tokens,
                                         self.chat_template_kwargs)
        with open(self.path, "a") as file:
            for prompt, before, after in zip(self.prompts, self.reference, self.latest):
                file.write(json.dumps({"step": state.global_step, "prompt": prompt, "reference": before,
                                       "policy": after}) + "\n")
                self.rows.append((state.global_step, prompt_text(prompt), before, after))
        for callback in self.backends:
            write_table = BACKEND_TABLES.get(type(callback).__name__)
            if write_table is not None:
                write_table(callback, self.rows, state.global_step)


def _tensorboard_table(callback: Any, rows: list[tuple[int, str, str, str]], step: int) -> None:
    if callback.tb_writer is None:  # after training ends the callback closes its writer; the eval log reopens it
        return
    header = "| step | prompt | reference | policy |\n| --- | --- | --- | --- |\n"
    body = "".join(f"| {s} | {_cell(prompt)} | {_cell(before)} | {_cell(after)} |\n"
                   for s, prompt, before, after in rows if s == step)
    callback.tb_writer.add_text("eval/completions", header + body, step)
    callback.tb_writer.flush()


def _wandb_table(callback: Any, rows: list[tuple[int, str, str, str]], step: int) -> None:
    table = callback._wandb.Table(columns=["step", "prompt", "reference", "policy"], data=[list(r) for r in rows])
    callback._wandb.log({"completions": table})


# report_to backends that show a table of completions, by their transformers callback; others get samples.jsonl only.
BACKEND_TABLES = {"TensorBoardCallback": _tensorboard_table, "WandbCallback": _wandb_table}


def format_samples(prompts: list[Any], reference: list[str], policy: list[str],
                   margins: list[tuple[float, float]] | None = None) -> str:
    """The samples as text, reference above policy; with `margins` ((reference, policy) log-prob margins of each
    pair), a line that shows how the preference between that pair's answers moved."""
    lines = []
    for index, (prompt, before, after) in enumerate(zip(prompts, reference, policy)):
        lines += [f"prompt:    {_one_line(prompt_text(prompt))}", f"reference: {_one_line(before)}",
                  f"policy:    {_one_line(after)}"]
        if margins:
            old, new = margins[index]
            lines.append(f"log p(chosen) - log p(rejected): reference {old:+.2f}, policy {new:+.2f} "
                         f"(change {new - old:+.2f})")
        lines.append("")
    return "\n".join(lines)


@torch.no_grad()
def logprob_margins(model: torch.nn.Module, collator: Any, pairs: list[dict[str, Any]],
                    label: str = "log-prob margins", hidden: bool = True) -> list[float]:
    """log p(chosen | prompt) - log p(rejected | prompt) of each tokenized pair, summed over its completion tokens,
    as the loss computes them (same tokens, same truncation, same layout). A bar named `label` unless `hidden`."""
    if not pairs:
        return []
    if getattr(collator, "rank_groups", False):
        # plackett_luce's collator ranks each group, which needs all its pairs: the first pairs may cut one, and a
        # margin reads no ranking. The same layout without it.
        collator = dataclasses.replace(collator, rank_groups=False)
    was_training = model.training
    model.eval()
    batch = collator([{key: pair[key] for key in ("prompt_ids", "chosen_ids", "rejected_ids")} for pair in pairs])
    batch = {key: value.to(model.device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}
    with phase_bar(label, len(pairs), "pair", hidden) as bar:
        chosen_logps, rejected_logps = sequence_logps(model, batch).logps.chunk(2)
        bar.update(len(pairs))
    model.train(was_training)
    return (chosen_logps.float() - rejected_logps.float()).tolist()


def _cell(text: str) -> str:
    return _one_line(text).replace("|", "\\|")


def _one_line(text: str, width: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 1] + "…"


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
