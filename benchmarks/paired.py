"""Paired tests for two arms scored on the same units: exact McNemar over prompts (only the discordant prompts
count: right in one arm and wrong in the other) and the sign test over seeds. Both are the two-sided exact binomial
test of the discordant counts against 1/2, doubled from the smaller tail and capped at 1.

The tail is summed in exact integers and its logarithm taken of those (`log10_binomial_two_sided`), so a p-value far
below a float's range is still its true value in log10 terms (5,000 against 0: 2 * 0.5**5000, about 1.42e-1505);
as a float it is then the smallest positive one, a true upper bound, never 0 (`shown_p` prints the true value)."""

import math
from math import comb

SMALLEST = math.ulp(0.0)  # 5e-324: the smallest positive float


def log10_binomial_two_sided(k: int, n: int) -> float:
    """log10 of the two-sided p-value of k successes in n fair trials (0 when n is 0): Python's integers hold the
    tail exactly and math.log10 reads an integer of any size, so nothing underflows on the way."""
    if n == 0:
        return 0.0
    tail = sum(comb(n, i) for i in range(min(k, n - k) + 1))
    return min(0.0, math.log10(2 * tail) - n * math.log10(2))


def binomial_two_sided(k: int, n: int) -> float:
    """P-value of k successes in n fair trials, two-sided: twice the smaller tail, at most 1; 1 when n is 0. Below
    the smallest positive float it is that float (an upper bound), not 0."""
    if n == 0:
        return 1.0
    tail = sum(comb(n, i) for i in range(min(k, n - k) + 1))
    return max(SMALLEST, min(1.0, 2 * tail / 2 ** n))  # int / int: correctly rounded, whatever their size


def shown_p(k: int, n: int) -> str:
    """The p-value to 3 significant digits, past a float's range too (`1.42e-1505`)."""
    p = binomial_two_sided(k, n)
    if p > 1e-300:
        return f"{p:.3g}"
    log10 = log10_binomial_two_sided(k, n)
    exponent = math.floor(log10)
    mantissa = float(f"{10 ** (log10 - exponent):.3g}")
    if mantissa >= 10:  # 9.9996 rounds up to the next power of ten
        mantissa, exponent = mantissa / 10, exponent + 1
    return f"{mantissa:.3g}e{exponent}"


def exact_mcnemar(only_first: int, only_second: int) -> float:
    """Prompts right only in the first arm against those right only in the second."""
    return binomial_two_sided(only_first, only_first + only_second)


def sign_test(ahead: int, behind: int) -> float:
    """Seeds where the first arm scored more against those where it scored less (ties left out)."""
    return binomial_two_sided(ahead, ahead + behind)


def seed_permutation_test(differences: list[int]) -> float:
    """Two-sided exact sign-flip test over seeds: each seed's difference in prompts right (first arm minus second) is
    one unit, since a seed's prompts share one trained model and do not vary independently. Under the null every
    difference is as likely negated; p is the share of the 2**n sign choices whose |sum| reaches the observed one.
    With 8 seeds its floor is 2/256 = 0.0078, however many prompts each seed holds."""
    observed = abs(sum(differences))
    totals = [0]
    for difference in differences:  # every sum over the sign choices, in 2**n entries (256 for 8 seeds)
        totals = [total + sign * difference for total in totals for sign in (1, -1)]
    return sum(abs(total) >= observed for total in totals) / len(totals)


def sign_flip_floor(differences: list[int], seeds_in_all: int) -> float:
    """The least two-sided sign-flip p over `seeds_in_all` seeds that the seeds not yet run can give, whatever they
    show, with the first arm ahead (a positive sum: it is ahead on the discordant prompts too, since the seeds'
    differences sum to those counts' difference). Every sign choice that flips only seeds run behind or level keeps a
    sum at least the observed one, and so does each one's negation: p >= 2 * 2**(behind + level) / 2**seeds_in_all.
    Seeds left with large distinct positive differences reach it."""
    not_ahead = sum(difference <= 0 for difference in differences)
    return min(1.0, 2 ** (1 + not_ahead) / 2 ** seeds_in_all)


def overdispersion(differences: list[int], prompts_per_seed: int, only_first: int, only_second: int) -> float:
    """The variance of the per-seed differences over the variance independent prompts would give them: each prompt
    adds +1 (right only in the first arm), -1 (only in the second) or 0, with the pooled shares of each. Near 1 the
    prompts behave as independent units; at 2, a McNemar test over prompts overstates the evidence."""
    total = prompts_per_seed * len(differences)
    first, second = only_first / total, only_second / total
    independent = prompts_per_seed * (first + second - (first - second) ** 2)
    mean = sum(differences) / len(differences)
    observed = sum((d - mean) ** 2 for d in differences) / (len(differences) - 1)
    return observed / independent
