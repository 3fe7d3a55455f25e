import copy
import math

import pytest
import torch
from conftest import tiny_llama
from peft import LoraConfig, get_peft_model

from dpo_min import DPOMinConfig, DPOMinTrainer

METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "logits/chosen", "logits/rejected")


def config(tmp_path, **overrides):
    settings = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=3, logging_steps=1,
                    report_to="none", learning_rate=5e-3, save_strategy="no", seed=7, use_cpu=True,
                    disable_tqdm=True, max_length=1024, bf16=False, gradient_checkpointing=False)
    settings.update(overrides)
    return settings


def lora():
    return LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)


def step_logs(trainer):
    return [entry for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("use_lora", [True, False], ids=["lora", "full"])
def test_matches_trl_dpo_trainer_step_by_step(tmp_path, tokenizer, hh_pairs, use_lora):
    import trl  # the reference: missing is a failure, not a skip
    settings = config(tmp_path)
    ours = DPOMinTrainer(tiny_llama(), DPOMinConfig(**settings), train_dataset=hh_pairs, processing_class=tokenizer,
                         peft_config=lora() if use_lora else None)
    ours.train()
    theirs_model = tiny_llama()
    theirs = trl.DPOTrainer(
        model=theirs_model, ref_model=None if use_lora else copy.deepcopy(theirs_model),
        args=trl.DPOConfig(**settings), train_dataset=hh_pairs, processing_class=tokenizer,
        peft_config=lora() if use_lora else None,
    )
    theirs.train()
    ours_logs, theirs_logs = step_logs(ours), step_logs(theirs)
    assert len(ours_logs) == len(theirs_logs) == 3
    for step, (mine, reference) in enumerate(zip(ours_logs, theirs_logs)):
        for key in METRICS:
            assert mine[key] == pytest.approx(reference[key], abs=1e-4, rel=1e-5), (step, key)
    # The run must have moved the policy, or the comparison above proves little.
    assert ours_logs[-1]["rewards/margins"] != 0.0


def test_untrained_adapter_gives_ln2_and_zero_rewards(tmp_path, tokenizer, hh_pairs):
    trainer = DPOMinTrainer(tiny_llama(), DPOMinConfig(**config(tmp_path, max_steps=1)), train_dataset=hh_pairs,
                            processing_class=tokenizer, peft_config=lora())
    trainer.train()
    first = step_logs(trainer)[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["rewards/chosen"] == 0.0 and first["rewards/rejected"] == 0.0


def _grads_after_one_step(tmp_path, tokenizer, pairs, batch, accumulation):
    model = tiny_llama()
    args = DPOMinConfig(**config(tmp_path, per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation,
                                 max_steps=1, learning_rate=1.0, optim="sgd", max_grad_norm=0.0,
                                 lr_scheduler_type="constant", weight_decay=0.0))
    trainer = DPOMinTrainer(model, args, train_dataset=pairs, processing_class=tokenizer)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer.train()
    # SGD with lr 1: the step is minus the gradient.
    return {name: before[name] - p.detach() for name, p in model.named_parameters()}


def test_gradient_accumulation_equals_one_big_batch(tmp_path, tokenizer, hh_pairs):
    accumulated = _grads_after_one_step(tmp_path, tokenizer, hh_pairs, batch=2, accumulation=4)
    big = _grads_after_one_step(tmp_path, tokenizer, hh_pairs, batch=8, accumulation=1)
    assert max(g.abs().max().item() for g in big.values()) > 1e-4
    for name in big:
        torch.testing.assert_close(accumulated[name], big[name], atol=1e-5, rtol=0)


def test_precomputed_reference_gives_the_same_run(tmp_path, tokenizer, hh_pairs):
    runs = []
    for precompute in (False, True):
        trainer = DPOMinTrainer(tiny_llama(), DPOMinConfig(**config(tmp_path, precompute_ref_log_probs=precompute)),
                                train_dataset=hh_pairs, processing_class=tokenizer, peft_config=lora())
        trainer.train()
        runs.append(step_logs(trainer))
    assert "ref_chosen_logps" in trainer.train_dataset.column_names
    for online, precomputed in zip(*runs):
        for key in METRICS:
            assert precomputed[key] == pytest.approx(online[key], abs=1e-5), key


def test_full_finetune_precompute_without_ref_model_keeps_no_reference_copy(tmp_path, tokenizer, hh_pairs):
    trainer = DPOMinTrainer(tiny_llama(), DPOMinConfig(**config(tmp_path, precompute_ref_log_probs=True)),
                            train_dataset=hh_pairs, eval_dataset=hh_pairs.select(range(2)),
                            processing_class=tokenizer)
    assert trainer.ref_model is None
    trainer.train()
    # Precomputed before the first step, so eval still compares against the untrained model.
    assert "ref_chosen_logps" in trainer.eval_dataset.column_names
    assert step_logs(trainer)[0]["rewards/margins"] == 0.0


def test_ref_model_stays_frozen(tmp_path, tokenizer, hh_pairs):
    ref_model = tiny_llama(seed=3)
    before = {name: p.detach().clone() for name, p in ref_model.named_parameters()}
    trainer = DPOMinTrainer(tiny_llama(), DPOMinConfig(**config(tmp_path)), train_dataset=hh_pairs,
                            processing_class=tokenizer, ref_model=ref_model)
    trainer.train()
    assert not ref_model.training
    for name, param in ref_model.named_parameters():
        assert not param.requires_grad
        assert torch.equal(param, before[name]), name
    # A different reference than the starting policy: rewards are non-zero from the first step.
    assert step_logs(trainer)[0]["rewards/chosen"] != 0.0


def test_reference_of_a_trained_adapter_is_that_adapter_not_the_base_model(tmp_path, tokenizer, hh_pairs):
    base = tiny_llama()
    peft_model = get_peft_model(base, lora())
    with torch.no_grad():  # a "trained" adapter: B no longer zero
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    trainer = DPOMinTrainer(peft_model, DPOMinConfig(**config(tmp_path, max_steps=1)), train_dataset=hh_pairs,
                            processing_class=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    policy = trainer.reference_logps(batch).logps  # reference before any step
    with torch.no_grad():
        from dpo_min.logps import sequence_logps
        current = sequence_logps(trainer.model, batch).logps
        with peft_model.disable_adapter():
            bare = sequence_logps(trainer.model, batch).logps
    torch.testing.assert_close(policy, current)
    assert (policy - bare).abs().max() > 1e-3
    trainer.train()
    first = step_logs(trainer)[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    # The reference adapter did not move while the trained one did.
    ref_weights = {n: p for n, p in trainer.model.named_parameters() if ".ref." in n}
    assert ref_weights and not any(p.requires_grad for p in ref_weights.values())


def test_eval_metrics_carry_the_eval_prefix(tmp_path, tokenizer, hh_pairs):
    trainer = DPOMinTrainer(tiny_llama(), DPOMinConfig(**config(tmp_path)), train_dataset=hh_pairs,
                            eval_dataset=hh_pairs.select(range(4)), processing_class=tokenizer, peft_config=lora())
    metrics = trainer.evaluate()
    for key in METRICS:
        assert f"eval_{key}" in metrics
    assert metrics["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)


def test_metrics_average_every_micro_batch_of_the_interval(tmp_path, tokenizer, hh_pairs):
    trainer = DPOMinTrainer(tiny_llama(), DPOMinConfig(**config(tmp_path, max_steps=1, gradient_accumulation_steps=4,
                                                                  per_device_train_batch_size=2)),
                            train_dataset=hh_pairs, processing_class=tokenizer, peft_config=lora())
    trainer.train()
    logged = step_logs(trainer)[0]["logps/chosen"]
    # The same 8 pairs in one batch: the mean of the four micro-batch means equals the mean over all 8.
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(8)])
    with torch.no_grad(), trainer.model.disable_adapter():
        from dpo_min.logps import sequence_logps
        chosen = sequence_logps(trainer.model, batch).logps.chunk(2)[0]
    assert logged == pytest.approx(chosen.mean().item(), rel=1e-5)


def test_a_last_batch_of_one_pair_is_logged_whole(tmp_path, tokenizer, hh_pairs):
    trainer = DPOMinTrainer(tiny_llama(), DPOMinConfig(**config(tmp_path, max_steps=2)),
                            train_dataset=hh_pairs.select(range(3)), processing_class=tokenizer, peft_config=lora())
    trainer.train()
    last = step_logs(trainer)[1]  # 3 pairs in batches of 2: the second batch holds one pair
    assert last["rewards/accuracies"] in (0.0, 1.0)
    assert last["rewards/margins"] == pytest.approx(last["rewards/chosen"] - last["rewards/rejected"], abs=1e-7)


def test_a_tokenizer_without_pad_token_pads_with_eos(tmp_path, tokenizer, hh_pairs):
    tokenizer.pad_token = None
    trainer = DPOMinTrainer(tiny_llama(), DPOMinConfig(**config(tmp_path, max_steps=1)), train_dataset=hh_pairs,
                            processing_class=tokenizer, peft_config=lora())
    assert tokenizer.pad_token == tokenizer.eos_token
    assert trainer.data_collator.pad_token_id == tokenizer.eos_token_id
