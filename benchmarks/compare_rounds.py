"""DPO in rounds against one offline round, on the rounds demo's task (issue 33, item 5): the same pairs count and
training steps, the same held-out prompts, greedy, counted right or wrong.

    python benchmarks/compare_rounds.py                  # the demo's settings, 3 rounds; about 2x the demo's time
    python benchmarks/compare_rounds.py --seed 7 --out /tmp/compare-7

Three arms, each scored on the demo's held-out prompts (a greedy completion each, its last integer against the
answer):
- pi_0: SmolLM2-135M-Instruct as loaded;
- on-policy: `python -m dpo_min.train --rounds N`'s run, as the command makes it (its plan, model, LoRA and
  RoundsConfig), N rounds, each sampling the policy it has become;
- offline: pi_0 sampled N times with the seeds of those N rounds (so its first draw is round 1's, checked), paired by
  the same rule, pooled and cut to the on-policy run's pairs count, then ONE DPO pass from pi_0 (a fresh adapter,
  pi_0 as reference) of exactly as many steps as the N rounds took together.
The on-policy run's folder is kept (--out/on-policy): a second call reuses it, so only the offline arm reruns.
"""

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's dpo_min, when it is not installed


def sample_like_the_rounds(model, tokenizer, rows, indices, settings, batch_size):
    """The samples of `indices` as the rounds loop draws them: batches of batch_size prompts, batch b seeded
    settings.seed + b (one process)."""
    from dpo_min.rounds.loop import rendered_prompts
    from dpo_min.rounds.sampling import sample

    prompt_ids = rendered_prompts(tokenizer, rows, None)
    groups = []
    for b, start in enumerate(range(0, len(indices), batch_size)):
        batch = [prompt_ids[i] for i in indices[start:start + batch_size]]
        groups += sample(model, tokenizer, batch, replace(settings, seed=settings.seed + b), batch_size)
    return groups


def pi0_pairs(model, tokenizer, rows, train_rows, config, rewards, round_index):
    """Pairs of pi_0's samples drawn with round `round_index`'s seed, by the rounds' rule."""
    from dpo_min.rounds import make_pairs
    from dpo_min.rounds.loop import rendered_prompts
    from dpo_min.rounds.sampling import GenerationSettings

    settings = GenerationSettings(config.num_generations, config.max_completion_length, True, config.temperature,
                                  config.top_p, seed=config.seed + 1000 * round_index)
    groups = sample_like_the_rounds(model, tokenizer, rows, train_rows, settings, config.prompts_per_batch)
    prompt_ids = rendered_prompts(tokenizer, rows, None)
    prompt_groups = []
    for i, group in zip(train_rows, groups):
        columns = {"solution": [rows[i]["solution"]] * len(group)}
        totals = rewards.score([rows[i]["prompt"]] * len(group), group, columns, round_index).total
        prompt_groups.append({"prompt_index": i, "prompt": rows[i]["prompt"],
                              "prompt_ids": prompt_ids[i],
                              "samples": [{"completion": c.text, "completion_ids": c.ids, "total": t}
                                          for c, t in zip(group, totals)]})
    made, _ = make_pairs(prompt_groups, config.min_margin)
    return made


def held_out_count(model, tokenizer, rows, held_rows, config, rewards) -> tuple[int, int]:
    """(right, prompts): one greedy completion of each held-out prompt, batched as the rounds loop batches it."""
    from dpo_min.rounds.sampling import GenerationSettings

    greedy = sample_like_the_rounds(model, tokenizer, rows, held_rows,
                                    GenerationSettings(1, config.max_completion_length, False),
                                    config.prompts_per_batch)
    completions = [group[0] for group in greedy]
    totals = rewards.score([rows[i]["prompt"] for i in held_rows], completions,
                           {"solution": [rows[i]["solution"] for i in held_rows]}, 0).total
    return int(sum(t or 0 for t in totals)), len(held_rows)


def on_policy_arm(rounds: int, seed: int, out: Path) -> dict:
    """The command's own rounds run (its folder reused when it is there)."""
    from dpo_min.rounds import run_rounds
    from dpo_min.rounds.arithmetic import last_integer_reward
    from dpo_min.train import load_model, resolve
    from dpo_min.train.rounds import MODEL_SETTINGS, load_prompts, rounds_config

    plan = resolve(["--rounds", str(rounds), "--seed", str(seed), "--output_dir", str(out / "on-policy")])
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
    model, tokenizer, peft_config, _ = load_model(plan)  # pi_0 again, untouched by the on-policy run
    rows = prompt_rows(load_prompts(plan))
    train_rows, held_rows = split_held_out(len(rows), config.held_out_share, config.seed)
    rewards = Rewards([last_integer_reward])
    pi0 = held_out_count(model, tokenizer, rows, held_rows, config, rewards)
    draws = [pi0_pairs(model, tokenizer, rows, train_rows, config, rewards, k) for k in range(1, config.rounds + 1)]
    round_one = [json.loads(line) for line in (Path(config.output_dir) / "round-1" / "pairs.jsonl").open()]
    if [(p["prompt_index"], p["chosen"], p["rejected"]) for p in draws[0]] != \
            [(p["prompt_index"], p["chosen"], p["rejected"]) for p in round_one]:
        sys.exit("pi_0's first draw differs from the on-policy run's round 1: the two arms do not start alike")
    pairs_count = sum(line["pairs"] for line in result.rounds)
    steps = sum(line["dpo"]["steps"] for line in result.rounds if "dpo" in line)
    pool = [pair for draw in draws for pair in draw]
    chosen = pool[:pairs_count]
    args = DPOMinConfig(**{"report_to": "none", "logging_steps": 1, "seed": config.seed + 1, **config.training,
                           "output_dir": str(out / "offline" / "train"), "max_steps": steps})
    columns = ("prompt", "chosen", "rejected", "prompt_ids", "chosen_ids", "rejected_ids")  # the sampled ids
    data = Dataset.from_list([{key: pair[key] for key in columns} for pair in chosen])
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=42, help="the run's --seed: sampling, held-out split, training")
    parser.add_argument("--out", default="compare_rounds", help="where both arms write (kept; reused on a rerun)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    out = Path(args.out)
    on = on_policy_arm(args.rounds, args.seed, out)
    off = offline_arm(on, out)
    held = {line["round"]: line for line in on["result"].held_out}
    n = held[0]["n"]
    on_right = [round(held[k]["mean"] * n) for k in sorted(held)]
    if on_right[0] != off["pi0"][0]:
        sys.exit(f"pi_0 scored {off['pi0'][0]} here and {on_right[0]} in the on-policy run: not the same pi_0")
    rounds = on["result"].rounds
    print(f"held-out prompts: {n}, greedy, exact answer; pairs per on-policy round: "
          f"{[line['pairs'] for line in rounds]}; pi_0 pairs per draw: {off['per_draw']}\n")
    print("| arm | pairs | steps | held-out right (95% interval) |\n| --- | ---: | ---: | --- |")
    print(f"| pi_0 | 0 | 0 | {interval(on_right[0], n)} |")
    print(f"| one offline round on pi_0's pairs | {off['pairs']} of {off['pool']} | {off['steps']} | "
          f"{interval(off['after'][0], n)} |")
    for k in range(1, len(on_right)):
        pairs = sum(line["pairs"] for line in rounds[:k])
        steps = sum(line.get("dpo", {}).get("steps", 0) for line in rounds[:k])
        print(f"| on-policy, after round {k} | {pairs} | {steps} | {interval(on_right[k], n)} |")
    print(f"\non-policy arm {on['seconds']:.0f} s (0 if reused), offline arm {off['seconds']:.0f} s")
    print(f"reproduce: python benchmarks/compare_rounds.py {' '.join(sys.argv[1:])}".rstrip())
    if args.json:
        Path(args.json).write_text(json.dumps({"n": n, "on_policy_right": on_right, "rounds": rounds,
                                               "offline": off}, indent=1, default=str))


if __name__ == "__main__":
    main()
