"""The command's data phase: the pairs a run trains and evaluates on, from one dataset, a mixture or a stream, as
the plan says; and the local files and folders it reads, which the output folder must stay apart from."""

import json
import logging
import os
import sys
import traceback
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from datasets import Dataset

from .. import trainer_setup
from ..config import DPOMinConfig
from ..data.loading import load_preference_dataset
from ..data.mixtures import Mixture, handbook_mixture, legacy_mixer, trl_mixture
from ..data.options import LayoutOptions
from ..data.overlap import count_shared_in_stream, warn_shared_pairs
from ..data.pairs import SOURCE_DATASET
from ..data.streams import DROP_REASONS, SKIPPED, StreamCounts, stream_counts
from ..data.unpaired import UNPAIRED
from ..grouping import prompt_groups
from ..split import held_out_split
from .args import MIXTURE_KEYS, DataArguments, InputError, UsageError
from .model_setup import load_run_tokenizer
from .plan import Plan
from .recipe import _parse_json

EMBEDDED_DATA = Path(__file__).resolve().parents[2] / "data" / "hh-rlhf-harmless-single-turn.jsonl.gz"
EMBEDDED_DATASET_NAME = "Anthropic/hh-rlhf"  # its harmless-base test split, the file in data/
DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv")

logger = logging.getLogger("dpo_min.data")  # shown on stdout by _show_data_log



def load_pairs(plan: Plan) -> tuple[Dataset, Dataset | None]:
    """(train pairs, held-out pairs or None), validated."""
    data_args = plan.data
    _show_data_log(plan.is_main)
    mixture = _load_mixture(plan)
    if mixture is not None:
        train, held_out, source = mixture.train, mixture.held_out, "the mixture"
        if held_out is not None and data_args.eval_fraction is not None:
            # parse_args refuses eval_fraction beside a test_split_size, naming both as written; this is the rest
            raise UsageError("the mixture holds out its own rows (its test splits): eval_fraction would hold out "
                             "others; give one of them")
    else:
        source, train, held_out = _load_dataset(plan)
    train_read = train  # what reading dropped is noted on it (a stream counts on every later form of it too)
    if data_args.streaming:
        return _stream_pairs(train, source, plan)
    if mixture is not None and held_out is None and data_args.max_eval_samples is not None and \
            data_args.eval_fraction is None:
        # A stream holds out its first --max_eval_samples pairs; map-style data caps what it holds out.
        raise UsageError(f"--max_eval_samples {data_args.max_eval_samples} caps the held-out pairs, and the mixture "
                         "holds out none: hold some out with test_split_size (dataset_mixer: its test splits) or "
                         "--eval_fraction")
    if held_out is None and plan.eval_fraction > 0:
        train, held_out = _split(train, plan)
    if held_out is not None and data_args.max_eval_samples is not None:
        held_out = _capped(held_out, data_args.max_eval_samples, plan.args.listwise)
    if plan.reach is not None and len(train) > plan.reach and not plan.args.group_by_prompt:  # a cut would cut groups
        # Only the pairs the run will reach are tokenized (and, with precompute_ref_log_probs, scored).
        train = train.shuffle(seed=plan.seed).select(range(plan.reach))
    warn_shared_pairs(train, held_out, source)  # the pairs as trained and evaluated, whichever form split them
    return _with_dropped_rows(train, getattr(train_read, _DROPPED_ROWS, {})), held_out


def _load_dataset(plan: Plan) -> tuple[str, Any, Any]:
    """(where the pairs come from, the train split, the --eval_split or None) of one dataset."""
    data_args = plan.data
    source = data_args.dataset or str(EMBEDDED_DATA)
    stem = source[:-3] if source.endswith(".gz") else source
    if not os.path.exists(source) and data_args.dataset is None:
        raise InputError(f"the embedded pairs ({source}) come with a source checkout of dpo_min; pass --dataset")
    if not os.path.exists(source) and stem.endswith(DATA_SUFFIXES):
        raise UsageError(f"no such dataset file: {source}")
    counts = None if data_args.streaming else StreamCounts()  # a stream counts into its own
    train = _load(source, data_args.split, data_args, plan.args, counts)
    held_out = _load(source, data_args.eval_split, data_args, plan.args, counts) if data_args.eval_split and not \
        data_args.streaming else None
    return source, _with_dropped_rows(train, counts.snapshot()) if counts else train, held_out


def _split(pairs: Dataset, plan: Plan) -> tuple[Dataset, Dataset]:
    """The seeded split of one dataset, holding out the plan's count of its pairs; under group_by_prompt, of its
    prompts, each with all its pairs (a group cut in two would train on the prompt it is evaluated on)."""
    groups = prompt_groups(_grouped_prompts(pairs, plan)) if plan.args.group_by_prompt else \
        [[position] for position in range(len(pairs))]
    what = "prompts" if plan.args.group_by_prompt else "pairs"
    try:  # dpo_min.split, the split the rounds' held-out prompts take too
        train, held_out = held_out_split(len(groups), plan.eval_fraction, plan.seed)
    except ValueError:
        raise UsageError(f"--eval_fraction {plan.eval_fraction} of {len(groups)} {what} leaves no pair to train "
                         "on") from None
    if not held_out:
        raise UsageError(f"--eval_fraction {plan.eval_fraction} of {len(groups)} {what} holds out no pair")
    return tuple(pairs.select([position for group in part for position in groups[group]])
                 for part in (train, held_out))


def _grouped_prompts(pairs: Dataset, plan: Plan) -> list[Any]:
    """Each pair's prompt as the trainer groups it: its ids (a conversation with the template's default system
    message written out and one without it are one prompt), else, for a pair truncation drops, its JSON."""
    try:
        ids = trainer_setup.grouped_prompts(pairs, load_run_tokenizer(plan), plan.args)
    except ValueError as error:  # a row the trainer would refuse, refused before the model loads, in its words
        raise InputError(str(error).splitlines()[0]) from None
    return [json.dumps(prompt, sort_keys=True) if key is None else key for key, prompt in zip(ids, pairs["prompt"])]


def trained_sources(train_pairs: Any, data_args: DataArguments) -> dict[str, Any]:
    """The datasets the train pairs came from, each with its number of pairs: a mixture's from the pairs' own
    source column, whatever the mixture's entries look like; else the one dataset."""
    if SOURCE_DATASET in (getattr(train_pairs, "column_names", None) or []):
        return dict(sorted(Counter(train_pairs[SOURCE_DATASET]).items()))
    return {data_args.dataset or EMBEDDED_DATASET_NAME: pair_count(train_pairs)}


_DROPPED_ROWS = "_dpo_min_dropped_rows"  # what reading a map-style dataset dropped, noted on the train pairs


def _with_dropped_rows(pairs: Any, counts: Mapping[str, int]) -> Any:
    setattr(pairs, _DROPPED_ROWS, dict(counts))  # plain numbers: datasets may pickle the pairs
    return pairs


def dropped_rows(train_pairs: Any) -> dict[str, int]:
    """The rows reading dropped, by reason (ties, rows that cannot be pairs, and a stream's pairs cut unusable by
    truncation), as the train pairs note them; {} where they note none (a map-style mixture logs its own)."""
    counts = stream_counts(train_pairs)
    found = counts.snapshot() if counts is not None else getattr(train_pairs, _DROPPED_ROWS, {})
    return {reason: found[reason] for reason in (SKIPPED, *UNPAIRED, *DROP_REASONS) if found.get(reason)}


def pair_count(pairs: Any) -> int | None:
    """How many pairs a dataset holds; None for a stream, which has no length (metrics.json: null)."""
    return len(pairs) if hasattr(pairs, "__len__") else None


class _Stdout(logging.Handler):
    """Writes to the sys.stdout of the moment: a run's, not an earlier run's (which a test or notebook may have
    closed since)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), file=sys.stdout)


def _show_data_log(is_main: bool) -> None:
    """The data module's one line naming each dataset's layout, and its warnings, on stdout."""
    if not any(isinstance(handler, _Stdout) for handler in logger.handlers):
        logger.addHandler(_Stdout())
    logger.setLevel(logging.INFO if is_main else logging.WARNING)


def _stream_pairs(train: Any, source: str, plan: Plan) -> tuple[Any, Any]:
    data_args, args = plan.data, plan.args
    count = data_args.max_eval_samples
    if data_args.eval_split:  # the whole split, as without --streaming, or its first --max_eval_samples pairs
        split = _load(source, data_args.eval_split, data_args, args)  # a stream of its own, with its own counts
        held_out = _held_out_of_stream(split if count is None else split.take(count), stream_counts(split), source,
                                       f"split {data_args.eval_split!r}", whole=count is None)
        return count_shared_in_stream(train, held_out), held_out
    if not count:  # a stream has no length to take a fraction of (a fraction given is refused by the plan)
        if plan.eval_fraction:  # one dataset's default share, which map-style data would hold out
            print("held out no pairs: a stream has no length to hold out --eval_fraction of; --max_eval_samples N "
                  "holds out its first N pairs (training skips them), --eval_split evaluates a split")
        return train, None
    if data_args.eval_fraction == 0:  # asked for no evaluation, as map-style data
        return train, None
    if args.dataloader_num_workers > 1 and train.num_shards > 1:
        # datasets splits skip(n) among the workers, each skipping its share of its own files: held-out pairs of the
        # first file would train, and pairs of the others would be skipped unseen.
        raise UsageError(f"--dataloader_num_workers {args.dataloader_num_workers} on a stream of {train.num_shards} "
                         "files cannot skip the held-out first pairs exactly: give --eval_split, or at most 1 worker")
    # A stream cannot be split by fraction: the first max_eval_samples pairs are held out, training skips them.
    counts = stream_counts(train)  # skip and take make streams that do not carry them
    held_out = _held_out_of_stream(train.take(count), counts, source, "the stream's first pairs", whole=False)
    rest = train.skip(count)
    if next(iter(rest), None) is None:  # read before the model loads; the run's counts start at training
        raise InputError(f"{source}: --max_eval_samples {count} held out every pair of the stream "
                         f"({len(held_out)}): none is left to train on; hold out fewer")
    return count_shared_in_stream(rest, held_out, counts), held_out


def _held_out_of_stream(stream: Any, counts: StreamCounts | None, source: str, what: str, whole: bool) -> Dataset:
    before = counts.snapshot() if counts is not None else Counter()
    pairs = list(stream)
    if not pairs:
        raise InputError(f"{source}: {what} holds no pair to evaluate on")
    skipped = counts.snapshot()[SKIPPED] - before[SKIPPED] if counts is not None else 0
    # Read whole, the split's count of skipped rows is exact; a capped read converts rows beyond the cap too.
    print(f"held out {len(pairs)} pairs: {what}{', the whole split' if whole else ''}"
          f"{f' ({skipped} rows {SKIPPED})' if whole and skipped else ''}")
    return Dataset.from_list(pairs)


@contextmanager
def stream_rows_checked(streaming: bool) -> Iterator[None]:
    """A stream is read, validated and tokenized as it trains: a row refused then (given ids beside a rewritten text,
    a bad row past the first batch read before the model loaded) is the one line map-style data gives before the
    model loads, naming row and field (its ValueError's first line), not a traceback from the DataLoader."""
    try:
        yield
    except ValueError as error:
        refusal = _row_refusal(error) if streaming else None
        if refusal is None:
            raise
        raise InputError(refusal) from None


def _row_refusal(error: ValueError) -> str | None:
    """The message of a ValueError the package's data reading raised (a frame in dpo_min.data or dpo_min.tokenizing;
    a DataLoader worker's comes back with the worker's traceback as its text), else None: not the data's."""
    modules = {frame.f_globals.get("__name__", "") for frame, _ in traceback.walk_tb(error.__traceback__)}
    lines = str(error).strip().splitlines()
    if any(name == "dpo_min.tokenizing" or name.startswith("dpo_min.data.") for name in modules):
        return lines[0]
    if lines and lines[0].startswith("Caught ValueError in DataLoader worker") and any(
            f"dpo_min{os.sep}{part}" in line for line in lines for part in ("tokenizing.py", f"data{os.sep}")):
        return lines[-1].removeprefix("ValueError: ")
    return None


def _columns(data_args: DataArguments) -> dict[str, str] | None:
    columns = {name: getattr(data_args, f"{name}_column") for name in ("prompt", "chosen", "rejected", "system")}
    return {name: column for name, column in columns.items() if column} or None


def _layout_options(data_args: DataArguments) -> dict[str, Any]:
    names = ("preference_label", "no_prompt", "as_messages", "row_split", "label_column", "label_chosen",
             "label_rejected", "every_ranked_pair")
    return {name: getattr(data_args, name) for name in names}


def _load(source: str, split: str, data_args: DataArguments, args: DPOMinConfig,
          counts: StreamCounts | None = None) -> Any:
    try:
        return load_preference_dataset(source, split=split, config=data_args.dataset_config,
                                       columns=_columns(data_args), streaming=data_args.streaming,
                                       num_proc=args.dataset_num_proc, counts=counts,
                                       strict_pairs=data_args.strict_pairs, **_layout_options(data_args))
    except ValueError as error:  # a bad row or an unreadable file: the message names it
        raise InputError(f"{source}: {error}" if source not in str(error) else str(error)) from None
    except Exception as error:  # datasets' own errors for a name it cannot find or fetch
        raise InputError(f"cannot load dataset {source!r} (split {split!r}): {str(error).splitlines()[0]}") from None


def _load_mixture(plan: Plan) -> Mixture | None:
    """The recipe's mixture, in whichever of the three published forms it is written; None without one."""
    data_args, form, seed, num_proc = plan.data, plan.mixture, plan.seed, plan.args.dataset_num_proc
    if form is None:
        return None
    value = _mapping_or_list(getattr(data_args, form), form)
    options = LayoutOptions(**_layout_options(data_args))
    try:
        if form == "datasets":
            mixture = trl_mixture(value, test_split_size=data_args.test_split_size, streaming=data_args.streaming,
                                  seed=seed, num_proc=num_proc, options=options)
        elif form == "dataset_mixture":
            mixture = handbook_mixture(value, test_split_size=data_args.test_split_size, num_proc=num_proc,
                                       options=options)
        else:
            mixture = legacy_mixer(value, data_args.dataset_splits, data_args.dataset_configs, num_proc=num_proc,
                                   options=options)
    except ValueError as error:
        raise InputError(str(error).splitlines()[0]) from None
    except Exception as error:  # datasets' own errors for a name it cannot find or fetch
        raise InputError(f"cannot load the mixture: {str(error).splitlines()[0]}") from None
    for line in mixture.lines:
        logger.info("mixture: %s", line)
    return mixture


def local_data(data_args: DataArguments) -> list[tuple[str, str]]:
    """The local files and folders the run reads, each with the option that names it: --dataset, and each mixture
    entry's path (TRL), id (handbook), name (legacy mixer) and data_files. A name that is no path here is a hub
    dataset's; a mixture that does not parse is said where the mixture is read."""
    named = [("--dataset", data_args.dataset)]
    for key in MIXTURE_KEYS:
        value = getattr(data_args, key)
        if value is None:
            continue
        with suppress(UsageError):
            value = _mapping_or_list(value, key)
        if key == "dataset_mixer" and isinstance(value, dict):
            named += [(key, name) for name in value]
        entries = value.get("datasets") if key == "dataset_mixture" and isinstance(value, dict) else value
        for position, entry in enumerate(entries if isinstance(entries, list) else []):
            if not isinstance(entry, dict):
                continue
            where = f"{key}[{position}]" if key == "datasets" else f"{key}.datasets[{position}]"
            named += [(f"{where}.{field}", entry.get(field)) for field in ("path", "id")]
            files = entry.get("data_files")
            for group in files.values() if isinstance(files, dict) else [files]:
                named += [(f"{where}.data_files", name) for name in (group if isinstance(group, list) else [group])]
    return [(option, name) for option, name in named if isinstance(name, str) and os.path.exists(name)]


def _mapping_or_list(value: Any, name: str) -> Any:
    """A recipe's value as it is; JSON text (a library caller's DataArguments) read as the flag's is."""
    return _parse_json(value, f"--{name}") if isinstance(value, str) else value


def _capped(held_out: Dataset, count: int, whole_groups: bool) -> Dataset:
    """The first `count` held-out pairs (--max_eval_samples). plackett_luce ranks whole groups: a cap that cuts one
    is refused, naming it (what is left of a group may no longer order its answers, a tie the data does not hold)."""
    capped = held_out.select(range(min(count, len(held_out))))
    if not whole_groups or len(capped) == len(held_out):
        return capped
    groups = prompt_groups([json.dumps(prompt, sort_keys=True) for prompt in held_out["prompt"]])
    cut = next((group for group in groups if group[0] < count <= group[-1]), None)
    if cut is None:
        return capped
    whole = " or ".join(str(n) for n in (_whole_cut(groups, count, min), _whole_cut(groups, count, max)) if n)
    rows = held_out["source_row"] if "source_row" in held_out.column_names else range(len(held_out))
    kept = sum(position < count for position in cut)
    raise UsageError(f"--max_eval_samples {count} cuts the held-out group of row {rows[cut[0]]} ({kept} of its "
                     f"prompt's {len(cut)} pairs kept), and loss_type plackett_luce ranks whole groups: give "
                     f"--max_eval_samples {whole}")


def _whole_cut(groups: list[list[int]], count: int, nearest: Any) -> int:
    """The nearest count of first pairs below (`min`) or above (`max`) `count` that cuts no group."""
    while straddled := [group for group in groups if group[0] < count <= group[-1]]:
        count = nearest(group[0] if nearest is min else group[-1] + 1 for group in straddled)
    return count
