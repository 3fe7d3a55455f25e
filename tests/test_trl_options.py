"""TRL DPOConfig options and metrics, step by step against TRL's DPOTrainer on tiny models.

The metrics `entropy`, `mean_token_accuracy`, `num_tokens` (and `aux_loss` for a mixture of experts) must come out as
TRL logs them, under the options `pad_to_multiple_of`, `activation_offloading`, `f_divergence_type`,
`router_aux_loss_coef` and `precompute_ref_batch_size`.
"""

import contextlib
import copy

import pytest
import torch
import trl
from conftest import tiny_llama
from transformers import MixtralConfig, MixtralForCausalLM

from dpo_min import DPOMinConfig, DPOMinTrainer

DPO_METRICS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
               "logps/rejected", "logits/chosen", "logits/rejected")
NEW_METRICS = ("entropy", "mean_token_accuracy", "num_tokens")


def settings(tmp_path, **overrides):
    # SGD: Adam would turn float noise in near-zero gradients into lr-sized steps, blurring a step-by-step match.
    return dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=3, logging_steps=1,
                report_to="none", learning_rate=0.5, optim="sgd", save_strategy="no", seed=7, use_cpu=True,
                disable_tqdm=True, max_length=1024, bf16=False, gradient_checkpointing=False) | overrides


def step_logs(trainer):
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def run_both(make_model, pairs, tokenizer, ours_settings, theirs_settings=None):
    ours = DPOMinTrainer(make_model(), args=DPOMinConfig(**ours_settings), train_dataset=pairs,
                         processing_class=tokenizer)
    ours.train()
    model = make_model()
    theirs = trl.DPOTrainer(model=model, ref_model=copy.deepcopy(model),
                            args=trl.DPOConfig(**(theirs_settings or ours_settings)), train_dataset=pairs,
                            processing_class=tokenizer)
    theirs.train()
    return ours, theirs, step_logs(ours), step_logs(theirs)


def assert_same_logs(ours_logs, theirs_logs, keys):
    assert len(ours_logs) == len(theirs_logs) == 3
    for step, (mine, reference) in enumerate(zip(ours_logs, theirs_logs)):
        for key in keys:
            # A reward is beta * (difference of two float32 sums of ~1e3): its float32 noise is ~1e-6 absolute.
            # Float32 differences of the two log-prob codes grow step by step (1e-4 relative on grad_norm by step 3
            # at this learning rate), so the first two steps are held tight and the third loosely.
            rel, tolerance = (1e-5, 1e-5 if key.startswith("rewards/") else 1e-6) if step < 2 else (1e-3, 1e-4)
            assert mine[key] == pytest.approx(reference[key], rel=rel, abs=tolerance), (step, key)


def test_new_metrics_and_options_match_trl_step_by_step(tmp_path, tokenizer, hh_pairs):
    options = settings(tmp_path, pad_to_multiple_of=64, f_divergence_type="js_divergence")
    # TRL's activation offloading needs an accelerator (it fails on a CPU tensor); ours passes CPU tensors through.
    offloaded = options | {"activation_offloading": True}
    ours, _, ours_logs, theirs_logs = run_both(tiny_llama, hh_pairs, tokenizer, offloaded, options)
    assert_same_logs(ours_logs, theirs_logs, DPO_METRICS + NEW_METRICS)
    # Values that could not pass by accident: a running token count, an entropy below log(V), a moved policy.
    assert ours_logs[0]["num_tokens"] < ours_logs[1]["num_tokens"] < ours_logs[2]["num_tokens"]
    assert 0 < ours_logs[0]["entropy"] < torch.log(torch.tensor(49152.0)).item()
    assert abs(ours_logs[-1]["rewards/margins"]) > 1e-3
    batch = ours.data_collator([ours.train_dataset[i] for i in range(2)])
    assert batch["input_ids"].shape[1] % 64 == 0


def test_num_tokens_counts_the_tokens_computed_without_padding(tmp_path, tokenizer, hh_pairs):
    options = settings(tmp_path, pad_to_multiple_of=64, per_device_train_batch_size=8, max_steps=2)
    trainer = DPOMinTrainer(tiny_llama(), args=DPOMinConfig(**options), train_dataset=hh_pairs,
                            processing_class=tokenizer)
    trainer.train()
    # By hand, from the tokenized rows: each step sees all 8 pairs, each a prompt+chosen and a prompt+rejected row.
    per_step = sum(2 * len(ex["prompt_ids"]) + len(ex["chosen_ids"]) + len(ex["rejected_ids"])
                   for ex in trainer.train_dataset)
    assert [entry["num_tokens"] for entry in step_logs(trainer)] == [per_step, 2 * per_step]


def tiny_mixtral(**overrides):
    config = MixtralConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=2048, tie_word_embeddings=False, **overrides)
    torch.manual_seed(0)
    return MixtralForCausalLM(config).float()


@pytest.mark.parametrize("coef", [None, 0.5], ids=["config_coef", "explicit_coef"])
def test_router_aux_loss_matches_trl_on_a_tiny_mixtral(tmp_path, tokenizer, hh_pairs, coef):
    options = settings(tmp_path, router_aux_loss_coef=coef)
    ours, theirs, ours_logs, theirs_logs = run_both(lambda: tiny_mixtral(router_aux_loss_coef=0.02), hh_pairs,
                                                    tokenizer, options)
    assert ours.router_aux_loss_coef == theirs.router_aux_loss_coef == (0.02 if coef is None else coef)
    assert_same_logs(ours_logs, theirs_logs, DPO_METRICS + NEW_METRICS + ("aux_loss",))
    # The aux loss is in the loss: at step 1 (policy = reference) the DPO part is ln 2 exactly.
    first = ours_logs[0]
    assert first["loss"] == pytest.approx(0.6931471805599453 + ours.router_aux_loss_coef * first["aux_loss"], rel=1e-6)
    assert ours.router_aux_loss_coef * first["aux_loss"] > 1e-3


def test_router_aux_loss_off_and_refused_where_it_cannot_be(tmp_path, tokenizer, hh_pairs):
    trainer = DPOMinTrainer(tiny_mixtral(),
                            args=DPOMinConfig(**settings(tmp_path, router_aux_loss_coef=0.0, max_steps=1)),
                            train_dataset=hh_pairs, processing_class=tokenizer)
    trainer.train()
    assert "aux_loss" not in step_logs(trainer)[0]
    with pytest.raises(ValueError, match="not a mixture-of-experts"):
        DPOMinTrainer(tiny_llama(), args=DPOMinConfig(**settings(tmp_path, router_aux_loss_coef=0.1)),
                      train_dataset=hh_pairs, processing_class=tokenizer)
    with pytest.raises(ValueError, match="share_prompt"):
        DPOMinTrainer(tiny_mixtral(attn_implementation="sdpa"),
                      args=DPOMinConfig(**settings(tmp_path, share_prompt=True)),
                      train_dataset=hh_pairs, processing_class=tokenizer)


def test_precompute_ref_batch_size_matches_trl_columns(tmp_path, tokenizer, hh_pairs, monkeypatch):
    options = settings(tmp_path, precompute_ref_log_probs=True, precompute_ref_batch_size=3)
    ours = DPOMinTrainer(tiny_llama(), args=DPOMinConfig(**options), train_dataset=hh_pairs, processing_class=tokenizer)
    sizes = []
    reference_logps = ours.reference_logps

    def recording(inputs):
        sizes.append(int(inputs["sequence_index"].max()) // 2 + 1)
        return reference_logps(inputs)

    monkeypatch.setattr(ours, "reference_logps", recording)
    ours.get_train_dataloader()
    assert sizes == [3, 3, 2]  # 8 pairs in batches of 3
    model = tiny_llama()
    theirs = trl.DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=trl.DPOConfig(**options),
                            train_dataset=hh_pairs, processing_class=tokenizer)
    for column in ("ref_chosen_logps", "ref_rejected_logps"):
        torch.testing.assert_close(torch.tensor(ours.train_dataset[column]), torch.tensor(theirs.train_dataset[column]),
                                   rtol=1e-5, atol=1e-5)


def test_activation_offloading_gives_the_same_steps(tmp_path, tokenizer, hh_pairs):
    runs = []
    for offload in (False, True):
        trainer = DPOMinTrainer(tiny_llama(), args=DPOMinConfig(**settings(tmp_path, activation_offloading=offload)),
                                train_dataset=hh_pairs, processing_class=tokenizer)
        trainer.train()
        runs.append(step_logs(trainer))
    for plain, offloaded in zip(*runs):
        for key in DPO_METRICS:
            assert offloaded[key] == plain[key], key


def test_offloaded_activations_come_back_unchanged(tokenizer, hh_pairs):
    """The pack/unpack round trip, forced on CPU tensors (on a CPU run the trainer keeps them, nothing to save)."""
    from dpo_min import DPODataCollator
    from dpo_min.logps import sequence_logps
    from dpo_min.scale.offload import OffloadActivations
    from dpo_min.tokenizing import tokenize_dataset

    batch = DPODataCollator(tokenizer.pad_token_id)(list(tokenize_dataset(hh_pairs.select(range(2)), tokenizer, 1024)))
    grads = []
    for offload in (False, True):
        model = tiny_llama()
        hooks = OffloadActivations(model, keep_on=()) if offload else None
        with hooks or contextlib.nullcontext():
            loss = -sequence_logps(model, batch).logps.mean()
        loss.backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    assert hooks.offloaded > 10  # activations of every layer, not the weights (those would be 13 more)
    for name, grad in grads[0].items():
        assert torch.equal(grads[1][name], grad), name


@pytest.mark.parametrize("options,message", [
    ({"f_divergence_type": "forward_kl", "loss_type": "bco_pair"}, "no f-divergence form"),
    ({"f_divergence_type": "chi2"}, "f_divergence_type must be one of"),
    ({"alpha": 0.2, "loss_type": "sigmoid"}, "AlphaPO"),
    ({"pad_to_multiple_of": 0}, "pad_to_multiple_of must be >= 1"),
    ({"precompute_ref_batch_size": 0}, "precompute_ref_batch_size must be >= 1"),
    ({"router_aux_loss_coef": -1.0}, "router_aux_loss_coef must be >= 0"),
    ({"cpo_alpha": -1.0}, "cpo_alpha must be >= 0"),
])
def test_bad_options_are_refused_when_the_config_is_built(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        DPOMinConfig(**settings(tmp_path, **options))
