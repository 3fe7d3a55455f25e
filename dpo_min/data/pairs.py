"""Rows -> validated preference pairs: the dataset's layout (`layouts.py`, detected once from its columns) brings
each row to prompt/chosen/rejected, and every row is validated here, once, in one loop (`_pairs_of`), whether the
rows come as a list or as a `datasets.map` batch (parallel with `num_proc`, and cached by the datasets fingerprint).
A bad row raises a ValueError naming its row in the source (and its dataset, in a mixture) and the field; a tie is
left out, a row that cannot be a pair (`unpaired.Unpaired`) left out and counted unless `strict_pairs`."""

import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from datasets import Dataset, IterableDataset

from .columns import check_mapping, rename_columns
from .given_ids import GIVEN_IDS, MADE_BY
from .layouts import (
    CARRIED_COLUMNS,
    KEPT_WHOLE,
    Layout,
    detect_layout,
    feature_kind,
    gives_several_pairs,
    layout_by_name,
    to_pair,
    value_kind,
)
from .options import LayoutOptions
from .sources import AnyDataset, mixed_kinds
from .streams import SKIPPED, StreamCounts, carrying
from .unpaired import LeftOut, Unpaired, note_in_stream, refuse_most_unpaired

logger = logging.getLogger("dpo_min.data")

PAIR_COLUMNS = ("prompt", "chosen", "rejected")
SOURCE_ROW, SOURCE_DATASET = "source_row", "source_dataset"  # where a pair came from, for error messages
DEFAULT_OPTIONS = LayoutOptions()


def to_preference_rows(rows: Iterable[Mapping[str, Any]], columns: Mapping[str, str] | None = None,
                       options: LayoutOptions = DEFAULT_OPTIONS, strict_pairs: bool = False) -> list[dict[str, Any]]:
    """Bring each row to {prompt, chosen, rejected}, validating it. Raises ValueError naming row and field; a row that
    cannot be a pair is left out with a warning, as `load_preference_dataset` does."""
    return [{name: value for name, value in pair.items() if name != SOURCE_ROW}
            for pair in to_pairs(rows, columns, options, strict_pairs)]


def to_pairs(rows: Iterable[Mapping[str, Any]], columns: Mapping[str, str] | None = None,
             options: LayoutOptions = DEFAULT_OPTIONS, strict_pairs: bool = False) -> list[dict[str, Any]]:
    """Rows given as a list -> validated pairs, each with its `source_row` (its index in the list). Rows that cannot
    be pairs are left out with one warning, and refused where they are most rows."""
    rows = list(rows)
    if not rows:
        return []
    if columns:
        check_mapping(columns, list(rows[0]))
        rows = [rename_columns(row, columns) for row in rows]
    layout = _detect(rows[0] if isinstance(rows[0], Mapping) else {}, None, options)
    kind = _first_kind(rows, layout, options, strict_pairs)
    kept, unpaired = _pairs_of(rows, range(len(rows)), layout, options, None, kind, strict_pairs)
    if unpaired:
        left_out = {reason: len(found) for reason, found in unpaired.items()}
        refuse_most_unpaired(next(iter(unpaired.values()))[0][1], left_out, len(rows))
        logger.warning("dropped %d of %d rows: %s", sum(left_out.values()), len(rows),
                       ", ".join(f"{number} {reason}" for reason, number in left_out.items()))
    return [{**pair, SOURCE_ROW: index} for index, pair in kept]


def _first_kind(rows: list[Any], layout: Layout, options: LayoutOptions, strict_pairs: bool) -> bool | None:
    """Whether the list's first pair is conversational: every pair of the list must be as it is. The rows before it
    are ties or unpaired, so reading them here raises only what `_pairs_of` would raise first."""
    for index, row in enumerate(rows):
        found = pair_or_reason(layout, row, index, options, strict_pairs)
        found = found[0] if isinstance(found, list) and found else found
        if isinstance(found, dict):
            return isinstance(found["prompt"], list)
    return None


def _pairs_of(rows: Iterable[Any], labels: Iterable[Any], layout: Layout, options: LayoutOptions,
              columns: Mapping[str, str] | None, conversational: bool | None,
              strict_pairs: bool) -> tuple[list[tuple[int, dict[str, Any]]], LeftOut]:
    """The loop every row goes through: (position, pair) of each pair a row gives (a ranked row several), and the
    rows that cannot be (`UNPAIRED`) by reason; ties are left out. Every pair must be `conversational` or not (None:
    not checked)."""
    kept, unpaired = [], {}
    for position, (row, label) in enumerate(zip(rows, labels)):
        found = pair_or_reason(layout, rename_columns(row, columns) if columns else row, label, options, strict_pairs)
        if isinstance(found, tuple):
            unpaired.setdefault(found[0], []).append((label, found[1]))
        elif found is not None:
            for pair in found if isinstance(found, list) else [found]:
                _check_kind(pair, label, conversational)
                kept.append((position, pair))
    return kept, unpaired


def pair_or_reason(layout: Layout, row: Mapping[str, Any], label: Any, options: LayoutOptions,
                   strict_pairs: bool, validate: bool = True) -> dict[str, Any] | tuple[str, str] | None:
    """The row's pair, None for a tie, or (reason, the layout's message) for a row that cannot be a pair."""
    try:
        return to_pair(layout, row, label, options) if validate else layout.to_pair(row, label, options)
    except Unpaired as error:
        if strict_pairs:
            raise
        return error.reason, str(error)


def _check_kind(pair: Mapping[str, Any], label: int | str, conversational: bool | None) -> None:
    """Standard and conversational pairs cannot share a dataset (see `sources.mixed_kinds`)."""
    if conversational is not None and isinstance(pair["prompt"], list) != conversational:
        kinds = ("text", "messages") if conversational else ("messages", "text")
        raise ValueError(mixed_kinds(label, "prompt", *kinds))


def _convert_batch(batch: dict[str, list], indices: list[int], layout_name: str, options: LayoutOptions,
                   columns: Mapping[str, str] | None, conversational: bool | None, keep: tuple[str, ...] = (),
                   counts: StreamCounts | None = None, strict_pairs: bool = False) -> dict[str, list]:
    """A map's batch of rows -> validated pairs, with the columns they carry. A stream counts the rows it leaves out
    here, map-style data once the map is done (`_note_map_drops`)."""
    rows = list(batch_rows(batch))
    labels = [row_label(batch, position, index) for position, index in enumerate(indices)]
    kept, unpaired = _pairs_of(rows, labels, layout_by_name(layout_name), options, columns, conversational,
                               strict_pairs)
    out = {name: [pair[name] for _, pair in kept] for name in PAIR_COLUMNS}
    out[SOURCE_ROW] = [rows[position].get(SOURCE_ROW, indices[position]) for position, _ in kept]
    for name in (name for name in (*CARRIED_COLUMNS, *GIVEN_IDS, *MADE_BY, *keep) if name in batch):
        out[name] = [rows[position][name] for position, _ in kept]
    if counts is not None:  # a stream: its drops are counted as they happen (see StreamCounts)
        unpaired_rows, paired_rows = sum(map(len, unpaired.values())), len({position for position, _ in kept})
        counts.add({"read": len(indices), SKIPPED: len(indices) - paired_rows - unpaired_rows,
                    **{reason: len(found) for reason, found in unpaired.items()}})
        note_in_stream(unpaired, counts)
    return out


def to_preference_dataset(dataset: AnyDataset, columns: Mapping[str, str] | None = None,
                          options: LayoutOptions = DEFAULT_OPTIONS, num_proc: int | None = None,
                          source: str = "", keep: tuple[str, ...] = (),
                          counts: StreamCounts | None = None, strict_pairs: bool = False) -> AnyDataset:
    """A loaded dataset in any known layout -> validated prompt/chosen/rejected/source_row columns (a cached `map`),
    and the columns named in `keep`. Rows read and left out (ties, `UNPAIRED` rows unless `strict_pairs`) are added
    to `counts` (a stream's: see StreamCounts)."""
    first = first_row(dataset)
    if columns:
        check_mapping(columns, list(first))
        first = rename_columns(first, columns)
    layout = _detect(first, None if columns else dataset.features, options, source)
    # The kind every pair must have is the first row's. Not validated here: the map validates that row with the
    # others. None: a tie; a tuple: unpaired (then the kinds are not checked).
    first_pair = pair_or_reason(layout, first, 0, options, strict_pairs, validate=False)
    first_pair = first_pair[0] if isinstance(first_pair, list) and first_pair else first_pair
    conversational = None if not isinstance(first_pair, dict) else (
        options.as_messages or isinstance(first_pair["prompt"], list))
    fn_kwargs = {"layout_name": layout.name, "options": options, "columns": dict(columns) if columns else None,
                 "conversational": conversational, "keep": tuple(keep), "strict_pairs": strict_pairs}
    map_kwargs: dict[str, Any] = {"batched": True, "with_indices": True, "remove_columns": column_names(dataset),
                                  "fn_kwargs": fn_kwargs}
    if isinstance(dataset, IterableDataset):  # counted as it is read, in the workers that read it too
        counts = fn_kwargs["counts"] = counts if counts is not None else StreamCounts()
        return carrying(dataset.map(_convert_batch, **map_kwargs), counts)
    # Map-style: the datasets cache keys the map by fn_kwargs, which hold no counts; they are counted once, here.
    map_kwargs.update(num_proc=num_proc, desc=f"Reading {layout.name} pairs")
    converted = dataset.map(_convert_batch, **map_kwargs)
    _note_map_drops(dataset, converted, layout, options, columns, counts, source)
    return converted


def _note_map_drops(dataset: Dataset, converted: Dataset, layout: Layout, options: LayoutOptions,
                    columns: Mapping[str, str] | None, counts: StreamCounts | None, source: str) -> None:
    """What a map-style read left out, counted and logged once: most rows unpaired is refused."""
    left_out: LeftOut = {}
    # A map that kept no row writes no columns at all: no source_row to read. A ranked row gives several pairs.
    kept = converted[SOURCE_ROW] if len(converted) else []
    kept = list(dict.fromkeys(kept)) if gives_several_pairs(layout, options) else kept
    if len(kept) < len(dataset):
        labels = dataset[SOURCE_ROW] if SOURCE_ROW in dataset.column_names else range(len(dataset))
        left_out = left_out_rows(dataset, labels, kept, layout, options, columns)
    ties = len(dataset) - len(kept) - sum(map(len, left_out.values()))
    if left_out:
        refuse_most_unpaired(min(rows[0] for rows in left_out.values())[1],
                             {reason: len(rows) for reason, rows in left_out.items()}, len(dataset))
    if not len(converted):  # the rows the layout skips are most of them, or all
        listed = ", ".join([f"{ties} that the {layout.name} layout skips ({layout.skips})"] +
                           [f"{len(rows)} {reason}" for reason, rows in left_out.items()])
        raise ValueError(f"no pair in its {len(dataset)} rows: {listed}")
    if counts is not None:
        counts.add({"read": len(dataset), SKIPPED: ties, **{reason: len(rows) for reason, rows in left_out.items()}})
    if ties:
        logger.warning("%s: dropped %d of %d rows that the %s layout skips (%s)", source or "data", ties,
                       len(dataset), layout.name, layout.skips)
    for reason, rows in left_out.items():
        logger.warning("%s: dropped %d of %d rows %s; first source rows: %s", source or "data", len(rows),
                       len(dataset), reason, ", ".join(str(label) for label, _ in rows[:10]))


def left_out_rows(dataset: Dataset, labels: Sequence[Any], kept_labels: Sequence[Any], layout: Layout,
                  options: LayoutOptions, columns: Mapping[str, str] | None) -> LeftOut:
    """The rows of `dataset` (labelled `labels`) that a map kept no pair of (`kept_labels`), other than ties. A
    cached map says nothing, so the missing rows are read again: ties and unpaired rows only, few."""
    kept, missing = Counter(kept_labels), []
    for position, label in enumerate(labels):
        if kept[label]:
            kept[label] -= 1
        else:
            missing.append(position)
    left_out: LeftOut = {}
    for position, row in zip(missing, dataset.select(missing)):
        label = labels[position]
        found = pair_or_reason(layout, rename_columns(row, columns) if columns else row, label, options, False)
        if isinstance(found, tuple):
            left_out.setdefault(found[0], []).append((label, found[1]))
    return left_out


def _detect(first: Mapping[str, Any], features: Any, options: LayoutOptions, source: str = "") -> Layout:
    kinds = ({name: feature_kind(feature) for name, feature in features.items()} if features
             else {name: value_kind(value) for name, value in first.items()})
    layout = detect_layout(kinds, first, options)
    logger.info("%slayout %s (as %s), from columns [%s]", f"{source}: " if source else "", layout.name,
                layout.described(), ", ".join(kinds))
    if options.every_ranked_pair and layout.name not in ("ranked", *KEPT_WHOLE):
        logger.warning("%severy_ranked_pair changes nothing: the %s layout has no ranked answers (it keeps every "
                       "ranked answer of %s; the ranked layout pairs every answer anyway)", f"{source}: " if source
                       else "", layout.name, " and ".join(KEPT_WHOLE))
    return layout


def row_label(batch: Mapping[str, list], position: int, index: int) -> int | str:
    """How an error names a batch's row: its row in the source, and its dataset in a mixture ('3 of hh.jsonl')."""
    row = batch[SOURCE_ROW][position] if SOURCE_ROW in batch else index
    return f"{row} of {batch[SOURCE_DATASET][position]}" if SOURCE_DATASET in batch else row


def batch_rows(batch: Mapping[str, list]) -> Iterable[dict[str, Any]]:
    """A map's batch (columns of values) as rows."""
    names = list(batch)
    return (dict(zip(names, values)) for values in zip(*batch.values()))


def first_row(dataset: Any) -> dict[str, Any]:
    if isinstance(dataset, Dataset):
        if len(dataset) == 0:
            raise ValueError("the dataset holds no rows")
        return dataset[0]
    try:
        return dict(next(iter(dataset)))
    except StopIteration:
        raise ValueError("the dataset holds no rows") from None


def column_names(dataset: AnyDataset) -> list[str]:
    """A dataset's columns; a stream of unknown features shows them in its first row."""
    return dataset.column_names if dataset.column_names is not None else list(first_row(dataset))
