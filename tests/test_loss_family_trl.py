"""f-DPO against TRL's DPOTrainer, and SimPO / CPO / AlphaPO against TRL's CPOTrainer, on identical log-probs.

As in `test_losses_trl.py`, both trainers read their log-probs from the same fixed logit tables, so everything
downstream (f-divergence scores, length normalisation, the AlphaPO reward shape, the behaviour-cloning NLL, rewards)
is each trainer's own code.
"""

import pytest
import torch
import trl
from conftest import tiny_llama
from datasets import Dataset
from test_losses_trl import PAIRS, VOCAB, OursTable, TrlTable, last_metrics, trainers  # noqa: F401 (a fixture)
from transformers import AutoTokenizer

from dpo_min import DPODataCollator, DPOMinConfig, dpo_loss

F_CASES = {  # (our config, float64 tables?) TRL's alpha_divergence has no float64 branch, hence float32 there
    "forward_kl_sigmoid": ({"loss_type": "sigmoid", "f_divergence_type": "forward_kl"}, True),
    "js_sigmoid": ({"loss_type": "sigmoid", "f_divergence_type": "js_divergence"}, True),
    "js_hinge": ({"loss_type": "hinge", "f_divergence_type": "js_divergence", "beta": 0.5}, True),
    "forward_kl_ipo": ({"loss_type": "ipo", "f_divergence_type": "forward_kl"}, True),
    "js_sigmoid_norm": ({"loss_type": "sigmoid_norm", "f_divergence_type": "js_divergence", "beta": 2.0}, True),
    "forward_kl_exo_pair": ({"loss_type": "exo_pair", "f_divergence_type": "forward_kl",
                             "label_smoothing": 1e-3}, True),
    "js_robust": ({"loss_type": "robust", "f_divergence_type": "js_divergence", "label_smoothing": 0.2}, True),
    "forward_kl_discopop": ({"loss_type": "discopop", "f_divergence_type": "forward_kl", "discopop_tau": 0.5}, True),
    "js_rpo": ({"loss_type": ["sigmoid", "sft"], "f_divergence_type": "js_divergence",
                "loss_weights": [1.0, 0.5]}, True),
    "alpha_limit_is_reverse_kl": ({"loss_type": "sigmoid", "f_divergence_type": "alpha_divergence",
                                   "f_alpha_divergence_coef": 1.0}, True),
    "alpha_sigmoid": ({"loss_type": "sigmoid", "f_divergence_type": "alpha_divergence"}, False),
    "alpha_0.3_ipo": ({"loss_type": "ipo", "f_divergence_type": "alpha_divergence",
                       "f_alpha_divergence_coef": 0.3}, False),
}


@pytest.mark.parametrize("case,float64", F_CASES.values(), ids=F_CASES.keys())
def test_f_divergence_matches_trl(trainers, case, float64):  # noqa: F811 (the fixture)
    ours, theirs, common = trainers
    args = DPOMinConfig(**common, **case, accelerator_config={"use_configured_state": True})
    ours.args = args
    for name, value in {"loss_types": args.loss_type, "loss_weights": args.loss_weights or [1.0] * len(args.loss_type),
                        "beta": args.beta, "label_smoothing": args.label_smoothing, "ld_alpha": None,
                        "use_weighting": False, "f_divergence_type": args.f_divergence_type,
                        "f_alpha_divergence_coef": args.f_alpha_divergence_coef}.items():
        setattr(theirs, name, value)
    theirs.args.discopop_tau = args.discopop_tau
    batch = DPODataCollator(pad_token_id=0)(PAIRS)
    rows, length = batch["input_ids"].shape
    dtype = torch.float64 if float64 else torch.float32
    our_policy, their_policy = OursTable(0, rows, length).to(dtype), TrlTable(0, rows, length).to(dtype)
    ours.ref_model, theirs.ref_model = OursTable(1, rows, length).to(dtype), TrlTable(1, rows, length).to(dtype)

    our_loss = ours.compute_loss(our_policy, batch)
    their_loss = theirs._compute_loss(their_policy, trl.trainer.dpo_trainer.DataCollatorForPreference(0)(PAIRS),
                                      return_outputs=False)
    our_loss.backward()
    their_loss.backward()
    # TRL takes exo_pair's log(eps) in float32: 1e-8 relative apart in float64.
    rel = (1e-7 if case["loss_type"] == "exo_pair" else 1e-9) if float64 else 1e-5
    assert our_loss.item() == pytest.approx(their_loss.item(), rel=rel)
    # Not the reverse-KL loss in disguise (except at the alpha -> 1 limit, which is reverse KL by definition).
    reverse = DPOMinConfig(**common, **{**case, "f_divergence_type": "reverse_kl"},
                           accelerator_config={"use_configured_state": True})
    ours.args = reverse
    reverse_loss = ours.compute_loss(OursTable(0, rows, length).to(dtype), batch).item()
    if case.get("f_alpha_divergence_coef") != 1.0:
        assert abs(reverse_loss - our_loss.item()) > 1e3 * rel * abs(our_loss.item())
    assert their_policy.logits.grad.abs().max() > 0
    torch.testing.assert_close(our_policy.logits.grad, their_policy.logits.grad, atol=1e-12 if float64 else 1e-7,
                               rtol=1e-6 if float64 else 1e-4)
    # The rewards are log-ratios whatever the f-divergence (as TRL), so the reverse-KL run logged the same ones.
    for key, value in last_metrics(ours).items():
        assert value == pytest.approx(last_metrics(theirs)[key], rel=rel, abs=1e-12), key


# CPOConfig's loss_type and options -> ours. CPO is `cpo` + cpo_alpha; AlphaPO is `alpha` on simpo (or cpo).
CPO_CASES = {
    "cpo": ({"loss_type": "sigmoid", "cpo_alpha": 1.0}, {"loss_type": "cpo", "cpo_alpha": 1.0}),
    "cpo_smoothed": ({"loss_type": "sigmoid", "cpo_alpha": 1.0, "label_smoothing": 0.1, "beta": 0.5},
                     {"loss_type": "cpo", "cpo_alpha": 1.0, "label_smoothing": 0.1, "beta": 0.5}),
    "cpo_without_nll": ({"loss_type": "sigmoid", "cpo_alpha": 0.0}, {"loss_type": "cpo"}),
    "simpo": ({"loss_type": "simpo", "cpo_alpha": 0.0, "simpo_gamma": 0.5, "beta": 2.0},
              {"loss_type": "simpo", "simpo_gamma": 0.5, "beta": 2.0}),
    "simpo_gamma_1.4": ({"loss_type": "simpo", "cpo_alpha": 0.0, "simpo_gamma": 1.4, "beta": 2.5},
                        {"loss_type": "simpo", "simpo_gamma": 1.4, "beta": 2.5}),
    "cpo_simpo": ({"loss_type": "simpo", "cpo_alpha": 0.5, "simpo_gamma": 0.3, "beta": 2.0},
                  {"loss_type": "simpo", "cpo_alpha": 0.5, "simpo_gamma": 0.3, "beta": 2.0}),
    "alphapo": ({"loss_type": "simpo", "cpo_alpha": 0.0, "alpha": 0.25, "simpo_gamma": 0.5, "beta": 2.0},
                {"loss_type": "simpo", "alpha": 0.25, "simpo_gamma": 0.5, "beta": 2.0}),
    "alphapo_negative_on_cpo": ({"loss_type": "sigmoid", "cpo_alpha": 1.0, "alpha": -0.05},
                                {"loss_type": "cpo", "cpo_alpha": 1.0, "alpha": -0.05}),
}
CPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


class CpoTable(TrlTable):
    def forward(self, input_ids, attention_mask, use_cache):
        return type("Output", (), {"logits": self.logits})()


def _cpo_batch(pairs):
    """CPOTrainer's batch: prompt + completion ids, labels -100 on the prompt, right-padded per side."""
    batch = {}
    for side in ("chosen", "rejected"):
        rows = [ex["prompt_ids"] + ex[f"{side}_ids"] for ex in pairs]
        width = max(map(len, rows))
        batch[f"{side}_input_ids"] = torch.tensor([row + [0] * (width - len(row)) for row in rows])
        batch[f"{side}_attention_mask"] = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
        batch[f"{side}_labels"] = torch.tensor([[-100] * len(ex["prompt_ids"]) + ex[f"{side}_ids"]
                                                + [-100] * (width - len(row)) for ex, row in zip(pairs, rows)])
    return batch


@pytest.fixture(scope="module")
def cpo_trainer(smollm_path, tmp_path_factory):
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm_path))
    args = CPOConfig(output_dir=str(tmp_path_factory.mktemp("cpo")), report_to="none", use_cpu=True, bf16=False,
                     max_length=64)
    return CPOTrainer(model=tiny_llama(vocab_size=VOCAB), args=args, processing_class=tokenizer,
                      train_dataset=Dataset.from_list([{"prompt": "Hi", "chosen": " yes", "rejected": " no"}]))


@pytest.mark.parametrize("theirs_options,ours_options", CPO_CASES.values(), ids=CPO_CASES.keys())
def test_reference_free_losses_match_trl_cpo_trainer(trainers, cpo_trainer, theirs_options,  # noqa: F811
                                                     ours_options):
    ours, _, common = trainers
    theirs = cpo_trainer
    defaults = {"beta": 0.1, "label_smoothing": 0.0, "alpha": 0.0, "simpo_gamma": 0.5}
    for name, value in {**defaults, **theirs_options}.items():
        setattr(theirs, name, value)
    ours.args = DPOMinConfig(**common, **ours_options, accelerator_config={"use_configured_state": True})
    ours.ref_model = None  # reference-free: never asked for

    our_batch = DPODataCollator(pad_token_id=0)(PAIRS)
    their_batch = _cpo_batch(PAIRS)
    rows, length = our_batch["input_ids"].shape
    assert theirs.concatenated_inputs(their_batch)["concatenated_input_ids"].shape == (rows, length)
    our_policy, their_policy = OursTable(0, rows, length), CpoTable(0, rows, length)
    our_loss = ours.compute_loss(our_policy, our_batch)
    their_loss, their_metrics = theirs.get_batch_loss_metrics(their_policy, their_batch)
    our_loss.backward()
    their_loss.backward()

    assert our_loss.item() == pytest.approx(their_loss.item(), rel=1e-9)
    assert their_policy.logits.grad.abs().max() > 0
    torch.testing.assert_close(our_policy.logits.grad, their_policy.logits.grad, atol=1e-12, rtol=1e-7)
    metrics = ours._metrics["train" if ours.model.training else "eval"]
    for key in CPO_METRICS:
        assert metrics[key][-1] == pytest.approx(their_metrics[key], rel=1e-6, abs=1e-9), key


def test_alpha_zero_and_small_alpha_agree_and_large_alpha_differs():
    """AlphaPO's shape (1 - p^-alpha) / alpha tends to log p as alpha -> 0: a hand check beside the TRL match."""
    chosen, rejected = torch.tensor([-3.0, -1.0], dtype=torch.float64), torch.tensor([-2.0, -4.0], dtype=torch.float64)
    lengths = torch.tensor([3.0, 2.0], dtype=torch.float64)
    common = {"loss_type": "simpo", "beta": 2.0, "chosen_lengths": lengths, "rejected_lengths": lengths}
    plain, plain_rewards, _ = dpo_loss(chosen, rejected, chosen, rejected, **common)
    near, _, _ = dpo_loss(chosen, rejected, chosen, rejected, alpha=1e-6, **common)
    far, far_rewards, _ = dpo_loss(chosen, rejected, chosen, rejected, alpha=0.5, **common)
    torch.testing.assert_close(near, plain, rtol=1e-5, atol=0)
    # By hand: simpo rewards are beta * mean token log-prob; with alpha 0.5, beta * (1 - exp(-0.5 * m)) / 0.5.
    torch.testing.assert_close(plain_rewards, 2.0 * chosen / lengths)
    torch.testing.assert_close(far_rewards, 2.0 * (1 - torch.exp(-0.5 * chosen / lengths)) / 0.5)
    assert (far - plain).abs().min() > 1e-2
