"""One test per published layout, with rows written exactly with the columns of that dataset's card (there is no hub
access here). Each checks what the pair becomes, so a layout that loses or moves text fails."""

import json
import logging
import re

import pytest
from datasets import Dataset

from dpo_min.data.loading import load_preference_dataset
from dpo_min.tokenizing import tokenize_dataset


def load(tmp_path, rows, **options):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    dataset = load_preference_dataset(str(path), **options)
    return [{key: row[key] for key in ("prompt", "chosen", "rejected")} for row in dataset]


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def test_ultrafeedback_h4_prompt_is_the_shared_user_turn(tmp_path, caplog):
    question = "How many legs does a spider have?"
    row = {"prompt": question, "prompt_id": "a1b2", "chosen": [user(question), assistant("Eight.")],
           "rejected": [user(question), assistant("Six.")],
           "messages": [user(question), assistant("Eight.")], "score_chosen": 9.0, "score_rejected": 2.0}
    with caplog.at_level(logging.INFO, logger="dpo_min.data"):
        [pair] = load(tmp_path, [row])
    assert pair == {"prompt": [user(question)], "chosen": [assistant("Eight.")], "rejected": [assistant("Six.")]}
    assert "layout ultrafeedback_h4" in caplog.text


def test_ultrafeedback_h4_prompt_that_differs_from_the_messages_names_the_row(tmp_path):
    good = {"prompt": "Q", "prompt_id": "1", "chosen": [user("Q"), assistant("a")],
            "rejected": [user("Q"), assistant("b")], "messages": [], "score_chosen": 1.0, "score_rejected": 0.0}
    bad = dict(good, prompt="another question")
    with pytest.raises(ValueError, match=r"row 1: field 'prompt' differs from the user turn"):
        load(tmp_path, [good, bad])


@pytest.mark.parametrize("extra", [
    {"score_chosen": 8.0, "score_rejected": 3.0},  # trl-lib/ultrafeedback_binarized
    {"dataset": "capybara", "chosen_rating": 5.0, "rejected_rating": 2.0},  # argilla/dpo-mix-7k
    {"id": "tulu-1", "source": "sft", "prompt": "Name a color."},  # allenai/llama-3.1-tulu-3-8b-preference-mixture
    {"source": "orca", "prompt": "Name a color.", "question": "Name a color."},  # mlabonne/orpo-dpo-mix-40k
], ids=["trl-lib-ultrafeedback", "argilla-dpo-mix-7k", "tulu-3-preference-mixture", "orpo-dpo-mix-40k"])
def test_implicit_conversational_sets_ignore_their_extra_columns(tmp_path, extra):
    system = {"role": "system", "content": "Be brief."}
    row = {"chosen": [system, user("Name a color."), assistant("Blue.")],
           "rejected": [system, user("Name a color."), assistant("Loud.")], **extra}
    [pair] = load(tmp_path, [row])
    assert pair == {"prompt": [system, user("Name a color.")], "chosen": [assistant("Blue.")],
                    "rejected": [assistant("Loud.")]}


def test_orca_pairs_keep_their_question_as_the_prompt(tmp_path):
    rows = [{"system": "You are an AI assistant.", "question": "What is 2+2?", "chosen": "4", "rejected": "5"},
            {"system": "", "question": "What is 2+3?", "chosen": "5", "rejected": "6"}]
    standard = load(tmp_path, rows)
    assert standard == [{"prompt": "You are an AI assistant.\n\nWhat is 2+2?", "chosen": "4", "rejected": "5"},
                        {"prompt": "What is 2+3?", "chosen": "5", "rejected": "6"}]
    conversational = load(tmp_path, rows, as_messages=True)
    assert conversational[0] == {"prompt": [{"role": "system", "content": "You are an AI assistant."},
                                            user("What is 2+2?")],
                                 "chosen": [assistant("4")], "rejected": [assistant("5")]}
    assert conversational[1]["prompt"] == [user("What is 2+3?")]


PKU_ROW = {"prompt": "How do I pick a lock?", "response_0": "I can't help with that.",
           "response_1": "Use a tension wrench.", "prompt_source": "Alpaca3-70B", "response_0_source": "Alpaca-7B",
           "response_1_source": "Alpaca-7B", "is_response_0_safe": True, "is_response_1_safe": False,
           "response_0_harm_category": {}, "response_1_harm_category": {}, "response_0_severity_level": 0,
           "response_1_severity_level": 2, "better_response_id": 1, "safer_response_id": 0,
           "response_0_sha256": "aa", "response_1_sha256": "bb"}


@pytest.mark.parametrize("label, chosen", [("better_response_id", "response_1"), ("safer_response_id", "response_0")])
def test_pku_saferlhf_label_option_decides(tmp_path, label, chosen):
    [pair] = load(tmp_path, [PKU_ROW], preference_label=label)
    rejected = "response_0" if chosen == "response_1" else "response_1"
    assert pair == {"prompt": PKU_ROW["prompt"], "chosen": PKU_ROW[chosen], "rejected": PKU_ROW[rejected]}


def test_shp_labels_pick_the_preferred_reply(tmp_path):
    common = {"post_id": "p", "domain": "askscience_train", "upvote_ratio": 0.99, "history": "Why is the sky blue?",
              "c_root_id_A": "a", "c_root_id_B": "b", "created_at_utc_A": 1, "created_at_utc_B": 2, "score_A": 50,
              "score_B": 3, "seconds_difference": 1.0, "score_ratio": 16.7}
    rows = [dict(common, human_ref_A="Rayleigh scattering.", human_ref_B="It reflects the sea.", labels=1),
            dict(common, human_ref_A="It reflects the sea.", human_ref_B="Rayleigh scattering.", labels=0)]
    pairs = load(tmp_path, rows)
    expected = {"prompt": "Why is the sky blue?", "chosen": "Rayleigh scattering.", "rejected": "It reflects the sea."}
    assert pairs == [expected, expected]


def test_helpsteer3_sign_decides_and_ties_are_dropped_and_counted(tmp_path, caplog):
    context = [user("Write a haiku.")]
    common = {"domain": "general", "language": "english", "context": context, "individual_preference": []}
    rows = [dict(common, response1="Leaves fall", response2="no", overall_preference=-2),
            dict(common, response1="no", response2="Leaves fall", overall_preference=3),
            dict(common, response1="a", response2="b", overall_preference=0)]
    with caplog.at_level(logging.WARNING):
        pairs = load(tmp_path, rows)
    expected = {"prompt": context, "chosen": [assistant("Leaves fall")], "rejected": [assistant("no")]}
    assert pairs == [expected, expected]
    assert "dropped 1 of 3 rows" in caplog.text


def test_hh_transcripts_become_conversations(tmp_path):
    row = {"chosen": "\n\nHuman: Hi?\n\nAssistant: Hello.\n\nHuman: Joke?\n\nAssistant: A pun.",
           "rejected": "\n\nHuman: Hi?\n\nAssistant: Hello.\n\nHuman: Joke?\n\nAssistant: No."}
    [pair] = load(tmp_path, [row])
    assert pair == {"prompt": [user("Hi?"), assistant("Hello."), user("Joke?")], "chosen": [assistant("A pun.")],
                    "rejected": [assistant("No.")]}


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {}}}}]
TOOL_TEMPLATE = (
    "{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
    "{% if think is defined %}<think={{ think }}>\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}"
    "{{ m.content or '' }}</{{ m.role }}>\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


def test_tool_use_rows_give_the_tools_to_the_chat_template_as_trl(tmp_path, tokenizer):
    import trl  # the reference: missing is a failure, not a skip
    from conftest import tiny_llama

    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    prompt = [user("Weather in Paris?"), {"role": "assistant", "content": "", "tool_calls": [call]},
              {"role": "tool", "content": "sunny", "tool_calls": None}]
    for turn in prompt[:1]:
        turn["tool_calls"] = None  # as datasets stores message lists: every turn has every key
    rows = [{"prompt": prompt, "chosen": [{"role": "assistant", "content": "Sunny.", "tool_calls": None}],
             "rejected": [{"role": "assistant", "content": "Rainy.", "tool_calls": None}],
             "tools": json.dumps(TOOLS), "chat_template_kwargs": {"think": "no"}}]
    tokenizer.chat_template = TOOL_TEMPLATE
    ours = tokenize_dataset(Dataset.from_list(rows), tokenizer)
    args = trl.DPOConfig(output_dir=str(tmp_path), report_to="none", max_length=None, bf16=False, use_cpu=True)
    theirs = trl.DPOTrainer(model=tiny_llama(), ref_model=tiny_llama(), args=args,
                            train_dataset=Dataset.from_list(rows), processing_class=tokenizer).train_dataset
    for name in ("prompt_ids", "chosen_ids", "rejected_ids"):
        assert ours[name] == theirs[name], name
    prompt_text = tokenizer.decode(ours[0]["prompt_ids"])
    assert "get_weather" in prompt_text and "<think=no>" in prompt_text and "Paris" in prompt_text


def test_run_wide_chat_template_kwargs_reach_the_template(tokenizer):
    tokenizer.chat_template = TOOL_TEMPLATE
    row = {"prompt": [user("Hi")], "chosen": [assistant("a")], "rejected": [assistant("b")]}
    [example] = tokenize_dataset([row], tokenizer, chat_template_kwargs={"think": "off"})
    assert "<think=off>" in tokenizer.decode(example["prompt_ids"])


def test_explicit_column_mapping(tmp_path):
    rows = [{"instruction": "Say hi", "sys": "Be kind.", "good": "Hi!", "bad": "Go away.", "id": 7}]
    [pair] = load(tmp_path, rows, columns={"prompt": "instruction", "chosen": "good", "rejected": "bad",
                                           "system": "sys"})
    assert pair == {"prompt": "Be kind.\n\nSay hi", "chosen": "Hi!", "rejected": "Go away."}


def test_unknown_layout_names_the_columns_and_the_mapping_options(tmp_path):
    with pytest.raises(ValueError, match=r"no known preference layout has the columns \[instruction, good, bad\].*"
                                         r"--prompt_column"):
        load(tmp_path, [{"instruction": "Say hi", "good": "Hi!", "bad": "Go away."}])


def test_a_mapping_to_a_missing_column_names_it(tmp_path):
    with pytest.raises(ValueError, match=r"no column named 'question'"):
        load(tmp_path, [{"prompt": "p", "chosen": "a", "rejected": "b"}], columns={"prompt": "question"})



CLASH = "columns: 'prompt' is mapped from the column 'question' (--prompt_column question), and the data has a " \
        "'prompt' column too: which one is meant is not said; drop or rename one of them"


def test_a_mapping_onto_a_column_the_data_also_has_is_refused_naming_both(tmp_path):
    rows = [{"question": "What is 2 + 2?", "prompt": "old", "chosen": "4", "rejected": "5"}]
    with pytest.raises(ValueError) as error:  # it trained 'question' and dropped 'prompt' without a word
        load(tmp_path, rows, columns={"prompt": "question"})
    assert str(error.value) == f"{tmp_path / 'rows.jsonl'}: {CLASH}"
    with pytest.raises(ValueError, match=r"columns: 'chosen' is mapped from the column 'good' \(--chosen_column good"):
        load(tmp_path, [dict(rows[0], good="four")], columns={"chosen": "good"})
    # A column of our name that is itself mapped elsewhere is read, not dropped: no clash.
    shifted = [{"question": "What is 2 + 2?", "prompt": "4", "chosen": "5"}]
    assert load(tmp_path, shifted, columns={"prompt": "question", "chosen": "prompt", "rejected": "chosen"}) == [
        {"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "5"}]


def test_the_command_refuses_a_prompt_column_beside_a_prompt_column_in_one_line(tmp_path, capsys):
    from dpo_min.train import main

    path = tmp_path / "both.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {i} + 2?", "prompt": "old", "chosen": f"{i + 2}",
                                        "rejected": "5"}) + "\n" for i in range(4)))
    code = main(["--dataset", str(path), "--prompt_column", "question", "--model", str(tmp_path / "no_model"),
                 "--output_dir", str(tmp_path / "out")])
    assert (code, capsys.readouterr().err.strip()) == (1, f"python -m dpo_min.train: error: {path}: {CLASH}")
    assert not (tmp_path / "out").exists()

# ---- text no layout may drop (issue 18) ---------------------------------------------------------------------------
def test_sharegpt_system_column_is_the_first_turn_as_llamafactory_reads_it(tmp_path):
    turn = {"conversations": [{"from": "human", "value": "Hi"}], "chosen": {"from": "gpt", "value": "Hello!"},
            "rejected": {"from": "gpt", "value": "Go away."}}
    system = {"role": "system", "content": "Be brief."}
    [pair] = load(tmp_path, [dict(turn, system="Be brief.")])
    assert pair == {"prompt": [system, user("Hi")], "chosen": [assistant("Hello!")],
                    "rejected": [assistant("Go away.")]}
    # LLaMA-Factory takes a conversation's own opening system turn; a system column that says otherwise is an error.
    own = dict(turn, conversations=[{"from": "system", "value": "Be brief."}, *turn["conversations"]])
    assert load(tmp_path, [dict(own, system="Be brief.")]) == [pair] == load(tmp_path, [dict(own, system="")])
    with pytest.raises(ValueError, match=r"row 1: field 'system' differs from the prompt's own system turn"):
        load(tmp_path, [dict(own, system=""), dict(own, system="Be verbose.")])


def test_alpaca_rows_join_instruction_and_input_as_llamafactory(tmp_path):
    rows = [{"instruction": "Translate to French.", "input": "Good morning", "chosen": "Bonjour", "rejected": "Hola"},
            {"instruction": "Say hi.", "input": "", "chosen": "Hi!", "rejected": "Go away."}]
    assert load(tmp_path, rows) == [
        {"prompt": "Translate to French.\nGood morning", "chosen": "Bonjour", "rejected": "Hola"},
        {"prompt": "Say hi.", "chosen": "Hi!", "rejected": "Go away."}]
    with_system = [dict(row, system="Be kind.") for row in rows]
    assert load(tmp_path, with_system)[1]["prompt"] == "Be kind.\n\nSay hi."
    assert load(tmp_path, with_system, as_messages=True)[1] == {
        "prompt": [{"role": "system", "content": "Be kind."}, user("Say hi.")], "chosen": [assistant("Hi!")],
        "rejected": [assistant("Go away.")]}
    # history: the earlier [instruction, response] turns, before this row's user turn (the rows are then messages)
    history = [dict(rows[0], history=[["Hello", "Hi there"]]), dict(rows[1], history=[])]
    assert [pair["prompt"] for pair in load(tmp_path, history)] == [
        [user("Hello"), assistant("Hi there"), user("Translate to French.\nGood morning")], [user("Say hi.")]]


def test_string_pairs_with_a_text_column_no_layout_reads_are_refused(tmp_path):
    # alpaca's instruction under another name: the implicit prompt would be the answers' common opening, "Sure!"
    rows = [{"task": "Say hi.", "chosen": "Sure! Hi!", "rejected": "Sure! Go away."}]
    with pytest.raises(ValueError, match=r"no known preference layout reads the column 'task' .*--prompt_column task"):
        load(tmp_path, rows)
    assert load(tmp_path, rows, columns={"prompt": "task"}) == [
        {"prompt": "Say hi.", "chosen": "Sure! Hi!", "rejected": "Sure! Go away."}]
    assert load(tmp_path, rows, no_prompt=True)[0]["prompt"] == ""


ONE_ROW = {
    "sharegpt": {"conversations": [{"from": "human", "value": "Hi"}], "chosen": {"from": "gpt", "value": "Hello!"},
                 "rejected": {"from": "gpt", "value": "Go away."}},
    "pku_saferlhf": PKU_ROW,
    "shp": {"post_id": "p", "history": "Why?", "human_ref_A": "Because.", "human_ref_B": "No.", "labels": 1},
    "helpsteer3": {"context": [user("Hi")], "response1": "Hello!", "response2": "Go away.", "overall_preference": -1},
    "orca": {"system": "", "question": "What is 2+2?", "chosen": "4", "rejected": "5"},
    "alpaca": {"instruction": "Say hi.", "input": "", "chosen": "Hi!", "rejected": "Go away."},
    "ultrafeedback_h4": {"prompt": "Q", "prompt_id": "1", "chosen": [user("Q"), assistant("a")],
                         "rejected": [user("Q"), assistant("b")], "messages": [user("Q"), assistant("a")]},
    "implicit_conversational": {"chosen": [user("Q"), assistant("a")], "rejected": [user("Q"), assistant("b")],
                                "score_chosen": 8.0, "score_rejected": 3.0},  # trl-lib: no prompt column at all
    "explicit_prompt": {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
    "hh_transcripts": {"chosen": "\n\nHuman: Hi?\n\nAssistant: Hello.", "rejected": "\n\nHuman: Hi?\n\nAssistant: No."},
    "implicit_standard": {"chosen": "Q: sky? A: blue", "rejected": "Q: sky? A: green"},
    "pku_saferlhf_single": {"prompt": "Q", "response_0": "a", "response_1": "b", "better_response_id": 0},
    "helpsteer2": {"split": "train", "prompt": "Q", "response_1": "a", "response_2": "b", "preference_strength": 1},
    "ultrafeedback_raw": {"instruction": "Q", "completions": [{"response": "a", "overall_score": 8.0},
                                                              {"response": "b", "overall_score": 3.0}]},
    "chatbot_arena": {"conversation_a": [user("Q"), assistant("a")], "conversation_b": [user("Q"), assistant("b")],
                      "winner": "model_a"},
    "nectar": {"prompt": "Human: Q\n\nAssistant:", "answers": [{"answer": "a", "rank": 1.0},
                                                                 {"answer": "b", "rank": 2.0}]},
    "summarize_from_feedback": {"info": {"post": "P", "title": "T", "subreddit": "s"}, "choice": 0,
                                "summaries": [{"text": " a"}, {"text": " b"}]},
    "webgpt_comparisons": {"question": {"full_text": "Q"}, "answer_0": "a", "answer_1": "b", "score_0": 1.0,
                           "score_1": -1.0},
    "ranked": {"prompt": "Q", "completions": ["a", "b"], "scores": [1.0, 0.0]},
}


def test_every_layout_has_a_row_in_the_log_line_table():
    from dpo_min.data.layouts import LAYOUT_NAMES

    assert sorted(ONE_ROW) == sorted(LAYOUT_NAMES)


@pytest.mark.parametrize("name", list(ONE_ROW))
def test_the_log_line_names_the_layout_the_rows_are_in_and_tokenizing_reads_them_once(tmp_path, tokenizer, caplog,
                                                                                       monkeypatch, name):
    from dpo_min.data import layouts

    checked, validate = [], layouts.validate_pair
    monkeypatch.setattr(layouts, "validate_pair", lambda pair, index: checked.append(index) or validate(pair, index))
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(ONE_ROW[name]) + "\n" + json.dumps(ONE_ROW[name]) + "\n")
    with caplog.at_level(logging.INFO, logger="dpo_min.data"):
        tokenize_dataset(load_preference_dataset(str(path)), tokenizer)
    assert re.findall(r"layout (\w+) \(as", caplog.text) == [name]
    assert checked == [0, 1]  # each row validated once, when it is read; tokenizing trusts what reading produced


# ---- pairs given as a label or scores over two or more responses (dpo_min/data/labelled.py) -------------------
def test_helpsteer2_strength_sign_decides_split_selects_rows_and_ties_are_counted(tmp_path, caplog):
    # nvidia/HelpSteer2 preference/preference.jsonl.gz, as its card's "Preferences" section lists the fields
    # (arXiv 2410.01257): -3..-1 prefer response_1, 1..3 response_2, 0 about the same; train and val rows in one file.
    common = {"preference_statement": "@Response 1 is better.", "preference_elaboration": "It answers.",
              "three_most_similar_preferences": ["a", "b", "c"], "all_preferences_unprocessed": [-2, -1, -2]}
    rows = [dict(common, split="train", prompt="Name a fruit.", response_1="Apple.", response_2="Chair.",
                 preference_strength=-2),
            dict(common, split="train", prompt="Name a colour.", response_1="Loud.", response_2="Blue.",
                 preference_strength=3),
            dict(common, split="train", prompt="Say hi.", response_1="Hi.", response_2="Hello.", preference_strength=0),
            dict(common, split="val", prompt="Name a dog.", response_1="Rex.", response_2="Tom the cat.",
                 preference_strength=-1)]
    with caplog.at_level(logging.WARNING):
        pairs = load(tmp_path, rows)
    assert pairs == [{"prompt": "Name a fruit.", "chosen": "Apple.", "rejected": "Chair."},
                     {"prompt": "Name a colour.", "chosen": "Blue.", "rejected": "Loud."}]
    assert "dropped 2 of 4 rows that the helpsteer2 layout skips (ties, and rows of another split" in caplog.text
    assert load(tmp_path, rows, row_split="val") == [{"prompt": "Name a dog.", "chosen": "Rex.",
                                                      "rejected": "Tom the cat."}]


def ultrafeedback_completion(response, overall_score, model):
    rating = {"Rating": "4", "Rationale": "Fine."}
    return {"annotations": {"helpfulness": rating, "honesty": rating, "instruction_following": rating,
                            "truthfulness": rating},
            "critique": "Good.", "custom_system_prompt": "", "fine-grained_score": 4.0, "model": model,
            "overall_score": overall_score, "principle": "helpfulness", "response": response}


def test_ultrafeedback_raw_is_binarized_as_h4_with_a_seeded_draw(tmp_path, caplog):
    # openbmb/UltraFeedback (its card's fields); HuggingFaceH4/ultrafeedback_binarized's card: chosen = the highest
    # overall_score, rejected = one of the remaining three at random.
    def row(instruction):
        answers = [("Paris is in Spain.", 2.0, "alpaca-7b"), ("Paris.", 9.5, "gpt-4"), ("France?", 5.0, "llama-2"),
                   ("Lyon.", 1.0, "falcon-40b")]
        return {"source": "evol_instruct", "instruction": instruction, "models": [m for _, _, m in answers],
                "completions": [ultrafeedback_completion(*answer) for answer in answers],
                "correct_answers": ["None"], "incorrect_answers": ["None"]}

    rows = [row(f"What is the capital of France? ({n})") for n in range(12)]
    with caplog.at_level(logging.INFO, logger="dpo_min.data"):
        pairs = load(tmp_path, rows)
    assert "H4's binarization: chosen = the highest overall_score, rejected = a seeded random other" in caplog.text
    assert all(pair["chosen"] == [assistant("Paris.")] for pair in pairs)
    assert all(pair["prompt"] == [user(row["instruction"])] for pair, row in zip(pairs, rows))
    drawn = [pair["rejected"][0]["content"] for pair in pairs]
    assert set(drawn) <= {"Paris is in Spain.", "France?", "Lyon."} and len(set(drawn)) > 1  # random, never chosen
    again = load(tmp_path, rows[::-1])  # the draw is the row's own, whatever the order it is read in
    assert [pair["rejected"][0]["content"] for pair in again] == drawn[::-1]


def test_chatbot_arena_winner_is_chosen_ties_and_diverged_turns_are_dropped_and_counted(tmp_path, caplog):
    # lmsys/chatbot_arena_conversations (its card's fields): winner model_a / model_b / tie / tie (bothbad).
    def row(winner, a, b, turn=1):
        return {"question_id": "q", "model_a": "vicuna-13b", "model_b": "koala-13b", "winner": winner,
                "judge": "arena_user_1", "conversation_a": a, "conversation_b": b, "turn": turn, "anony": True,
                "language": "English", "tstamp": 1682351591.13}

    question = [user("Name a planet.")]
    rows = [row("model_a", [*question, assistant("Mars.")], [*question, assistant("The Sun.")]),
            row("model_b", [*question, assistant("The Moon.")], [*question, assistant("Venus.")]),
            row("tie", [*question, assistant("Mars.")], [*question, assistant("Venus.")]),
            row("tie (bothbad)", [*question, assistant("No.")], [*question, assistant("Pass.")]),
            row("model_a", [*question, assistant("Mars."), user("Another?"), assistant("Venus.")],  # answers differ
                [*question, assistant("Pluto."), user("Another?"), assistant("Ceres.")], turn=2),
            row("model_b", [*question, assistant("Mars."), user("Another?"), assistant("Ceres.")],
                [*question, assistant("Mars."), user("Another?"), assistant("Jupiter.")], turn=2)]
    with caplog.at_level(logging.WARNING):
        pairs = load(tmp_path, rows)
    assert pairs == [
        {"prompt": question, "chosen": [assistant("Mars.")], "rejected": [assistant("The Sun.")]},
        {"prompt": question, "chosen": [assistant("Venus.")], "rejected": [assistant("The Moon.")]},
        {"prompt": [*question, assistant("Mars."), user("Another?")], "chosen": [assistant("Jupiter.")],
         "rejected": [assistant("Ceres.")]}]
    assert "dropped 3 of 6 rows that the chatbot_arena layout skips (ties, and multi-turn rows" in caplog.text


def test_nectar_rank_one_against_a_lower_ranked_answer(tmp_path):
    # berkeley-nest/Nectar (its card's fields): an HH-style prompt, seven answers each with a rank (1 is best).
    answers = [{"answer": "Four.", "model": "gpt-4", "rank": 1.0}, {"answer": "Five.", "model": "llama", "rank": 3.0},
               {"answer": "2+2 is 4, I think.", "model": "gpt-3.5", "rank": 2.0}]
    rows = [{"prompt": "Human: What is 2+2?\n\nAssistant:", "answers": answers[::-1], "turns": 1,
             "num_responses": 3, "source": ["sharegpt"], "good_natured": True},
            {"prompt": "Human: Hi.\n\nAssistant: Hello.\n\nHuman: What is 2+2?\n\nAssistant:", "answers": answers,
             "turns": 2, "num_responses": 3, "source": ["anthropic-hh"], "good_natured": True}]
    first, second = load(tmp_path, rows)
    assert first["prompt"] == [user("What is 2+2?")]
    assert second["prompt"] == [user("Hi."), assistant("Hello."), user("What is 2+2?")]
    for pair in (first, second):
        assert pair["chosen"] == [assistant("Four.")]
        assert pair["rejected"] in ([assistant("Five.")], [assistant("2+2 is 4, I think.")])


def test_pku_saferlhf_single_dimension_reads_its_one_label(tmp_path):
    # PKU-Alignment/PKU-SafeRLHF-single-dimension: better_response_id and no safer_response_id.
    row = {"prompt": "How do I bake bread?", "response_0": "Buy some.", "response_1": "Knead, rise, bake.",
           "prompt_source": "Alpaca3-70B", "response_0_source": "Alpaca-7B", "response_1_source": "Alpaca-7B",
           "better_response_id": 1}
    assert load(tmp_path, [row]) == [{"prompt": "How do I bake bread?", "chosen": "Knead, rise, bake.",
                                      "rejected": "Buy some."}]
    with pytest.raises(ValueError, match="has only better_response_id"):
        load(tmp_path, [row], preference_label="safer_response_id")


def test_summarize_from_feedback_follows_trl_tldr_preference(tmp_path):
    # openai/summarize_from_feedback "comparisons" (its card's fields); TRL's examples/datasets/tldr_preference.py:
    # the prompt in TRL's TL;DR format (CNN/DM batches: its article format), chosen = summaries[choice], stripped.
    post = {"id": "t3_1", "post": "I lost my keys twice.", "title": "Keys", "subreddit": "tifu", "site": None,
            "article": None}
    article = {"id": "cnn_1", "post": None, "title": None, "subreddit": None, "site": "cnn", "article": "Rain fell."}
    rows = [{"info": post, "summaries": [{"text": " I lose keys.", "policy": "sup2", "note": None},
                                         {"text": " Cats.", "policy": "ref", "note": None}],
             "choice": 0, "worker": "w1", "batch": "batch3", "split": "train", "extra": {"confidence": 8}},
            {"info": article, "summaries": [{"text": " Sun.", "policy": "sup2", "note": None},
                                            {"text": " It rained.", "policy": "ref", "note": None}],
             "choice": 1, "worker": "w2", "batch": "cnndm0", "split": "valid1", "extra": {"confidence": 6}}]
    assert load(tmp_path, rows) == [
        {"prompt": [user("SUBREDDIT: r/tifu\n\nTITLE: Keys\n\nPOST: I lost my keys twice.\n\nTL;DR:")],
         "chosen": [assistant("I lose keys.")], "rejected": [assistant("Cats.")]},
        {"prompt": [user("Article:\nRain fell.\n\nTL;DR:")], "chosen": [assistant("It rained.")],
         "rejected": [assistant("Sun.")]}]


def test_webgpt_comparisons_higher_score_is_chosen_and_ties_are_counted(tmp_path, caplog):
    # openai/webgpt_comparisons (its card's fields); ties dropped as open-instruct's scripts/data/preferences/webgpt.py.
    def row(question, answer_0, score_0, answer_1, score_1):
        quotes = {"title": ["Sky"], "extract": ["Light scatters."]}
        return {"question": {"dataset": "eli5", "id": "q1", "full_text": question}, "quotes_0": quotes,
                "answer_0": answer_0, "tokens_0": {"prompt": [1], "completion": [2]}, "score_0": score_0,
                "quotes_1": quotes, "answer_1": answer_1, "tokens_1": {"prompt": [1], "completion": [2]},
                "score_1": score_1}

    rows = [row("Why is the sky blue?", "Scattering.", 1.0, "Paint.", -1.0),
            row("Why is grass green?", "Magic.", -0.5, "Chlorophyll.", 0.5),
            row("Why is snow white?", "Light.", 0.0, "Ice.", 0.0)]
    with caplog.at_level(logging.WARNING):
        pairs = load(tmp_path, rows)
    assert pairs == [{"prompt": "Why is the sky blue?", "chosen": "Scattering.", "rejected": "Paint."},
                     {"prompt": "Why is grass green?", "chosen": "Chlorophyll.", "rejected": "Magic."}]
    assert "dropped 1 of 3 rows that the webgpt_comparisons layout skips (ties)" in caplog.text


# ---- a label is never silently ignored --------------------------------------------------------------------------
HELPSTEER2_ROW = {"split": "train", "prompt": "Name a colour.", "response_1": "Loud.", "response_2": "Blue.",
                  "preference_strength": 3}
ARENA_ROW = {"winner": "model_b", "conversation_a": [user("Q"), assistant("Bad.")],
             "conversation_b": [user("Q"), assistant("Good.")]}


@pytest.mark.parametrize("row, columns, label", [
    (HELPSTEER2_ROW, {"chosen": "response_1", "rejected": "response_2"}, "preference_strength"),
    (ARENA_ROW, {"chosen": "conversation_a", "rejected": "conversation_b"}, "winner"),
    ({"q": "Q", "a": "x", "b": "y", "choice": 1}, {"prompt": "q", "chosen": "a", "rejected": "b"}, "choice"),
    ({"prompt": "Q", "chosen": "x", "rejected": "y", "human_preference": "y"}, None, "human_preference"),
], ids=["helpsteer2-mapped", "arena-mapped", "choice-mapped", "unmapped-preference"])
def test_a_mapping_that_leaves_a_label_unread_is_refused_naming_it(tmp_path, row, columns, label):
    with pytest.raises(ValueError, match=rf"column '{label}' looks like a preference label.*--label_column {label}"):
        load(tmp_path, [row], columns=columns)


def test_the_label_options_read_a_mapped_label(tmp_path):
    rows = [{"question": "Name a planet.", "answer_a": "Mars.", "answer_b": "The Sun.", "winner": "A"},
            {"question": "Name a fruit.", "answer_a": "Chair.", "answer_b": "Apple.", "winner": "B"}]
    options = {"columns": {"prompt": "question", "chosen": "answer_a", "rejected": "answer_b"},
               "label_column": "winner", "label_chosen": "A", "label_rejected": "B"}
    assert load(tmp_path, rows, **options) == [{"prompt": "Name a planet.", "chosen": "Mars.", "rejected": "The Sun."},
                                               {"prompt": "Name a fruit.", "chosen": "Apple.", "rejected": "Chair."}]
    with pytest.raises(ValueError, match=r"row 1: field 'winner' is 'tie', neither --label_chosen 'A'"):
        load(tmp_path, [rows[0], dict(rows[1], winner="tie")], **options)


def test_label_options_on_a_layout_with_its_own_label_are_refused(tmp_path):
    with pytest.raises(ValueError, match="the helpsteer2 layout reads its own label"):
        load(tmp_path, [HELPSTEER2_ROW], label_column="split", label_chosen="train", label_rejected="val")


def test_label_names_that_are_refused_and_those_that_describe_a_pair_in_order():
    from dpo_min.data.labelled import unread_labels

    named_like_labels = ["winner", "label", "labels", "choice", "rank", "overall_preference", "Preference",
                         "better_response_id", "score_0", "score_A"]
    in_order = ["score_chosen", "score_rejected", "chosen_rating", "prompt", "source", "scores", "ranking_model"]
    assert unread_labels(named_like_labels + in_order, read=()) == named_like_labels


def test_the_command_reads_the_label_and_row_split_options(tmp_path):
    from dpo_min import train
    from dpo_min.train.command_line import parse_args

    mapped = tmp_path / "mapped.jsonl"
    mapped.write_text("".join(json.dumps(row) + "\n" for row in [
        {"question": "Name a planet.", "answer_a": "Mars.", "answer_b": "The Sun.", "winner": "A"},
        {"question": "Name a fruit.", "answer_a": "Chair.", "answer_b": "Apple.", "winner": "B"}]))
    helpsteer2 = tmp_path / "preference.jsonl"
    helpsteer2.write_text("".join(json.dumps(row) + "\n" for row in [
        dict(HELPSTEER2_ROW, split="val"), dict(HELPSTEER2_ROW, prompt="Q", response_1="a", response_2="b")]))
    common = ["--output_dir", str(tmp_path / "out"), "--eval_fraction", "0", "--report_to", "none"]
    for given, expected in [
        (["--dataset", str(mapped), "--prompt_column", "question", "--chosen_column", "answer_a",
          "--rejected_column", "answer_b", "--label_column", "winner", "--label_chosen", "A", "--label_rejected", "B"],
         [("Name a planet.", "Mars."), ("Name a fruit.", "Apple.")]),
        (["--dataset", str(helpsteer2), "--row_split", "val"], [("Name a colour.", "Blue.")])]:
        pairs, _ = train.load_pairs(train.decide(*parse_args([*given, *common])))
        assert [(pair["prompt"], pair["chosen"]) for pair in pairs] == expected


@pytest.mark.parametrize("row", [
    {"prompt": "What is 2 + 3?", "solution": "5"},  # TRL's prompt-only layout (GRPO's math data)
    {"prompt": [{"role": "user", "content": "What is 2 + 3?"}]},  # ... conversational
], ids=["text", "messages"])
def test_prompt_only_rows_are_refused_offline_pointing_to_dpo_in_rounds_which_reads_them(tmp_path, row):
    from dpo_min.rounds.prompts import prompt_rows

    path = tmp_path / "prompts.jsonl"
    path.write_text((json.dumps(row) + "\n") * 3)
    with pytest.raises(ValueError, match=r"prompts\.jsonl.*no known preference layout has the columns \[prompt.*\]: "
                                         r"they are prompt-only data \(a prompt, no chosen and rejected answers\), "
                                         r"whose answers DPO in rounds samples and scores \(--rounds N"):
        load_preference_dataset(str(path))
    assert [checked["prompt"] for checked in prompt_rows([row] * 3)] == [row["prompt"]] * 3  # the rounds read them
    # A prompt beside answers under other names is no prompt-only data: the other refusal, naming the columns
    path.write_text(json.dumps({"prompt": "Q", "good": "a", "bad": "b"}) + "\n")
    with pytest.raises(ValueError, match=r"prompt-only data .*if the answers are there, name the columns with "
                                         r"--prompt_column/--chosen_column/--rejected_column"):
        load_preference_dataset(str(path))


def test_helpsteer2_attribute_rows_are_one_answer_with_scores_not_prompt_only_data(tmp_path):
    # nvidia/HelpSteer2's train.jsonl.gz: one response per row, scored 0-4 on five attributes
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": "Name a fruit.", "response": "Apple.", "helpfulness": 3, "correctness": 4,
                                "coherence": 4, "complexity": 1, "verbosity": 1}) + "\n")
    with pytest.raises(ValueError) as error:
        load_preference_dataset(str(path))
    message = str(error.value)
    assert message == (f"{path}: no known preference layout has the columns [prompt, response, helpfulness, "
                       "correctness, coherence, complexity, verbosity]: a 'response' is one answer (with scores, as "
                       "HelpSteer2's attribute files), neither a pair nor prompt-only data; DPO reads pairs: "
                       "HelpSteer2's are its preference file (preference/preference.jsonl.gz, the helpsteer2 layout)")
    assert "--rounds" not in message

