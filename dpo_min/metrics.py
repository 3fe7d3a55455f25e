"""The metrics `compute_loss` records, TRL's names and definitions, kept per mode until the trainer's `log`
averages them."""

from collections import defaultdict
from typing import Any

import torch

from .collator import IGNORE_INDEX
from .logps import SequenceLogps


def computed_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[1] tokens the forward computes, padding excluded: every row ends with its last completion token, so a row's
    length is the position of its last label + 1 (TRL counts attention_mask.sum(), the same in the padded layout)."""
    labels = batch["labels"]
    positions = torch.arange(1, labels.size(1) + 1, device=labels.device)
    return torch.where(labels != IGNORE_INDEX, positions, 0).amax(dim=1).sum().reshape(1)


def metric_halves(policy: SequenceLogps) -> dict[str, torch.Tensor]:
    """The per-sequence sums the metrics read, split into [B] halves: chosen_lengths, rejected_lengths, and so for
    logits, entropy and top1."""
    sums = {"logits": policy.logits_sums, "lengths": policy.lengths, "entropy": policy.entropy_sums,
            "top1": policy.top1_counts}
    return {f"{half}_{name}": value for name, values in sums.items()
            for half, value in zip(("chosen", "rejected"), values.chunk(2))}


class StepMetrics:
    """Every micro-batch's metrics since the last log, and each held-out pair's reward margin at the latest evaluation
    (`eval_margins`, in order). A logged figure is a mean over every pair since the last log (over every completion
    token for the per-token ones, over groups for plackett_luce's loss): `totals` keeps each metric's sum and count
    and `averages` divides once, so that no figure depends on how the pairs were cut into batches or processes.
    `by_mode` (the trainer's `_metrics`, TRL's name) keeps each micro-batch's own figure, as TRL records them. The
    running count of training tokens lives in the trainer state, which every checkpoint saves and a resume loads, so
    a resumed run counts on."""

    def __init__(self) -> None:
        self.by_mode: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self.totals: dict[str, dict[str, list[float]]] = {mode: defaultdict(lambda: [0.0, 0.0])
                                                          for mode in self.by_mode}
        self.eval_margins: list[float] = []
        self._pending_margins: list[torch.Tensor] = []  # gathered batch by batch until the evaluation logs

    def add(self, mode: str, key: str, total: float, count: float) -> None:
        """A micro-batch's `total` of a metric over its `count` pairs (tokens, groups), every process's."""
        self.by_mode[mode][key].append(total / count)
        sums = self.totals[mode][key]
        sums[0] += total
        sums[1] += count

    def record(self, accelerator: Any, state: Any, mode: str, policy: SequenceLogps, logps: tuple, rewards: tuple,
               reference: tuple, inputs: dict[str, torch.Tensor], losses: torch.Tensor) -> None:
        """`logps`, `rewards`, `reference`: (chosen, rejected) [B] halves; the reference's are None without one.
        `losses`: [B] each pair's loss ([G] each group's, plackett_luce), which makes the evaluation's loss (training
        logs Trainer's, the mean of its steps' losses)."""
        chosen_logps, rejected_logps = logps[0].detach(), logps[1].detach()
        per_pair = {"chosen_rewards": rewards[0], "rejected_rewards": rewards[1], "chosen_logps": chosen_logps,
                    "rejected_logps": rejected_logps, **metric_halves(policy)}
        if reference[0] is not None:
            per_pair |= {"chosen_drift": chosen_logps - reference[0], "rejected_drift": rejected_logps - reference[1]}
        # Only per-pair [B] tensors go through gather_for_metrics: it trims the last batch to the dataset's length,
        # where a process padded it with pairs of another. Summed in float64: they are added over many batches.
        pairs = {name: value.double() for name, value in accelerator.gather_for_metrics(per_pair).items()}
        tokens = self._token_metrics(mode, pairs)
        # TRL's GRPO uses state.num_input_tokens_seen, which Trainer itself adds to under include_num_input_tokens_seen.
        count = state.stateful_callbacks.setdefault("dpo_min", {"num_tokens": 0})
        if mode == "train":
            count["num_tokens"] += int(accelerator.gather(computed_tokens(inputs)).sum())
        self.by_mode[mode]["num_tokens"] = [count["num_tokens"]]
        self.totals[mode]["num_tokens"] = [count["num_tokens"], 1]  # a running count, not a mean
        if policy.aux_loss is not None:  # one value per forward, not per pair
            self.add(mode, "aux_loss", accelerator.gather_for_metrics(policy.aux_loss.detach()).mean().item(), 1)
        if mode == "eval":
            self._pending_margins.append((pairs["chosen_rewards"] - pairs["rejected_rewards"]).cpu())
            every = accelerator.gather_for_metrics(losses.detach()).double()
            self.add(mode, "loss", every.sum().item(), len(every))
        self._pair_metrics(mode, pairs, tokens)

    def _token_metrics(self, mode: str, pairs: dict[str, torch.Tensor]) -> dict[str, float]:
        """TRL's definitions: entropy over every completion token; token accuracy (argmax = label) over the chosen
        ones. Returns the completion tokens of each half."""
        tokens = {half: pairs[f"{half}_lengths"].sum().item() for half in ("chosen", "rejected")}
        entropy = pairs["chosen_entropy"].sum() + pairs["rejected_entropy"].sum()
        self.add(mode, "entropy", entropy.item(), tokens["chosen"] + tokens["rejected"])
        self.add(mode, "mean_token_accuracy", pairs["chosen_top1"].sum().item(), tokens["chosen"])
        return tokens

    def _pair_metrics(self, mode: str, pairs: dict[str, torch.Tensor], tokens: dict[str, float]) -> None:
        chosen, rejected = pairs["chosen_rewards"], pairs["rejected_rewards"]
        count = len(chosen)
        self.add(mode, "rewards/chosen", chosen.sum().item(), count)
        self.add(mode, "rewards/rejected", rejected.sum().item(), count)
        self.add(mode, "rewards/accuracies", (chosen > rejected).sum().item(), count)
        self.add(mode, "rewards/margins", (chosen - rejected).sum().item(), count)
        for half in ("chosen", "rejected"):
            self.add(mode, f"logps/{half}", pairs[f"{half}_logps"].sum().item(), count)
        for half in ("chosen", "rejected"):  # mean logit over completion tokens, token-weighted (TRL)
            self.add(mode, f"logits/{half}", pairs[f"{half}_logits"].sum().item(), tokens[half])
        for half in ("chosen", "rejected") if "chosen_drift" in pairs else ():
            # Drift from the reference: mean policy - reference log-ratio per completion token, token-weighted. A
            # model that collapses can still rank pairs "right"; this shows how far it went to do so.
            self.add(mode, f"drift/{half}", pairs[f"{half}_drift"].sum().item(), tokens[half])

    def averages(self, mode: str, margins: bool = True) -> dict[str, float]:
        """Each metric's mean since the last log (then forgotten); at an evaluation, its margins become
        `eval_margins` (`margins=False`, predict's: they are dropped)."""
        logs = {key: total / count for key, (total, count) in self.totals[mode].items() if count}
        self.by_mode[mode].clear()
        self.totals[mode].clear()
        if mode == "eval":
            if margins and self._pending_margins:
                self.eval_margins = torch.cat(self._pending_margins).tolist()
            self._pending_margins = []
        return logs
