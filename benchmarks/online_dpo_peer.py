"""The maintained peer of DPO in rounds (issue 39, item 4): TRL's experimental `OnlineDPOTrainer` on the arithmetic
pool, SmolLM2-135M-Instruct with the rounds demo's LoRA, judged by the same reward, scored on held-out prompts as
benchmarks/compare_rounds.py scores them.

    python benchmarks/online_dpo_peer.py --smoke                 # 8 prompts, 2 steps, 8 held out: it runs (~9 min
                                                                 # on the 2 shared CPU cores, ~200 s a step)
    python benchmarks/online_dpo_peer.py --train_prompts 96      # 96 prompts = 192 sampled completions, 24 steps

How it is set up, against a rounds run:
- reward: `dpo_min.rounds.arithmetic:last_integer_reward`, passed to OnlineDPOTrainer as a reward function (TRL 1.16
  takes callables in GRPOTrainer's contract; the row's `solution` column reaches it, repeated for the 2 samples);
- samples: OnlineDPO draws 2 completions of each prompt of a batch and trains one step on that batch, each prompt
  seen once here (one epoch, a fresh prompt at every visit). A rounds run that samples `num_generations` completions
  of P prompts in each of R rounds draws R * P * num_generations; the same number here is `train_prompts` =
  R * P * num_generations / 2 (`--match_rounds R P G` computes it);
- model, chat template, LoRA: as `python -m dpo_min.train --rounds N` loads them for its demo (its plan and
  `load_model`: float32, ROUNDS_DEMO_DEFAULTS' template, LoRA r 16, alpha 32, dropout 0, all-linear); learning rate
  1e-4, 4 prompts a step and max_length 128 as ROUNDS_DEMO_DEFAULTS; no bf16 autocast and no gradient checkpointing,
  as DPOMinConfig trains (both are on by default in TRL's configs);
- sampling: `temperature`, `max_completion_length` new tokens, top_k off (TRL's 0, the rounds' None), top_p 1.
What differs and is TRL's own: OnlineDPO pairs the two samples whatever their rewards, so a tie (both right or both
wrong, most pairs under a 0/1 reward) is trained as a preference of the first over the second; the rounds drop
tied prompts and pair the best of `num_generations` against the worst. Each step samples from the policy as it is.

Held out: `held_out` rows of the pool drawn by `dpo_min.rounds.prompts.split_held_out` with `seed` (the same rows
benchmarks/pool_headroom.py scores pi_0 on), one greedy completion each, batched as the rounds batch them
(`compare_rounds.held_out_count`); the training prompts are the other rows, shuffled by `seed`.
"""

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's dpo_min, when it is not installed
sys.path.insert(0, str(ROOT / "benchmarks"))

POOL = ROOT / "data" / "arithmetic-pool.jsonl"


def pool_split(pool: Path, held_out: int, seed: int) -> tuple[list[dict], list[int], list[int]]:
    """(rows, training row indices shuffled by `seed`, `held_out` held-out row indices)."""
    from dpo_min.rounds.prompts import split_held_out

    rows = [json.loads(line) for line in pool.read_text().splitlines()]
    train_rows, held_rows = split_held_out(len(rows), held_out / len(rows), seed)
    assert len(held_rows) == held_out, (len(held_rows), held_out)
    random.Random(seed).shuffle(train_rows)
    return rows, train_rows, held_rows


def load_policy(model: str | None = None) -> tuple:
    """(model, tokenizer, LoRA config) exactly as `python -m dpo_min.train --rounds N` loads them for its demo:
    SmolLM2-135M-Instruct, the demo's chat template, the command's LoRA (r 16, alpha 32, dropout 0, all-linear).
    `model` (a folder: the tests' tiny model) replaces SmolLM2, with the same LoRA and template."""
    from dpo_min.train import load_model, resolve
    from dpo_min.train.args import ROUNDS_DEMO_DEFAULTS

    argv = ["--rounds", "1", "--output_dir", tempfile.mkdtemp(prefix="online-dpo-plan-")]
    plan = resolve(argv + (["--model", model, "--use_peft"] if model else []))
    policy, tokenizer, peft_config, _ = load_model(plan)
    tokenizer.chat_template = ROUNDS_DEMO_DEFAULTS["chat_template"]  # the demo's plan sets it already
    return policy, tokenizer, peft_config


def score_held_out(model, tokenizer, rows, held_rows, max_completion_length: int) -> tuple[int, int]:
    """(right, prompts), greedy, as compare_rounds scores every arm (batches of 8 prompts, the rounds' default)."""
    from compare_rounds import held_out_count

    from dpo_min.rounds import Rewards
    from dpo_min.rounds.arithmetic import last_integer_reward

    # held_out_count batches 8 prompts a generate() call, as the rounds do by default.
    settings = SimpleNamespace(max_completion_length=max_completion_length, prompts_per_batch=8)
    return held_out_count(model, tokenizer, rows, held_rows, settings, Rewards([last_integer_reward]))


def run_online_dpo(seed: int = 42, train_prompts: int = 96, max_completion_length: int = 32,
                   temperature: float = 0.7, learning_rate: float = 1e-4, beta: float = 0.1, held_out: int = 64,
                   per_device_train_batch_size: int = 4, pool: Path = POOL, output_dir: str | None = None,
                   score_pi0: bool = False, model: str | None = None) -> dict:
    """Train with OnlineDPOTrainer on `train_prompts` fresh pool prompts (2 samples each, one step per batch), then
    score the held-out prompts greedily. Returns the figures, `held_out_right` among them."""
    from datasets import Dataset
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    from dpo_min.rounds.arithmetic import last_integer_reward
    from dpo_min.train.args import ROUNDS_DEMO_DEFAULTS

    start = time.perf_counter()
    rows, train_rows, held_rows = pool_split(pool, held_out, seed)
    model, tokenizer, peft_config = load_policy(model)
    pi0 = score_held_out(model, tokenizer, rows, held_rows, max_completion_length) if score_pi0 else None
    data = Dataset.from_list([{"prompt": rows[i]["prompt"], "solution": rows[i]["solution"]}
                              for i in train_rows[:train_prompts]])
    args = OnlineDPOConfig(
        output_dir=output_dir or tempfile.mkdtemp(prefix="online-dpo-"), seed=seed, num_train_epochs=1,
        per_device_train_batch_size=per_device_train_batch_size, learning_rate=learning_rate, beta=beta,
        max_new_tokens=max_completion_length, max_length=ROUNDS_DEMO_DEFAULTS["max_length"], temperature=temperature,
        bf16=False, gradient_checkpointing=False, logging_steps=1, save_strategy="no", report_to="none")
    trainer = OnlineDPOTrainer(model=model, reward_funcs=last_integer_reward, args=args, train_dataset=data,
                               processing_class=tokenizer, peft_config=peft_config)
    trained = time.perf_counter()
    trainer.train()
    training_seconds = time.perf_counter() - trained
    right, n = score_held_out(trainer.model, tokenizer, rows, held_rows, max_completion_length)
    logs = [line for line in trainer.state.log_history if "objective/scores" in line]
    return {"trainer": "trl.experimental.online_dpo.OnlineDPOTrainer", "seed": seed, "train_prompts": len(data),
            "sampled_completions": 2 * len(data), "steps": trainer.state.global_step,
            "pi0_right": pi0[0] if pi0 else None, "held_out_right": right, "held_out": n,
            "train_reward_mean": [round(line["objective/scores"], 4) for line in logs],
            # chosen - rejected reward per step, over its prompts: with a 0/1 reward, x batch size = the untied pairs
            "train_scores_margin": [round(line["objective/scores_margin"], 4) for line in logs],
            "settings": {"max_completion_length": max_completion_length, "temperature": temperature,
                         "learning_rate": learning_rate, "beta": beta,
                         "per_device_train_batch_size": per_device_train_batch_size},
            "training_seconds": round(training_seconds, 1), "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="8 prompts (2 steps of 4), 8 held out: it runs")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--train_prompts", type=int, default=96)
    parser.add_argument("--match_rounds", type=int, nargs=3, metavar=("ROUNDS", "PROMPTS", "GENERATIONS"),
                        help="train_prompts = ROUNDS * PROMPTS * GENERATIONS / 2: as many sampled completions")
    parser.add_argument("--max_completion_length", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--held_out", type=int, default=64)
    parser.add_argument("--pi0", action="store_true", help="also score pi_0 on the held-out prompts first")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    train_prompts, held_out = (8, 8) if args.smoke else (args.train_prompts, args.held_out)
    if args.match_rounds:
        rounds, prompts, generations = args.match_rounds
        train_prompts = rounds * prompts * generations // 2
    result = run_online_dpo(seed=args.seed, train_prompts=train_prompts,
                            max_completion_length=args.max_completion_length, temperature=args.temperature,
                            learning_rate=args.learning_rate, beta=args.beta, held_out=held_out, score_pi0=args.pi0)
    from compare_rounds import interval

    print(json.dumps(result, indent=1))
    print(f"OnlineDPO, {result['train_prompts']} prompts ({result['sampled_completions']} sampled completions, "
          f"{result['steps']} steps): held-out {interval(result['held_out_right'], result['held_out'])}, "
          f"{result['seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
