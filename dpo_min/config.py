"""DPOMinConfig: transformers.TrainingArguments plus the DPO knobs."""

from dataclasses import dataclass, field

from transformers import TrainingArguments

TRUNCATION_MODES = ("keep_end", "keep_start")


@dataclass
class DPOMinConfig(TrainingArguments):
    """Training arguments for `DPOMinTrainer`.

    Defaults follow TRL's `DPOConfig` where both have the option, so that the same numbers come out.
    """

    learning_rate: float = field(default=1e-6, metadata={"help": "AdamW learning rate (TRL's DPO default)."})
    beta: float = field(default=0.1, metadata={"help": "Strength of the implicit KL penalty towards the reference."})
    loss_type: str = field(default="sigmoid", metadata={"help": "Preference loss; see README for the list."})
    label_smoothing: float = field(
        default=0.0, metadata={"help": "Probability that a label is flipped (conservative DPO / robust DPO)."}
    )
    max_length: int | None = field(
        default=1024, metadata={"help": "Most tokens of prompt+completion; completions are cut to fit."}
    )
    max_prompt_length: int | None = field(default=None, metadata={"help": "Most prompt tokens, cut first."})
    truncation_mode: str = field(
        default="keep_end",
        metadata={"help": "Which end of an over-long prompt to keep: keep_end (its last tokens) or keep_start."},
    )
    precompute_ref_log_probs: bool = field(
        default=False, metadata={"help": "Compute every pair's reference log-probs once, before training."}
    )
    padding_free: bool = field(
        default=False,
        metadata={"help": "Pack the batch's sequences into one row with restarting position_ids: no pad token is "
                          "computed. Needs sdpa or eager attention."},
    )
    share_prompt: bool = field(
        default=False,
        metadata={"help": "Lay each pair out as prompt, chosen, rejected with a 4D attention mask, so the prompt is "
                          "computed once. Combines with padding_free. Needs sdpa or eager attention."},
    )
    disable_dropout: bool = field(default=True, metadata={"help": "Turn dropout off in policy and reference."})
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Kept False: the collator picks the columns it needs."}
    )

    def __post_init__(self):
        super().__post_init__()
        if self.beta <= 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")
        if self.truncation_mode not in TRUNCATION_MODES:
            raise ValueError(f"truncation_mode must be one of {TRUNCATION_MODES}, got {self.truncation_mode!r}")
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(f"max_length must be >= 2 or None, got {self.max_length}")
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1 or None, got {self.max_prompt_length}")
