"""pi_0's headroom on the arithmetic pool (data/arithmetic-pool.jsonl, issue 39 item 4): SmolLM2-135M-Instruct as the
rounds demo loads it, one greedy completion of each of `--held_out` pool prompts (the held-out rows of
benchmarks/online_dpo_peer.py for the same seed), `--max_completion_length` new tokens, scored right or wrong by
`last_integer_reward`, with the 95% interval compare_rounds prints.

    python benchmarks/pool_headroom.py                    # 64 held-out prompts, seed 42, 32 new tokens
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_rounds import interval
from online_dpo_peer import POOL, load_policy, pool_split, score_held_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--held_out", type=int, default=64)
    parser.add_argument("--max_completion_length", type=int, default=32)
    parser.add_argument("--pool", default=str(POOL))
    args = parser.parse_args()
    start = time.perf_counter()
    rows, _, held_rows = pool_split(Path(args.pool), args.held_out, args.seed)
    model, tokenizer, _ = load_policy()
    right, n = score_held_out(model, tokenizer, rows, held_rows, args.max_completion_length)
    print(json.dumps({"pool": args.pool, "seed": args.seed, "held_out": n, "right": right,
                      "max_completion_length": args.max_completion_length,
                      "seconds": round(time.perf_counter() - start, 1)}))
    print(f"pi_0 (greedy) on {n} held-out pool prompts: {interval(right, n)}")


if __name__ == "__main__":
    main()
