"""The DPO family's loss types beyond DPO's own logistic loss, each a per-pair loss of one `PairTerms`, and what the
`LOSSES` table (losses.py) holds of each: `LossEntry`, its `Knob`s; f-DPO's `F_DIVERGENCES`.

`dpo_loss` (losses.py) makes the `PairTerms` of a batch from the four log-probs, and the one `LOSSES` table there
names each function below beside its constraints; DPO's `sigmoid` and the losses that take it of logits of their own
(aot, cpo, simpo) are written in losses.py, beside `dpo_loss`.
"""

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

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


# ---- what the `LOSSES` table (losses.py) holds of each loss type: its function and its constraints -----------
@dataclass(frozen=True)
class Knob:
    """A hyperparameter a loss reads: its default (the config field's) and the values this loss accepts."""

    default: float
    low: float = -math.inf
    high: float = math.inf
    open_low: bool = False
    open_high: bool = False
    note: str = ""

    def holds(self, value: float) -> bool:
        above = value > self.low if self.open_low else value >= self.low
        below = value < self.high if self.open_high else value <= self.high
        return above and below

    def __str__(self) -> str:  # "in [0, 0.5)", or "> 0" for a range open above
        if self.high == math.inf:
            return f"{'>' if self.open_low else '>='} {self.low:g}"
        return f"in {'(' if self.open_low else '['}{self.low:g}, {self.high:g}{')' if self.open_high else ']'}"


# Checked whatever the loss types (each is a config field of its own): the values that make sense at all.
SMOOTHING, TAU, NON_NEGATIVE = Knob(0.0, 0.0, 1.0, open_high=True), Knob(0.05, 0.0, open_low=True), Knob(0.0, 0.0)
RANGES: dict[str, Knob] = {"label_smoothing": SMOOTHING, "discopop_tau": TAU, "cpo_alpha": NON_NEGATIVE}
ALPHA, GAMMA = Knob(0.0), Knob(0.5)


@dataclass(frozen=True)
class LossEntry:
    """One loss type and its constraints.

    `reads`: the hyperparameters (config field names) it reads beyond beta, with the values it accepts.
    `reads_reference`: its loss reads the reference log-probs (a run without one still keeps the reference for the
    reward metrics, the log-ratios, unless a loss type has `rewards` of its own: `LossSettings.reads_reference`).
    `sorts_batch`: it sorts pairs across the batch (no per-pair
    weights). `f_divergence`: built on the chosen-rejected score difference, where f-DPO's reparameterisation holds
    (TRL's list). `rewards`: the (chosen, rejected) implicit rewards before beta, when they are not the log-ratios
    (AlphaPO's reward form, for the losses that read `alpha`)."""

    loss: Callable[[PairTerms], torch.Tensor]
    reads: Mapping[str, Knob] = field(default_factory=dict)
    reads_reference: bool = True
    needs_lengths: bool = False
    sorts_batch: bool = False
    f_divergence: bool = False
    rewards: Callable[[PairTerms], tuple[torch.Tensor, torch.Tensor]] | None = None
    tie: float | None = None  # its loss of a pair whose policy is its reference, when the same for every pair


READS_LABEL_SMOOTHING = {"label_smoothing": SMOOTHING}  # a label-flip probability in [0, 1)


# ---- f-DPO's regularisers, which `dpo_loss` looks up (reverse KL, DPO's own, the log-ratio itself) -----------
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
