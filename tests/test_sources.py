"""Where rows come from (dpo_min/data/sources.py): a CSV file's text is the text written."""

import pytest
from datasets import Dataset

from dpo_min import load_preference_dataset, tokenize_dataset
from dpo_min.data.loading import load_rows
from dpo_min.data.mixtures import trl_mixture

ANSWERS = "prompt,chosen,rejected,score_chosen\nWhat is 6*7?,42,041,9\nHalf of 3?,1.50,1.5e0,8\nWhat is 2+2?,4,5,7\n"
WRITTEN = [("What is 6*7?", "42", "041"), ("Half of 3?", "1.50", "1.5e0"), ("What is 2+2?", "4", "5")]


@pytest.mark.parametrize("streaming", [False, True], ids=["map-style", "streaming"])
def test_a_csv_answer_that_looks_like_a_number_is_the_text_written(tmp_path, tokenizer, streaming):
    # pandas read the column as numbers: "row 0: field 'chosen' must be a string, got int" (TRL's tokenizer refuses
    # an int alike); "041" would have been 41, "1.50" 1.5.
    path = tmp_path / "answers.csv"
    path.write_text(ANSWERS)
    pairs = list(load_preference_dataset(str(path), streaming=streaming))
    assert [(pair["prompt"], pair["chosen"], pair["rejected"]) for pair in pairs] == WRITTEN
    assert len(tokenize_dataset(Dataset.from_list(pairs), tokenizer)) == 3
    # A score keeps its number: a layout that reads scores or labels compares them as numbers.
    assert load_rows(str(path)).features["score_chosen"].dtype == "int64"


def test_a_csv_column_mapped_or_renamed_onto_an_answer_is_the_text_written(tmp_path):
    path = tmp_path / "answers.csv"
    path.write_text(ANSWERS.replace("chosen,rejected,", "right,wrong,", 1))
    mapped = load_preference_dataset(str(path), columns={"chosen": "right", "rejected": "wrong"})
    assert mapped["chosen"] == ["42", "1.50", "4"]
    mixture = trl_mixture([{"path": str(path), "rename_columns": {"right": "chosen", "wrong": "rejected"},
                            "columns": ["prompt", "right", "wrong"]}])
    assert mixture.train["rejected"] == ["041", "1.5e0", "5"]
