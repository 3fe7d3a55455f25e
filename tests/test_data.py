import copy
import gzip
import json

import pytest
from conftest import HH_PATH, ROOT, tiny_llama
from datasets import Dataset

from dpo_min.data import load_preference_dataset, to_preference_rows, tokenize_dataset, tokenize_row, truncate_pair

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
    assert dataset.column_names == ["prompt", "chosen", "rejected"] and len(dataset) == 2
    assert dataset[0] == STANDARD


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
        ({"prompt": "p", "chosen": "   ", "rejected": "r"}, "chosen"),
        ({"prompt": "p", "chosen": "same", "rejected": "same"}, "rejected"),
        ({"prompt": 5, "chosen": "c", "rejected": "r"}, "prompt"),
        (dict(CONVERSATIONAL, chosen=[{"role": "user", "content": "no answer"}]), "chosen"),
        (dict(CONVERSATIONAL, rejected=[{"role": "wizard", "content": "x"}]), "rejected"),
        (dict(CONVERSATIONAL, rejected="a string"), "rejected"),
        ({"chosen": "\n\nHuman: hi\n\nAssistant: a", "rejected": "\n\nHuman: yo\n\nAssistant: b"}, "rejected"),
    ],
)
def test_bad_rows_name_the_row_and_field(row, field):
    rows = [STANDARD, STANDARD, row]
    with pytest.raises(ValueError, match=rf"row 2: field '{field}'"):
        to_preference_rows(rows)


def test_bad_file_says_which_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"broken\.json"):
        load_preference_dataset(str(path))


@pytest.mark.parametrize("conversational", [False, True], ids=["standard", "conversational"])
def test_token_ids_equal_trl(tokenizer, hh_pairs, conversational):
    import trl  # the reference: missing is a failure, not a skip
    rows = [dict(r) for r in hh_pairs]
    if not conversational:  # the same pairs as plain strings
        rows = [{"prompt": tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True),
                 "chosen": r["chosen"][0]["content"], "rejected": r["rejected"][0]["content"]} for r in rows]
    rows.append({"prompt": "Hello", "chosen": "world", "rejected": " there"})  # tokens merge across the seam
    if conversational:
        rows.pop()
    args = trl.DPOConfig(output_dir="unused", report_to="none", max_length=None, bf16=False, use_cpu=True)
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


def test_conversational_rows_need_a_chat_template(tokenizer):
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match=r"row 0: conversational data needs a tokenizer with a chat template"):
        tokenize_dataset([CONVERSATIONAL], tokenizer)


def test_a_chat_template_error_names_the_row(tokenizer):
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match=r"row 0: field 'prompt': the chat template refused it: roles must alternate"):
        tokenize_dataset([CONVERSATIONAL], tokenizer)
