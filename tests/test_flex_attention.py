"""flex attention runs the packed layouts from a BlockMask built of the collator's segments.

What runs on CPU (torch 2.13): flex attention's forward, uncompiled; its backward raises NotImplementedError there, so
gradients through flex are left to the GPU check (benchmarks/gpu_check.sh)."""

import itertools

import pytest
import torch
from conftest import tiny_llama
from datasets import Dataset
from test_layouts import LAYOUTS, random_pairs, tiny_qwen2
from test_trainer import config
from torch.nn.attention.flex_attention import create_mask

from dpo_min import DPOMinConfig, DPOMinTrainer
from dpo_min.logps import sequence_logps
from dpo_min.scale.attention import FLEX, PACKED_ATTENTION, packed_attention, packed_mask_mod, use_packed_attention
from dpo_min.trainer_setup import make_collator

PACKED = {name: layout for name, layout in LAYOUTS.items() if name != "padded"}


def dense_flex_mask(batch):
    rows, length = batch["segment_ids"].shape
    return create_mask(packed_mask_mod(batch["segment_ids"], batch["branch_ids"]), rows, 1, length, length,
                       device="cpu")


@pytest.mark.parametrize("layout", ["shared_packed", "shared_padded"])
def test_flex_mask_is_the_share_prompt_dense_mask(layout):
    padding_free, share_prompt = LAYOUTS[layout]
    batch = make_collator(0, padding_free, share_prompt)(random_pairs(5))
    assert torch.equal(dense_flex_mask(batch), batch["attention_mask"])


def test_flex_mask_is_block_diagonal_causal_over_padding_free_sequences():
    batch = make_collator(0, padding_free=True)(random_pairs(5))
    bounds = batch["segment_bounds"].tolist()
    length = bounds[-1]
    expected = torch.zeros(length, length, dtype=torch.bool)
    for start, stop in itertools.pairwise(bounds):
        expected[start:stop, start:stop] = torch.ones(stop - start, stop - start, dtype=torch.bool).tril()
    assert torch.equal(dense_flex_mask(batch)[0, 0], expected)


def test_without_its_dense_mask_a_shared_batch_carries_the_same_inputs_otherwise():
    pairs = random_pairs(3)
    dense = make_collator(0, padding_free=True, share_prompt=True)(pairs)
    lean = make_collator(0, padding_free=True, share_prompt=True, dense_mask=False)(pairs)
    assert "attention_mask" not in lean
    assert set(dense) - set(lean) == {"attention_mask"}
    assert all(torch.equal(lean[key], dense[key]) for key in lean)


@pytest.mark.parametrize("family", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
def test_flex_forward_on_cpu_gives_the_log_probs_of_the_padded_layout(family):
    model = family(vocab_size=64, attn_implementation="sdpa").eval()
    pairs = random_pairs(4)
    with torch.no_grad():
        padded = sequence_logps(model, make_collator(0)(pairs)).logps
        model.set_attn_implementation("flex_attention")
        use_packed_attention(model)
        assert model.config._attn_implementation == FLEX
        for layout, (padding_free, share_prompt) in PACKED.items():
            batch = make_collator(0, padding_free, share_prompt, dense_mask=False)(pairs)
            flex = sequence_logps(model, batch).logps
            torch.testing.assert_close(flex, padded, rtol=1e-5, atol=1e-5, msg=layout)


def test_the_flex_check_sees_segments_that_attend_to_each_other():
    """Control for the test above: one segment id for the whole packed row lets sequences see each other."""
    model = tiny_llama(vocab_size=64, attn_implementation="flex_attention").eval()
    use_packed_attention(model)
    pairs = random_pairs(4)
    with torch.no_grad():
        batch = make_collator(0, padding_free=True, dense_mask=False)(pairs)
        right = sequence_logps(model, batch).logps
        batch["segment_ids"] = torch.zeros_like(batch["segment_ids"])
        leaky = sequence_logps(model, batch).logps
    assert (leaky - right).abs().max() > 1e-2


def test_trainer_with_flex_attention_computes_the_padded_loss(tmp_path, tokenizer):
    pairs = random_pairs(4)
    losses = {}
    for attention, share_prompt in (("sdpa", False), ("flex_attention", True)):
        model = tiny_llama(vocab_size=64, attn_implementation=attention)
        trainer = DPOMinTrainer(model, args=DPOMinConfig(**config(tmp_path, padding_free=share_prompt,
                                                             share_prompt=share_prompt)),
                                train_dataset=Dataset.from_list(pairs), processing_class=tokenizer,
                                ref_model=tiny_llama(1, 64, attn_implementation=attention))
        batch = trainer.data_collator(pairs)
        assert ("attention_mask" in batch) == (attention == "sdpa")  # flex builds its own mask, no [N, N] one
        with torch.no_grad():  # flex has no backward on CPU
            losses[attention] = trainer.compute_loss(trainer.model, batch)
    assert abs(losses["sdpa"].item() - 0.6931) > 1e-3
    torch.testing.assert_close(losses["flex_attention"], losses["sdpa"], rtol=1e-5, atol=0)


@pytest.mark.parametrize("attention", ["flash_attention_2", "paged|sdpa", "my_kernel"])
def test_an_attention_that_cannot_keep_segments_apart_is_refused(tmp_path, tokenizer, attention):
    model = tiny_llama(vocab_size=64)
    model.config._attn_implementation = attention
    with pytest.raises(ValueError, match=f"keeps packed sequences apart.*got '{attention}'"):
        DPOMinTrainer(model, args=DPOMinConfig(**config(tmp_path, padding_free=True)),
                      train_dataset=Dataset.from_list(random_pairs(2)), processing_class=tokenizer)
    assert attention not in PACKED_ATTENTION
    with pytest.raises(ValueError, match="keeps packed sequences apart"):
        packed_attention(attention)
