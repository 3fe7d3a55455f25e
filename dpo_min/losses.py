"""The DPO loss family: a pure function of four per-pair log-prob tensors (plus lengths for a few variants).

`LOSSES` is a table of small named entries, each a per-pair loss written from the same `PairTerms`; several
variants combine as sum_i w_i * L_i per pair, so that the mean over pairs is sum_i w_i * mean(L_i).
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PairTerms:
    """What every loss reads, computed once per batch; every tensor is [B], one value per pair."""

    chosen_logps: torch.Tensor  # policy
    rejected_logps: torch.Tensor
    ref_chosen_logps: torch.Tensor
    ref_rejected_logps: torch.Tensor
    chosen_logratios: torch.Tensor  # policy - reference
    rejected_logratios: torch.Tensor
    chosen_scores: torch.Tensor  # f'(pi / pi_ref) of the f-divergence; the log-ratios for reverse KL
    rejected_scores: torch.Tensor
    chosen_lengths: torch.Tensor | None
    rejected_lengths: torch.Tensor | None
    chosen_nll: torch.Tensor | None
    beta: float
    eps: float  # label_smoothing
    discopop_tau: float
    simpo_gamma: float
    alpha: float  # AlphaPO

    @property
    def delta(self) -> torch.Tensor:
        return self.chosen_scores - self.rejected_scores

    def smoothed_logistic(self, margin: torch.Tensor) -> torch.Tensor:
        """-(1 - eps) log sigmoid(beta m) - eps log sigmoid(-beta m): the logistic loss with labels flipped at eps."""
        return -(1 - self.eps) * F.logsigmoid(self.beta * margin) - self.eps * F.logsigmoid(-self.beta * margin)

    def length_normalised_delta(self) -> torch.Tensor:
        return (self.chosen_scores / self.chosen_lengths.clamp(min=1)
                - self.rejected_scores / self.rejected_lengths.clamp(min=1))

    def alphapo(self, logps: torch.Tensor) -> torch.Tensor:
        """AlphaPO's reward shape (1 - p^-alpha) / alpha of a (mean or summed) log-prob; the log-prob at alpha 0."""
        return logps if self.alpha == 0 else (1 - torch.exp(-self.alpha * logps)) / self.alpha

    def per_token_policy_logps(self) -> tuple[torch.Tensor, torch.Tensor]:
        chosen_lengths, rejected_lengths = self.chosen_lengths.clamp(min=1), self.rejected_lengths.clamp(min=1)
        return self.chosen_logps / chosen_lengths, self.rejected_logps / rejected_lengths


# ---- reference-based losses: r = log pi - log pi_ref, D = r_chosen - r_rejected ----------------------------------
def _sigmoid(t: PairTerms) -> torch.Tensor:  # DPO, arXiv 2305.18290; eps > 0 is conservative DPO
    return t.smoothed_logistic(t.delta)


def _robust(t: PairTerms) -> torch.Tensor:  # arXiv 2403.00409: unbiased under label flips with probability eps
    beta_delta = t.beta * t.delta
    return (-(1 - t.eps) * F.logsigmoid(beta_delta) + t.eps * F.logsigmoid(-beta_delta)) / (1 - 2 * t.eps)


def _hinge(t: PairTerms) -> torch.Tensor:  # SLiC, arXiv 2305.10425
    return torch.relu(1 - t.beta * t.delta)


def _ipo(t: PairTerms) -> torch.Tensor:  # arXiv 2310.12036; per-token log-ratios, as the IPO authors ran it (and TRL)
    return (t.length_normalised_delta() - 1 / (2 * t.beta)) ** 2


def _sigmoid_norm(t: PairTerms) -> torch.Tensor:  # length-normalised DPO, Tulu 3, arXiv 2411.15124
    return -F.logsigmoid(t.beta * t.length_normalised_delta())


def _sft(t: PairTerms) -> torch.Tensor:  # RPO's NLL term, arXiv 2404.19733: the batch's token-level mean NLL
    nll = -t.chosen_logps if t.chosen_nll is None else t.chosen_nll
    return (nll.sum() / t.chosen_lengths.sum().clamp(min=1)).expand_as(t.chosen_logps)


def _bco_pair(t: PairTerms) -> torch.Tensor:  # BCO, arXiv 2404.04656
    return -F.logsigmoid(t.beta * t.chosen_logratios) - F.logsigmoid(-t.beta * t.rejected_logratios)


def _sppo_hard(t: PairTerms) -> torch.Tensor:  # SPPO, arXiv 2405.00675: P(chosen wins) = 1, P(rejected wins) = 0
    return (t.chosen_logratios - 0.5 / t.beta) ** 2 + (t.rejected_logratios + 0.5 / t.beta) ** 2


def _nca_pair(t: PairTerms) -> torch.Tensor:  # NCA, arXiv 2402.05369
    return (-F.logsigmoid(t.beta * t.chosen_logratios) - 0.5 * F.logsigmoid(-t.beta * t.chosen_logratios)
            - 0.5 * F.logsigmoid(-t.beta * t.rejected_logratios))


def _apo_zero(t: PairTerms) -> torch.Tensor:  # APO, arXiv 2408.06266, eq. 7: raise chosen, lower rejected
    return 1 - torch.sigmoid(t.beta * t.chosen_logratios) + torch.sigmoid(t.beta * t.rejected_logratios)


def _apo_down(t: PairTerms) -> torch.Tensor:  # APO, arXiv 2408.06266, eq. 8: lower chosen, lower rejected more
    return torch.sigmoid(t.beta * t.chosen_logratios) + 1 - torch.sigmoid(t.beta * t.delta)


def _exo_pair(t: PairTerms) -> torch.Tensor:  # EXO, arXiv 2402.00856: KL(softmax(beta [r_w, r_l]) || [1-eps, eps])
    beta_delta = t.beta * t.delta
    return (torch.sigmoid(beta_delta) * (F.logsigmoid(beta_delta) - math.log1p(-t.eps))
            + torch.sigmoid(-beta_delta) * (F.logsigmoid(-beta_delta) - math.log(t.eps)))


def _aot(t: PairTerms) -> torch.Tensor:  # AOT, arXiv 2406.05882: sorted policy margins against sorted reference ones
    policy_margins = torch.sort(t.chosen_logps - t.rejected_logps).values
    return t.smoothed_logistic(policy_margins - torch.sort(t.ref_chosen_logps - t.ref_rejected_logps).values)


def _aot_unpaired(t: PairTerms) -> torch.Tensor:  # AOT, arXiv 2406.05882
    return t.smoothed_logistic(torch.sort(t.chosen_logratios).values - torch.sort(t.rejected_logratios).values)


def _discopop(t: PairTerms) -> torch.Tensor:  # DiscoPOP, arXiv 2406.08414: logistic blending into exponential
    logits = t.beta * t.delta
    blend = torch.sigmoid(logits / t.discopop_tau)
    return -F.logsigmoid(logits) * (1 - blend) + torch.exp(-logits) * blend


# ---- reference-free losses: rewards from the policy alone (AlphaPO's `alpha` reshapes them) -------------------------
def _cpo_rewards(t: PairTerms) -> tuple[torch.Tensor, torch.Tensor]:
    return t.alphapo(t.chosen_logps), t.alphapo(t.rejected_logps)


def _cpo(t: PairTerms) -> torch.Tensor:  # CPO, arXiv 2401.08417, eq. 3 (its NLL term is `cpo_alpha`)
    chosen, rejected = _cpo_rewards(t)
    return t.smoothed_logistic(chosen - rejected)


def _simpo_rewards(t: PairTerms) -> tuple[torch.Tensor, torch.Tensor]:
    chosen, rejected = t.per_token_policy_logps()
    return t.alphapo(chosen), t.alphapo(rejected)


def _simpo(t: PairTerms) -> torch.Tensor:  # SimPO, arXiv 2405.14734: per-token log-probs, target margin gamma
    chosen, rejected = _simpo_rewards(t)
    return t.smoothed_logistic(chosen - rejected - t.simpo_gamma / t.beta)


@dataclass(frozen=True)
class LossEntry:
    """One loss type. `needs_reference`: None for a loss that reads no reference but leaves the choice to the others
    (sft: alone, it keeps the reference for the reward metrics, as TRL). `rewards` gives the (chosen, rejected)
    implicit rewards before beta, when they are not the log-ratios; `f_divergence` says the loss is built on the
    chosen-rejected score difference, where f-DPO's reparameterisation holds (TRL's list)."""

    loss: Callable[[PairTerms], torch.Tensor]
    needs_reference: bool | None = True
    needs_lengths: bool = False
    f_divergence: bool = False
    rewards: Callable[[PairTerms], tuple[torch.Tensor, torch.Tensor]] | None = None


LOSSES: dict[str, LossEntry] = {
    "sigmoid": LossEntry(_sigmoid, f_divergence=True),
    "robust": LossEntry(_robust, f_divergence=True),
    "hinge": LossEntry(_hinge, f_divergence=True),
    "ipo": LossEntry(_ipo, needs_lengths=True, f_divergence=True),
    "sigmoid_norm": LossEntry(_sigmoid_norm, needs_lengths=True, f_divergence=True),
    "sft": LossEntry(_sft, needs_reference=None, needs_lengths=True, f_divergence=True),
    "bco_pair": LossEntry(_bco_pair),
    "sppo_hard": LossEntry(_sppo_hard),
    "nca_pair": LossEntry(_nca_pair),
    "apo_zero": LossEntry(_apo_zero),
    "apo_down": LossEntry(_apo_down),
    "exo_pair": LossEntry(_exo_pair, f_divergence=True),
    "aot": LossEntry(_aot),
    "aot_unpaired": LossEntry(_aot_unpaired),
    "discopop": LossEntry(_discopop, f_divergence=True),
    "cpo": LossEntry(_cpo, needs_reference=False, rewards=_cpo_rewards),
    "simpo": LossEntry(_simpo, needs_reference=False, needs_lengths=True, rewards=_simpo_rewards),
}
LOSS_TYPES = tuple(LOSSES)
NEEDS_LENGTHS = tuple(name for name, entry in LOSSES.items() if entry.needs_lengths)
ALPHAPO_LOSSES = ("cpo", "simpo")  # the ones whose rewards AlphaPO reshapes


def _alpha_divergence_score(logratios: torch.Tensor, coef: float) -> torch.Tensor:
    if abs(coef - 1.0) < 1e-6:  # the limit f'(t) -> log t: reverse KL (as TRL)
        return logratios
    # (t^(coef-1) - 1) / (coef - 1), exponent clamped so that exp stays finite (TRL's float32 clamp)
    exponent = torch.clamp(((coef - 1.0) * logratios).float(), max=80.0)
    return (torch.exp(exponent) - 1.0).to(logratios.dtype) / (coef - 1.0)


# f-DPO, arXiv 2309.16240: f'(pi / pi_ref) of each f-divergence, written from the log-ratio u = log(pi / pi_ref).
F_DIVERGENCES: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "reverse_kl": lambda u, coef: u,
    "forward_kl": lambda u, coef: 1 - torch.exp(-u),
    "js_divergence": lambda u, coef: math.log(2) + F.logsigmoid(u),
    "alpha_divergence": _alpha_divergence_score,
}


def needs_reference(loss_types: str | Sequence[str], reference_free: bool = False) -> bool:
    """Whether any of the loss types reads the reference log-probs."""
    names = [loss_types] if isinstance(loss_types, str) else loss_types
    wants = [LOSSES[name].needs_reference for name in names]
    return not reference_free and (any(wants) or all(want is None for want in wants))


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
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    simpo_gamma: float = 0.5,
    alpha: float = 0.0,
    cpo_alpha: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair preference loss and implicit rewards.

    Args:
        policy_chosen_logps: [B] summed log-probs of the chosen completions under the policy.
        policy_rejected_logps: [B] the same for the rejected completions.
        ref_chosen_logps: [B] summed log-probs of the chosen completions under the reference (unread by cpo, simpo
            and sft).
        ref_rejected_logps: [B] the same for the rejected completions.
        beta: inverse temperature of the implicit reward (tau, the regulariser, for ipo).
        label_smoothing: eps. For sigmoid, aot, cpo and simpo, the probability that a label is flipped (conservative
            DPO): loss = -(1 - eps) * logsigmoid(beta * D) - eps * logsigmoid(-beta * D); robust DPO's unbiased
            estimator for robust; the target distribution [1 - eps, eps] for exo_pair.
        reference_free: take the reference log-probs as 0 (the reference is a uniform model).
        loss_type: one name of `LOSS_TYPES` or several, combined per pair as sum_i loss_weights[i] * L_i.
        loss_weights: one float per loss type (default all 1).
        chosen_lengths: [B] completion tokens of each chosen completion; needed by `NEEDS_LENGTHS`.
        rejected_lengths: [B] the same for the rejected completions.
        chosen_nll: [B] summed negative log-likelihood of each chosen completion under the policy, for sft and
            cpo_alpha (default -policy_chosen_logps; pass it when those are length-desensitised).
        pair_weights: [B] per-pair weights multiplying every loss term (WPO), or None.
        discopop_tau: temperature of discopop's mixing between the logistic and the exponential loss.
        f_divergence_type: a name of `F_DIVERGENCES`; the losses that allow it (`LossEntry.f_divergence`) compare
            f'(pi / pi_ref) instead of the log-ratios.
        f_alpha_divergence_coef: the alpha of alpha_divergence.
        simpo_gamma: SimPO's target margin between the per-token chosen and rejected rewards.
        alpha: AlphaPO's reward shape for cpo and simpo; 0 keeps the log-probs.
        cpo_alpha: weight of CPO's behaviour-cloning term, the batch's mean NLL of the chosen tokens (as sft).

    Returns:
        (losses [B], chosen_rewards [B], rejected_rewards [B]), rewards detached: beta * (policy - reference), or
        for a first loss type with rewards of its own (cpo, simpo), beta times those.
    """
    loss_types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    loss_weights = [1.0] * len(loss_types) if loss_weights is None else list(loss_weights)
    unknown = [name for name in loss_types if name not in LOSSES]
    if unknown or not loss_types or len(loss_weights) != len(loss_types):
        raise ValueError(f"loss_type {loss_types} with loss_weights {loss_weights}: each loss type must be one of "
                         f"{LOSS_TYPES}, with one weight each")
    if (any(LOSSES[name].needs_lengths for name in loss_types) or cpo_alpha) and (
            chosen_lengths is None or rejected_lengths is None):
        raise ValueError(f"loss types {NEEDS_LENGTHS} and cpo_alpha need chosen_lengths and rejected_lengths")
    if f_divergence_type not in F_DIVERGENCES:
        raise ValueError(f"f_divergence_type must be one of {tuple(F_DIVERGENCES)}, got {f_divergence_type!r}")
    if f_divergence_type != "reverse_kl" and not all(LOSSES[name].f_divergence for name in loss_types):
        raise ValueError(f"f_divergence_type {f_divergence_type!r} needs loss types among "
                         f"{[name for name, entry in LOSSES.items() if entry.f_divergence]}, got {loss_types}")
    if alpha != 0 and not set(loss_types) & set(ALPHAPO_LOSSES):
        raise ValueError(f"alpha (AlphaPO) reshapes the rewards of {ALPHAPO_LOSSES}, none of which is in {loss_types}")
    if reference_free:
        ref_chosen_logps = torch.zeros_like(ref_chosen_logps)
        ref_rejected_logps = torch.zeros_like(ref_rejected_logps)
    chosen_logratios = policy_chosen_logps - ref_chosen_logps
    rejected_logratios = policy_rejected_logps - ref_rejected_logps
    score = F_DIVERGENCES[f_divergence_type]
    terms = PairTerms(
        chosen_logps=policy_chosen_logps, rejected_logps=policy_rejected_logps, ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps, chosen_logratios=chosen_logratios,
        rejected_logratios=rejected_logratios, chosen_scores=score(chosen_logratios, f_alpha_divergence_coef),
        rejected_scores=score(rejected_logratios, f_alpha_divergence_coef), chosen_lengths=chosen_lengths,
        rejected_lengths=rejected_lengths, chosen_nll=chosen_nll, beta=beta, eps=label_smoothing,
        discopop_tau=discopop_tau, simpo_gamma=simpo_gamma, alpha=alpha,
    )
    losses = sum(weight * LOSSES[name].loss(terms) for name, weight in zip(loss_types, loss_weights))
    if pair_weights is not None:
        losses = losses * pair_weights
    if cpo_alpha:  # added after the pair weights, as CPOTrainer adds it to the mean loss
        losses = losses + cpo_alpha * _sft(terms)
    reward_of = LOSSES[loss_types[0]].rewards
    chosen_rewards, rejected_rewards = (chosen_logratios, rejected_logratios) if reward_of is None else reward_of(terms)
    return losses, beta * chosen_rewards.detach(), beta * rejected_rewards.detach()
