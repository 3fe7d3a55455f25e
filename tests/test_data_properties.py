"""Property-based: whatever rows arrive, the data path ends in a ValueError that names the row and field, or in
examples the collator turns into a correct batch. Never an IndexError deep inside, never a silent wrong batch."""

import gzip
import json
import re

import pytest
from conftest import HH_PATH
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpo_min import DPODataCollator
from dpo_min.data.loading import load_preference_dataset
from dpo_min.tokenizing import tokenize_dataset

MAX_LENGTH = 48
ROW_FIELD_ERROR = re.compile(r"^(row 0: field '(prompt|chosen|rejected|conversations)'|no known preference layout)")
TRIED = {"examples": 0, "rejected": 0, "tokenized": 0}

text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", "   ", "\n\n", "\x00", "\ud800 lone surrogate", "é\u0301 combining", "😀" * 30,
                     "<|im_end|>", "\u202e right-to-left", "word " * 80]),
)
scalar = st.one_of(st.none(), st.integers(), st.floats(allow_nan=True), st.booleans(), text)
message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "wizard", None, 3]),
                           "content": st.one_of(text, st.none(), st.integers())}),
    st.dictionaries(st.sampled_from(["role", "content", "from", "value"]), scalar, max_size=3),
    scalar,
)
messages = st.lists(message, max_size=4)
field_value = st.one_of(scalar, messages, st.dictionaries(st.sampled_from(["from", "value"]), text, max_size=2))
row = st.dictionaries(st.sampled_from(["prompt", "chosen", "rejected", "conversations", "extra"]), field_value,
                      max_size=5)
hh_row = st.builds(lambda a, b, c: {"chosen": f"\n\nHuman: {a}\n\nAssistant: {b}",
                                    "rejected": f"\n\nHuman: {a}\n\nAssistant: {c}"}, text, text, text)
plausible_row = st.builds(
    lambda user, good, bad, as_messages: (
        {"prompt": [{"role": "user", "content": user}], "chosen": [{"role": "assistant", "content": good}],
         "rejected": [{"role": "assistant", "content": bad}]} if as_messages
        else {"prompt": user, "chosen": good, "rejected": bad}),
    text, text, text, st.booleans())


def check_batch(example):
    batch = DPODataCollator(pad_token_id=0)([example])
    completion_tokens = len(example["chosen_ids"]) + len(example["rejected_ids"])
    assert int((batch["labels"] != -100).sum()) == completion_tokens
    assert batch["sequence_index"].max().item() == 1
    chosen_row = batch["input_ids"][0, : len(example["prompt_ids"]) + len(example["chosen_ids"])].tolist()
    assert chosen_row == example["prompt_ids"] + example["chosen_ids"]


@pytest.fixture(scope="module")
def shared_tokenizer(smollm_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm_path))


# derandomize: the same 400 rows on every run, so that a failure seen once reproduces.
@settings(max_examples=400, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
# plausible rows twice: a string pair without a prompt is now an error, so fewer random rows get tokenized.
@given(candidate=st.one_of(row, hh_row, plausible_row, plausible_row))
def test_any_row_is_rejected_by_name_or_tokenized_correctly(shared_tokenizer, candidate):
    TRIED["examples"] += 1
    try:
        dataset = tokenize_dataset([candidate], shared_tokenizer, max_length=MAX_LENGTH)
    except ValueError as error:
        TRIED["rejected"] += 1
        message = str(error)
        assert ROW_FIELD_ERROR.match(message) or message.startswith("no pair left: every row's prompt fills"), message
        return
    TRIED["tokenized"] += 1
    assert len(dataset) == 1
    example = dataset[0]
    assert example["chosen_ids"] and example["rejected_ids"]
    for name in ("chosen_ids", "rejected_ids"):
        assert len(example["prompt_ids"]) + len(example[name]) <= MAX_LENGTH
        assert all(0 <= token < len(shared_tokenizer) for token in example[name])
    check_batch(example)


def test_property_run_tried_many_rows():
    # Runs after the property test in file order; records how many inputs it threw at the data path.
    print(f"\nproperty test: {TRIED}")
    assert TRIED["examples"] >= 400 and TRIED["rejected"] > 50 and TRIED["tokenized"] > 50


def test_a_file_that_is_not_json_names_the_file(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\nthis is not json\n')
    with pytest.raises(ValueError, match=r"pairs\.jsonl: line 2 is not JSON: Expecting value \(column 1\)$"):
        load_preference_dataset(str(path))


def test_a_truncated_gz_names_the_file(tmp_path):
    whole = gzip.compress(HH_PATH.read_bytes()[:200_000])  # a valid gz of the first part of the file
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=r"cut\.jsonl\.gz: could not be read"):
        load_preference_dataset(str(path))


def test_a_top_level_json_scalar_names_the_file(tmp_path):
    path = tmp_path / "scalar.json"
    path.write_text(json.dumps(42))
    with pytest.raises(ValueError, match=r"scalar\.json"):
        load_preference_dataset(str(path))
