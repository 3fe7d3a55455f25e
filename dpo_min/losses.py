"""The DPO loss family's table: a pure function of four per-pair log-prob tensors (plus lengths for a few variants)
for every loss but DPO's alone, the default, which `DPOMinTrainer.compute_loss` writes out (`LossSettings.dpo_alone`
says which; `dpo_loss` gives the same on those settings).

`dpo_loss` computes the log-ratios and DPO's logits from the four log-probs, then calls each loss type's entry of
`LOSSES`: a per-pair loss of those `PairTerms` (plain tensors and plain hyperparameter values), carrying its own
constraints (a `LossEntry`): the hyperparameters it reads (config fields) and the values it accepts, whether it reads
the reference, needs lengths, sorts across the batch, has an f-divergence form, or rewards of its own (AlphaPO's form).
DPO's `sigmoid` and the losses that take it of logits of their own (aot, cpo, simpo) are written here, with what the
table holds of each (`LossEntry`, its `Knob`s) and f-DPO's `F_DIVERGENCES`; the other loss types and `PairTerms` are
in loss_family.py.
`LossSettings` is built from the config, validated once (`DPOMinConfig.__post_init__`), and is what `dpo_loss` reads.
Several variants combine as sum_i w_i * L_i per pair, so that the mean over pairs is sum_i w_i * mean(L_i). Adding
a loss type with a hyperparameter of its own is one `LOSSES` entry and one `DPOMinConfig` field of the same name:
`LossSettings` reads the field, and the resume check compares it (`LossSettings.config_fields`).
"""

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F

from . import listwise
from . import loss_family as family
from .loss_family import PairTerms


# ---- what the `LOSSES` table holds of each loss type: its function and its constraints -------------------------
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


# ---- f-DPO's regularisers, which `dpo_loss` looks up (reverse KL, DPO's own, the log-ratio itself) ---------------
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


# ---- DPO and the losses that take its loss of logits of their own: r = log pi - log pi_ref, D = r_c - r_r --------
def _sigmoid(t: PairTerms, logits: torch.Tensor | None = None) -> torch.Tensor:
    """DPO, arXiv 2305.18290: logits (pi_c - ref_c) - (pi_r - ref_r) in log-probs, made by `dpo_loss`; label_smoothing
    ls > 0 is conservative DPO (cDPO, Mitchell 2023), labels flipped with probability ls. aot, cpo and simpo take
    the same loss of logits of their own."""
    logits = t.delta if logits is None else logits
    beta, ls = t.beta, t.label_smoothing
    return -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls


def _aot(t: PairTerms) -> torch.Tensor:  # AOT, arXiv 2406.05882: sorted policy margins against sorted reference ones
    policy_margins = torch.sort(t.chosen_logps - t.rejected_logps).values
    return _sigmoid(t, policy_margins - torch.sort(t.ref_chosen_logps - t.ref_rejected_logps).values)


def _aot_unpaired(t: PairTerms) -> torch.Tensor:  # AOT, arXiv 2406.05882
    return _sigmoid(t, torch.sort(t.chosen_logratios).values - torch.sort(t.rejected_logratios).values)


# ---- reference-free losses: rewards from the policy alone (AlphaPO's `alpha` reshapes them) -------------------------
def _cpo_rewards(t: PairTerms) -> tuple[torch.Tensor, torch.Tensor]:
    return t.alphapo(t.chosen_logps), t.alphapo(t.rejected_logps)


def _cpo(t: PairTerms) -> torch.Tensor:  # CPO, arXiv 2401.08417, eq. 3 (its NLL term is `cpo_alpha`)
    chosen, rejected = _cpo_rewards(t)
    return _sigmoid(t, chosen - rejected)


def _simpo_rewards(t: PairTerms) -> tuple[torch.Tensor, torch.Tensor]:
    chosen, rejected = t.per_token_policy_logps()
    return t.alphapo(chosen), t.alphapo(rejected)


def _simpo(t: PairTerms) -> torch.Tensor:  # SimPO, arXiv 2405.14734: per-token log-probs, target margin gamma
    chosen, rejected = _simpo_rewards(t)
    return _sigmoid(t, chosen - rejected - t.value("simpo_gamma") / t.beta)


def _plackett_luce(t: PairTerms) -> torch.Tensor:
    """DPO's listwise loss, arXiv 2305.18290 appendix A.3: [G], one loss per group, over each group's ranking of the
    rewards beta * (pi - ref) (listwise.py); without groups each pair is its own ranking of two, DPO's sigmoid."""
    rewards = t.beta * torch.cat([t.chosen_logratios, t.rejected_logratios])
    pairs = len(t.chosen_logratios)
    ranking, sizes = t.groups or (torch.arange(2 * pairs).view(2, pairs).T.flatten(), torch.full((pairs,), 2))
    return listwise.plackett_luce(rewards, ranking.to(rewards.device), sizes)


LOSSES: dict[str, LossEntry] = {
    "sigmoid": LossEntry(_sigmoid, READS_LABEL_SMOOTHING, f_divergence=True, tie=math.log(2)),  # -logsigmoid(0)
    "robust": LossEntry(family.robust, {"label_smoothing": Knob(0.0, 0.0, 0.5, open_high=True)}, f_divergence=True),
    "hinge": LossEntry(family.hinge, f_divergence=True),
    "ipo": LossEntry(family.ipo, needs_lengths=True, f_divergence=True),
    "sigmoid_norm": LossEntry(family.sigmoid_norm, needs_lengths=True, f_divergence=True),
    "sft": LossEntry(family.sft, reads_reference=False, needs_lengths=True, f_divergence=True),
    "bco_pair": LossEntry(family.bco_pair),
    "sppo_hard": LossEntry(family.sppo_hard),
    "nca_pair": LossEntry(family.nca_pair),
    "apo_zero": LossEntry(family.apo_zero),
    "apo_down": LossEntry(family.apo_down),
    "exo_pair": LossEntry(family.exo_pair, {"label_smoothing": Knob(0.0, 0.0, 1.0, open_low=True, open_high=True,
                                                              note=" (the EXO paper uses 1e-3)")}, f_divergence=True),
    "aot": LossEntry(_aot, READS_LABEL_SMOOTHING, sorts_batch=True),
    "aot_unpaired": LossEntry(_aot_unpaired, READS_LABEL_SMOOTHING, sorts_batch=True),
    "discopop": LossEntry(family.discopop, {"discopop_tau": TAU}, f_divergence=True),
    "cpo": LossEntry(_cpo, {**READS_LABEL_SMOOTHING, "alpha": ALPHA}, reads_reference=False, rewards=_cpo_rewards),
    "simpo": LossEntry(_simpo, {**READS_LABEL_SMOOTHING, "alpha": ALPHA, "simpo_gamma": GAMMA}, reads_reference=False,
                       needs_lengths=True, rewards=_simpo_rewards),
    "plackett_luce": LossEntry(_plackett_luce),  # one loss per group (a batch of whole groups, listwise.py)
}
LOSS_TYPES = tuple(LOSSES)


def _hyperparameter_defaults() -> dict[str, float]:
    """Every hyperparameter some entry reads, at its default (read now: a test may add an entry)."""
    return {name: knob.default for entry in LOSSES.values() for name, knob in entry.reads.items()}


# The LossSettings fields not read from a config field of their own name.
_RENAMED_FIELDS = ("loss_types", "loss_weights", "hyperparameters")


@dataclass(frozen=True)
class LossSettings:
    """Every value the loss reads besides tensors: which losses, their weights and hyperparameters, and the two
    modifiers applied before `dpo_loss` (LD-DPO's `ld_alpha` on the summed log-probs, WPO's `use_weighting`)."""

    loss_types: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] | None = None  # one per loss type; None: all 1
    beta: float = 0.1
    reference_free: bool = False
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    cpo_alpha: float = 0.0
    ld_alpha: float | None = None
    use_weighting: bool = False
    hyperparameters: Mapping[str, float] = field(default_factory=_hyperparameter_defaults)  # by config field name

    @classmethod
    def from_config(cls, config: Any) -> "LossSettings":
        """The settings of a `DPOMinConfig` (or any object with its fields), not yet validated."""
        own = {f.name: getattr(config, f.name) for f in fields(cls) if f.name not in _RENAMED_FIELDS}
        weights = None if config.loss_weights is None else tuple(config.loss_weights)
        return cls(loss_types=tuple(config.loss_type), loss_weights=weights, **own,
                   hyperparameters={name: getattr(config, name) for name in _hyperparameter_defaults()})

    @classmethod
    def default(cls, name: str) -> Any:
        """The default of a config field the loss reads (`DPOMinConfig` reads its own from here): a field of these
        settings, or a hyperparameter some entry reads (its `Knob`)."""
        own = {f.name: f.default for f in fields(cls) if f.name not in _RENAMED_FIELDS}
        return own[name] if name in own else _hyperparameter_defaults()[name]

    @classmethod
    def config_fields(cls) -> tuple[str, ...]:
        """The config fields `from_config` reads (an entry's new hyperparameter included): a resumed run must share
        them to train the same loss."""
        own = (f.name for f in fields(cls) if f.name not in _RENAMED_FIELDS)
        return ("loss_type", "loss_weights", *own, *_hyperparameter_defaults())

    @classmethod
    def of(cls, loss_type: str | Sequence[str] = "sigmoid", loss_weights: Sequence[float] | None = None,
           **options: Any) -> "LossSettings":
        """Settings from keyword arguments (a config's field names), validated: for calling `dpo_loss` directly."""
        own = {f.name for f in fields(cls)}
        known = _hyperparameter_defaults()
        unknown = sorted(set(options) - own - set(known))
        if unknown:
            raise TypeError(f"dpo_loss got unknown settings {unknown}; known: {sorted(own | set(known))}")
        names = (loss_type,) if isinstance(loss_type, str) else tuple(loss_type)
        settings = cls(loss_types=names, loss_weights=None if loss_weights is None else tuple(loss_weights),
                       **{name: value for name, value in options.items() if name in own},
                       hyperparameters=known | {name: value for name, value in options.items() if name in known})
        return settings.validate()

    @property
    def weights(self) -> tuple[float, ...]:
        return self.loss_weights or (1.0,) * len(self.loss_types)

    @property
    def reads_reference(self) -> bool:
        """Whether a reference is built and run: some loss type reads it, or none has rewards of its own, so that the
        reward metrics are log-ratios (sft alone keeps it for them, as TRL); never with `reference_free`."""
        entries = [LOSSES[name] for name in self.loss_types]
        return not self.reference_free and (any(entry.reads_reference for entry in entries)
                                            or all(entry.rewards is None for entry in entries))

    @property
    def dpo_alone(self) -> bool:
        """Whether the loss is DPO's `-logsigmoid(beta * logits)` alone, which `compute_loss` writes out (the
        default): sigmoid alone at weight 1, a reference, no label smoothing, reverse KL, no WPO weights or CPO term
        (`ld_alpha` shapes the log-probs before either). Any other settings go through this table, in `dpo_loss`."""
        return (self.loss_types == ("sigmoid",) and self.weights == (1.0,) and self.reads_reference
                and self.hyperparameters["label_smoothing"] == 0 and self.f_divergence_type == "reverse_kl"
                and not self.use_weighting and self.cpo_alpha == 0)

    @property
    def rewards_are_log_ratios(self) -> bool:
        """Whether the implicit rewards are beta times the log-ratios of policy to reference (0 while the policy is
        the reference): a reference is read, and the first loss type has no rewards of its own (`dpo_loss`)."""
        return self.reads_reference and LOSSES[self.loss_types[0]].rewards is None

    @property
    def tie_loss(self) -> float | None:
        """The loss of a pair whose policy is its reference (every pair before training), from the loss table: ln 2
        for DPO's sigmoid alone; None where it is not one known value."""
        return LOSSES[self.loss_types[0]].tie if len(self.loss_types) == 1 else None

    @property
    def needs_lengths(self) -> bool:
        return self.cpo_alpha != 0 or any(LOSSES[name].needs_lengths for name in self.loss_types)

    def validate(self) -> "LossSettings":
        """Raise a one-line ValueError for the first setting that no loss type accepts; return the settings."""
        unknown = [name for name in self.loss_types if name not in LOSSES]
        if unknown or not self.loss_types:
            raise ValueError(f"unknown loss_type {unknown or list(self.loss_types)}; valid choices: "
                             f"{', '.join(LOSSES)}")
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_types):
            raise ValueError(f"loss_weights needs one weight per loss_type: got {len(self.loss_weights)} weights for "
                             f"{list(self.loss_types)}")
        if self.beta <= 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")
        values = {**self.hyperparameters, "cpo_alpha": self.cpo_alpha}
        for name, knob in RANGES.items():
            if name in values and not knob.holds(values[name]):
                raise ValueError(f"{name} must be {knob}, got {values[name]}")
        for loss in self.loss_types:
            for name, knob in LOSSES[loss].reads.items():
                if not knob.holds(values[name]):
                    raise ValueError(f"loss_type {loss!r} needs {name} {knob}{knob.note}, got {values[name]}")
        self._check_unread_alpha()
        self._check_f_divergence()
        self._check_modifiers()
        if "plackett_luce" in self.loss_types and (len(self.loss_types) > 1 or self.ld_alpha is not None
                                                   or self.cpo_alpha or self.use_weighting):
            raise ValueError("loss_type plackett_luce is one loss per group: it takes no other loss type, ld_alpha, "
                             "use_weighting or cpo_alpha")
        return self

    def _check_modifiers(self) -> None:
        if self.ld_alpha is not None and not 0.0 <= self.ld_alpha <= 1.0:
            raise ValueError(f"ld_alpha must be in [0, 1] or None, got {self.ld_alpha}")
        sorting = [name for name, entry in LOSSES.items() if entry.sorts_batch]
        if self.use_weighting and set(sorting) & set(self.loss_types):
            raise ValueError(f"use_weighting (WPO) cannot weight {'/'.join(sorting)}: they sort pairs across the "
                             "batch")

    def _check_unread_alpha(self) -> None:
        alphapo = tuple(name for name, entry in LOSSES.items() if "alpha" in entry.reads)
        if self.hyperparameters.get("alpha", 0) != 0 and not set(self.loss_types) & set(alphapo):
            raise ValueError(f"alpha (AlphaPO) reshapes the rewards of loss_type {alphapo}, got "
                             f"{list(self.loss_types)}")

    def _check_f_divergence(self) -> None:
        if self.f_divergence_type not in F_DIVERGENCES:
            raise ValueError(f"f_divergence_type must be one of {', '.join(F_DIVERGENCES)}, got "
                             f"{self.f_divergence_type!r}")
        f_losses = [name for name, entry in LOSSES.items() if entry.f_divergence]
        if self.f_divergence_type != "reverse_kl" and not set(self.loss_types) <= set(f_losses):
            raise ValueError(f"f_divergence_type {self.f_divergence_type!r} needs every loss_type among {f_losses} "
                             f"(the others have no f-divergence form), got {list(self.loss_types)}")


def dpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
             ref_chosen_logps: torch.Tensor | None, ref_rejected_logps: torch.Tensor | None,
             settings: LossSettings | None = None, chosen_lengths: torch.Tensor | None = None,
             rejected_lengths: torch.Tensor | None = None, chosen_nll: torch.Tensor | None = None,
             pair_weights: torch.Tensor | None = None, groups: tuple[torch.Tensor, torch.Tensor] | None = None,
             **options: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair preference loss and implicit rewards.

    Args:
        policy_chosen_logps, policy_rejected_logps: [B] summed log-probs of each completion under the policy.
        ref_chosen_logps, ref_rejected_logps: [B] the same under the reference; None (or `reference_free`) takes
            them as 0, the reference of cpo, simpo and sft alone.
        settings: the loss types, weights and hyperparameters (`DPOMinConfig.loss_settings`); without it, keyword
            `options` with a config's field names build one (`beta=0.1, loss_type=["sigmoid", "sft"], ...`). Its
            `ld_alpha` and `use_weighting` shape the inputs: the log-probs and `pair_weights` (`compute_loss`).
        chosen_lengths, rejected_lengths: [B] completion tokens of each completion; needed by the losses with
            `needs_lengths` and by cpo_alpha.
        chosen_nll: [B] summed negative log-likelihood of each chosen completion under the policy, for sft and
            cpo_alpha (default -policy_chosen_logps; pass it when those are length-desensitised).
        pair_weights: [B] per-pair weights multiplying every loss term (WPO), or None.
        groups: plackett_luce's (ranking [R], sizes [G]) of the batch's groups (collator_groups.py), or None.

    Returns:
        (losses [B], chosen_rewards [B], rejected_rewards [B]), rewards detached: beta * (policy - reference), or
        for a first loss type with rewards of its own (cpo, simpo), beta times those. plackett_luce's losses are
        [G], one per group.
    """
    settings = _settings_of(settings, options, chosen_lengths is not None and rejected_lengths is not None)
    if settings.reference_free or ref_chosen_logps is None:  # log pi_ref taken as 0
        ref_chosen_logps, ref_rejected_logps = (torch.zeros_like(policy_chosen_logps),
                                                torch.zeros_like(policy_rejected_logps))
    chosen_logratios = policy_chosen_logps - ref_chosen_logps
    rejected_logratios = policy_rejected_logps - ref_rejected_logps
    # f-DPO (arXiv 2309.16240) takes f'(pi / pi_ref) of each ratio; reverse KL, DPO's own, the log-ratio itself.
    f_prime, coef = F_DIVERGENCES[settings.f_divergence_type], settings.f_alpha_divergence_coef
    chosen_scores, rejected_scores = f_prime(chosen_logratios, coef), f_prime(rejected_logratios, coef)
    terms = PairTerms(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps,
                      chosen_logratios, rejected_logratios, chosen_scores, rejected_scores,
                      delta=chosen_scores - rejected_scores, chosen_lengths=chosen_lengths,
                      rejected_lengths=rejected_lengths, chosen_nll=chosen_nll, beta=settings.beta,
                      label_smoothing=settings.hyperparameters["label_smoothing"],
                      hyperparameters=settings.hyperparameters, groups=groups)
    losses = sum(weight * LOSSES[name].loss(terms) for name, weight in zip(settings.loss_types, settings.weights))
    if pair_weights is not None:
        losses = losses * pair_weights
    if settings.cpo_alpha:  # added after the pair weights, as CPOTrainer adds it to the mean loss
        losses = losses + settings.cpo_alpha * family.sft(terms)
    reward_of = LOSSES[settings.loss_types[0]].rewards
    chosen_rewards, rejected_rewards = (chosen_logratios, rejected_logratios) if reward_of is None else reward_of(terms)
    return losses, settings.beta * chosen_rewards.detach(), settings.beta * rejected_rewards.detach()


def _settings_of(settings: LossSettings | None, options: dict[str, Any], with_lengths: bool) -> LossSettings:
    """The settings given, or built from the keyword options; checked against what dpo_loss was given."""
    shaping = sorted({"ld_alpha", "use_weighting"} & set(options))
    if shaping:  # they act on the inputs; taken here they would change nothing, silently
        raise TypeError(f"dpo_loss does not apply {shaping}: pass LD-DPO's log-probs (SequenceLogps.summed_logps) "
                        "and WPO's pair_weights (SequenceLogps.wpo_weights) instead")
    if settings is not None and options:
        raise TypeError(f"pass either settings or keyword options, not both (got {sorted(options)})")
    settings = LossSettings.of(**options) if settings is None else settings
    if settings.needs_lengths and not with_lengths:
        raise ValueError(f"loss types {[name for name, entry in LOSSES.items() if entry.needs_lengths]} and "
                         "cpo_alpha need chosen_lengths and rejected_lengths")
    return settings
