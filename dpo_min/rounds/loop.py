"""run_rounds: sample -> score -> pair -> one DPO pass, round after round, each phase's result on disk before the
next starts, so a run killed anywhere resumes where it stopped (store.py lists the files)."""

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState
from datasets import Dataset
from transformers import PrinterCallback, ProgressCallback, TrainerState

from dpo_min import DPOMinConfig, DPOMinTrainer
from dpo_min.devices import several_on_cpu
from dpo_min.tokenizing import (
    CARRIED_COLUMNS,
    GIVEN_COLUMNS,
    end_token_ids,
    made_by,
)

from . import draws, held_out, history, kept, pairs, schedule, spend, store
from .config import RoundsConfig, RoundsError
from .lines import no_pair_message, summary
from .policy import Policy
from .progress import RoundBar, TokenSteps, phase_bar
from .prompts import fingerprint, prompt_rows, rendered_prompts, split_held_out
from .rewards import RewardFunc, Rewards
from .sampling import Completion, GenerateFn, GenerationSettings, sample

logger = logging.getLogger(__name__)


@dataclass
class RoundsResult:
    rounds: list[dict[str, Any]]  # rounds.jsonl, one line per finished round
    held_out: list[dict[str, Any]]  # held_out.jsonl: round 0 (pi_0), then after each round
    policy: Policy  # the model as trained (with LoRA: policy.current() gives it with its adapter)
    # The last round's, when this call trained one, holding the trained policy: its save_model() writes it (with LoRA,
    # the adapter as round-K/checkpoint holds it).
    trainer: DPOMinTrainer | None = None
    stopped: str | None = None  # why the run stopped before config.rounds, if it did


@dataclass
class _Run:
    """What every phase of every round reads: fixed for the call."""

    config: RoundsConfig
    tokenizer: Any
    rows: list[dict[str, Any]]
    train_rows: list[int]
    held_rows: list[int]
    rewards: Rewards
    prompt_ids: list[list[int]]  # each row's prompt as rendered once: sampled from, and trained on
    end_ids: set[int]  # the ids a sample stops on: a pair's ids hold a special token only as their last, one of these
    folder: store.RoundFiles
    generate_fn: GenerateFn | None
    state: PartialState = field(default_factory=PartialState)

    def say(self, message: str) -> None:
        if self.state.is_main_process:
            print(message, flush=True)


def _shared(items: list[Any], work: Callable[[list[Any]], list[Any]], state: PartialState) -> list[Any]:
    """`work` on this process's share of `items` (every num_processes-th), the results gathered back in order."""
    if state.num_processes == 1:
        return work(items)
    mine = work(items[state.process_index::state.num_processes])
    everyone = [None] * state.num_processes
    torch.distributed.all_gather_object(everyone, mine)
    ordered = [None] * len(items)
    for rank, results in enumerate(everyone):
        ordered[rank::state.num_processes] = results
    return ordered


def _columns(run: _Run, row_indices: Sequence[int], per_row: int) -> dict[str, list]:
    """The prompt rows' other columns, each value repeated once per sample (TRL's reward kwargs). A column of any row
    is passed, None where a row lacks it: TRL's rows come from one dataset, whose every row has every column."""
    names = dict.fromkeys(name for i in row_indices for name in run.rows[i]
                          if name not in ("prompt", "completion", "completion_ids"))
    return {name: [run.rows[i].get(name) for i in row_indices for _ in range(per_row)] for name in names}


def _bar(run: _Run, label: str, total: int, unit: str) -> Any:
    hidden = not run.state.is_main_process or bool(run.config.training.get("disable_tqdm"))
    return phase_bar(label, total, unit, hidden)


def _sample_shared(run: _Run, model: Any, indices: list[int], settings: GenerationSettings,
                   label: str = "sampling", keep: Path | None = None, first_batch: int = 0) -> list[list[Completion]]:
    """The samples of each prompt in `indices`, in order: batches of prompts_per_batch prompts (generation_batch_size
    completions), batch b (numbered from first_batch) seeded settings.seed + b and dealt to the processes in turn, so
    a prompt's samples do not depend on the process count. `label` names the progress bar; `keep`, where the finished
    batches are kept (kept.py) until the phase's own file replaces them."""
    size = run.config.prompts_per_batch
    batches = [(first_batch + b, indices[start:start + size]) for b, start in enumerate(range(0, len(indices), size))]
    keep = keep if run.state.num_processes == 1 else None
    finished = kept.read(keep, batches)

    def work(mine: list[tuple[int, list[int]]]) -> list[list[list[Completion]]]:
        groups = []
        with _bar(run, label, sum(len(batch) for _, batch in mine), "prompt") as bar:
            for b, batch in mine:
                if b not in finished:
                    finished[b] = sample(model, run.tokenizer, [run.prompt_ids[i] for i in batch],
                                         replace(settings, seed=settings.seed + b), size, run.generate_fn,
                                         streamer=TokenSteps(bar, settings.max_new_tokens))
                    if keep is not None:
                        kept.write(keep, finished, batches)
                groups.append(finished[b])
                bar.update(len(batch))
        return groups
    return [group for groups in _shared(batches, work, run.state) for group in groups]


def _generate(run: _Run, model: Any, round_index: int, steps: int) -> list[dict[str, Any]]:
    """round-K/generated.jsonl: num_generations samples of each of the round's training prompts (every one, or its
    draw of prompts_per_round; draws.py: less those skipped, more to refill), by the current policy at the round's
    temperature. With dynamic_sampling each sample is scored as it comes (its next draw reads the scores)."""
    config, folder = run.config, run.folder.round_dir(round_index)
    settings = GenerationSettings(config.num_generations, config.max_completion_length, True,
                                  schedule.round_temperature(config.temperature, round_index), config.top_p,
                                  seed=schedule.round_seed(config.seed, round_index))
    past = history.draws([run.folder.round_dir(k) / "samples.jsonl" for k in range(1, round_index)],
                         config.min_margin, config.pair_rule) if config.skip_saturated else {}
    rows, drawn = draws.sample_round(
        config, run.train_rows, past, round_index,
        lambda indices, first: _sample_shared(run, model, indices, settings, f"round {round_index}: sampling",
                                              kept.partial_of(folder / "generated.jsonl"), first),
        lambda new: _scored(run, new, round_index, steps))
    if draws.uses_draws(config) and run.state.is_main_process:  # before generated.jsonl: with it, it is there
        store.write_json(folder / "draw.json", drawn)
    return rows


def _sampled(rows: list[dict[str, Any]]) -> list[int]:
    """The round's prompts, as its samples hold them, in their order."""
    return list(dict.fromkeys(row["prompt_index"] for row in rows))


def _score(run: _Run, generated: list[dict[str, Any]], round_index: int, steps: int) -> list[dict[str, Any]]:
    """round-K/samples.jsonl: every sample with its reward per function and the weighted sum (scored while sampled,
    with dynamic_sampling)."""
    scored = generated if generated and "total" in generated[0] else _scored(run, generated, round_index, steps)
    return [{**{key: value for key, value in row.items() if key not in ("rewards", "total")},
             "prompt": run.rows[row["prompt_index"]]["prompt"], "rewards": row["rewards"], "total": row["total"]}
            for row in scored]


def _scored(run: _Run, generated: list[dict[str, Any]], round_index: int, steps: int) -> list[dict[str, Any]]:
    """The rows with their reward per function and the weighted sum. Each process scores its share of the prompts,
    all their samples in one call to each function, as TRL's batches."""
    def work(groups: list[list[dict[str, Any]]]) -> list[list[tuple[dict, float | None]]]:
        rows = [row for group in groups for row in group]
        if not rows:
            return [[] for _ in groups]
        completions = [Completion(row["completion"], row["completion_ids"], row["truncated"]) for row in rows]
        indices = [row["prompt_index"] for row in rows]
        with _bar(run, f"round {round_index}: scoring", len(rows), "sample") as bar:  # one call per function
            scores = run.rewards.score([run.rows[i]["prompt"] for i in indices], completions,
                                       _columns(run, indices, 1), round_index, TrainerState(global_step=steps))
            bar.update(len(rows))
        results = list(zip(scores.per_function, scores.total))
        return [results[sum(map(len, groups[:g])):][:len(group)] for g, group in enumerate(groups)]
    by_prompt = [[row for row in generated if row["prompt_index"] == i] for i in _sampled(generated)]
    scored = _shared(by_prompt, work, run.state)
    return [{**row, "rewards": per_function, "total": total}
            for group, results in zip(by_prompt, scored) for row, (per_function, total) in zip(group, results)]


def _pairs(run: _Run, samples: list[dict[str, Any]], args: DPOMinConfig) -> tuple[list[dict[str, Any]], dict, int]:
    """The round's pairs, those the DPO pass would drop left out (its `pairs` count is what trains), the drop counts,
    and how many prompts were saturated (every sample scored the same)."""
    groups = [{"prompt_index": i, "prompt": run.rows[i]["prompt"], "prompt_ids": run.prompt_ids[i],
               "samples": [row for row in samples if row["prompt_index"] == i]} for i in _sampled(samples)]
    made, dropped = pairs.make_pairs(groups, run.config.min_margin, run.config.pairs_per_prompt,
                                     run.config.pair_rule, ranked=args.listwise)  # a listwise loss: one ranking
    # What made the ids, and the row's own template arguments: the DPO pass checks the ids by them (given_ids.py).
    made = [{**pair, **made_by(run.tokenizer, pair["prompt"]),
             **{name: run.rows[pair["prompt_index"]][name] for name in CARRIED_COLUMNS
                if run.rows[pair["prompt_index"]].get(name) is not None}} for pair in made]
    kept, untrainable = pairs.keep_trainable(made, run.tokenizer, args, run.end_ids)
    return kept, {**dropped, **untrainable}, pairs.saturated(groups)


def _evaluate(run: _Run, model: Any, round_index: int) -> None:
    """held_out.jsonl: a greedy completion of each held-out prompt, scored; printed and plotted."""
    if not run.held_rows or any(line["round"] == round_index for line in run.folder.held_out()):
        return
    when = "before round 1" if round_index == 0 else f"after round {round_index}"
    keep = run.folder.root / f"held_out-{round_index}.partial.jsonl"
    greedy = _sample_shared(run, model, run.held_rows, GenerationSettings(1, run.config.max_completion_length, False),
                            f"held-out {when}: greedy", keep)

    def work(items: list[tuple[int, Completion]]) -> list[float | None]:
        if not items:
            return []
        indices, completions = [i for i, _ in items], [c for _, c in items]
        return run.rewards.score([run.rows[i]["prompt"] for i in indices], completions, _columns(run, indices, 1),
                                 round_index).total
    totals = _shared([(i, group[0]) for i, group in zip(run.held_rows, greedy)], work, run.state)
    # Each prompt's total too (row index, total): a paired comparison of two runs reads them prompt by prompt.
    line = {"round": round_index, **held_out.mean_with_interval([t for t in totals if t is not None]),
            "unscorable": sum(t is None for t in totals), "per_prompt": [list(x) for x in zip(run.held_rows, totals)]}
    if run.state.is_main_process:
        run.folder.append("held_out.jsonl", line)
        keep.unlink(missing_ok=True)
        with store.written_whole(run.folder.root / "held_out.png") as staging:
            held_out.plot(run.folder.held_out(), staging)
    run.state.wait_for_everyone()
    run.say(held_out.describe(line))


def _phase(run: _Run, path: Path, times: dict[str, float], name: str, make: Callable[[], list[dict]]) -> list[dict]:
    """A phase's rows: read back when an earlier call wrote them, else made (timed) and written whole."""
    done = path.exists()
    # Every process looks before the main one can write it: else a late process finds the file just written, skips
    # the barrier below and leaves the main process waiting there (a hang under accelerate launch, seen once in CI).
    run.state.wait_for_everyone()
    if done:
        return store.read_jsonl(path)
    start = time.perf_counter()
    rows = make()
    times[name] = round(time.perf_counter() - start, 3)
    if run.state.is_main_process:
        store.write_jsonl(path, rows)
        kept.partial_of(path).unlink(missing_ok=True)  # its batches are in `path` now
    run.state.wait_for_everyone()
    return rows


def pair_dataset(made: list[dict[str, Any]]) -> Dataset:
    """A round's pairs as its DPO pass reads them: the ids the policy was given and sampled, trained as they are (no
    EOS where the policy emitted none), once checked against the text beside them and what made them."""
    columns = [name for name in ("prompt", "chosen", "rejected", *GIVEN_COLUMNS)
               if any(name in pair for pair in made)]
    return Dataset.from_list([{key: pair.get(key) for key in columns} for pair in made])


def _training_args(run: _Run, folder: Path, round_index: int, policy: Policy) -> DPOMinConfig:
    """The settings of a round's DPO pass; its reference named by the policy (RoundsConfig refuses one in training)."""
    return DPOMinConfig(**{"report_to": "none", "logging_steps": 1, "num_train_epochs": 1,  # one pass a round
                           "seed": run.config.seed + round_index, "use_cpu": several_on_cpu(),  # join over gloo
                           **run.config.round_training(round_index), "output_dir": str(folder / "train"),
                           "reference_mode": policy.reference_mode})


def _train(run: _Run, policy: Policy, made: list[dict[str, Any]], args: DPOMinConfig,
           folder: Path) -> tuple[dict[str, Any], DPOMinTrainer]:
    """One DPO pass on the round's pairs, warm-started from the last round; a half-trained round resumes from its
    latest checkpoint-N. Returns the mean of the round's logged step metrics, and the trainer."""
    try:  # the pass validates and tokenizes its pairs here: what it refuses is the round's one line, not a traceback
        trainer = DPOMinTrainer(**policy.trainer_models(), args=args, train_dataset=pair_dataset(made),
                                processing_class=run.tokenizer)
    except ValueError as error:
        raise RoundsError(f"{folder.name.replace('-', ' ')}: the DPO pass refused {folder.name}/pairs.jsonl: "
                          f"{(str(error).strip().splitlines() or [type(error).__name__])[0]}") from None
    # The round's one line says the pass's figures (_summary); Trainer would print every step's dict, every round.
    trainer.remove_callback(PrinterCallback)
    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(RoundBar(f"{folder.name.replace('-', ' ')}: DPO pass"))
    policy.warm_start(trainer)
    resume = any((folder / "train").glob("checkpoint-*"))
    with store.writing(folder / "train"):  # its checkpoint-N
        output = trainer.train(resume_from_checkpoint=True if resume else None)
    steps = [entry for entry in trainer.state.log_history if "loss" in entry and "train_loss" not in entry]
    keys = sorted({key for entry in steps for key in entry if key not in ("epoch", "step")})
    metrics = {key: sum(e[key] for e in steps if key in e) / sum(key in e for e in steps) for key in keys}
    # Not Trainer's training_loss: after a resume it averages only the steps that call ran.
    return {**metrics, "steps": output.global_step}, trainer


def _round(run: _Run, policy: Policy, round_index: int, steps: int) -> tuple[dict[str, Any], Any]:
    folder = run.folder.round_dir(round_index)
    times_path = folder / "phase_seconds.json"
    times = json.loads(times_path.read_text()) if times_path.exists() else {}
    with policy.current() as model:
        generated = _phase(run, folder / "generated.jsonl", times, "sampling",
                           lambda: _generate(run, model, round_index, steps))
    samples = _phase(run, folder / "samples.jsonl", times, "scoring",
                     lambda: _score(run, generated, round_index, steps))
    args = _training_args(run, folder, round_index, policy)
    made, dropped, saturated = _pairs(run, samples, args)
    _phase(run, folder / "pairs.jsonl", {}, "pairing", lambda: made)
    if run.state.is_main_process:
        store.write_json(times_path, times)
    totals = [row["total"] for row in samples if row["total"] is not None]
    line = {"round": round_index, "prompts": len(_sampled(samples)), "samples": len(samples), "pairs": len(made),
            "dropped": dropped, "saturated": saturated,
            "draw": spend.record(samples, draws.recorded(run.config, folder, _sampled(samples), round_index)),
            "unscorable_samples": len(samples) - len(totals),
            "reward_mean": held_out.mean_with_interval(totals)["mean"],  # finite where a sum of 1e308s is not
            "reward_best": max(totals, default=None), "reward_worst": min(totals, default=None)}
    if not made:
        return {**line, "status": f"no pair: {run.config.on_no_pairs}", "seconds": times}, None
    if run.config.trains_no_step(round_index):  # its pairs written, its weights the round before's
        return {**line, "status": "no step: round_max_steps 0", "seconds": times}, None
    trainer = None
    if (folder / "checkpoint").is_dir():  # trained before a kill: the round's weights are on disk
        policy.restore(folder / "checkpoint")
        metrics = json.loads((folder / "train_metrics.json").read_text())
    else:
        start = time.perf_counter()
        metrics, trainer = _train(run, policy, made, args, folder)
        times["training"] = round(time.perf_counter() - start, 3)
        if run.state.is_main_process:  # before the checkpoint: a checkpoint on disk means both are there
            store.write_json(folder / "train_metrics.json", metrics)
            store.write_json(times_path, times)
        policy.finish(trainer, folder / "checkpoint")
    with policy.current() as model:
        _evaluate(run, model, round_index)
    return {**line, "status": "trained", "dpo": metrics, "seconds": times}, trainer


def _open(model: Any, tokenizer: Any, prompts: Any, reward_funcs: Any, config: RoundsConfig,
          generate_fn: GenerateFn | None, model_record: dict[str, Any] | None) -> tuple[_Run, Policy, list[dict]]:
    """Validate, claim the output folder (or check a resume's settings), and load what finished rounds left."""
    rows = prompt_rows(prompts)
    rewards = Rewards(reward_funcs, config.reward_weights, config.missing_eos_penalty)
    train_rows, held_rows = split_held_out(len(rows), config.held_out_share, config.seed)
    schedule.check_pool(train_rows, config.prompts_per_round)  # before the folder is claimed
    state = PartialState(cpu=several_on_cpu())  # several CPU processes join over gloo, as the trainer's
    hidden = not state.is_main_process or bool(config.training.get("disable_tqdm"))
    run = _Run(config, tokenizer, rows, train_rows, held_rows, rewards,
               rendered_prompts(tokenizer, rows, config.training.get("chat_template_kwargs"), hidden),
               end_token_ids(model, tokenizer), store.RoundFiles(config.output_dir), generate_fn, state)
    with phase_bar("the reward functions' identity (code, weights)", 1, "step", hidden) as bar:
        identity = rewards.identity()
        bar.update()
    settings = {**config.settings(), "prompts": fingerprint(rows), "reward_funcs": rewards.names,
                "reward_identity": identity,
                "processes": state.num_processes,
                "model": store.model_record(model, tokenizer) if model_record is None else model_record}
    if state.is_main_process:
        run.folder.claim(settings)
    state.wait_for_everyone()
    if not state.is_main_process:
        run.folder.claim(settings)  # the main process wrote it, or refused: each process refuses alike
    shared = held_out.also_training(run.prompt_ids, train_rows, held_rows)
    if shared:
        run.say(shared)
    with phase_bar("the policy (LoRA adapter, reference)", 1, "step", hidden) as bar:
        policy = Policy(model, config.peft_config, config.reference)
        bar.update()
    done = run.folder.finished_rounds()
    checkpoint = run.folder.last_checkpoint()
    if checkpoint is not None:
        policy.restore(checkpoint)
    if done:
        run.say(f"resuming {config.output_dir}: {len(done)} round(s) finished")
    return run, policy, done


def run_rounds(model: torch.nn.Module, tokenizer: Any, prompts: Any, reward_funcs: RewardFunc | list[RewardFunc],
               config: RoundsConfig, generate_fn: GenerateFn | None = None,
               model_record: dict[str, Any] | None = None) -> RoundsResult:
    """DPO in rounds: each round samples config.num_generations completions of every training prompt from the
    current policy, scores them with `reward_funcs` (TRL GRPOTrainer's contract), pairs the best against the worst
    and trains one DPO pass on those pairs. Called again on the same output_dir, it resumes.

    model: pi_0, as loaded (on a resume too: the finished rounds' weights are loaded into it). prompts: rows with
    a `prompt` column (text or messages), other columns passed to the reward functions. model_record: what decides
    the numbers about the model, as the caller decided it (the command: its plan's model, revision, dtype and chat
    template); None reads it off `model` and `tokenizer` (store.model_record). Raises RoundsError (one line) on bad
    input, a bad reward, a full disk, or a resume with other settings (another model, dtype or chat template too)."""
    run, policy, done = _open(model, tokenizer, prompts, reward_funcs, config, generate_fn, model_record)
    if done and done[-1]["status"] == "no pair: stop":
        run.say(no_pair_message(done[-1]))  # the same call again: said again, not a silent return
        return RoundsResult(done, run.folder.held_out(), policy, stopped=no_pair_message(done[-1]))
    with policy.current() as current:
        _evaluate(run, current, 0)
    trainer, steps = None, sum(line.get("dpo", {}).get("steps", 0) for line in done)
    for round_index in range(len(done) + 1, config.rounds + 1):
        line, round_trainer = _round(run, policy, round_index, steps)
        trainer = round_trainer or trainer
        steps += line.get("dpo", {}).get("steps", 0)
        if run.state.is_main_process:
            run.folder.append("rounds.jsonl", line)
            with store.written_whole(run.folder.root / "rounds.png") as staging:
                spend.plot(run.folder.finished_rounds(), run.folder.held_out(), staging)
        run.state.wait_for_everyone()
        done.append(line)
        run.say(summary(line))
        if line["status"] == "no pair: stop":
            break
    policy.hand_to(trainer)
    stopped = no_pair_message(done[-1]) if done[-1]["status"] == "no pair: stop" else None
    return RoundsResult(done, run.folder.held_out(), policy, trainer, stopped=stopped)
