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
import multiprocessing
import os
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import yaml
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
from datasets.data_files import DataFilesDict, get_data_patterns
from datasets.load import _ALL_ALLOWED_EXTENSIONS

from .folders import check_every_file_read, file_type
from .layouts import (
    CARRIED_COLUMNS,
    Layout,
    LayoutOptions,
    check_mapping,
    detect_layout,
    feature_kind,
    layout_by_name,
    rename_columns,
    value_kind,
)
from .unpaired import (  # noqa: F401  (NO_ANSWER, NO_COMMON_PROMPT, SAME_ANSWERS: the reasons, beside the others)
    NO_ANSWER,
    NO_COMMON_PROMPT,
    SAME_ANSWERS,
    UNPAIRED,
    left_out_rows,
    note_in_stream,
    pair_or_reason,
    refuse_most_unpaired,
)

logger = logging.getLogger("dpo_min.data")  # one logger for the data folder: the command shows its lines

_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
FILE_SPLIT = "train"  # a data file has one split; datasets names it "train"
PAIR_COLUMNS = ("prompt", "chosen", "rejected")
TOKEN_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
REFERENCE_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
SOURCE_ROW, SOURCE_DATASET = "source_row", "source_dataset"  # where a pair came from, for error messages
AnyDataset = Dataset | IterableDataset
DEFAULT_OPTIONS = LayoutOptions()
DROPPED = "dropped_because"  # a pair's reason in DROP_REASONS ('' for a kept pair), between tokenizing and dropping
SKIPPED = "skipped by the layout (ties)"
NO_COMPLETION = "with no completion token left after truncation"
SAME_COMPLETIONS = "with chosen identical to rejected after truncation"
DROP_REASONS = (NO_COMPLETION, SAME_COMPLETIONS)
# The datasets cache keys a map by its function's own code and arguments, not by the helpers it calls: a change
# to what tokenizing writes (the drop reasons became names, not 0/1/2) must change this, or a cached map of
# the old form is read back.
TOKENIZED_VERSION = 2
ALSO_HELD_OUT = "train pairs also held out"  # a StreamCounts name
_COUNTS = "_dpo_min_stream_counts"  # the attribute a stream of this module carries its StreamCounts in


class StreamCounts:
    """What one stream has read and dropped, by reason (`NAMES`): a stream is converted and tokenized as it is read,
    so its drops are counted as they happen (the command logs them); map-style data logs its drops once.

    Each stream has its own: `load_preference_dataset(..., streaming=True)` makes one (or takes `counts=`), and
    `tokenize_dataset` and `count_shared_in_stream` add to the one the stream carries (`stream_counts`). The counts
    are in shared memory, so DataLoader workers (`dataloader_num_workers`) that read the stream add to them too
    (with the default start method, as Trainer starts them; like any multiprocessing object, the counts pickle only
    into a process being started).
    """
    NAMES = ("read", SKIPPED, *DROP_REASONS, *UNPAIRED, ALSO_HELD_OUT)

    def __init__(self) -> None:
        self._values = multiprocessing.Array("q", len(self.NAMES))  # with a lock: two workers may add at once

    def add(self, counts: Mapping[str, int]) -> None:
        with self._values.get_lock():
            for name, number in counts.items():
                self._values[self.NAMES.index(name)] += number

    def snapshot(self) -> Counter[str]:
        """The counts now, by name (a copy: subtract an earlier snapshot for what was read in between)."""
        with self._values.get_lock():
            return Counter(dict(zip(self.NAMES, self._values[:])))

    def __copy__(self) -> "StreamCounts":
        return self  # datasets copies a stream's steps as it reads them: every copy counts into these counts

    def __deepcopy__(self, memo: dict) -> "StreamCounts":
        return self

    def __repr__(self) -> str:
        return f"StreamCounts({dict(self.snapshot())})"


def stream_counts(stream: Any) -> StreamCounts | None:
    """The counts a stream of this module carries (a DataLoader's stream too, or a shard of it); None for others."""
    for _ in range(3):  # a DataLoader -> accelerate's IterableDatasetShard -> the stream
        if hasattr(stream, _COUNTS):
            return getattr(stream, _COUNTS)
        stream = getattr(stream, "dataset", None)
    return None


def _counts_for(stream: IterableDataset, counts: StreamCounts | None) -> StreamCounts:
    """The counts a step on `stream` adds to: those given, else the stream's own, else new ones."""
    if counts is not None:
        return counts
    return stream_counts(stream) or StreamCounts()


def _carrying(stream: IterableDataset, counts: StreamCounts) -> IterableDataset:
    setattr(stream, _COUNTS, counts)
    return stream


# ---- loading ----------------------------------------------------------------------------------------------------
def load_preference_dataset(path_or_name: str, split: str = "train", *, config: str | None = None,
                            columns: Mapping[str, str] | None = None, streaming: bool = False,
                            num_proc: int | None = None, preference_label: str = "better_response_id",
                            no_prompt: bool = False, as_messages: bool = False, row_split: str = "train",
                            label_column: str | None = None, label_chosen: str | None = None,
                            label_rejected: str | None = None, counts: StreamCounts | None = None,
                            strict_pairs: bool = False, **load_kwargs: Any) -> AnyDataset:
    """Load preference pairs from a JSON/JSONL/Parquet/CSV file (optionally .gz) or a `datasets` name.

    Returns a `Dataset` (an `IterableDataset` with `streaming`) with columns `prompt`, `chosen`, `rejected`
    (strings, or message lists), `source_row` (the row's index in the source split), and `tools` /
    `chat_template_kwargs` where the source has them. The layout is detected from the columns (see
    `layouts.LAYOUTS`); `columns` maps our names (prompt, chosen, rejected, system) to the source's. A stream
    counts what it reads and skips in `counts` (a new `StreamCounts` if not given; `stream_counts(stream)` is it).
    A row that cannot be a preference pair (`UNPAIRED`: no answer, no common prompt) is dropped and counted, unless
    `strict_pairs`, or most rows are such (a wrong layout): then it raises, naming the row.
    """
    options = LayoutOptions(preference_label=preference_label, no_prompt=no_prompt, as_messages=as_messages,
                            row_split=row_split, label_column=label_column, label_chosen=label_chosen,
                            label_rejected=label_rejected)
    raw = _load_raw(path_or_name, split, config, streaming, load_kwargs)
    try:
        return to_preference_dataset(raw, columns=columns, options=options, num_proc=num_proc,
                                     source=os.path.basename(path_or_name), counts=counts, strict_pairs=strict_pairs)
    except ValueError as error:
        raise ValueError(f"{path_or_name}: {error}") from error


def _load_raw(path_or_name: str, split: str, config: str | None, streaming: bool,
              load_kwargs: dict[str, Any]) -> AnyDataset:
    """One split of a file, a local folder (one `load_dataset` reads, or a `save_to_disk` one) or a hub name."""
    if os.path.isdir(path_or_name) and _is_saved_to_disk(path_or_name, split):
        return _load_saved(path_or_name, split, config, streaming)
    if os.path.isdir(path_or_name) or not os.path.exists(path_or_name):
        return _load_named(path_or_name, split, config, streaming, load_kwargs)
    builder = data_file_type(path_or_name)
    if builder is None:
        raise ValueError(f"{path_or_name}: unknown file type; use .json, .jsonl, .parquet or .csv (optionally .gz), "
                         "or a dataset folder")
    _check_file_split(path_or_name, split, config)
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


def load_rows(path_or_name: str, split: str = "train", config: str | None = None) -> Dataset:
    """One split's rows as the source holds them, read as `load_preference_dataset` reads its source (a file, a
    folder, a hub name), before any layout: the prompt-only rows of DPO in rounds. Raises ValueError naming it."""
    return _load_raw(path_or_name, split, config, False, {})


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
    files = _check_one_file_type(path_or_name, load_kwargs) if os.path.isdir(path_or_name) else []
    try:
        return load_dataset(path_or_name, config, split=split, streaming=streaming, **load_kwargs)
    except ValueError as error:
        if not str(error).startswith("Unknown split"):
            _name_unreadable_file(files, error)
            raise
        raise ValueError(f"{path_or_name}: no split {split!r}; it has "
                         f"{_split_names(path_or_name, config, load_kwargs)}") from None
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


def _check_one_file_type(folder: str, load_kwargs: Mapping[str, Any]) -> list[str]:
    """datasets reads a folder's files of its commonest type only (`infer_module_for_data_files`, then a filter on
    that type), only its split-named files where some are, and none it cannot glob (`folders`): such a folder is
    refused, naming the files, rather than read in part. Files that a README's `configs:` or `data_files` name are
    read as named. Returns the files datasets reads (relative to the folder), [] where they are named."""
    base = os.path.join(folder, load_kwargs["data_dir"]) if load_kwargs.get("data_dir") else folder
    if load_kwargs.get("data_files") is not None or _readme_configs(base):
        return []

    def found(patterns: Mapping[str, list[str]]) -> list[str]:
        files = DataFilesDict.from_patterns(patterns, base_path=base, allowed_extensions=_ALL_ALLOWED_EXTENSIONS)
        return sorted(os.path.relpath(file, base) for split in files.values() for file in split)
    try:
        in_splits, every = found(get_data_patterns(base)), found({"all": ["**"]})
    except Exception:  # no data files that datasets can glob
        in_splits = every = []
    check_every_file_read(base, every)
    by_type: dict[tuple[str, ...], list[str]] = {}
    for name in every:
        kind = file_type(name)  # datasets' own rule, one file at a time
        if kind is not None:
            by_type.setdefault(kind, []).append(name)
    if len(by_type) > 1:
        listed = "; ".join(f"{_type_name(kind)}: {_some(names)}" for kind, names in by_type.items())
        raise ValueError(f"{base}: holds data files of {len(by_type)} types, and datasets would read one type "
                         f"only: {listed}; keep one type in the folder, or name a file")
    # Files named by split (train.jsonl, test-*.parquet) make datasets read those alone and leave out the others.
    left_out = sorted(set(name for names in by_type.values() for name in names) - set(in_splits))
    if left_out:
        raise ValueError(f"{base}: datasets reads its files by split name ({_some(in_splits)}) and would leave out "
                         f"{_some(left_out)}; name every file by its split, or keep one split's files there")
    return [os.path.join(base, name) for names in by_type.values() for name in names]


def _type_name(kind: tuple[str, ...]) -> str:
    """('csv', 'sep', '\t') -> "csv (sep '\t')"."""
    options = ", ".join(f"{name} {value!r}" for name, value in zip(kind[1::2], kind[2::2]))
    return f"{kind[0]} ({options})" if options else kind[0]


def _some(names: list[str]) -> str:
    """'2 files (a.jsonl, b.jsonl)', at most three named."""
    return (f"{len(names)} file{'s' * (len(names) > 1)} ({', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''})")


def _readme_configs(folder: str) -> bool:
    """The folder's README.md front matter has `configs:` (a hub dataset's card naming its data files)."""
    readme = os.path.join(folder, "README.md")
    if not os.path.isfile(readme):
        return False
    with open(readme, encoding="utf-8", errors="replace") as file:
        text = file.read()
    if not text.startswith("---"):
        return False
    try:
        header = yaml.safe_load(text.split("---", 2)[1])
    except yaml.YAMLError as error:  # datasets reads the front matter too, and its error names no file
        mark = getattr(error, "problem_mark", None)  # its line in the front matter, which starts on line 1
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ValueError(f"{readme}: its YAML front matter does not parse: {getattr(error, 'problem', error)}"
                         f"{where}") from None
    return isinstance(header, Mapping) and "configs" in header


def _split_names(path_or_name: str, config: str | None, load_kwargs: dict[str, Any]) -> str:
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
                return _mixed_kinds(index, name, kind, expected)
    return None


_KIND_WORDS = {"text": "a string", "messages": "a message list", "turn": "an object", "other": "a number or "
               "boolean", "null": "null"}


def _mixed_kinds(index: int | str, field: str, kind: str, first_kind: str) -> str:
    # TRL would treat every row as the first row's kind, so a file or dataset holds one kind of row.
    return (f"row {index}: field '{field}' is {_KIND_WORDS[kind]} but row 0's is {_KIND_WORDS[first_kind]}; "
            "standard (string) and conversational (message list) rows cannot be mixed")


# ---- held-out pairs that are also train pairs ------------------------------------------------------------------
def _pair_keys(pairs: AnyDataset) -> Iterable[str]:
    """Each pair's content (prompt, chosen, rejected) as one text, batch by batch."""
    for batch in pairs.select_columns(list(PAIR_COLUMNS)).iter(batch_size=1000):
        yield from (json.dumps(pair, sort_keys=True) for pair in zip(*(batch[name] for name in PAIR_COLUMNS)))


def count_shared_pairs(train: Dataset, held_out: Dataset) -> int:
    """How many held-out pairs are also train pairs by content: split apart by row, duplicate rows or a dataset
    listed twice still put the same pair on both sides."""
    held = Counter(_pair_keys(held_out))
    shared = {key for key in _pair_keys(train) if key in held}
    return sum(held[key] for key in shared)


def warn_shared_pairs(train: Dataset, held_out: Dataset | None, source: str = "data") -> int:
    """Count the held-out pairs that are train pairs too and warn with the count; returns it."""
    shared = count_shared_pairs(train, held_out) if held_out is not None else 0
    if shared:
        logger.warning("%s: %d of the %d held-out pairs are also train pairs (the same prompt, chosen and rejected: "
                       "duplicate rows, or a dataset listed twice); their held-out scores measure recall", source,
                       shared, len(held_out))
    return shared


def count_shared_in_stream(train: IterableDataset, held_out: Dataset,
                           counts: StreamCounts | None = None) -> IterableDataset:
    """The train stream, counting the pairs it gives that are also held out as it is read, in `counts` (by default
    the train stream's own, `stream_counts(train)`), which the stream it returns carries."""
    held = set(_pair_keys(held_out))
    counts = _counts_for(train, counts)

    def count(batch: dict[str, list]) -> dict[str, list]:
        keys = (json.dumps(pair, sort_keys=True) for pair in zip(*(batch[name] for name in PAIR_COLUMNS)))
        counts.add({ALSO_HELD_OUT: sum(key in held for key in keys)})
        return batch
    return _carrying(train.map(count, batched=True, features=train.features), counts)


# ---- layouts -> pairs: every row is validated here, once -----------------------------------------------------
def to_preference_rows(rows: Iterable[Mapping[str, Any]], columns: Mapping[str, str] | None = None,
                       options: LayoutOptions = DEFAULT_OPTIONS, strict_pairs: bool = False) -> list[dict[str, Any]]:
    """Bring each row to {prompt, chosen, rejected}, validating it. Raises ValueError naming row and field; a row that
    cannot be a pair is left out with a warning, as `load_preference_dataset` does."""
    return [{name: value for name, value in pair.items() if name != SOURCE_ROW}
            for pair in _to_pairs(rows, columns, options, strict_pairs)]


def _to_pairs(rows: Iterable[Mapping[str, Any]], columns: Mapping[str, str] | None,
              options: LayoutOptions, strict_pairs: bool = False) -> list[dict[str, Any]]:
    rows = list(rows)
    if not rows:
        return []
    if columns:
        check_mapping(columns, list(rows[0]))
        rows = [rename_columns(row, columns) for row in rows]
    layout = _detect(rows[0] if isinstance(rows[0], Mapping) else {}, None, options)
    pairs, first_conversational, left_out = [], None, Counter()
    for index, row in enumerate(rows):
        pair = pair_or_reason(layout, row, index, options, strict_pairs)
        if isinstance(pair, tuple):
            if not left_out:
                first = pair[1]
            left_out[pair[0]] += 1
            continue
        if pair is None:
            continue
        first_conversational = _check_kind(pair, index, first_conversational)
        pairs.append({**pair, SOURCE_ROW: index})
    if left_out:
        refuse_most_unpaired(first, left_out, len(rows))
        logger.warning("dropped %d of %d rows: %s", sum(left_out.values()), len(rows),
                       ", ".join(f"{number} {reason}" for reason, number in left_out.items()))
    return pairs


def _check_kind(pair: Mapping[str, Any], index: int | str, first_conversational: bool | None) -> bool:
    """Standard and conversational pairs cannot share a dataset (see `_mixed_kinds`)."""
    conversational = isinstance(pair["prompt"], list)
    if first_conversational is not None and conversational != first_conversational:
        kinds = ("messages", "text") if conversational else ("text", "messages")
        raise ValueError(_mixed_kinds(index, "prompt", *kinds))
    return conversational


def _detect(first_row: Mapping[str, Any], features: Any, options: LayoutOptions, source: str = "") -> Layout:
    kinds = ({name: feature_kind(feature) for name, feature in features.items()} if features
             else {name: value_kind(value) for name, value in first_row.items()})
    layout = detect_layout(kinds, first_row, options)
    logger.info("%slayout %s (as %s), from columns [%s]", f"{source}: " if source else "", layout.name,
                layout.described(), ", ".join(kinds))
    return layout


def _row_label(batch: Mapping[str, list], position: int, index: int) -> int | str:
    row = batch[SOURCE_ROW][position] if SOURCE_ROW in batch else index
    return f"{row} of {batch[SOURCE_DATASET][position]}" if SOURCE_DATASET in batch else row


def _rows(batch: Mapping[str, list]) -> Iterable[dict[str, Any]]:
    names = list(batch)
    return (dict(zip(names, values)) for values in zip(*batch.values()))


def _convert_batch(batch: dict[str, list], indices: list[int], layout_name: str, options: LayoutOptions,
                   columns: Mapping[str, str] | None, conversational: bool | None, keep: tuple[str, ...] = (),
                   counts: StreamCounts | None = None, strict_pairs: bool = False) -> dict[str, list]:
    """Rows -> validated pairs; a tie, or a row that cannot be a pair (`UNPAIRED`), is left out: a stream counts
    both here, map-style data once the map is done (`unpaired.left_out_rows`)."""
    layout = layout_by_name(layout_name)
    carried = [name for name in (*CARRIED_COLUMNS, *keep) if name in batch]
    out: dict[str, list] = {name: [] for name in (*PAIR_COLUMNS, SOURCE_ROW, *carried)}
    unpaired: dict[str, list[tuple[Any, str]]] = {}
    for position, (row, index) in enumerate(zip(_rows(batch), indices)):
        label = _row_label(batch, position, index)
        pair = pair_or_reason(layout, rename_columns(row, columns) if columns else row, label, options, strict_pairs)
        if isinstance(pair, tuple):
            unpaired.setdefault(pair[0], []).append((label, pair[1]))
            continue
        if pair is None:
            continue
        _check_kind(pair, label, conversational)
        for name in PAIR_COLUMNS:
            out[name].append(pair[name])
        out[SOURCE_ROW].append(row.get(SOURCE_ROW, index))
        for name in carried:
            out[name].append(row[name])
    if counts is not None:  # a stream: its drops are counted as they happen (see StreamCounts)
        left_out = sum(map(len, unpaired.values()))
        counts.add({"read": len(indices), SKIPPED: len(indices) - len(out[SOURCE_ROW]) - left_out,
                    **{reason: len(rows) for reason, rows in unpaired.items()}})
        note_in_stream(unpaired, counts)
    return out


def to_preference_dataset(dataset: AnyDataset, columns: Mapping[str, str] | None = None,
                          options: LayoutOptions = DEFAULT_OPTIONS, num_proc: int | None = None,
                          source: str = "", keep: tuple[str, ...] = (),
                          counts: StreamCounts | None = None, strict_pairs: bool = False) -> AnyDataset:
    """A loaded dataset in any known layout -> validated prompt/chosen/rejected/source_row columns (a cached `map`),
    and the columns named in `keep`. Rows read and left out (ties, `UNPAIRED` rows unless `strict_pairs`) are added
    to `counts` (a stream's: see StreamCounts)."""
    first_row = _first_row(dataset)
    if columns:
        check_mapping(columns, list(first_row))
        first_row = rename_columns(first_row, columns)
    features = None if columns else dataset.features
    layout = _detect(first_row, features, options, source)
    # The kind every row must have is the first row's; the map validates that row with the others.
    # None: a tie; a tuple: unpaired. Not validated: the map validates that row with the others.
    first_pair = pair_or_reason(layout, first_row, 0, options, strict_pairs, validate=False)
    conversational = None if not isinstance(first_pair, dict) else (
        options.as_messages or isinstance(first_pair["prompt"], list))
    fn_kwargs = {"layout_name": layout.name, "options": options, "columns": dict(columns) if columns else None,
                 "conversational": conversational, "keep": tuple(keep), "strict_pairs": strict_pairs}
    map_kwargs: dict[str, Any] = {"batched": True, "with_indices": True, "remove_columns": _column_names(dataset),
                                  "fn_kwargs": fn_kwargs}
    if isinstance(dataset, IterableDataset):  # counted as it is read, in the workers that read it too
        counts = fn_kwargs["counts"] = counts if counts is not None else StreamCounts()
        return _carrying(dataset.map(_convert_batch, **map_kwargs), counts)
    # Map-style: the datasets cache keys the map by fn_kwargs, which hold no counts; they are counted once, here.
    map_kwargs.update(num_proc=num_proc, desc=f"Reading {layout.name} pairs")
    converted = dataset.map(_convert_batch, **map_kwargs)
    left_out = {}
    if len(converted) < len(dataset):
        labels = dataset[SOURCE_ROW] if SOURCE_ROW in dataset.column_names else range(len(dataset))
        left_out = left_out_rows(dataset, labels, converted[SOURCE_ROW], layout, options, columns)
    ties = len(dataset) - len(converted) - sum(map(len, left_out.values()))
    if left_out:
        refuse_most_unpaired(min(rows[0] for rows in left_out.values())[1],
                              {reason: len(rows) for reason, rows in left_out.items()}, len(dataset))
    if counts is not None:
        counts.add({"read": len(dataset), SKIPPED: ties, **{reason: len(rows) for reason, rows in left_out.items()}})
    if ties:
        logger.warning("%s: dropped %d of %d rows that the %s layout skips (%s)", source or "data", ties,
                       len(dataset), layout.name, layout.skips)
    for reason, rows in left_out.items():
        logger.warning("%s: dropped %d of %d rows %s; first source rows: %s", source or "data", len(rows),
                       len(dataset), reason, ", ".join(str(label) for label, _ in rows[:10]))
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


def _column_names(dataset: AnyDataset) -> list[str]:
    return dataset.column_names if dataset.column_names is not None else list(_first_row(dataset))


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


def _tokenize_batch(batch: dict[str, list], indices: list[int], tokenizer: Any, truncation: dict[str, Any],
                    chat_template_kwargs: dict[str, Any] | None, output_version: int) -> dict[str, list]:
    """Validated pairs -> truncated token ids, and why a pair is unusable (`DROP_REASONS`; '': it is usable).

    `output_version` is not read: it is TOKENIZED_VERSION, passed so that the datasets cache key changes with it."""
    pairs = list(_rows(batch))
    labels = [_row_label(batch, position, index) for position, index in enumerate(indices)]
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
    out: dict[str, list] = {name: [] for name in (*TOKEN_COLUMNS, SOURCE_ROW, DROPPED)}
    for example, label in zip(tokenized, labels):
        cut = truncate_pair(example, **truncation)
        for name, ids in cut.items():
            out[name].append(ids)
        out[SOURCE_ROW].append(label)
        out[DROPPED].append(_drop_reason(cut) or "")  # a string column: '' rather than None, so shards concatenate
    return out


def _drop_reason(example: Mapping[str, list[int]]) -> str | None:
    """Why a truncated pair cannot be trained on (one of DROP_REASONS), or None."""
    if not example["chosen_ids"] or not example["rejected_ids"]:
        return NO_COMPLETION
    # Both answers cut inside their shared opening: the same sequence twice, a loss of ln 2 and no gradient.
    return SAME_COMPLETIONS if example["chosen_ids"] == example["rejected_ids"] else None


def _tokenize_one(pair: Mapping[str, Any], label: int | str, tokenizer: Any,
                  chat_template_kwargs: Mapping[str, Any] | None) -> dict[str, list[int]]:
    try:
        return tokenize_row(pair, tokenizer, chat_template_kwargs)
    except ValueError as error:
        raise ValueError(f"row {label}: {error}") from error


def tokenize_dataset(dataset: AnyDataset | Iterable[Mapping[str, Any]], tokenizer: Any,
                     max_length: int | None = None, max_prompt_length: int | None = None,
                     truncation_mode: str = "keep_end", num_proc: int | None = None,
                     chat_template_kwargs: Mapping[str, Any] | None = None,
                     counts: StreamCounts | None = None) -> AnyDataset:
    """Tokenize and truncate every pair (a batched, cached `datasets.map`, `num_proc` processes); pairs left without
    a completion token, or with chosen identical to rejected, are dropped with a warning naming their source rows.

    Rows that `load_preference_dataset` has not read yet (a list, or a dataset in any layout) are first brought to
    validated pairs by it; its own pairs are not validated again. Extra columns that hold precomputed reference
    log-probs are carried along. An `IterableDataset` is tokenized on the fly, and counts its unusable pairs as
    it is read in `counts` (by default its own, `stream_counts(dataset)`), which the stream it returns carries.
    """
    if not isinstance(dataset, (Dataset, IterableDataset)):
        dataset = Dataset.from_list(_to_pairs(dataset, None, DEFAULT_OPTIONS))
    names = _column_names(dataset)
    if not {*PAIR_COLUMNS, SOURCE_ROW} <= set(names):  # not yet read by to_preference_dataset, which marks its rows
        dataset = to_preference_dataset(dataset, num_proc=num_proc, keep=REFERENCE_COLUMNS, counts=counts)
        names = _column_names(dataset)
    streaming = isinstance(dataset, IterableDataset)
    truncation = {"max_length": max_length, "max_prompt_length": max_prompt_length, "truncation_mode": truncation_mode}
    map_kwargs: dict[str, Any] = {
        "batched": True, "with_indices": True,
        "remove_columns": [name for name in names if name not in REFERENCE_COLUMNS],
        "fn_kwargs": {"tokenizer": tokenizer, "truncation": truncation, "chat_template_kwargs": (
            dict(chat_template_kwargs) if chat_template_kwargs else None), "output_version": TOKENIZED_VERSION}}
    if not streaming:
        map_kwargs.update(num_proc=num_proc, desc="Tokenizing pairs")
    tokenized = dataset.map(_tokenize_batch, **map_kwargs)
    if streaming:
        counts = _counts_for(dataset, counts)
        return _carrying(tokenized.filter(_count_usable, input_columns=[DROPPED], batched=True,
                                          fn_kwargs={"counts": counts}).remove_columns([SOURCE_ROW, DROPPED]), counts)
    return _drop_unusable(tokenized, truncation, counts).remove_columns([SOURCE_ROW, DROPPED])


def describe_stream_counts(counts: Mapping[str, int]) -> str:
    """'read 40 rows, dropped 3: 2 skipped by the layout (ties), 1 with no completion token left after truncation'."""
    dropped = {reason: counts.get(reason, 0) for reason in (SKIPPED, *UNPAIRED, *DROP_REASONS)
               if counts.get(reason, 0)}
    listed = ", ".join(f"{number} {reason}" for reason, number in dropped.items())
    shared = counts.get(ALSO_HELD_OUT, 0)
    return (f"read {counts.get('read', 0)} rows, dropped {sum(dropped.values())}" + (f": {listed}" if listed else "")
            + (f"; {shared} {ALSO_HELD_OUT} (the same prompt, chosen and rejected)" if shared else ""))


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
        counts = ", ".join(f"{(reasons == reason).sum()} {reason}" for reason in rows)
        raise ValueError(f"no pair left after truncation ({settings}): {counts} (rows "
                         f"{', '.join(rows.get(NO_COMPLETION, []) + rows.get(SAME_COMPLETIONS, []))})")
    return tokenized.select(np.flatnonzero(kept))


def is_tokenized(dataset: Any) -> bool:
    return isinstance(dataset, (Dataset, IterableDataset)) and dataset.column_names is not None and \
        set(TOKEN_COLUMNS) <= set(dataset.column_names)
