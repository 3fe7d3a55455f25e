"""Data with k answers to a prompt: the ranked layout (prompt, completions, scores) and Nectar's and UltraFeedback's
(raw) rows under every_ranked_pair give every strictly better answer against every worse one, a row's pairs one
group under group_by_prompt; a bad row is one line naming row and field."""

import json

import pytest
from test_layouts_published import assistant, load, ultrafeedback_completion, user

from dpo_min import tokenize_dataset
from dpo_min.collator_groups import GroupedDPODataCollator
from dpo_min.data.loading import load_preference_dataset


def test_every_strictly_better_answer_against_every_worse_one(tmp_path):
    rows = [{"prompt": "Name a colour.", "completions": ["Blue.", "Loud.", "Red.", "Soft."],
             "scores": [3, 1, 2.5, 1]}]
    # By hand: Blue (3) > Red (2.5) > Loud = Soft (1); Loud and Soft tie, so they are no pair.
    assert load(tmp_path, rows) == [
        {"prompt": "Name a colour.", "chosen": "Blue.", "rejected": "Red."},
        {"prompt": "Name a colour.", "chosen": "Blue.", "rejected": "Loud."},
        {"prompt": "Name a colour.", "chosen": "Blue.", "rejected": "Soft."},
        {"prompt": "Name a colour.", "chosen": "Red.", "rejected": "Loud."},
        {"prompt": "Name a colour.", "chosen": "Red.", "rejected": "Soft."}]


def test_a_message_prompt_takes_text_answers_as_assistant_turns_and_each_pair_keeps_its_row(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [{"prompt": [user("Q1")], "completions": ["a", [assistant("b")]], "scores": [0.0, 1.0]},
            {"prompt": [user("Q2")], "completions": ["c", "d", "e"], "scores": [2, 1, 0]}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    pairs = load_preference_dataset(str(path))
    assert pairs["source_row"] == [0, 1, 1, 1]
    assert pairs[0]["chosen"] == [assistant("b")] and pairs[0]["rejected"] == [assistant("a")]


@pytest.mark.parametrize(("row", "message"), [
    ({"completions": ["a", "b", "c"], "scores": [1, 0]}, "row 1: field 'scores' must be a list of one score per "
                                                         r"completion \(3\), got 2 scores"),
    ({"completions": ["a", "b"], "scores": [1, float("nan")]}, "row 1: field 'scores' holds nan at 1, not a finite"),
    ({"completions": ["a", "b"], "scores": [1, "high"]}, "row 1: field 'scores' holds 'high' at 1, not a finite"),
    ({"completions": ["a", "b"], "scores": [2, 2]}, "row 1: field 'scores' has fewer than two distinct scores"),
    ({"completions": "a", "scores": [2, 2]}, "row 1: field 'completions' must be a list of two or more answers"),
])
def test_a_bad_ranked_row_is_one_line_naming_row_and_field(tmp_path, row, message):
    good = {"prompt": "Q", "completions": ["a", "b"], "scores": [1, 0]}
    with pytest.raises(ValueError, match=message):
        load(tmp_path, [good, {"prompt": "Q", **row}])


NECTAR_ANSWERS = [{"answer": "Four.", "model": "gpt-4", "rank": 1.0},
                  {"answer": "Five.", "model": "llama", "rank": 3.0},
                  {"answer": "2+2 is 4, I think.", "model": "gpt-3.5", "rank": 2.0}]
NECTAR_ROW = {"prompt": "Human: What is 2+2?\n\nAssistant:", "answers": NECTAR_ANSWERS, "turns": 1,
              "num_responses": 3, "source": ["sharegpt"], "good_natured": True}


def test_nectar_keeps_every_ranked_answer_under_the_option_and_stays_binarized_by_default(tmp_path):
    assert len(load(tmp_path, [NECTAR_ROW])) == 1
    pairs = load(tmp_path, [NECTAR_ROW], every_ranked_pair=True)
    four, close, five = [assistant("Four.")], [assistant("2+2 is 4, I think.")], [assistant("Five.")]
    assert [(pair["chosen"], pair["rejected"]) for pair in pairs] == [(four, close), (four, five), (close, five)]
    assert all(pair["prompt"] == [user("What is 2+2?")] for pair in pairs)


def test_ultrafeedback_raw_keeps_every_ranked_answer_under_the_option(tmp_path):
    answers = [("Paris is in Spain.", 2.0, "alpaca-7b"), ("Paris.", 9.5, "gpt-4"), ("France?", 5.0, "llama-2"),
               ("Lyon.", 2.0, "falcon-40b")]
    row = {"source": "evol_instruct", "instruction": "Capital of France?", "models": [m for _, _, m in answers],
           "completions": [ultrafeedback_completion(*answer) for answer in answers]}
    assert len(load(tmp_path, [row])) == 1
    pairs = [(p["chosen"][0]["content"], p["rejected"][0]["content"])
             for p in load(tmp_path, [row], every_ranked_pair=True)]
    # 9.5 > 5 > 2 = 2: five pairs, the two answers scored 2 no pair
    assert pairs == [("Paris.", "France?"), ("Paris.", "Paris is in Spain."), ("Paris.", "Lyon."),
                     ("France?", "Paris is in Spain."), ("France?", "Lyon.")]


def test_a_ranked_rows_pairs_are_one_group(tmp_path, tokenizer):
    rows = [{"prompt": [user(f"Question {n}?")], "completions": ["Yes.", "No.", "Maybe."], "scores": [2, 0, 1]}
            for n in range(2)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    pairs = tokenize_dataset(load_preference_dataset(str(path)), tokenizer)
    batch = GroupedDPODataCollator(tokenizer.pad_token_id)([pairs[i] for i in range(len(pairs))])
    assert batch["input_ids"].shape[0] == 2  # one segment per row, each of its three answers once
    assert int(batch["completion_index"].max()) + 1 == 6


def test_a_stream_of_ranked_rows_counts_rows_not_pairs(tmp_path):
    from dpo_min.data.streams import SKIPPED, stream_counts

    rows = [{"prompt": "Q", "completions": ["a", "b", "c"], "scores": [2, 1, 0]},
            {"prompt": "R", "completions": ["d", "d"], "scores": [1, 0]}]  # one text: no pair, a skipped row
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    stream = load_preference_dataset(str(path), streaming=True)
    assert len(list(stream)) == 3
    counts = stream_counts(stream).snapshot()
    assert counts["read"] == 2 and counts[SKIPPED] == 1
