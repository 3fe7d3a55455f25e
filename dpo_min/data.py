"""Preference data: load files, `datasets` names and mixtures, bring each to (prompt, chosen, rejected), tokenize.

Data flows one way: source rows -> the dataset's layout (`layouts.py`, detected once from its columns) ->
validated prompt/chosen/rejected -> `tokenize_dataset` (prompt_ids/chosen_ids/rejected_ids). Both steps are
batched `datasets.map` calls: parallel with `num_proc`, and cached by the datasets fingerprint, so a second
identical run reads the cache. Every bad row raises a ValueError naming its row in the source (and its dataset,
in a mixture) and the field.
"""

import gzip
import json
import logging
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import pyarrow.compute as pc
from datasets import Dataset, IterableDataset, concatenate_datasets, load_dataset

from .layouts import (
    CARRIED_COLUMNS,
    Layout,
    LayoutOptions,
    check_mapping,
    detect_layout,
    feature_kind,
    layout_by_name,
    rename_columns,
    to_pair,
    value_kind,
)

logger = logging.getLogger(__name__)

_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
PAIR_COLUMNS = ("prompt", "chosen", "rejected")
TOKEN_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
REFERENCE_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
SOURCE_ROW, SOURCE_DATASET = "source_row", "source_dataset"  # where a pair came from, for error messages
AnyDataset = Dataset | IterableDataset
DEFAULT_OPTIONS = LayoutOptions()


# ---- loading ----------------------------------------------------------------------------------------------------
def load_preference_dataset(path_or_name: str, split: str = "train", *, config: str | None = None,
                            columns: Mapping[str, str] | None = None, streaming: bool = False,
                            num_proc: int | None = None, preference_label: str = "better_response_id",
                            no_prompt: bool = False, as_messages: bool = False, **load_kwargs: Any) -> AnyDataset:
    """Load preference pairs from a JSON/JSONL/Parquet/CSV file (optionally .gz) or a `datasets` name.

    Returns a `Dataset` (an `IterableDataset` with `streaming`) with columns `prompt`, `chosen`, `rejected`
    (strings, or message lists), `source_row` (the row's index in the source split), and `tools` /
    `chat_template_kwargs` where the source has them. The layout is detected from the columns (see
    `layouts.LAYOUTS`); `columns` maps our names (prompt, chosen, rejected, system) to the source's.
    """
    options = LayoutOptions(preference_label=preference_label, no_prompt=no_prompt, as_messages=as_messages)
    raw = _load_raw(path_or_name, split, config, streaming, load_kwargs)
    try:
        return to_preference_dataset(raw, columns=columns, options=options, num_proc=num_proc,
                                     source=os.path.basename(path_or_name))
    except ValueError as error:
        raise ValueError(f"{path_or_name}: {error}") from error


def _load_raw(path_or_name: str, split: str, config: str | None, streaming: bool,
              load_kwargs: dict[str, Any]) -> AnyDataset:
    if not os.path.exists(path_or_name):
        return load_dataset(path_or_name, config, split=split, streaming=streaming, **load_kwargs)
    stem = path_or_name[:-3] if path_or_name.endswith(".gz") else path_or_name
    builder = _FILE_BUILDERS.get(os.path.splitext(stem)[1].lower())
    if builder is None:
        raise ValueError(f"{path_or_name}: unknown file type; use .json, .jsonl, .parquet or .csv (optionally .gz)")
    try:
        dataset = load_dataset(builder, data_files={"train": path_or_name}, split="train", streaming=streaming,
                               **load_kwargs)
    except Exception as error:  # datasets wraps parse errors in several exception types
        raise ValueError(f"{path_or_name}: {_why_unreadable(path_or_name, builder, error)}") from error
    if not streaming and len(dataset) == 0:
        raise ValueError(f"{path_or_name}: the file holds no rows")
    return _columns_object(dataset, path_or_name) if builder == "json" and not streaming else dataset


def _columns_object(dataset: Dataset, path: str) -> Dataset:
    """A JSON object of equal-length lists ({"prompt": [...], "chosen": [...], ...}, as `Dataset.to_dict()` writes)
    is columns, not one row of lists as pyarrow reads it. A real one-row file differs: its values are texts or
    message lists (lists of objects), never lists of texts or of message lists."""
    if len(dataset) != 1:
        return dataset
    row = dataset[0]
    values = list(row.values())
    if not all(isinstance(value, list) for value in values) or any(
            value and all(isinstance(item, dict) for item in value) for value in values):
        return dataset
    lengths = {name: len(value) for name, value in row.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"{path}: a JSON object of columns must hold lists of one length, got {lengths}")
    return Dataset.from_dict(row)


def _why_unreadable(path: str, builder: str, error: Exception) -> str:
    """A reason that names the row: datasets says 'Expected bytes, got a list' for mixed layouts, '' for empty."""
    if builder == "json":
        try:
            with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as file:
                text = file.read()
        except (OSError, EOFError, UnicodeDecodeError):
            text = None
        if text is not None and not text.strip():
            return "the file is empty"
        if text is not None:
            found = _first_mixed_row(text)
            if found:
                return found
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"could not be read as {builder}: {reason}"


def _first_mixed_row(text: str) -> str | None:
    try:
        rows = json.loads(text) if text.lstrip().startswith("[") else [json.loads(line) for line in
                                                                         text.splitlines() if line.strip()]
    except json.JSONDecodeError:
        return None
    if not rows or not all(isinstance(row, dict) for row in rows):
        return None
    first = {name: value_kind(value) for name, value in rows[0].items()}
    for index, row in enumerate(rows[1:], start=1):
        for name, value in row.items():
            kind, expected = value_kind(value), first.get(name)
            if kind != "null" and expected not in (None, "null", kind):
                return (f"row {index}: field '{name}' is {_KIND_WORDS[kind]} but row 0's is {_KIND_WORDS[expected]}; "
                        "standard (string) and conversational (message list) rows cannot be mixed in one file")
    return None


_KIND_WORDS = {"text": "a string", "messages": "a message list", "turn": "an object", "other": "a number or "
               "boolean", "null": "null"}


def load_mixture(entries: list[Mapping[str, Any]], seed: int = 42, num_proc: int | None = None,
                 **options: Any) -> Dataset:
    """Several preference datasets as one, shuffled with `seed`. Each entry: `dataset` (a name or file), and
    optionally `config`, `split`, `columns`, and either `fraction` (of its rows) or `weight` (its share of the
    mixture, relative to the other entries' weights; all entries or none have one). Rows are taken after a seeded
    shuffle, and never repeated: weighted, the mixture is the largest one in those shares."""
    known = {"dataset", "config", "split", "columns", "fraction", "weight"}
    weighted = [isinstance(entry, Mapping) and "weight" in entry for entry in entries]
    if any(weighted) and not all(weighted):
        raise ValueError(f"datasets[{weighted.index(not weighted[0])}]: give every entry a weight, or none")
    parts = []
    for position, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or "dataset" not in entry or set(entry) - known:
            raise ValueError(f"datasets[{position}]: an entry needs 'dataset' and may have "
                             f"{sorted(known - {'dataset'})}, got {entry!r}")
        name = entry["dataset"]
        fraction, weight = entry.get("fraction", 1.0), entry.get("weight")
        if not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"datasets[{position}] ({name}): fraction must be in (0, 1], got {fraction!r}")
        if weight is not None and (not isinstance(weight, (int, float)) or isinstance(weight, bool) or weight <= 0
                                   or "fraction" in entry):
            raise ValueError(f"datasets[{position}] ({name}): weight must be a number > 0, without fraction, "
                             f"got {entry!r}")
        try:
            part = load_preference_dataset(name, entry.get("split", "train"), config=entry.get("config"),
                                           columns=entry.get("columns"), num_proc=num_proc, **options)
        except ValueError as error:
            raise ValueError(f"{name}: {error}" if name not in str(error) else str(error)) from None
        if fraction < 1:
            part = part.shuffle(seed=seed).select(range(max(1, round(len(part) * fraction))))
        parts.append(part.add_column(SOURCE_DATASET, [name] * len(part)))
    if all(weighted) and parts:
        weights = [entry["weight"] for entry in entries]
        shares = [weight / sum(weights) for weight in weights]
        total = min(len(part) / share for part, share in zip(parts, shares))  # the entry that runs out first
        parts = [part.shuffle(seed=seed).select(range(max(1, math.floor(total * share + 1e-9))))
                 for part, share in zip(parts, shares)]
    if not parts:
        raise ValueError("datasets: the mixture lists no dataset")
    logger.info("mixture: %s", ", ".join(f"{entry['dataset']} {len(part)} rows" for entry, part in zip(entries, parts)))
    kinds = {entry["dataset"]: feature_kind(part.features["prompt"]) for entry, part in zip(entries, parts)}
    if len(set(kinds.values())) > 1:
        raise ValueError(f"a mixture cannot mix string and message-list prompts: {kinds}; use as_messages")
    try:
        return concatenate_datasets(parts).shuffle(seed=seed)
    except ValueError as error:  # columns that differ (tools in one dataset only)
        raise ValueError(f"the datasets of the mixture do not have the same columns: {error}") from None


# ---- layouts -> pairs -------------------------------------------------------------------------------------------
def to_preference_rows(rows: Iterable[Mapping[str, Any]], columns: Mapping[str, str] | None = None,
                       options: LayoutOptions = DEFAULT_OPTIONS) -> list[dict[str, Any]]:
    """Bring each row to {prompt, chosen, rejected}, validating it. Raises ValueError naming row and field."""
    rows = list(rows)
    if not rows:
        return []
    if columns:
        check_mapping(columns, list(rows[0]))
        rows = [rename_columns(row, columns) for row in rows]
    layout = _detect(rows[0] if isinstance(rows[0], Mapping) else {}, None)
    pairs, first_conversational = [], None
    for index, row in enumerate(rows):
        pair = to_pair(layout, row, index, options)
        if pair is None:
            continue
        first_conversational = _check_kind(pair, index, first_conversational)
        pairs.append(pair)
    return pairs


def _check_kind(pair: Mapping[str, Any], index: int | str, first_conversational: bool | None) -> bool:
    """Standard and conversational pairs cannot share a dataset: TRL would treat all rows as the first row's kind."""
    conversational = isinstance(pair["prompt"], list)
    if first_conversational is not None and conversational != first_conversational:
        raise ValueError(f"row {index}: field 'prompt' is {_KIND_WORDS['messages' if conversational else 'text']} "
                         f"but row 0's is {_KIND_WORDS['text' if conversational else 'messages']}; standard (string) "
                         "and conversational (message list) rows cannot be mixed")
    return conversational


def _detect(first_row: Mapping[str, Any], features: Any, source: str = "") -> Layout:
    kinds = ({name: feature_kind(feature) for name, feature in features.items()} if features
             else {name: value_kind(value) for name, value in first_row.items()})
    layout = detect_layout(kinds, first_row)
    logger.info("%slayout %s (as %s), from columns [%s]", f"{source}: " if source else "", layout.name,
                layout.example, ", ".join(kinds))
    return layout


def _row_label(batch: Mapping[str, list], position: int, index: int) -> int | str:
    row = batch[SOURCE_ROW][position] if SOURCE_ROW in batch else index
    return f"{row} of {batch[SOURCE_DATASET][position]}" if SOURCE_DATASET in batch else row


def _rows(batch: Mapping[str, list]) -> Iterable[dict[str, Any]]:
    names = list(batch)
    return (dict(zip(names, values)) for values in zip(*batch.values()))


def _convert_batch(batch: dict[str, list], indices: list[int], layout_name: str, options: LayoutOptions,
                   columns: Mapping[str, str] | None, conversational: bool | None) -> dict[str, list]:
    layout = layout_by_name(layout_name)
    carried = [name for name in CARRIED_COLUMNS if name in batch]
    out: dict[str, list] = {name: [] for name in (*PAIR_COLUMNS, SOURCE_ROW, *carried)}
    for position, (row, index) in enumerate(zip(_rows(batch), indices)):
        label = _row_label(batch, position, index)
        pair = to_pair(layout, rename_columns(row, columns) if columns else row, label, options)
        if pair is None:
            continue
        _check_kind(pair, label, conversational)
        for name in PAIR_COLUMNS:
            out[name].append(pair[name])
        out[SOURCE_ROW].append(row.get(SOURCE_ROW, index))
        for name in carried:
            out[name].append(row[name])
    return out


def to_preference_dataset(dataset: AnyDataset, columns: Mapping[str, str] | None = None,
                          options: LayoutOptions = DEFAULT_OPTIONS, num_proc: int | None = None,
                          source: str = "") -> AnyDataset:
    """A loaded dataset in any known layout -> prompt/chosen/rejected/source_row columns (a cached `map`)."""
    first_row = _first_row(dataset)
    if columns:
        check_mapping(columns, list(first_row))
        first_row = rename_columns(first_row, columns)
    features = None if columns else dataset.features
    layout = _detect(first_row, features, source)
    first_pair = to_pair(layout, first_row, 0, options)  # None for a first row the layout skips (a tie)
    conversational = None if first_pair is None else isinstance(first_pair["prompt"], list)
    names = dataset.column_names if dataset.column_names is not None else list(_first_row(dataset))
    map_kwargs: dict[str, Any] = {"batched": True, "with_indices": True, "remove_columns": names, "fn_kwargs": {
        "layout_name": layout.name, "options": options, "columns": dict(columns) if columns else None,
        "conversational": conversational}}
    if isinstance(dataset, Dataset):
        map_kwargs.update(num_proc=num_proc, desc=f"Reading {layout.name} pairs")
    converted = dataset.map(_convert_batch, **map_kwargs)
    if isinstance(dataset, Dataset) and len(converted) < len(dataset):
        logger.warning("%s: dropped %d of %d rows that the %s layout skips (ties)", source or "data",
                       len(dataset) - len(converted), len(dataset), layout.name)
    return converted


def _first_row(dataset: Any) -> dict[str, Any]:
    if isinstance(dataset, Dataset):
        if len(dataset) == 0:
            raise ValueError("the dataset holds no rows")
        return dataset[0]
    try:
        return dict(next(iter(dataset)))
    except StopIteration:
        raise ValueError("the dataset holds no rows") from None


# ---- tokenization -----------------------------------------------------------------------------------------------
def tokenize_row(row: Mapping[str, Any], tokenizer: Any,
                 chat_template_kwargs: Mapping[str, Any] | None = None) -> dict[str, list[int]]:
    """Token ids of one validated pair, the same as TRL's `DPOTrainer` gives.

    The prompt is tokenized once; a completion's ids are those of prompt+completion after the prompt, with the EOS
    text appended to plain-string completions (a chat template closes its own turns). Where prompt and
    prompt+completion tokenize differently at the seam, the completion starts where they diverge. A row's `tools`
    (a list, or JSON text) and `chat_template_kwargs` go to the chat template, after the run's own kwargs.
    """
    return _tokenize_pairs([row], tokenizer, chat_template_kwargs)[0]


def _tokenize_pairs(pairs: list[Mapping[str, Any]], tokenizer: Any,
                    chat_template_kwargs: Mapping[str, Any] | None) -> list[dict[str, list[int]]]:
    """`tokenize_row` for pairs of one kind and one set of template arguments, in one tokenizer call per sequence
    kind: the fast tokenizer encodes a batch far faster than one text at a time, to the same ids."""
    if isinstance(pairs[0]["prompt"], list):
        if tokenizer.chat_template is None:
            raise ValueError("conversational data needs a tokenizer with a chat template; set "
                             "tokenizer.chat_template or pass plain-string prompts")
        tools = pairs[0].get("tools")
        template_kwargs = {"tools": json.loads(tools) if isinstance(tools, str) else tools,
                           **(chat_template_kwargs or {}), **(pairs[0].get("chat_template_kwargs") or {})}

        def encode(conversations, field, **kwargs):
            try:
                ids = tokenizer.apply_chat_template(conversations, tokenize=True, return_dict=True,
                                                    **template_kwargs, **kwargs)["input_ids"]
            except Exception as error:  # templates raise their own errors (e.g. "roles must alternate")
                raise ValueError(f"field '{field}': the chat template refused it: {error}") from error
            return [list(one) for one in ids]
        prompt_ids = encode([pair["prompt"] for pair in pairs], "prompt", add_generation_prompt=True)
        prompt_chosen_ids = encode([pair["prompt"] + pair["chosen"] for pair in pairs], "chosen")
        prompt_rejected_ids = encode([pair["prompt"] + pair["rejected"] for pair in pairs], "rejected")
    else:
        eos = tokenizer.eos_token

        def with_eos(text: str) -> str:
            return text if text.endswith(eos) else text + eos
        prompt_ids = tokenizer(text=[pair["prompt"] for pair in pairs])["input_ids"]
        prompt_chosen_ids = tokenizer(text=[pair["prompt"] + with_eos(pair["chosen"]) for pair in pairs])["input_ids"]
        prompt_rejected_ids = tokenizer(text=[pair["prompt"] + with_eos(pair["rejected"])
                                              for pair in pairs])["input_ids"]
    examples = []
    for prompt, chosen, rejected in zip(prompt_ids, prompt_chosen_ids, prompt_rejected_ids):
        prompt_len = min(_common_prefix_length(prompt, chosen), _common_prefix_length(prompt, rejected))
        examples.append({"prompt_ids": prompt[:prompt_len], "chosen_ids": chosen[prompt_len:],
                         "rejected_ids": rejected[prompt_len:]})
    return examples


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


def _tokenize_batch(batch: dict[str, list], indices: list[int], layout_name: str, tokenizer: Any,
                    truncation: dict[str, Any], chat_template_kwargs: dict[str, Any] | None) -> dict[str, list]:
    layout = layout_by_name(layout_name)
    pairs, labels, conversational = [], [], None
    for position, (row, index) in enumerate(zip(_rows(batch), indices)):
        labels.append(_row_label(batch, position, index))
        pairs.append(to_pair(layout, row, labels[-1], DEFAULT_OPTIONS))
        conversational = _check_kind(pairs[-1], labels[-1], conversational)
    # Rows with their own tools or template arguments are tokenized alone; the rest together.
    alone = {i for i, pair in enumerate(pairs) if any(pair.get(name) is not None for name in CARRIED_COLUMNS)}
    together = [i for i in range(len(pairs)) if i not in alone]
    tokenized: list[Any] = [None] * len(pairs)
    for group in [together] * bool(together) + [[i] for i in sorted(alone)]:
        try:
            examples = _tokenize_pairs([pairs[i] for i in group], tokenizer, chat_template_kwargs)
        except ValueError:  # tokenize row by row to name the row that fails
            examples = [_tokenize_one(pairs[i], labels[i], tokenizer, chat_template_kwargs) for i in group]
        for i, example in zip(group, examples):
            tokenized[i] = example
    out: dict[str, list] = {name: [] for name in (*TOKEN_COLUMNS, SOURCE_ROW)}
    for example, label in zip(tokenized, labels):
        for name, ids in truncate_pair(example, **truncation).items():
            out[name].append(ids)
        out[SOURCE_ROW].append(label)
    return out


def _tokenize_one(pair: Mapping[str, Any], label: int | str, tokenizer: Any,
                  chat_template_kwargs: Mapping[str, Any] | None) -> dict[str, list[int]]:
    try:
        return tokenize_row(pair, tokenizer, chat_template_kwargs)
    except ValueError as error:
        raise ValueError(f"row {label}: {error}") from error


def tokenize_dataset(dataset: AnyDataset | Iterable[Mapping[str, Any]], tokenizer: Any,
                     max_length: int | None = None, max_prompt_length: int | None = None,
                     truncation_mode: str = "keep_end", num_proc: int | None = None,
                     chat_template_kwargs: Mapping[str, Any] | None = None) -> AnyDataset:
    """Validate, tokenize and truncate every row (a batched, cached `datasets.map`, `num_proc` processes); pairs
    left without a completion token are dropped with a warning naming their source rows.

    Extra columns that hold precomputed reference log-probs are carried along. An `IterableDataset` is tokenized
    on the fly.
    """
    if not isinstance(dataset, (Dataset, IterableDataset)):
        dataset = Dataset.from_list(to_preference_rows(dataset))
    first_row = _first_row(dataset)
    layout = _detect(first_row, dataset.features)
    streaming = isinstance(dataset, IterableDataset)
    names = dataset.column_names if dataset.column_names is not None else list(first_row)
    map_kwargs: dict[str, Any] = {
        "batched": True, "with_indices": True,
        "remove_columns": [name for name in names if name not in REFERENCE_COLUMNS],
        "fn_kwargs": {"layout_name": layout.name, "tokenizer": tokenizer, "chat_template_kwargs": (
            dict(chat_template_kwargs) if chat_template_kwargs else None), "truncation": {
            "max_length": max_length, "max_prompt_length": max_prompt_length, "truncation_mode": truncation_mode}}}
    if not streaming:
        map_kwargs.update(num_proc=num_proc, desc="Tokenizing pairs")
    tokenized = dataset.map(_tokenize_batch, **map_kwargs)
    if streaming:
        return tokenized.filter(_has_completions, input_columns=["chosen_ids", "rejected_ids"], batched=True)\
            .remove_columns([SOURCE_ROW])
    kept = _completion_mask(tokenized)
    if not kept.all():
        dropped = np.flatnonzero(~kept)
        rows = [str(row) for row in tokenized.select(dropped[:10])[SOURCE_ROW]]
        logger.warning("dropped %d of %d pairs with no completion token left after truncation "
                       "(max_length=%s, max_prompt_length=%s); first source rows: %s", len(dropped), len(kept),
                       max_length, max_prompt_length, ", ".join(rows))
        if len(dropped) == len(kept):
            raise ValueError(f"no pair left: every row's prompt fills max_length={max_length} "
                             f"(rows {', '.join(rows)})")
        tokenized = tokenized.select(np.flatnonzero(kept))
    return tokenized.remove_columns([SOURCE_ROW])


def _has_completions(chosen_ids: list[list[int]], rejected_ids: list[list[int]]) -> list[bool]:
    return [bool(chosen) and bool(rejected) for chosen, rejected in zip(chosen_ids, rejected_ids)]


def _completion_mask(dataset: Dataset) -> np.ndarray:
    table = dataset.with_format("arrow")[:] if dataset._indices is not None else dataset.data.table
    lengths = [np.asarray(pc.list_value_length(table.column(name))) for name in ("chosen_ids", "rejected_ids")]
    return (lengths[0] > 0) & (lengths[1] > 0)


def is_tokenized(dataset: Any) -> bool:
    return isinstance(dataset, (Dataset, IterableDataset)) and dataset.column_names is not None and \
        set(TOKEN_COLUMNS) <= set(dataset.column_names)
