"""The pair rule: per prompt, the best-scored sample against the worst. A prompt gives no pair when fewer than two
of its samples are scorable, when all its scores tie, or when best - worst < min_margin; each such prompt is
counted under its reason, never dropped silently."""

from collections import Counter
from collections.abc import Sequence
from typing import Any

DROP_REASONS = ("unscorable", "all_tied", "below_min_margin")


def best_and_worst(totals: Sequence[float | None], min_margin: float) -> tuple[int, int] | str:
    """The indices (best, worst) of one prompt's samples, the first of equals; or the reason there is no pair."""
    scored = [i for i, total in enumerate(totals) if total is not None]
    if len(scored) < 2:
        return "unscorable"
    best = max(scored, key=lambda i: totals[i])
    worst = min(scored, key=lambda i: totals[i])
    margin = totals[best] - totals[worst]
    if margin == 0:
        return "all_tied"
    return "below_min_margin" if margin < min_margin else (best, worst)


def make_pairs(groups: Sequence[dict[str, Any]], min_margin: float) -> tuple[list[dict[str, Any]], Counter]:
    """`groups`: one per prompt, {"prompt_index", "prompt", "prompt_ids", "samples": [{"completion",
    "completion_ids", "total", ...}]}.

    Returns the pairs in explicit-prompt layout (prompt, chosen, rejected; a conversational prompt's completions
    as one assistant message) with the ids that were sampled (prompt_ids, chosen_ids, rejected_ids), which
    load_preference_dataset reads back and the DPO pass trains on as given, and the drop counts by reason."""
    pairs, dropped = [], Counter(dict.fromkeys(DROP_REASONS, 0))
    for group in groups:
        samples = group["samples"]
        chosen = best_and_worst([sample["total"] for sample in samples], min_margin)
        if isinstance(chosen, str):
            dropped[chosen] += 1
            continue
        best, worst = (samples[i] for i in chosen)
        pairs.append({"prompt": group["prompt"], "chosen": _as_completion(group["prompt"], best["completion"]),
                      "rejected": _as_completion(group["prompt"], worst["completion"]),
                      "prompt_ids": group["prompt_ids"], "chosen_ids": best["completion_ids"],
                      "rejected_ids": worst["completion_ids"],
                      "chosen_reward": best["total"], "rejected_reward": worst["total"],
                      "prompt_index": group["prompt_index"]})
    return pairs, dropped


def _as_completion(prompt: Any, text: str) -> Any:
    return [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text
