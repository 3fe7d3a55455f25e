"""Write data/arithmetic-prompts.jsonl: the verifiable task of the rounds' demo (`python -m dpo_min.train --rounds
3`), generated, with no model output in it.

    python data/make_arithmetic.py            # rewrites the file; the same bytes every time

The rule (data/README.md): ROWS prompts, the four kinds in turn (single-digit addition, single-digit subtraction
with a result >= 0, single-digit multiplication, two-digit addition with no carry), operands drawn by
random.Random(SEED), no problem twice. Each row is a
one-turn conversation and its integer `solution`, read by dpo_min.rounds.arithmetic.last_integer_reward.
"""

import json
import random
import sys
from pathlib import Path

SEED = 33
ROWS = 96
QUESTION = "What is {a} {op} {b}? Answer with the number."
# Single digits are 2..9. No carry: each two-digit operand's digits are at most 4 (tens 1..4), so no column sums
# past 9.
KINDS = (
    ("+", lambda draw: (draw(2, 9), draw(2, 9)), lambda a, b: a + b),
    ("-", lambda draw: sorted((draw(2, 9), draw(2, 9)), reverse=True), lambda a, b: a - b),
    ("*", lambda draw: (draw(2, 9), draw(2, 9)), lambda a, b: a * b),
    ("+", lambda draw: (10 * draw(1, 4) + draw(0, 4), 10 * draw(1, 4) + draw(0, 4)), lambda a, b: a + b),
)


def make_rows(rows: int = ROWS, seed: int = SEED) -> list[dict]:
    draw, seen, made = random.Random(seed).randint, set(), []
    while len(made) < rows:
        op, operands, answer = KINDS[len(made) % len(KINDS)]
        a, b = operands(draw)
        if (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        made.append({"prompt": [{"role": "user", "content": QUESTION.format(a=a, op=op, b=b)}],
                     "solution": answer(a, b)})
    return made


def write(path: Path) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in make_rows()))


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "arithmetic-prompts.jsonl")
