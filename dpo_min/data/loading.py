"""Preference data, the entry: `load_preference_dataset` reads a file, folder or `datasets` name (`sources.py`) and
brings its rows to validated prompt/chosen/rejected pairs (`pairs.py`); `dpo_min.tokenizing` then tokenizes them.
A stream counts what it reads and drops as it goes (`streams.py`); held-out pairs that are also train pairs are
counted in `overlap.py`, mixtures of datasets read in `mixtures.py`. Every bad row raises a ValueError naming its row
in the source (and its dataset, in a mixture) and the field.
"""

import os
from collections.abc import Mapping
from typing import Any

from datasets import Dataset

from .options import LayoutOptions
from .pairs import to_preference_dataset
from .sources import AnyDataset, load_raw
from .streams import StreamCounts


def load_preference_dataset(path_or_name: str, split: str = "train", *, config: str | None = None,
                            columns: Mapping[str, str] | None = None, streaming: bool = False,
                            num_proc: int | None = None, preference_label: str = "better_response_id",
                            no_prompt: bool = False, as_messages: bool = False, row_split: str = "train",
                            label_column: str | None = None, label_chosen: str | None = None,
                            label_rejected: str | None = None, counts: StreamCounts | None = None,
                            strict_pairs: bool = False, every_ranked_pair: bool = False,
                            **load_kwargs: Any) -> AnyDataset:
    """Load preference pairs from a JSON/JSONL/Parquet/CSV file (optionally .gz) or a `datasets` name.

    Returns a `Dataset` (an `IterableDataset` with `streaming`) with columns `prompt`, `chosen`, `rejected`
    (strings, or message lists), `source_row` (the row's index in the source split), and `tools` /
    `chat_template_kwargs` where the source has them. The layout is detected from the columns (see
    `layouts.LAYOUTS`); `columns` maps our names (prompt, chosen, rejected, system) to the source's. A stream
    counts what it reads and skips in `counts` (a new `StreamCounts` if not given; `stream_counts(stream)` is it).
    A row that cannot be a preference pair (`UNPAIRED`: no answer, no common prompt) is dropped and counted, unless
    `strict_pairs`, or most rows are such (a wrong layout): then it raises, naming the row. `every_ranked_pair`:
    Nectar's and UltraFeedback's (raw) rows give every better answer against every worse one, not one pair.
    """
    options = LayoutOptions(preference_label=preference_label, no_prompt=no_prompt, as_messages=as_messages,
                            row_split=row_split, label_column=label_column, label_chosen=label_chosen,
                            label_rejected=label_rejected, every_ranked_pair=every_ranked_pair)
    raw = load_raw(path_or_name, split, config, streaming, load_kwargs, (columns or {}).values())
    try:
        return to_preference_dataset(raw, columns=columns, options=options, num_proc=num_proc,
                                     source=os.path.basename(path_or_name), counts=counts, strict_pairs=strict_pairs)
    except ValueError as error:
        raise ValueError(f"{path_or_name}: {error}") from error


def load_rows(path_or_name: str, split: str = "train", config: str | None = None) -> Dataset:
    """One split's rows as the source holds them, read as `load_preference_dataset` reads its source (a file, a
    folder, a hub name), before any layout: the prompt-only rows of DPO in rounds. Raises ValueError naming it."""
    return load_raw(path_or_name, split, config, False, {})
