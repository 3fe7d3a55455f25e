"""A run of the command, decided once: `resolve(argv)` reads the command line (and recipe) and makes every choice
that the phases of `main` (folder, data, model, trainer, train, publish) would otherwise each make again.

What depends on the data (the pairs' digest, whether a mixture's files hold test splits) is decided where the data
is read; everything else is here, each decision in one place: how the model loads (`ModelLoad`), how many pairs the
seeded split holds out (`Plan.held_out_count`), and which options cannot go together with the data named
(`_check_data_options`, before any file is read or the folder locked).
"""

import copy
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..config import DPOMinConfig
from ..models import EMBEDDED_MODEL_NAME
from ..reference import needs_second_load
from ..scale import zero  # noqa: F401 (tests patch zero.zero_stage here: the module needs_second_load reads)
from ..split import held_out_count
from .args import EVAL_FRACTION, MIXTURE_KEYS, MIXTURE_OPTIONS, DataArguments, ModelArguments, UsageError
from .command_line import parse_with_rounds
from .hub import hub_repo_id
from .rounds_args import RoundsArguments
from .run_dir import RunFolder
from .same_run import resume_settings


@dataclass(frozen=True)
class ModelLoad:
    """How the weights load, decided once: TRL's model_init_kwargs, then the named options (--dtype,
    --model_revision, --trust_remote_code, --attn_implementation, --load_in_4bit/8bit). `model_setup.load_model`
    passes them to from_pretrained as they are."""

    dtype: str
    kwargs: dict[str, Any]  # from_pretrained's keywords, device_map included for quantized weights
    bits: int | None  # 4 or 8: bitsandbytes, frozen quantized weights under the adapter; None: not quantized
    compute_dtype: str  # the quantized layers' arithmetic: the weights' dtype, float32 for "auto"


@dataclass(frozen=True)
class Plan:
    """What the run is. The three option sets are as parsed, with the few fields the plan takes over set here:
    `args.output_dir` is the staging folder, `args.push_to_hub` is off (the command pushes the published folder) and
    `args.eval_on_start` is off where the step-0 figures are known already."""

    model: ModelArguments
    data: DataArguments
    args: DPOMinConfig
    demo: bool  # no model and no data given: the demo's defaults (args.DEMO_DEFAULTS) apply
    mixture: str | None  # which of the three mixture forms is given, or None for one dataset
    eval_fraction: float  # the share of one dataset held out by a seeded split; 0 for none
    seed: int  # the data's: the held-out split, a mixture's shuffle, the pairs kept for max_steps
    saved_as: str  # "adapter", "merged" (the adapter merged into the weights) or "full"
    load: ModelLoad
    reload_reference: bool  # ZeRO-3 full fine-tuning: the reference is a second load of the model, not a copy
    folder: RunFolder  # the output folder, its links followed once
    repo_id: str  # the hub repository the run is (or would be) pushed to
    push: bool
    resuming: bool  # --resume_from_checkpoint given: the run continues a checkpoint's training (its step 0 is past)
    # ... and that checkpoint is this folder's interrupted run ("latest", or a path inside the staging folder): the
    # staging folder it left is reused, not refused (RunFolder.prepare).
    resumes_here: bool
    # What a resumed run must share with the interrupted one (same_run.resume_keys), fixed as `decide` decides it.
    resume_settings: dict[str, Any] = field(default_factory=dict)
    rounds: RoundsArguments | None = None  # --rounds N: DPO in rounds (train/rounds/) instead of one offline run

    @property
    def is_main(self) -> bool:
        return self.args.process_index == 0

    @property
    def trains_adapter(self) -> bool:
        """LoRA (saved as an adapter or merged) rather than full fine-tuning: `saved_as` says it, once."""
        return self.saved_as != "full"

    @property
    def model_name(self) -> str:
        return self.model.model or EMBEDDED_MODEL_NAME

    @property
    def decided_settings(self) -> dict[str, Any]:
        """The resume settings the plan decides rather than an option spelling them: a resume that spells out what
        was decided anyway (--eval_fraction 0.05 where it was left out, --data_seed equal to --seed) is the same run."""
        return {"model": self.model_name, "use_peft": self.trains_adapter, "eval_fraction": self.eval_fraction,
                "data_seed": self.seed, "dtype": self.load.dtype, "model_revision": self.load.kwargs["revision"]}

    def held_out_count(self, pairs: int) -> int:
        """How many of `pairs` the seeded split holds out: eval_fraction of them rounded up, as `datasets`'
        train_test_split rounds a fraction (dpo_min.split, the split the pairs take)."""
        return held_out_count(pairs, self.eval_fraction)

    @property
    def reach(self) -> int | None:
        """The train pairs the run reaches with max_steps (only those are tokenized and scored), or None."""
        return self.args.max_steps * self.args.global_batch_size if self.args.max_steps > 0 else None

    @property
    def records_pairs(self) -> bool:
        """Whether the run records its pairs' digest, to be compared on resume: a run with checkpoints, or one that
        resumes (only a run with checkpoints is resumed)."""
        return self.args.save_strategy != "no" or self.resuming

    @property
    def ties_at_start(self) -> bool:
        """Whether the figures before training are known without measuring them: the policy starts as its
        reference, so every pair is a tie (a resumed run has its first run's step 0 in its log)."""
        return not self.args.eval_on_start and not self.resuming and self.args.loss_settings.reads_reference


def resolve(argv: list[str] | None = None) -> Plan:
    """The command line -> its Plan. Raises UsageError (and OutputDirError for an output folder that cannot be)."""
    model_args, data_args, rounds_args, args, demo = parse_with_rounds(argv)
    return decide(model_args, data_args, args, demo, rounds=None if rounds_args.rounds is None else rounds_args)


def decide(model_args: ModelArguments, data_args: DataArguments, args: DPOMinConfig, demo: bool = False,
           rounds: RoundsArguments | None = None) -> Plan:
    """The Plan of parsed options (a library caller's too). The plan holds its own copies: the caller's three
    objects are left as they were given. A rounds run (`rounds`) refuses the offline data options itself
    (train/rounds/)."""
    model_args, data_args, args = copy.deepcopy(model_args), copy.deepcopy(data_args), copy.deepcopy(args)
    mixture = _mixture_form(data_args, is_main=args.process_index == 0)
    if rounds is None:
        _check_data_options(data_args, args, mixture)
    folder = RunFolder(args.output_dir)  # follows links once; refuses the working folder or above it
    push, args.push_to_hub = args.push_to_hub, False  # Trainer would name the repo after the staging folder
    checkpoint = args.resume_from_checkpoint
    resuming = checkpoint is not None
    args.eval_on_start = args.eval_on_start and not resuming  # a resumed run has its first run's step 0
    args.output_dir = str(folder.staging)
    given_fraction = data_args.eval_fraction
    plan = Plan(
        model=model_args, data=data_args, args=args, demo=demo, mixture=mixture,
        eval_fraction=given_fraction if given_fraction is not None else 0.0 if mixture else EVAL_FRACTION,
        seed=args.data_seed if args.data_seed is not None else args.seed,
        saved_as="full" if not model_args.use_peft else "merged" if model_args.merge_adapter else "adapter",
        load=_model_load(model_args, args),
        reload_reference=needs_second_load(args, trains_adapter=model_args.use_peft),
        folder=folder, repo_id=hub_repo_id(folder.named, args.hub_model_id), push=push, resuming=resuming,
        resumes_here=checkpoint == "latest" or (
            resuming and Path(checkpoint).resolve().is_relative_to(folder.staging.resolve())), rounds=rounds)
    if rounds is None:  # a rounds run refuses --reference_mode itself (train/rounds/)
        _check_reference_mode(plan)
    return replace(plan, resume_settings=resume_settings(model_args, data_args, args, decided=plan.decided_settings))


def _model_load(model_args: ModelArguments, args: DPOMinConfig) -> ModelLoad:
    kwargs = dict(args.model_init_kwargs or {})
    # The command has moved model_init_kwargs' dtype to --dtype (command_line._one_dtype); a library caller's wins.
    dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", model_args.dtype))
    kwargs.setdefault("revision", model_args.model_revision)
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    if model_args.attn_implementation:
        kwargs.setdefault("attn_implementation", model_args.attn_implementation)
    bits = 4 if model_args.load_in_4bit else 8 if model_args.load_in_8bit else None
    if bits:
        kwargs["device_map"] = {"": args.local_process_index}  # each process its own full copy, as TRL
    return ModelLoad(dtype=dtype, kwargs=kwargs, bits=bits, compute_dtype=dtype if dtype != "auto" else "float32")


def _check_data_options(data_args: DataArguments, args: DPOMinConfig, mixture: str | None) -> None:
    """The data options that cannot go together with the data named (one dataset, a stream, a mixture's form),
    refused before any file is read; what depends on the rows is refused where they are read (train/pairs.py)."""
    if mixture is None:
        for name in MIXTURE_OPTIONS:
            if getattr(data_args, name) is not None:
                raise UsageError(f"{name} belongs to a mixture (datasets, dataset_mixture or dataset_mixer); "
                                 "there is none")
        if data_args.eval_split and (data_args.dataset is None or os.path.isfile(data_args.dataset)):
            # the embedded pairs (no --dataset) are a file too
            raise UsageError("--eval_split picks a split of a datasets name; a file has one split, use "
                             "--eval_fraction")
    else:
        if data_args.strict_pairs:
            raise UsageError("--strict_pairs applies to one dataset (--dataset); a mixture drops the rows that "
                             "cannot be preference pairs and names them in its log")
        if data_args.eval_split:
            raise UsageError("--eval_split picks a split of one dataset; a mixture holds out --eval_fraction of "
                             "its pairs, or its own test_split_size (dataset_mixer: its test splits)")
        if data_args.streaming and mixture != "datasets":
            raise UsageError(f"--streaming: {mixture} is read whole (TRL's datasets: mixture streams)")
        if mixture == "dataset_mixer" and data_args.test_split_size is not None:
            raise UsageError("test_split_size: dataset_mixer holds out its test splits (dataset_splits)")
    if not data_args.streaming:
        return
    if args.max_steps <= 0:
        raise UsageError("--streaming needs --max_steps (a stream has no length to count epochs by)")
    if args.precompute_ref_log_probs:
        raise UsageError("--streaming computes the reference on the fly: pass --precompute_ref_log_probs false")
    if not data_args.eval_split and not data_args.max_eval_samples and data_args.eval_fraction:
        raise UsageError(f"--eval_fraction {data_args.eval_fraction}: a stream has no length to hold out a "
                         "fraction of; hold out its first pairs with --max_eval_samples N"
                         + ("" if mixture else ", or give --eval_split"))


# The reference the command's trainer gets, by how it trains: it loads one bare model (a second one as ref_model
# for full fine-tuning under ZeRO-3) and hands it over with its LoRA config, if any.
_COMMAND_REFERENCE = {
    "adapter_off": "a LoRA adapter (--use_peft): its reference is the model with the adapter off",
    "policy_at_start": "every weight (no --use_peft): its reference is the model as it starts",
    "ref_model": "every weight under ZeRO-3: its reference is the model loaded a second time",
}


def _check_reference_mode(plan: Plan) -> None:
    """--reference_mode names the reference the library would build from the models it is given (its ValueError
    came after the model loaded, in the library's terms): the command gives one kind, refused here otherwise."""
    mode = plan.args.reference_mode
    if mode is None or not plan.args.loss_settings.reads_reference:  # a loss without a reference ignores it
        return
    fits = "ref_model" if plan.reload_reference else "adapter_off" if plan.trains_adapter else "policy_at_start"
    if mode != fits:
        raise UsageError(f"--reference_mode {mode}: this run trains {_COMMAND_REFERENCE[fits]} ({fits}); leave "
                         f"--reference_mode out, or give {fits}")


def _mixture_form(data_args: DataArguments, is_main: bool) -> str | None:
    """Which mixture form is given; a dataset beside it is dropped from (the plan's copy of) data_args."""
    given = [name for name in MIXTURE_KEYS if getattr(data_args, name) is not None]
    if len(given) > 1:
        raise UsageError(f"one mixture per run: {' and '.join(given)} are both given")
    if given and data_args.dataset is not None:
        # Both in one place (the recipe, or the command line): TRL's rule, the mixture is trained.
        if is_main:  # said once, not by every process of the run
            print(f"warning: both {given[0]} (a mixture) and dataset {data_args.dataset} are given; the mixture is "
                  "trained, dataset ignored", file=sys.stderr)
        data_args.dataset = None
    return given[0] if given else None
