"""Memory tools: non-reentrant gradient checkpointing in every layout (use_liger_kernel, accepted with one log line:
tests/test_config.py)."""

import pytest
import torch
from conftest import tiny_llama
from datasets import Dataset
from peft import LoraConfig
from test_layouts import LAYOUTS, random_pairs
from test_trainer import config, step_logs

from dpo_min import DPOMinConfig, DPOMinTrainer


def loss_and_gradients(tmp_path, tokenizer, layout, use_lora, checkpointing):
    padding_free, share_prompt = LAYOUTS[layout]
    pairs = random_pairs(4)
    peft_config = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    trainer = DPOMinTrainer(
        tiny_llama(vocab_size=64), args=DPOMinConfig(**config(tmp_path, padding_free=padding_free,
                                                         share_prompt=share_prompt)),
        train_dataset=Dataset.from_list(pairs), processing_class=tokenizer,
        peft_config=peft_config if use_lora else None, ref_model=None if use_lora else tiny_llama(1, 64))
    model = trainer.model.train()
    if checkpointing:
        # What Trainer.train does for gradient_checkpointing=True (transformers' default is non-reentrant).
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layer_calls = []
    # A pre-hook of a module inside the layer: transformers checkpoints the layer's forward, not its hooks, and the
    # recomputation stops once it has what the backward needs, so a module's forward hook may never fire again.
    first_attention = trainer.accelerator.unwrap_model(model).get_decoder().layers[0].self_attn
    first_attention.register_forward_pre_hook(lambda *_: layer_calls.append(torch.is_grad_enabled()))
    loss = trainer.compute_loss(model, trainer.data_collator(pairs))
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, layer_calls


@pytest.mark.parametrize("use_lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("layout", ["padded", "padding_free", "shared_packed", "shared_padded"])
def test_gradient_checkpointing_gives_the_gradients_of_a_run_without_it(tmp_path, tokenizer, layout, use_lora):
    loss, grads, calls = loss_and_gradients(tmp_path, tokenizer, layout, use_lora, checkpointing=False)
    checkpointed_loss, checkpointed_grads, checkpointed_calls = loss_and_gradients(
        tmp_path, tokenizer, layout, use_lora, checkpointing=True)
    # Without checkpointing the layer's attention runs for the policy (with grad) and the reference (without); with
    # it, the backward runs the policy's attention once more: the recomputation really happened.
    assert calls.count(True) == 1 and checkpointed_calls.count(True) == 2, (calls, checkpointed_calls)
    assert abs(loss.item() - 0.6931) > 1e-3
    torch.testing.assert_close(checkpointed_loss, loss, rtol=1e-6, atol=0)
    assert grads.keys() == checkpointed_grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(checkpointed_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_trainer_with_gradient_checkpointing_trains_as_without(tmp_path, tokenizer):
    runs = {}
    for checkpointing in (False, True):
        trainer = DPOMinTrainer(
            tiny_llama(vocab_size=64), args=DPOMinConfig(**config(tmp_path, padding_free=True, share_prompt=True,
                                                             gradient_checkpointing=checkpointing, max_steps=2)),
            train_dataset=Dataset.from_list(random_pairs(4)), processing_class=tokenizer,
            peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        trainer.train()
        assert trainer.accelerator.unwrap_model(trainer.model).is_gradient_checkpointing == checkpointing
        runs[checkpointing] = [(log["loss"], log["grad_norm"]) for log in step_logs(trainer)]
    flat = {checkpointing: [value for step in logs for value in step] for checkpointing, logs in runs.items()}
    assert len(flat[True]) == 4 and flat[True] == pytest.approx(flat[False], rel=1e-5)
