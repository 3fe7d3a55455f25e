"""Data with k answers to a prompt: the ranked layout (prompt, completions, scores) and Nectar's and UltraFeedback's
(raw) rows under every_ranked_pair give every strictly better answer against every worse one, a row's pairs one
group under group_by_prompt; a bad row is one line naming row and field."""

import json
import logging

import pytest
from test_layouts_published import assistant, load, ultrafeedback_completion, user

from dpo_min import tokenize_dataset
from dpo_min.collator_groups import GroupedDPODataCollator
from dpo_min.data.loading import load_preference_dataset
from dpo_min.data.options import LayoutOptions
from dpo_min.data.pairs import to_preference_rows


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
    ({"completions": ["a", "b"], "scores": [1, float("nan")]}, r"row 1: field 'scores\[1\]' is nan, not a finite"),
    ({"completions": ["a", "b"], "scores": [1, "high"]}, r"row 1: field 'scores\[1\]' is 'high', not a finite"),
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


# ---- an answer given twice (issue 54 item 3): one answer, never both better and worse than another -------------
def _pairs(pairs):
    return [(pair["chosen"], pair["rejected"]) for pair in pairs]


def test_an_answer_given_twice_is_one_answer_and_never_both_better_and_worse(tmp_path):
    rows = [{"prompt": "Name a colour.", "completions": ["Blue.", "Red.", "Blue.", "Grey."], "scores": [3, 2, 1, 0]},
            {"prompt": "Name a fruit.", "completions": ["Pear.", "Stone.", "Pear."], "scores": [2, 0, 2]}]
    # By hand: Blue is scored 3 and 1, around Red (2): paired with neither way; Blue's lowest (1) and Red (2) are
    # above Grey (0). Pear twice with one score is one answer: one pair, not two.
    assert _pairs(load(tmp_path, rows)) == [("Blue.", "Grey."), ("Red.", "Grey."), ("Pear.", "Stone.")]


def test_a_text_answer_and_the_message_list_holding_it_are_one_answer(tmp_path):
    row = {"prompt": [user("Name a colour.")], "completions": ["Blue.", [assistant("Blue.")], "Red."],
           "scores": [2, 2, 1]}
    assert _pairs(load(tmp_path, [row])) == [([assistant("Blue.")], [assistant("Red.")])]


def test_a_row_whose_answers_straddle_each_other_is_skipped_and_counted(tmp_path, caplog):
    rows = [{"prompt": "Q", "completions": ["Blue.", "Red.", "Blue."], "scores": [3, 2, 1]},
            {"prompt": "R", "completions": ["a", "b"], "scores": [1, 0]}]
    with caplog.at_level(logging.WARNING, logger="dpo_min.data"):
        assert _pairs(load(tmp_path, rows)) == [("a", "b")]
    assert "dropped 1 of 2 rows that the ranked layout skips" in caplog.text


def test_nectar_and_ultrafeedback_pair_an_answer_given_twice_by_the_same_rule(tmp_path):
    four, close, five = [assistant("Four.")], [assistant("2+2 is 4, I think.")], [assistant("Five.")]
    answers = [{"answer": "Four.", "rank": 1.0}, {"answer": "2+2 is 4, I think.", "rank": 2.0},
               {"answer": "Four.", "rank": 3.0}, {"answer": "Five.", "rank": 4.0}]
    # Nectar ranks are 1..7, each once: a text given twice always has two ranks. Four (1 and 3) straddles close (2).
    assert _pairs(load(tmp_path, [{**NECTAR_ROW, "answers": answers}], every_ranked_pair=True)) == [
        (four, five), (close, five)]
    row = {"instruction": "2+2?", "completions": [ultrafeedback_completion(text, score, "m") for text, score in
                                                   (("Four.", 9.0), ("Five.", 2.0), ("Four.", 9.0))]}
    assert _pairs(load(tmp_path, [row], every_ranked_pair=True)) == [(four, five)]


# ---- one score check for every ranked source (issue 54 item 4) ----------------------------------------------------
def _ultrafeedback(score):
    return {"instruction": "Q", "completions": [ultrafeedback_completion("a", 1.0, "m"),
                                                ultrafeedback_completion("b", score, "m")]}


def _nectar(rank):
    return {**NECTAR_ROW, "answers": [NECTAR_ANSWERS[0], {**NECTAR_ANSWERS[1], "rank": rank}]}


@pytest.mark.parametrize("every_ranked_pair", [True, False])
@pytest.mark.parametrize(("row", "message"), [
    (_ultrafeedback(float("nan")), r"row 1: field 'completions\[1\]\.overall_score' is nan, not a finite number"),
    (_ultrafeedback(float("inf")), r"row 1: field 'completions\[1\]\.overall_score' is inf, not a finite number"),
    (_ultrafeedback(True), r"row 1: field 'completions\[1\]\.overall_score' is True, not a finite number"),
    (_nectar(float("nan")), r"row 1: field 'answers\[1\]\.rank' is nan, not a finite number"),
    (_nectar(float("-inf")), r"row 1: field 'answers\[1\]\.rank' is -inf, not a finite number"),
    (_nectar(True), r"row 1: field 'answers\[1\]\.rank' is True, not a finite number"),
    ({"prompt": "Q", "completions": ["a", "b"], "scores": [1, True]}, r"row 1: field 'scores\[1\]' is True, not a"),
    ({"prompt": "Q", "completions": ["a", "b"], "scores": [float("inf"), 1]}, r"row 1: field 'scores\[0\]' is inf"),
])
def test_every_ranked_source_refuses_a_score_that_is_no_finite_number_in_one_line(tmp_path, row, message,
                                                                                  every_ranked_pair):
    # The first row is good: the refusal names the row at fault, not the first.
    good = _ultrafeedback(2.0) if "instruction" in row else _nectar(2.0) if "answers" in row else \
        {"prompt": "Q", "completions": ["a", "b"], "scores": [1, 0]}
    with pytest.raises(ValueError, match=message) as refused:
        load(tmp_path, [good, row], every_ranked_pair=every_ranked_pair)
    assert "\n" not in str(refused.value)


# ---- what a refusal names (issue 54 item 8) -----------------------------------------------------------------------
@pytest.mark.parametrize(("row", "message"), [
    ({"prompt": "Q", "completions": ["a", [assistant("b")]], "scores": [1, 0]},
     r"^row 0: field 'completions\[1\]' must be a string, got list$"),
    ({"prompt": [user("Q")], "completions": ["a", [user("b")]], "scores": [1, 0]},
     r"^row 0: field 'completions\[1\]' must start with an assistant turn, not 'user'$"),
    ({"instruction": "Q", "completions": [{"response": "a", "overall_score": 2.0}, {"overall_score": 1.0}]},
     r"^row 0: field 'completions\[1\]\.response' must be text or a message list, got NoneType$"),
    ({**NECTAR_ROW, "answers": [NECTAR_ANSWERS[0], {"answer": "\ud800", "rank": 2.0}]},
     r"^row 0: field 'answers\[1\]\.answer' is not valid unicode"),
])
def test_a_ranked_rows_bad_answer_is_named_by_its_field_and_position(row, message):
    # It named fields 'chosen' or 'rejected', which the data does not have.
    with pytest.raises(ValueError, match=message):
        to_preference_rows([row], options=LayoutOptions(every_ranked_pair=True))


def test_every_ranked_pair_on_data_without_ranked_answers_says_it_changes_nothing_once(tmp_path, caplog):
    rows = [{"prompt": "Q", "chosen": "a", "rejected": "b"}, {"prompt": "R", "chosen": "c", "rejected": "d"}]
    with caplog.at_level(logging.WARNING, logger="dpo_min.data"):
        assert len(load(tmp_path, rows, every_ranked_pair=True)) == 2
    assert caplog.text.count("every_ranked_pair changes nothing: the explicit_prompt layout has no ranked") == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dpo_min.data"):
        load(tmp_path, [NECTAR_ROW], every_ranked_pair=True)
    assert "every_ranked_pair" not in caplog.text


def test_a_ranked_csv_is_told_that_its_cells_are_text_and_how_to_write_them(tmp_path):
    path = tmp_path / "ranked.csv"
    path.write_text('prompt,completions,scores\nQ,"[""a"", ""b""]","[1, 0]"\n')
    with pytest.raises(ValueError, match=r"row 0: field 'completions' must be a list of two or more answers .*got "
                       r"the text '\[\"a\", \"b\"\]' \(a CSV cell is text: write ranked rows as JSON lines or Parquet"):
        load_preference_dataset(str(path))
