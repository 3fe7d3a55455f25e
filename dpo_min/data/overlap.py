"""Held-out pairs that are also train pairs, by content: split apart by row, duplicate rows or a dataset listed twice
still put the same pair on both sides, and its held-out scores then measure recall. Counted and warned (a stream
counts them as it is read), never dropped."""

import json
import logging
from collections import Counter
from collections.abc import Iterable

from datasets import Dataset, IterableDataset

from .pairs import PAIR_COLUMNS
from .sources import AnyDataset
from .streams import ALSO_HELD_OUT, StreamCounts, carrying, counts_for

logger = logging.getLogger("dpo_min.data")


def _pair_keys(pairs: AnyDataset) -> Iterable[str]:
    """Each pair's content (prompt, chosen, rejected) as one text, batch by batch."""
    for batch in pairs.select_columns(list(PAIR_COLUMNS)).iter(batch_size=1000):
        yield from (json.dumps(pair, sort_keys=True) for pair in zip(*(batch[name] for name in PAIR_COLUMNS)))


def count_shared_pairs(train: Dataset, held_out: Dataset) -> int:
    """How many held-out pairs are also train pairs by content."""
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
    counts = counts_for(train, counts)

    def count(batch: dict[str, list]) -> dict[str, list]:
        keys = (json.dumps(pair, sort_keys=True) for pair in zip(*(batch[name] for name in PAIR_COLUMNS)))
        counts.add({ALSO_HELD_OUT: sum(key in held for key in keys)})
        return batch
    return carrying(train.map(count, batched=True, features=train.features), counts)
