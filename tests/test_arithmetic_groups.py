"""data/arithmetic-groups.jsonl, the data of docs/groups.md's group_by_prompt example: ranked rows of the embedded
model's own answers to prompts of the arithmetic pool, several scored answers a prompt (data/README.md)."""

import hashlib
import importlib.util
import json
import re
from pathlib import Path

from dpo_min.data.loading import load_preference_dataset
from dpo_min.rounds.prompts import split_held_out

DATA = Path(__file__).resolve().parent.parent / "data"
GROUPS = DATA / "arithmetic-groups.jsonl"


def _script():
    spec = importlib.util.spec_from_file_location("make_arithmetic_groups", DATA / "make_arithmetic_groups.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _readme_section() -> str:
    text = (DATA / "README.md").read_text()
    return text[text.index("`arithmetic-groups.jsonl`"):]


def test_the_graded_score_by_hand():
    score = _script().graded_score
    assert score("79", 79) == 1.0 and score("23 + 56 = 79", 79) == 1.0  # the last integer, as the rounds read it
    assert score("80", 79) == 0.5 and score("69", 79) == 1 / 11 and score("The answer is 12.", 79) == 1 / 68
    assert score("seventy-nine", 79) == 0.0


def test_the_bundled_file_is_ranked_data_with_several_answers_a_prompt():
    rows = [json.loads(line) for line in GROUPS.read_text().splitlines()]
    pairs = load_preference_dataset(str(GROUPS))
    groups = len({json.dumps(prompt) for prompt in pairs["prompt"]})
    assert groups == len(rows) >= 48 and len(pairs) >= 8 * groups  # several pairs a prompt, not HH-RLHF's one
    score = _script().graded_score
    for row in rows:
        assert len(set(row["completions"])) == 8 and len(set(row["scores"])) >= 4  # as data/README.md says
        assert row["scores"] == [score(text, row["solution"]) for text in row["completions"]]
    # what data/README.md states of it: its rows, pairs and digest
    section = _readme_section()
    assert f"{len(rows)} prompts" in section and f"{len(pairs):,} pairs" in section
    assert re.search(r"sha256 of this file:\s*`(\w+)`", section)[1] == hashlib.sha256(GROUPS.read_bytes()).hexdigest()


def test_its_prompts_are_the_pools_and_none_the_rounds_demo_holds_out():
    pool = [json.loads(line) for line in (DATA / "arithmetic-pool.jsonl").read_text().splitlines()]
    held = {json.dumps(pool[index]["prompt"]) for index in split_held_out(len(pool), 64 / 3000, 42)[1]}
    solutions = {json.dumps(row["prompt"]): row["solution"] for row in pool}
    for row in map(json.loads, GROUPS.read_text().splitlines()):
        prompt = json.dumps(row["prompt"])
        assert solutions[prompt] == row["solution"] and prompt not in held
