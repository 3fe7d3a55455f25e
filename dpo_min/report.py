"""What the command shows and writes besides the model: held-out figures, a plot of the run, greedy samples."""

import json
import math
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import ProgressCallback, TrainerCallback

# The held-out figures the command prints and compares (TRL's names) and how they are shown.
HEADLINE = {"reward accuracy": ("eval_rewards/accuracies", ".4f"), "mean margin": ("eval_rewards/margins", "+.4f"),
            "loss": ("eval_loss", ".4f")}
PLOTTED = {"loss": "loss", "reward accuracy": "rewards/accuracies", "reward margin": "rewards/margins"}


class LiveLossBar(ProgressCallback):
    """Trainer's progress bar, with the latest loss, accuracy and margin in the bar instead of a line of logs."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None and logs and "loss" in logs:
            self.training_bar.set_postfix(loss=f"{logs['loss']:.4f}", acc=f"{logs.get('rewards/accuracies', 0):.2f}",
                                          margin=f"{logs.get('rewards/margins', 0):+.3f}")


class HeldOutPrinter(TrainerCallback):
    """Prints the headline held-out figures after each evaluation, above the progress bar."""

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if not state.is_world_process_zero or not metrics:
            return
        when = "before training" if state.global_step == 0 else f"at step {state.global_step}"
        note = "  (the policy starts as the reference: rewards are 0)" if state.global_step == 0 else ""
        tqdm.write(f"held-out {when}: {describe(metrics)}{note}")


def describe_plan(args: Any, train_pairs: int) -> str:
    """'training: 8 steps (0.01 epochs of 2196 pairs), global batch 4 (...), learning rate 0.0005 ...' before a run."""
    global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    batches = math.ceil(train_pairs / (args.per_device_train_batch_size * args.world_size))
    steps_per_epoch = max(batches // args.gradient_accumulation_steps, 1)  # as Trainer counts them
    if args.max_steps > 0:
        steps, epochs = args.max_steps, args.max_steps / steps_per_epoch
    else:
        steps, epochs = math.ceil(args.num_train_epochs * steps_per_epoch), args.num_train_epochs
    return (f"training: {steps} steps ({epochs:.3g} epochs of {train_pairs} pairs), global batch {global_batch} "
            f"({args.per_device_train_batch_size} per device x {args.gradient_accumulation_steps} accumulation x "
            f"{args.world_size} processes), learning rate {args.learning_rate:g} ({args.lr_scheduler_type.value}, "
            f"warmup {args.warmup_steps})")


def describe(metrics: dict[str, float]) -> str:
    """'reward accuracy 0.625, mean margin +0.041, loss 0.6812' from an evaluation's metrics."""
    return ", ".join(f"{name} {metrics[key]:{style}}" for name, (key, style) in HEADLINE.items() if key in metrics)


def describe_change(before: dict[str, float], after: dict[str, float]) -> str:
    """'reward accuracy 0.0000 -> 0.6250, ...' from two evaluations."""
    return ", ".join(f"{name} {before[key]:{style}} -> {after[key]:{style}}" for name, (key, style) in HEADLINE.items())


def wilson_interval(successes: int, trials: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (95% for the default z); stays inside [0, 1] at 0 or n."""
    if trials == 0:
        return 0.0, 1.0
    rate = successes / trials
    centre = (rate + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(rate * (1 - rate) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return max(0.0, centre - half), min(1.0, centre + half)


def all_finite(metrics: dict[str, float]) -> bool:
    return all(math.isfinite(metrics[key]) for key, _ in HEADLINE.values() if key in metrics)


def plot_training(log_history: list[dict[str, Any]], path: Path) -> None:
    """Loss, reward accuracy and reward margin over steps: training logs as lines, evaluations as points."""
    from matplotlib.figure import Figure  # imported here: only the command needs matplotlib

    figure = Figure(figsize=(13, 3.6), layout="constrained")
    train = [entry for entry in log_history if "loss" in entry and "rewards/margins" in entry]
    evals = [entry for entry in log_history if "eval_loss" in entry]
    for axis, (title, key) in zip(figure.subplots(1, 3), PLOTTED.items()):
        axis.plot([e["step"] for e in train], [e[key] for e in train], marker=".", label="train")
        axis.plot([e["step"] for e in evals], [e[f"eval_{key}"] for e in evals], "o--", label="held-out")
        axis.set(title=title, xlabel="step")
        axis.grid(alpha=0.3)
    axis.legend()
    figure.savefig(path, dpi=110)


@torch.no_grad()
def greedy_completions(model: torch.nn.Module, tokenizer: Any, prompts: list[Any], max_new_tokens: int) -> list[str]:
    """Greedy completion of each prompt (a string, or messages rendered with the chat template)."""
    was_training = model.training
    model.eval()
    texts = []
    for prompt in prompts:
        if isinstance(prompt, str):
            inputs = tokenizer(prompt, return_tensors="pt")
        else:
            inputs = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=True,
                                                   return_tensors="pt")
        inputs = {name: tensor.to(model.device) for name, tensor in inputs.items()}
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                pad_token_id=tokenizer.pad_token_id)
        texts.append(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip())
    model.train(was_training)
    return texts


def prompt_text(prompt: Any) -> str:
    """The last user turn of a conversational prompt, or the prompt string itself."""
    if isinstance(prompt, str):
        return prompt
    return next((turn["content"] for turn in reversed(prompt) if turn["role"] == "user"), prompt[-1]["content"])


def write_samples(path: Path, prompts: list[Any], reference: list[str], policy: list[str]) -> str:
    """Save one JSON line per prompt and return the same samples as text, reference above policy."""
    lines = []
    with open(path, "w") as file:
        for prompt, before, after in zip(prompts, reference, policy):
            file.write(json.dumps({"prompt": prompt, "reference": before, "policy": after}) + "\n")
            lines += [f"prompt:    {_one_line(prompt_text(prompt))}", f"reference: {_one_line(before)}",
                      f"policy:    {_one_line(after)}", ""]
    return "\n".join(lines)


def _one_line(text: str, width: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 1] + "…"
