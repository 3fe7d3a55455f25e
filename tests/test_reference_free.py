"""A loss that reads no reference (cpo, simpo, or any loss with reference_free) builds none and runs none."""

import pytest
from conftest import tiny_llama
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM

from dpo_min import DPOMinConfig, DPOMinTrainer
from dpo_min.losses import LossSettings

STEPS = 2


def needs_reference(loss_type, reference_free=False):  # asked of the settings, as the trainer asks
    return LossSettings.of(loss_type, reference_free=reference_free).reads_reference


def settings(tmp_path, **overrides):
    return dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=STEPS, logging_steps=1,
                report_to="none", learning_rate=1e-3, save_strategy="no", use_cpu=True, disable_tqdm=True,
                bf16=False, gradient_checkpointing=False) | overrides


def lora():
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def trained_adapter():
    return get_peft_model(tiny_llama(), lora())


@pytest.fixture
def forward_calls(monkeypatch):
    """Every forward of any Llama in the process: policy, reference copy or adapter-disabled base alike."""
    calls = []
    forward = LlamaForCausalLM.forward

    def counting(self, *args, **kwargs):
        calls.append(self)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "forward", counting)
    return calls


MODELS = {"full": lambda: (tiny_llama(), None), "lora": lambda: (tiny_llama(), lora()),
          "adapter_given": lambda: (trained_adapter(), None)}
NO_REFERENCE = {"simpo": {"loss_type": "simpo"}, "cpo": {"loss_type": "cpo", "cpo_alpha": 1.0},
                "sigmoid_reference_free": {"loss_type": "sigmoid", "reference_free": True},
                "simpo_with_sft": {"loss_type": ["simpo", "sft"]}}


@pytest.mark.parametrize("model_kind", MODELS)
@pytest.mark.parametrize("options", NO_REFERENCE.values(), ids=NO_REFERENCE.keys())
def test_no_reference_is_built_or_run(tmp_path, tokenizer, hh_pairs, forward_calls, monkeypatch, model_kind, options):
    model, peft_config = MODELS[model_kind]()
    trainer = DPOMinTrainer(model, args=DPOMinConfig(**settings(tmp_path, **options)), train_dataset=hh_pairs,
                            processing_class=tokenizer, peft_config=peft_config)
    assert trainer.ref_model is None and trainer.ref_adapter_name is None
    if model_kind != "full":
        assert list(trainer.model.peft_config) == ["default"]  # no frozen copy of the adapter
    monkeypatch.setattr(trainer, "reference_logps", lambda inputs: pytest.fail("a reference forward ran"))
    trainer.train()
    assert len(forward_calls) == STEPS  # one policy forward per step, nothing else
    assert trainer.state.log_history[0]["loss"] > 0


@pytest.mark.parametrize("model_kind", MODELS)
def test_control_a_reference_loss_runs_one_reference_forward_per_step(tmp_path, tokenizer, hh_pairs, forward_calls,
                                                                      model_kind):
    model, peft_config = MODELS[model_kind]()
    trainer = DPOMinTrainer(model, args=DPOMinConfig(**settings(tmp_path)), train_dataset=hh_pairs,
                            processing_class=tokenizer, peft_config=peft_config)
    assert trainer.ref_model is not None or trainer.ref_adapter_name is not None or model_kind == "lora"
    trainer.train()
    assert len(forward_calls) == 2 * STEPS


def test_a_ref_model_given_to_a_reference_free_loss_is_not_kept(tmp_path, tokenizer, hh_pairs):
    trainer = DPOMinTrainer(tiny_llama(), args=DPOMinConfig(**settings(tmp_path, loss_type="simpo")),
                            train_dataset=hh_pairs, processing_class=tokenizer, ref_model=tiny_llama(seed=1))
    assert trainer.ref_model is None


def test_which_loss_combinations_need_a_reference():
    assert not needs_reference("simpo") and not needs_reference(["cpo", "sft"])
    assert needs_reference(["cpo", "sigmoid"]) and needs_reference("sigmoid")
    assert not needs_reference("sigmoid", reference_free=True)
    # sft alone keeps its reference, for the reward metrics (as TRL).
    assert needs_reference("sft")


@pytest.mark.parametrize("option", [{"precompute_ref_log_probs": True}, {"sync_ref_model": True}])
def test_reference_options_with_a_reference_free_loss_are_refused(tmp_path, option):
    with pytest.raises(ValueError, match="reads no reference"):
        DPOMinConfig(**settings(tmp_path, loss_type="simpo", **option))
