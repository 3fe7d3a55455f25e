"""Which training prompts a round samples: its draw (schedule.py), less the prompts its history skips
(`skip_saturated`, history.py), and with `dynamic_sampling` more prompts until `prompts_per_round` of them gave a pair.

DAPO's dynamic sampling (arXiv 2503.14476; verl's `filter_groups`): a prompt whose samples all score alike gives no
pair and teaches nothing, so the round sets it aside and draws another in its place. Here a round samples its draw,
scores it, and draws as many further prompts as the prompts that gave no pair (so that no more than prompts_per_round
give one), until prompts_per_round gave a pair, the pool is used up, or `max_num_gen_batches` generate() calls
(batches of generation_batch_size completions; verl's option counts its larger generation batches) are spent (0: no
cap). The further prompts are the rest of the training pool in a seeded order of (seed, round) after the draw: never
held-out, never twice in a round, and the draws of later rounds do not depend on them. Every sampled completion,
set aside or not, is in generated.jsonl and samples.jsonl and counts in the round's `samples`.

Batch b of the round (counted over its waves) is seeded seed + b, and what decides the next wave is the scores of the
last, so a resume that samples again (kept.py keeps the finished batches) makes the same waves, token for token.
"""

import json
import random
from collections.abc import Callable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any

from . import history, schedule
from .config import RoundsConfig
from .pairs import gives_pair
from .sampling import Completion

# (indices, first batch number) -> each prompt's completions; rows -> the rows with "rewards" and "total" added.
SampleFn = Callable[[list[int], int], list[list[Completion]]]
ScoreFn = Callable[[list[dict[str, Any]]], list[dict[str, Any]]]


def uses_draws(config: RoundsConfig) -> bool:
    """Whether a round's prompts are more than its schedule's draw (then it records draw.json)."""
    return config.dynamic_sampling or config.skip_saturated > 0


def recorded(config: RoundsConfig, folder: Path, prompts: list[int], round_index: int) -> dict[str, Any]:
    """What the round's draw did (sample_round's record): its draw.json; for a plain draw of `prompts` (the round's
    prompts in the order sampled: one wave), its generate() calls, their prompts and seeds."""
    if uses_draws(config):
        return json.loads((folder / "draw.json").read_text())
    return {"skipped": [], "refills": 0, **_calls([prompts], config, round_index)}


def _calls(waves: list[list[int]], config: RoundsConfig, round_index: int) -> dict[str, Any]:
    """The round's generate() calls: how many, the round's temperature, and each call's prompts and sampling seed
    (batches of prompts_per_batch prompts within each wave, numbered over the waves, batch b seeded round_seed + b as
    the loop seeds it), so that another model can be sampled on exactly these prompts with these seeds."""
    size, first = config.prompts_per_batch, schedule.round_seed(config.seed, round_index)
    batches = [wave[start:start + size] for wave in waves for start in range(0, len(wave), size)]
    return {"gen_batches": len(batches), "temperature": schedule.round_temperature(config.temperature, round_index),
            "batches": [{"seed": first + b, "prompts": prompts} for b, prompts in enumerate(batches)]}


def candidates(pool: list[int], per_round: int | None, seed: int, round_index: int) -> list[int]:
    """The round's draw, then the rest of the pool in a seeded order: the prompts it may sample, in order."""
    drawn = schedule.round_prompts(pool, per_round, seed, round_index)
    taken = set(drawn)
    rest = [i for i in pool if i not in taken]
    random.Random(f"{seed} further prompts of round {round_index}").shuffle(rest)
    return drawn + rest


def _not_skipped(order: list[int], past: dict[int, list[bool]], config: RoundsConfig, round_index: int,
                 skipped: list[int]) -> Iterator[int]:
    """The prompts of `order` the history does not skip, in order; those it skips on the way added to `skipped`."""
    for prompt in order:
        if history.skipped(prompt, past.get(prompt, []), config.skip_saturated, config.seed, round_index):
            skipped.append(prompt)
        else:
            yield prompt


def _rows(indices: list[int], groups: list[list[Completion]]) -> list[dict[str, Any]]:
    return [{"prompt_index": i, "sample": s, "completion": c.text, "completion_ids": c.ids, "truncated": c.truncated}
            for i, group in zip(indices, groups) for s, c in enumerate(group)]


def _paired(rows: list[dict[str, Any]], config: RoundsConfig) -> int:
    """How many of the rows' prompts gave a pair."""
    by_prompt: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        by_prompt.setdefault(row["prompt_index"], []).append(row)
    return sum(gives_pair(samples, config.min_margin, config.pair_rule) for samples in by_prompt.values())


def sample_round(config: RoundsConfig, pool: list[int], past: dict[int, list[bool]], round_index: int,
                 sample: SampleFn, score: ScoreFn) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The round's generated rows (scored, with dynamic sampling: its decisions read the scores) and its record:
    the prompts skipped, how many were drawn to refill, the generate() calls made (`_calls`)."""
    skipped: list[int] = []
    order = _not_skipped(candidates(pool, config.prompts_per_round, config.seed, round_index), past, config,
                         round_index, skipped)
    target = config.prompts_per_round
    wave = list(islice(order, target))  # None: every prompt not skipped
    rows, batches, paired, first, waves = [], 0, 0, len(wave), []
    size = config.prompts_per_batch
    while wave:
        waves.append(wave)
        new = _rows(wave, sample(wave, batches))
        batches += -(-len(wave) // size)
        if not config.dynamic_sampling:
            rows += new
            break
        new = score(new)
        rows += new
        paired += _paired(new, config)
        room = config.max_num_gen_batches - batches if config.max_num_gen_batches else len(pool)
        wave = list(islice(order, max(0, min(target - paired, room * size))))
    sampled = len({row["prompt_index"] for row in rows})
    return rows, {"skipped": skipped, "refills": sampled - first, **_calls(waves, config, round_index)}
