"""On-policy to the token: a round's DPO pass trains on the ids the policy was given and sampled, rendered by the
one prompt renderer (`tokenizing.render_prompts`) that the DPO pass, the sampler and the command's report share.

Checked on a tiny random Llama with the SmolLM2 tokenizer: a sample cut by max_completion_length trains without
an EOS it never produced (the text path appends one), the trainer's per-sequence log-prob of each sampled
completion equals the sum of the sampler's own per-token log-probs of the same ids, a template switch in
chat_template_kwargs reaches the sampled prompt, and a round's pairs.jsonl trained again offline uses its ids, once
they are checked to be its text's and made by the run's tokenizer and chat template (`dpo_min/data/given_ids.py`),
alone or in a mixture of any of the three forms."""

import copy
import hashlib
import json

import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from dpo_min import DPOMinConfig, DPOMinTrainer, load_preference_dataset, sequence_logps, tokenize_dataset
from dpo_min.data.mixtures import handbook_mixture, legacy_mixer, trl_mixture
from dpo_min.rounds import RoundsConfig, run_rounds
from dpo_min.rounds.loop import pair_dataset
from dpo_min.rounds.pairs import keep_trainable
from dpo_min.tokenizing import end_token_ids, render_prompts

PROMPTS = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}]} for i in range(4)]


def tiny_policy() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                                        tie_word_embeddings=False))


def id_sum(completion_ids, **_):
    """A reward that all but never ties: every prompt gives a pair."""
    return [float(sum(ids)) for ids in completion_ids]


@pytest.fixture(scope="module")
def tokenizer(smollm_path):
    return AutoTokenizer.from_pretrained(str(smollm_path))


class RecordingGenerate:
    """model.generate as the rounds call it, keeping each sampled sequence's per-token log-probs under the model's
    raw (temperature 1) distribution, and each prompt it was given."""

    def __init__(self, pad_id: int):
        self.pad_id, self.token_logps, self.prompts = pad_id, {}, []

    @torch.no_grad()
    def __call__(self, model, prompt_ids, settings):
        width = max(map(len, prompt_ids))
        input_ids = torch.tensor([[self.pad_id] * (width - len(ids)) + ids for ids in prompt_ids])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompt_ids])
        torch.manual_seed(settings.seed)
        output = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=settings.do_sample,
                                max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                                top_p=settings.top_p, top_k=None,
                                num_return_sequences=settings.num_return_sequences, pad_token_id=self.pad_id,
                                output_logits=True, return_dict_in_generate=True)
        new = output.sequences[:, width:]
        logps = torch.stack(output.logits, dim=1).float().log_softmax(-1).gather(-1, new[..., None])[..., 0]
        for row, ids in enumerate(new.tolist()):
            prompt = tuple(prompt_ids[row // settings.num_return_sequences])
            self.token_logps[(prompt, tuple(ids))] = logps[row].tolist()
            self.prompts.append(prompt)
        return new.tolist()

    def summed(self, prompt_ids, completion_ids) -> float:
        """The sampler's log-prob of a completion as cut (up to its first EOS, or max_new_tokens)."""
        for (prompt, ids), logps in self.token_logps.items():
            if list(prompt) == list(prompt_ids) and list(ids[:len(completion_ids)]) == list(completion_ids):
                return sum(logps[:len(completion_ids)])
        raise KeyError("this completion was never sampled")


@pytest.fixture(scope="module")
def one_round(tmp_path_factory, tokenizer):
    """One round of full fine-tuning with learning rate 0: the policy stays pi_0, whose samples the pairs hold."""
    folder = tmp_path_factory.mktemp("tokens")
    model = tiny_policy()
    pi_0 = copy.deepcopy(model).eval()
    recorder = RecordingGenerate(tokenizer.pad_token_id)
    config = RoundsConfig(output_dir=str(folder / "run"), rounds=1, num_generations=3, max_completion_length=5,
                          temperature=1.0, seed=3, training={"per_device_train_batch_size": 2, "learning_rate": 0.0,
                                                             "disable_tqdm": True, "save_strategy": "no"})
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DPO_MIN_CACHE", str(folder / "cache"))
        run_rounds(model, tokenizer, PROMPTS, id_sum, config, generate_fn=recorder)
    made = [json.loads(line) for line in (folder / "run" / "round-1" / "pairs.jsonl").read_text().splitlines()]
    return made, recorder, pi_0, folder


def trainer_for(model, tokenizer, data, folder, **args) -> DPOMinTrainer:
    return DPOMinTrainer(model, args=DPOMinConfig(output_dir=str(folder / "trainer"), report_to="none",
                                                  per_device_train_batch_size=2, **args),
                         train_dataset=data, processing_class=tokenizer)


def test_a_cut_sample_trains_without_an_eos_after_its_last_sampled_token(one_round, tokenizer):
    made, _, pi_0, folder = one_round
    eos = tokenizer.eos_token_id
    cut = [(pair, side) for pair in made for side in ("chosen", "rejected") if eos not in pair[f"{side}_ids"]]
    assert cut, "max_completion_length 5 cuts most samples of a random policy"
    trained = trainer_for(pi_0, tokenizer, pair_dataset(made), folder).train_dataset
    for row, pair in zip(trained, made):
        assert row["prompt_ids"] == pair["prompt_ids"]
        assert row["chosen_ids"] == pair["chosen_ids"] and row["rejected_ids"] == pair["rejected_ids"]
    for pair, side in cut:
        assert trained[made.index(pair)][f"{side}_ids"][-1] != eos
    # What the text path did, and the ids path no longer does: the cut text rendered again gains an end of turn.
    pair, side = cut[0]
    text_only = tokenize_dataset([{key: pair[key] for key in ("prompt", "chosen", "rejected")}], tokenizer)
    assert text_only[0][f"{side}_ids"] != pair[f"{side}_ids"]


def test_the_trainers_log_prob_of_a_sampled_completion_is_the_samplers_sum_of_the_same_ids(one_round, tokenizer):
    made, recorder, pi_0, folder = one_round
    trainer = trainer_for(pi_0, tokenizer, pair_dataset(made), folder)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(made))])
    with torch.no_grad():
        logps = sequence_logps(pi_0, batch).logps
    chosen, rejected = logps.chunk(2)
    for pair, chosen_logp, rejected_logp in zip(made, chosen.tolist(), rejected.tolist()):
        assert chosen_logp == pytest.approx(recorder.summed(pair["prompt_ids"], pair["chosen_ids"]), abs=1e-4)
        assert rejected_logp == pytest.approx(recorder.summed(pair["prompt_ids"], pair["rejected_ids"]), abs=1e-4)


def test_a_rounds_pairs_file_trained_offline_uses_its_ids(one_round, tokenizer):
    made, _, pi_0, folder = one_round
    pairs = load_preference_dataset(str(folder / "run" / "round-1" / "pairs.jsonl"))
    trained = trainer_for(pi_0, tokenizer, pairs, folder).train_dataset
    assert trained["chosen_ids"] == [pair["chosen_ids"] for pair in made]
    assert trained["rejected_ids"] == [pair["rejected_ids"] for pair in made]
    # Truncated as any pair: max_length cuts the given ids too.
    short = trainer_for(pi_0, tokenizer, pairs, folder, max_length=len(made[0]["prompt_ids"]) + 2).train_dataset
    assert all(len(row["chosen_ids"]) <= 2 for row in short)


def test_given_ids_are_checked_naming_the_row_and_the_field(tokenizer):
    good = {"prompt": "p", "chosen": "a", "rejected": "b", "prompt_ids": tokenizer("p")["input_ids"],
            "chosen_ids": tokenizer("a")["input_ids"], "rejected_ids": tokenizer("b")["input_ids"]}
    with pytest.raises(ValueError, match=r"row 1: field 'chosen_ids': expected a non-empty list of token ids"):
        tokenize_dataset(Dataset.from_list([good, {**good, "chosen_ids": [10**9]}]), tokenizer)
    with pytest.raises(ValueError, match=r"row 0: field 'rejected_ids' is missing"):
        tokenize_dataset([{key: value for key, value in good.items() if key != "rejected_ids"}], tokenizer)


def ids_file(tmp_path, tokenizer, suffix, change):
    """Five pairs with their ids, row 3 changed by `change(row)`, as a JSONL or CSV file (a CSV cell holds text)."""
    rows = []
    for i in range(5):
        text = {"prompt": f"What is {i} + {i}?", "chosen": f" It is {2 * i}.", "rejected": f" It is {2 * i + 1}."}
        rows.append({**text, **{f"{name}_ids": tokenizer(value)["input_ids"] for name, value in text.items()}})
    change(rows[3])
    path = tmp_path / f"pairs.{suffix}"
    if suffix == "csv":
        Dataset.from_list([{key: json.dumps(value) if isinstance(value, list) else value for key, value in row.items()}
                           for row in rows]).to_csv(path, index=False)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path), rows


@pytest.mark.parametrize(("suffix", "change", "message"), [
    # One row's float makes the loader read every row's ids as floats: it named row 0, showing [657.0, 314.0, ...]
    ("jsonl", lambda row: row["chosen_ids"].__setitem__(0, 1.5),
     "row 3: field 'chosen_ids': expected a non-empty list of token ids in [0, 49152), got [1.5, 314, 216, 38, 30]"),
    # A CSV cell is text: it was shown as the list it looks like, [1780, 314, ...]
    ("csv", lambda row: None, "row 0: field 'prompt_ids': expected a non-empty list of token ids in [0, 49152), got "
                              "the text '[1780, 314, 216, 32, 1232, 216, 32, 47]' (a CSV cell is text: give ids in "
                              "JSON lines or Parquet)"),
], ids=["a float in row 3", "csv"])
def test_given_ids_that_are_not_token_ids_name_their_row_and_show_what_it_holds(tmp_path, tokenizer, suffix, change,
                                                                                message):
    path, _ = ids_file(tmp_path, tokenizer, suffix, change)
    assert refusal(path, tokenizer) == message


def test_whole_numbers_a_loader_read_as_floats_are_the_ids_they_were(tmp_path, tokenizer):
    path, rows = ids_file(tmp_path, tokenizer, "jsonl", lambda row: row["chosen_ids"].__setitem__(0, 657.0))
    tokenized = tokenize_dataset(load_preference_dataset(path), tokenizer)
    assert tokenized["chosen_ids"] == [[int(i) for i in row["chosen_ids"]] for row in rows]


def test_a_template_switch_in_chat_template_kwargs_reaches_the_sampled_prompt(tmp_path, tokenizer):
    switched = copy.deepcopy(tokenizer)
    switched.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                              "{% if think is defined and not think %}no thinking\n{% endif %}{% endif %}")
    recorder = RecordingGenerate(switched.pad_token_id)
    config = RoundsConfig(output_dir=str(tmp_path / "run"), rounds=1, num_generations=2, max_completion_length=2,
                          seed=3, training={"per_device_train_batch_size": 2, "disable_tqdm": True,
                                            "save_strategy": "no", "chat_template_kwargs": {"think": False}})
    run_rounds(tiny_policy(), switched, PROMPTS[:2], id_sum, config, generate_fn=recorder)
    sampled = {switched.decode(list(prompt)) for prompt in recorder.prompts}
    assert sampled and all(text.endswith("assistant\nno thinking\n") for text in sampled)
    expected = render_prompts(switched, [PROMPTS[0]["prompt"]], {"think": False})[0]
    made = [json.loads(line) for line in (tmp_path / "run" / "round-1" / "pairs.jsonl").read_text().splitlines()]
    assert any(pair["prompt_ids"] == expected for pair in made)


# ---- given ids that are not their text's, or another tokenizer's or template's (issue 44, item 1) -----------------
def rewritten(made, folder, name, change=None, drop=()):
    """The round's pairs.jsonl with `change(rows)` applied and the columns `drop` left out, as a file."""
    rows = [{key: value for key, value in copy.deepcopy(row).items() if key not in drop} for row in made]
    if change is not None:
        change(rows)
    path = folder / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def refusal(path, tokenizer) -> str:
    with pytest.raises(ValueError) as error:
        tokenize_dataset(load_preference_dataset(path), tokenizer)
    assert len(str(error.value).splitlines()) == 1
    return str(error.value)


def another_tokenizer(chat_template) -> PreTrainedTokenizerFast:
    """A byte-level BPE of 400 tokens trained here on a few sentences: another vocabulary than SmolLM2's."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator([f"What is {i} + {i}? It is {2 * i}." for i in range(50)], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    other = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    other.chat_template = chat_template
    return other


def test_a_rounds_pairs_file_records_the_tokenizer_and_template_that_made_its_ids(one_round, tokenizer):
    made, _, _, folder = one_round
    vocabulary = hashlib.sha256(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode()).hexdigest()
    template = hashlib.sha256(tokenizer.chat_template.encode()).hexdigest()
    assert made and all(pair["ids_tokenizer"] == vocabulary and pair["ids_template"] == template for pair in made)
    # Read back as data, the file passes its own check: the same ids, a cut sample's without an EOS.
    trained = tokenize_dataset(load_preference_dataset(str(folder / "run" / "round-1" / "pairs.jsonl")), tokenizer)
    assert trained["chosen_ids"] == [pair["chosen_ids"] for pair in made]


def test_given_ids_beside_a_rewritten_text_are_refused_naming_the_row_and_the_field(one_round, tokenizer):
    made, _, _, folder = one_round

    def answer(rows):
        rows[1]["chosen"][0]["content"] = "It is 4."

    def question(rows):
        rows[0]["prompt"][0]["content"] = "What is 9 + 9?"
    decoded = tokenizer.decode(made[1]["chosen_ids"], skip_special_tokens=True)
    assert refusal(rewritten(made, folder, "answer.jsonl", answer), tokenizer).startswith(
        f"row 1: field 'chosen_ids': the ids decode to {decoded!r}, not to the row's chosen text 'It is 4.'")
    for drop in ((), ("ids_tokenizer", "ids_template")):  # a file without fingerprints: its text is checked alike
        assert refusal(rewritten(made, folder, "question.jsonl", question, drop), tokenizer).startswith(
            "row 0: field 'prompt_ids': the ids are not the row's prompt as this run renders it")


def test_given_ids_of_another_tokenizer_are_refused_naming_the_row_and_the_field(one_round, tokenizer):
    made, _, _, folder = one_round
    other = another_tokenizer(tokenizer.chat_template)
    assert refusal(rewritten(made, folder, "pairs.jsonl"), other).startswith(
        "row 0: field 'ids_tokenizer': the ids were made by another tokenizer")
    # A hand-made file of the other tokenizer's ids, with no fingerprint, trained with SmolLM2's: each id is in
    # its vocabulary, and the text they decode to is not the row's.
    text = {"prompt": "What is 2 + 2?", "chosen": " It is 4.", "rejected": " It is 5."}
    row = {**text, **{f"{name}_ids": other(value)["input_ids"] for name, value in text.items()}}
    assert max(max(row[f"{name}_ids"]) for name in text) < len(other) < len(tokenizer)
    path = rewritten([row], folder, "by_hand.jsonl")
    assert refusal(path, tokenizer).startswith("row 0: field 'prompt_ids': the ids are not the row's prompt")
    assert tokenize_dataset(load_preference_dataset(path), other)["chosen_ids"] == [row["chosen_ids"]]


def test_given_ids_under_another_chat_template_are_refused_naming_the_row_and_the_field(one_round, tokenizer):
    made, _, _, folder = one_round
    switched = copy.deepcopy(tokenizer)
    switched.chat_template = tokenizer.chat_template.replace("You are a helpful AI assistant", "You are terse")
    assert refusal(rewritten(made, folder, "pairs.jsonl"), switched).startswith(
        "row 0: field 'ids_template': the prompt ids were rendered by another chat template")
    unmarked = rewritten(made, folder, "unmarked.jsonl", drop=("ids_tokenizer", "ids_template"))
    assert refusal(unmarked, switched).startswith("row 0: field 'prompt_ids': the ids are not the row's prompt")


# A stream is tokenized as it trains: its refusal came from the DataLoader (in a worker, or not), as a traceback.
@pytest.mark.parametrize("extra", [[], ["--streaming"], ["--streaming", "--dataloader_num_workers", "1"]],
                         ids=["map-style", "streaming", "streaming, a worker"])
def test_the_command_refuses_given_ids_beside_a_rewritten_text_in_one_line(one_round, tiny_model_dir, tmp_path,
                                                                           capsys, extra):
    from dpo_min.train import main

    made, _, _, folder = one_round

    def answer(rows):
        rows[1]["rejected"][0]["content"] = "It is 4."
    path = rewritten(made, folder, "command.jsonl", answer)
    code = main(["--model", str(tiny_model_dir), "--dataset", path, "--eval_fraction", "0", "--max_steps", "1",
                 "--report_to", "none", "--disable_tqdm", "true", "--output_dir", str(tmp_path / "run"), *extra])
    err = capsys.readouterr().err.strip()
    assert code == 1 and "Traceback" not in err, err
    assert err.splitlines()[-1].startswith("python -m dpo_min.train: error: row 1: field 'rejected_ids': the ids "
                                           "decode to"), err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("form", ["trl", "handbook", "legacy"])
def test_a_mixture_of_pairs_with_their_ids_trains_the_ids_in_every_form(tmp_path, tokenizer, form):
    # Ids without an EOS, as a cut sample of DPO in rounds has them: the text tokenized again would append one.
    rows = []
    for i in range(6):
        text = {"prompt": f"What is {i} + {i}?", "chosen": f" It is {2 * i}.", "rejected": f" It is {2 * i + 1}."}
        rows.append({**text, **{f"{name}_ids": tokenizer(value)["input_ids"] for name, value in text.items()}})
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    mixture = {"trl": lambda: trl_mixture([{"path": str(path)}]),
               "handbook": lambda: handbook_mixture({"datasets": [{"id": str(path)}]}),
               "legacy": lambda: legacy_mixer({str(path): 1.0}, ["train"])}[form]()
    trained = tokenize_dataset(mixture.train, tokenizer)
    ids = ("prompt_ids", "chosen_ids", "rejected_ids")
    # The legacy form kept only the handbook's text columns, and the text was tokenized again with an EOS.
    assert sorted(tuple(map(tuple, (row[name] for name in ids))) for row in trained) == \
        sorted(tuple(map(tuple, (row[name] for name in ids))) for row in rows)
    assert all(tokenizer.eos_token_id not in row["chosen_ids"] for row in trained)


# ---- special tokens around given ids (issue 48, item 3) -----------------------------------------------------------
def hand_row(tokenizer, chosen_ids=None) -> dict:
    """A text pair with its ids as the tokenizer encodes them (no BOS: SmolLM2's adds none), chosen_ids replaced."""
    text = {"prompt": "What is 2 + 2?", "chosen": " It is 4.", "rejected": " It is 5."}
    row = {**text, **{f"{name}_ids": tokenizer(value)["input_ids"] for name, value in text.items()}}
    return {**row, "chosen_ids": row["chosen_ids"] if chosen_ids is None else chosen_ids(row["chosen_ids"])}


def test_special_tokens_around_given_ids_are_refused_naming_the_row_and_the_field(tmp_path, tokenizer):
    start, end, text_end, file_sep = (tokenizer.convert_tokens_to_ids(token) for token in
                                      ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<file_sep>"))
    assert tokenizer.eos_token_id == end and file_sep not in tokenizer.all_special_ids  # yet decoding skips it
    padded = hand_row(tokenizer, lambda ids: [*[start] * 50, *ids, *[end] * 3])
    # What the check read before: the padded ids decode, special tokens skipped, to the row's text.
    assert tokenizer.decode(padded["chosen_ids"], skip_special_tokens=True) == padded["chosen"]
    good = hand_row(tokenizer)
    size = len(good["chosen_ids"])
    refused = {"padded": (padded, 0), "ends thrice": (hand_row(tokenizer, lambda ids: [*ids, end, end, end]), size),
               "ends on a token no sample stops on": (hand_row(tokenizer, lambda ids: [*ids, text_end]), size),
               "inside": (hand_row(tokenizer, lambda ids: [ids[0], file_sep, *ids[1:], end]), 1)}
    for name, (row, at) in refused.items():
        message = refusal(rewritten([good, row], tmp_path, f"{name}.jsonl"), tokenizer)
        assert message.startswith(f"row 1: field 'chosen_ids': id {row['chosen_ids'][at]} "
                                  f"({tokenizer.convert_ids_to_tokens(row['chosen_ids'][at])}) at position {at} is a "
                                  "special token"), (name, message)
        assert "<|im_end|> (2)" in message
    # One closing end token, as a sample that stopped has it, trains as given; so does none (a cut sample).
    closed = hand_row(tokenizer, lambda ids: [*ids, end])
    trained = tokenize_dataset(load_preference_dataset(rewritten([closed, good], tmp_path, "closed.jsonl")), tokenizer)
    assert trained["chosen_ids"] == [closed["chosen_ids"], good["chosen_ids"]]


def test_given_ids_may_close_on_the_models_own_end_of_turn_token(tmp_path, tokenizer):
    # A model whose samples also stop on <|endoftext|> (its generation_config says so; the sampler stops there too):
    # its trainer takes that closing token, where a trainer of a model that does not stop on it refuses it.
    text_end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    row = hand_row(tokenizer, lambda ids: [*ids, text_end])
    model = tiny_policy()
    assert text_end not in end_token_ids(model, tokenizer)
    at = len(row["chosen_ids"]) - 1
    with pytest.raises(ValueError, match=rf"row 0: field 'chosen_ids': id 0 \(<\|endoftext\|>\) at position {at} "):
        trainer_for(model, tokenizer, Dataset.from_list([row]), tmp_path)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, text_end]
    assert end_token_ids(model, tokenizer) == {tokenizer.eos_token_id, text_end}
    trained = trainer_for(model, tokenizer, Dataset.from_list([row]), tmp_path).train_dataset
    assert trained["chosen_ids"] == [row["chosen_ids"]]


def test_a_rounds_pair_whose_sample_holds_a_special_token_inside_is_counted_out(tmp_path, tokenizer):
    file_sep = tokenizer.convert_tokens_to_ids("<file_sep>")
    inside = {**hand_row(tokenizer, lambda ids: [ids[0], file_sep, *ids[1:]]), "chosen_reward": 1.0}
    args = DPOMinConfig(output_dir=str(tmp_path), report_to="none")
    kept, dropped = keep_trainable([inside, {**hand_row(tokenizer), "chosen_reward": 1.0}], tokenizer, args,
                                   {tokenizer.eos_token_id})
    assert len(kept) == 1 and kept[0]["chosen_ids"] == hand_row(tokenizer)["chosen_ids"]
    assert dropped["special_token_inside"] == 1
