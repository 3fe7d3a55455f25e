import copy
import inspect
import math
import re
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama
from peft import LoraConfig, get_peft_model

from dpo_min import DPODataCollator, DPOMinConfig, DPOMinTrainer
from dpo_min.tokenizing import tokenize_dataset

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


def adapter_weights(model, adapter):
    """One adapter's weights, copied, keyed by name without the adapter's name."""
    return {name.replace(f".{adapter}.", "."): p.detach().clone() for name, p in model.named_parameters()
            if f".{adapter}." in name}


def step_logs(trainer):
    return [entry for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("use_lora", [True, False], ids=["lora", "full"])
def test_matches_trl_dpo_trainer_step_by_step(tmp_path, tokenizer, hh_pairs, use_lora):
    import trl  # the reference: missing is a failure, not a skip

    # SGD, so that a gradient off by a constant factor also changes the steps (Adam would normalise it away), and
    # short pairs so that the rewards move far more than the rounding of the log-probs they are differences of.
    settings = config(tmp_path, max_length=64, optim="sgd", learning_rate=2.0 if use_lora else 5.0)
    ours = DPOMinTrainer(tiny_llama(), args=DPOMinConfig(**settings), train_dataset=hh_pairs,
                         processing_class=tokenizer, peft_config=lora() if use_lora else None)
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
    # Every value both log, grad_norm included, at relative 1e-5. The rewards are beta times a difference of two
    # log-probs, which TRL sums in float32: they are held to relative 1e-5 of those log-probs.
    shared = set(ours_logs[0]) & set(theirs_logs[0])
    assert {*METRICS, "grad_norm", "learning_rate"} <= shared
    for step, (mine, reference) in enumerate(zip(ours_logs, theirs_logs), start=1):
        reward_tolerance = 1e-5 * settings.get("beta", 0.1) * max(abs(reference["logps/chosen"]),
                                                                    abs(reference["logps/rejected"]))
        for key in shared:
            tolerance = {"abs": reward_tolerance} if key.startswith("rewards/") else {}
            assert mine[key] == pytest.approx(reference[key], rel=1e-5, **tolerance), (step, key)
        # Once the policy has moved, the margins are far above that tolerance, so a near miss shows.
        if step > 1:
            assert abs(mine["rewards/margins"]) > 100 * reward_tolerance, (step, mine["rewards/margins"])


def test_untrained_adapter_gives_ln2_and_zero_rewards(tmp_path, tokenizer, hh_pairs):
    trainer = DPOMinTrainer(tiny_llama(), args=DPOMinConfig(**config(tmp_path, max_steps=1)), train_dataset=hh_pairs,
                            processing_class=tokenizer, peft_config=lora())
    trainer.train()
    first = step_logs(trainer)[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["rewards/chosen"] == 0.0 and first["rewards/rejected"] == 0.0


def _grads_after_one_step(tmp_path, tokenizer, pairs, batch, accumulation, use_lora=False,
                          model_accepts_loss_kwargs=False):
    args = DPOMinConfig(**config(tmp_path, per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation,
                                 max_steps=1, learning_rate=1.0, optim="sgd", max_grad_norm=0.0,
                                 lr_scheduler_type="constant", weight_decay=0.0))
    trainer = DPOMinTrainer(tiny_llama(), args=args, train_dataset=pairs, processing_class=tokenizer,
                            peft_config=lora() if use_lora else None)
    if model_accepts_loss_kwargs:  # the control: Trainer then leaves the division by the accumulation steps to us
        trainer.model_accepts_loss_kwargs = True
    trained = {name: p for name, p in trainer.model.named_parameters() if p.requires_grad}
    before = {name: p.detach().clone() for name, p in trained.items()}
    trainer.train()
    # SGD with lr 1: the step is minus the gradient.
    return {name: before[name] - p.detach() for name, p in trained.items()}


def _relative_difference(grads, expected):
    """|grads - expected| / |expected|, the norms taken over every parameter together."""
    difference = sum(((grads[name] - value) ** 2).sum() for name, value in expected.items())
    return (difference / sum((value ** 2).sum() for value in expected.values())).sqrt().item()


@pytest.mark.parametrize("use_lora", [False, True], ids=["full", "lora"])
def test_gradient_accumulation_equals_one_big_batch(tmp_path, tokenizer, hh_pairs, use_lora):
    accumulated = _grads_after_one_step(tmp_path, tokenizer, hh_pairs, batch=2, accumulation=4, use_lora=use_lora)
    big = _grads_after_one_step(tmp_path, tokenizer, hh_pairs, batch=8, accumulation=1, use_lora=use_lora)
    assert max(g.abs().max().item() for g in big.values()) > 1e-4
    assert accumulated.keys() == big.keys()
    # float32 sums of four micro-batch gradients against one sum over eight pairs: rounding, not a formula.
    assert _relative_difference(accumulated, big) < 1e-5
    if use_lora:
        return
    # The control: if Trainer stopped dividing by the accumulation steps (model_accepts_loss_kwargs=True), the
    # gradient would be 4 times too large, and the comparison above would fail.
    control = _grads_after_one_step(tmp_path, tokenizer, hh_pairs, batch=2, accumulation=4,
                                    model_accepts_loss_kwargs=True)
    assert _relative_difference(control, big) > 1.0
    assert _relative_difference(control, {name: 4 * value for name, value in big.items()}) < 1e-5


def test_precomputed_reference_gives_the_same_run(tmp_path, tokenizer, hh_pairs):
    runs = []
    for precompute in (False, True):
        args = DPOMinConfig(**config(tmp_path, precompute_ref_log_probs=precompute))
        trainer = DPOMinTrainer(tiny_llama(), args=args, train_dataset=hh_pairs, processing_class=tokenizer,
                                peft_config=lora())
        trainer.train()
        runs.append(step_logs(trainer))
    assert "ref_chosen_logps" in trainer.train_dataset.column_names
    for online, precomputed in zip(*runs):
        for key in METRICS:
            assert precomputed[key] == pytest.approx(online[key], abs=1e-5), key


def test_full_finetune_precompute_without_ref_model_keeps_no_reference_copy(tmp_path, tokenizer, hh_pairs):
    trainer = DPOMinTrainer(tiny_llama(), args=DPOMinConfig(**config(tmp_path, precompute_ref_log_probs=True)),
                            train_dataset=hh_pairs, eval_dataset=hh_pairs.select(range(2)),
                            processing_class=tokenizer)
    assert trainer.ref_model is None
    trainer.train()
    # Precomputed before the first step, so eval still compares against the untrained model.
    assert "ref_chosen_logps" in trainer.eval_dataset.column_names
    assert step_logs(trainer)[0]["rewards/margins"] == 0.0


@pytest.mark.parametrize("use_lora", [False, True], ids=["full", "lora"])
def test_predict_reads_pairs_as_evaluate_does_and_refuses_what_it_refuses(tmp_path, tokenizer, hh_pairs, use_lora):
    """predict() tokenizes raw pairs and precomputes their reference log-probs, as evaluate() does (it was
    KeyError: 'prompt_ids'); after full fine-tuning the untrained reference is gone, and predict() is refused in
    evaluate()'s words, naming predict(), where the policy scored itself (a loss of exactly ln 2)."""
    args = DPOMinConfig(**config(tmp_path, max_steps=2, precompute_ref_log_probs=True))
    trainer = DPOMinTrainer(tiny_llama(), args=args, train_dataset=hh_pairs.select(range(4)),
                            processing_class=tokenizer, peft_config=lora() if use_lora else None)
    raw = hh_pairs.select(range(4, 6))
    tokenized = tokenize_dataset(raw, tokenizer, args.max_length, args.max_prompt_length)
    # Before the first step the policy is its reference: the loss is ln 2 by definition.
    assert trainer.predict(raw).metrics["test_loss"] == pytest.approx(math.log(2), abs=1e-6)
    trainer.train()
    if use_lora:  # the reference (the adapter off) is still there: predict() scores what evaluate() scores
        expected = trainer.evaluate(raw)["eval_loss"]
        assert abs(expected - math.log(2)) > 1e-4  # the run moved the policy
        for pairs in (raw, tokenized):
            assert trainer.predict(pairs).metrics["test_loss"] == pytest.approx(expected, abs=1e-6)
        return
    with pytest.raises(ValueError, match=r"passed to `evaluate\(\)` after training has started"):
        trainer.evaluate(raw)
    for pairs in (raw, tokenized):
        with pytest.raises(ValueError, match=r"passed to `predict\(\)` after training has started \(the test data\)"):
            trainer.predict(pairs)


def test_ref_model_stays_frozen(tmp_path, tokenizer, hh_pairs):
    ref_model = tiny_llama(seed=3)
    before = {name: p.detach().clone() for name, p in ref_model.named_parameters()}
    trainer = DPOMinTrainer(tiny_llama(), args=DPOMinConfig(**config(tmp_path)), train_dataset=hh_pairs,
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
    initial = adapter_weights(peft_model, "default")
    trainer = DPOMinTrainer(peft_model, args=DPOMinConfig(**config(tmp_path, max_steps=1)), train_dataset=hh_pairs,
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
    # The reference adapter is the trained adapter as it arrived, and did not move while the trained one did.
    reference_after, trained_after = adapter_weights(peft_model, "ref"), adapter_weights(peft_model, "default")
    assert reference_after.keys() == initial.keys() == trained_after.keys() and initial
    assert all(torch.equal(reference_after[name], value) for name, value in initial.items())
    assert any(not torch.equal(trained_after[name], value) for name, value in initial.items())
    assert not any(p.requires_grad for name, p in peft_model.named_parameters() if ".ref." in name)


def test_eval_metrics_carry_the_eval_prefix(tmp_path, tokenizer, hh_pairs):
    trainer = DPOMinTrainer(tiny_llama(), args=DPOMinConfig(**config(tmp_path)), train_dataset=hh_pairs,
                            eval_dataset=hh_pairs.select(range(4)), processing_class=tokenizer, peft_config=lora())
    metrics = trainer.evaluate()
    for key in METRICS:
        assert f"eval_{key}" in metrics
    assert metrics["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)


def test_metrics_average_every_micro_batch_of_the_interval(tmp_path, tokenizer, hh_pairs):
    args = DPOMinConfig(**config(tmp_path, max_steps=1, gradient_accumulation_steps=4, per_device_train_batch_size=2))
    trainer = DPOMinTrainer(tiny_llama(), args=args,
                            train_dataset=hh_pairs, processing_class=tokenizer, peft_config=lora())
    trainer.train()
    logged = step_logs(trainer)[0]["logps/chosen"]
    # The same 8 pairs in one batch: the mean of the four micro-batch means equals the mean over all 8.
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(8)])
    with torch.no_grad(), trainer.model.disable_adapter():
        from dpo_min.logps import sequence_logps
        chosen = sequence_logps(trainer.model, batch).logps.chunk(2)[0]
    assert logged == pytest.approx(chosen.mean().item(), rel=1e-5)


@torch.no_grad()
def _completion_logp(model, prompt_ids, completion_ids):
    """Sum of log p(completion | prompt), one unpadded sequence, without the trainer's code."""
    ids = torch.tensor([prompt_ids + completion_ids])
    logps = torch.log_softmax(model(ids).logits[0, :-1].double(), dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return logps[len(prompt_ids) - 1:].sum().item()


def test_a_last_batch_of_one_pair_is_logged_whole(tmp_path, tokenizer, hh_pairs):
    """3 pairs in batches of 2: step 2 holds one pair, and logs exactly that pair's rewards, margin and accuracy."""
    batches = []
    collate = DPODataCollator(pad_token_id=tokenizer.eos_token_id)

    def recording_collator(examples):
        batches.append(examples)
        return collate(examples)

    policy, reference = tiny_llama(), tiny_llama(seed=3)  # another reference: non-zero rewards from the start
    # learning_rate 0: the policy stays as it starts, so each pair's figures can be computed after the run.
    trainer = DPOMinTrainer(policy, args=DPOMinConfig(**config(tmp_path, max_steps=2, learning_rate=0.0, beta=0.5)),
                            train_dataset=hh_pairs.select(range(3)), processing_class=tokenizer, ref_model=reference,
                            data_collator=recording_collator)
    trainer.train()
    assert [len(batch) for batch in batches] == [2, 1]
    for logged, batch in zip(step_logs(trainer), batches):
        rewards = {name: [0.5 * (_completion_logp(policy, ex["prompt_ids"], ex[f"{name}_ids"])
                                 - _completion_logp(reference, ex["prompt_ids"], ex[f"{name}_ids"])) for ex in batch]
                   for name in ("chosen", "rejected")}
        margins = [chosen - rejected for chosen, rejected in zip(rewards["chosen"], rewards["rejected"])]
        expected = {"rewards/chosen": sum(rewards["chosen"]) / len(batch),
                    "rewards/rejected": sum(rewards["rejected"]) / len(batch),
                    "rewards/margins": sum(margins) / len(batch),
                    "rewards/accuracies": sum(margin > 0 for margin in margins) / len(batch),
                    "logps/chosen": sum(_completion_logp(policy, ex["prompt_ids"], ex["chosen_ids"])
                                        for ex in batch) / len(batch)}
        assert min(abs(margin) for margin in margins) > 1e-2  # far from zero: the accuracy is not a coin toss
        for key, value in expected.items():
            # float32 log-probs of a few hundred nats, against float64 here: a margin is four such sums apart, times
            # beta (measured 1.1e-4 off on an AVX-512/AMX Xeon, where 1e-4 failed), far below the 1e-2 margins.
            assert logged[key] == pytest.approx(value, rel=1e-5, abs=5e-4), (len(batch), key)


def test_a_tokenizer_without_pad_token_pads_with_eos(tmp_path, tokenizer, hh_pairs):
    tokenizer.pad_token = None
    trainer = DPOMinTrainer(tiny_llama(), args=DPOMinConfig(**config(tmp_path, max_steps=1)), train_dataset=hh_pairs,
                            processing_class=tokenizer, peft_config=lora())
    assert tokenizer.pad_token == tokenizer.eos_token
    assert trainer.data_collator.pad_token_id == tokenizer.eos_token_id


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0], ids=["clipping", "no-clipping"])
def test_every_overridden_trainer_hook_is_called(tmp_path, tokenizer, hh_pairs, monkeypatch, max_grad_norm):
    """The overrides of private Trainer hooks run: if transformers renames a hook, this fails instead of the
    override going quiet (no finite-gradient check, checkpoints written in place, pair columns dropped)."""
    from transformers import Trainer

    from dpo_min.trl_surface import TRLSurface

    # Every private Trainer method DPOMinTrainer or its base overrides, read from the classes: a new one joins here.
    overridden = {name for cls in (DPOMinTrainer, TRLSurface) for name in vars(cls)
                  if name.startswith("_") and not name.startswith("__") and hasattr(Trainer, name)}
    assert overridden == {"_clip_grad_norm", "_get_grad_norm", "_get_train_sampler", "_save", "_save_checkpoint",
                          "_set_signature_columns_if_needed"}
    calls = {name: 0 for name in (*overridden, "_check_finite_gradients")}

    def counting(name, original):
        def counted(self, *args, **kwargs):
            calls[name] += 1
            return original(self, *args, **kwargs)
        return counted

    for name in calls:
        monkeypatch.setattr(DPOMinTrainer, name, counting(name, getattr(DPOMinTrainer, name)))
    # remove_unused_columns=True (TRL's default) is what makes Trainer ask for the signature columns.
    args = config(tmp_path, max_steps=2, max_grad_norm=max_grad_norm, save_strategy="steps", save_steps=1,
                  remove_unused_columns=True)
    trainer = DPOMinTrainer(tiny_llama(), args=DPOMinConfig(**args), train_dataset=hh_pairs.select(range(4)),
                            processing_class=tokenizer, peft_config=lora())
    trainer.train()
    assert calls == {"_clip_grad_norm": 2 if max_grad_norm else 0, "_get_grad_norm": 2, "_save_checkpoint": 2,
                     "_save": 2, "_set_signature_columns_if_needed": 1, "_get_train_sampler": 1,
                     "_check_finite_gradients": 2}  # the gradients checked once per step, by either hook
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["checkpoint-1", "checkpoint-2"]


def test_trls_attributes_can_be_assigned_where_docs_trl_says_and_the_others_cannot(tmp_path, tokenizer, hh_pairs):
    # docs/trl.md lists TRL's public attributes and the ones that can be assigned, as in TRL; the others raise, and
    # those read from args follow the config the trainer is given.
    text = " ".join((Path(__file__).parent.parent / "docs" / "trl.md").read_text().split())
    listed = re.search(r"TRL's public trainer attributes that scripts read exist with TRL's meaning \((.*?)\): (.*?) "
                       r"can be assigned", text)
    attributes, assignable = (re.findall(r"`(\w+)`", group) for group in listed.groups())
    assert set(assignable) == {"ref_model", "router_aux_loss_coef"}
    trainer = DPOMinTrainer(tiny_llama(), args=DPOMinConfig(**config(tmp_path)),
                            train_dataset=hh_pairs.select(range(2)), processing_class=tokenizer)
    for name in attributes:
        value = getattr(trainer, name)
        if name in assignable:
            setattr(trainer, name, value)
        else:
            with pytest.raises(AttributeError):
                setattr(trainer, name, value)
    # The loss reads a config when the trainer is given it, as TRL's trainer reads its attributes once: the
    # attributes say what the loss reads.
    trainer.args = DPOMinConfig(**config(tmp_path), beta=0.25)
    assert trainer.beta == trainer.loss_settings.beta == 0.25
    assert not trainer.aux_loss_enabled
    trainer.router_aux_loss_coef = 0.01
    assert trainer.aux_loss_enabled


def test_without_a_config_the_output_folder_is_trls_default(tmp_path, monkeypatch):
    # TRL's DPOTrainer writes to "<model's last name>-DPO" when given no args (compat.trl_default_output_dir).
    from dpo_min.trainer_setup import validated_args

    monkeypatch.chdir(tmp_path)
    args = validated_args("org/tiny-model", None, None, [{"prompt": "a"}], None, None, None)
    assert args.output_dir == "tiny-model-DPO"


def test_compute_loss_writes_dpos_loss_out_and_hands_every_other_loss_to_the_table():
    # The design card, in order: the policy's forward, chunk(2) into chosen and rejected, the log-ratios, DPO's loss
    # of their difference (arXiv 2305.18290, eq. 7); any other loss is the loss table's (dpo_loss).
    source = inspect.getsource(DPOMinTrainer.compute_loss)
    steps = ["sequence_logps(", ".chunk(2)", "chosen_logps - ref_chosen_logps", "rejected_logps - ref_rejected_logps",
             "logits = chosen_logratios - rejected_logratios", "losses = -F.logsigmoid(beta * logits)", "dpo_loss("]
    assert [step for step in steps if step not in source] == []
    assert [source.index(step) for step in steps] == sorted(source.index(step) for step in steps)


@pytest.mark.parametrize("options", [{}, {"label_smoothing": 0.2}], ids=["dpo alone", "the table (cDPO)"])
def test_compute_loss_is_dpos_loss_of_the_two_forwards_by_hand(tmp_path, tokenizer, hh_pairs, options):
    # Policy and a separate reference computed here, outside the trainer; the loss by hand from their log-probs.
    policy, reference = tiny_llama(), tiny_llama(seed=1)
    # Short rows: float32 sums of a few tokens, so that the two summation orders agree closely.
    args = DPOMinConfig(**config(tmp_path, beta=0.5, max_prompt_length=12, max_length=24, **options))
    trainer = DPOMinTrainer(policy, reference, args=args, train_dataset=hh_pairs.select(range(2)),
                            processing_class=tokenizer)
    assert trainer.dpo_alone == (options == {})
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    model_inputs = {name: batch[name] for name in ("input_ids", "attention_mask")}
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch).item()
        sums = []
        for model in (policy, reference):
            logprobs = model(**model_inputs).logits[:, :-1].log_softmax(-1)
            labels = batch["labels"][:, 1:]
            token = logprobs.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
            sums.append((token * (labels != -100)).sum(-1))
    (chosen, rejected), (ref_chosen, ref_rejected) = (values.chunk(2) for values in sums)
    logits = 0.5 * ((chosen - ref_chosen) - (rejected - ref_rejected))
    eps = options.get("label_smoothing", 0.0)
    expected = [-(1 - eps) * math.log(1 / (1 + math.exp(-x))) - eps * math.log(1 / (1 + math.exp(x)))
                for x in logits.tolist()]
    assert loss == pytest.approx(sum(expected) / 2, abs=1e-5)  # float32 forwards, summed in other orders
