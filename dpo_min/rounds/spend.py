"""Where a round's samples went, as its line says it (rounds.jsonl's `draw`, the printed line) and rounds.png draws it.

Each sampled prompt is one of: all right or all wrong (a right-or-wrong reward: every total of the round 0 or 1),
all alike (every scorable sample scored the same, for any other reward), mixed (two scores or more: where pairs come
from), or unscorable (under two scorable samples). Beside them: the prompts the history skipped (skip_saturated),
those drawn to refill the round (dynamic_sampling), and the round's generate() calls. Every completion sampled, set
aside or not, counts in the line's `samples`: what the round spent.
"""

from pathlib import Path
from typing import Any

from . import held_out

OUTCOMES = ("all_right", "all_wrong", "all_alike", "mixed", "unscorable")
_SHOWN = {"all_right": "all right", "all_wrong": "all wrong", "all_alike": "all alike", "mixed": "mixed",
          "unscorable": "unscorable"}


def outcomes(samples: list[dict[str, Any]]) -> dict[str, int]:
    """How many of the round's prompts had each outcome (OUTCOMES)."""
    by_prompt: dict[int, list[float | None]] = {}
    for row in samples:
        by_prompt.setdefault(row["prompt_index"], []).append(row["total"])
    scored = [total for totals in by_prompt.values() for total in totals if total is not None]
    right_or_wrong = bool(scored) and all(total in (0.0, 1.0) for total in scored)
    counts = dict.fromkeys(OUTCOMES, 0)
    for totals in by_prompt.values():
        values = {total for total in totals if total is not None}
        if sum(total is not None for total in totals) < 2:
            counts["unscorable"] += 1
        elif len(values) > 1:
            counts["mixed"] += 1
        elif right_or_wrong:
            counts["all_right" if values == {1.0} else "all_wrong"] += 1
        else:
            counts["all_alike"] += 1
    return counts


def record(samples: list[dict[str, Any]], drawn: dict[str, Any]) -> dict[str, Any]:
    """rounds.jsonl's `draw`: the outcomes, and from the round's draw (draws.sample_round) the prompts skipped, the
    prompts drawn to refill, the generate() calls, the round's temperature and each call's prompts and seed (a
    draw.json written before they were recorded has none)."""
    calls = {key: drawn[key] for key in ("gen_batches", "temperature", "batches") if key in drawn}
    return {**outcomes(samples), "skipped": len(drawn["skipped"]), "refills": drawn["refills"], **calls}


def describe(line: dict[str, Any]) -> str:
    """'8 prompts: 2 all right, 1 all wrong, 5 mixed (2 skipped as saturated, 3 drawn to refill)'."""
    draw = line["draw"]
    parts = [f"{draw[name]} {_SHOWN[name]}" for name in OUTCOMES if draw[name] or name == "mixed"]
    extra = [f"{draw['skipped']} skipped as saturated"] * bool(draw["skipped"])
    extra += [f"{draw['refills']} drawn to refill"] * bool(draw["refills"])
    return f"{line['prompts']} prompts: {', '.join(parts)}" + (f" ({', '.join(extra)})" if extra else "")


def plot(rounds: list[dict[str, Any]], held: list[dict[str, Any]], path: Path) -> None:
    """rounds.png: the held-out curve (left) beside each round's completions by its prompts' outcome, with the
    round's pairs and DPO steps above its bar (right)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display here
    from matplotlib import pyplot

    shown = [line for line in rounds if "draw" in line]  # a line from before `draw` was recorded has no split
    figure, (left, right) = pyplot.subplots(1, 2, figsize=(9.5, 3.4))
    held_out.draw(left, held)
    x = [line["round"] for line in shown]
    bottom = [0.0] * len(shown)
    for name in ("mixed", *(name for name in OUTCOMES if name != "mixed")):  # what trains, at the foot of the bar
        per_prompt = [line["samples"] / line["prompts"] if line["prompts"] else 0 for line in shown]
        heights = [line["draw"][name] * each for line, each in zip(shown, per_prompt)]
        if any(heights):
            right.bar(x, heights, bottom=bottom, label=_SHOWN[name])
            bottom = [b + h for b, h in zip(bottom, heights)]
    for position, height, line in zip(x, bottom, shown):
        steps = line.get("dpo", {}).get("steps", 0)
        right.annotate(f"{line['pairs']} pair{'s' * (line['pairs'] != 1)}\n{steps} step{'s' * (steps != 1)}",
                       (position, height), ha="center", va="bottom", fontsize=7)
    right.set_xlabel("round")
    right.set_ylabel("completions sampled")
    right.set_xticks(x)
    right.margins(y=0.25)
    if shown:
        right.legend(title="the prompt's samples", fontsize=7, title_fontsize=7, loc="upper left",
                     bbox_to_anchor=(1, 1))  # beside the bars, clear of their labels
    figure.tight_layout()
    figure.savefig(path, dpi=100, format="png")  # `path` may be a staging name (dpo_min.files)
    pyplot.close(figure)
