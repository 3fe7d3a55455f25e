"""Validated pairs -> the token ids the collator batches (`collator.TOKEN_COLUMNS`), the same as TRL's `DPOTrainer`
gives, truncated; a pair left unusable by truncation is dropped with a warning naming its source rows (a stream
counts it as it is read). Tokenizing is a batched `datasets.map`: parallel with `num_proc`, and cached by the
datasets fingerprint, so a second identical run reads the cache. The trainer tokenizes through this module alone.
"""

import json
import logging
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import numpy as np
from datasets import Dataset, IterableDataset

from .collator import REFERENCE_COLUMNS, TOKEN_COLUMNS
from .data import given_ids
from .data.given_ids import (  # noqa: F401 - the rounds record them, and end and check samples by them
    GIVEN_IDS,
    MADE_BY,
    end_token_ids,
    made_by,
    special_ids,
    special_inside,
    template_fingerprint,
    tokenizer_fingerprint,
)
from .data.layouts import CARRIED_COLUMNS, layout_by_name
from .data.pairs import (
    DEFAULT_OPTIONS,
    PAIR_COLUMNS,
    SOURCE_ROW,
    batch_rows,
    column_names,
    pair_or_reason,
    row_label,
    to_pairs,
    to_preference_dataset,
)
from .data.sources import AnyDataset
from .data.streams import DROP_REASONS, NO_COMPLETION, SAME_COMPLETIONS, StreamCounts, carrying, counts_for
from .data.unpaired import NO_ANSWER  # noqa: F401 - drop_reason returns it: its callers name it from here
from .data.validation import validate_text, validate_turns

logger = logging.getLogger("dpo_min.data")  # the data folder's logger: the command shows its lines

# What a pair with given ids carries beside its text for their check: the rounds write these to pairs.jsonl.
GIVEN_COLUMNS = (*GIVEN_IDS, *MADE_BY, *CARRIED_COLUMNS)
DROPPED = "dropped_because"  # a pair's reason in DROP_REASONS ('' for a kept pair), between tokenizing and dropping
# A column that tokenizing carries through, as it carries precomputed reference log-probs: a caller that numbers its
# rows in it finds the row each kept pair came from (`trainer_setup.kept_rows`).
ROW_POSITION = "_dpo_min_row_position"
CARRIED_THROUGH = (*REFERENCE_COLUMNS, ROW_POSITION)
# The datasets cache keys a map by its function's own code and arguments, not by the helpers it calls: a change
# to what tokenizing writes (the drop reasons became names, not 0/1/2) must change this, or a cached map of
# the old form is read back.
# 3: a pair's given ids (GIVEN_IDS) are trained as given; 4: once checked (given_ids.py); 5: special ids only closing
TOKENIZED_VERSION = 5


def tokenize_row(row: Mapping[str, Any], tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None = None,
                 end_ids: Collection[int] | None = None) -> dict[str, list[int]]:
    """Token ids of one validated pair, the same as TRL's `DPOTrainer` gives.

    The prompt is tokenized once; a completion's ids are those of prompt+completion after the prompt, with the EOS
    text appended to plain-string completions (a chat template closes its own turns). Where prompt and
    prompt+completion tokenize differently at the seam, the completion starts where they diverge. A row's `tools`
    (a list, or JSON text) and `chat_template_kwargs` go to the chat template, after the run's own kwargs. A row
    that carries its ids (`prompt_ids`, `chosen_ids`, `rejected_ids`: a round's samples) is trained on those ids,
    once they are checked to be its text's and this run's (`data/given_ids.py`): a completion's ids hold a special
    token only as their last, one of `end_ids` (the ids a sample stops on; None: the tokenizer's EOS).
    """
    if all(row.get(name) is not None for name in GIVEN_IDS):
        return _given_ids(row, tokenizer, chat_template_kwargs, end_ids)
    return _tokenize_pairs([row], tokenizer, chat_template_kwargs)[0]


def template_kwargs_of(row: Mapping[str, Any], chat_template_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """The chat template's keyword arguments for one row, as TRL passes them: the row's `tools` (a list, or JSON
    text), the run's `chat_template_kwargs`, then the row's own `chat_template_kwargs`."""
    tools = row.get("tools")
    return {"tools": json.loads(tools) if isinstance(tools, str) else tools, **(chat_template_kwargs or {}),
            **(row.get("chat_template_kwargs") or {})}


def render_prompts(tokenizer: Any, prompts: list[Any], template_kwargs: Mapping[str, Any]) -> list[list[int]]:
    """The prompt ids a policy is given: messages through the chat template with the generation prompt, a text as
    the tokenizer encodes it. The one renderer of prompts: the DPO pass tokenizes with it, DPO in rounds samples
    from its ids and trains on them, and the command's greedy samples start from them."""
    if isinstance(prompts[0], list):
        return _apply_template(tokenizer, prompts, "prompt", template_kwargs, add_generation_prompt=True)
    return [list(ids) for ids in tokenizer(text=prompts)["input_ids"]]


def _apply_template(tokenizer: Any, conversations: list[Any], field: str, template_kwargs: Mapping[str, Any],
                    **kwargs: Any) -> list[list[int]]:
    if tokenizer.chat_template is None:
        raise ValueError("conversational data needs a tokenizer with a chat template; set "
                         "tokenizer.chat_template or pass plain-string prompts")
    try:
        ids = tokenizer.apply_chat_template(conversations, tokenize=True, return_dict=True, **template_kwargs,
                                            **kwargs)["input_ids"]
    except Exception as error:  # templates raise their own errors (e.g. "roles must alternate")
        raise ValueError(f"field '{field}': the chat template refused it: {error}") from error
    return [list(one) for one in ids]


def _tokenize_pairs(pairs: list[Mapping[str, Any]], tokenizer: Any,
                    chat_template_kwargs: Mapping[str, Any] | None) -> list[dict[str, list[int]]]:
    """`tokenize_row` for pairs of one kind and one set of template arguments, in one tokenizer call per sequence
    kind: the fast tokenizer encodes a batch far faster than one text at a time, to the same ids."""
    template_kwargs = template_kwargs_of(pairs[0], chat_template_kwargs)
    prompt_ids = render_prompts(tokenizer, [pair["prompt"] for pair in pairs], template_kwargs)
    if isinstance(pairs[0]["prompt"], list):
        prompt_chosen_ids = _apply_template(tokenizer, [pair["prompt"] + pair["chosen"] for pair in pairs],
                                            "chosen", template_kwargs)
        prompt_rejected_ids = _apply_template(tokenizer, [pair["prompt"] + pair["rejected"] for pair in pairs],
                                              "rejected", template_kwargs)
    else:
        eos = tokenizer.eos_token

        def with_eos(text: str) -> str:
            return text if text.endswith(eos) else text + eos
        prompt_chosen_ids = tokenizer(text=[pair["prompt"] + with_eos(pair["chosen"]) for pair in pairs])["input_ids"]
        prompt_rejected_ids = tokenizer(text=[pair["prompt"] + with_eos(pair["rejected"])
                                              for pair in pairs])["input_ids"]
    examples = []
    for prompt, chosen, rejected in zip(prompt_ids, prompt_chosen_ids, prompt_rejected_ids):
        prompt_len = min(_common_prefix_length(prompt, chosen), _common_prefix_length(prompt, rejected))
        examples.append({"prompt_ids": prompt[:prompt_len], "chosen_ids": chosen[prompt_len:],
                         "rejected_ids": rejected[prompt_len:]})
    return examples


def _given_ids(pair: Mapping[str, Any], tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None,
               end_ids: Collection[int] | None) -> dict[str, list[int]]:
    """A pair's own ids, checked: what the policy was given and sampled, so no EOS is added where it emitted none;
    made by this run's tokenizer and template where the pair records them, and its text's (`given_ids.py`)."""
    given_ids.check_made_by(pair, tokenizer)  # first: ids of another tokenizer fail the checks below for that
    vocabulary = len(tokenizer)
    example = {}
    for name in GIVEN_IDS:
        example[name] = _token_ids(pair[name], name, vocabulary)
    rendered = render_prompts(tokenizer, [pair["prompt"]], template_kwargs_of(pair, chat_template_kwargs))[0]
    given_ids.check_text(pair, example, rendered, tokenizer, end_ids)
    return example


def _token_ids(ids: Any, name: str, vocabulary: int) -> list[int]:
    """A given ids field as token ids. A loader gives a column one type: one row's float (1.5) makes every row's ids
    floats (657.0), so whole numbers are read back as the ids they were, and the row with the fraction is the one
    refused. The refusal shows what the row holds: a CSV cell is text, shown as text."""
    if isinstance(ids, (list, tuple)):
        ids = [int(i) if isinstance(i, float) and i.is_integer() else i for i in ids]
    if isinstance(ids, list) and ids and \
            all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocabulary for i in ids):
        return ids
    shown = f"the text {ids[:80]!r} (a CSV cell is text: give ids in JSON lines or Parquet)" \
        if isinstance(ids, str) else str(ids)[:80]
    raise ValueError(f"field '{name}': expected a non-empty list of token ids in [0, {vocabulary}), got {shown}")


def check_prompt(prompt: str | list, index: int) -> None:
    """A prompt by the rules its pairs are validated with (data/validation.py), before any answer exists: DPO in rounds
    checks its prompts so before it samples them. Raises ValueError("row N: field 'prompt' ...")."""
    if isinstance(prompt, list):
        validate_turns(prompt, index, "prompt")
    else:
        validate_text(prompt, index, "prompt")


def _common_prefix_length(ids: list[int], other_ids: list[int]) -> int:
    length = 0
    for token, other in zip(ids, other_ids):
        if token != other:
            break
        length += 1
    return length


def truncate_pair(example: dict[str, list[int]], max_length: int | None, max_prompt_length: int | None,
                  truncation_mode: str = "keep_end") -> dict[str, list[int]]:
    """Cut the prompt to `max_prompt_length` (keeping its end or start), then completions so each sequence fits
    `max_length`. A completion may come out empty: the caller drops such pairs."""
    prompt_ids = example["prompt_ids"]
    if max_prompt_length is not None and len(prompt_ids) > max_prompt_length:
        keep_end = truncation_mode == "keep_end"
        prompt_ids = prompt_ids[-max_prompt_length:] if keep_end else prompt_ids[:max_prompt_length]
    room = None if max_length is None else max(max_length - len(prompt_ids), 0)
    return {"prompt_ids": prompt_ids, "chosen_ids": example["chosen_ids"][:room],
            "rejected_ids": example["rejected_ids"][:room]}


def _tokenize_batch(batch: dict[str, list], indices: list[int], tokenizer: Any, truncation: dict[str, Any],
                    chat_template_kwargs: dict[str, Any] | None, output_version: int,
                    end_ids: list[int] | None = None) -> dict[str, list]:
    """Validated pairs -> truncated token ids, and why a pair is unusable (`DROP_REASONS`; '': it is usable).

    `output_version` is not read: it is TOKENIZED_VERSION, passed so that the datasets cache key changes with it."""
    pairs = list(batch_rows(batch))
    labels = [row_label(batch, position, index) for position, index in enumerate(indices)]
    # Rows with their own ids, tools or template arguments are tokenized alone; the rest together.
    alone = {i for i, pair in enumerate(pairs)
             if any(pair.get(name) is not None for name in (*CARRIED_COLUMNS, *GIVEN_IDS))}
    together = [i for i in range(len(pairs)) if i not in alone]
    tokenized: list[Any] = [None] * len(pairs)
    for group in [together] * bool(together) + [[i] for i in sorted(alone)]:
        try:
            examples = _tokenize_pairs([pairs[i] for i in group], tokenizer, chat_template_kwargs) \
                if len(group) > 1 else [tokenize_row(pairs[group[0]], tokenizer, chat_template_kwargs, end_ids)]
        except ValueError:  # tokenize row by row to name the row that fails
            examples = [_tokenize_one(pairs[i], labels[i], tokenizer, chat_template_kwargs, end_ids) for i in group]
        for i, example in zip(group, examples):
            tokenized[i] = example
    out: dict[str, list] = {name: [] for name in (*TOKEN_COLUMNS, SOURCE_ROW, DROPPED)}
    for example, label in zip(tokenized, labels):
        cut = truncate_pair(example, **truncation)
        for name, ids in cut.items():
            out[name].append(ids)
        out[SOURCE_ROW].append(label)
        out[DROPPED].append(_drop_reason(cut) or "")  # a string column: '' rather than None, so shards concatenate
    return out


def drop_reason(row: Mapping[str, Any], tokenizer: Any, max_length: int | None = None,
                max_prompt_length: int | None = None, truncation_mode: str = "keep_end",
                chat_template_kwargs: Mapping[str, Any] | None = None,
                end_ids: Collection[int] | None = None) -> str | None:
    """Why `tokenize_dataset` with these settings drops this prompt/chosen/rejected row (an UNPAIRED reason, such
    as NO_ANSWER, or one of DROP_REASONS), or None: the same reading and truncation, for a caller that counts its
    drops before training (DPO in rounds). A malformed row raises, as it does there."""
    pair = pair_or_reason(layout_by_name("explicit_prompt"), row, 0, DEFAULT_OPTIONS, strict_pairs=False)
    if isinstance(pair, tuple):
        return pair[0]
    return _drop_reason(truncate_pair(tokenize_row(pair, tokenizer, chat_template_kwargs, end_ids), max_length,
                                      max_prompt_length, truncation_mode))


def _drop_reason(example: Mapping[str, list[int]]) -> str | None:
    """Why a truncated pair cannot be trained on (one of DROP_REASONS), or None."""
    if not example["chosen_ids"] or not example["rejected_ids"]:
        return NO_COMPLETION
    # Both answers cut inside their shared opening: the same sequence twice, a loss of ln 2 and no gradient.
    return SAME_COMPLETIONS if example["chosen_ids"] == example["rejected_ids"] else None


def _tokenize_one(pair: Mapping[str, Any], label: int | str, tokenizer: Any,
                  chat_template_kwargs: Mapping[str, Any] | None,
                  end_ids: Collection[int] | None) -> dict[str, list[int]]:
    try:
        return tokenize_row(pair, tokenizer, chat_template_kwargs, end_ids)
    except ValueError as error:
        raise ValueError(f"row {label}: {error}") from error


def tokenize_dataset(dataset: AnyDataset | Iterable[Mapping[str, Any]], tokenizer: Any,
                     max_length: int | None = None, max_prompt_length: int | None = None,
                     truncation_mode: str = "keep_end", num_proc: int | None = None,
                     chat_template_kwargs: Mapping[str, Any] | None = None,
                     counts: StreamCounts | None = None, end_ids: Collection[int] | None = None) -> AnyDataset:
    """Tokenize and truncate every pair (a batched, cached `datasets.map`, `num_proc` processes); pairs left without
    a completion token, or with chosen identical to rejected, are dropped with a warning naming their source rows.

    Rows that `load_preference_dataset` has not read yet (a list, or a dataset in any layout) are first brought to
    validated pairs by it; its own pairs are not validated again. Extra columns that hold precomputed reference
    log-probs are carried along. An `IterableDataset` is tokenized on the fly, and counts its unusable pairs as
    it is read in `counts` (by default its own, `stream_counts(dataset)`), which the stream it returns carries.
    `end_ids`: the ids a sample stops on, where pairs carry their ids (`tokenize_row`); the trainer passes its
    model's (`end_token_ids`).
    """
    if not isinstance(dataset, (Dataset, IterableDataset)):
        dataset = Dataset.from_list(to_pairs(dataset))
    names = column_names(dataset)
    if not {*PAIR_COLUMNS, SOURCE_ROW} <= set(names):  # not yet read by to_preference_dataset, which marks its rows
        dataset = to_preference_dataset(dataset, num_proc=num_proc, keep=CARRIED_THROUGH, counts=counts)
        names = column_names(dataset)
    streaming = isinstance(dataset, IterableDataset)
    truncation = {"max_length": max_length, "max_prompt_length": max_prompt_length, "truncation_mode": truncation_mode}
    map_kwargs: dict[str, Any] = {
        "batched": True, "with_indices": True,
        "remove_columns": [name for name in names if name not in CARRIED_THROUGH],
        "fn_kwargs": {"tokenizer": tokenizer, "truncation": truncation, "chat_template_kwargs": (
            dict(chat_template_kwargs) if chat_template_kwargs else None), "output_version": TOKENIZED_VERSION,
        "end_ids": None if end_ids is None else sorted(end_ids)}}
    if not streaming:
        map_kwargs.update(num_proc=num_proc, desc="Tokenizing pairs")
    tokenized = dataset.map(_tokenize_batch, **map_kwargs)
    if streaming:
        counts = counts_for(dataset, counts)
        return carrying(tokenized.filter(_count_usable, input_columns=[DROPPED], batched=True,
                                         fn_kwargs={"counts": counts}).remove_columns([SOURCE_ROW, DROPPED]), counts)
    return _drop_unusable(tokenized, truncation, counts).remove_columns([SOURCE_ROW, DROPPED])


def _count_usable(reasons: list[str], counts: StreamCounts) -> list[bool]:
    counts.add(Counter(reason for reason in reasons if reason))
    return [not reason for reason in reasons]


def _drop_unusable(tokenized: Dataset, truncation: Mapping[str, Any], counts: StreamCounts | None = None) -> Dataset:
    table = tokenized.with_format("arrow")[:] if tokenized._indices is not None else tokenized.data.table
    reasons = np.asarray(table.column(DROPPED).to_pylist(), dtype=object)
    kept = reasons == ""
    if counts is not None:
        counts.add(Counter(reason for reason in reasons if reason))
    if kept.all():
        return tokenized
    settings = f"max_length={truncation['max_length']}, max_prompt_length={truncation['max_prompt_length']}"
    rows = {}
    for reason in DROP_REASONS:
        dropped = np.flatnonzero(reasons == reason)
        if len(dropped):
            rows[reason] = [str(row) for row in tokenized.select(dropped[:10])[SOURCE_ROW]]
            logger.warning("dropped %d of %d pairs %s (%s); first source rows: %s", len(dropped), len(reasons),
                           reason, settings, ", ".join(rows[reason]))
    if not kept.any():
        if set(rows) == {NO_COMPLETION}:
            raise ValueError(f"no pair left: every row's prompt fills max_length={truncation['max_length']} "
                             f"(rows {', '.join(rows[NO_COMPLETION])})")
        by_reason = ", ".join(f"{(reasons == reason).sum()} {reason}" for reason in rows)
        raise ValueError(f"no pair left after truncation ({settings}): {by_reason} (rows "
                         f"{', '.join(rows.get(NO_COMPLETION, []) + rows.get(SAME_COMPLETIONS, []))})")
    return tokenized.select(np.flatnonzero(kept))


def is_tokenized(dataset: Any) -> bool:
    """Token ids alone, as `tokenize_dataset` leaves them: taken as prepared. Ids beside the pair's text (a round's
    pairs.jsonl) are pairs whose ids are trained as given, once validated and truncated as any pair."""
    return isinstance(dataset, (Dataset, IterableDataset)) and dataset.column_names is not None and \
        set(TOKEN_COLUMNS) <= set(dataset.column_names) and not set(PAIR_COLUMNS) <= set(dataset.column_names)
