"""Paired tests for two arms scored on the same units: exact McNemar over prompts (only the discordant prompts
count: right in one arm and wrong in the other) and the sign test over seeds. Both are the two-sided exact binomial
test of the discordant counts against 1/2, doubled from the smaller tail and capped at 1."""

from math import comb


def binomial_two_sided(k: int, n: int) -> float:
    """P-value of k successes in n fair trials, two-sided: twice the smaller tail, at most 1; 1 when n is 0."""
    if n == 0:
        return 1.0
    tail = sum(comb(n, i) for i in range(min(k, n - k) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def exact_mcnemar(only_first: int, only_second: int) -> float:
    """Prompts right only in the first arm against those right only in the second."""
    return binomial_two_sided(only_first, only_first + only_second)


def sign_test(ahead: int, behind: int) -> float:
    """Seeds where the first arm scored more against those where it scored less (ties left out)."""
    return binomial_two_sided(ahead, ahead + behind)
