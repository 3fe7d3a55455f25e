"""Held-out prompts, never sampled for training: the mean reward of one greedy completion each, with its 95%
interval (the normal approximation, dpo_min.intervals), before round 1 and after each round; with a right-or-wrong
reward (every total 0 or 1, as the demo's), also the count of prompts right, with its Wilson interval."""

import math
import sys
from pathlib import Path
from typing import Any

from dpo_min.intervals import mean_interval, wilson_interval


def also_training(prompt_ids: list[list[int]], train_rows: list[int], held_rows: list[int]) -> str | None:
    """The warning when held-out prompts are also training prompts, as rendered (the ids the policy is given): the
    split is by row, so duplicate rows put one prompt on both sides, and its held-out score then measures recall.
    Counted and said, never dropped, in the words of the offline split's held-out pairs (dpo_min/data/overlap.py)."""
    training = {tuple(prompt_ids[i]) for i in train_rows}
    shared = sum(tuple(prompt_ids[i]) in training for i in held_rows)
    if not shared:
        return None
    return (f"prompts: {shared} of the {len(held_rows)} held-out prompts are also training prompts (the same prompt: "
            "duplicate rows); their held-out scores measure recall")


def mean_with_interval(values: list[float]) -> dict[str, Any]:
    """Mean and 95% interval of the scorable values; the interval needs two of them. Finite rewards near the float
    range (1e308) overflow a plain sum: they are averaged scaled down, and a bound past the range is its end."""
    n = len(values)
    if n == 0:
        return {"mean": None, "low": None, "high": None, "n": 0}
    try:
        mean, low, high = mean_interval(values)
    except OverflowError:  # a square past the float range
        mean = low = high = math.inf
    if not all(map(math.isfinite, (mean, low, high))):
        scale = max(abs(value) for value in values)
        mean, low, high = (_clamped(scale * figure) for figure in mean_interval([v / scale for v in values]))
    if n < 2:
        return {"mean": mean, "low": None, "high": None, "n": 1}
    return {"mean": mean, "low": low, "high": high, "n": n}


def _clamped(value: float) -> float:
    return max(-sys.float_info.max, min(sys.float_info.max, value))


def right_count(line: dict[str, Any]) -> tuple[int, int] | None:
    """(right, scorable): how many scorable held-out prompts scored 1, when every scorable total is 0 or 1 (a
    right-or-wrong reward); None for any other reward, or a line written before the per-prompt totals were kept.
    The docs quote the rounds in this unit (9 -> 20 of 64), as benchmarks/compare_rounds.py counts them."""
    totals = [total for _, total in line.get("per_prompt", []) if total is not None]
    if not totals or any(total not in (0.0, 1.0) for total in totals):
        return None
    return sum(total == 1.0 for total in totals), len(totals)


def describe(line: dict[str, Any]) -> str:
    when = "before round 1" if line["round"] == 0 else f"after round {line['round']}"
    if line["mean"] is None:
        return f"held-out {when}: no scorable completion"
    interval = f" [{line['low']:.3f}, {line['high']:.3f}]" if line["low"] is not None else ""
    mean = f"mean reward {line['mean']:.3f}{interval} over {line['n']} prompts (greedy)"
    counted = right_count(line)
    if counted is None:
        return f"held-out {when}: {mean}"
    right, scored = counted
    low, high = wilson_interval(right, scored)
    return f"held-out {when}: right {right}/{scored} = {right / scored:.3f} [{low:.3f}, {high:.3f}] (Wilson), {mean}"


def plot(lines: list[dict[str, Any]], path: Path) -> None:
    """The held-out mean against the round, its interval as error bars."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display here
    from matplotlib import pyplot

    if not any(line["mean"] is not None for line in lines):
        return
    figure, axes = pyplot.subplots(figsize=(5, 3.2))
    draw(axes, lines)
    figure.tight_layout()
    figure.savefig(path, dpi=100, format="png")  # `path` may be a staging name (dpo_min.files)
    pyplot.close(figure)


def draw(axes: Any, lines: list[dict[str, Any]]) -> None:
    """The held-out curve on matplotlib `axes` (held_out.png's; rounds.png's left panel)."""
    shown = [line for line in lines if line["mean"] is not None]
    if not shown:
        return
    # Drawn in units of 10**k when the rewards are large: matplotlib's axis limits overflow near 1e308.
    largest = max(abs(line[key]) for line in shown for key in ("mean", "low", "high") if line[key] is not None)
    exponent = math.floor(math.log10(largest)) if largest >= 1e6 else 0
    unit = 10.0 ** exponent
    means = [line["mean"] / unit for line in shown]
    low = [mean - (line["low"] / unit if line["low"] is not None else mean) for mean, line in zip(means, shown)]
    high = [(line["high"] / unit if line["high"] is not None else mean) - mean for mean, line in zip(means, shown)]
    axes.errorbar([line["round"] for line in shown], means, yerr=[low, high], marker="o", capsize=3)
    axes.set_xlabel("round (0: before round 1)")
    axes.set_ylabel("held-out mean reward (greedy)" + (f", x 1e{exponent}" if exponent else ""))
    axes.set_xticks([line["round"] for line in shown])
