"""Where rows come from: a data file (JSON, JSONL, Parquet, CSV, optionally .gz), a local folder (one that
`datasets.load_dataset` reads, or a `save_to_disk` one), or a `datasets` name, one split of it, as raw rows. A file
that does not read is refused in one line naming the line or row at fault (`_why_unreadable`), a folder's file too."""

import gzip
import json
import logging
import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from datasets import (
    Dataset,
    DatasetDict,
    IterableDataset,
    ReadInstruction,
    concatenate_datasets,
    get_dataset_split_names,
    load_dataset,
    load_from_disk,
)

from .folders import check_one_file_type, file_type
from .layouts import value_kind

logger = logging.getLogger("dpo_min.data")  # one logger for the data folder: the command shows its lines

_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
# The columns a pair's text is read from, as written: in a CSV file these cells are text, never the numbers pandas
# would make of them (an answer "42" read as int and refused, "007" as 7). Label and score columns keep their numbers.
TEXT_COLUMNS = ("prompt", "chosen", "rejected", "completion", "system")
FILE_SPLIT = "train"  # a data file has one split; datasets names it "train"
AnyDataset = Dataset | IterableDataset


def load_raw(path_or_name: str, split: str, config: str | None, streaming: bool,
             load_kwargs: dict[str, Any], text_columns: Iterable[str] = ()) -> AnyDataset:
    """One split of a file, a local folder (one `load_dataset` reads, or a `save_to_disk` one) or a hub name. A CSV
    file's TEXT_COLUMNS, and `text_columns` (those a mapping reads as them), are read as the text written."""
    if os.path.isdir(path_or_name) and _is_saved_to_disk(path_or_name, split):
        return _load_saved(path_or_name, split, config, streaming)
    if os.path.isdir(path_or_name) or not os.path.exists(path_or_name):
        return _load_named(path_or_name, split, config, streaming, load_kwargs)
    builder = data_file_type(path_or_name)
    if builder is None:
        raise ValueError(f"{path_or_name}: unknown file type; use .json, .jsonl, .parquet or .csv (optionally .gz), "
                         "or a dataset folder")
    _check_file_split(path_or_name, split, config)
    if builder == "csv":
        load_kwargs = {"converters": dict.fromkeys((*TEXT_COLUMNS, *text_columns), _cell_text), **load_kwargs}
    try:
        with _quiet(f"datasets.packaged_modules.{builder}.{builder}"):  # its log line; ours names the line too
            dataset = load_dataset(builder, data_files={FILE_SPLIT: path_or_name}, streaming=streaming,
                                   split=FILE_SPLIT if streaming else split, **load_kwargs)  # slices: map-style only
        if builder == "json" and not streaming:
            dataset.data.table.validate(full=True)  # pyarrow reads text that is not UTF-8, and fails later
    except Exception as error:  # datasets wraps parse errors in several exception types
        raise ValueError(f"{path_or_name}: {_why_unreadable(path_or_name, builder, error)}") from error
    if streaming:
        return _slice_stream(dataset, split, path_or_name)
    if len(dataset) == 0:
        raise ValueError(f"{path_or_name}: the file holds no rows")
    return _columns_object(dataset, path_or_name) if builder == "json" else dataset


def _cell_text(cell: str) -> str | None:
    """A CSV cell as written; an empty one is no value, as pandas reads it."""
    return cell or None


@contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Hold back a library logger's lines below CRITICAL while a call that raises its own message runs."""
    library_logger = logging.getLogger(name)
    level = library_logger.level
    library_logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        library_logger.setLevel(level)


def data_file_type(path: str) -> str | None:
    """The datasets builder of a data file (json, parquet, csv; .gz forms too); None for a folder or a name."""
    if not os.path.isfile(path):
        return None
    stem = path[:-3] if path.endswith(".gz") else path
    return _FILE_BUILDERS.get(os.path.splitext(stem)[1].lower())


def _check_file_split(path: str, split: str, config: str | None) -> None:
    """A data file is one split of one config: naming another would read the whole file as it (train on the
    held-out rows), so it is refused; a slice of its split (train[:80%]) is honoured."""
    if config not in (None, "default"):
        raise ValueError(f"{path}: a data file has no configs (subsets); drop the config name {config!r}")
    others = [name for name in _split_names_in(split) if name != FILE_SPLIT]
    if others:
        raise ValueError(f"{path}: a data file has one split, {FILE_SPLIT!r}; there is no split {others[0]!r} "
                         f"(name {FILE_SPLIT!r} or a slice of it, such as 'train[:80%]')")


def _split_names_in(spec: str) -> list[str]:
    """The splits a datasets split spec names: 'train[:10%]+test' -> ['train', 'test']."""
    return [_split_base(part) for part in spec.split("+")]


def _slice_stream(stream: IterableDataset, spec: str, path: str) -> IterableDataset:
    """A slice of a streamed file by rows (train[:1000], train[50:]): a stream has no length for percents or
    counts from the end."""
    if spec.strip() == FILE_SPLIT:
        return stream
    if "%" in spec or "-" in spec:
        raise ValueError(f"{path}: a stream has no length to take {spec!r} of; slice it by rows from the start "
                         "(train[:1000], train[50:]), or drop --streaming")
    parts = []
    for one in ReadInstruction.from_spec(spec).to_absolute({FILE_SPLIT: sys.maxsize}):
        part = stream.skip(one.from_) if one.from_ else stream
        parts.append(part.take(one.to - one.from_) if one.to < sys.maxsize else part)
    return parts[0] if len(parts) == 1 else concatenate_datasets(parts)


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


def _load_named(path_or_name: str, split: str, config: str | None, streaming: bool,
                load_kwargs: dict[str, Any]) -> AnyDataset:
    """`datasets.load_dataset(name or folder, config, split=...)`: a folder's README.md `configs:`, or its data files
    named by split (data/train_prefs-*.parquet), as for the hub dataset it is a copy of."""
    files = check_one_file_type(path_or_name, load_kwargs) if os.path.isdir(path_or_name) else []
    try:
        return load_dataset(path_or_name, config, split=split, streaming=streaming, **load_kwargs)
    except ValueError as error:
        if not str(error).startswith("Unknown split"):
            _name_unreadable_file(files, error)
            raise
        raise ValueError(f"{path_or_name}: no split {split!r}; it has "
                         f"{_listed_splits(path_or_name, config, load_kwargs)}") from None
    except Exception as error:  # datasets says 'An error occurred while generating the dataset', naming no file
        _name_unreadable_file(files, error)
        raise


def _name_unreadable_file(files: list[str], error: Exception) -> None:
    """Raise the reason of the first of a folder's files that does not read on its own, naming it; return where
    each reads (the folder's error is then about them together, and stands)."""
    for path in files:
        module, *options = file_type(path)
        try:
            with _quiet(f"datasets.packaged_modules.{module}.{module}"):
                load_dataset(module, data_files={FILE_SPLIT: path}, split=FILE_SPLIT,
                             **dict(zip(options[::2], options[1::2])))
        except Exception as file_error:
            raise ValueError(f"{path}: {_why_unreadable(path, module, file_error)}") from error


def _listed_splits(path_or_name: str, config: str | None, load_kwargs: dict[str, Any]) -> str:
    try:
        return ", ".join(get_dataset_split_names(path_or_name, config, **load_kwargs))
    except Exception:
        return "other splits"


def _is_saved_to_disk(folder: str, split: str) -> bool:
    """A `Dataset.save_to_disk` or `DatasetDict.save_to_disk` folder (or one split's folder inside such a one)."""
    return _holds_saved(folder) or _holds_saved(os.path.join(folder, _split_base(split)))


def _holds_saved(folder: str) -> bool:
    """`save_to_disk` wrote this folder itself: a DatasetDict's index or a Dataset's state file."""
    return any(os.path.isfile(os.path.join(folder, name)) for name in ("dataset_dict.json", "state.json"))


def _split_base(split: str) -> str:
    return split.split("[", 1)[0].strip()


def _load_saved(folder: str, split: str, config: str | None, streaming: bool) -> AnyDataset:
    if config not in (None, "default"):
        raise ValueError(f"{folder}: a save_to_disk folder has no configs; drop config {config!r}")
    base = _split_base(split)
    # Otherwise folder/<split> is one split's save_to_disk folder (the layout the handbook's legacy loader reads).
    saved = load_from_disk(folder if _holds_saved(folder) else os.path.join(folder, base))
    if isinstance(saved, DatasetDict):
        if base not in saved:
            raise ValueError(f"{folder}: no split {base!r}; it has {', '.join(saved)}")
        saved = saved[base]
    else:
        logger.info("%s: a save_to_disk folder of one split, read as split %r", folder, base)
    if base != split:  # a slice such as train[:10%] or train[5:]
        instructions = ReadInstruction.from_spec(split).to_absolute({base: len(saved)})
        saved = concatenate_datasets([saved.select(range(one.from_, one.to)) for one in instructions])
    return saved.to_iterable_dataset() if streaming else saved


def _why_unreadable(path: str, builder: str, error: Exception) -> str:
    """A reason that names the line or row: datasets says 'An error occurred while generating the dataset' for a
    line that is not JSON, 'Expected bytes, got a list' for mixed layouts, '' for an empty file."""
    if builder == "json" and path.lower().endswith((".json", ".jsonl", ".gz")):  # a text or .gz we can read
        try:
            with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as file:
                found = _json_fault(file.read())
        except (OSError, EOFError):  # a truncated .gz: datasets' reason says so
            found = None
        if found:
            return found
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"could not be read as {builder}: {reason}"


def _json_fault(data: bytes) -> str | None:
    """The first line that is not UTF-8 or not JSON, or the first row of another kind than row 0's."""
    if not data.strip():
        return "the file is empty"
    newline = b"\n"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        return f"line {data.count(newline, 0, error.start) + 1} is not UTF-8 text"
    try:
        rows = json.loads(text)  # one JSON document (a list of rows, or an object of columns)
    except json.JSONDecodeError as error:
        if text.lstrip().startswith("["):
            return f"line {error.lineno} is not JSON: {error.msg} (column {error.colno})"
        rows = []
        # JSON Lines split on "\n" alone: str.splitlines would also split at U+2028 inside a string.
        for number, line in enumerate(text.split("\n"), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as line_error:
                return f"line {number} is not JSON: {line_error.msg} (column {line_error.colno})"
    if not isinstance(rows, list) or not rows or not all(isinstance(row, dict) for row in rows):
        return None
    return _first_mixed_row(rows)


def _first_mixed_row(rows: list[dict[str, Any]]) -> str | None:
    first = {name: value_kind(value) for name, value in rows[0].items()}
    for index, row in enumerate(rows[1:], start=1):
        for name, value in row.items():
            kind, expected = value_kind(value), first.get(name)
            if kind != "null" and expected not in (None, "null", kind):
                return mixed_kinds(index, name, kind, expected)
    return None


_KIND_WORDS = {"text": "a string", "messages": "a message list", "turn": "an object", "other": "a number or "
               "boolean", "null": "null"}


def mixed_kinds(index: int | str, field: str, kind: str, first_kind: str) -> str:
    # TRL would treat every row as the first row's kind, so a file or dataset holds one kind of row.
    return (f"row {index}: field '{field}' is {_KIND_WORDS[kind]} but row 0's is {_KIND_WORDS[first_kind]}; "
            "standard (string) and conversational (message list) rows cannot be mixed")
