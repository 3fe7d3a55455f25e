"""95% intervals, the one place they are computed: the command's held-out figures (train/report.py) and the rounds'
held-out mean reward (rounds/held_out.py) both read them from here."""

import math

Z_95 = 1.959964  # the normal quantile of 0.975


def wilson_interval(successes: int, trials: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (95% for the default z); stays inside [0, 1] at 0 or n."""
    if trials == 0:
        return 0.0, 1.0
    rate = successes / trials
    centre = (rate + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(rate * (1 - rate) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return max(0.0, centre - half), min(1.0, centre + half)


def mean_interval(values: list[float], z: float = Z_95) -> tuple[float, float, float]:
    """(mean, low, high): the mean with its 95% interval, mean +- z * s / sqrt(n) (normal approximation, s the sample
    standard deviation); the interval is the mean itself for fewer than two values."""
    count = len(values)
    mean = sum(values) / count
    if count < 2:
        return mean, mean, mean
    spread = z * math.sqrt(sum((value - mean) ** 2 for value in values) / (count - 1) / count)
    return mean, mean - spread, mean + spread
