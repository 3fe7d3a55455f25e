"""Write data/arithmetic-pool.jsonl: a pool of generated arithmetic prompts large enough for fresh prompts every round
(issue 39, item 4), with headroom for SmolLM2-135M-Instruct, and no model output in it.

    python data/make_arithmetic_pool.py            # rewrites the file; the same bytes every time

The rule (data/README.md): ROWS prompts, the kinds of KINDS in turn, operands drawn by random.Random(SEED), no problem
twice. Each row is a one-turn conversation and its integer `solution`, read by
dpo_min.rounds.arithmetic.last_integer_reward.
"""

import json
import random
import sys
from pathlib import Path

SEED = 39
QUESTION = "What is {a} {op} {b}? Reply with only the number."


def _draw_until(draw, operands, keep):
    while True:
        a, b = operands(draw)
        if keep(a, b):
            return a, b


# (operator, how many rows, operands, answer). No carry and no borrow: SmolLM2-135M-Instruct got 0 of 12 greedy
# answers right on two-digit sums with a carry, and 2 of 16 on a mix with carries and borrows (data/README.md). The
# one-digit kinds have 324 distinct problems each, the two-digit kinds 1,980 and 2,385.
KINDS = (
    ("+", 300, lambda draw: _draw_until(draw, lambda d: (d(10, 99), d(2, 9)), lambda a, b: a % 10 + b <= 9),
     lambda a, b: a + b),
    ("-", 300, lambda draw: _draw_until(draw, lambda d: (d(10, 99), d(2, 9)), lambda a, b: a % 10 >= b),
     lambda a, b: a - b),
    ("+", 1200, lambda draw: _draw_until(draw, lambda d: (d(10, 89), d(10, 89)),
                                         lambda a, b: a % 10 + b % 10 <= 9 and a + b <= 99), lambda a, b: a + b),
    ("-", 1200, lambda draw: _draw_until(draw, lambda d: (d(11, 99), d(10, 98)),
                                         lambda a, b: a > b and a % 10 >= b % 10), lambda a, b: a - b),
)
ROWS = sum(count for _, count, _, _ in KINDS)


def make_rows(seed: int = SEED) -> list[dict]:
    """Each kind's rows drawn in turn (no problem twice), then all of them in one seeded random order."""
    rng = random.Random(seed)
    seen, made = set(), []
    for op, count, operands, answer in KINDS:
        drawn = 0
        while drawn < count:
            a, b = operands(rng.randint)
            if (a, op, b) in seen:
                continue
            seen.add((a, op, b))
            drawn += 1
            made.append({"prompt": [{"role": "user", "content": QUESTION.format(a=a, op=op, b=b)}],
                         "solution": answer(a, b)})
    rng.shuffle(made)
    return made


def write(path: Path) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in make_rows()))


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "arithmetic-pool.jsonl")
