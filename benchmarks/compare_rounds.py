"""DPO in rounds against one offline round, by a protocol fixed before its seeds run (issue 45): every arm scored on
the same held-out prompts of the arithmetic pool, one greedy completion each, right or wrong, prompt by prompt.

    python benchmarks/compare_rounds.py --protocol benchmarks/protocols/rounds-2026-12-05.json --seed 13 \\
        --out runs/compare-13 --json runs/compare-13.json
    python benchmarks/compare_rounds.py --table runs/compare-*.json       # per seed, pooled, the paired tests

The arms of one seed (its held-out split, draws and sampling seeds are the command's for that --seed):
- pi_0: SmolLM2-135M-Instruct as loaded (the rounds run's own score before round 1);
- rounds: `python -m dpo_min.train --rounds N` with the protocol's options, as the command makes it (its plan,
  model, LoRA and RoundsConfig); each round samples the policy it has become;
- offline_samples (equal sampled completions): pi_0 sampled on the same prompts with the same seeds and
  temperatures as the rounds (round 1's samples are pi_0's: read back from the rounds folder), paired by the same
  rule, pooled, and ONE DPO pass from pi_0 with the rounds' training options (its own number of steps);
- offline_matched (equal pairs and steps): the same pool cut to the rounds' pairs count (all of it when pi_0 gave
  fewer: the unique pairs are reported) and exactly as many steps as the rounds took together.
A protocol fixes one learning-rate schedule for all arms (constant: equal steps are equal summed learning rate),
which is what makes the matched comparison fair; each round's pass would otherwise restart a decay.
The seed must be one the protocol lists; each arm's folder is kept under --out and a rerun reuses the rounds run.
A seed file records the protocol's digest and its arguments; `--table` reads the protocol and refuses, in one line,
a file not run under it (benchmarks/seed_files.py).
The paired statistics are benchmarks/paired.py's.
"""

import json
import sys
import time
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's dpo_min, when it is not installed
sys.path.insert(0, str(ROOT / "benchmarks"))

from paired import overdispersion, seed_permutation_test, shown_p  # noqa: E402
from seed_files import SeedFileForm, protocol_digest, read_seeds, recorded_argv, run_or_table  # noqa: E402

# The pool's task with the demo's model, template and LoRA: eval_fraction 0.0213 holds out 64 of the 3,000 prompts.
POOL_OPTIONS = ["--dataset", str(ROOT / "data" / "arithmetic-pool.jsonl"),
                "--reward_funcs", "dpo_min.rounds.arithmetic:last_integer_reward", "--eval_fraction", "0.0213"]
ARMS = ("pi_0", "rounds", "offline_samples", "offline_matched")


def demo_options() -> list[str]:
    """The rounds demo's model and training settings (ROUNDS_DEMO_DEFAULTS, as the command reads them once --dataset
    is given); a protocol's options come after them and win."""
    from dpo_min.train.args import ROUNDS_DEMO_DEFAULTS

    return [item for key, value in ROUNDS_DEMO_DEFAULTS.items() if key != "eval_fraction"
            for item in (f"--{key}", *(map(str, value) if isinstance(value, list) else [str(value)]))]


def render(tokenizer, rows, indices, config=None) -> dict[int, list[int]]:
    """The prompt ids of rows `indices`, by the rounds' own renderer with the run's chat_template_kwargs (only the
    rows asked for: the pool has 3,000)."""
    from dpo_min.rounds.loop import rendered_prompts

    kwargs = getattr(config, "training", {}).get("chat_template_kwargs")
    return dict(zip(indices, rendered_prompts(tokenizer, [rows[i] for i in indices], kwargs)))


def sample_like_the_rounds(model, tokenizer, prompt_ids, indices, settings, batch_size):
    """The samples of `indices` (their ids in `prompt_ids`, from `render`) as the rounds loop draws them: batches of
    batch_size prompts, batch b seeded settings.seed + b (one process)."""
    from dpo_min.rounds.sampling import sample

    groups = []
    for b, start in enumerate(range(0, len(indices), batch_size)):
        batch = [prompt_ids[i] for i in indices[start:start + batch_size]]
        groups += sample(model, tokenizer, batch, replace(settings, seed=settings.seed + b), batch_size)
    return groups


def pi0_groups(model, tokenizer, rows, train_rows, config, rewards, round_index):
    """pi_0's scored samples of round `round_index`'s prompts, drawn with its seed and temperature."""
    from dpo_min.rounds.sampling import GenerationSettings
    from dpo_min.rounds.schedule import round_prompts, round_temperature

    settings = GenerationSettings(config.num_generations, config.max_completion_length, True,
                                  round_temperature(config.temperature, round_index), config.top_p,
                                  seed=config.seed + 1000 * round_index)
    indices = round_prompts(train_rows, config.prompts_per_round, config.seed, round_index)
    prompt_ids = render(tokenizer, rows, indices, config)
    groups = sample_like_the_rounds(model, tokenizer, prompt_ids, indices, settings, config.prompts_per_batch)
    return scored_groups(rows, indices, prompt_ids, groups, rewards, round_index)


def scored_groups(rows, indices, prompt_ids, groups, rewards, round_index) -> list[dict]:
    """Each prompt's samples (`groups`, in the order of `indices`) scored, as make_pairs reads a prompt's group."""
    scored = []
    for i, group in zip(indices, groups):
        columns = {"solution": [rows[i]["solution"]] * len(group)}
        totals = rewards.score([rows[i]["prompt"]] * len(group), group, columns, round_index).total
        scored.append({"prompt_index": i, "prompt": rows[i]["prompt"], "prompt_ids": prompt_ids[i],
                       "samples": [{"completion": c.text, "completion_ids": c.ids, "total": t}
                                   for c, t in zip(group, totals)]})
    return scored


def round_one_groups(folder: Path, tokenizer, rows, config):
    """Round 1's scored samples as the rounds run wrote them: pi_0's, with round 1's seed, prompts and temperature."""
    samples = [json.loads(line) for line in (folder / "round-1" / "samples.jsonl").open()]
    indices = list(dict.fromkeys(row["prompt_index"] for row in samples))
    prompt_ids = render(tokenizer, rows, indices, config)
    return [{"prompt_index": i, "prompt": rows[i]["prompt"], "prompt_ids": prompt_ids[i],
             "samples": [row for row in samples if row["prompt_index"] == i]} for i in indices]


def held_out_outcomes(model, tokenizer, rows, held_rows, config, rewards) -> list[int]:
    """One greedy completion of each held-out prompt, batched as the rounds loop batches it: 1 right, 0 not."""
    from dpo_min.rounds.sampling import GenerationSettings

    greedy = sample_like_the_rounds(model, tokenizer, render(tokenizer, rows, held_rows, config), held_rows,
                                    GenerationSettings(1, config.max_completion_length, False),
                                    config.prompts_per_batch)
    totals = rewards.score([rows[i]["prompt"] for i in held_rows], [group[0] for group in greedy],
                           {"solution": [rows[i]["solution"] for i in held_rows]}, 0).total
    return [int(bool(total)) for total in totals]


def held_out_count(model, tokenizer, rows, held_rows, config, rewards) -> tuple[int, int]:
    """(right, prompts) of held_out_outcomes (benchmarks/online_dpo_peer.py scores its peer so)."""
    outcomes = held_out_outcomes(model, tokenizer, rows, held_rows, config, rewards)
    return sum(outcomes), len(outcomes)


def rounds_arm(argv: list[str]) -> dict:
    """The command's own rounds run of `argv` (its folder reused when it is there)."""
    from dpo_min.rounds import run_rounds
    from dpo_min.rounds.arithmetic import last_integer_reward
    from dpo_min.train import load_model, resolve
    from dpo_min.train.rounds import MODEL_SETTINGS, load_prompts, rounds_config

    plan = resolve(argv)
    model, tokenizer, peft_config, _ = load_model(plan)
    config = replace(rounds_config(plan, None), peft_config=peft_config)
    start = time.perf_counter()
    # The command's record of the model, so that a folder the command wrote is reused here (and the other way).
    result = run_rounds(model, tokenizer, load_prompts(plan), [last_integer_reward], config,
                        model_record={name: plan.resume_settings[name] for name in MODEL_SETTINGS})
    return {"plan": plan, "config": config, "result": result, "seconds": time.perf_counter() - start}


def rounds_figures(on: dict) -> dict:
    """Per round: held-out right (round 0: pi_0), the prompts whose outcome changed since the round before, pairs,
    steps, prompts saturated; and the final per-prompt outcomes."""
    held = sorted(on["result"].held_out, key=lambda line: line["round"])
    outcomes = [[int(bool(total)) for _, total in line["per_prompt"]] for line in held]
    rounds = on["result"].rounds
    return {"right": [sum(o) for o in outcomes], "outcomes": outcomes[-1], "pi0_outcomes": outcomes[0],
            "held_rows": [i for i, _ in held[0]["per_prompt"]],
            "changed": [sum(a != b for a, b in zip(before, after)) for before, after in pairwise(outcomes)],
            "pairs": [line["pairs"] for line in rounds],
            "steps": [line.get("dpo", {}).get("steps", 0) for line in rounds],
            "saturated": [line.get("saturated") for line in rounds], "seconds": round(on["seconds"])}


def offline_arms(on: dict, out: Path) -> dict:
    """offline_samples and offline_matched (the module's docstring), from one pool of pi_0's pairs."""
    from dpo_min.rounds import Rewards, make_pairs
    from dpo_min.rounds.arithmetic import last_integer_reward
    from dpo_min.rounds.pairs import keep_trainable
    from dpo_min.rounds.prompts import prompt_rows, split_held_out
    from dpo_min.train import load_model
    from dpo_min.train.rounds import load_prompts

    plan, config, result = on["plan"], on["config"], on["result"]
    start = time.perf_counter()
    model, tokenizer, _, _ = load_model(plan)  # pi_0 again, untouched by the rounds run
    rows = prompt_rows(load_prompts(plan))
    train_rows, held_rows = split_held_out(len(rows), config.held_out_share, config.seed)
    rewards = Rewards([last_integer_reward])
    groups = [round_one_groups(Path(config.output_dir), tokenizer, rows, config)]
    groups += [pi0_groups(model, tokenizer, rows, train_rows, config, rewards, k) for k in range(2, config.rounds + 1)]
    args = pass_args(config, out / "check")
    draws = [keep_trainable(make_pairs(g, config.min_margin, config.pairs_per_prompt, config.pair_rule)[0],
                            tokenizer, args)[0] for g in groups]
    pool = [pair for draw in draws for pair in draw]
    rounds_pairs = sum(line["pairs"] for line in result.rounds)
    rounds_steps = sum(line["dpo"]["steps"] for line in result.rounds if "dpo" in line)
    figures = {"per_draw": [len(draw) for draw in draws], "pool": len(pool)}
    for name, pairs, steps in (("offline_samples", pool, None), ("offline_matched", pool[:rounds_pairs], rounds_steps)):
        trained, taken = one_pass(plan, config, pairs, steps, out / name)
        figures[name] = {"pairs": len(pairs), "steps": taken,
                         "outcomes": held_out_outcomes(trained, tokenizer, rows, held_rows, config, rewards)}
    figures["seconds"] = round(time.perf_counter() - start)
    return figures


def one_pass(plan, config, pairs, steps, out: Path):
    """ONE DPO pass from pi_0 (a fresh load, a fresh adapter, pi_0 as reference) on `pairs`, with the rounds' training
    options; `steps` None: as many as its epochs take. Returns the trained model and its steps."""
    from datasets import Dataset

    from dpo_min import DPOMinTrainer
    from dpo_min.train import load_model

    model, tokenizer, peft_config, _ = load_model(plan)
    args = pass_args(config, out, steps)
    columns = ("prompt", "chosen", "rejected", "prompt_ids", "chosen_ids", "rejected_ids")  # the sampled ids
    data = Dataset.from_list([{name: pair[name] for name in columns} for pair in pairs])
    trainer = DPOMinTrainer(model=model, peft_config=peft_config, args=args, train_dataset=data,
                            processing_class=tokenizer)
    trainer.train()
    return trainer.model, trainer.state.global_step


def pass_args(config, out: Path, steps: int | None = None):
    """The DPOMinConfig of one offline pass from pi_0 with the rounds' training options: as a round's, seeded
    seed + 1; `steps` None: as many as its epochs take."""
    from dpo_min import DPOMinConfig

    cap = {} if steps is None else {"max_steps": steps}
    return DPOMinConfig(**{"report_to": "none", "logging_steps": 1, "num_train_epochs": 1, "seed": config.seed + 1,
                           **config.training, "output_dir": str(out), **cap})


def seed_argv(protocol: dict, seed: int, out: Path = Path("compare_rounds")) -> list[str]:
    """The rounds run's arguments for one seed of the protocol (its seed files record them, `--table` checks them)."""
    return ["--rounds", str(protocol["rounds"]), "--seed", str(seed), *demo_options(), *POOL_OPTIONS,
            *protocol["options"], "--output_dir", str(out / "rounds")]


def seed_fields(protocol: dict) -> dict:
    """The fields of a seed file of `protocol` that `--table` reads (seed_files.field_problem's shape)."""
    rounds = protocol["rounds"]
    return {"seed": int, "protocol": str, "protocol_digest": str, "argv": list, "held_rows": list,
            "rounds": {"right": rounds + 1, "changed": rounds, "pairs": rounds, "steps": rounds}, "per_draw": rounds,
            "outcomes": dict.fromkeys(ARMS, list),
            "offline": {arm: {"steps": int} for arm in ("offline_samples", "offline_matched")}}


SEED_FILES = SeedFileForm({"name": str, "seeds": list, "rounds": int, "options": list}, seed_fields, seed_argv)


def run_seed(protocol: dict, seed: int, out: Path) -> dict:
    if seed not in protocol["seeds"]:
        sys.exit(f"seed {seed} is not one of the protocol's {protocol['seeds']}: a protocol's seeds are fixed")
    argv = seed_argv(protocol, seed, out)
    on = rounds_arm(argv)
    rounds = rounds_figures(on)
    off = offline_arms(on, out)
    return {"seed": seed, "protocol": protocol["name"], "protocol_digest": protocol_digest(protocol),
            "argv": recorded_argv(argv), "held_rows": rounds["held_rows"],
            "rounds": rounds, "per_draw": off["per_draw"], "pool": off["pool"], "offline_seconds": off["seconds"],
            "outcomes": {"pi_0": rounds["pi0_outcomes"], "rounds": rounds["outcomes"],
                         "offline_samples": off["offline_samples"]["outcomes"],
                         "offline_matched": off["offline_matched"]["outcomes"]},
            "offline": {name: {k: v for k, v in off[name].items() if k != "outcomes"}
                        for name in ("offline_samples", "offline_matched")}}


def interval(right: int, n: int) -> str:
    from dpo_min.intervals import wilson_interval

    low, high = wilson_interval(right, n)
    return f"{right}/{n} = {right / n:.3f} [{low:.3f}, {high:.3f}]"


def print_table(paths: list[str], protocol_file: str | None = None) -> None:
    """Per seed: each arm's held-out right, the rounds' per-round figures; then every seed pooled (Wilson 95%
    interval) and the paired tests of the rounds against each offline arm and of each arm against pi_0. Every file is
    checked against the protocol first (`protocol_file`, or the one the files name): seed_files.read_seeds."""
    _, seeds = read_seeds(paths, protocol_file, SEED_FILES)
    print(f"protocol {seeds[0]['protocol']}, {len(seeds)} seed(s)\n")
    print("| seed | pi_0 | rounds (after each round) | changed per round | offline, equal samples | offline, equal "
          "pairs and steps | pairs per round (pi_0's per draw) | steps: rounds, samples, matched |\n"
          "| ---: | ---: | --- | --- | ---: | ---: | --- | --- |")
    for f in seeds:
        r, o = f["rounds"], f["offline"]
        print(f"| {f['seed']} | {r['right'][0]} | {' -> '.join(map(str, r['right'][1:]))} | {r['changed']} | "
              f"{sum(f['outcomes']['offline_samples'])} | {sum(f['outcomes']['offline_matched'])} | "
              f"{r['pairs']} ({f['per_draw']}) | {sum(r['steps'])}, {o['offline_samples']['steps']}, "
              f"{o['offline_matched']['steps']} |")
    pooled = {arm: [x for f in seeds for x in f["outcomes"][arm]] for arm in ARMS}
    print("\n| arm | all seeds (Wilson 95%) |\n| --- | --- |")
    for arm in ARMS:
        print(f"| {arm} | {interval(sum(pooled[arm]), len(pooled[arm]))} |")
    print_comparisons(seeds, pooled, (("rounds", "offline_samples"), ("rounds", "offline_matched"), ("rounds", "pi_0"),
                                      ("offline_samples", "pi_0"), ("offline_matched", "pi_0")))


def print_comparisons(seeds: list[dict], pooled: dict[str, list[int]], comparisons) -> None:
    """The paired tests of each (first, second) arm: over prompts (exact McNemar) and over seeds (the sign test, the
    exact sign-flip test, and how much more the seeds vary than independent prompts would make them)."""
    print("\n| comparison | right only in the first | right only in the second | exact McNemar p (prompts) | "
          "seeds first ahead / behind / level | sign test p (seeds) | sign-flip p (seeds) | seed variance / prompts' "
          "|\n| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |")
    for first, second in comparisons:
        only_first = sum(a and not b for a, b in zip(pooled[first], pooled[second]))
        only_second = sum(b and not a for a, b in zip(pooled[first], pooled[second]))
        diffs = [sum(f["outcomes"][first]) - sum(f["outcomes"][second]) for f in seeds]
        ahead, behind = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
        spread = (f"{overdispersion(diffs, len(seeds[0]['outcomes'][first]), only_first, only_second):.2f}"
                  if len(diffs) > 1 and only_first + only_second else "-")
        print(f"| {first} vs {second} | {only_first} | {only_second} | {shown_p(only_first, only_first + only_second)}"
              f" | {ahead} / {behind} / {len(diffs) - ahead - behind} | {shown_p(ahead, ahead + behind)} | "
              f"{seed_permutation_test(diffs):.3g} | {spread} |")


def main() -> None:
    run_or_table(__doc__, "compare_rounds", run_seed, print_table)


if __name__ == "__main__":
    main()
