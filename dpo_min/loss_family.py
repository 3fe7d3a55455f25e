"""The DPO family's loss types beyond DPO's own logistic loss, each a per-pair loss of one `PairTerms` with its paper,
and `PairTerms` itself, what every loss type reads.

`dpo_loss` (losses.py) makes the `PairTerms` of a batch from the four log-probs, and the one `LOSSES` table there
names each function below beside its constraints (a `LossEntry`); DPO's `sigmoid` and the losses that take it of
logits of their own (aot, cpo, simpo) are written in losses.py, beside `dpo_loss`. A default run calls none of these.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PairTerms:
    """What every loss reads, made once per batch by `dpo_loss`: [B] tensors, one value per pair, and the
    hyperparameters as plain values."""

    chosen_logps: torch.Tensor  # policy
    rejected_logps: torch.Tensor
    ref_chosen_logps: torch.Tensor
    ref_rejected_logps: torch.Tensor
    chosen_logratios: torch.Tensor  # policy - reference
    rejected_logratios: torch.Tensor
    chosen_scores: torch.Tensor  # f'(pi / pi_ref) of the f-divergence; the log-ratios for reverse KL (DPO)
    rejected_scores: torch.Tensor
    delta: torch.Tensor  # DPO's logits: chosen_scores - rejected_scores
    chosen_lengths: torch.Tensor | None
    rejected_lengths: torch.Tensor | None
    chosen_nll: torch.Tensor | None
    beta: float
    label_smoothing: float
    hyperparameters: Mapping[str, float]  # every one some entry reads, by config field name (`LossEntry.reads`)
    # plackett_luce: (ranking [R] into the 2B sequences, sizes [G]) of the batch's groups (collator_groups.py)
    groups: tuple[torch.Tensor, torch.Tensor] | None = None

    def value(self, name: str) -> float:
        """A hyperparameter a loss entry declares it reads (`LossEntry.reads`)."""
        return self.hyperparameters[name]

    def length_normalised_delta(self) -> torch.Tensor:
        return (self.chosen_scores / self.chosen_lengths.clamp(min=1)
                - self.rejected_scores / self.rejected_lengths.clamp(min=1))

    def alphapo(self, logps: torch.Tensor) -> torch.Tensor:
        """AlphaPO's reward shape (1 - p^-alpha) / alpha of a (mean or summed) log-prob; the log-prob at alpha 0."""
        alpha = self.value("alpha")
        return logps if alpha == 0 else (1 - torch.exp(-alpha * logps)) / alpha

    def per_token_policy_logps(self) -> tuple[torch.Tensor, torch.Tensor]:
        chosen_lengths, rejected_lengths = self.chosen_lengths.clamp(min=1), self.rejected_lengths.clamp(min=1)
        return self.chosen_logps / chosen_lengths, self.rejected_logps / rejected_lengths


# ---- reference-based losses: r = log pi - log pi_ref, D = r_chosen - r_rejected ----------------------------------
def robust(t: PairTerms) -> torch.Tensor:  # arXiv 2403.00409: unbiased under label flips with probability eps
    beta_delta, eps = t.beta * t.delta, t.label_smoothing
    return (-(1 - eps) * F.logsigmoid(beta_delta) + eps * F.logsigmoid(-beta_delta)) / (1 - 2 * eps)


def hinge(t: PairTerms) -> torch.Tensor:  # SLiC, arXiv 2305.10425
    return torch.relu(1 - t.beta * t.delta)


def ipo(t: PairTerms) -> torch.Tensor:  # arXiv 2310.12036; per-token log-ratios, as the IPO authors ran it (and TRL)
    return (t.length_normalised_delta() - 1 / (2 * t.beta)) ** 2


def sigmoid_norm(t: PairTerms) -> torch.Tensor:  # length-normalised DPO, Tulu 3, arXiv 2411.15124
    return -F.logsigmoid(t.beta * t.length_normalised_delta())


def sft(t: PairTerms) -> torch.Tensor:  # RPO's NLL term, arXiv 2404.19733: the batch's token-level mean NLL
    nll = -t.chosen_logps if t.chosen_nll is None else t.chosen_nll
    return (nll.sum() / t.chosen_lengths.sum().clamp(min=1)).expand_as(t.chosen_logps)


def bco_pair(t: PairTerms) -> torch.Tensor:  # BCO, arXiv 2404.04656
    return -F.logsigmoid(t.beta * t.chosen_logratios) - F.logsigmoid(-t.beta * t.rejected_logratios)


def sppo_hard(t: PairTerms) -> torch.Tensor:  # SPPO, arXiv 2405.00675: P(chosen wins) = 1, P(rejected wins) = 0
    return (t.chosen_logratios - 0.5 / t.beta) ** 2 + (t.rejected_logratios + 0.5 / t.beta) ** 2


def nca_pair(t: PairTerms) -> torch.Tensor:  # NCA, arXiv 2402.05369
    return (-F.logsigmoid(t.beta * t.chosen_logratios) - 0.5 * F.logsigmoid(-t.beta * t.chosen_logratios)
            - 0.5 * F.logsigmoid(-t.beta * t.rejected_logratios))


def apo_zero(t: PairTerms) -> torch.Tensor:  # APO, arXiv 2408.06266, eq. 7: raise chosen, lower rejected
    return 1 - torch.sigmoid(t.beta * t.chosen_logratios) + torch.sigmoid(t.beta * t.rejected_logratios)


def apo_down(t: PairTerms) -> torch.Tensor:  # APO, arXiv 2408.06266, eq. 8: lower chosen, lower rejected more
    return torch.sigmoid(t.beta * t.chosen_logratios) + 1 - torch.sigmoid(t.beta * t.delta)


def exo_pair(t: PairTerms) -> torch.Tensor:  # EXO, arXiv 2402.00856: KL(softmax(beta [r_w, r_l]) || [1-eps, eps])
    beta_delta, eps = t.beta * t.delta, t.label_smoothing
    return (torch.sigmoid(beta_delta) * (F.logsigmoid(beta_delta) - math.log1p(-eps))
            + torch.sigmoid(-beta_delta) * (F.logsigmoid(-beta_delta) - math.log(eps)))


def discopop(t: PairTerms) -> torch.Tensor:  # DiscoPOP, arXiv 2406.08414: logistic blending into exponential
    logits = t.beta * t.delta
    blend = torch.sigmoid(logits / t.value("discopop_tau"))
    return -F.logsigmoid(logits) * (1 - blend) + torch.exp(-logits) * blend
