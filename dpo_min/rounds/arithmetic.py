"""The exact-match reward of the rounds' demo (data/arithmetic-pool.jsonl; data/arithmetic-prompts.jsonl too), in TRL
GRPOTrainer's contract; and a graded one, the distance of the answer to the solution, which orders a prompt's wrong
answers too (what a listwise loss, plackett_luce, needs: a 0/1 reward orders one right against one wrong at most).

A small instruct model writes its working out (`47 + 38 = 85`), so the first integer of a completion is often an
operand: the answer read is the completion's LAST integer, compared with the row's `solution`."""

import re
from typing import Any

_INTEGER = re.compile(r"(?<![\d.])-?\d+(?![\d.]*\d)")  # a whole number, not part of a decimal such as 8.5


def last_integer(text: str) -> int | None:
    """The last integer written in `text` ('-12' reads as -12, '1,000' as 0: thousands separators are not read);
    None when it holds none."""
    found = _INTEGER.findall(text)
    return int(found[-1]) if found else None


def last_integer_reward(completions: list[Any], solution: list[Any], **_: Any) -> list[float]:
    """1.0 where the completion's last integer equals `solution` (an integer, or its text), else 0.0. Completions
    are texts, or one-message lists [{"role": "assistant", "content": ...}] for conversational prompts."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(last_integer(text) == int(answer)) for text, answer in zip(texts, solution)]


def arithmetic_distance(completions: list[Any], solution: list[Any], **_: Any) -> list[float]:
    """1.0 where the completion's last integer equals `solution`, 1 / (2 + |answer - solution|) where it is another
    integer (0.333 one off, 0.25 two off: under every right answer, and higher the closer), 0.0 where the completion
    holds no integer. Completions as for last_integer_reward."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    scores = []
    for text, answer in zip(texts, solution):
        found = last_integer(text)
        distance = None if found is None else abs(found - int(answer))
        scores.append(0.0 if distance is None else 1.0 if distance == 0 else 1.0 / (2 + distance))
    return scores
