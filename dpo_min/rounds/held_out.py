"""Held-out prompts, never sampled for training: the mean reward of one greedy completion each, with its 95%
interval (the normal approximation, dpo_min.intervals), before round 1 and after each round."""

from pathlib import Path
from typing import Any

from dpo_min.intervals import mean_interval


def mean_with_interval(values: list[float]) -> dict[str, Any]:
    """Mean and 95% interval of the scorable values; the interval needs two of them."""
    n = len(values)
    if n == 0:
        return {"mean": None, "low": None, "high": None, "n": 0}
    mean, low, high = mean_interval(values)
    if n < 2:
        return {"mean": mean, "low": None, "high": None, "n": 1}
    return {"mean": mean, "low": low, "high": high, "n": n}


def describe(line: dict[str, Any]) -> str:
    when = "before round 1" if line["round"] == 0 else f"after round {line['round']}"
    if line["mean"] is None:
        return f"held-out {when}: no scorable completion"
    interval = f" [{line['low']:.3f}, {line['high']:.3f}]" if line["low"] is not None else ""
    return f"held-out {when}: mean reward {line['mean']:.3f}{interval} over {line['n']} prompts (greedy)"


def plot(lines: list[dict[str, Any]], path: Path) -> None:
    """The held-out mean against the round, its interval as error bars."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display here
    from matplotlib import pyplot

    shown = [line for line in lines if line["mean"] is not None]
    if not shown:
        return
    figure, axes = pyplot.subplots(figsize=(5, 3.2))
    low = [line["mean"] - (line["low"] if line["low"] is not None else line["mean"]) for line in shown]
    high = [(line["high"] if line["high"] is not None else line["mean"]) - line["mean"] for line in shown]
    axes.errorbar([line["round"] for line in shown], [line["mean"] for line in shown], yerr=[low, high],
                  marker="o", capsize=3)
    axes.set_xlabel("round (0: before round 1)")
    axes.set_ylabel("held-out mean reward (greedy)")
    axes.set_xticks([line["round"] for line in shown])
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
