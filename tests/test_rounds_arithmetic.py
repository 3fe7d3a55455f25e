"""The rounds demo's data and reward: the arithmetic prompts and pool are their generators' output byte for byte and
follow the rule data/README.md states, and the reward reads the last integer of a completion."""

import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dpo_min.rounds.arithmetic import last_integer, last_integer_reward

ROOT = Path(__file__).resolve().parent.parent
ARITHMETIC = ROOT / "data" / "arithmetic-prompts.jsonl"  # the first rounds demo's 96 prompts, kept as an example


# ---- the demo's data and reward -----------------------------------------------------------------------------------
def load_generator(name: str = "make_arithmetic"):
    spec = importlib.util.spec_from_file_location(name, ROOT / "data" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_arithmetic_prompts_are_the_generators_output_byte_for_byte(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "data" / "make_arithmetic.py"), str(tmp_path / "a.jsonl")],
                   check=True)
    assert (tmp_path / "a.jsonl").read_bytes() == ARITHMETIC.read_bytes()


def test_the_arithmetic_prompts_follow_the_rule_in_data_readme():
    rows = [json.loads(line) for line in ARITHMETIC.read_text().splitlines()]
    generator = load_generator()
    assert len(rows) == generator.ROWS and len({json.dumps(row) for row in rows}) == len(rows)
    for index, row in enumerate(rows):
        (message,) = row["prompt"]
        a, op, b = message["content"].removeprefix("What is ").removesuffix("? Answer with the number.").split()
        a, b = int(a), int(b)
        kind = index % 4  # single-digit +, -, *, then two-digit + with no carry
        assert op == "+-*+"[kind] and message["role"] == "user"
        if kind < 3:
            assert 2 <= a <= 9 and 2 <= b <= 9
        else:
            assert all(1 <= n // 10 <= 4 and n % 10 <= 4 for n in (a, b))  # no column sums past 9
        assert row["solution"] == {"+": a + b, "-": a - b, "*": a * b}[op] >= 0
    digest = hashlib.sha256(ARITHMETIC.read_bytes()).hexdigest()
    assert f"`{digest}`" in (ROOT / "data" / "README.md").read_text()  # the sha256 data/README.md gives


# ---- the arithmetic pool (issue 39): fresh prompts every round -----------------------------------------------------
POOL = ROOT / "data" / "arithmetic-pool.jsonl"


def test_the_arithmetic_pool_is_its_generators_output_byte_for_byte(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "data" / "make_arithmetic_pool.py"), str(tmp_path / "p.jsonl")],
                   check=True)
    assert (tmp_path / "p.jsonl").read_bytes() == POOL.read_bytes()


def test_the_arithmetic_pool_follows_the_rule_in_data_readme():
    rows = [json.loads(line) for line in POOL.read_text().splitlines()]
    generator = load_generator("make_arithmetic_pool")
    assert len(rows) == generator.ROWS == 3000 and len({json.dumps(row["prompt"]) for row in rows}) == len(rows)
    kinds = []
    for row in rows:
        (message,) = row["prompt"]
        a, op, b = message["content"].removeprefix("What is ").removesuffix("? Reply with only the number.").split()
        a, b = int(a), int(b)
        assert message["role"] == "user" and 10 <= a <= 99 and 2 <= b <= 98
        if b <= 9:  # a two-digit number and a one-digit one: no carry, no borrow
            assert (a % 10 + b <= 9) if op == "+" else (a % 10 >= b)
        else:  # two two-digit numbers: no carry and a sum under 100; the larger first, no borrow
            assert (a % 10 + b % 10 <= 9 and a + b <= 99) if op == "+" else (a > b and a % 10 >= b % 10)
        kinds.append((op, b <= 9))
        assert row["solution"] == (a + b if op == "+" else a - b) >= 0
    assert [kinds.count(kind) for kind in [("+", True), ("-", True), ("+", False), ("-", False)]] == \
        [300, 300, 1200, 1200]
    digest = hashlib.sha256(POOL.read_bytes()).hexdigest()
    assert f"`{digest}`" in (ROOT / "data" / "README.md").read_text()  # the sha256 data/README.md gives


@pytest.mark.parametrize(("text", "expected"), [
    ("3 + 2 = 5", 5),  # the first integer is an operand
    ("47 + 38 = 85.", 85),
    ("The answer is 51", 51),
    ("90 - 99 = -9", -9),
    ("8.5, so 7", 7),  # a decimal is no integer
    ("about 8.5", None),
    ("no digits", None),
])
def test_last_integer_reads_the_last_whole_number(text, expected):
    assert last_integer(text) == expected


def test_the_reward_is_exact_match_of_the_last_integer_for_text_and_messages():
    completions = ["83 + 31 = 114", "83 + 31 = 113", "114 is 83 + 31", "none"]
    assert last_integer_reward(completions=completions, solution=[114] * 4) == [1.0, 0.0, 0.0, 0.0]
    messages = [[{"role": "assistant", "content": text}] for text in completions]
    assert last_integer_reward(completions=messages, solution=["114"] * 4, prompts=[None] * 4) == [1.0, 0.0, 0.0, 0.0]
