"""DPOMinConfig: transformers.TrainingArguments plus the DPO knobs."""

import copy
import json
import logging
from dataclasses import dataclass, field, fields
from typing import Any

from transformers import TrainingArguments

from .compat import TRL_FIELDS, apply_trl_negations, check_trl_fields, trl_pad_to_multiple_of
from .losses import F_DIVERGENCES, LOSS_TYPES, LOSSES, LossSettings

# The references DPOMinConfig.reference_mode names, each a class of reference.py (`reference.REFERENCES`), whose
# kind is this word.
REFERENCE_MODES = ("ref_model", "adapter_off", "adapter_at_start", "policy_at_start")
TRUNCATION_MODES = ("keep_end", "keep_start")
# The loss types that read label_smoothing, named in its help.
SMOOTHED_LOSSES = tuple(name for name, entry in LOSSES.items() if "label_smoothing" in entry.reads)
# TrainingArguments' secrets (hub_token): its to_dict() masks every `*_token` field, for logs and TensorBoard.
SECRET_FIELDS = tuple(option.name for option in fields(TrainingArguments) if option.name.endswith("_token"))
logger = logging.getLogger(__name__)


@dataclass
class DPOMinConfig(TrainingArguments):
    """Training arguments for `DPOMinTrainer`.

    Defaults follow TRL's `DPOConfig` where both have the option, so that the same numbers come out. Every other
    field of TRL's `DPOConfig` is accepted too (the TRL-only ones first below, checked against `compat.TRL_FIELDS`),
    and TRL's `--no_<name>` flags (`compat.TRL_NEGATIONS`). `loss_settings`, what the loss reads of these fields, is
    read from them once, in `__post_init__`, and again by the trainer it is given to if a loss field was set since (as
    a TRL script may set `args.beta` before building the trainer).
    """

    # Fields whose JSON string (from the command line) TrainingArguments parses into a dict. Not annotated: a
    # ClassVar would still appear among the dataclass fields that --help lists.
    _VALID_DICT_FIELDS = [*TrainingArguments._VALID_DICT_FIELDS, "model_init_kwargs"]  # noqa: RUF012

    # TRL-only: accepted at TRL's default, refused otherwise (`compat.check_trl_fields`).
    pad_token: str | None = field(default=None, metadata={
        "help": f"TRL DPOConfig field, accepted at its default None only: {TRL_FIELDS['pad_token']}."})
    # TRL defaults these to True, so its command line has --no_<name> for them; here they default to False and would
    # get no such flag. Each gives it, with TRL's meaning (`compat.apply_trl_negations`).
    no_gradient_checkpointing: bool = field(
        default=False, metadata={"help": "TRL's --no_gradient_checkpointing: gradient_checkpointing=False."})
    no_remove_unused_columns: bool = field(
        default=False, metadata={"help": "TRL's --no_remove_unused_columns: remove_unused_columns=False."})

    learning_rate: float = field(default=1e-6, metadata={"help": "AdamW learning rate (TRL's DPO default)."})
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "from_pretrained keyword arguments (dtype, attn_implementation, revision...) for a model "
                          "or ref_model given as an id or a path, as TRL. dtype defaults to float32."},
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow hub code for a model and tokenizer loaded from an id, as TRL."}
    )
    # The loss's fields default to what the loss says (LossSettings.default), so that the two cannot differ.
    beta: float = field(default=LossSettings.default("beta"),
                        metadata={"help": "Strength of the implicit KL penalty towards the reference."})
    loss_type: list[str] = field(
        default_factory=lambda: ["sigmoid"],
        metadata={"help": f"Preference loss(es), space- or comma-separated, from {', '.join(LOSS_TYPES)} "
                          "(docs/losses.md). plackett_luce needs --group_by_prompt: it ranks each prompt's answers "
                          "at once, so per_device_train_batch_size counts whole groups, not pairs (docs/groups.md)."},
    )
    loss_weights: list[float] | None = field(
        default=None, metadata={"help": "One weight per loss_type: total = sum_i w_i * mean(L_i). Default all 1."}
    )
    label_smoothing: float = field(
        default=LossSettings.default("label_smoothing"),
        metadata={"help": f"eps, read by {', '.join(SMOOTHED_LOSSES)}: the label-flip probability (sigmoid's is "
                          "conservative DPO; robust needs < 0.5); exo_pair's eps (> 0)."},
    )
    reference_free: bool = field(default=False, metadata={"help": "Take the reference log-probs as 0."})
    reference_mode: str | None = field(
        default=None,
        metadata={"help": "The reference named, rather than chosen from what the trainer is given: ref_model (the "
                          "ref_model passed), adapter_off (a bare model and a peft_config: the adapter disabled), "
                          "adapter_at_start (a PeftModel: a frozen copy of its adapter as it starts), policy_at_start "
                          "(a frozen copy of the model, or with precompute_ref_log_probs the model before its first "
                          "step). The models given must fit it. Default: chosen from them."},
    )
    ld_alpha: float | None = field(
        default=None, metadata={"help": "LD-DPO: weight in [0, 1] of the tokens beyond the shorter completion."}
    )
    use_weighting: bool = field(default=False, metadata={"help": "WPO: weight each pair by its policy probability."})
    discopop_tau: float = field(default=LossSettings.default("discopop_tau"),
                                metadata={"help": "Temperature of the discopop loss."})
    dataset_num_proc: int | None = field(
        default=None, metadata={"help": "Processes that tokenize the data (datasets.map num_proc); None: one."}
    )
    chat_template_kwargs: dict | str | None = field(
        default=None,
        metadata={"help": "Extra chat template arguments for every row, as a dict or JSON text, e.g. "
                          "'{\"enable_thinking\": false}'; a row's own chat_template_kwargs column wins."},
    )
    f_divergence_type: str = field(
        default=LossSettings.default("f_divergence_type"),
        metadata={"help": f"f-DPO regulariser, one of {', '.join(F_DIVERGENCES)}; other than reverse_kl only for "
                          f"{', '.join(name for name, entry in LOSSES.items() if entry.f_divergence)}."},
    )
    f_alpha_divergence_coef: float = field(default=LossSettings.default("f_alpha_divergence_coef"),
                                           metadata={"help": "The alpha of alpha_divergence."})
    simpo_gamma: float = field(default=LossSettings.default("simpo_gamma"),
                               metadata={"help": "SimPO's target reward margin (loss_type simpo)."})
    alpha: float = field(
        default=LossSettings.default("alpha"),
        metadata={"help": "AlphaPO: rewards (1 - p^-alpha) / alpha for cpo and simpo; 0 keeps log p."}
    )
    cpo_alpha: float = field(
        default=LossSettings.default("cpo_alpha"),
        metadata={"help": "Weight of the mean NLL of the chosen tokens added to the loss (CPO's behaviour cloning; "
                          "the CPO paper and TRL's CPOConfig use 1.0)."},
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={"help": "Weight of a mixture-of-experts model's load-balancing loss; None: the model config's "
                          "own; 0 turns it off."},
    )
    max_length: int | None = field(
        default=1024, metadata={"help": "Most tokens of prompt+completion; completions are cut to fit."}
    )
    max_prompt_length: int | None = field(default=None, metadata={
        "help": "Most prompt tokens, cut first. Default: no cap of its own (max_length still cuts)."})
    truncation_mode: str = field(
        default="keep_end",
        metadata={"help": "Which end of an over-long prompt to keep: keep_end (its last tokens) or keep_start."},
    )
    precompute_ref_log_probs: bool = field(
        default=False, metadata={"help": "Compute every pair's reference log-probs once, before training."}
    )
    precompute_ref_batch_size: int | None = field(
        default=None, metadata={"help": "Batch size of the precomputing pass (default per_device_eval_batch_size)."}
    )
    model_adapter_name: str | None = field(
        default=None, metadata={"help": "PeftModel: the adapter to train (default: the active one)."}
    )
    ref_adapter_name: str | None = field(
        default=None, metadata={"help": "PeftModel: another adapter of the same model, used frozen as reference."}
    )
    sync_ref_model: bool = field(
        default=False, metadata={"help": "TR-DPO: every ref_model_sync_steps, ref <- alpha * policy + (1-alpha) * ref."}
    )
    ref_model_mixup_alpha: float = field(default=0.6, metadata={"help": "TR-DPO alpha, in (0, 1]."})
    ref_model_sync_steps: int = field(default=512, metadata={"help": "TR-DPO: optimizer steps between syncs."})
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
    group_by_prompt: bool = field(
        default=False,
        metadata={"help": "Train the pairs of one prompt as one group: the prompt once and each distinct completion "
                          "once, as share_prompt's segment with a branch per completion; the pairs of a prompt are "
                          "batched together (the groups shuffled, or in order with train_sampling_strategy "
                          "sequential). Combines with padding_free. Needs sdpa or eager attention. Ranked data, "
                          "plackett_luce: docs/groups.md."},
    )
    shard_with_fsdp2: bool = field(
        default=False,
        metadata={"help": "Shard policy and reference with FSDP2 (fully_shard) across the processes, applied by "
                          "dpo_min: it shards on CPU/gloo too, where accelerate's FSDP falls back to DDP."},
    )
    pad_to_multiple_of: int | None = field(
        default=None, metadata={"help": "Pad each batch's length to a multiple of this (not with padding_free)."}
    )
    activation_offloading: bool = field(
        default=False, metadata={"help": "Keep the activations saved for backward in CPU memory until needed."}
    )
    disable_dropout: bool = field(default=True, metadata={"help": "Turn dropout off in policy and reference."})
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Kept False: the collator picks the columns it needs."}
    )

    def __post_init__(self):
        apply_trl_negations(self)
        super().__post_init__()
        check_trl_fields(self)
        if isinstance(self.chat_template_kwargs, str):
            self.chat_template_kwargs = json.loads(self.chat_template_kwargs)
        if self.dataset_num_proc is not None and self.dataset_num_proc < 1:
            raise ValueError(f"dataset_num_proc must be >= 1 or None, got {self.dataset_num_proc}")
        self._check_losses()
        self._check_reference()
        self._check_training_numbers()
        if self.use_liger_kernel:
            self._accept_liger_kernel()
        if self.truncation_mode not in TRUNCATION_MODES:
            raise ValueError(f"truncation_mode must be one of {TRUNCATION_MODES}, got {self.truncation_mode!r}")
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(f"max_length must be >= 2 or None, got {self.max_length}")
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1 or None, got {self.max_prompt_length}")
        self.pad_to_multiple_of = trl_pad_to_multiple_of(self.pad_to_multiple_of)
        for name in ("precompute_ref_batch_size", "pad_to_multiple_of"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {getattr(self, name)}")
        if self.listwise and not self.group_by_prompt:
            raise ValueError("loss_type plackett_luce ranks each prompt's answers: it needs group_by_prompt")
        if self.group_by_prompt and self.train_sampling_strategy not in ("random", "sequential"):
            raise ValueError(f"group_by_prompt orders the pairs itself (a prompt's pairs together, the groups "
                             f"shuffled, or in order with 'sequential'): drop "
                             f"train_sampling_strategy={self.train_sampling_strategy!r}")
        if self.router_aux_loss_coef is not None and self.router_aux_loss_coef < 0:
            raise ValueError(f"router_aux_loss_coef must be >= 0 or None, got {self.router_aux_loss_coef}")
        if self.packed:
            self._undispatched()

    def __getstate__(self) -> dict[str, Any]:
        # Trainer pickles the whole config into training_args.bin, in the output folder and every checkpoint, and a
        # push uploads it: a pickled copy holds no token. The live config keeps it, for the push.
        return {name: None if name in SECRET_FIELDS else value for name, value in self.__dict__.items()}

    # A copy in memory is the same run (the plan's copy pushes with the token): copy and deepcopy would otherwise go
    # through __getstate__ and drop it.
    def __copy__(self) -> "DPOMinConfig":
        copied = object.__new__(type(self))
        copied.__dict__.update(self.__dict__)
        return copied

    def __deepcopy__(self, memo: dict) -> "DPOMinConfig":
        copied = object.__new__(type(self))
        memo[id(self)] = copied
        copied.__dict__.update({name: copy.deepcopy(value, memo) for name, value in self.__dict__.items()})
        return copied

    def _accept_liger_kernel(self) -> None:
        # What TRL 1.16 asks of Liger in DPO is memory: a fused LM head that never holds the [2B, T, V] logits (the
        # layer kernels it also patches in compute the same numbers). dpo_min's log-probs already come from the
        # completion positions only, reduced in chunks; Liger's fused cross-entropy would replace the model's forward,
        # which TRL refuses too.
        if (self.liger_kernel_config or {}).get("fused_linear_cross_entropy"):
            raise ValueError('liger_kernel_config={"fused_linear_cross_entropy": True} is not supported: it replaces '
                             "the model's forward, as in TRL; drop it")
        logger.warning("use_liger_kernel: dpo_min's own log-probs already hold no [2B, T, V] logits (what Liger's "
                       "fused loss saves); the model keeps its own kernels, and use_liger_kernel is set to False")
        self.use_liger_kernel = False

    def _undispatched(self) -> None:
        # accelerate's dispatcher (its default for a stream) cuts every tensor of a collated batch to the rows of the
        # first: a packed batch's per-sequence ones (completion_index, segment bounds) hold more, and the step fails.
        # Undispatched, each process reads the stream and collates its own share of the pairs.
        accelerator = self.accelerator_config
        if getattr(accelerator, "dispatch_batches", None):
            layout = next(name for name in ("padding_free", "share_prompt", "group_by_prompt") if getattr(self, name))
            raise ValueError(f"accelerator_config dispatch_batches=True cuts a collated batch to the rows of its first "
                             f"tensor, which {layout}'s packed batches do not keep: drop dispatch_batches")
        if accelerator is not None:
            accelerator.dispatch_batches = False

    def _check_training_numbers(self) -> None:
        # Trainer takes any max_steps <= 0 as "use num_train_epochs", and trains zero steps for 0 epochs: both hide
        # a typo behind a run that reports success.
        if self.learning_rate < 0:
            raise ValueError(f"learning_rate must be >= 0, got {self.learning_rate}")
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_steps == 0 or self.max_steps < -1:
            raise ValueError(f"max_steps must be > 0, or -1 to train num_train_epochs, got {self.max_steps}")
        if self.max_steps == -1 and self.num_train_epochs <= 0:
            raise ValueError(f"num_train_epochs must be > 0 when max_steps is -1, got {self.num_train_epochs}: the "
                             "run would train zero steps (to evaluate only, call evaluate() without train())")

    @property
    def packed(self) -> bool:
        """Whether a batch is packed into rows (padding_free, share_prompt, group_by_prompt) rather than padded."""
        return self.padding_free or self.shares_prompt

    @property
    def shares_prompt(self) -> bool:
        """Whether a segment's completions share its prompt under a 4D mask: share_prompt, or group_by_prompt."""
        return self.share_prompt or self.group_by_prompt

    @property
    def listwise(self) -> bool:
        """Whether the loss reads each group's whole ranking (plackett_luce): then a batch holds
        per_device_train_batch_size whole groups, not pairs."""
        return "plackett_luce" in self.loss_type

    @property
    def global_batch_size(self) -> int:
        """Pairs per optimizer step, over every process."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.world_size

    def read_loss_settings(self) -> LossSettings:
        """`loss_settings`, read again from the fields where one was set since the config was built (a TRL script may
        set `args.beta` before it builds the trainer): the trainer asks where it is built and where it is given args."""
        if LossSettings.from_config(self) != self.loss_settings:
            self.loss_settings = LossSettings.from_config(self).validate()
        return self.loss_settings

    def _check_losses(self) -> None:
        # From Python a string, from the CLI a list whose items may hold commas: both become a list of names.
        names = [self.loss_type] if isinstance(self.loss_type, str) else list(self.loss_type)
        self.loss_type = [part.strip() for name in names for part in name.split(",") if part.strip()] or names
        # Read from the fields once, here, and validated: every reader (the trainer, the command) reads this value.
        self.loss_settings: LossSettings = LossSettings.from_config(self).validate()

    def _check_reference(self) -> None:
        if self.reference_mode is not None and self.reference_mode not in REFERENCE_MODES:
            raise ValueError(f"reference_mode must be one of {REFERENCE_MODES} or None, got {self.reference_mode!r}")
        if self.sync_ref_model:
            if not 0.0 < self.ref_model_mixup_alpha <= 1.0:
                raise ValueError(f"ref_model_mixup_alpha must be in (0, 1], got {self.ref_model_mixup_alpha}")
            if self.ref_model_sync_steps < 1:
                raise ValueError(f"ref_model_sync_steps must be >= 1, got {self.ref_model_sync_steps}")
            if self.precompute_ref_log_probs or self.reference_free:
                raise ValueError("sync_ref_model updates the reference during training: it cannot be combined with "
                                 "precompute_ref_log_probs or reference_free")
        if self.reference_free and self.precompute_ref_log_probs:
            raise ValueError("reference_free needs no reference log-probs: drop precompute_ref_log_probs")
        if not self.loss_settings.reads_reference and (self.precompute_ref_log_probs or self.sync_ref_model):
            raise ValueError(f"loss_type {self.loss_type} reads no reference: drop precompute_ref_log_probs and "
                             "sync_ref_model")
        if self.ref_adapter_name is not None and self.ref_adapter_name == self.model_adapter_name:
            raise ValueError(f"ref_adapter_name and model_adapter_name are both {self.ref_adapter_name!r}: the "
                             "reference must be another adapter than the trained one")
