"""Every loss type of TRL's DPOTrainer, ours against TRL's own loss code (`DPOTrainer._compute_loss`).

Both trainers read their log-probs from the same fixed logit tables (a policy table and a reference table, float64),
so they see identical per-token log-probs, lengths and distributions; everything downstream (LD-DPO weighting, WPO
weights, length normalisation, sft, the combination of several losses) is each trainer's own code. Losses, gradients
with respect to the policy's logits, and the reward/log-prob metrics must agree to relative 1e-12: float64 rounding
leaves about 1e-15, so any difference in the formula shows.
"""

from types import SimpleNamespace

import pytest
import torch
import trl  # the independent reference: its absence is a failure, not a skip
from conftest import tiny_llama
from datasets import Dataset
from transformers import AutoTokenizer

from dpo_min import DPODataCollator, DPOMinConfig, DPOMinTrainer

VOCAB = 24
PAIRS = [
    {"prompt_ids": [5, 6, 7], "chosen_ids": [8, 9, 10, 11, 2], "rejected_ids": [12, 2]},  # chosen longer
    {"prompt_ids": [13, 14], "chosen_ids": [15, 2], "rejected_ids": [16, 17, 18, 19, 20, 2]},  # rejected longer
    {"prompt_ids": [21, 22, 23, 5], "chosen_ids": [3, 4, 2], "rejected_ids": [4, 3, 2]},  # same length
    {"prompt_ids": [6], "chosen_ids": [7, 8, 9, 2], "rejected_ids": [10, 11, 12, 13, 2]},
]
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")

CASES = {
    "sigmoid": {"loss_type": "sigmoid"},
    "hinge": {"loss_type": "hinge", "beta": 0.5},
    "ipo": {"loss_type": "ipo"},
    "exo_pair": {"loss_type": "exo_pair", "label_smoothing": 1e-3},
    "nca_pair": {"loss_type": "nca_pair"},
    "robust": {"loss_type": "robust", "label_smoothing": 0.2},
    "bco_pair": {"loss_type": "bco_pair"},
    "sppo_hard": {"loss_type": "sppo_hard"},
    "aot": {"loss_type": "aot", "label_smoothing": 0.1},
    "aot_unpaired": {"loss_type": "aot_unpaired", "label_smoothing": 0.1},
    "apo_zero": {"loss_type": "apo_zero"},
    "apo_down": {"loss_type": "apo_down"},
    "discopop": {"loss_type": "discopop", "discopop_tau": 0.5},
    "sft": {"loss_type": "sft"},
    "sigmoid_norm": {"loss_type": "sigmoid_norm", "beta": 2.0},
    "rpo": {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]},
    "mpo": {"loss_type": "sigmoid,bco_pair,sft", "loss_weights": [0.8, 0.2, 1.0]},
    "ld_alpha": {"loss_type": ["sigmoid", "sft"], "ld_alpha": 0.3},
    "ld_alpha_ipo": {"loss_type": "ipo", "ld_alpha": 0.5},
    "wpo": {"loss_type": "sigmoid", "use_weighting": True},
    # Not with sft or hinge: TRL 1.16 scales each loss by the WPO weights in place, which fails for the expanded sft
    # tensor and breaks hinge's backward (relu saved its output).
    "wpo_ld_alpha_mpo": {"loss_type": ["sigmoid", "bco_pair"], "use_weighting": True, "ld_alpha": 0.5},
}
# Relative tolerance per case: float64 throughout, except where TRL itself computes in float32 (exo_pair takes
# log(label_smoothing) of a float32 tensor, a relative error near 1e-8 in the loss and its gradient).
TOLERANCE = {"exo_pair": 1e-7}
FLOAT64_TOLERANCE = 1e-12


class LogitTable(torch.nn.Module):
    """A 'model' whose logits are a fixed random [2B, T, V] table, whatever the input ids."""

    def __init__(self, seed: int, rows: int, length: int):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.logits = torch.nn.Parameter(2 * torch.randn(rows, length, VOCAB, generator=generator, dtype=torch.float64))


class OursTable(LogitTable):
    def forward(self, input_ids, attention_mask, logits_to_keep, use_cache):
        return SimpleNamespace(logits=self.logits[logits_to_keep][None])


class TrlTable(LogitTable):
    def forward(self, input_ids, attention_mask, labels, fused_lm_head, use_cache):
        # What TRL's fused LM head returns: per-token outputs for the next label, zero off the completions.
        logprobs = torch.log_softmax(self.logits[:, :-1], dim=-1)
        next_labels = labels[:, 1:]
        mask = next_labels != -100
        zeros = torch.zeros(mask.shape, dtype=torch.float64)
        return SimpleNamespace(
            log_probs=logprobs.gather(-1, next_labels.clamp(min=0)[..., None]).squeeze(-1) * mask,
            log_sum_sq_probs=torch.logsumexp(2 * logprobs, dim=-1) * mask,
            entropy=zeros, mean_logits=zeros, is_top1=zeros.bool(),
        )


@pytest.fixture(scope="module")
def trainers(smollm_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("parity")
    tokenizer = AutoTokenizer.from_pretrained(str(smollm_path))
    common = {"output_dir": str(out), "report_to": "none", "use_cpu": True, "bf16": False,
              "gradient_checkpointing": False}
    # use_weighting=True so that TRL's fused head would compute log_sum_sq_probs; the tables replace it anyway.
    theirs = trl.DPOTrainer(model=tiny_llama(vocab_size=VOCAB), ref_model=tiny_llama(seed=1, vocab_size=VOCAB),
                            args=trl.DPOConfig(**common, use_weighting=True), processing_class=tokenizer,
                            train_dataset=Dataset.from_list([{"prompt": "Hi", "chosen": " yes", "rejected": " no"}]))
    ours = DPOMinTrainer(tiny_llama(vocab_size=VOCAB), args=DPOMinConfig(**common),
                         train_dataset=Dataset.from_list(PAIRS), processing_class=tokenizer,
                         ref_model=tiny_llama(seed=1, vocab_size=VOCAB))
    return ours, theirs, common


def last_metrics(trainer):
    metrics = trainer._metrics["train" if trainer.model.training else "eval"]
    return {key: metrics[key][-1] for key in METRICS}


@pytest.mark.parametrize("name", CASES)
def test_loss_matches_trl(trainers, name):
    ours, theirs, common = trainers
    case, tolerance = CASES[name], TOLERANCE.get(name, FLOAT64_TOLERANCE)
    # use_configured_state: building these arguments must not reset the accelerator state TRL's trainer runs on.
    args = DPOMinConfig(**common, **case, accelerator_config={"use_configured_state": True})
    ours.args = args
    for name, value in {"loss_types": args.loss_type, "loss_weights": args.loss_weights or [1.0] * len(args.loss_type),
                        "beta": args.beta, "label_smoothing": args.label_smoothing, "ld_alpha": args.ld_alpha,
                        "use_weighting": args.use_weighting}.items():
        setattr(theirs, name, value)
    theirs.args.discopop_tau = args.discopop_tau

    our_batch = DPODataCollator(pad_token_id=0)(PAIRS)
    their_batch = trl.trainer.dpo_trainer.DataCollatorForPreference(pad_token_id=0)(PAIRS)
    assert torch.equal(our_batch["input_ids"], their_batch["input_ids"])
    rows, length = our_batch["input_ids"].shape
    our_policy, their_policy = OursTable(0, rows, length), TrlTable(0, rows, length)
    ours.ref_model, theirs.ref_model = OursTable(1, rows, length), TrlTable(1, rows, length)

    our_loss = ours.compute_loss(our_policy, our_batch)
    their_loss = theirs._compute_loss(their_policy, their_batch, return_outputs=False)
    our_loss.backward()
    their_loss.backward()

    assert our_loss.item() == pytest.approx(their_loss.item(), rel=tolerance)
    their_grad = their_policy.logits.grad
    assert their_grad.abs().max() > 0  # a loss that moves the policy
    # Relative to the largest entry: single entries near zero are sums that cancel.
    torch.testing.assert_close(our_policy.logits.grad, their_grad, rtol=tolerance,
                               atol=tolerance * their_grad.abs().max().item())
    for key, value in last_metrics(ours).items():
        assert value == pytest.approx(last_metrics(theirs)[key], rel=FLOAT64_TOLERANCE), key
