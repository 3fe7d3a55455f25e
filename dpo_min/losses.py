"""The DPO loss: a pure function of four per-pair log-prob tensors."""

import torch
import torch.nn.functional as F


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    reference_free: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair DPO loss and implicit rewards.

    Args:
        policy_chosen_logps: [B] summed log-probs of the chosen completions under the policy.
        policy_rejected_logps: [B] the same for the rejected completions.
        ref_chosen_logps: [B] summed log-probs of the chosen completions under the reference.
        ref_rejected_logps: [B] the same for the rejected completions.
        beta: inverse temperature of the implicit reward.
        label_smoothing: probability eps that a preference label is flipped (conservative DPO):
            loss = -(1 - eps) * logsigmoid(beta * D) - eps * logsigmoid(-beta * D).
        reference_free: take the reference log-probs as 0 (the reference is a uniform model).

    Returns:
        (losses [B], chosen_rewards [B], rejected_rewards [B]); rewards are beta * (policy - reference), detached.
    """
    if reference_free:
        ref_chosen_logps = torch.zeros_like(ref_chosen_logps)
        ref_rejected_logps = torch.zeros_like(ref_rejected_logps)
    chosen_logratios = policy_chosen_logps - ref_chosen_logps
    rejected_logratios = policy_rejected_logps - ref_rejected_logps
    logits = beta * (chosen_logratios - rejected_logratios)
    losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    return losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()
