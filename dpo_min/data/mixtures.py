"""Dataset mixtures in the three forms recipes publish them, each read as its publisher's loader reads it.

- TRL 1.16's `datasets: [{path, name, data_dir, data_files, split, columns, fraction}]`, `streaming`,
  `test_split_size` (`trl/scripts/utils.py` `get_dataset`): `fraction` is a dataset's share of the mixture, whose
  size is the largest that repeats no row; each dataset gives its first `round(share * size)` rows.
- the alignment-handbook's `dataset_mixture: {datasets: [{id, config, split, columns, weight}], seed,
  test_split_size}` (`src/alignment/data.py`, 925acdf): `weight` is the fraction of a dataset's rows, taken after a
  shuffle with `seed`; the concatenation is shuffled and split with `seed`.
- the handbook's legacy `dataset_mixer: {id: fraction}` + `dataset_splits` (+ `dataset_configs`) (`mix_datasets`,
  before 19f0345): the first `fraction` of each `train*` split; every `test*` split whole, held out.

`columns` is, in all three, a list of columns to keep. dpo_min's own addition, `rename_columns` on an entry, is
`Dataset.rename_columns`' mapping {source column: new name}, applied after `columns`. Rows become pairs
(`data.to_preference_dataset`) after the publisher's selection, per dataset, in the publisher's order: the pairs are
those rows whenever no row is dropped (a tie in a scored layout, which TRL cannot read at all). docs/mixtures.md has
the tables.
"""

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml
from datasets import Dataset, DatasetDict, IterableDataset, concatenate_datasets

from .given_ids import GIVEN_IDS, MADE_BY
from .layouts import feature_kind
from .options import LayoutOptions
from .overlap import warn_shared_pairs
from .pairs import DEFAULT_OPTIONS, SOURCE_DATASET, SOURCE_ROW, to_preference_dataset
from .sources import FILE_SPLIT, AnyDataset, data_file_type, load_raw
from .streams import StreamCounts, carrying

logger = logging.getLogger("dpo_min.data")  # the command shows this logger's lines

TRL_KEYS = ("path", "name", "data_dir", "data_files", "split", "columns", "fraction", "rename_columns")
HANDBOOK_KEYS = ("id", "config", "split", "columns", "weight", "rename_columns")
# The columns the handbook's run_dpo.py kept (columns_to_keep) when it read dataset_mixer, and dpo_min's given ids
# with what made them, which the other two forms keep: without them the text would be tokenized again.
LEGACY_KEPT_COLUMNS = ("messages", "chosen", "rejected", "prompt", "completion", "label", *GIVEN_IDS, *MADE_BY)


@dataclass
class Source:
    """One dataset of a mixture: where its rows are, and which columns of them."""

    path: str
    split: str = "train"
    config: str | None = None
    columns: list[str] | None = None
    rename: dict[str, str] | None = None
    load_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.path}[{self.split}]"


@dataclass
class Mixture:
    """The train rows as pairs, the held-out pairs (or None), and one line per dataset on what it gave and why."""

    train: AnyDataset
    held_out: Dataset | None
    lines: list[str]


# ---- the three forms --------------------------------------------------------------------------------------------
def trl_mixture(entries: Any, *, test_split_size: Any = None, streaming: bool = False, seed: int = 42,
                num_proc: int | None = None, options: LayoutOptions = DEFAULT_OPTIONS) -> Mixture:
    """TRL's `datasets:` block, as `trl.scripts.utils.get_dataset` reads it (its unseeded test split seeded here)."""
    sources, fractions = [], []
    for position, entry in enumerate(_entry_list(entries, "datasets")):
        _check_keys(entry, TRL_KEYS, f"datasets[{position}]", "path")
        sources.append(Source(entry["path"], entry.get("split", "train"), entry.get("name"), entry.get("columns"),
                              entry.get("rename_columns"), {key: entry[key] for key in ("data_dir", "data_files")
                                                            if entry.get(key) is not None}))
        fractions.append(entry.get("fraction"))
    raws = [_load_source(source, streaming) for source in sources]
    reasons = [f"all {len(raw)} rows (no fraction)" if isinstance(raw, Dataset) else "streamed whole" for raw in raws]
    if any(fraction is not None for fraction in fractions):
        raws, reasons = _trl_shares(raws, fractions, streaming)
    return _finish(sources, raws, reasons, test_split_size, seed, "TRL's train_test_split is unseeded", num_proc,
                   options, shuffle_seed=None)


def handbook_mixture(mixture: Any, *, test_split_size: Any = None, num_proc: int | None = None,
                     options: LayoutOptions = DEFAULT_OPTIONS) -> Mixture:
    """The alignment-handbook's `dataset_mixture:`, as its `src/alignment/data.py` `get_dataset` reads it."""
    if not isinstance(mixture, Mapping) or "datasets" not in mixture or set(mixture) - {"datasets", "seed",
                                                                                        "test_split_size"}:
        raise ValueError(f"dataset_mixture: a mapping of datasets, seed and test_split_size, got {mixture!r}")
    seed = mixture.get("seed", 0)
    size = test_split_size if test_split_size is not None else mixture.get("test_split_size")
    sources, weights = [], []
    for position, entry in enumerate(_entry_list(mixture["datasets"], "dataset_mixture.datasets")):
        where = f"dataset_mixture.datasets[{position}]"
        _check_keys(entry, HANDBOOK_KEYS, where, "id")
        weight = entry.get("weight", 1.0)  # the handbook's default
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight <= 1:
            raise ValueError(f"{where}: weight is the fraction of its rows taken, in [0, 1], got {weight!r}")
        sources.append(Source(entry["id"], entry.get("split", "train"), entry.get("config"), entry.get("columns"),
                              entry.get("rename_columns")))
        weights.append(weight)
    column_sets = [set(source.columns) for source in sources if source.columns is not None]
    if any(columns != column_sets[0] for columns in column_sets):
        raise ValueError(f"dataset_mixture: every dataset must keep the same columns, as the handbook requires; got "
                         f"{[sorted(columns) for columns in column_sets]}")
    raws, reasons = [], []
    for source, weight in zip(sources, weights):
        raw = _load_source(source, streaming=False)
        raws.append(raw.shuffle(seed=seed).select(range(int(len(raw) * weight))))
        reasons.append(f"weight {weight} of its {len(raw)} rows, shuffled with seed {seed}")
    return _finish(sources, raws, reasons, size, seed, "as the handbook splits", num_proc, options, shuffle_seed=seed)


def legacy_mixer(mixer: Any, splits: list[str] | None = None, configs: list[str] | None = None, *,
                 num_proc: int | None = None, options: LayoutOptions = DEFAULT_OPTIONS) -> Mixture:
    """The handbook's legacy `dataset_mixer: {id: fraction}` + `dataset_splits`, as its `mix_datasets` read it."""
    if not isinstance(mixer, Mapping) or not mixer:
        raise ValueError(f"dataset_mixer: a mapping of dataset: fraction of its train rows, got {mixer!r}")
    splits = ["train", "test"] if splits is None else list(splits)
    configs = [None] * len(mixer) if not configs else list(configs)
    if len(configs) != len(mixer):
        raise ValueError(f"dataset_configs: {len(configs)} names for {len(mixer)} datasets of dataset_mixer")
    unknown = [split for split in splits if "train" not in split and "test" not in split]
    if unknown:
        raise ValueError(f"dataset_splits: {unknown[0]!r} is neither a train nor a test split (its name must hold one)")
    train_splits = [split for split in splits if "train" in split]
    if len(train_splits) != 1:
        # mix_datasets pairs the k-th train split with the k-th dataset's fraction: only one train split each is right.
        raise ValueError(f"dataset_splits: give exactly one train split, got {train_splits}")
    sources, raws, reasons, held_out, absent = [], [], [], [], []
    for (name, fraction), config in zip(mixer.items(), configs):
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
            raise ValueError(f"dataset_mixer: {name}: a fraction of its train rows in [0, 1], got {fraction!r}")
        for split in splits:
            source = Source(name, split, config)
            if "train" not in split and data_file_type(name):
                # A file's one split is its train split: reading it as the test split too held out every train row.
                absent.append(f"{source.label}: nothing held out: a data file has one split, {FILE_SPLIT!r}")
                continue
            raw = _load_source(source, streaming=False)
            raw = raw.remove_columns([column for column in raw.column_names
                                      if column not in LEGACY_KEPT_COLUMNS and column != SOURCE_ROW])
            if "train" in split:
                sources.append(source)
                raws.append(raw.select(range(int(fraction * len(raw)))))
                reasons.append(f"fraction {fraction} of its {len(raw)} rows, the first ones")
            else:
                held_out.append((source, raw))
    mixture = _finish(sources, raws, reasons, None, 42, "", num_proc, options, shuffle_seed=42)
    mixture.lines += absent
    if held_out:
        parts = [_pairs(raw, source, num_proc, options) for source, raw in held_out]
        mixture.held_out = concatenate_datasets(parts).shuffle(seed=42)
        mixture.lines += [f"{source.label}: {len(part)} held-out rows: a test split, whole"
                          for (source, _), part in zip(held_out, parts)]
    return mixture


# ---- shared steps -----------------------------------------------------------------------------------------------
def _trl_shares(raws: list[AnyDataset], fractions: list[Any], streaming: bool) -> tuple[list[Dataset], list[str]]:
    """TRL's arithmetic, line for line: shares normalised, the mixture as large as the scarcest dataset allows."""
    if any(fraction is None for fraction in fractions):
        raise ValueError("datasets: `fraction` must be set for either all datasets in the mixture or none of them")
    if streaming:
        raise ValueError("datasets: a dataset `fraction` is not supported with streaming datasets")
    for position, fraction in enumerate(fractions):
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction < math.inf:
            raise ValueError(f"datasets[{position}]: fraction is its share of the mixture, a finite number >= 0, "
                             f"got {fraction!r}")
    if not sum(fractions) > 0:
        raise ValueError("datasets: every fraction is 0; give one a share > 0")
    weights = [fraction / sum(fractions) for fraction in fractions]
    total = min(len(raw) / weight for raw, weight in zip(raws, weights) if weight > 0)
    taken = [round(weight * total) for weight in weights]  # rows of each dataset
    reasons = [f"fraction {fraction} (share {weight:.3g}) of a {total:g}-row mixture: its first {count} of "
               f"{len(raw)} rows" for raw, fraction, weight, count in zip(raws, fractions, weights, taken)]
    return [raw.select(range(count)) for raw, count in zip(raws, taken)], reasons


def _finish(sources: list[Source], raws: list[AnyDataset], reasons: list[str], test_split_size: Any, seed: int,
            split_note: str, num_proc: int | None, options: LayoutOptions, shuffle_seed: int | None) -> Mixture:
    """Rows -> pairs per dataset, concatenated (and shuffled where the publisher shuffles), the held-out split."""
    if not sources:
        raise ValueError("the mixture lists no dataset")
    lines = [f"{source.label}: {len(raw) if isinstance(raw, Dataset) else 'streamed'} rows: {reason}"
             for source, raw, reason in zip(sources, raws, reasons)]
    # A share of 0 (or one that rounds to no row) is allowed, as its publisher allows it: that dataset gives nothing.
    given = [(raw, source) for raw, source in zip(raws, sources) if not isinstance(raw, Dataset) or len(raw)]
    if not given:
        raise ValueError(f"the mixture takes no rows: {'; '.join(lines)}")
    # A streamed mixture's datasets are read as one stream, counted in one StreamCounts.
    counts = StreamCounts() if any(isinstance(raw, IterableDataset) for raw, _ in given) else None
    parts = [_pairs(raw, source, num_proc, options, counts) for raw, source in given]
    kinds = {source.label: feature_kind(part.features["prompt"]) for (_, source), part in zip(given, parts)
             if part.features is not None}
    if len(set(kinds.values())) > 1:
        raise ValueError(f"a mixture cannot mix string and message-list prompts: {kinds}; use as_messages")
    try:
        combined = concatenate_datasets(parts)
    except ValueError as error:  # columns that differ (tools in one dataset only)
        raise ValueError(f"the datasets of the mixture do not have the same columns: {error}") from None
    if shuffle_seed is not None:
        combined = combined.shuffle(seed=shuffle_seed)
    if counts is not None:
        combined = carrying(combined, counts)
    size = held_out_size(test_split_size)
    if size is None:
        return Mixture(combined, None, lines)
    if isinstance(combined, IterableDataset):
        raise ValueError("test_split_size: a streamed mixture cannot be split; drop it or streaming")
    try:
        split = combined.train_test_split(test_size=size, seed=seed)
    except ValueError as error:
        raise ValueError(f"test_split_size {size!r} of a {len(combined)}-row mixture: {error}") from None
    lines.append(f"held out: {len(split['test'])} of the mixture's {len(combined)} rows, test_split_size {size!r} "
                 f"(train_test_split, seed {seed}{'; ' + split_note if split_note else ''})")
    return Mixture(split["train"], split["test"], lines)


def held_out_size(value: Any) -> int | float | None:
    """A count (an integer) or a fraction, as `train_test_split(test_size=...)` takes it; the flag's text parsed."""
    if isinstance(value, str):
        value = yaml.safe_load(value)
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return value
    raise ValueError(f"test_split_size: a number of rows or a fraction, got {value!r}")


def _load_source(source: Source, streaming: bool) -> AnyDataset:
    try:
        raw = load_raw(source.path, source.split, source.config, streaming, dict(source.load_kwargs),
                       source.rename or ())
    except ValueError as error:
        message = str(error).splitlines()[0]
        raise ValueError(message if source.path in message else f"{source.path}: {message}") from None
    if isinstance(raw, Dataset):  # errors then name a row by its place in the split, before any selection
        raw = raw.add_column(SOURCE_ROW, list(range(len(raw))))
    try:
        if source.columns is not None:
            raw = raw.select_columns(list(source.columns) + ([SOURCE_ROW] * isinstance(raw, Dataset)))
        return raw.rename_columns(dict(source.rename)) if source.rename else raw
    except ValueError as error:
        raise ValueError(f"{source.label}: {str(error).splitlines()[0]}") from None


def _pairs(raw: AnyDataset, source: Source, num_proc: int | None, options: LayoutOptions,
           counts: StreamCounts | None = None) -> AnyDataset:
    try:
        pairs = to_preference_dataset(raw, options=options, num_proc=num_proc, source=source.label, counts=counts)
    except ValueError as error:
        raise ValueError(f"{source.label}: {error}") from None
    # The dataset's name alone (not its split): what the card lists, and what a later error names the row by.
    if isinstance(pairs, IterableDataset):
        return pairs.map(lambda batch: {SOURCE_DATASET: [source.path] * len(batch["prompt"])}, batched=True)
    return pairs.add_column(SOURCE_DATASET, [source.path] * len(pairs))


def _entry_list(entries: Any, where: str) -> list[Mapping[str, Any]]:
    if not isinstance(entries, list) or not all(isinstance(entry, Mapping) for entry in entries):
        raise ValueError(f"{where}: must be a list of entries (mappings), got {entries!r}")
    return entries


def _check_keys(entry: Mapping[str, Any], known: tuple[str, ...], where: str, required: str) -> None:
    unknown = sorted(set(entry) - set(known))
    if required not in entry or unknown:
        raise ValueError(f"{where}: an entry needs {required!r} and may have {[k for k in known if k != required]}"
                         + (f"; unknown: {unknown}" if unknown else ""))
    if entry.get("columns") is not None and (not isinstance(entry["columns"], list) or not all(
            isinstance(column, str) for column in entry["columns"])):
        raise ValueError(f"{where}: columns is the list of columns to keep; to rename columns write rename_columns: "
                         f"{{source column: new name}}")
    if entry.get("rename_columns") is not None and not isinstance(entry["rename_columns"], Mapping):
        raise ValueError(f"{where}: rename_columns is a mapping {{source column: new name}}")


def load_mixture(entries: list[Mapping[str, Any]], seed: int = 42, num_proc: int | None = None,
                 test_split_size: float | int | None = None, **options: Any) -> DatasetDict:
    """TRL's `datasets:` mixture as pairs: `{"train": ...}`, and `"test"` with `test_split_size`, as TRL's
    `get_dataset` returns (its test split seeded with `seed` here). Each entry: `path` (a name, file or folder), and
    optionally `name`, `data_dir`, `data_files`, `split`, `columns` (to keep), `fraction` (its share of the
    mixture; on every entry or none), and dpo_min's `rename_columns`."""
    mixture = trl_mixture(entries, test_split_size=test_split_size, seed=seed, num_proc=num_proc,
                          options=LayoutOptions(**options))
    for line in mixture.lines:
        logger.info("mixture: %s", line)
    warn_shared_pairs(mixture.train, mixture.held_out, "the mixture")
    return DatasetDict({"train": mixture.train, **({"test": mixture.held_out} if mixture.held_out is not None
                                                   else {})})
