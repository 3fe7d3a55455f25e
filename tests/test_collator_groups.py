"""The grouped layout (group_by_prompt) computes what the padded layout computes on the same pairs: each pair's
log-probs (against one-sequence-at-a-time forwards), the loss, the metrics and the gradients, while each distinct
completion of a group runs once."""

import itertools
import random
import re

import pytest
import torch
from conftest import tiny_llama
from datasets import Dataset
from peft import LoraConfig
from test_logps import naive_logps
from test_trainer import METRICS, config, step_logs

from dpo_min import DPOMinConfig, DPOMinTrainer
from dpo_min.collator_groups import GroupedDPODataCollator
from dpo_min.grouping import GroupedSampler, prompt_groups
from dpo_min.logps import sequence_logps
from dpo_min.losses import LOSSES
from dpo_min.scale.attention import use_packed_attention


def ranked_pairs(answers_per_prompt=(4, 3, 2), seed: int = 0) -> list[dict[str, list[int]]]:
    """Every better answer against every worse one, for prompts of 4, 3 and 2 answers (6 + 3 + 1 pairs), answers of
    varied lengths, a prompt of one token among them (an empty shared prefix); the prompts' pairs interleaved, as
    data need not hold a prompt's pairs together."""
    rng = random.Random(seed)

    def ids(low, high):
        return [rng.randrange(3, 64) for _ in range(rng.randint(low, high))]

    groups = []
    for number, count in enumerate(answers_per_prompt):
        prompt, answers = ids(1, 1) if number == 1 else ids(3, 9), [ids(1, 6) for _ in range(count)]
        groups.append([{"prompt_ids": prompt, "chosen_ids": answers[a], "rejected_ids": answers[b]}
                       for a in range(count) for b in range(a + 1, count)])
    return [pair for round_ in zip(*[g + [None] * 6 for g in groups]) for pair in round_ if pair]


def test_grouped_row_layout():
    pairs = [{"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6]},
             {"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [7]}]
    batch = GroupedDPODataCollator(pad_token_id=0)(pairs)
    m = -100
    # prompt[:-1] | prompt[-1] [4, 5] | prompt[-1] [6] | prompt[-1] [7]: the shared answer once, three branches.
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 3, 6, 3, 7]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 2, 3, 2, 3]]
    assert batch["labels"].tolist() == [[m, m, m, 4, 5, m, 6, m, 7]]
    assert batch["sequence_index"].tolist() == [[-1, -1, -1, 0, 0, -1, 1, -1, 2]]
    # chosen of pair 0 and 1: completion 0; rejected: completions 1 and 2
    assert batch["completion_index"].tolist() == [0, 0, 1, 2]
    visible = batch["attention_mask"][0, 0].int().tolist()
    assert visible[8] == [1, 1, 0, 0, 0, 0, 0, 1, 1]  # the third answer sees the shared prefix and itself only
    assert visible[6] == [1, 1, 0, 0, 0, 1, 1, 0, 0]


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded_rows", "padding_free"])
def test_grouped_layout_gives_each_pairs_log_probs_of_one_sequence_at_a_time(padding_free):
    model = tiny_llama(vocab_size=64).eval()
    use_packed_attention(model)
    pairs = ranked_pairs()
    with torch.no_grad():
        ours = sequence_logps(model, GroupedDPODataCollator(0, padding_free=padding_free)(pairs))
    torch.testing.assert_close(ours.logps.double(), naive_logps(model, pairs), rtol=1e-5, atol=1e-5)
    lengths = [len(p["chosen_ids"]) for p in pairs] + [len(p["rejected_ids"]) for p in pairs]
    assert ours.lengths.tolist() == lengths


def test_each_distinct_completion_runs_once():
    pairs = ranked_pairs()
    batch = GroupedDPODataCollator(0, padding_free=True)(pairs)
    # By hand, per prompt: the prompt once (its last token again at the head of each answer), each answer once.
    expected = 0
    for prompt in {tuple(p["prompt_ids"]) for p in pairs}:
        answers = {tuple(p[side]) for p in pairs if tuple(p["prompt_ids"]) == prompt
                   for side in ("chosen_ids", "rejected_ids")}
        expected += len(prompt) - 1 + sum(1 + len(answer) for answer in answers)
    assert batch["input_ids"].shape == (1, expected)
    per_pair = sum(len(p["prompt_ids"]) + len(p["chosen_ids"]) + len(p["rejected_ids"]) + 1 for p in pairs)
    assert expected < per_pair * 0.75  # against share_prompt's one segment per pair: 9 answers, not 20


def test_prompt_groups_and_the_sampler_keep_a_prompts_pairs_together():
    pairs = ranked_pairs()
    groups = prompt_groups([p["prompt_ids"] for p in pairs])
    assert [len(g) for g in groups] == [6, 3, 1]
    order = list(GroupedSampler(groups, seed=3))
    assert sorted(order) == list(range(len(pairs)))
    runs = [tuple(pairs[i]["prompt_ids"]) for i in order]
    assert len([a for a, b in itertools.pairwise(runs) if a != b]) == 2  # three runs, one per prompt
    assert list(GroupedSampler(groups, seed=3)) == order  # seeded
    sampler, epochs = GroupedSampler(groups, seed=3), set()
    for epoch in range(6):
        sampler.set_epoch(epoch)
        epochs.add(tuple(sampler))
    assert len(epochs) > 1  # another order each epoch


def test_each_seed_and_epoch_draws_its_own_group_order():
    """Epoch e drew Random(seed + e): seed 48's first epoch was seed 47's second, silently."""
    groups, orders = [[position] for position in range(30)], {}
    for seed in range(40, 50):
        sampler = GroupedSampler(groups, seed)
        for epoch in range(10):
            sampler.set_epoch(epoch)
            orders[seed, epoch] = tuple(sampler)
    assert len(set(orders.values())) == len(orders) == 100


@pytest.mark.parametrize("loss_type", ["sigmoid", "plackett_luce"])
def test_the_grouped_order_follows_data_seed_as_trainers_own_sampler_does(tmp_path, tokenizer, loss_type):
    """The grouped sampler (and plackett_luce's whole-group batches) were seeded by --seed alone: --data_seed, which
    Trainer's own sampler follows, was ignored."""
    pairs = ranked_pairs((3, 2, 4, 2, 3, 2, 2, 3))

    def batches(**seeds):
        trainer = DPOMinTrainer(tiny_llama(vocab_size=64), ref_model=tiny_llama(1, 64),
                                args=DPOMinConfig(**config(tmp_path, group_by_prompt=True, loss_type=loss_type,
                                                           **seeds)),
                                train_dataset=Dataset.from_list(pairs), processing_class=tokenizer)
        return [batch["input_ids"].tolist() for batch in trainer.get_train_dataloader()]

    order = batches(seed=1, data_seed=5)
    assert batches(seed=2, data_seed=5) == order  # the model's seed apart, the data's order is data_seed's
    assert batches(seed=5) == order  # data_seed falls back to seed
    assert batches(seed=1, data_seed=6) != order


def _trainer(tmp_path, tokenizer, pairs, grouped: bool, use_lora: bool, **options):
    # init_lora_weights=False: a non-zero adapter, so policy and reference (adapter off) differ.
    peft_config = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    return DPOMinTrainer(tiny_llama(vocab_size=64), args=DPOMinConfig(**config(tmp_path, group_by_prompt=grouped,
                                                                                **options)),
                         train_dataset=Dataset.from_list(pairs), processing_class=tokenizer,
                         peft_config=peft_config if use_lora else None,
                         ref_model=None if use_lora else tiny_llama(1, 64))


PAIR_LOSSES = [name for name in LOSSES if name != "plackett_luce"]


@pytest.mark.parametrize("use_lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("precompute", [False, True], ids=["online", "precomputed"])
def test_groups_give_the_padded_loss_metrics_and_gradients(tmp_path, tokenizer, use_lora, precompute):
    pairs = ranked_pairs()
    results = {}
    for grouped in (False, True):
        trainer = _trainer(tmp_path, tokenizer, pairs, grouped, use_lora, precompute_ref_log_probs=precompute)
        trainer.precompute_reference()
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(pairs))])
        assert ("completion_index" in batch) == grouped
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        grads = {name: p.grad for name, p in trainer.model.named_parameters() if p.requires_grad}
        metrics = {key: values[-1] for key, values in trainer.step_metrics.by_mode["train"].items()}
        results[grouped] = loss.detach(), grads, metrics
    (loss, grads, metrics), (group_loss, group_grads, group_metrics) = results[False], results[True]
    assert abs(loss.item() - 0.6931) > 1e-3  # policy differs from the reference, so the gradients are not trivial
    torch.testing.assert_close(group_loss, loss, rtol=1e-5, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(group_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # num_tokens counts the tokens computed: fewer, which is the point
    assert group_metrics.pop("num_tokens") < metrics.pop("num_tokens")
    assert group_metrics == pytest.approx(metrics, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("loss_type", PAIR_LOSSES)
def test_every_pair_loss_type_reads_the_padded_pairs(tmp_path, tokenizer, loss_type):
    pairs = ranked_pairs()
    options = {"loss_type": loss_type, "label_smoothing": 0.1 if loss_type == "exo_pair" else 0.0}
    if loss_type == "sigmoid":  # with the modifiers that read tokens per pair: LD-DPO's positions, WPO's weights
        options |= {"ld_alpha": 0.5, "use_weighting": True}
    losses = []
    for grouped in (False, True):
        trainer = _trainer(tmp_path, tokenizer, pairs, grouped, True, **options)
        losses.append(trainer.compute_loss(trainer.model, trainer.data_collator(pairs)).detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-7)


def test_a_grouped_run_with_accumulation_is_the_padded_run_on_its_order(tmp_path, tokenizer):
    pairs = ranked_pairs()
    settings = {"max_steps": 2, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "optim": "sgd",
                "learning_rate": 1.0}
    grouped = _trainer(tmp_path, tokenizer, pairs, True, True, **settings)
    grouped.train()
    # The padded layout, sequential, on the pairs in the order the grouped run's sampler drew them (epoch 0).
    order = list(GroupedSampler(prompt_groups([p["prompt_ids"] for p in pairs]), seed=7))
    padded = _trainer(tmp_path, tokenizer, [pairs[i] for i in order], False, True,
                      train_sampling_strategy="sequential", **settings)
    padded.train()
    for mine, reference in zip(step_logs(grouped), step_logs(padded), strict=True):
        for key in (*METRICS, "grad_norm"):
            assert mine[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-6), key


def test_the_commands_held_out_split_keeps_a_prompts_pairs_on_one_side(tmp_path):
    import json

    from dpo_min.train import load_pairs, resolve

    rows = [{"prompt": f"Question {n}?", "completions": ["Yes.", "No.", "Maybe.", "Later."], "scores": [3, 0, 2, 1]}
            for n in range(10)]
    path = tmp_path / "ranked.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = ["--dataset", str(path), "--eval_fraction", "0.2", "--output_dir", str(tmp_path / "out")]
    for grouped in (False, True):
        train, held_out = load_pairs(resolve(common + ["--group_by_prompt"] * grouped))
        shared = set(train["prompt"]) & set(held_out["prompt"])
        assert len(train) + len(held_out) == 60
        if grouped:
            assert shared == set() and len(held_out) == 12  # 2 of the 10 prompts, with their 6 pairs each
        else:
            assert shared  # 12 of 60 pairs drawn alone: some prompts on both sides


def test_the_held_out_split_keys_a_prompt_by_the_ids_the_trainer_groups(tmp_path, tiny_model_dir):
    """A conversation with the template's default system message written out and the same one without it render the
    same ids: the trainer groups them as one prompt, and the split, keying prompts by their JSON, put one on each
    side of it, silently."""
    import json

    from transformers import AutoTokenizer

    from dpo_min.tokenizing import render_prompts
    from dpo_min.train import load_pairs, resolve

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    default_system = rendered.split("<|im_start|>system\n", 1)[1].split("<|im_end|>", 1)[0]  # SmolLM2's
    rows = []
    for n in range(10):
        question = [{"role": "user", "content": f"Question {n}?"}]
        for written, prompt in enumerate([question, [{"role": "system", "content": default_system}, *question]]):
            rows.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": f"Yes {written}."}],
                         "rejected": [{"role": "assistant", "content": f"No {written}."}]})
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    train, held_out = load_pairs(resolve(["--model", str(tiny_model_dir), "--dataset", str(path), "--eval_fraction",
                                          "0.2", "--group_by_prompt", "--output_dir", str(tmp_path / "out")]))

    def prompts(pairs):
        return {tuple(ids) for ids in render_prompts(tokenizer, list(pairs["prompt"]), {})}

    assert len(prompts(train) | prompts(held_out)) == 10  # each question's two rows: one prompt to the trainer
    assert not prompts(train) & prompts(held_out)
    assert (len(train), len(held_out)) == (16, 4)  # 2 of the 10 prompts held out, each with both its rows


def test_a_listwise_run_with_held_out_prompts_trains_and_counts_its_epochs_in_groups(tmp_path, tiny_model_dir,
                                                                                    capsys):
    """plackett_luce with a held-out split: the sample margins collated the first --num_samples held-out pairs with
    the collator that ranks groups, which cut a group of 6 pairs to 3 that give no single order, and the run died
    before training; and the plan line counted the epochs in pairs where a batch counts groups."""
    import json

    from dpo_min.train import main

    rows = [{"prompt": f"Question {n}?", "completions": ["Yes.", "No.", "Maybe.", "Later."], "scores": [3, 0, 2, 1]}
            for n in range(10)]
    path = tmp_path / "ranked.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    argv = ["--model", str(tiny_model_dir), "--dataset", str(path), "--eval_fraction", "0.2", "--group_by_prompt",
            "--loss_type", "plackett_luce", "--per_device_train_batch_size", "2", "--max_steps", "4",
            "--num_samples", "3", "--max_new_tokens", "2", "--save_strategy", "no", "--disable_tqdm", "true",
            "--eval_on_start", "false", "--output_dir", str(tmp_path / "run")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # 8 training prompts of 6 pairs, 2 groups a batch: 4 steps are one epoch.
    assert "training: 4 steps (1 epoch of 8 groups, 48 pairs), global batch 2 groups (2 per device" in out
    shown = re.findall(r"log p\(chosen\) - log p\(rejected\): reference ([+-][\d.]+), policy ([+-][\d.]+)", out)
    assert len(shown) == 2  # one sample a held-out prompt: its 6 pairs share one greedy completion
    state = json.loads((tmp_path / "run" / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and state["epoch"] == pytest.approx(1.0)


def test_what_cannot_take_groups_is_refused_in_one_line(tmp_path, tokenizer):
    from test_layouts import tiny_model

    with pytest.raises(ValueError, match="group_by_prompt orders the pairs itself"):
        DPOMinConfig(**config(tmp_path, group_by_prompt=True, train_sampling_strategy="group_by_length"))
    pairs = Dataset.from_list(ranked_pairs())
    with pytest.raises(ValueError, match=r"only for the model families .*this model is 'mpt'"):  # ALiBi: no positions
        DPOMinTrainer(tiny_model("mpt", attn_implementation="eager"), processing_class=tokenizer,
                      args=DPOMinConfig(**config(tmp_path, group_by_prompt=True)), train_dataset=pairs,
                      ref_model=tiny_model("mpt"))
    with pytest.raises(ValueError, match=r"plackett_luce trains batches of whole groups.*no stream"):
        DPOMinTrainer(tiny_llama(vocab_size=64), processing_class=tokenizer, train_dataset=pairs.to_iterable_dataset(),
                      args=DPOMinConfig(**config(tmp_path, group_by_prompt=True, loss_type="plackett_luce")))


def _family_cases():
    from test_layouts import FAMILY_CASES

    return FAMILY_CASES


@pytest.mark.parametrize(("family", "attention"), _family_cases())
def test_every_packed_family_gives_each_pairs_log_probs_in_groups(family, attention):
    # PACKED_FAMILIES is an allow-list of families shown to keep packed segments apart (test_layouts.py); here their
    # segments of k branches, against one sequence at a time.
    from test_layouts import tiny_model

    model = tiny_model(family, attn_implementation="eager" if attention == "eager" else "sdpa").eval()
    if attention != "sdpa":
        use_packed_attention(model)
    pairs = ranked_pairs()
    with torch.no_grad():
        ours = sequence_logps(model, GroupedDPODataCollator(0, padding_free=True)(pairs)).logps
        torch.testing.assert_close(ours.double(), naive_logps(model, pairs), rtol=1e-5, atol=1e-5)


def test_flex_attention_builds_the_grouped_mask_from_segments_and_branches():
    from test_flex_attention import dense_flex_mask

    from dpo_min.scale.attention import FLEX

    batch = GroupedDPODataCollator(0)(ranked_pairs())
    assert torch.equal(dense_flex_mask(batch), batch["attention_mask"])
    model = tiny_llama(vocab_size=64, attn_implementation="sdpa").eval()
    pairs = ranked_pairs()
    with torch.no_grad():
        one_at_a_time = naive_logps(model, pairs)
        model.set_attn_implementation("flex_attention")
        use_packed_attention(model)
        assert model.config._attn_implementation == FLEX
        lean = GroupedDPODataCollator(0, padding_free=True, dense_mask=False)(pairs)
        assert "attention_mask" not in lean
        flex = sequence_logps(model, lean).logps
    torch.testing.assert_close(flex.double(), one_at_a_time, rtol=1e-5, atol=1e-5)
