"""The padding-free and shared-prompt layouts compute what the padded layout computes: the same per-sequence
log-probs (against one-sequence-at-a-time forwards), the same loss and gradients, the same training run."""

import random

import pytest
import torch
from conftest import tiny_llama
from datasets import Dataset
from peft import LoraConfig
from test_logps import naive_logps
from test_trainer import METRICS, config, step_logs
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BloomConfig,
    GemmaConfig,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    MptConfig,
    Phi3Config,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
)

from dpo_min import DPOMinConfig, DPOMinTrainer, tokenize_dataset
from dpo_min.collator_packed import PackedDPODataCollator
from dpo_min.logps import sequence_logps
from dpo_min.scale.attention import PACKED_FAMILIES, SEGMENTED_SDPA, use_packed_attention
from dpo_min.trainer_setup import make_collator

# (padding_free, share_prompt); (False, False) is the padded reference layout.
LAYOUTS = {"padded": (False, False), "padding_free": (True, False), "shared_packed": (True, True),
           "shared_padded": (False, True)}


def tiny_qwen2(seed: int = 0, vocab_size: int = 64, **overrides) -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, **overrides)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).float()


SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 2048}
# A tiny random model of every family in PACKED_FAMILIES: config class and settings (vocab_size and attention apart).
TINY_FAMILIES = {
    "gemma": (GemmaConfig, dict(SMALL, head_dim=16)),
    "gpt_neox": (GPTNeoXConfig, {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                 "num_attention_heads": 4}),
    "llama": (LlamaConfig, SMALL),
    "mistral": (MistralConfig, SMALL),
    "mixtral": (MixtralConfig, dict(SMALL, num_local_experts=4, num_experts_per_tok=2)),
    "phi3": (Phi3Config, dict(SMALL, pad_token_id=0)),
    "qwen2": (Qwen2Config, SMALL),
    "qwen3": (Qwen3Config, dict(SMALL, head_dim=16)),
    # ALiBi: these ignore position_ids, and are refused for packed layouts
    "mpt": (MptConfig, {"d_model": 64, "n_heads": 4, "n_layers": 2}),
    "bloom": (BloomConfig, {"hidden_size": 64, "n_head": 4, "n_layer": 2}),
}


def tiny_model(family: str, vocab_size: int = 64, **overrides):
    config_class, settings = TINY_FAMILIES[family]
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config_class(vocab_size=vocab_size, **settings, **overrides)).float()


def random_pairs(count: int, seed: int = 0) -> list[dict[str, list[int]]]:
    """Pairs of varied lengths, with a one-token prompt (empty shared prefix) among them."""
    rng = random.Random(seed)

    def ids(low, high):
        return [rng.randrange(3, 64) for _ in range(rng.randint(low, high))]

    pairs = [{"prompt_ids": ids(2, 12), "chosen_ids": ids(1, 7), "rejected_ids": ids(1, 7)} for _ in range(count)]
    pairs[1]["prompt_ids"] = pairs[1]["prompt_ids"][:1]
    return pairs


# The allow-list PACKED_FAMILIES: a family is in it by passing the test below. Every attention the table accepts is run
# on two families; every family under the attention the trainer runs packed layouts with (sdpa, switched to segmented).
ATTENTIONS = ("sdpa", "eager", SEGMENTED_SDPA)
FAMILY_CASES = [(family, attention) for family in sorted(PACKED_FAMILIES)
                for attention in (ATTENTIONS if family in ("llama", "qwen2") else [SEGMENTED_SDPA])]


@pytest.mark.parametrize(("family", "attention"), FAMILY_CASES)
def test_every_layout_gives_the_log_probs_of_one_sequence_at_a_time(family, attention):
    # Eval mode: there a forward builds a cache unless told not to, and with a cache transformers ignores
    # position_ids when masking, so packed sequences would attend to each other.
    model = tiny_model(family, attn_implementation="eager" if attention == "eager" else "sdpa").eval()
    if attention == SEGMENTED_SDPA:
        use_packed_attention(model)
    assert model.config._attn_implementation == attention
    pairs = random_pairs(4)
    with torch.no_grad():
        reference = naive_logps(model, pairs)
        for layout, (padding_free, share_prompt) in LAYOUTS.items():
            ours = sequence_logps(model, make_collator(0, padding_free, share_prompt)(pairs)).logps
            torch.testing.assert_close(ours.double(), reference, rtol=1e-5, atol=1e-6, msg=layout)


def test_the_equality_check_sees_sequences_that_attend_to_each_other():
    """Control for the test above: the same packed row with one running position sequence (so transformers sees one
    long sequence) gives other log-probs."""
    model = tiny_llama(vocab_size=64).eval()
    pairs = random_pairs(4)
    batch = make_collator(0, padding_free=True)(pairs)
    batch["position_ids"] = torch.arange(batch["input_ids"].size(1))[None]
    with torch.no_grad():
        leaky = sequence_logps(model, batch).logps
    assert (leaky.double() - naive_logps(model, pairs)).abs().max() > 1e-2


def test_alibi_models_mix_packed_sequences_and_are_refused(tmp_path, tokenizer):
    """Why PACKED_FAMILIES is an allow-list: MPT's and Bloom's attention ignores position_ids (ALiBi), so a packed
    row's sequences see each other, under the attention implementation the table accepts (eager)."""
    pairs = random_pairs(4)
    model = tiny_model("mpt", attn_implementation="eager").eval()
    with torch.no_grad():
        packed = sequence_logps(model, make_collator(0, padding_free=True)(pairs)).logps.double()
        assert (packed - naive_logps(model, pairs)).abs().max() > 1e-2
    for family in ("mpt", "bloom"):
        for padding_free, share_prompt in ((True, False), (False, True)):
            with pytest.raises(ValueError, match=rf"only for the model families .*this model is '{family}'"):
                DPOMinTrainer(tiny_model(family, attn_implementation="eager"), processing_class=tokenizer,
                              args=DPOMinConfig(**config(tmp_path, padding_free=padding_free,
                                                         share_prompt=share_prompt)),
                              train_dataset=Dataset.from_list(pairs), ref_model=tiny_model(family))


def test_shared_prompt_row_layout():
    pair = {"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6]}
    batch = PackedDPODataCollator(pad_token_id=0, share_prompt=True)([pair])
    m = -100
    # prompt[:-1] | prompt[-1] chosen | prompt[-1] rejected; the answers both continue at position 2.
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 3, 6]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 2, 3]]
    assert batch["labels"].tolist() == [[m, m, m, 4, 5, m, 6]]
    assert batch["sequence_index"].tolist() == [[-1, -1, -1, 0, 0, -1, 1]]
    assert batch["attention_mask"].tolist() == [[[
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 1, 0],  # the rejected answer sees the shared prefix and itself, not the chosen answer
        [1, 1, 0, 0, 0, 1, 1],
    ]]]


def test_padding_free_row_restarts_positions_and_never_scores_a_first_token():
    pairs = [{"prompt_ids": [], "chosen_ids": [4, 5], "rejected_ids": [6, 7]}]
    batch = PackedDPODataCollator(pad_token_id=0)(pairs)
    assert batch["input_ids"].tolist() == [[4, 5, 6, 7]]
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1]]
    # With no prompt nothing predicts a completion's first token; packed, 5 would otherwise predict 6.
    assert batch["labels"].tolist() == [[-100, 5, -100, 7]]
    assert "attention_mask" not in batch


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_bf16_shared_prompt_mask_is_additive_in_the_model_dtype(attention):
    model = tiny_llama(vocab_size=64, attn_implementation=attention).to(torch.bfloat16).eval()
    pairs = random_pairs(3)
    with torch.no_grad():
        shared = sequence_logps(model, make_collator(0, padding_free=True, share_prompt=True)(pairs)).logps
        padded = sequence_logps(model, make_collator(0)(pairs)).logps
    # bf16 rounding differs between layouts; a mask added as 0/1 would let the answers see each other.
    torch.testing.assert_close(shared, padded, rtol=2e-2, atol=0.1)


@pytest.fixture(scope="module")
def hh_tokenized(smollm_path, hh_pairs):
    return tokenize_dataset(hh_pairs, AutoTokenizer.from_pretrained(str(smollm_path)), max_length=1024)


@pytest.mark.parametrize(("use_lora", "loss_options"), [
    (True, {}), (False, {}),
    # the per-token inputs of LD-DPO (token positions) and WPO (sum of squared probabilities) in every layout
    (True, {"loss_type": "sigmoid,ipo", "ld_alpha": 0.5, "use_weighting": True}),
], ids=["lora", "full", "lora-ld-wpo-ipo"])
def test_layouts_give_the_same_loss_and_gradients(tmp_path, tokenizer, use_lora, loss_options):
    pairs = random_pairs(4)
    results = {}
    for layout in ("padded", "padding_free", "shared_packed"):
        padding_free, share_prompt = LAYOUTS[layout]
        # init_lora_weights=False: a non-zero adapter, so policy and reference (adapter off) differ.
        peft_config = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
        trainer = DPOMinTrainer(
            tiny_llama(vocab_size=64), args=DPOMinConfig(**config(tmp_path, padding_free=padding_free,
                                                             share_prompt=share_prompt, **loss_options)),
            train_dataset=Dataset.from_list(pairs), processing_class=tokenizer,
            peft_config=peft_config if use_lora else None, ref_model=None if use_lora else tiny_llama(1, 64))
        loss = trainer.compute_loss(trainer.model, trainer.data_collator(pairs))
        loss.backward()
        grads = {name: p.grad for name, p in trainer.model.named_parameters() if p.requires_grad}
        results[layout] = loss.detach(), grads
    loss, grads = results.pop("padded")
    assert abs(loss.item() - 0.6931) > 1e-3  # policy differs from the reference, so the gradients are not trivial
    for layout, (other_loss, other_grads) in results.items():
        torch.testing.assert_close(other_loss, loss, rtol=1e-5, atol=0, msg=layout)
        for name, grad in grads.items():
            torch.testing.assert_close(other_grads[name], grad, rtol=1e-4, atol=1e-6, msg=f"{layout} {name}")


def test_trainer_runs_the_same_with_every_layout(tmp_path, tokenizer, hh_tokenized):
    runs = {}
    # The shared layout with an online reference goes through compute_loss in the test above.
    for name, layout in {"padded": (False, False), "padding_free": (True, False),
                         "shared_packed_precomputed": (True, True)}.items():
        args = DPOMinConfig(**config(tmp_path, max_steps=2, padding_free=layout[0], share_prompt=layout[1],
                                     precompute_ref_log_probs=name.endswith("precomputed")))
        trainer = DPOMinTrainer(tiny_llama(), args=args, train_dataset=hh_tokenized, processing_class=tokenizer,
                                peft_config=LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
        trainer.train()
        runs[name] = step_logs(trainer)
    assert isinstance(trainer.data_collator, PackedDPODataCollator) and trainer.data_collator.share_prompt
    padded = runs.pop("padded")
    assert padded[-1]["rewards/margins"] != 0.0
    for name, logs in runs.items():
        assert len(logs) == len(padded) == 2
        for mine, reference in zip(logs, padded):
            for key in METRICS:
                # A reward is beta times a small difference of two sums of ~100 log-probs: float32 noise of the sums
                # (another layout, other kernels) is 1e-4 nats, 1e-5 in a reward; measured 1.5e-6 on an AVX-512 Xeon.
                floor = 1e-5 if key.startswith("rewards/") else 1e-6
                assert mine[key] == pytest.approx(reference[key], rel=1e-5, abs=floor), (name, key)


def test_packed_layouts_refuse_attention_they_were_not_tested_with(tmp_path, tokenizer, hh_tokenized):
    model = tiny_llama()
    model.config._attn_implementation = "flash_attention_2"  # flex attention joined the table (test_flex_attention)
    with pytest.raises(ValueError, match="sdpa"):
        DPOMinTrainer(model, args=DPOMinConfig(**config(tmp_path, padding_free=True)), train_dataset=hh_tokenized,
                      processing_class=tokenizer)
    with pytest.raises(ValueError, match="sliding window"):
        DPOMinTrainer(tiny_qwen2(use_sliding_window=True, sliding_window=8, max_window_layers=0),
                      args=DPOMinConfig(**config(tmp_path, share_prompt=True)), train_dataset=hh_tokenized,
                      processing_class=tokenizer)


def test_sdpa_attends_segment_by_segment_in_a_packed_row(monkeypatch):
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, *args, **kwargs):
        seen.append(query.shape[-2])
        return sdpa(query, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    model = tiny_llama(vocab_size=64)
    use_packed_attention(model)
    pairs = random_pairs(3)
    batch = make_collator(0, padding_free=True, share_prompt=True)(pairs)
    sequence_logps(model, batch)
    pair_lengths = [len(p["prompt_ids"]) + len(p["chosen_ids"]) + len(p["rejected_ids"]) + 1 for p in pairs]
    assert seen == pair_lengths * model.config.num_hidden_layers


@pytest.mark.parametrize("layout", ["padding_free", "shared_packed"])
def test_gradient_checkpointing_recomputes_segmented_attention(layout):
    pairs = random_pairs(3)
    batch = make_collator(0, *LAYOUTS[layout])(pairs)
    grads = []
    for checkpointing in (False, True):
        model = tiny_llama(vocab_size=64).train()
        use_packed_attention(model)
        if checkpointing:
            model.gradient_checkpointing_enable()
        sequence_logps(model, batch).logps.sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for plain, recomputed in zip(*grads):
        torch.testing.assert_close(recomputed, plain, rtol=1e-4, atol=1e-6)
