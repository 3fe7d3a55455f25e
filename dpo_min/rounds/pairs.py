"""The pair rule: per prompt, the best-scored sample against the worst (with `pairs_per_prompt` k, against each of
the k worst: GroupDPO, arXiv 2604.15602, takes more than one pair of a prompt's group); or, with `pair_rule`
"every", every sample against every lower-scored one (with a 0/1 reward: every right answer against every wrong
one), up to `pairs_per_prompt` pairs a prompt. A prompt gives no pair when
fewer than two of its samples are scorable, when all its scores tie or its best and worst are the same text, or when
best - worst < min_margin; a pair the DPO pass would drop (`keep_trainable`) is left out before it. Each is counted
under its reason, never dropped silently.

For a listwise loss (plackett_luce, which reads one strict order of a prompt's answers and refuses ties), "every"
pairs one ranking instead (`ranked_chain`): one text per distinct score, each against the next lower one."""

from collections import Counter
from collections.abc import Collection, Sequence
from itertools import groupby, pairwise
from typing import Any

from dpo_min.tokenizing import (
    GIVEN_COLUMNS,
    NO_ANSWER,
    NO_COMPLETION,
    SAME_COMPLETIONS,
    drop_reason,
    special_ids,
    special_inside,
)

PAIR_RULE_REASONS = ("unscorable", "all_tied", "below_min_margin")
# Why the DPO pass drops a pair (reading it as data, tokenizing and truncating it), as rounds.jsonl names it.
TRAINING_REASONS = {NO_ANSWER: "empty_completion", NO_COMPLETION: "prompt_fills_max_length",
                    SAME_COMPLETIONS: "same_after_truncation"}
# A sample with a special token before its end (decoding hid it from the text the reward read): the DPO pass refuses
# its ids (tokenizing.tokenize_row), so the pair is counted out here rather than stop the round.
SPECIAL_INSIDE = "special_token_inside"
COMPLETION_IDS = ("chosen_ids", "rejected_ids")
DROP_REASONS = (*PAIR_RULE_REASONS, *TRAINING_REASONS.values(), SPECIAL_INSIDE)


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


def best_and_k_worst(samples: Sequence[dict[str, Any]], min_margin: float, k: int) -> tuple[int, list[int]] | str:
    """The best sample's index (the first of equals) and those of the k worst others (lowest total first, the first
    of equals first) that make a pair with it: each scored under the best by min_margin or more (and by more than
    0), its text neither the best's nor an earlier one's of these k. Or the reason there is no pair. With k=1 this is
    best_and_worst, and a worst of the best's text is no pair (`all_tied`)."""
    totals = [sample["total"] for sample in samples]
    chosen = best_and_worst(totals, min_margin)
    if isinstance(chosen, str):
        return chosen
    best = chosen[0]
    others = sorted((i for i, total in enumerate(totals) if total is not None and i != best),
                    key=lambda i: (totals[i], i))
    texts, rejected = {samples[best]["completion"]}, []
    for i in others[:k]:
        margin = totals[best] - totals[i]
        if margin > 0 and margin >= min_margin and samples[i]["completion"] not in texts:
            rejected.append(i)
        texts.add(samples[i]["completion"])
    # No pair from the k worst: the worst is as far from the best as any, so its text is the best's (a cut sample's
    # missing_eos_penalty scored one text apart from itself), or the k worst all were.
    return (best, rejected) if rejected else "all_tied"


def every_better_against_worse(samples: Sequence[dict[str, Any]], min_margin: float,
                                cap: int) -> list[tuple[int, int]] | str:
    """Up to `cap` (chosen, rejected) index pairs of one prompt's samples: every text against every text it scored
    above in each sample of both (its lowest total over the other's highest) by min_margin or more (and by more than
    0), each pair of texts once and never a text against itself, so that no two texts are paired both ways (a text
    sampled twice, scored 1 and 0, is paired over no text scored between). A pair is the chosen text's best-scored
    sample against the rejected text's worst (the first of equals). The widest margins come first; among equal
    margins, the pair whose two texts were used least so far (so a cap spreads over the group rather than pairing
    one right answer with every wrong one), then the lowest indices. Or the reason there is no pair, as
    best_and_worst gives it."""
    reason = best_and_worst([sample["total"] for sample in samples], min_margin)
    if isinstance(reason, str):
        return reason
    texts = _scored_texts(samples)
    candidates = [(a["low"] - b["high"], a["best"], b["worst"], i, j) for i, a in enumerate(texts)
                  for j, b in enumerate(texts) if i != j and a["low"] - b["high"] > 0
                  and a["low"] - b["high"] >= min_margin]
    return _spread(candidates, cap) or "all_tied"


def _scored_texts(samples: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each text's scored samples, in the order the texts first appear: the index of its best and of its worst sample
    (the first of equals), and its lowest and highest total."""
    by_text: dict[str, dict[str, Any]] = {}
    for i, sample in enumerate(samples):
        total = sample["total"]
        if total is None:
            continue
        text = by_text.setdefault(sample["completion"], {"best": i, "worst": i, "low": total, "high": total})
        if total > text["high"]:
            text["best"], text["high"] = i, total
        if total < text["low"]:
            text["worst"], text["low"] = i, total
    return list(by_text.values())


def _spread(candidates: list[tuple[float, int, int, int, int]], cap: int) -> list[tuple[int, int]]:
    """Up to `cap` of the (margin, chosen sample, rejected sample, chosen text, rejected text) candidates, as a greedy
    choice: the widest margin first; among equal margins the pair whose two texts were used least so far, then the
    lowest sample indices. Uses only grow, so a margin's pairs are scanned level by level of their uses: at level L,
    in index order, a pair whose uses are still L is the greedy's next choice, and one whose uses grew waits at its
    new level. The work grows with the pairs times the levels they wait at, not with a fresh minimum over every
    candidate for each pair taken (9 s a prompt at 128 samples)."""
    chosen: list[tuple[int, int]] = []
    uses = [0] * (1 + max((max(i, j) for *_, i, j in candidates), default=0))  # per text
    candidates.sort(key=lambda candidate: -candidate[0])
    for _, same_margin in groupby(candidates, key=lambda candidate: candidate[0]):
        levels: dict[int, list[tuple[int, int, int, int]]] = {}
        for _, a, b, i, j in same_margin:
            levels.setdefault(uses[i] + uses[j], []).append((a, b, i, j))
        while levels and len(chosen) < cap:
            level = min(levels)
            for a, b, i, j in sorted(levels.pop(level)):
                now = uses[i] + uses[j]
                if now != level:
                    levels.setdefault(now, []).append((a, b, i, j))
                    continue
                chosen.append((a, b))
                uses[i] += 1
                uses[j] += 1
                if len(chosen) == cap:
                    return chosen
    return chosen


def ranked_chain(samples: Sequence[dict[str, Any]], min_margin: float, cap: int) -> list[tuple[int, int]] | str:
    """The (better, worse) index pairs of one ranking of a prompt's samples, for plackett_luce: from the best down,
    one sample per score (the first of equals), each text once, each scored under the last one taken by min_margin
    or more (and by more than 0); each taken sample against the next, so the pairs order the taken answers in one way
    only (grouping.strict_order) and two answers that tie are never both in it. `cap` pairs at most: the best
    cap + 1 answers. Or the reason there is no pair, as best_and_worst gives it ("all_tied": one text)."""
    reason = best_and_worst([sample["total"] for sample in samples], min_margin)
    if isinstance(reason, str):
        return reason
    scored = sorted((i for i, sample in enumerate(samples) if sample["total"] is not None),
                    key=lambda i: (-samples[i]["total"], i))
    taken, texts = [scored[0]], {samples[scored[0]]["completion"]}
    for i in scored[1:]:
        margin = samples[taken[-1]]["total"] - samples[i]["total"]
        if len(taken) > cap or samples[i]["completion"] in texts or margin <= 0 or margin < min_margin:
            continue
        taken.append(i)
        texts.add(samples[i]["completion"])
    return list(pairwise(taken)) or "all_tied"


def gives_pair(samples: Sequence[dict[str, Any]], min_margin: float, rule: str) -> bool:
    """Whether one prompt's samples give a pair by the rule (before the DPO pass's own checks): what dynamic sampling
    keeps and what a prompt's history counts (draws.py, history.py)."""
    return not isinstance(_pair_indices(samples, min_margin, 1, rule), str)


def _pair_indices(samples: Sequence[dict[str, Any]], min_margin: float, cap: int,
                  rule: str, ranked: bool = False) -> list[tuple[int, int]] | str:
    if rule == "every":
        if ranked:
            return ranked_chain(samples, min_margin, cap)
        return every_better_against_worse(samples, min_margin, cap)
    chosen = best_and_k_worst(samples, min_margin, cap)
    return chosen if isinstance(chosen, str) else [(chosen[0], worst) for worst in chosen[1]]


def make_pairs(groups: Sequence[dict[str, Any]], min_margin: float, pairs_per_prompt: int = 1,
               rule: str = "best", ranked: bool = False) -> tuple[list[dict[str, Any]], Counter]:
    """`groups`: one per prompt, {"prompt_index", "prompt", "prompt_ids", "samples": [{"completion",
    "completion_ids", "total", ...}]}.

    Returns the pairs in explicit-prompt layout (prompt, chosen, rejected; a conversational prompt's completions
    as one assistant message) with the ids that were sampled (prompt_ids, chosen_ids, rejected_ids), which
    load_preference_dataset reads back and the DPO pass trains on as given, and the drop counts by reason: a count
    of prompts that gave no pair. `ranked` (a listwise loss): with rule "every", each prompt's pairs are one ranking
    (ranked_chain)."""
    pairs, dropped = [], Counter(dict.fromkeys(PAIR_RULE_REASONS, 0))
    for group in groups:
        samples = group["samples"]
        chosen = _pair_indices(samples, min_margin, pairs_per_prompt, rule, ranked)
        if isinstance(chosen, str):
            dropped[chosen] += 1
            continue
        for best, worst in ((samples[a], samples[b]) for a, b in chosen):
            pairs.append({"prompt": group["prompt"], "chosen": _as_completion(group["prompt"], best["completion"]),
                          "rejected": _as_completion(group["prompt"], worst["completion"]),
                          "prompt_ids": group["prompt_ids"], "chosen_ids": best["completion_ids"],
                          "rejected_ids": worst["completion_ids"],
                          "chosen_reward": best["total"], "rejected_reward": worst["total"],
                          "prompt_index": group["prompt_index"]})
    return pairs, dropped


def saturated(groups: Sequence[dict[str, Any]]) -> int:
    """How many prompts had every scorable sample (two or more) score the same total: no sample to learn from,
    whatever the rule. Each is also counted in `all_tied` (which counts too a best and worst of one text)."""
    counted = 0
    for group in groups:
        totals = {sample["total"] for sample in group["samples"] if sample["total"] is not None}
        scorable = sum(sample["total"] is not None for sample in group["samples"])
        counted += scorable >= 2 and len(totals) == 1
    return counted


def _as_completion(prompt: Any, text: str) -> Any:
    return [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text


def keep_trainable(pairs: list[dict[str, Any]], tokenizer: Any, args: Any,
                   end_ids: Collection[int] | None = None) -> tuple[list[dict[str, Any]], Counter]:
    """The pairs the DPO pass trains on, and the others counted by reason (TRAINING_REASONS' values, SPECIAL_INSIDE),
    decided by the core's own reading and tokenizing with `args`' (a DPOMinConfig) max_length, max_prompt_length,
    truncation_mode and chat_template_kwargs, and `end_ids` (the ids the policy's samples stop on), so that
    rounds.jsonl's `pairs` is what trains."""
    kept, dropped = [], Counter(dict.fromkeys((*TRAINING_REASONS.values(), SPECIAL_INSIDE), 0))
    specials, ends = special_ids(tokenizer), {tokenizer.eos_token_id} if end_ids is None else set(end_ids)
    for pair in pairs:
        if any(special_inside(pair.get(side) or [], specials, ends) is not None for side in COMPLETION_IDS):
            dropped[SPECIAL_INSIDE] += 1
            continue
        given = ("prompt", "chosen", "rejected", *GIVEN_COLUMNS)
        reason = drop_reason({name: pair[name] for name in given if name in pair}, tokenizer, args.max_length,
                             args.max_prompt_length, args.truncation_mode, args.chat_template_kwargs, ends)
        if reason is None:
            kept.append(pair)
        else:
            dropped[TRAINING_REASONS.get(reason, reason)] += 1
    return kept, dropped
