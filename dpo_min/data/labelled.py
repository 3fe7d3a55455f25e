"""Layouts whose preference is a label or a score over two or more responses, and the label check.

Each adapter turns a row into {prompt, chosen, rejected} by its publisher's rule (or a well-known conversion's,
cited beside it), or returns None for a row the rule skips (a tie). `layouts.LAYOUTS` holds their entries, with the
columns that recognise them and the label columns each reads: one table. A column named like a preference label
that no one reads is refused (`check_labels_read`): a label silently ignored trains half the pairs backwards.
"""

import random
import re
from collections.abc import Iterable, Mapping
from typing import Any

from .options import LayoutOptions
from .ranked import every_better_pair, finite_score, shown

# winner, label(s), choice, rank, *preference*, *_response_id, score_*: a column that says which response is better.
# One named after the chosen or the rejected reply (score_chosen, chosen_rating) describes a pair already in order.
_LABEL_NAME = re.compile(r"^(winner|labels?|choice|rank|score_.+|.+_response_id|.*preference.*)$", re.IGNORECASE)
_SEED = "dpo_min"  # with the row's prompt, the seed of a layout's random draw: the same row always draws the same
_TLDR_PROMPT = "SUBREDDIT: r/{subreddit}\n\nTITLE: {title}\n\nPOST: {post}\n\nTL;DR:"
_CNNDM_PROMPT = "Article:\n{article}\n\nTL;DR:"
_CNNDM_BATCHES = ("batch0_cnndm", "cnndm0", "cnndm2")
_HH_TURN = re.compile(r"\n\n(Human|Assistant):")


def require(row: Mapping[str, Any], index: int | str, *names: str) -> None:
    for name in names:
        if row.get(name) is None:
            raise ValueError(f"row {index}: field '{name}' is missing")


def seeded_choice(items: list[Any], key: str) -> Any:
    """One of `items`, drawn by a generator seeded with the row's own text: the draw does not depend on the order,
    the slice or the worker a row is read in."""
    return random.Random(f"{_SEED}:{key}").choice(items)


def unread_labels(columns: Iterable[str], read: Iterable[str]) -> list[str]:
    read = set(read)
    return [name for name in columns if name not in read and _LABEL_NAME.match(name)
            and "chosen" not in name.lower() and "rejected" not in name.lower()]


def check_labels_read(layout_name: str, columns: Iterable[str], read: tuple[str, ...], own: bool) -> None:
    """Refuse a label-like column that `read` (the layout's labels, and --label_column) leaves out."""
    unread = unread_labels(columns, read)
    if not unread:
        return
    how = (f"it reads {', '.join(name for name in read if name)}; remove the column if it is not a label" if own
           else f"say how to read it (--label_column {unread[0]} --label_chosen VALUE --label_rejected VALUE: the "
                "values that mean the chosen or the rejected column is the better one), or remove the column")
    raise ValueError(f"column '{unread[0]}' looks like a preference label, and the {layout_name} layout does not "
                     f"read it (the pairs could train backwards): {how}")


def check_label_option(layout_name: str, labels: tuple[str, ...], kinds: Mapping[str, str],
                       options: LayoutOptions) -> None:
    if options.label_column is None:
        return
    if labels:
        raise ValueError(f"the {layout_name} layout reads its own label ({', '.join(labels)}); "
                         "drop --label_column")
    if options.label_column not in kinds:
        raise ValueError(f"--label_column: no column named {options.label_column!r} in [{', '.join(kinds)}]")


def apply_label(pair: dict[str, Any], row: Mapping[str, Any], index: int | str, options: LayoutOptions) -> dict:
    """The user's label (--label_column) over a pair of mapped columns: kept, or swapped when it prefers rejected."""
    column = options.label_column
    value = row.get(column)
    if value is not None and str(value) == options.label_chosen:
        return pair
    if value is not None and str(value) == options.label_rejected:
        return {**pair, "chosen": pair["rejected"], "rejected": pair["chosen"]}
    raise ValueError(f"row {index}: field '{column}' is {value!r}, neither --label_chosen {options.label_chosen!r} "
                     f"nor --label_rejected {options.label_rejected!r}")


def hh_messages(transcript: str) -> list[dict[str, str]]:
    # re.split with one group gives ["", "Human", " text", "Assistant", " text", ...]
    parts = _HH_TURN.split(transcript)[1:]
    return [{"role": "user" if speaker == "Human" else "assistant", "content": text.strip()}
            for speaker, text in zip(parts[::2], parts[1::2])]


def _turns(prompt: Any, better: str, worse: str) -> dict[str, Any]:
    return {"prompt": prompt, "chosen": [{"role": "assistant", "content": better}],
            "rejected": [{"role": "assistant", "content": worse}]}


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# ---- the adapters -------------------------------------------------------------------------------------------------
def pku_saferlhf(row: Mapping[str, Any], index: int | str, options: LayoutOptions) -> dict:
    label = options.preference_label
    require(row, index, "prompt", "response_0", "response_1", label)
    if row[label] not in (0, 1):
        raise ValueError(f"row {index}: field '{label}' must be 0 or 1, got {row[label]!r}")
    better = int(row[label])
    return {"prompt": row["prompt"], "chosen": row[f"response_{better}"], "rejected": row[f"response_{1 - better}"]}


def pku_saferlhf_single(row: Mapping[str, Any], index: int | str, options: LayoutOptions) -> dict:
    # PKU-Alignment/PKU-SafeRLHF-single-dimension: one label, better_response_id; there is no safer one to pick.
    if options.preference_label != "better_response_id":
        raise ValueError(f"--preference_label {options.preference_label}: this data (PKU-SafeRLHF-single-dimension) "
                         "has only better_response_id")
    return pku_saferlhf(row, index, options)


def shp(row: Mapping[str, Any], index: int | str, options: LayoutOptions) -> dict:
    require(row, index, "history", "human_ref_A", "human_ref_B", "labels")
    if row["labels"] not in (0, 1):
        raise ValueError(f"row {index}: field 'labels' must be 0 or 1 (1: human_ref_A preferred), "
                         f"got {row['labels']!r}")
    a_preferred = row["labels"] == 1
    return {"prompt": row["history"], "chosen": row["human_ref_A" if a_preferred else "human_ref_B"],
            "rejected": row["human_ref_B" if a_preferred else "human_ref_A"]}


def _by_strength(row: Mapping[str, Any], index: int | str, field: str, first: str, second: str) -> tuple | None:
    """HelpSteer's -3..3 scale: negative prefers the first response, positive the second, 0 is a tie (None)."""
    strength = row[field]
    if not isinstance(strength, int) or isinstance(strength, bool) or not -3 <= strength <= 3:
        raise ValueError(f"row {index}: field '{field}' must be an integer in -3..3, got {strength!r}")
    if strength == 0:
        return None
    return (row[first], row[second]) if strength < 0 else (row[second], row[first])


def helpsteer3(row: Mapping[str, Any], index: int | str, options: LayoutOptions) -> dict | None:
    require(row, index, "context", "response1", "response2", "overall_preference")
    ordered = _by_strength(row, index, "overall_preference", "response1", "response2")
    return None if ordered is None else _turns(row["context"], *ordered)


def helpsteer2(row: Mapping[str, Any], index: int | str, options: LayoutOptions) -> dict | None:
    # nvidia/HelpSteer2 preference/preference.jsonl.gz (arXiv 2410.01257): one file of train and val rows, told
    # apart by `split`; preference_strength -3..3, negative: response_1 better.
    require(row, index, "split", "prompt", "response_1", "response_2", "preference_strength")
    if row["split"] != options.row_split:
        return None
    ordered = _by_strength(row, index, "preference_strength", "response_1", "response_2")
    return None if ordered is None else {"prompt": row["prompt"], "chosen": ordered[0], "rejected": ordered[1]}


def ultrafeedback_raw(row: Mapping[str, Any], index: int | str, options: LayoutOptions) -> dict | list | None:
    # openbmb/UltraFeedback binarized as HuggingFaceH4/ultrafeedback_binarized's card says: chosen = the highest
    # overall_score (the first of equals), rejected = one of the other completions at random.
    require(row, index, "instruction", "completions")
    completions = row["completions"]
    if not isinstance(completions, list) or not all(isinstance(one, dict) for one in completions):
        raise ValueError(f"row {index}: field 'completions' must be a list of {{'response', 'overall_score', ...}}, "
                         f"got {shown(completions)}")
    scores = [finite_score(one.get("overall_score"), index, f"completions[{position}].overall_score")
              for position, one in enumerate(completions)]
    if len(completions) < 2:
        return None  # nothing to compare
    if options.every_ranked_pair:  # every better completion against every worse one (ranked.py)
        return every_better_pair(_user(row["instruction"]), [one.get("response") for one in completions], scores,
                                 index, "completions[{}].response") or None  # None: every score equal, a tie
    best = max(range(len(completions)), key=lambda position: scores[position])
    other = seeded_choice([one for position, one in enumerate(completions) if position != best], row["instruction"])
    return _turns(_user(row["instruction"]), completions[best].get("response"), other.get("response"))


def _last_answer(conversation: Any, index: int | str, field: str) -> tuple[list, Any]:
    if not isinstance(conversation, list) or not conversation or not isinstance(conversation[-1], dict) or \
            conversation[-1].get("role") != "assistant":
        raise ValueError(f"row {index}: field '{field}' must be a message list ending with an assistant turn")
    return conversation[:-1], conversation[-1]


def chatbot_arena(row: Mapping[str, Any], index: int | str, options: LayoutOptions) -> dict | None:
    # lmsys/chatbot_arena_conversations: winner is model_a, model_b, tie or tie (bothbad). The two models answered
    # each turn apart, so a multi-turn row is a pair only where both conversations share every turn but the last.
    require(row, index, "conversation_a", "conversation_b", "winner")
    if row["winner"] not in ("model_a", "model_b", "tie", "tie (bothbad)"):
        raise ValueError(f"row {index}: field 'winner' must be model_a, model_b, tie or tie (bothbad), "
                         f"got {row['winner']!r}")
    prompt_a, answer_a = _last_answer(row["conversation_a"], index, "conversation_a")
    prompt_b, answer_b = _last_answer(row["conversation_b"], index, "conversation_b")
    if row["winner"].startswith("tie") or prompt_a != prompt_b:
        return None
    better, worse = (answer_a, answer_b) if row["winner"] == "model_a" else (answer_b, answer_a)
    return {"prompt": prompt_a, "chosen": [better], "rejected": [worse]}


def summarize_from_feedback(row: Mapping[str, Any], index: int | str, options: LayoutOptions) -> dict:
    # openai/summarize_from_feedback `comparisons`, as TRL's examples/datasets/tldr_preference.py: the prompt is the
    # post (or CNN/DM article) in TRL's TL;DR format; chosen = summaries[choice], stripped of its leading space.
    require(row, index, "info", "summaries", "choice")
    summaries, choice = row["summaries"], row["choice"]
    if choice not in (0, 1) or not isinstance(summaries, list) or len(summaries) != 2 or not all(
            isinstance(one, dict) and isinstance(one.get("text"), str) for one in summaries):
        raise ValueError(f"row {index}: field 'choice' must be 0 or 1 over two summaries {{'text': str, ...}}")
    form = _CNNDM_PROMPT if row.get("batch") in _CNNDM_BATCHES else _TLDR_PROMPT
    try:
        prompt = form.format(**row["info"])
    except (KeyError, TypeError):
        raise ValueError(f"row {index}: field 'info' must hold subreddit, title and post (article for CNN/DM)") \
            from None
    return _turns(_user(prompt), summaries[choice]["text"].strip(), summaries[1 - choice]["text"].strip())


def webgpt_comparisons(row: Mapping[str, Any], index: int | str, options: LayoutOptions) -> dict | None:
    # openai/webgpt_comparisons: the higher score is better, equal scores a tie (dropped, as open-instruct's
    # scripts/data/preferences/webgpt.py). The prompt is the question: each answer cites its own quotes.
    require(row, index, "question", "answer_0", "answer_1", "score_0", "score_1")
    question = row["question"].get("full_text") if isinstance(row["question"], dict) else None
    if not isinstance(question, str):
        raise ValueError(f"row {index}: field 'question' must be {{'full_text': str, ...}}")
    if row["score_0"] == row["score_1"]:
        return None
    better = 0 if row["score_0"] > row["score_1"] else 1
    return {"prompt": question, "chosen": row[f"answer_{better}"], "rejected": row[f"answer_{1 - better}"]}


def nectar(row: Mapping[str, Any], index: int | str, options: LayoutOptions) -> dict | list | None:
    # berkeley-nest/Nectar: `prompt` is an HH transcript ("Human: ...\n\nAssistant:"), `answers` seven
    # {answer, model, rank}. Rank 1 against one lower-ranked answer drawn at random (seeded by the prompt);
    # open-instruct's scripts/data/preferences/nectar.py draws chosen among the top 4 instead.
    require(row, index, "prompt", "answers")
    answers = row["answers"]
    if not isinstance(answers, list) or len(answers) < 2 or not all(isinstance(one, dict) for one in answers):
        raise ValueError(f"row {index}: field 'answers' must be a list of two or more {{'answer', 'rank'}}, "
                         f"got {shown(answers)}")
    if not isinstance(row["prompt"], str):
        raise ValueError(f"row {index}: field 'prompt' must be a transcript string, got {type(row['prompt']).__name__}")
    ranks = [finite_score(one.get("rank"), index, f"answers[{position}].rank") for position, one in enumerate(answers)]
    turns = hh_messages("\n\n" + row["prompt"].lstrip("\n"))
    if not turns or turns[-1] != {"role": "assistant", "content": ""}:
        raise ValueError(f"row {index}: field 'prompt' must be a transcript ending with an empty 'Assistant:' turn")
    if options.every_ranked_pair:  # every better-ranked answer against every worse one (ranked.py); rank 1 is best
        return every_better_pair(turns[:-1], [one.get("answer") for one in answers], [-rank for rank in ranks],
                                 index, "answers[{}].answer") or None
    best = min(ranks)
    lower = [one for one, rank in zip(answers, ranks) if rank > best]
    if not lower:
        raise ValueError(f"row {index}: field 'answers' has no answer ranked below the first")
    first = answers[ranks.index(best)]  # the first of the best-ranked, as a stable sort by rank puts it
    return {"prompt": turns[:-1], "chosen": [{"role": "assistant", "content": first.get("answer")}],
            "rejected": [{"role": "assistant", "content": seeded_choice(lower, row["prompt"]).get("answer")}]}
