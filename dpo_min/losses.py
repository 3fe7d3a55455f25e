"""The DPO loss family: a pure function of four per-pair log-prob tensors (plus lengths for a few variants).

Every variant is a few lines in `dpo_loss` below, written from the same log-ratios; several variants combine as
sum_i w_i * L_i per pair, so that the mean over pairs is sum_i w_i * mean(L_i).
"""

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

LOSS_TYPES = ("sigmoid", "robust", "hinge", "ipo", "sigmoid_norm", "sft", "bco_pair", "sppo_hard", "nca_pair",
              "apo_zero", "apo_down", "exo_pair", "aot", "aot_unpaired", "discopop")
NEEDS_LENGTHS = ("ipo", "sigmoid_norm", "sft")


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    reference_free: bool = False,
    loss_type: str | Sequence[str] = "sigmoid",
    loss_weights: Sequence[float] | None = None,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    chosen_nll: torch.Tensor | None = None,
    pair_weights: torch.Tensor | None = None,
    discopop_tau: float = 0.05,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair preference loss and implicit rewards.

    Args:
        policy_chosen_logps: [B] summed log-probs of the chosen completions under the policy.
        policy_rejected_logps: [B] the same for the rejected completions.
        ref_chosen_logps: [B] summed log-probs of the chosen completions under the reference.
        ref_rejected_logps: [B] the same for the rejected completions.
        beta: inverse temperature of the implicit reward (tau, the regulariser, for ipo).
        label_smoothing: eps. For sigmoid and aot, the probability that a label is flipped (conservative DPO):
            loss = -(1 - eps) * logsigmoid(beta * D) - eps * logsigmoid(-beta * D); robust DPO's unbiased
            estimator for robust; the target distribution [1 - eps, eps] for exo_pair.
        reference_free: take the reference log-probs as 0 (the reference is a uniform model).
        loss_type: one name of `LOSS_TYPES` or several, combined per pair as sum_i loss_weights[i] * L_i.
        loss_weights: one float per loss type (default all 1).
        chosen_lengths: [B] completion tokens of each chosen completion; needed by ipo, sigmoid_norm and sft.
        rejected_lengths: [B] the same for the rejected completions.
        chosen_nll: [B] summed negative log-likelihood of each chosen completion under the policy, for sft
            (default -policy_chosen_logps; pass it when those are length-desensitised).
        pair_weights: [B] per-pair weights multiplying every loss term (WPO), or None.
        discopop_tau: temperature of discopop's mixing between the logistic and the exponential loss.

    Returns:
        (losses [B], chosen_rewards [B], rejected_rewards [B]); rewards are beta * (policy - reference), detached.
    """
    loss_types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    loss_weights = [1.0] * len(loss_types) if loss_weights is None else list(loss_weights)
    unknown = [name for name in loss_types if name not in LOSS_TYPES]
    if unknown or len(loss_weights) != len(loss_types):
        raise ValueError(f"loss_type {loss_types} with loss_weights {loss_weights}: each loss type must be one of "
                         f"{LOSS_TYPES}, with one weight each")
    if any(name in NEEDS_LENGTHS for name in loss_types) and (chosen_lengths is None or rejected_lengths is None):
        raise ValueError(f"loss types {NEEDS_LENGTHS} need chosen_lengths and rejected_lengths")
    if reference_free:
        ref_chosen_logps = torch.zeros_like(ref_chosen_logps)
        ref_rejected_logps = torch.zeros_like(ref_rejected_logps)
    chosen_logratios = policy_chosen_logps - ref_chosen_logps
    rejected_logratios = policy_rejected_logps - ref_rejected_logps
    delta = chosen_logratios - rejected_logratios
    eps = label_smoothing

    def smoothed_logistic(margin: torch.Tensor) -> torch.Tensor:
        return -(1 - eps) * F.logsigmoid(beta * margin) - eps * F.logsigmoid(-beta * margin)

    def length_normalised_delta() -> torch.Tensor:
        return chosen_logratios / chosen_lengths.clamp(min=1) - rejected_logratios / rejected_lengths.clamp(min=1)

    def loss_of(name: str) -> torch.Tensor:
        if name == "sigmoid":
            return smoothed_logistic(delta)
        if name == "robust":  # unbiased under label flips with probability eps
            return (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
        if name == "hinge":
            return torch.relu(1 - beta * delta)
        if name == "ipo":  # per-token log-ratios, as the IPO authors ran it (and TRL)
            return (length_normalised_delta() - 1 / (2 * beta)) ** 2
        if name == "sigmoid_norm":
            return -F.logsigmoid(beta * length_normalised_delta())
        if name == "sft":  # token-level mean NLL of the batch's chosen completions, the same for every pair
            nll = -policy_chosen_logps if chosen_nll is None else chosen_nll
            return (nll.sum() / chosen_lengths.sum().clamp(min=1)).expand_as(delta)
        if name == "bco_pair":
            return -F.logsigmoid(beta * chosen_logratios) - F.logsigmoid(-beta * rejected_logratios)
        if name == "sppo_hard":  # P(chosen wins) set to 1, P(rejected wins) to 0
            return (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2
        if name == "nca_pair":
            return (-F.logsigmoid(beta * chosen_logratios) - 0.5 * F.logsigmoid(-beta * chosen_logratios)
                    - 0.5 * F.logsigmoid(-beta * rejected_logratios))
        if name == "apo_zero":  # raise chosen, lower rejected
            return 1 - torch.sigmoid(beta * chosen_logratios) + torch.sigmoid(beta * rejected_logratios)
        if name == "apo_down":  # lower chosen, lower rejected more
            return torch.sigmoid(beta * chosen_logratios) + 1 - torch.sigmoid(beta * delta)
        if name == "exo_pair":  # KL(softmax(beta * [r_chosen, r_rejected]) || [1 - eps, eps])
            return (torch.sigmoid(beta * delta) * (F.logsigmoid(beta * delta) - math.log1p(-eps))
                    + torch.sigmoid(-beta * delta) * (F.logsigmoid(-beta * delta) - math.log(eps)))
        if name == "aot":  # sorted policy margins against sorted reference margins, across the batch
            policy_margins = torch.sort(policy_chosen_logps - policy_rejected_logps).values
            return smoothed_logistic(policy_margins - torch.sort(ref_chosen_logps - ref_rejected_logps).values)
        if name == "aot_unpaired":
            return smoothed_logistic(torch.sort(chosen_logratios).values - torch.sort(rejected_logratios).values)
        # discopop: logistic for negative margins blending into exponential for positive ones
        logits = beta * delta
        blend = torch.sigmoid(logits / discopop_tau)
        return -F.logsigmoid(logits) * (1 - blend) + torch.exp(-logits) * blend

    losses = sum(weight * loss_of(name) for name, weight in zip(loss_types, loss_weights))
    if pair_weights is not None:
        losses = losses * pair_weights
    return losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()
