"""The reference options: a named reference adapter, TR-DPO syncing, reference_free. Tiny models on token ids."""

import copy
import json

import peft
import pytest
import torch
from conftest import tiny_llama
from datasets import Dataset
from packaging.version import Version
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM, TrainerCallback

from dpo_min import DPODataCollator, DPOMinConfig, DPOMinTrainer, dpo_loss
from dpo_min.config import REFERENCE_MODES
from dpo_min.logps import sequence_logps
from dpo_min.reference import REFERENCES
from dpo_min.train.card import model_card

VOCAB = 64


def pairs(count: int = 8) -> Dataset:
    generator = torch.Generator().manual_seed(0)

    def ids(length):
        return torch.randint(3, VOCAB, (length,), generator=generator).tolist()

    return Dataset.from_list([{"prompt_ids": ids(5), "chosen_ids": [*ids(3 + i % 3), 2], "rejected_ids": [*ids(4), 2]}
                              for i in range(count)])


def config(tmp_path, **overrides):
    settings = {"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 2, "max_steps": 4,
                "learning_rate": 0.05, "report_to": "none", "save_strategy": "no", "use_cpu": True, "seed": 3,
                "disable_tqdm": True, "logging_steps": 1}
    return DPOMinConfig(**{**settings, **overrides})


def lora():
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def adapter_weights(model, adapter):
    return {name.replace(f".{adapter}.", "."): p.detach().clone() for name, p in model.named_parameters()
            if f".{adapter}." in name}


def randomise_lora_b(model, adapter, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if f"lora_B.{adapter}." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)


def first_batch(trainer):
    return trainer.data_collator([trainer.train_dataset[i] for i in range(2)])


def test_named_reference_adapter_stays_frozen_while_the_model_adapter_trains(tmp_path, tokenizer):
    model = get_peft_model(tiny_llama(vocab_size=VOCAB), lora(), adapter_name="policy")
    model.add_adapter("reference", lora())
    randomise_lora_b(model, "policy", seed=1)
    randomise_lora_b(model, "reference", seed=2)
    model.set_adapter("reference")  # model_adapter_name, not the active adapter, picks what trains
    snapshot = copy.deepcopy(model)
    policy_before, reference_before = adapter_weights(model, "policy"), adapter_weights(model, "reference")
    trainer = DPOMinTrainer(model, args=config(tmp_path, model_adapter_name="policy", ref_adapter_name="reference"),
                            train_dataset=pairs(), processing_class=tokenizer)
    trainer.train()

    assert model.active_adapter == "policy"
    reference_after = adapter_weights(model, "reference")
    assert all(torch.equal(reference_after[name], value) for name, value in reference_before.items())
    assert not any(p.requires_grad for name, p in model.named_parameters() if ".reference." in name)
    policy_after = adapter_weights(model, "policy")
    assert any(not torch.equal(policy_after[name], value) for name, value in policy_before.items())
    # The reference log-probs are those of the untouched copy with only its reference adapter on.
    batch = first_batch(trainer)
    snapshot.set_adapter("reference")
    with torch.no_grad():
        expected = sequence_logps(snapshot, batch).logps
        policy = sequence_logps(model, batch).logps
    torch.testing.assert_close(trainer.reference_logps(batch).logps, expected)
    assert (policy - expected).abs().max() > 1e-3


def test_reference_adapter_must_exist(tmp_path, tokenizer):
    model = get_peft_model(tiny_llama(vocab_size=VOCAB), lora())
    with pytest.raises(ValueError, match="no adapter named 'ref_typo'"):
        DPOMinTrainer(model, args=config(tmp_path, ref_adapter_name="ref_typo"), train_dataset=pairs(),
                      processing_class=tokenizer)


class Recorder(TrainerCallback):
    """Reference and policy weights around every step (runs after the trainer's own sync callback)."""

    def __init__(self, reference_weights, policy_weights):
        self.reference_weights, self.policy_weights = reference_weights, policy_weights
        self.before, self.after, self.policy = [], [], []

    def on_step_begin(self, args, state, control, **kwargs):
        self.before.append(self.reference_weights())

    def on_step_end(self, args, state, control, **kwargs):
        self.after.append(self.reference_weights())
        self.policy.append(self.policy_weights())


def check_sync(recorder, alpha, sync_steps):
    for step, (before, after, policy) in enumerate(zip(recorder.before, recorder.after, recorder.policy), start=1):
        for name, value in after.items():
            if step % sync_steps == 0:
                expected = policy[name] if alpha == 1.0 else alpha * policy[name] + (1 - alpha) * before[name]
                torch.testing.assert_close(value, expected, atol=1e-7, rtol=0)
            else:
                assert torch.equal(value, before[name]), (step, name)
        if step % sync_steps:  # between syncs the policy moved away from the reference
            assert any(not torch.equal(after[name], policy[name]) for name in after), step


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_sync_moves_a_reference_model_every_n_steps(tmp_path, tokenizer, alpha):
    model, ref_model = tiny_llama(vocab_size=VOCAB), tiny_llama(seed=5, vocab_size=VOCAB)
    trainer = DPOMinTrainer(model, args=config(tmp_path, sync_ref_model=True, ref_model_mixup_alpha=alpha,
                                          ref_model_sync_steps=2, max_steps=3),
                            train_dataset=pairs(), processing_class=tokenizer, ref_model=ref_model)

    def weights(module):
        return lambda: {name: p.detach().clone() for name, p in module.named_parameters()}

    recorder = Recorder(weights(ref_model), weights(model))
    trainer.add_callback(recorder)
    trainer.train()
    assert len(recorder.after) == 3
    check_sync(recorder, alpha, sync_steps=2)
    assert not any(p.requires_grad for p in ref_model.parameters())


@pytest.mark.parametrize("setup", ["peft_config", "named_adapters"])
def test_sync_copies_the_trained_adapter_into_the_reference_adapter(tmp_path, tokenizer, setup):
    base = tiny_llama(vocab_size=VOCAB)
    if setup == "peft_config":
        model, peft_config, names = base, lora(), {}
    else:
        model, peft_config = get_peft_model(base, lora(), adapter_name="policy"), None
        model.add_adapter("reference", lora())
        randomise_lora_b(model, "reference", seed=2)
        names = {"model_adapter_name": "policy", "ref_adapter_name": "reference"}
    trainer = DPOMinTrainer(model, args=config(tmp_path, sync_ref_model=True, ref_model_mixup_alpha=1.0,
                                          ref_model_sync_steps=2, max_steps=3, **names),
                            train_dataset=pairs(), processing_class=tokenizer, peft_config=peft_config)
    peft_model = trainer.model
    trained, reference = peft_model.active_adapter, trainer.ref_adapter_name
    batch = first_batch(trainer)
    if setup == "peft_config":
        # The reference adapter starts as a copy of the fresh adapter: the bare base model.
        with torch.no_grad(), peft_model.disable_adapter():
            bare = sequence_logps(peft_model, batch).logps
        torch.testing.assert_close(trainer.reference_logps(batch).logps, bare)
    recorder = Recorder(lambda: adapter_weights(peft_model, reference), lambda: adapter_weights(peft_model, trained))
    trainer.add_callback(recorder)
    trainer.train()
    check_sync(recorder, 1.0, sync_steps=2)
    assert not any(p.requires_grad for name, p in peft_model.named_parameters() if f".{reference}." in name)


def test_reference_free_needs_no_reference(tmp_path, tokenizer, monkeypatch):
    model = tiny_llama(vocab_size=VOCAB)
    # Two pairs, one batch: the logged loss is the mean over both, whatever order the sampler picks.
    trainer = DPOMinTrainer(model, args=config(tmp_path, reference_free=True, max_steps=1), train_dataset=pairs(2),
                            processing_class=tokenizer)
    assert trainer.ref_model is None

    def no_reference(*args, **kwargs):
        raise AssertionError("reference_free must not compute reference log-probs")

    monkeypatch.setattr(DPOMinTrainer, "reference_logps", no_reference)
    batch = DPODataCollator(pad_token_id=2)([trainer.train_dataset[i] for i in range(2)])
    with torch.no_grad():
        chosen, rejected = sequence_logps(model, batch).logps.chunk(2)
    trainer.train()
    zeros = torch.zeros_like(chosen)
    expected = dpo_loss(chosen, rejected, zeros, zeros, beta=0.1)[0].mean().item()
    assert trainer.state.log_history[0]["loss"] == pytest.approx(expected, abs=1e-6)
    assert expected != pytest.approx(0.6931471805599453, abs=1e-4)  # not the ln 2 of a reference equal to the policy


def test_sync_needs_a_reference_adapter_shaped_like_the_trained_one(tmp_path, tokenizer):
    model = get_peft_model(tiny_llama(vocab_size=VOCAB), lora(), adapter_name="policy")
    model.add_adapter("reference", LoraConfig(r=2, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(ValueError, match="policy's parameters"):
        DPOMinTrainer(model, args=config(tmp_path, sync_ref_model=True, model_adapter_name="policy",
                                    ref_adapter_name="reference"), train_dataset=pairs(), processing_class=tokenizer)


def tiny_moe():
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           tie_word_embeddings=False)
    torch.manual_seed(0)
    return MixtralForCausalLM(config).float()


@pytest.mark.parametrize("peft_version", ["0.19.1", peft.__version__], ids=["peft_0.19", "installed_peft"])
def test_an_adapter_on_target_parameters_gets_trls_reference(tmp_path, tokenizer, monkeypatch, peft_version):
    # TRL 1.16 (DPOTrainer.__init__): under peft 0.17-0.19 the adapter is disabled for the reference, since peft
    # cannot hold a second adapter on target_parameters; from peft 0.20 it copies the adapter as for any other.
    monkeypatch.setattr(peft, "__version__", peft_version)
    model = get_peft_model(tiny_moe(), LoraConfig(r=2, target_modules=[], target_parameters=["mlp.experts.down_proj"]))
    randomise_lora_b(model, "default", seed=1)  # an adapter that changes the outputs
    trainer = DPOMinTrainer(model, args=config(tmp_path, max_steps=1), train_dataset=pairs(),
                            processing_class=tokenizer)
    batch = first_batch(trainer)
    with torch.no_grad(), model.disable_adapter():
        base = sequence_logps(model, batch).logps
    with torch.no_grad():
        adapted = sequence_logps(model, batch).logps
    copied = peft_version == peft.__version__ and Version(peft_version) >= Version("0.20.0")
    assert sorted(model.peft_config) == (["default", "ref"] if copied else ["default"])
    assert trainer.ref_adapter_name == ("ref" if copied else None)
    torch.testing.assert_close(trainer.reference_logps(batch).logps, adapted if copied else base)
    assert (adapted - base).abs().max() > 1e-4


# ---- what the trainer says its reference is (issue 25): the card prints this line --------------------------------
def named_adapters():
    model = get_peft_model(tiny_llama(vocab_size=VOCAB), lora(), adapter_name="policy")
    model.add_adapter("frozen", lora())
    return model


REFERENCE_KINDS = {
    "simpo": (dict(loss_type="simpo"), {}, "none (loss_type simpo: the loss reads no reference)"),
    "cpo": (dict(loss_type="cpo"), {}, "none (loss_type cpo: the loss reads no reference)"),
    "reference_free": (dict(reference_free=True), {}, "none (reference_free: the loss reads no reference)"),
    "adapter off": ({}, dict(peft_config=lora()), "the base model (the adapter disabled)"),
    "adapter off, precomputed": (dict(precompute_ref_log_probs=True), dict(peft_config=lora()),
                                 "the base model (the adapter disabled), log-probs precomputed"),
    "fresh adapter copy (TR-DPO)": (dict(sync_ref_model=True), dict(peft_config=lora()),
                                    "a copy of the fresh adapter (TR-DPO)"),
    "named adapter": (dict(model_adapter_name="policy", ref_adapter_name="frozen"), dict(model=named_adapters),
                      "adapter 'frozen'"),
    "copy of the adapter given": ({}, dict(model=lambda: get_peft_model(tiny_llama(vocab_size=VOCAB), lora())),
                                  "a frozen copy of the adapter the model came with"),
    "frozen copy": ({}, {}, "a frozen copy of the model"),
    "ref_model": ({}, dict(ref_model=lambda: tiny_llama(seed=1, vocab_size=VOCAB)),
                  "ref_model, a separate frozen model"),
    "policy before its first step": (dict(precompute_ref_log_probs=True), {},
                                     "the model before its first step (log-probs precomputed)"),
}


@pytest.mark.parametrize("kind", REFERENCE_KINDS)
def test_the_trainer_describes_its_reference_and_the_card_prints_it(tmp_path, tokenizer, kind):
    expected = REFERENCE_KINDS[kind][2]
    reference, args = built_reference(tmp_path, tokenizer, kind)
    assert reference.description == expected
    card = model_card(model="org/base", kind="full", datasets={"org/pairs": 4}, train_pairs=4, held_out_pairs=0,
                      args=args, reference=reference.description, lora=None, before={}, after={}, repo_id="r")
    [line] = [line for line in card.splitlines() if line.startswith("| reference |")]
    assert line == f"| reference | {expected} |"


# Each reference's kind, in the words DPOMinConfig.reference_mode takes (None: no reference read), and its part of
# the precompute cache key: the JSON of `cache_settings`, hashed into the cache's file names (ref_cache.cache_key).
# These are the cache keys users' caches were written under (computed at 350e59b, before the kinds took the
# reference_mode words): a change here orphans every cache on disk.
CACHE_SETTINGS = ('{{"ld_alpha": null, "max_length": 1024, "max_prompt_length": null, "reference": "{}", '
                  '"truncation_mode": "keep_end"}}')  # the reference's name: KIND_AND_CACHE_KEY's second column
KIND_AND_CACHE_KEY = {
    "simpo": (None, "model"), "cpo": (None, "model"), "reference_free": (None, "model"),
    "adapter off": ("adapter_off", "adapter disabled"), "adapter off, precomputed": ("adapter_off", "adapter disabled"),
    "fresh adapter copy (TR-DPO)": ("adapter_at_start", "adapter ref"),
    "named adapter": ("adapter_at_start", "adapter frozen"),
    "copy of the adapter given": ("adapter_at_start", "adapter ref"),
    "frozen copy": ("policy_at_start", "model"), "ref_model": ("ref_model", "model"),
    "policy before its first step": ("policy_at_start", "model"),
}


def built_reference(tmp_path, tokenizer, case):
    options, build, _ = REFERENCE_KINDS[case]
    model = build.get("model", lambda: tiny_llama(vocab_size=VOCAB))()
    ref_model = build["ref_model"]() if "ref_model" in build else None
    args = config(tmp_path, **options)
    trainer = DPOMinTrainer(model, ref_model, args=args, train_dataset=pairs(4), processing_class=tokenizer,
                            peft_config=build.get("peft_config"))
    return trainer.reference, args


@pytest.mark.parametrize("case", REFERENCE_KINDS)
def test_each_reference_is_of_the_kind_its_reference_mode_word_names(tmp_path, tokenizer, case):
    reference, _ = built_reference(tmp_path, tokenizer, case)
    assert reference.kind == KIND_AND_CACHE_KEY[case][0]
    assert tuple(REFERENCES) == REFERENCE_MODES  # one vocabulary: the config's words are the classes' kinds
    assert all(REFERENCES[mode].kind == mode for mode in REFERENCE_MODES)


@pytest.mark.parametrize("case", REFERENCE_KINDS)
def test_each_reference_s_cache_settings_are_the_keys_users_caches_were_written_under(tmp_path, tokenizer, case):
    reference, args = built_reference(tmp_path, tokenizer, case)
    expected = CACHE_SETTINGS.format(KIND_AND_CACHE_KEY[case][1])
    assert json.dumps(reference.cache_settings(args), sort_keys=True) == expected


def test_a_named_reference_mode_reads_the_adapter_ref_adapter_name_names_or_refuses_it(tmp_path, tokenizer):
    """reference_mode='adapter_at_start' with ref_adapter_name: the reference was a fresh copy of the active adapter,
    the adapter named silently left unread; another mode beside ref_adapter_name reads no named adapter: refused."""
    args = config(tmp_path, model_adapter_name="policy", ref_adapter_name="frozen", reference_mode="adapter_at_start")
    trainer = DPOMinTrainer(named_adapters(), args=args, train_dataset=pairs(4), processing_class=tokenizer)
    assert (trainer.reference.adapter, trainer.reference.description) == ("frozen", "adapter 'frozen'")
    args = config(tmp_path, model_adapter_name="policy", ref_adapter_name="frozen", reference_mode="policy_at_start")
    with pytest.raises(ValueError, match=r"^ref_adapter_name='frozen' names an adapter_at_start reference, not "
                                         r"reference_mode='policy_at_start''s: leave one of them out$"):
        DPOMinTrainer(named_adapters(), args=args, train_dataset=pairs(4), processing_class=tokenizer)


def test_a_ref_model_loaded_from_the_policys_own_path_is_named_a_second_load(tmp_path, tokenizer, tiny_model_dir):
    # What the command passes for full fine-tuning under ZeRO-3 (train.load_model): the base model loaded again.
    model, ref_model = (AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)) for _ in range(2))
    trainer = DPOMinTrainer(model, ref_model, args=config(tmp_path), train_dataset=pairs(4),
                            processing_class=tokenizer)
    assert trainer.reference.description == (f"the base model loaded a second time as ref_model ({tiny_model_dir}), "
                                             "frozen")
