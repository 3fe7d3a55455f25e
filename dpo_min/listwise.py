"""DPO's listwise loss: the Plackett-Luce objective over a group's ranking (loss_type `plackett_luce`).

The DPO paper (Rafailov et al. 2023, arXiv 2305.18290, appendix A.3) derives it for K ranked answers tau(1) > ... >
tau(K) of one prompt: with implicit rewards r = beta * log(pi / pi_ref),

    L = -log prod_{k=1}^{K} exp(r_tau(k)) / sum_{j=k}^{K} exp(r_tau(j)),

which for K = 2 is DPO's -log sigmoid(r_chosen - r_rejected). A group's ranking comes from its pairs
(grouping.strict_order), and the batch carries it (collator_groups.py: `group_ranking`, `group_sizes`).
"""

import torch


def plackett_luce(rewards: torch.Tensor, ranking: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """The Plackett-Luce negative log-likelihood of each group's ranking.

    Args:
        rewards: [2B] implicit rewards of the pairs' sequences (B chosen, then B rejected), beta * log(pi / pi_ref).
        ranking: [R] indices into `rewards`, group by group, each group's completions best first, each once.
        sizes: [G] completions per group (sum = R), each >= 2.

    Returns:
        [G] losses, -sum_k (r_tau(k) - log sum_{j>=k} exp r_tau(j)) per group; the last answer's term is 0.
    """
    losses = []
    for ranked in torch.split(rewards[ranking], sizes.tolist()):
        # log sum_{j >= k} exp r_tau(j) for every k: a log-cumsum-exp from the worst answer up.
        tails = torch.logcumsumexp(ranked.flip(0), dim=0).flip(0)
        losses.append((tails - ranked).sum())
    return torch.stack(losses)
