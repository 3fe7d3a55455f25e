"""The runner of the command's DPO in rounds (`python -m dpo_min.train --rounds N`): the plan's options -> a
RoundsConfig, the prompts from --dataset (without one, the embedded arithmetic pool), the reward functions from
--reward_funcs, the model as the command loads it; then `dpo_min.rounds.run_rounds` into --output_dir, locked for
the run.

The output folder is the command's RunFolder for the checks and the lock (`<output_dir>.lock`, held by the main
process), not for its staging and publish: a rounds run writes each phase in place and resumes from what is there
(dpo_min/rounds/store.py), so that finished rounds stay where they are when a later round fails. docs/rounds.md.
"""

import importlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from ...config import DPOMinConfig
from ...data.columns import check_no_clash
from ...data.loading import load_rows
from ...files import staging_path
from ...models import is_repo_id
from ...rounds import RewardModel, RoundsConfig, RoundsError, run_rounds
from ...rounds.held_out import describe
from ...rounds.prompts import check_room, prompt_rows, split_held_out
from ...rounds.rewards import load_reward_model
from ...rounds.schedule import check_pool
from .. import model_setup
from ..args import ROUNDS_DEMO_DEFAULTS, InputError, UsageError
from ..pairs import DATA_SUFFIXES, local_data
from ..plan import Plan
from ..report import describe_rounds_plan
from ..rounds_args import LOAD_BEST_WITH_ROUNDS
from ..run_dir import OutputDirError, RunFolder

EMBEDDED_PROMPTS = Path(__file__).resolve().parents[3] / "data" / "arithmetic-pool.jsonl"  # the demo's prompts
DEMO_REWARD = "dpo_min.rounds.arithmetic:last_integer_reward"
SETTINGS_FILE = "settings.json"  # what dpo_min.rounds.store writes first into a rounds run's folder
# Options of the offline run that a rounds run would not honour: refused when given, with what to do instead.
NOT_IN_ROUNDS = {
    "eval_split": "a share of --dataset's prompts is held out: --eval_fraction",
    "max_eval_samples": "a share of --dataset's prompts is held out: --eval_fraction",
    "num_samples": "every held-out prompt is completed greedily after each round (held_out.jsonl)",
    "max_new_tokens": "sampled and held-out completions take --max_completion_length",
    "streaming": "the prompts are read whole",
    "datasets": "the prompts come from --dataset", "dataset_mixture": "the prompts come from --dataset",
    "dataset_mixer": "the prompts come from --dataset",
    "push_to_hub": "upload a round's checkpoint folder with `hf upload`",
    "resume_from_checkpoint": "run the same command again: a rounds run resumes where it stopped",
    "merge_adapter": "each round saves its adapter (round-K/checkpoint)",
    "load_in_4bit": "not tried with rounds", "load_in_8bit": "not tried with rounds",
    "reference_mode": "each round's reference is named from --reference (initial or previous)",
}
# What decides the numbers about the model, recorded in the rounds' settings.json as the plan decided it for the
# offline record (same_run.resume_keys); LoRA is recorded as RoundsConfig.peft_config, the training options as training.
MODEL_SETTINGS = ("model", "model_revision", "dtype", "load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type",
                  "use_bnb_nested_quant", "chat_template", "chat_template_kwargs")
# Training options that are the rounds' own: the loop sets a round's folder and seed (seed + K).
NOT_PER_ROUND = {"output_dir", "seed", "eval_on_start", "push_to_hub", "resume_from_checkpoint",
                 "model_init_kwargs", "reference_mode"}


def run(plan: Plan) -> None:
    """The rounds run of `plan` (plan.rounds set), from the folder's checks to the last round. Raises UsageError,
    InputError or OutputDirError, each one line."""
    started = time.perf_counter()
    plan.folder.check_apart_from(local_data(plan.data))  # before the lock: a refusal writes nothing
    _refuse_unsupported(plan)
    specs = plan.rounds.reward_funcs or ([DEMO_REWARD] if plan.data.dataset is None else None)
    if specs is None:
        raise UsageError("--rounds on your --dataset needs --reward_funcs (module:function, or a reward model's path)")
    reward_funcs = [_imported(spec) for spec in specs]  # before the model loads: a typo fails in a second
    weights = plan.rounds.reward_weights
    if weights is not None and len(weights) != len(specs):
        raise UsageError(f"--reward_weights has {len(weights)} weights for {len(specs)} --reward_funcs")
    config = rounds_config(plan, None)
    folder = plan.folder
    if plan.is_main:
        folder.lock()
    try:
        if plan.is_main:
            _check_folder(folder)
        prompts = load_prompts(plan)
        train_rows = _training_rows(prompts, config)
        if plan.is_main:  # the run's one plan line, before the model loads
            print(describe_rounds_plan(plan, config, len(train_rows), len(prompts) - len(train_rows)), flush=True)
        trust = plan.load.kwargs.get("trust_remote_code", False)  # --trust_remote_code, as the policy loads
        reward_funcs = [_reward_model(func, trust) if isinstance(func, str) else func for func in reward_funcs]
        model, tokenizer, peft_config, _ = model_setup.load_model(plan)
        try:
            check_room(prompts, train_rows, tokenizer, config.training)  # before the first sample
        except RoundsError as error:
            raise InputError(f"{_source(plan)}: {error}") from None
        try:
            result = run_rounds(model, tokenizer, prompts, reward_funcs, replace(config, peft_config=peft_config),
                                model_record={name: plan.resume_settings[name] for name in MODEL_SETTINGS})
        except RoundsError as error:
            raise InputError(str(error)) from None
    finally:
        folder.release()
    if plan.is_main:
        _say_results(result, folder, time.perf_counter() - started)


def rounds_config(plan: Plan, peft_config: Any) -> RoundsConfig:
    """The RoundsConfig of the plan: the rounds' options, the held-out share (--eval_fraction), the seed, and the
    training options given (a recipe's too, and the rounds demo's) for each round's DPO pass."""
    options, args = plan.rounds, plan.args
    trainable = {option.name for option in fields(DPOMinConfig) if option.init}
    given = set(options.given) | (set(ROUNDS_DEMO_DEFAULTS) if plan.demo else set()) | {"ddp_find_unused_parameters"}
    values = args.to_dict()  # as JSON holds them (enums as their values): settings.json records them
    training = {name: values[name] for name in sorted(given & trainable - NOT_PER_ROUND)}
    try:
        return RoundsConfig(
            output_dir=str(plan.folder.output_dir), rounds=options.rounds, num_generations=options.num_generations,
            max_completion_length=options.max_completion_length, temperature=options.temperature,
            top_p=options.top_p, reward_weights=options.reward_weights,
            missing_eos_penalty=options.missing_eos_penalty, min_margin=options.min_margin,
            reference=options.reference, on_no_pairs=options.on_no_pairs, held_out_share=plan.eval_fraction,
            generation_batch_size=options.generation_batch_size, seed=args.seed, training=training,
            prompts_per_round=options.prompts_per_round, pairs_per_prompt=options.pairs_per_prompt,
            pair_rule=options.pair_rule, dynamic_sampling=options.dynamic_sampling,
            max_num_gen_batches=options.max_num_gen_batches, skip_saturated=options.skip_saturated,
            round_max_steps=options.round_max_steps, peft_config=peft_config)
    except RoundsError as error:
        raise UsageError(f"--{error}") from None  # its messages open with the field's name, the option's


def _refuse_unsupported(plan: Plan) -> None:
    given = plan.rounds.given
    for option, instead in NOT_IN_ROUNDS.items():
        if option in given:
            raise UsageError(f"--{option} is not read with --rounds ({instead})")
    if plan.args.load_best_model_at_end:  # with strategies that match: Trainer would need an evaluation
        raise UsageError(LOAD_BEST_WITH_ROUNDS)
    # A round's DPO pass has no held-out pairs: Trainer refuses an evaluation after the round has sampled.
    evaluation = {"eval_strategy": getattr(plan.args.eval_strategy, "value", plan.args.eval_strategy),
                  "eval_on_start": plan.args.eval_on_start}
    for option, value in evaluation.items():
        if option in given and value not in ("no", False):
            raise UsageError(f"--{option} {value} is not read with --rounds (a round's DPO pass has no held-out pairs; "
                             "the held-out prompts, --eval_fraction, are scored after each round: held_out.jsonl)")


def _imported(spec: str) -> Callable[..., list] | str:
    """A reward function named as module:function, module.function (TRL's script) or a bare name of trl.rewards;
    a folder or a hub id (with a '/') stays a string: a reward model, loaded under the lock."""
    if ":" not in spec and (os.path.isdir(spec) or "/" in spec):
        if not os.path.exists(spec) and not is_repo_id(spec):  # else the hub's "Repo id must use alphanumeric ..."
            raise UsageError(f"--reward_funcs {spec}: no such reward model folder (and it is not a hub id either)")
        return spec
    module_name, _, name = spec.partition(":") if ":" in spec else spec.rpartition(".")
    module_name = module_name or "trl.rewards"
    if os.getcwd() not in sys.path:  # as TRL's grpo script: a reward module in the working folder imports
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # ImportError, or the module's own failure (a SyntaxError, ...)
        raise UsageError(f"--reward_funcs {spec}: cannot import {module_name} ({type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''})") from None
    func = getattr(module, name, None)
    if not callable(func):
        raise UsageError(f"--reward_funcs {spec}: {module_name} has no function {name!r}")
    return func


def _reward_model(path: str, trust_remote_code: bool) -> RewardModel:
    try:
        return load_reward_model(path, trust_remote_code)
    except (OSError, ValueError) as error:
        raise InputError(f"--reward_funcs {path}: {str(error).strip().splitlines()[0]}") from None


def _source(plan: Plan) -> str:
    return plan.data.dataset or str(EMBEDDED_PROMPTS)


def _training_rows(prompts: list[dict[str, Any]], config: RoundsConfig) -> list[int]:
    """The prompts the rounds train on: the run's own split, taken here to refuse a bad share or a draw larger than
    the pool before the model loads (the share's message names the library's field; the option is --eval_fraction)."""
    try:
        train_rows = split_held_out(len(prompts), config.held_out_share, config.seed)[0]
    except RoundsError as error:
        raise UsageError(f"--eval_fraction{str(error).removeprefix('held_out_share')}") from None
    try:
        check_pool(train_rows, config.prompts_per_round)  # a draw larger than the pool, before the model loads
    except RoundsError as error:
        raise UsageError(f"--{error}") from None
    return train_rows


def load_prompts(plan: Plan) -> list[dict[str, Any]]:
    """The prompt-only rows of --dataset (read as the command reads data), or the embedded arithmetic pool."""
    data_args = plan.data
    source = _source(plan)
    stem = source[:-3] if source.endswith(".gz") else source
    if not os.path.exists(source) and (data_args.dataset is None or stem.endswith(DATA_SUFFIXES)):
        raise UsageError(f"no such dataset file: {source}")
    try:
        rows = load_rows(source, data_args.split, data_args.dataset_config)
    except ValueError as error:
        raise InputError(str(error).strip().splitlines()[0]) from None
    if data_args.prompt_column and data_args.prompt_column != "prompt":
        if data_args.prompt_column not in rows.column_names:
            raise InputError(f"{source}: no column {data_args.prompt_column!r} (--prompt_column); it has "
                             f"{', '.join(rows.column_names)}")
        try:  # the offline mapping's rule: a prompt column beside the mapped one is refused, not dropped
            check_no_clash({"prompt": data_args.prompt_column}, rows.column_names)
        except ValueError as error:
            raise InputError(f"{source}: {error}") from None
        rows = rows.rename_column(data_args.prompt_column, "prompt")
    answers = [name for name in ("chosen", "rejected", "completion") if name in rows.column_names]
    if answers:
        raise InputError(f"{source} holds answers ({', '.join(answers)}), not prompts only: --rounds samples its own "
                         "(drop those columns), or train the pairs without --rounds")
    if "prompt" not in rows.column_names:
        raise InputError(f"{source}: no 'prompt' column (it has {', '.join(rows.column_names)}); --rounds reads "
                         "prompt-only rows (--prompt_column names yours)")
    try:
        return prompt_rows(rows)  # checked here, before the model loads
    except RoundsError as error:
        raise InputError(f"{source}: {error}") from None


def _check_folder(folder: RunFolder) -> None:
    """A rounds run writes into --output_dir itself: refused when it holds anything but a rounds run. The staging
    file of its first settings.json (dpo_min.files), left by a kill before the rename, is the run's own: the same
    command starts the run there again, and the writer replaces it."""
    out = folder.output_dir
    own = staging_path(out / SETTINGS_FILE).name
    if out.is_dir() and any(entry.name != own for entry in out.iterdir()) and not (out / SETTINGS_FILE).is_file():
        raise OutputDirError(f"--output_dir {folder.shown} holds files that are not a rounds run's (no "
                             f"{SETTINGS_FILE}); choose another folder")


def _say_results(result: Any, folder: RunFolder, seconds: float) -> None:
    """The held-out figures of every round together (each was printed as it came), and where the files are."""
    if result.held_out:
        print("held-out by round (greedy, 95% intervals):")
        for line in result.held_out:
            print(f"  {describe(line)}")
    print(f"wrote {len(result.rounds)} round(s) to {folder.shown} in {seconds:.0f} s: {_written(result, folder)}")


def _written(result: Any, folder: RunFolder) -> str:
    """The files the rounds left, as they are: a round that gave no pair trained nothing, so it has no checkpoint,
    and the policy is the last trained round's (or, none trained, the model as given)."""
    trained = [line["round"] for line in result.rounds if line["status"] == "trained"]
    idle = [str(line["round"]) for line in result.rounds if line["status"] != "trained"]
    files = [name for name in ("rounds.jsonl", "held_out.jsonl") if (folder.output_dir / name).is_file()]
    files += ["round-K/{samples,pairs}.jsonl"] + ["round-K/checkpoint"] * bool(trained)
    text = f"{', '.join(files[:-1])} and {files[-1]}"
    if not idle:
        return text
    policy = f"round-{trained[-1]}/checkpoint" if trained else "the model as given, untrained"
    return (f"{text}; round{'s' * (len(idle) > 1)} {', '.join(idle)} gave no pair (round-K/samples.jsonl holds the "
            f"rewards): not trained, no checkpoint, the policy unchanged; the policy now: {policy}")
