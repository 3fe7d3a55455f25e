"""A stream's counts (issue 26): each stream has its own, and DataLoader workers that read it add to them."""

import json
import os
from collections import Counter

import pytest
from datasets import Dataset
from torch.utils.data import DataLoader

from dpo_min.data.loading import load_preference_dataset
from dpo_min.data.overlap import count_shared_in_stream
from dpo_min.data.streams import ALSO_HELD_OUT, NO_COMPLETION, SAME_COMPLETIONS, SKIPPED, StreamCounts, stream_counts
from dpo_min.tokenizing import tokenize_dataset

HAIKU = [{"role": "user", "content": "Write a haiku."}]
LONG = [{"role": "user", "content": "word " * 60}]  # fills max_length=48: no completion token is left
OPENING = "the same opening words, " * 8  # chosen and rejected cut inside it: the same ids twice


def helpsteer3_row(i):
    """Row i of a HelpSteer3 file whose kind follows i % 6: 0 and 3 a tie, 1 a prompt that fills max_length, 2 two
    answers cut to the same ids, 4 and 5 a usable pair (unique by its answer)."""
    kind = i % 6
    if kind in (0, 3):
        return {"context": HAIKU, "response1": f"a{i}", "response2": f"b{i}", "overall_preference": 0}
    if kind == 1:
        return {"context": LONG, "response1": f"a{i}", "response2": f"b{i}", "overall_preference": 1}
    if kind == 2:
        return {"context": HAIKU, "response1": OPENING + "yes", "response2": OPENING + f"no{i}",
                "overall_preference": 1}
    return {"context": HAIKU, "response1": f"Leaves fall {i}", "response2": "no", "overall_preference": -2}


def expected_counts(rows):
    """The counts of `rows`, found from how they were made, not by the data code."""
    kinds = [i % 6 for i in rows]
    return {"read": len(kinds), SKIPPED: sum(kind in (0, 3) for kind in kinds),
            NO_COMPLETION: kinds.count(1), SAME_COMPLETIONS: kinds.count(2),
            "given": sum(kind in (4, 5) for kind in kinds)}


def write_rows(path, rows):
    path.write_text("".join(json.dumps(helpsteer3_row(i)) + "\n" for i in rows))
    return path


def read_counts(counts, before):
    after = counts.snapshot()
    after.subtract(before)
    return {name: after[name] for name in ("read", SKIPPED, NO_COMPLETION, SAME_COMPLETIONS)}


def test_a_stream_read_by_two_dataloader_workers_counts_every_row_exactly(tmp_path, tokenizer):
    folder = tmp_path / "helpsteer3"
    folder.mkdir()
    write_rows(folder / "a.jsonl", range(100))  # two files: two shards, one for each worker
    write_rows(folder / "b.jsonl", range(100, 200))
    stream = tokenize_dataset(load_preference_dataset(str(folder), streaming=True), tokenizer, max_length=48)
    counts = stream_counts(stream)
    before = counts.snapshot()  # building the stream read its first rows to learn their columns
    given = [row for batch in DataLoader(stream, batch_size=8, num_workers=2, collate_fn=list) for row in batch]
    expected = expected_counts(range(200))
    assert expected == {"read": 200, SKIPPED: 67, NO_COMPLETION: 34, SAME_COMPLETIONS: 33, "given": 66}
    assert read_counts(counts, before) == {name: expected[name] for name in StreamCounts.NAMES[:4]}
    assert len(given) == expected["given"]
    # The same files counted apart: map-style, read whole in this process.
    whole = StreamCounts()
    pairs = tokenize_dataset(load_preference_dataset(str(folder), counts=whole), tokenizer, max_length=48,
                             counts=whole)
    assert len(pairs) == len(given) and read_counts(whole, Counter()) == read_counts(counts, before)
    assert sorted(row["chosen_ids"] for row in given) == sorted(pairs["chosen_ids"])


def test_two_streams_in_one_process_are_counted_apart(tmp_path, tokenizer):
    first = tokenize_dataset(load_preference_dataset(str(write_rows(tmp_path / "first.jsonl", range(30))),
                                                     streaming=True), tokenizer, max_length=48)
    second = tokenize_dataset(load_preference_dataset(str(write_rows(tmp_path / "second.jsonl", range(4, 6))),
                                                      streaming=True), tokenizer, max_length=48)
    assert stream_counts(first) is not stream_counts(second)
    befores = stream_counts(first).snapshot(), stream_counts(second).snapshot()
    assert len(list(zip(first, second))) == 2  # read side by side, until second ends
    list(first)
    # Each read converts a batch of up to 1000 rows: first was read whole twice, second once.
    once = expected_counts(range(30))
    assert read_counts(stream_counts(first), befores[0]) == {name: 2 * once[name] for name in
                                                              ("read", SKIPPED, NO_COMPLETION, SAME_COMPLETIONS)}
    assert read_counts(stream_counts(second), befores[1]) == {"read": 2, SKIPPED: 0, NO_COMPLETION: 0,
                                                               SAME_COMPLETIONS: 0}


def test_counts_passed_in_are_the_ones_counted_and_a_shared_pair_count_goes_to_the_train_stream(tmp_path):
    counts, other = StreamCounts(), StreamCounts()
    path = write_rows(tmp_path / "pairs.jsonl", range(12))
    train = load_preference_dataset(str(path), streaming=True, counts=counts)
    held_out = load_preference_dataset(str(path), streaming=True, counts=other)
    assert stream_counts(train) is counts and stream_counts(held_out) is other
    held = Dataset.from_list([{name: pair[name] for name in ("prompt", "chosen", "rejected")}
                              for pair in held_out.take(2)])
    shared = count_shared_in_stream(train, held)
    assert stream_counts(shared) is counts
    before = counts.snapshot()
    assert len(list(shared)) == 12 - 4  # four ties
    assert read_counts(counts, before)["read"] == 12 and counts.snapshot()[ALSO_HELD_OUT] - before[ALSO_HELD_OUT] == 2
    assert other.snapshot()[ALSO_HELD_OUT] == 0


def test_the_command_counts_a_stream_its_two_dataloader_workers_read(tmp_path, tiny_model_dir, capsys):
    from dpo_min.train import main

    # Rows 0-1 are held out (both usable: kinds 4 and 5); then 12 rows of kinds 0-5 twice.
    path = tmp_path / "helpsteer3.jsonl"
    path.write_text("".join(json.dumps(helpsteer3_row(i)) + "\n" for i in (4, 5, *range(6, 18))))
    code = main(["--model", str(tiny_model_dir), "--dataset", str(path), "--streaming", "--output_dir",
                 str(tmp_path / "run"), "--max_steps", "2", "--per_device_train_batch_size", "2",
                 "--max_eval_samples", "2", "--max_length", "48", "--dataloader_num_workers", "2",
                 "--precompute_ref_log_probs", "false", "--num_samples", "1", "--max_new_tokens", "2",
                 "--logging_steps", "1", "--disable_tqdm", "true"])
    assert code == 0
    out = capsys.readouterr().out
    assert "held out 2 pairs: the stream's first pairs" in out
    # In the run the stream is read from its start again: all 14 rows are converted; the 2 held out are skipped
    # before tokenizing, so the unusable pairs counted are those of rows 6-17.
    assert (f"stream, in the run: read 14 rows, dropped 8: 4 {SKIPPED}, 2 {NO_COMPLETION}, 2 {SAME_COMPLETIONS}\n"
            in out), out


def test_a_streamed_mixture_counts_its_datasets_as_one_stream(tmp_path):
    from dpo_min.data.mixtures import trl_mixture

    paths = [write_rows(tmp_path / "a.jsonl", range(6)), write_rows(tmp_path / "b.jsonl", range(6, 18))]
    train = trl_mixture([{"path": str(path)} for path in paths], streaming=True).train
    counts = stream_counts(train)
    before = counts.snapshot()
    assert len(list(train)) == 18 - 6  # six ties
    assert read_counts(counts, before) == {"read": 18, SKIPPED: 6, NO_COMPLETION: 0, SAME_COMPLETIONS: 0}


def test_held_out_first_pairs_of_a_stream_of_several_files_read_by_several_workers_are_refused(tmp_path, capsys):
    from dpo_min.train import main

    folder = tmp_path / "data"
    folder.mkdir()
    for part in (0, 1):
        (folder / f"part-{part}.jsonl").write_text("".join(
            json.dumps({"prompt": f"F{part}-{i}", "chosen": "yes", "rejected": "no"}) + "\n" for i in range(6)))
    # What the refusal prevents: datasets splits skip(2) between the two workers, one pair of each file.
    stream = load_preference_dataset(str(folder), streaming=True)
    assert stream.num_shards == 2
    trained = [row["prompt"] for row in DataLoader(stream.skip(2), batch_size=None, num_workers=2)]
    held_out = [row["prompt"] for row in stream.take(2)]
    assert held_out == ["F0-0", "F0-1"] and "F0-1" in trained and "F1-0" not in trained
    argv = ["--model", "unused", "--dataset", str(folder), "--streaming", "--max_steps", "1", "--output_dir",
            str(tmp_path / "run"), "--max_eval_samples", "2", "--precompute_ref_log_probs", "false"]
    assert main([*argv, "--dataloader_num_workers", "2"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "--dataloader_num_workers 2 on a stream of 2 files cannot skip the held-out first pairs exactly: give "
        "--eval_split, or at most 1 worker")
    assert not (tmp_path / "run").exists()


# ---- what a stream holds out (issue 30) -------------------------------------------------------------------------
def plain_rows(path, name, count):
    path.write_text("".join(json.dumps({"prompt": f"{name}{i}", "chosen": "yes", "rejected": "no"}) + "\n"
                            for i in range(count)))
    return str(path)


def stream_pairs_of(tmp_path, **data):
    """The command's data step alone on DataArguments(streaming=True, **data): (train prompts, held-out prompts)."""
    from dpo_min import DPOMinConfig, train
    from dpo_min.train.args import DataArguments, ModelArguments

    args = DPOMinConfig(output_dir=str(tmp_path / "out"), max_steps=10, precompute_ref_log_probs=False,
                        report_to=[])
    plan = train.decide(ModelArguments(), DataArguments(streaming=True, **data), args)
    pairs, held_out = train.load_pairs(plan)
    return [pair["prompt"] for pair in pairs], None if held_out is None else held_out["prompt"]


def test_a_stream_holds_out_its_first_max_eval_samples_pairs_alone_or_mixed_and_says_when_it_holds_out_none(
        tmp_path, capsys):
    a, b = plain_rows(tmp_path / "a.jsonl", "a", 6), plain_rows(tmp_path / "b.jsonl", "b", 6)
    rows = [f"a{i}" for i in range(6)] + [f"b{i}" for i in range(6)]  # a TRL mixture's order: its entries in turn
    one = stream_pairs_of(tmp_path, dataset=a, max_eval_samples=2)
    assert one == (rows[2:6], rows[:2])
    mixed = stream_pairs_of(tmp_path, datasets=json.dumps([{"path": a}, {"path": b}]), max_eval_samples=3)
    assert mixed == (rows[3:], rows[:3])  # before issue 30: nothing held out, every pair trained
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("held out")]
    assert said == ["held out 2 pairs: the stream's first pairs", "held out 3 pairs: the stream's first pairs"]
    # Without --max_eval_samples one dataset, which map-style holds out 5% of, holds out nothing, and says so
    assert stream_pairs_of(tmp_path, dataset=a) == (rows[:6], None)
    assert ("held out no pairs: a stream has no length to hold out --eval_fraction of; --max_eval_samples N holds "
            "out its first N pairs") in capsys.readouterr().out
    # ... a mixture, as map-style, holds out nothing
    assert stream_pairs_of(tmp_path, datasets=json.dumps([{"path": a}])) == (rows[:6], None)
    assert "held out" not in capsys.readouterr().out


def test_a_fraction_of_a_stream_or_a_cap_on_nothing_held_out_is_one_line(tmp_path):
    from dpo_min.train import UsageError

    a = plain_rows(tmp_path / "a.jsonl", "a", 6)
    with pytest.raises(UsageError, match=r"^--eval_fraction 0.5: a stream has no length to hold out a fraction of; "
                                         r"hold out its first pairs with --max_eval_samples N, or give --eval_split$"):
        stream_pairs_of(tmp_path, dataset=a, eval_fraction=0.5)
    # map-style, a mixture without held-out rows has nothing for --max_eval_samples to cap
    from test_data import load_pairs_of

    with pytest.raises(UsageError, match=r"^--max_eval_samples 2 caps the held-out pairs, and the mixture holds out "
                                         r"none: hold some out with test_split_size"):
        load_pairs_of(tmp_path, datasets=json.dumps([{"path": a}]), max_eval_samples=2)


def test_a_stream_whose_every_pair_is_held_out_says_so_in_one_line(tmp_path, capsys):
    from dpo_min.train import main

    path = plain_rows(tmp_path / "a.jsonl", "a", 4)
    for cap in (4, 9):
        code = main(["--model", "unused", "--dataset", path, "--streaming", "--max_steps", "1", "--output_dir",
                     str(tmp_path / "run"), "--max_eval_samples", str(cap), "--precompute_ref_log_probs", "false"])
        assert code == 1
        assert capsys.readouterr().err.strip().splitlines() == [
            f"python -m dpo_min.train: error: {path}: --max_eval_samples {cap} held out every pair of the stream "
            "(4): none is left to train on; hold out fewer"]
        assert sorted(os.listdir(tmp_path)) == ["a.jsonl"]


def test_a_row_a_stream_refuses_while_training_is_one_line_and_other_errors_stay_themselves(tmp_path, tokenizer):
    from dpo_min.train.args import InputError
    from dpo_min.train.pairs import stream_rows_checked

    rows = [{"prompt": "Hi", "chosen": f"a{i}", "rejected": f"b{i}"} for i in range(3)]
    rows[2]["chosen"] = 5
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(InputError) as error, stream_rows_checked(streaming=True):  # read as training reads it
        list(tokenize_dataset(load_preference_dataset(str(path), streaming=True), tokenizer))
    assert str(error.value) == "row 2: field 'chosen' must be a string, got int"
    with pytest.raises(ValueError, match=r"^shapes differ$"), stream_rows_checked(streaming=True):
        raise ValueError("shapes differ")  # a fault of training, not of a row: its traceback is wanted
