"""The prompt-only layout: rows with a `prompt` column, a text or a message list ({role, content} dicts), all of
one kind. Every other column travels with its prompt to the reward functions (TRL's `solution`, say). What a round's
DPO pass would refuse of a prompt is refused here, before anything is sampled: its rows' rules (`prompt_rows`, before
the model loads) and, once the tokenizer is there, prompts that leave no room for an answer (`check_room`)."""

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import fields
from typing import Any

from ..config import DPOMinConfig
from ..split import held_out_split
from ..tokenizing import check_prompt, render_prompts, template_kwargs_of, truncate_pair
from .config import RoundsError
from .progress import phase_bar


def _prompt_kind(prompt: Any, index: int) -> str:
    """'text' or 'messages', checked before the model loads by the rules a round's DPO pass validates its pairs'
    prompts with (`tokenizing.check_prompt`), so that no prompt is refused after it has been sampled and scored."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise RoundsError(f"row {index}: field 'prompt' is empty")
        _checked(prompt, index)
        return "text"
    if isinstance(prompt, list) and prompt and all(isinstance(m, Mapping) and {"role", "content"} <= set(m)
                                                   for m in prompt):
        _checked(prompt, index)
        for turn in prompt:  # as an empty text prompt; an assistant turn that calls tools may have no text
            if not turn.get("tool_calls") and not turn["content"].strip():
                raise RoundsError(f"row {index}: field 'prompt' has an empty message: {str(turn)[:80]}")
        if prompt[-1]["role"] == "assistant":
            raise RoundsError(f"row {index}: field 'prompt' ends with an assistant turn; a prompt ends where the "
                              "answer the rounds sample begins")
        return "messages"
    raise RoundsError(f"row {index}: field 'prompt' must be a text or a list of {{role, content}} messages, got "
                      f"{type(prompt).__name__}")


def _checked(prompt: Any, index: int) -> None:
    try:
        check_prompt(prompt, index)
    except ValueError as error:
        raise RoundsError(str(error)) from None


def prompt_rows(prompts: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A dataset (or any rows) as a list of dicts, checked: a prompt in each, all of one kind."""
    rows = [dict(row) for row in prompts]
    if not rows:
        raise RoundsError("prompts: no rows")
    kinds = set()
    for index, row in enumerate(rows):
        if "prompt" not in row:
            raise RoundsError(f"row {index}: no 'prompt' field (it has {', '.join(sorted(row)) or 'none'})")
        kinds.add(_prompt_kind(row["prompt"], index))
        if len(kinds) > 1:
            raise RoundsError(f"row {index}: field 'prompt' mixes texts and message lists; give one kind")
    return rows


def fingerprint(rows: list[dict[str, Any]]) -> str:
    """What a resume checks it has the same prompts by."""
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()[:16]


def split_held_out(count: int, share: float, seed: int) -> tuple[list[int], list[int]]:
    """(training, held-out) row indices, each in row order: the package's one split (dpo_min.split, the command's
    held-out pairs' too), so a share that would hold out every prompt is refused there, not capped."""
    try:
        train, held = held_out_split(count, share, seed)
    except ValueError:
        raise RoundsError(f"held_out_share {share} of {count} prompt(s) holds out every one, leaving none to train "
                          "on: lower it, or give more prompts") from None
    return sorted(train), sorted(held)


def check_room(rows: list[dict[str, Any]], train_rows: Sequence[int], tokenizer: Any,
               training: Mapping[str, Any]) -> None:
    """Refuses, before the first sample, training prompts that all fill the DPO pass's max_length: it would drop
    every pair, after sampling and scoring them. Each prompt is rendered as it is sampled and cut as the pass cuts
    it (`truncate_pair`, with `training`'s max_length, max_prompt_length and truncation_mode, or their defaults)."""
    defaults = {option.name: option.default for option in fields(DPOMinConfig)}
    cut = {name: training.get(name, defaults[name]) for name in ("max_length", "max_prompt_length", "truncation_mode")}
    if cut["max_length"] is None or not train_rows:
        return
    lengths = []
    for index in train_rows:
        try:  # rendered as it is sampled: the one renderer, with the run's and the row's template kwargs
            ids = render_prompts(tokenizer, [rows[index]["prompt"]],
                                 template_kwargs_of(rows[index], training.get("chat_template_kwargs")))[0]
        except ValueError as error:
            raise RoundsError(f"row {index}: {(str(error).strip().splitlines() or ['?'])[0]}") from None
        if truncate_pair({"prompt_ids": ids, "chosen_ids": [0], "rejected_ids": [0]}, **cut)["chosen_ids"]:
            return  # one prompt leaves room: the pass has a pair to train on
        lengths.append(len(ids))
    raise RoundsError(f"every training prompt fills max_length={cut['max_length']} (the shortest has {min(lengths)} "
                      "tokens): a round's DPO pass would drop every pair; raise max_length")


def rendered_prompts(tokenizer: Any, rows: list[dict[str, Any]], chat_template_kwargs: dict[str, Any] | None,
                     hidden: bool = True) -> list[list[int]]:
    """Each row's prompt ids, by the renderer the DPO pass tokenizes with (its tools and template kwargs too); a
    labelled bar unless `hidden` (thousands of prompts take minutes on busy cores)."""
    rendered = []
    with phase_bar("rendering the prompts", len(rows), "prompt", hidden) as bar:
        for index, row in enumerate(rows):
            try:
                rendered += render_prompts(tokenizer, [row["prompt"]], template_kwargs_of(row, chat_template_kwargs))
            except ValueError as error:
                raise RoundsError(f"row {index}: {error}") from None
            bar.update()
    return rendered
