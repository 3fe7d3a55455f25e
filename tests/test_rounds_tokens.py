"""On-policy to the token: a round's DPO pass trains on the ids the policy was given and sampled, rendered by the
one prompt renderer (`tokenizing.render_prompts`) that the DPO pass, the sampler and the command's report share.

Checked on a tiny random Llama with the SmolLM2 tokenizer: a sample cut by max_completion_length trains without
an EOS it never produced (the text path appends one), the trainer's per-sequence log-prob of each sampled
completion equals the sum of the sampler's own per-token log-probs of the same ids, a template switch in
chat_template_kwargs reaches the sampled prompt, and a round's pairs.jsonl trained again offline uses its ids."""

import copy
import json

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dpo_min import DPOMinConfig, DPOMinTrainer, load_preference_dataset, sequence_logps, tokenize_dataset
from dpo_min.rounds import RoundsConfig, run_rounds
from dpo_min.rounds.loop import pair_dataset
from dpo_min.tokenizing import render_prompts

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
    good = {"prompt": "p", "chosen": "a", "rejected": "b", "prompt_ids": [1, 2], "chosen_ids": [3],
            "rejected_ids": [4]}
    with pytest.raises(ValueError, match=r"row 1: field 'chosen_ids': expected a non-empty list of token ids"):
        tokenize_dataset(Dataset.from_list([good, {**good, "chosen_ids": [10**9]}]), tokenizer)
    with pytest.raises(ValueError, match=r"row 0: field 'rejected_ids' is missing"):
        tokenize_dataset([{key: value for key, value in good.items() if key != "rejected_ids"}], tokenizer)


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
