"""The benchmark's model-FLOP count against torch's own count of the matmuls a LoRA or full fine-tuning step runs."""

import pytest
import torch
from conftest import tiny_llama
from peft import LoraConfig, get_peft_model
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.bench_vs_trl import step_flops
from dpo_min.logps import sequence_logps
from dpo_min.trainer_setup import make_collator


@pytest.mark.parametrize("full", [True, False], ids=["full", "lora"])
def test_step_flops_equal_the_matmuls_torch_counts(full):
    prompt, chosen, rejected = 7, 4, 4  # equal completions: the padded batch has no pad token
    model = tiny_llama(attn_implementation="eager")
    if not full:
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    example = {"prompt_ids": list(range(10, 10 + prompt)), "chosen_ids": list(range(30, 30 + chosen)),
               "rejected_ids": list(range(50, 50 + rejected))}
    with FlopCounterMode(display=False) as counter:
        sequence_logps(model, make_collator(0, False, False)([example])).logps.sum().backward()
    counts = counter.get_flop_counts()["Global"]
    shape = model.config.to_dict()
    # Both sequences carry the prompt here; step_flops counts a pair's prompt once, so pass them as two pairs.
    counted = step_flops(shape, [(prompt, chosen, 0), (prompt, rejected, 0)], full=full, lora_r=4, reference=False)
    # Eager attention computes every (query, key) pair and masks after; step_flops counts the causal ones.
    q_dim, layers = shape["hidden_size"], shape["num_hidden_layers"]
    causal = sum(prompt * (prompt + 1) / 2 + n * prompt + n * (n + 1) / 2 for n in (chosen, rejected))
    assert counts[torch.ops.aten.bmm] == 3 * 4 * q_dim * layers * 2 * (prompt + chosen) ** 2
    assert counts[torch.ops.aten.mm] == counted - 3 * 4 * q_dim * layers * causal
