import copy
import gzip
import json
import os

import pytest
from conftest import HH_PATH, ROOT, tiny_llama
from datasets import Dataset

from dpo_min.data.loading import load_preference_dataset
from dpo_min.data.pairs import to_preference_rows
from dpo_min.tokenizing import tokenize_dataset, tokenize_row, truncate_pair

STANDARD = {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
CONVERSATIONAL = {
    "prompt": [{"role": "user", "content": "What color is the sky?"}],
    "chosen": [{"role": "assistant", "content": "It is blue."}],
    "rejected": [{"role": "assistant", "content": "It is green."}],
}


def write(path, rows, fmt):
    if fmt == "jsonl.gz":
        with gzip.open(path, "wt") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "parquet":
        Dataset.from_list(rows).to_parquet(str(path))
    elif fmt == "csv":
        Dataset.from_list(rows).to_csv(str(path), index=False)


@pytest.mark.parametrize("fmt", ["json", "jsonl.gz", "parquet", "csv"])
def test_loads_every_file_type(tmp_path, fmt):
    path = tmp_path / f"pairs.{fmt}"
    write(path, [STANDARD, STANDARD], fmt)
    dataset = load_preference_dataset(str(path))
    assert dataset.column_names == ["prompt", "chosen", "rejected", "source_row"] and len(dataset) == 2
    assert dataset[1] == dict(STANDARD, source_row=1)


def test_hh_transcripts_become_conversations():
    dataset = load_preference_dataset(str(HH_PATH))
    assert len(dataset) == 2303
    row = dataset[0]
    roles = [m["role"] for m in row["prompt"]]
    assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"]
    assert row["prompt"][0]["content"] == "what are some pranks with a pen i can do?"
    assert row["chosen"][0]["role"] == "assistant"
    assert row["chosen"][0]["content"].startswith("No, sorry!  All of these")


def test_sharegpt_layout(tmp_path):
    shared = ROOT.parent / "shared" / "data" / "llamafactory-dpo_en_demo.json"
    if shared.exists():  # the shared data sits beside the checkout (here and in CI)
        rows = json.loads(shared.read_text())
    else:
        rows = [{"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"}],
                 "chosen": {"from": "gpt", "value": "Hello!"}, "rejected": {"from": "gpt", "value": "Go away."}}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(rows))
    dataset = load_preference_dataset(str(path))
    assert len(dataset) == len(rows)
    first = dataset[0]
    assert first["prompt"][-1]["role"] == "user"
    assert first["chosen"] == [{"role": "assistant", "content": rows[0]["chosen"]["value"]}]


def test_implicit_prompt_is_the_longest_common_prefix():
    [string_row] = to_preference_rows([{"chosen": "Q: sky? A: blue", "rejected": "Q: sky? A: green"}])
    assert string_row == {"prompt": "Q: sky? A:", "chosen": " blue", "rejected": " green"}
    full = {"chosen": CONVERSATIONAL["prompt"] + CONVERSATIONAL["chosen"],
            "rejected": CONVERSATIONAL["prompt"] + CONVERSATIONAL["rejected"]}
    assert to_preference_rows([full]) == [CONVERSATIONAL]


@pytest.mark.parametrize(
    "row, field",
    [
        ({"prompt": "p", "rejected": "r"}, "chosen"),
        ({"prompt": "p", "chosen": None, "rejected": "r"}, "chosen"),
        ({"prompt": "p", "chosen": 3, "rejected": "r"}, "chosen"),
        ({"prompt": 5, "chosen": "c", "rejected": "r"}, "prompt"),
        (dict(CONVERSATIONAL, chosen=[{"role": "user", "content": "no answer"}]), "chosen"),
        (dict(CONVERSATIONAL, rejected=[{"role": "wizard", "content": "x"}]), "rejected"),
        (dict(CONVERSATIONAL, rejected="a string"), "rejected"),
        ({"chosen": "\n\nHuman: hi\n\nAssistant: a", "rejected": "\n\nHuman: yo\n\nAssistant: b"}, "prompt"),
    ],
)
def test_bad_rows_name_the_row_and_field(row, field):
    rows = [STANDARD, STANDARD, row]
    with pytest.raises(ValueError, match=rf"row 2: field '{field}'"):
        to_preference_rows(rows)


@pytest.mark.parametrize("row, field, reason", [
    ({"prompt": "p", "chosen": "   ", "rejected": "r"}, "chosen", "1 with an empty answer"),
    ({"prompt": "p", "chosen": "same", "rejected": "same"}, "rejected", "1 with chosen identical to rejected"),
    (dict(CONVERSATIONAL, rejected=[{"role": "assistant", "content": " "}]), "rejected", "1 with an empty answer"),
])
def test_a_row_that_cannot_be_a_pair_is_dropped_and_counted_or_refused_when_strict(row, field, reason, caplog):
    rows = [STANDARD, STANDARD, row] if isinstance(row["chosen"], str) else [CONVERSATIONAL] * 2 + [row]
    assert to_preference_rows(rows) == rows[:2]
    assert f"dropped 1 of 3 rows: {reason}" in caplog.text
    with pytest.raises(ValueError, match=rf"row 2: field '{field}'"):
        to_preference_rows(rows, strict_pairs=True)
    # Most rows unpaired is a wrong layout, not a few bad pairs: refused, naming the first.
    with pytest.raises(ValueError, match=rf"^row 1: field '{field}' .*; 2 of 3 rows cannot be preference pairs"):
        to_preference_rows([rows[0], row, row])


def test_a_malformed_row_whose_message_reads_like_an_unpaired_one_is_refused_not_dropped(tmp_path, caplog):
    # A row is unpaired by the layout's typed `Unpaired`, not by its message's words: a label whose value reads like
    # such a message is a malformed row, refused in one line naming it, in a list and in a file alike.
    from dpo_min.data.layouts import LayoutOptions

    rows = [dict(STANDARD, label="a"), dict(STANDARD, label="b"), dict(STANDARD, label="a"),
            dict(STANDARD, label="x is identical to 'chosen'")]
    options = {"label_column": "label", "label_chosen": "a", "label_rejected": "b"}
    message = r"row 3: field 'label' is \"x is identical to 'chosen'\", neither --label_chosen 'a'"
    with pytest.raises(ValueError, match="^" + message):
        to_preference_rows(rows, options=LayoutOptions(**options))
    path = tmp_path / "labelled.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError, match=message):
        load_preference_dataset(str(path), **options)
    assert "dropped" not in caplog.text


def test_an_unpaired_row_pickles_with_its_reason():
    # Raised in a datasets worker (num_proc) with strict_pairs, it travels back to the main process by pickle.
    import pickle

    from dpo_min.data.unpaired import NO_ANSWER, Unpaired

    message = "row 3: field 'chosen' is an empty completion"
    error = pickle.loads(pickle.dumps(Unpaired(NO_ANSWER, message)))
    assert (type(error), error.reason, str(error)) == (Unpaired, NO_ANSWER, message)


def test_rows_in_a_list_and_in_a_dataset_become_the_same_pairs_with_the_same_drops(caplog):
    # One loop turns rows into pairs, whether they come as a list or as a dataset's map batches.
    from dpo_min.data.pairs import to_preference_dataset

    rows = [STANDARD, {"prompt": "p", "chosen": " ", "rejected": "r"}, dict(STANDARD, prompt="The sea is"),
            {"prompt": "q", "chosen": "same", "rejected": "same"}, dict(STANDARD, chosen=" grey.")]
    listed = to_preference_rows(rows)
    mapped = to_preference_dataset(Dataset.from_list(rows))
    assert [{name: pair[name] for name in ("prompt", "chosen", "rejected")} for pair in mapped] == listed
    assert mapped["source_row"] == [0, 2, 4] and listed == [rows[0], rows[2], rows[4]]
    assert "dropped 2 of 5 rows: 1 with an empty answer, 1 with chosen identical to rejected" in caplog.text
    assert "data: dropped 1 of 5 rows with an empty answer; first source rows: 1" in caplog.text


def test_bad_file_says_which_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"broken\.json"):
        load_preference_dataset(str(path))


@pytest.mark.parametrize("conversational", [False, True], ids=["standard", "conversational"])
def test_token_ids_equal_trl(tokenizer, hh_pairs, conversational, tmp_path):
    import trl  # the reference: missing is a failure, not a skip
    rows = [dict(r) for r in hh_pairs]
    if not conversational:  # the same pairs as plain strings
        rows = [{"prompt": tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True),
                 "chosen": r["chosen"][0]["content"], "rejected": r["rejected"][0]["content"]} for r in rows]
    rows.append({"prompt": "Hello", "chosen": "world", "rejected": " there"})  # tokens merge across the seam
    if conversational:
        rows.pop()
    args = trl.DPOConfig(output_dir=str(tmp_path), report_to="none", max_length=None, bf16=False, use_cpu=True)
    theirs = trl.DPOTrainer(model=tiny_llama(), ref_model=tiny_llama(), args=args,
                            train_dataset=Dataset.from_list(rows), processing_class=tokenizer).train_dataset
    ours = tokenize_dataset(Dataset.from_list(copy.deepcopy(rows)), tokenizer)
    for name in ("prompt_ids", "chosen_ids", "rejected_ids"):
        assert ours[name] == theirs[name], name


def test_plain_completions_end_with_eos(tokenizer):
    example = tokenize_row(STANDARD, tokenizer)
    assert example["chosen_ids"][-1] == tokenizer.eos_token_id
    assert example["prompt_ids"] == tokenizer("The sky is")["input_ids"]


def test_truncation_cuts_prompt_from_the_left_then_completions():
    example = {"prompt_ids": [1, 2, 3, 4, 5], "chosen_ids": [6, 7, 8], "rejected_ids": [9]}
    cut = truncate_pair(example, max_length=5, max_prompt_length=3)
    assert cut == {"prompt_ids": [3, 4, 5], "chosen_ids": [6, 7], "rejected_ids": [9]}
    keep_start = truncate_pair(example, max_length=None, max_prompt_length=2, truncation_mode="keep_start")
    assert keep_start["prompt_ids"] == [1, 2]


def test_pairs_without_completion_tokens_are_dropped_with_a_warning(tokenizer, caplog):
    rows = [STANDARD, {"prompt": "word " * 50, "chosen": "a", "rejected": "b"}]
    with caplog.at_level("WARNING"):
        dataset = tokenize_dataset(Dataset.from_list(rows), tokenizer, max_length=20)
    assert len(dataset) == 1
    assert "dropped 1 of 2 pairs" in caplog.text


def test_pairs_identical_after_truncation_are_dropped_and_counted(tokenizer, caplog):
    # max_length cuts both answers inside their shared opening: the same sequence twice, a loss of ln 2, no gradient.
    same_opening = {"prompt": "Q?", "chosen": " the same long opening words here, then yes",
                    "rejected": " the same long opening words here, then no"}
    with caplog.at_level("WARNING"):
        dataset = tokenize_dataset(Dataset.from_list([STANDARD, same_opening]), tokenizer, max_length=6)
    assert len(dataset) == 1 and dataset[0]["chosen_ids"] != dataset[0]["rejected_ids"]
    assert "dropped 1 of 2 pairs with chosen identical to rejected after truncation" in caplog.text
    assert "first source rows: 1" in caplog.text
    with pytest.raises(ValueError, match=r"no pair left after truncation .*: 1 with chosen identical to rejected"):
        tokenize_dataset([same_opening], tokenizer, max_length=6)


def test_conversational_rows_need_a_chat_template(tokenizer):
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match=r"row 0: conversational data needs a tokenizer with a chat template"):
        tokenize_dataset([CONVERSATIONAL], tokenizer)


def test_a_chat_template_error_names_the_row(tokenizer):
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match=r"row 0: field 'prompt': the chat template refused it: roles must alternate"):
        tokenize_dataset([CONVERSATIONAL], tokenizer)


# ---- input that must not be silently reinterpreted (issue 13) ----------------------------------------------------
def test_a_null_prompt_is_an_error_not_an_implicit_prompt(tmp_path):
    path = tmp_path / "pairs.jsonl"
    rows = [STANDARD, {"prompt": None, "chosen": "I like red.", "rejected": "I like blue."}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError, match=r"row 1: field 'prompt' is missing"):
        load_preference_dataset(str(path))


def test_an_empty_csv_prompt_cell_is_an_error_naming_the_row(tmp_path):
    path = tmp_path / "pairs.csv"
    path.write_text('prompt,chosen,rejected\nThe sky is, blue., green.\n,I like red.,I like blue.\n')
    with pytest.raises(ValueError, match=r"row 1: field 'prompt' is missing"):
        load_preference_dataset(str(path))


def test_string_pairs_with_an_empty_implicit_prompt_are_an_error_unless_the_data_has_no_prompts():
    rows = [{"chosen": "Paris is the capital.", "rejected": "Lyon is the capital."}]
    with pytest.raises(ValueError, match=r"row 0: field 'chosen' shares no prompt .*--no_prompt"):
        to_preference_rows(rows)
    from dpo_min.data.layouts import LayoutOptions

    assert to_preference_rows(rows, options=LayoutOptions(no_prompt=True)) == [
        {"prompt": "", "chosen": "Paris is the capital.", "rejected": "Lyon is the capital."}]


def test_an_empty_jsonl_file_says_it_is_empty(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    with pytest.raises(ValueError, match=r"empty\.jsonl: the file (is empty|holds no rows)$"):
        load_preference_dataset(str(path))


def test_standard_and_conversational_rows_mixed_in_one_file_name_the_row(tmp_path):
    path = tmp_path / "mixed.jsonl"
    rows = [STANDARD, STANDARD, CONVERSATIONAL]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError, match=r"mixed\.jsonl: row 2: field 'prompt' is a message list but row 0's is a "
                                         r"string"):
        load_preference_dataset(str(path))


def test_dropped_pair_warning_names_the_row_in_the_file_not_its_position_after_shuffling(tmp_path, tokenizer,
                                                                                        caplog):
    path = tmp_path / "pairs.jsonl"
    rows = [dict(STANDARD, prompt=f"Question {i}?") for i in range(6)]
    rows[4] = {"prompt": "word " * 50, "chosen": "a", "rejected": "b"}  # its prompt fills max_length
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    shuffled = load_preference_dataset(str(path)).shuffle(seed=0)
    assert shuffled["source_row"].index(4) != 4  # the row sits elsewhere after shuffling
    with caplog.at_level("WARNING"):
        tokenize_dataset(shuffled, tokenizer, max_length=20)
    assert "dropped 1 of 6 pairs" in caplog.text and "first source rows: 4" in caplog.text


def test_no_pair_left_because_every_prompt_fills_max_length_is_one_error_naming_the_rows(tokenizer):
    rows = [{"prompt": "word " * 50, "chosen": "a", "rejected": "b"}] * 2
    with pytest.raises(ValueError, match=r"every row's prompt fills max_length=16 \(rows 0, 1\)"):
        tokenize_dataset(rows, tokenizer, max_length=16)


def test_tokenization_is_cached_by_fingerprint_and_parallel_gives_the_same_ids(tmp_path, tokenizer):
    path = tmp_path / "pairs.jsonl"
    rows = [dict(STANDARD, prompt=f"Question {i}?") for i in range(40)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    pairs = load_preference_dataset(str(path))
    first = tokenize_dataset(pairs, tokenizer, max_length=64)
    again = tokenize_dataset(pairs, tokenizer, max_length=64)
    assert first.cache_files and again.cache_files[0]["filename"] == first.cache_files[0]["filename"]
    parallel = tokenize_dataset(pairs, tokenizer, max_length=32, num_proc=2)
    assert parallel["chosen_ids"] == first["chosen_ids"] and parallel["prompt_ids"] == first["prompt_ids"]


# ---- datasets: mixtures, streaming, the command's data options (issue 9) -----------------------------------------
ORCA_ROWS = [{"system": "", "question": f"What is {i}+1?", "chosen": str(i + 1), "rejected": str(i + 2)}
             for i in range(8)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_mixture_names_each_source_and_names_the_dataset_and_row_of_a_bad_row(tmp_path):
    from dpo_min.data.mixtures import load_mixture

    orca = write_jsonl(tmp_path / "orca.jsonl", ORCA_ROWS)
    plain = write_jsonl(tmp_path / "plain.jsonl", [dict(STANDARD, prompt=f"Q{i}") for i in range(4)])
    mixed = load_mixture([{"path": str(orca), "split": "train[:50%]"}, {"path": str(plain)}], seed=1)["train"]
    assert len(mixed) == 8 and sorted(set(mixed["source_dataset"])) == sorted([str(orca), str(plain)])
    assert list(mixed["prompt"][:4]) == [row["question"] for row in ORCA_ROWS[:4]]  # TRL's order: concatenated
    broken = write_jsonl(tmp_path / "broken.jsonl", [STANDARD, STANDARD, dict(STANDARD, chosen=None)])
    with pytest.raises(ValueError, match=r"broken\.jsonl\[train\]: row 2: field 'chosen' is missing"):
        load_mixture([{"path": str(orca), "fraction": 1}, {"path": str(broken), "fraction": 1}])


def test_mixture_fractions_are_trls_shares_of_the_largest_mixture_without_repeated_rows(tmp_path):
    from dpo_min.data.mixtures import load_mixture

    small = write_jsonl(tmp_path / "small.jsonl", [dict(STANDARD, prompt=f"S{i}") for i in range(6)])
    large = write_jsonl(tmp_path / "large.jsonl", [dict(STANDARD, prompt=f"L{i}") for i in range(40)])
    # 1:3 by fraction. The small set runs out first: 6 rows are a quarter of 24, so 18 of the large set's 40 go in,
    # its first 18 (TRL takes the first rows, unshuffled).
    mixed = load_mixture([{"path": str(small), "fraction": 1}, {"path": str(large), "fraction": 3}])["train"]
    assert list(mixed["prompt"]) == [f"S{i}" for i in range(6)] + [f"L{i}" for i in range(18)]
    # 0.2 : 0.8, the small set limits again: 6 rows are 20% of 30, so 24 of the large set's rows go in.
    mixed = load_mixture([{"path": str(small), "fraction": 0.2}, {"path": str(large), "fraction": 0.8}])["train"]
    assert [mixed["source_dataset"].count(str(name)) for name in (small, large)] == [6, 24]
    for entries, message in [
        ([{"path": str(small), "fraction": 1}, {"path": str(large)}], r"`fraction` must be set for either all"),
        ([{"path": str(small), "fraction": -1}], r"datasets\[0\]: fraction is its share of the mixture"),
        ([{"path": str(small), "fraction": 0}], r"every fraction is 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            load_mixture(entries)


def test_a_streamed_dataset_gives_the_same_token_ids_on_the_fly(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "pairs.jsonl", ORCA_ROWS)
    whole = tokenize_dataset(load_preference_dataset(str(path)), tokenizer, max_length=64)
    streamed = tokenize_dataset(load_preference_dataset(str(path), streaming=True), tokenizer, max_length=64)
    assert [row["prompt_ids"] for row in streamed] == whole["prompt_ids"]
    assert [row["chosen_ids"] for row in streamed] == whole["chosen_ids"]


def test_a_stream_counts_what_it_drops_as_it_is_read(tmp_path, tokenizer):
    from dpo_min.data.streams import describe_stream_counts, stream_counts

    haiku, long = [{"role": "user", "content": "Write a haiku."}], [{"role": "user", "content": "word " * 60}]
    opening = "the same opening words, " * 8
    rows = [{"context": haiku, "response1": "Leaves fall", "response2": "no", "overall_preference": -2},
            {"context": haiku, "response1": "a", "response2": "b", "overall_preference": 0},  # a tie
            {"context": long, "response1": "a", "response2": "b", "overall_preference": 1},  # the prompt fills it
            {"context": haiku, "response1": opening + "yes", "response2": opening + "no", "overall_preference": 1}]
    path = write_jsonl(tmp_path / "helpsteer3.jsonl", rows)
    stream = tokenize_dataset(load_preference_dataset(str(path), streaming=True), tokenizer, max_length=48)
    before = stream_counts(stream).snapshot()  # building the stream read its first rows to learn their columns
    assert len(list(stream)) == 1
    counts = stream_counts(stream).snapshot()
    counts.subtract(before)
    assert describe_stream_counts(counts) == (
        "read 4 rows, dropped 3: 1 skipped by the layout (ties), 1 with no completion token left after truncation, "
        "1 with chosen identical to rejected after truncation")


def test_streaming_evaluates_the_whole_eval_split_or_max_eval_samples(tmp_path, monkeypatch, capsys):
    from dpo_min import DPOMinConfig
    from dpo_min.train import decide, pairs
    from dpo_min.train.args import DataArguments, ModelArguments

    test_split = write_jsonl(tmp_path / "test.jsonl", [dict(STANDARD, prompt=f"Q{i}") for i in range(150)])
    monkeypatch.setattr(pairs, "_load", lambda *_: load_preference_dataset(str(test_split), streaming=True))
    args = DPOMinConfig(output_dir=str(tmp_path / "out"), max_steps=1, precompute_ref_log_probs=False)
    # A real train stream: _stream_pairs counts its pairs that are also held out (issue 25).
    train_split = write_jsonl(tmp_path / "train.jsonl", [dict(STANDARD, prompt=f"T{i}") for i in range(4)])
    for cap, expected in ((None, 150), (20, 20)):
        data_args = DataArguments(dataset="org/pairs", streaming=True, eval_split="test", max_eval_samples=cap)
        stream = load_preference_dataset(str(train_split), streaming=True)
        _, held_out = pairs._stream_pairs(stream, "org/pairs", decide(ModelArguments(), data_args, args))
        assert len(held_out) == expected and held_out["prompt"] == [f"Q{i}" for i in range(expected)]
    assert "held out 150 pairs: split 'test', the whole split" in capsys.readouterr().out


def test_the_command_trains_orca_rows_on_their_question_and_reads_a_yaml_mixture(tmp_path, tiny_model_dir):
    from dpo_min.train import main

    orca = write_jsonl(tmp_path / "orca.jsonl", ORCA_ROWS)
    renamed = write_jsonl(tmp_path / "mine.jsonl", [{"instruction": f"Name color {i}", "good": "red", "bad": "rd"}
                                                    for i in range(4)])
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"""datasets:
  - path: {orca}
  - path: {renamed}
    split: train[:50%]
    rename_columns: {{instruction: prompt, good: chosen, bad: rejected}}
""")
    output_dir = tmp_path / "run"
    code = main([str(recipe), "--model", str(tiny_model_dir), "--output_dir", str(output_dir), "--max_steps", "2",
                 "--per_device_train_batch_size", "2", "--eval_fraction", "0.3", "--num_samples", "3",
                 "--max_new_tokens", "2", "--disable_tqdm", "true"])
    assert code == 0
    prompts = [json.loads(line)["prompt"] for line in (output_dir / "samples.jsonl").read_text().splitlines()]
    questions = {row["question"] for row in ORCA_ROWS} | {f"Name color {i}" for i in range(4)}
    assert prompts and set(prompts) <= questions  # never an empty or cut prompt
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["train_pairs"] + metrics["held_out_pairs"] <= 10


def test_the_command_streams_with_max_steps(tmp_path, tiny_model_dir, capsys):
    from dpo_min.train import main

    path = write_jsonl(tmp_path / "orca.jsonl", ORCA_ROWS)
    output_dir = tmp_path / "run"
    code = main(["--model", str(tiny_model_dir), "--dataset", str(path), "--streaming", "--output_dir",
                 str(output_dir), "--max_steps", "2", "--per_device_train_batch_size", "2", "--max_eval_samples", "2",
                 "--precompute_ref_log_probs", "false", "--num_samples", "1", "--max_new_tokens", "2",
                 "--logging_steps", "1", "--disable_tqdm", "true"])
    assert code == 0
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["train_pairs"] is None and metrics["held_out_pairs"] == 2  # a stream has no length
    assert "streamed preference pairs trained on, 2 held out" in (output_dir / "README.md").read_text()
    state = json.loads((output_dir / "trainer_state.json").read_text())
    assert [entry["step"] for entry in state["log_history"] if "loss" in entry] == [1, 2]
    assert "stream, in the run: read 8 rows, dropped 0\n" in capsys.readouterr().out


# ---- issue 25: a file has one split, held-out pairs are not train pairs, a folder keeps every file ---------------
def unique_pairs(count, tag="Q"):
    return [dict(STANDARD, prompt=f"{tag}{i}") for i in range(count)]


def load_pairs_of(tmp_path, **data):
    """train.load_pairs on DataArguments(**data): the command's data step alone, without a model."""
    from dpo_min import DPOMinConfig, train
    from dpo_min.train.args import DataArguments, ModelArguments

    streaming = data.get("streaming", False)
    args = DPOMinConfig(output_dir=str(tmp_path / "out"), max_steps=1000, per_device_train_batch_size=1,
                        precompute_ref_log_probs=not streaming, report_to=[])
    return train.load_pairs(train.decide(ModelArguments(), DataArguments(**data), args))


def contents(pairs):
    return [(pair["prompt"], pair["chosen"], pair["rejected"]) for pair in pairs]


def shared_warning(caplog):
    """The count in the data logger's warning about held-out pairs that are train pairs too (0 without one)."""
    found = [record.getMessage() for record in caplog.records
             if record.name == "dpo_min.data" and "held-out pairs are also train pairs" in record.getMessage()]
    assert len(found) <= 1, found
    return int(found[0].split(": ")[1].split(" of ")[0]) if found else 0


@pytest.mark.parametrize("form", ["single", "trl", "handbook", "legacy"])
def test_no_held_out_pair_is_a_train_pair_and_duplicates_are_counted_in_every_form(tmp_path, caplog, form):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", unique_pairs(20))
    twice = write_jsonl(tmp_path / "twice.jsonl", unique_pairs(20) + unique_pairs(4))  # Q0..Q3 twice
    folder = tmp_path / "folder"  # for the legacy mixer: a folder with a test split holding 3 train rows
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", unique_pairs(12))
    write_jsonl(folder / "test.jsonl", unique_pairs(3) + unique_pairs(5, tag="T"))
    unique, duplicated = {
        "single": ({"dataset": str(pairs), "eval_fraction": 0.25}, {"dataset": str(twice), "eval_fraction": 0.5}),
        "trl": ({"datasets": [{"path": str(pairs), "split": "train[:10]"}, {"path": str(pairs), "split":
                 "train[10:]"}], "test_split_size": "5"},
                {"datasets": [{"path": str(pairs)}, {"path": str(pairs)}], "test_split_size": "5"}),
        "handbook": ({"dataset_mixture": {"datasets": [{"id": str(pairs)}], "test_split_size": 5}},
                     {"dataset_mixture": {"datasets": [{"id": str(twice)}], "test_split_size": 12, "seed": 3}}),
        "legacy": ({"dataset_mixer": {str(pairs): 1.0}, "eval_fraction": 0.25},
                   {"dataset_mixer": {str(folder): 1.0}}),
    }[form]
    train, held_out = load_pairs_of(tmp_path, **unique)
    assert len(train) + len(held_out) == 20 and not set(contents(train)) & set(contents(held_out))
    assert shared_warning(caplog) == 0
    caplog.clear()
    train, held_out = load_pairs_of(tmp_path, **duplicated)
    # The independent count: the held-out pairs whose prompt (unique to its content here) is also trained on.
    trained = set(train["prompt"])
    expected = sum(prompt in trained for prompt in held_out["prompt"])
    assert expected > 0 and shared_warning(caplog) == expected


def test_the_legacy_mixer_on_a_file_holds_out_nothing_and_says_so(tmp_path, caplog):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", unique_pairs(20))
    with caplog.at_level("INFO", logger="dpo_min.data"):
        train, held_out = load_pairs_of(tmp_path, dataset_mixer={str(pairs): 0.5})
    # Before issue 25 the whole file was also its test split: 20 held-out pairs, 10 of them trained on.
    assert held_out is None and sorted(train["prompt"]) == sorted(f"Q{i}" for i in range(10))
    assert f"mixture: {pairs}[test]: nothing held out: a data file has one split, 'train'" in caplog.messages


def test_a_stream_holds_out_its_first_pairs_and_counts_train_pairs_also_held_out(tmp_path):
    from dpo_min.data.streams import ALSO_HELD_OUT, stream_counts

    for rows, expected in ((unique_pairs(12), 0), (unique_pairs(12) + unique_pairs(3) + unique_pairs(2), 5)):
        path = write_jsonl(tmp_path / "stream.jsonl", rows)
        train, held_out = load_pairs_of(tmp_path, dataset=str(path), streaming=True, max_eval_samples=4)
        before = stream_counts(train).snapshot()[ALSO_HELD_OUT]
        trained = contents(train)
        assert len(held_out) == 4 and len(trained) == len(rows) - 4
        # Counted by the stream as it is read; the independent count compares the contents.
        assert stream_counts(train).snapshot()[ALSO_HELD_OUT] - before == expected == sum(
            pair in set(contents(held_out)) for pair in trained)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet", "jsonl.gz"])
def test_a_file_has_one_split_train_and_its_slices_are_honoured(tmp_path, fmt):
    path = tmp_path / f"pairs.{fmt}"
    write_jsonl(path, unique_pairs(20)) if fmt == "jsonl" else write(path, unique_pairs(20), fmt)
    for split, named in (("test", "test"), ("validation[:5]", "validation"), ("train[:5]+test", "test")):
        with pytest.raises(ValueError, match=rf"pairs\.\S+: a data file has one split, 'train'; there is no split "
                                             rf"'{named}' \(name 'train' or a slice of it"):
            load_preference_dataset(str(path), split=split)
    assert load_preference_dataset(str(path), split="train[:5]")["prompt"] == [f"Q{i}" for i in range(5)]
    assert load_preference_dataset(str(path), split="train[10%:]")["prompt"] == [f"Q{i}" for i in range(2, 20)]
    with pytest.raises(ValueError, match=r"pairs\.\S+: a data file has no configs \(subsets\); drop the config name"):
        load_preference_dataset(str(path), config="harmless")


def test_a_streamed_file_honours_a_slice_by_rows_and_refuses_one_by_percent(tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", unique_pairs(20))
    stream = load_preference_dataset(str(path), split="train[3:5]+train[18:]", streaming=True)
    assert [pair["prompt"] for pair in stream] == ["Q3", "Q4", "Q18", "Q19"]
    with pytest.raises(ValueError, match=r"pairs\.jsonl: a stream has no length to take 'train\[:10%\]' of"):
        load_preference_dataset(str(path), split="train[:10%]", streaming=True)
    with pytest.raises(ValueError, match="a data file has one split, 'train'; there is no split 'test'"):
        load_preference_dataset(str(path), split="test", streaming=True)


@pytest.mark.parametrize("names", [("part1.jsonl", "part2.parquet"), ("train.jsonl", "train.parquet")])
def test_a_folder_of_several_file_types_is_refused_naming_them_and_one_type_gives_every_row(tmp_path, names):
    folder = tmp_path / "pairs"
    folder.mkdir()
    write_jsonl(folder / names[0], unique_pairs(30, tag="J"))
    write(folder / names[1], unique_pairs(18, tag="P"), "parquet")
    # datasets alone reads the 18 parquet rows and drops the 30 JSON rows without a word.
    with pytest.raises(ValueError, match=rf"pairs: holds data files of 2 types, and datasets would read one type "
                                         rf"only: json: 1 file \({names[0]}\); parquet: 1 file \({names[1]}\)"):
        load_preference_dataset(str(folder))
    (folder / names[1]).unlink()
    write(folder / f"{names[0].split('.')[0]}-2.json", unique_pairs(7, tag="K"), "json")
    (folder / "NOTES.md").write_text("# where these pairs came from\n")  # a note, not a file of another type
    assert sorted(load_preference_dataset(str(folder))["prompt"]) == sorted(
        [f"J{i}" for i in range(30)] + [f"K{i}" for i in range(7)])


def test_a_folder_whose_files_datasets_would_read_by_split_name_in_part_is_refused(tmp_path):
    folder = tmp_path / "pairs"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", unique_pairs(5))
    write_jsonl(folder / "extra.jsonl", unique_pairs(4, tag="X"))  # datasets alone reads train.jsonl only
    with pytest.raises(ValueError, match=r"pairs: datasets reads its files by split name \(1 file \(train\.jsonl\)\) "
                                         r"and would leave out 1 file \(extra\.jsonl\)"):
        load_preference_dataset(str(folder))


@pytest.mark.parametrize("name, text, message", [
    ("pairs.jsonl", '{"prompt": "a", "chosen": "b", "rejected": "c"}\n\n{"prompt": "a", "chosen": "b",}\n',
     "line 3 is not JSON: Expecting property name enclosed in double quotes (column 31)"),
    ("pairs.json", '[\n{"prompt": "a", "chosen": "b", "rejected": "c"},\n{"prompt": "a" "chosen": "b"}\n]',
     "line 3 is not JSON: Expecting ',' delimiter (column 16)"),
    ("pairs.jsonl", b'{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "\xff"}\n',
     "line 2 is not UTF-8 text"),
])
def test_a_malformed_json_line_names_its_file_and_line(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError) as raised:
        load_preference_dataset(str(path))
    assert str(raised.value) == f"{path}: {message}"


def data_mistake(kind):
    """A command line for one data mistake of issue 25, in tmp_path."""
    def make(tmp_path):
        pairs = str(write_jsonl(tmp_path / "pairs.jsonl", unique_pairs(20)))
        recipe = tmp_path / "recipe.yaml"
        if kind == "split":
            return ["--dataset", pairs, "--split", "validation[:5]"]
        if kind == "stream-split":
            return ["--dataset", pairs, "--split", "test", "--streaming", "--max_steps", "1",
                    "--precompute_ref_log_probs", "false"]
        if kind == "config":
            return ["--dataset", pairs, "--dataset_config", "harmless"]
        if kind == "bad-line":
            (tmp_path / "pairs.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\nnot json\n')
            return ["--dataset", pairs]
        if kind == "mixed-folder":
            (tmp_path / "folder").mkdir()
            write(tmp_path / "folder" / "b.parquet", unique_pairs(3), "parquet")
            (tmp_path / "pairs.jsonl").rename(tmp_path / "folder" / "a.jsonl")
            return ["--dataset", str(tmp_path / "folder")]
        recipe.write_text({
            "trl-split": f"datasets:\n  - path: {pairs}\n    split: test\n",
            "trl-name": f"datasets:\n  - path: {pairs}\n    name: harmless\n",
            "handbook-split": f"dataset_mixture:\n  datasets:\n    - id: {pairs}\n      split: test\n",
            "handbook-config": f"dataset_mixture:\n  datasets:\n    - id: {pairs}\n      config: harmless\n",
            "legacy-split": f"dataset_mixer:\n  {pairs}: 0.5\ndataset_splits: [train_prefs, test_prefs]\n",
        }[kind])
        return ["--config", str(recipe)]
    return make


@pytest.mark.parametrize("kind, message", [
    ("split", "pairs.jsonl: a data file has one split, 'train'; there is no split 'validation'"),
    ("stream-split", "pairs.jsonl: a data file has one split, 'train'; there is no split 'test'"),
    ("trl-split", "pairs.jsonl: a data file has one split, 'train'; there is no split 'test'"),
    ("handbook-split", "pairs.jsonl: a data file has one split, 'train'; there is no split 'test'"),
    ("legacy-split", "pairs.jsonl: a data file has one split, 'train'; there is no split 'train_prefs'"),
    ("config", "pairs.jsonl: a data file has no configs (subsets); drop the config name 'harmless'"),
    ("trl-name", "pairs.jsonl: a data file has no configs (subsets); drop the config name 'harmless'"),
    ("handbook-config", "pairs.jsonl: a data file has no configs (subsets); drop the config name 'harmless'"),
    ("bad-line", "pairs.jsonl: line 2 is not JSON: Expecting value (column 1)"),
    ("mixed-folder", "folder: holds data files of 2 types, and datasets would read one type only: json: 1 file "
                     "(a.jsonl); parquet: 1 file (b.parquet)"),
])
def test_a_data_mistake_is_one_line_exit_1_and_writes_nothing(tmp_path, capsys, tiny_model_dir, kind, message):
    from dpo_min.train import main

    extra = data_mistake(kind)(tmp_path)
    before = sorted(os.listdir(tmp_path))
    code = main(["--model", str(tiny_model_dir), "--output_dir", str(tmp_path / "out"), *extra])
    error_lines = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(error_lines) == 1 and message in error_lines[0], error_lines
    assert sorted(os.listdir(tmp_path)) == before


# ---- issue 31: Anthropic/hh-rlhf as published; a row that cannot be a pair is dropped and counted ---------------
def upstream_unpaired_rows():
    """The upstream HH file's rows that cannot be pairs, found from its raw text (not by the data code): the last
    chosen answer empty, or the two transcripts different before their last Assistant turn."""
    with gzip.open(HH_PATH, "rt", encoding="utf-8") as file:
        rows = [json.loads(line) for line in file]
    split = [[row[name].rsplit("\n\nAssistant:", 1) for name in ("chosen", "rejected")] for row in rows]
    empty = [i for i, (chosen, rejected) in enumerate(split) if not chosen[1].strip() or not rejected[1].strip()]
    apart = [i for i, (chosen, rejected) in enumerate(split) if chosen[0] != rejected[0] and i not in empty]
    return rows, empty, apart


def test_the_embedded_hh_file_is_the_upstream_file_and_loads_with_its_9_unpaired_rows_dropped_by_reason(caplog):
    from hashlib import sha256

    from dpo_min.data.streams import StreamCounts
    from dpo_min.data.unpaired import NO_ANSWER, NO_COMMON_PROMPT

    digest = sha256(HH_PATH.read_bytes()).hexdigest()
    assert digest == "ebfaaed21162a4de120ae85366075b34425e2a6303fac59b99555002f7016f03"
    assert f"`{digest}`" in (ROOT / "data" / "README.md").read_text()
    rows, empty, apart = upstream_unpaired_rows()
    assert (len(rows), empty, apart) == (2312, [86, 516, 925, 1103], [1254, 1688, 1950, 1952, 2036])  # data/README.md
    counts = StreamCounts()
    pairs = load_preference_dataset(str(HH_PATH), counts=counts)
    assert pairs["source_row"] == [i for i in range(2312) if i not in empty + apart]
    assert {name: number for name, number in counts.snapshot().items() if number} == {
        "read": 2312, NO_ANSWER: 4, NO_COMMON_PROMPT: 5}
    assert f"dropped 4 of 2312 rows {NO_ANSWER}; first source rows: 86, 516, 925, 1103" in caplog.text
    assert f"dropped 5 of 2312 rows {NO_COMMON_PROMPT}; first source rows: 1254, 1688, 1950, 1952, 2036" in caplog.text
    with pytest.raises(ValueError, match=r"hh-rlhf-harmless-base-test\.jsonl\.gz: row 86: field 'chosen' is an empty "
                                         r"completion$"):
        load_preference_dataset(str(HH_PATH), strict_pairs=True)


def test_a_stream_drops_and_counts_the_upstream_unpaired_rows_naming_them(caplog):
    from dpo_min.data.streams import stream_counts
    from dpo_min.data.unpaired import NO_ANSWER, NO_COMMON_PROMPT

    stream = load_preference_dataset(str(HH_PATH), streaming=True)
    assert sum(1 for _ in stream) == 2303
    counts = stream_counts(stream).snapshot()
    assert (counts["read"], counts[NO_ANSWER], counts[NO_COMMON_PROMPT]) == (2312, 4, 5)
    assert f"dropped row 86 {NO_ANSWER}" in caplog.text and f"dropped row 2036 {NO_COMMON_PROMPT}" in caplog.text


def test_most_rows_unpaired_is_refused_as_a_wrong_layout_naming_the_first(tmp_path):
    rows, empty, _ = upstream_unpaired_rows()
    path = write_jsonl(tmp_path / "hh.jsonl", [rows[i] for i in [0, *empty, 1]])
    with pytest.raises(ValueError, match=r"hh\.jsonl: row 1: field 'chosen' is an empty completion; 4 of 6 rows cannot "
                                         r"be preference pairs \(4 with an empty answer\): too many to drop"):
        load_preference_dataset(str(path))


def test_a_file_whose_every_row_ties_is_one_line_naming_it(tmp_path, capsys, tiny_model_dir):
    from dpo_min.train import main

    ties = write_jsonl(tmp_path / "ties.jsonl", [{"prompt": f"Q{i}", "chosen": "a", "rejected": "a"} for i in range(3)])
    message = (f"{ties}: row 0: field 'rejected' is identical to 'chosen'; 3 of 3 rows cannot be preference pairs (3 "
               "with chosen identical to rejected): too many to drop, check the layout and columns")
    with pytest.raises(ValueError) as error:  # was: Column 'source_row' doesn't exist.
        load_preference_dataset(str(ties))
    assert str(error.value) == message
    capsys.readouterr()  # the library's progress bars
    code = main(["--model", str(tiny_model_dir), "--dataset", str(ties), "--output_dir", str(tmp_path / "out")])
    assert (code, capsys.readouterr().err.strip()) == (1, f"python -m dpo_min.train: error: {message}")
    # Every row a tie that the layout itself skips (HelpSteer3's overall_preference 0): said as such
    helpsteer3 = write_jsonl(tmp_path / "hs3.jsonl", [{"context": [{"role": "user", "content": "Hi"}], "response1": "a",
                                                       "response2": "b", "overall_preference": 0}] * 2)
    with pytest.raises(ValueError, match=r"^.*hs3\.jsonl: no pair in its 2 rows: 2 that the helpsteer3 layout skips "
                                         r"\(ties\)$"):
        load_preference_dataset(str(helpsteer3))


def test_the_command_counts_unpaired_rows_in_its_metrics_and_strict_pairs_refuses_in_one_line(tmp_path, capsys,
                                                                                           tiny_model_dir):
    from dpo_min.data.unpaired import NO_ANSWER, NO_COMMON_PROMPT
    from dpo_min.train import main

    rows, empty, apart = upstream_unpaired_rows()
    path = write_jsonl(tmp_path / "hh.jsonl", [rows[i] for i in sorted([*range(20), *empty, *apart])])
    argv = ["--model", str(tiny_model_dir), "--dataset", str(path), "--max_steps", "1", "--eval_fraction", "0.25",
            "--per_device_train_batch_size", "2", "--max_length", "1024", "--num_samples", "1", "--max_new_tokens", "2",
            "--disable_tqdm", "true"]
    assert main([*argv, "--output_dir", str(tmp_path / "run")]) == 0
    assert "dropped 4 of 29 rows with an empty answer; first source rows: 20, 21, 22, 23" in capsys.readouterr().out
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["dropped_rows"] == {NO_ANSWER: 4, NO_COMMON_PROMPT: 5}
    assert metrics["held_out_pairs"] == 5  # 25% of the 20 pairs left (the run reaches 2 of the other 15)
    assert main([*argv, "--output_dir", str(tmp_path / "strict"), "--strict_pairs"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"python -m dpo_min.train: error: {path}: row 20: field 'chosen' is an empty completion"]


def test_strict_pairs_with_a_mixture_is_a_usage_error(tmp_path, capsys, tiny_model_dir):
    from dpo_min.train import main

    path = write_jsonl(tmp_path / "pairs.jsonl", unique_pairs(6))
    code = main(["--model", str(tiny_model_dir), "--output_dir", str(tmp_path / "out"), "--strict_pairs",
                 "--datasets", json.dumps([{"path": str(path)}])])
    assert code == 2 and capsys.readouterr().err.strip().splitlines() == [
        "python -m dpo_min.train: error: --strict_pairs applies to one dataset (--dataset); a mixture drops the rows "
        "that cannot be preference pairs and names them in its log"]
