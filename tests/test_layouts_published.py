"""One test per published layout, with rows written exactly with the columns of that dataset's card (there is no hub
access here). Each checks what the pair becomes, so a layout that loses or moves text fails."""

import json
import logging
import re

import pytest
from datasets import Dataset

from dpo_min.data.loading import load_preference_dataset, tokenize_dataset


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
    args = trl.DPOConfig(output_dir="unused", report_to="none", max_length=None, bf16=False, use_cpu=True)
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
