"""Preference data: load a file or a datasets name, bring every layout to (prompt, chosen, rejected), tokenize.

Data flows one way: raw rows -> `to_preference_rows` (validated prompt/chosen/rejected) -> `tokenize_dataset`
(prompt_ids/chosen_ids/rejected_ids). Every bad row raises a ValueError that names its index and field.
"""

import logging
import os
import re
from collections.abc import Iterable
from typing import Any

from datasets import Dataset, load_dataset

logger = logging.getLogger(__name__)

_ROLES = ("system", "user", "assistant", "tool")
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
_HH_TURN = re.compile(r"\n\n(Human|Assistant):")
_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def load_preference_dataset(path_or_name: str, split: str = "train", **load_kwargs: Any) -> Dataset:
    """Load preference pairs from a JSON/JSONL(.gz)/Parquet/CSV file or a `datasets` name.

    Returns a `Dataset` with columns `prompt`, `chosen`, `rejected`: strings (standard) or message lists
    (conversational). Accepted input layouts: standard, conversational, implicit prompt (only chosen/rejected),
    Anthropic HH transcripts, and ShareGPT (`conversations` + chosen/rejected `{"from", "value"}`).
    """
    if os.path.exists(path_or_name):
        stem = path_or_name[:-3] if path_or_name.endswith(".gz") else path_or_name
        builder = _FILE_BUILDERS.get(os.path.splitext(stem)[1].lower())
        if builder is None:
            raise ValueError(f"{path_or_name}: unknown file type; use .json, .jsonl, .parquet or .csv (optionally .gz)")
        try:
            dataset = load_dataset(builder, data_files={split: path_or_name}, split=split, **load_kwargs)
        except Exception as error:  # datasets wraps parse errors in several exception types
            raise ValueError(f"{path_or_name}: could not be read as {builder}: {error}") from error
    else:
        dataset = load_dataset(path_or_name, split=split, **load_kwargs)
    return Dataset.from_list(to_preference_rows(dataset))


def to_preference_rows(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Bring each row to {prompt, chosen, rejected}, validating it. Raises ValueError naming row and field."""
    return [_to_preference_row(row, index) for index, row in enumerate(rows)]


def _to_preference_row(row: dict[str, Any], index: int) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise ValueError(f"row {index}: expected an object with chosen/rejected fields, got {type(row).__name__}")
    for name in ("chosen", "rejected"):
        if row.get(name) is None:
            raise ValueError(f"row {index}: field '{name}' is missing")
    if row.get("conversations") is not None:
        pair = _from_sharegpt(row, index)
    elif row.get("prompt") is not None:
        pair = {"prompt": row["prompt"], "chosen": row["chosen"], "rejected": row["rejected"]}
    elif isinstance(row["chosen"], str) and row["chosen"].startswith("\n\nHuman:"):
        pair = _from_hh(row, index)
    else:
        pair = _extract_prompt(row["chosen"], row["rejected"], index)
    _validate(pair, index)
    return pair


def _from_sharegpt(row: dict[str, Any], index: int) -> dict[str, Any]:
    def message(turn: Any, field: str) -> dict[str, str]:
        if not isinstance(turn, dict) or turn.get("from") not in _SHAREGPT_ROLES:
            raise ValueError(f"row {index}: field '{field}' must be {{'from': human|gpt|system, 'value': str}}")
        return {"role": _SHAREGPT_ROLES[turn["from"]], "content": turn.get("value")}

    if not isinstance(row["conversations"], list):
        raise ValueError(f"row {index}: field 'conversations' must be a list of turns")
    prompt = [message(turn, "conversations") for turn in row["conversations"]]
    return {"prompt": prompt, "chosen": [message(row["chosen"], "chosen")],
            "rejected": [message(row["rejected"], "rejected")]}


def _hh_messages(transcript: str) -> list[dict[str, str]]:
    # re.split with one group gives ["", "Human", " text", "Assistant", " text", ...]
    parts = _HH_TURN.split(transcript)[1:]
    return [{"role": "user" if speaker == "Human" else "assistant", "content": text.strip()}
            for speaker, text in zip(parts[::2], parts[1::2])]


def _from_hh(row: dict[str, Any], index: int) -> dict[str, Any]:
    if not isinstance(row["rejected"], str):
        raise ValueError(f"row {index}: field 'rejected' must be a transcript string like 'chosen'")
    chosen, rejected = _hh_messages(row["chosen"]), _hh_messages(row["rejected"])
    for name, messages in (("chosen", chosen), ("rejected", rejected)):
        if not messages or messages[-1]["role"] != "assistant":
            raise ValueError(f"row {index}: field '{name}' does not end with an '\\n\\nAssistant:' turn")
    if chosen[:-1] != rejected[:-1]:
        raise ValueError(f"row {index}: field 'rejected' differs from 'chosen' before the last Assistant turn")
    return {"prompt": chosen[:-1], "chosen": chosen[-1:], "rejected": rejected[-1:]}


def _extract_prompt(chosen: Any, rejected: Any, index: int) -> dict[str, Any]:
    """The implicit prompt is the longest common prefix of chosen and rejected (as TRL's `extract_prompt`)."""
    if not isinstance(chosen, (str, list)):
        raise ValueError(f"row {index}: field 'chosen' must be a string or a message list, got {type(chosen).__name__}")
    if type(chosen) is not type(rejected):
        raise ValueError(f"row {index}: field 'rejected' must be of the same kind as 'chosen' (string or messages)")
    split = 0
    for split in range(min(len(chosen), len(rejected))):
        if chosen[split] != rejected[split]:
            if isinstance(chosen, str) and split > 0 and chosen[split - 1] == " ":
                split -= 1  # the space belongs to the completion, as TRL does
            break
    else:
        split = min(len(chosen), len(rejected))
    return {"prompt": chosen[:split], "chosen": chosen[split:], "rejected": rejected[split:]}


def _validate(pair: dict[str, Any], index: int) -> None:
    conversational = isinstance(pair["prompt"], list)
    for name in ("prompt", "chosen", "rejected"):
        value = pair[name]
        if conversational:
            _validate_messages(value, index, name, need_assistant=name != "prompt")
        elif not isinstance(value, str):
            raise ValueError(f"row {index}: field '{name}' must be a string, got {type(value).__name__}")
        else:
            _validate_text(value, index, name)
            if name != "prompt" and not value.strip():
                raise ValueError(f"row {index}: field '{name}' is an empty completion")
    if pair["chosen"] == pair["rejected"]:
        raise ValueError(f"row {index}: field 'rejected' is identical to 'chosen'")


def _validate_text(text: str, index: int, name: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:  # lone surrogates: no tokenizer can encode them
        raise ValueError(f"row {index}: field '{name}' is not valid unicode ({error.reason})") from None


def _validate_messages(messages: Any, index: int, name: str, need_assistant: bool) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"row {index}: field '{name}' must be a non-empty list of messages")
    for position, turn in enumerate(messages):
        if not isinstance(turn, dict) or turn.get("role") not in _ROLES or not isinstance(turn.get("content"), str):
            raise ValueError(f"row {index}: field '{name}' has a message that is not {{'role': "
                             f"{'|'.join(_ROLES)}, 'content': str}}: {str(turn)[:80]}")
        _validate_text(turn["content"], index, name)
        if turn["role"] == "system" and (position > 0 or name != "prompt"):
            raise ValueError(f"row {index}: field '{name}' has a system message that is not the prompt's first")
    if need_assistant:
        if messages[0]["role"] != "assistant":
            raise ValueError(f"row {index}: field '{name}' must start with an assistant turn, "
                             f"not {messages[0]['role']!r}")
        if not any(turn["content"].strip() for turn in messages if turn["role"] == "assistant"):
            raise ValueError(f"row {index}: field '{name}' is an empty completion")
    elif messages[-1]["role"] == "assistant":
        raise ValueError(f"row {index}: field 'prompt' ends with an assistant turn; the completion goes in chosen")


def tokenize_row(row: dict[str, Any], tokenizer: Any) -> dict[str, list[int]]:
    """Token ids of one validated pair, the same as TRL's `DPOTrainer` gives.

    The prompt is tokenized once; a completion's ids are those of prompt+completion after the prompt, with the EOS
    text appended to plain-string completions (a chat template closes its own turns). Where prompt and
    prompt+completion tokenize differently at the seam, the completion starts where they diverge.
    """
    prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
    if isinstance(prompt, list):
        if tokenizer.chat_template is None:
            raise ValueError("conversational data needs a tokenizer with a chat template; set "
                             "tokenizer.chat_template or pass plain-string prompts")

        def encode(messages, field, **kwargs):
            try:
                ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"]
            except Exception as error:  # templates raise their own errors (e.g. "roles must alternate")
                raise ValueError(f"field '{field}': the chat template refused it: {error}") from error
            return list(ids)
        prompt_ids = encode(prompt, "prompt", add_generation_prompt=True)
        prompt_chosen_ids = encode(prompt + chosen, "chosen")
        prompt_rejected_ids = encode(prompt + rejected, "rejected")
    else:
        eos = tokenizer.eos_token
        chosen = chosen if chosen.endswith(eos) else chosen + eos
        rejected = rejected if rejected.endswith(eos) else rejected + eos
        prompt_ids = tokenizer(text=prompt)["input_ids"]
        prompt_chosen_ids = tokenizer(text=prompt + chosen)["input_ids"]
        prompt_rejected_ids = tokenizer(text=prompt + rejected)["input_ids"]
    prompt_len = min(_common_prefix_length(prompt_ids, prompt_chosen_ids),
                     _common_prefix_length(prompt_ids, prompt_rejected_ids))
    return {"prompt_ids": prompt_ids[:prompt_len], "chosen_ids": prompt_chosen_ids[prompt_len:],
            "rejected_ids": prompt_rejected_ids[prompt_len:]}


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


def tokenize_dataset(dataset: Dataset | Iterable[dict[str, Any]], tokenizer: Any, max_length: int | None = None,
                     max_prompt_length: int | None = None, truncation_mode: str = "keep_end") -> Dataset:
    """Validate, tokenize and truncate every row; pairs left without a completion token are dropped with a warning.

    Extra columns that hold precomputed reference log-probs are carried along.
    """
    columns: dict[str, list] = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": []}
    carried = [name for name in ("ref_chosen_logps", "ref_rejected_logps")
               if isinstance(dataset, Dataset) and name in dataset.column_names]
    columns.update({name: [] for name in carried})
    dropped = []
    for index, row in enumerate(dataset):
        pair = _to_preference_row(row, index)
        try:
            tokenized = tokenize_row(pair, tokenizer)
        except ValueError as error:
            raise ValueError(f"row {index}: {error}") from error
        example = truncate_pair(tokenized, max_length, max_prompt_length, truncation_mode)
        if not example["chosen_ids"] or not example["rejected_ids"]:
            dropped.append(index)
            continue
        for name, ids in example.items():
            columns[name].append(ids)
        for name in carried:
            columns[name].append(row[name])
    if dropped:
        logger.warning("dropped %d of %d pairs with no completion token left after truncation "
                       "(max_length=%s, max_prompt_length=%s); first rows: %s", len(dropped), len(dropped) +
                       len(columns["prompt_ids"]), max_length, max_prompt_length, dropped[:10])
    if not columns["prompt_ids"]:
        raise ValueError(f"no pair left: every row's prompt fills max_length={max_length} (rows {dropped[:10]})")
    return Dataset.from_dict(columns)


def is_tokenized(dataset: Any) -> bool:
    return isinstance(dataset, Dataset) and {"prompt_ids", "chosen_ids", "rejected_ids"} <= set(dataset.column_names)
