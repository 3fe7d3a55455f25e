"""pi_0's headroom on the arithmetic pool (data/arithmetic-pool.jsonl, issue 39 item 4): SmolLM2-135M-Instruct as the
rounds demo loads it, one greedy completion of each of `--held_out` pool prompts (the held-out rows of
benchmarks/online_dpo_peer.py for the same seed), `--max_completion_length` new tokens, scored right or wrong by
`last_integer_reward`, with the 95% interval compare_rounds prints.

    python benchmarks/pool_headroom.py                    # 64 held-out prompts, seed 42, 32 new tokens
    python benchmarks/pool_headroom.py --pairs 32         # and 32 training prompts sampled 4 times at 0.7

With `--pairs N` it also samples the first N training prompts `--num_generations` times at `--temperature`, as a
round samples them (compare_rounds.sample_like_the_rounds), and counts the samples right and the prompts that give
a pair (some sample right and some wrong: under a 0/1 reward, the rounds' pair rule).
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_rounds import interval, render, sample_like_the_rounds
from online_dpo_peer import POOL, load_policy, pool_split, score_held_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--held_out", type=int, default=64)
    parser.add_argument("--max_completion_length", type=int, default=32)
    parser.add_argument("--pool", default=str(POOL))
    parser.add_argument("--pairs", type=int, default=0, help="also sample this many training prompts (pair yield)")
    parser.add_argument("--num_generations", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.7)
    args = parser.parse_args()
    start = time.perf_counter()
    rows, train_rows, held_rows = pool_split(Path(args.pool), args.held_out, args.seed)
    model, tokenizer, _ = load_policy()
    right, n = score_held_out(model, tokenizer, rows, held_rows, args.max_completion_length)
    print(json.dumps({"pool": args.pool, "seed": args.seed, "held_out": n, "right": right,
                      "max_completion_length": args.max_completion_length,
                      "seconds": round(time.perf_counter() - start, 1)}))
    print(f"pi_0 (greedy) on {n} held-out pool prompts: {interval(right, n)}")
    if args.pairs:
        from dpo_min.rounds.arithmetic import last_integer_reward
        from dpo_min.rounds.sampling import GenerationSettings

        sampled = train_rows[:args.pairs]
        settings = GenerationSettings(args.num_generations, args.max_completion_length, True, args.temperature,
                                      seed=args.seed + 1000)  # round 1's seed
        groups = sample_like_the_rounds(model, tokenizer, render(tokenizer, rows, sampled), sampled, settings, 8)
        rights = [last_integer_reward([c.text for c in group], [rows[i]["solution"]] * len(group))
                  for i, group in zip(sampled, groups)]
        samples_right = int(sum(map(sum, rights)))
        paired = sum(0 < sum(r) < len(r) for r in rights)
        print(f"pi_0 at temperature {args.temperature}, {args.num_generations} samples of {len(sampled)} training "
              f"prompts: {interval(samples_right, len(sampled) * args.num_generations)} samples right; "
              f"{paired} of {len(sampled)} prompts give a pair")


if __name__ == "__main__":
    main()
