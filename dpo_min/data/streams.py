"""What a stream has read and dropped: a stream is converted and tokenized as it is read, so its drops are counted
as they happen, by reason, in a `StreamCounts` the stream carries (the command logs them); map-style data logs its
drops once. Every reason a pair is dropped for is named here, as the counts name it."""

import multiprocessing
from collections import Counter
from collections.abc import Mapping
from typing import Any

from datasets import IterableDataset

from .unpaired import UNPAIRED

SKIPPED = "skipped by the layout (ties)"
NO_COMPLETION = "with no completion token left after truncation"
SAME_COMPLETIONS = "with chosen identical to rejected after truncation"
DROP_REASONS = (NO_COMPLETION, SAME_COMPLETIONS)  # why a tokenized pair is dropped (`dpo_min.tokenizing`)
ALSO_HELD_OUT = "train pairs also held out"  # not dropped: counted (`overlap.count_shared_in_stream`)
_COUNTS = "_dpo_min_stream_counts"  # the attribute a stream of dpo_min carries its StreamCounts in


class StreamCounts:
    """What one stream has read and dropped, by reason (`NAMES`).

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
    """The counts a stream of dpo_min carries (a DataLoader's stream too, or a shard of it); None for others."""
    for _ in range(3):  # a DataLoader -> accelerate's IterableDatasetShard -> the stream
        if hasattr(stream, _COUNTS):
            return getattr(stream, _COUNTS)
        stream = getattr(stream, "dataset", None)
    return None


def counts_for(stream: IterableDataset, counts: StreamCounts | None) -> StreamCounts:
    """The counts a step on `stream` adds to: those given, else the stream's own, else new ones."""
    if counts is not None:
        return counts
    return stream_counts(stream) or StreamCounts()


def carrying(stream: IterableDataset, counts: StreamCounts) -> IterableDataset:
    """`stream`, carrying `counts` as its own (`stream_counts(stream)` is then `counts`)."""
    setattr(stream, _COUNTS, counts)
    return stream


def describe_stream_counts(counts: Mapping[str, int]) -> str:
    """'read 40 rows, dropped 3: 2 skipped by the layout (ties), 1 with no completion token left after truncation'."""
    dropped = {reason: counts.get(reason, 0) for reason in (SKIPPED, *UNPAIRED, *DROP_REASONS)
               if counts.get(reason, 0)}
    listed = ", ".join(f"{number} {reason}" for reason, number in dropped.items())
    shared = counts.get(ALSO_HELD_OUT, 0)
    return (f"read {counts.get('read', 0)} rows, dropped {sum(dropped.values())}" + (f": {listed}" if listed else "")
            + (f"; {shared} {ALSO_HELD_OUT} (the same prompt, chosen and rejected)" if shared else ""))
