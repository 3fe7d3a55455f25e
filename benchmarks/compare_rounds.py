"""DPO in rounds against one offline round (issue 39, item 4): equal sampled completions, pairs and training steps,
the same held-out prompts, greedy, counted right or wrong.

    python benchmarks/compare_rounds.py                       # the rounds demo as it is (DPO + NLL), 3 rounds
    python benchmarks/compare_rounds.py --pool --seed 7 --out runs/compare-7 --json runs/compare-7.json \\
        --arm nll "--loss_type sigmoid sft --loss_weights 1 1" --arm previous "--reference previous"
    python benchmarks/compare_rounds.py --table runs/compare-42.json runs/compare-7.json runs/compare-1.json

The arms, each scored on the same held-out prompts (a greedy completion each, its last integer against the answer):
- pi_0: SmolLM2-135M-Instruct as loaded;
- rounds: `python -m dpo_min.train --rounds N`'s run, as the command makes it (its plan, model, LoRA and
  RoundsConfig), N rounds, each sampling the policy it has become; `--arm NAME "OPTIONS"` adds a rounds run with
  more options (the NLL term, `--reference previous`), on the same prompts' draws and seeds;
- offline: pi_0 sampled with the seeds, temperatures and prompts of the N rounds (so its first draw is round 1's,
  checked), paired by the same rule, pooled and cut to the rounds run's pairs count, then ONE DPO pass from pi_0 (a
  fresh adapter, pi_0 as reference) of exactly as many steps as the N rounds took together.
`--pool` runs every arm on data/arithmetic-pool.jsonl with the published recipes' sampling (POOL_OPTIONS): 64
held-out prompts, a fresh draw of 32 training prompts a round, 8 samples each, the best against the 2 worst.
Each run's folder is kept (--out/NAME): a second call reuses it, so only the offline arm reruns.
"""

import argparse
import json
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's dpo_min, when it is not installed

# The pool's task with the demo's model, template, LoRA and training settings (ROUNDS_DEMO_DEFAULTS, given as the
# command reads them once --dataset is given): eval_fraction 0.0213 holds out 64 of the 3,000 prompts.
POOL_OPTIONS = ["--dataset", str(ROOT / "data" / "arithmetic-pool.jsonl"),
                "--reward_funcs", "dpo_min.rounds.arithmetic:last_integer_reward", "--eval_fraction", "0.0213",
                "--prompts_per_round", "32", "--num_generations", "8", "--pairs_per_prompt", "2"]


def demo_options() -> list[str]:
    """The rounds demo's model and training settings, less what POOL_OPTIONS sets and its loss (the demo's NLL term
    is an --arm here; the base arm is plain DPO)."""
    from dpo_min.train.args import ROUNDS_DEMO_DEFAULTS

    own = {"eval_fraction", "prompts_per_round", "num_generations", "pairs_per_prompt", "loss_type", "loss_weights"}
    given = {key: value for key, value in ROUNDS_DEMO_DEFAULTS.items() if key not in own}
    return [item for key, value in given.items() for item in (f"--{key}", str(value))]


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


def pi0_pairs(model, tokenizer, rows, train_rows, config, rewards, round_index):
    """Pairs of pi_0's samples of round `round_index`'s prompts, drawn with its seed and temperature, by the rounds'
    rule."""
    from dpo_min.rounds import make_pairs
    from dpo_min.rounds.sampling import GenerationSettings
    from dpo_min.rounds.schedule import round_prompts, round_temperature

    settings = GenerationSettings(config.num_generations, config.max_completion_length, True,
                                  round_temperature(config.temperature, round_index), config.top_p,
                                  seed=config.seed + 1000 * round_index)
    indices = round_prompts(train_rows, config.prompts_per_round, config.seed, round_index)
    prompt_ids = render(tokenizer, rows, indices, config)
    groups = sample_like_the_rounds(model, tokenizer, prompt_ids, indices, settings, config.prompts_per_batch)
    prompt_groups = []
    for i, group in zip(indices, groups):
        columns = {"solution": [rows[i]["solution"]] * len(group)}
        totals = rewards.score([rows[i]["prompt"]] * len(group), group, columns, round_index).total
        prompt_groups.append({"prompt_index": i, "prompt": rows[i]["prompt"],
                              "prompt_ids": prompt_ids[i],
                              "samples": [{"completion": c.text, "completion_ids": c.ids, "total": t}
                                          for c, t in zip(group, totals)]})
    made, _ = make_pairs(prompt_groups, config.min_margin, config.pairs_per_prompt)
    return made


def held_out_count(model, tokenizer, rows, held_rows, config, rewards) -> tuple[int, int]:
    """(right, prompts): one greedy completion of each held-out prompt, batched as the rounds loop batches it."""
    from dpo_min.rounds.sampling import GenerationSettings

    greedy = sample_like_the_rounds(model, tokenizer, render(tokenizer, rows, held_rows, config), held_rows,
                                    GenerationSettings(1, config.max_completion_length, False),
                                    config.prompts_per_batch)
    completions = [group[0] for group in greedy]
    totals = rewards.score([rows[i]["prompt"] for i in held_rows], completions,
                           {"solution": [rows[i]["solution"] for i in held_rows]}, 0).total
    return int(sum(t or 0 for t in totals)), len(held_rows)


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


def offline_arm(on: dict, out: Path) -> dict:
    from datasets import Dataset

    from dpo_min import DPOMinConfig, DPOMinTrainer
    from dpo_min.rounds import Rewards
    from dpo_min.rounds.arithmetic import last_integer_reward
    from dpo_min.rounds.prompts import prompt_rows, split_held_out
    from dpo_min.train import load_model
    from dpo_min.train.rounds import load_prompts

    plan, config, result = on["plan"], on["config"], on["result"]
    start = time.perf_counter()
    model, tokenizer, peft_config, _ = load_model(plan)  # pi_0 again, untouched by the rounds run
    rows = prompt_rows(load_prompts(plan))
    train_rows, held_rows = split_held_out(len(rows), config.held_out_share, config.seed)
    rewards = Rewards([last_integer_reward])
    pi0 = held_out_count(model, tokenizer, rows, held_rows, config, rewards)
    draws = [pi0_pairs(model, tokenizer, rows, train_rows, config, rewards, k) for k in range(1, config.rounds + 1)]
    key = lambda pair: json.dumps([pair["prompt_index"], pair["chosen_ids"], pair["rejected_ids"]])  # noqa: E731
    round_one = [key(json.loads(line)) for line in (Path(config.output_dir) / "round-1" / "pairs.jsonl").open()]
    first = [key(pair) for pair in draws[0]]
    if [k for k in first if k in round_one] != round_one:  # the round drops what the DPO pass would drop; no more
        sys.exit("pi_0's first draw differs from the rounds run's round 1: the two arms do not start alike")
    pairs_count = sum(line["pairs"] for line in result.rounds)
    steps = sum(line["dpo"]["steps"] for line in result.rounds if "dpo" in line)
    pool = [pair for draw in draws for pair in draw]
    chosen = pool[:pairs_count]
    args = DPOMinConfig(**{"report_to": "none", "logging_steps": 1, "seed": config.seed + 1, **config.training,
                           "output_dir": str(out / "train"), "max_steps": steps})
    columns = ("prompt", "chosen", "rejected", "prompt_ids", "chosen_ids", "rejected_ids")  # the sampled ids
    data = Dataset.from_list([{name: pair[name] for name in columns} for pair in chosen])
    trainer = DPOMinTrainer(model=model, peft_config=peft_config, args=args, train_dataset=data,
                            processing_class=tokenizer)
    trainer.train()
    after = held_out_count(trainer.model, tokenizer, rows, held_rows, config, rewards)
    return {"pi0": pi0, "after": after, "pool": len(pool), "pairs": len(chosen), "steps": trainer.state.global_step,
            "per_draw": [len(draw) for draw in draws], "seconds": time.perf_counter() - start}


def interval(right: int, n: int) -> str:
    from dpo_min.rounds.held_out import mean_with_interval

    line = mean_with_interval([1.0] * right + [0.0] * (n - right))
    return f"{right}/{n} = {line['mean']:.3f} [{line['low']:.3f}, {line['high']:.3f}]"


def summary(on: dict) -> dict:
    """A rounds run's figures: held-out right after each round (round 0: pi_0), and per round its pairs, steps,
    prompts sampled and prompts saturated."""
    held = {line["round"]: line for line in on["result"].held_out}
    n = held[0]["n"]
    rounds = on["result"].rounds
    return {"n": n, "right": [round(held[k]["mean"] * n) for k in sorted(held)],
            "pairs": [line["pairs"] for line in rounds],
            "steps": [line.get("dpo", {}).get("steps", 0) for line in rounds],
            "prompts": [line["prompts"] for line in rounds], "saturated": [line.get("saturated") for line in rounds],
            "seconds": round(on["seconds"])}


def print_seed(figures: dict) -> None:
    arms, off = figures["arms"], figures["offline"]
    n = off["pi0"][1]
    print(f"seed {figures['seed']}: held-out prompts {n}, greedy, exact answer; pi_0 pairs per draw: "
          f"{off['per_draw']}\n")
    print("| arm | pairs per round | steps | saturated per round | held-out right (95% interval) | s |\n"
          "| --- | --- | ---: | --- | --- | ---: |")
    print(f"| pi_0 | | 0 | | {interval(off['pi0'][0], n)} | |")
    print(f"| one offline round on pi_0's pairs, as {figures['offline_like']} | {off['pairs']} of {off['pool']} | "
          f"{off['steps']} | | "
          f"{interval(off['after'][0], n)} | {off['seconds']:.0f} |")
    for name, arm in arms.items():
        print(f"| {name} | {arm['pairs']} | {sum(arm['steps'])} | {arm['saturated']} | "
              f"{' -> '.join(str(r) for r in arm['right'][1:])} of {n}: {interval(arm['right'][-1], n)} | "
              f"{arm['seconds']} |")


def print_table(paths: list[str]) -> None:
    """Every seed's final held-out counts per arm, and all seeds pooled (each seed holds out its own prompts). Files
    of one seed (another --offline_like on the same folders) are merged."""
    by_seed: dict[int, dict[str, tuple[int, int]]] = {}
    for path in paths:
        figures = json.loads(Path(path).read_text())
        off = figures["offline"]
        rows = by_seed.setdefault(figures["seed"], {"pi_0": tuple(off["pi0"])})
        if rows["pi_0"] != tuple(off["pi0"]):
            sys.exit(f"{path}: pi_0 scored {off['pi0']}, another file of seed {figures['seed']} {rows['pi_0']}")
        rows[f"one offline round, as {figures.get('offline_like', 'rounds')}"] = tuple(off["after"])
        rows |= {name: (arm["right"][-1], arm["n"]) for name, arm in figures["arms"].items()}
    names = list(dict.fromkeys(name for rows in by_seed.values() for name in rows))
    heads = " | ".join(f"seed {seed}" for seed in by_seed)
    print(f"| arm | {heads} | all seeds (95% interval) |\n| --- | {' | '.join('---:' for _ in by_seed)} | --- |")
    for name in names:
        finals = [rows[name] for rows in by_seed.values() if name in rows]
        cells = " | ".join(f"{rows[name][0]}/{rows[name][1]}" if name in rows else "" for rows in by_seed.values())
        right, n = sum(r for r, _ in finals), sum(k for _, k in finals)
        print(f"| {name} | {cells} | {interval(right, n)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=42, help="the run's --seed: sampling, held-out split, training")
    parser.add_argument("--out", default="compare_rounds", help="where every arm writes (kept; reused on a rerun)")
    parser.add_argument("--json", default=None, help="also write the figures to this file (for --table)")
    parser.add_argument("--pool", action="store_true", help="the arithmetic pool with fresh prompts (POOL_OPTIONS)")
    parser.add_argument("--arm", nargs=2, action="append", default=[], metavar=("NAME", "OPTIONS"),
                        help="one more rounds run: the same command line and these options")
    parser.add_argument("--offline_like", default="rounds",
                        help="the rounds arm the offline arm matches: its loss, pairs count and steps")
    parser.add_argument("--table", nargs="+", default=None, help="print the seeds' table from these --json files")
    args = parser.parse_args()
    if args.table:
        return print_table(args.table)
    out = Path(args.out)
    shared = ["--rounds", str(args.rounds), "--seed", str(args.seed)]
    shared += demo_options() + POOL_OPTIONS if args.pool else []
    arms = {"rounds": rounds_arm([*shared, "--output_dir", str(out / "rounds")])}
    for name, options in args.arm:
        arms[name] = rounds_arm(shared + shlex.split(options) + ["--output_dir", str(out / name)])
    if args.offline_like not in arms:
        sys.exit(f"--offline_like {args.offline_like}: no such arm (rounds, or an --arm's name)")
    off = offline_arm(arms[args.offline_like], out / f"offline-like-{args.offline_like}")
    figures = {"seed": args.seed, "options": shared, "arms": {name: summary(on) for name, on in arms.items()},
               "arm_options": dict(args.arm), "offline_like": args.offline_like, "offline": off}
    for name, arm in figures["arms"].items():
        if arm["right"][0] != off["pi0"][0]:
            sys.exit(f"pi_0 scored {off['pi0'][0]} here and {arm['right'][0]} in the {name} run: not the same pi_0")
    print_seed(figures)
    print(f"\nreproduce: python benchmarks/compare_rounds.py {shlex.join(sys.argv[1:])}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1, default=str))


if __name__ == "__main__":
    main()
