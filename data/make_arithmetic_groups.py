"""Write data/arithmetic-groups.jsonl: ranked rows (`prompt`, `completions`, `scores`; docs/groups.md, "Data with k
answers") of the embedded SmolLM2-135M-Instruct's own answers to prompts of the arithmetic pool, several scored
answers a prompt, for the `group_by_prompt` example of docs/groups.md (issue 55, item 3).

    python data/make_arithmetic_groups.py          # rewrites the file: minutes on 2 CPU cores

The rule (data/README.md): the first PROMPTS rows of data/arithmetic-pool.jsonl, in its order, that are not among the
rounds demo's 64 held-out prompts (`split_held_out(3000, 64 / 3000, 42)`, as `--rounds 3` draws them); SAMPLES answers
each from the embedded model (the one `python -m dpo_min.train` loads without --model), rendered by its own chat
template as the command renders a --dataset's prompts, sampled at TEMPERATURE with at most MAX_NEW_TOKENS new tokens,
seeded (batch b of BATCH prompts by SEED + b, dpo_min.rounds.sampling); each answer scored by `graded_score`. An empty
answer is left out (the ranked layout refuses one) and a prompt whose answers all score alike is dropped (it gives no
pair); the script says how many of each. The same bytes every run on the same torch build and CPU.
"""

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 55
PROMPTS = 64
SAMPLES = 8
TEMPERATURE = 1.0
MAX_NEW_TOKENS = 24
BATCH = 8
# The rounds demo's held-out prompts (dpo_min/train/args.py, ROUNDS_DEMO_DEFAULTS: eval_fraction 64 / 3000, seed 42):
# none of them is in this file, so a model trained on it can still be scored on them.
DEMO_HELD_OUT = (64 / 3000, 42)


def graded_score(text: str, solution: int) -> float:
    """1.0 for the right number (the answer's last integer, as the rounds' last_integer_reward reads it), else
    1 / (1 + distance to the solution): a near miss above a far one; 0.0 for an answer with no number. Graded so that
    a prompt's answers are ranked, not only right against wrong."""
    from dpo_min.rounds.arithmetic import last_integer

    number = last_integer(text)
    return 0.0 if number is None else 1.0 / (1 + abs(number - int(solution)))


def chosen_prompts(pool: list[dict]) -> list[dict]:
    from dpo_min.rounds.prompts import split_held_out

    held = set(split_held_out(len(pool), *DEMO_HELD_OUT)[1])
    return [row for index, row in enumerate(pool) if index not in held][:PROMPTS]


def sampled_rows(rows: list[dict]) -> tuple[list[dict], dict[str, int]]:
    """The ranked rows, and how many empty answers and all-alike prompts were left out."""
    from dpo_min.models import load_causal_lm, load_tokenizer
    from dpo_min.rounds.sampling import GenerationSettings, sample
    from dpo_min.tokenizing import render_prompts

    model, tokenizer = load_causal_lm(None), load_tokenizer(None)
    prompt_ids = render_prompts(tokenizer, [row["prompt"] for row in rows], {})
    settings = GenerationSettings(num_return_sequences=SAMPLES, max_new_tokens=MAX_NEW_TOKENS, do_sample=True,
                                  temperature=TEMPERATURE, seed=SEED)
    made, left_out = [], {"empty answers": 0, "prompts whose answers all score alike": 0}
    for row, completions in zip(rows, sample(model, tokenizer, prompt_ids, settings, batch_size=BATCH)):
        texts = [c.text.strip() for c in completions]
        left_out["empty answers"] += sum(not text for text in texts)
        texts = [text for text in texts if text]
        scores = [graded_score(text, row["solution"]) for text in texts]
        if len(set(scores)) < 2:
            left_out["prompts whose answers all score alike"] += 1
            continue
        made.append({"prompt": row["prompt"], "completions": texts, "scores": scores, "solution": row["solution"]})
    return made, left_out


def write(path: Path) -> None:
    pool = [json.loads(line) for line in (HERE / "arithmetic-pool.jsonl").read_text().splitlines()]
    rows, left_out = sampled_rows(chosen_prompts(pool))
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(rows)} rows to {path}; left out: " + ", ".join(f"{n} {what}" for what, n in left_out.items()))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))  # this checkout's dpo_min
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "arithmetic-groups.jsonl")
