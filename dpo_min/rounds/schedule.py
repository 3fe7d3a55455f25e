"""What a round samples when the recipe changes it from round to round: which training prompts (a fresh draw from
the pool each round, as RLHFlow's Online-RLHF and Online-DPO-R1 take a fresh prompt set each iteration) and at what
temperature (one per round, raised over the rounds as DPO-VP does). Both are pure functions of the config and the
round, so a resumed run draws the same prompts and samples at the same temperature."""

import random
from collections.abc import Sequence

from .config import RoundsError


def check_pool(pool: Sequence[int], per_round: int | None) -> None:
    """Refuses a draw larger than the pool (the training prompts, the held-out ones never in it): a round would need
    a prompt twice."""
    if per_round is not None and per_round > len(pool):
        raise RoundsError(f"prompts_per_round {per_round} is more than the {len(pool)} training prompt(s) (held-out "
                          "ones are never drawn): lower it, or leave it unset to sample every prompt each round")


def round_prompts(pool: Sequence[int], per_round: int | None, seed: int, round_index: int) -> list[int]:
    """Round K's training prompts (row indices, ascending). `per_round` None: the whole pool, every round.

    Otherwise the rounds go through the pool in passes, each pass drawing every prompt once: round K draws
    `per_round` of the prompts its pass has not drawn yet, without replacement, seeded by (seed, K). A round that
    finds fewer left takes all of them, then the rest of its share from a new pass over the whole pool, reshuffled
    (less the prompts the round already took, so no prompt comes twice in one round); the next round goes on in that
    new pass. Computed from round 1 each time, so round K's draw does not depend on what ran before in this process."""
    if per_round is None:
        return list(pool)
    check_pool(pool, per_round)
    left, drawn = list(pool), []
    for k in range(1, round_index + 1):
        rng = random.Random(f"{seed} prompts of round {k}")  # a str seed is hashed the same in every process
        if len(left) >= per_round:
            drawn = rng.sample(left, per_round)
            chosen = set(drawn)
            left = [i for i in left if i not in chosen]
            continue
        taken = set(left)
        fresh = rng.sample([i for i in pool if i not in taken], per_round - len(left))
        drawn, chosen = [*left, *fresh], set(fresh)
        left = [i for i in pool if i not in chosen]
    return sorted(drawn)


def round_seed(seed: int, round_index: int) -> int:
    """The sampling seed of round K's first generate() call; its batch b is seeded this + b (1000 calls a round
    before two rounds' seeds meet)."""
    return seed + 1000 * round_index


def round_temperature(temperature: float | list[float], round_index: int) -> float:
    """Round K's sampling temperature: the one value, or the K-th of one per round."""
    return temperature[round_index - 1] if isinstance(temperature, list) else temperature
