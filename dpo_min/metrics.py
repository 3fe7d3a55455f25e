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
    """Every micro-batch's metrics since the last log (`by_mode`, the trainer's `_metrics`) and each held-out pair's
    reward margin at the latest evaluation (`eval_margins`, in order). The running count of training tokens lives in
    the trainer state, which every checkpoint saves and a resume loads, so a resumed run counts on."""

    def __init__(self) -> None:
        self.by_mode: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self.eval_margins: list[float] = []
        self._pending_margins: list[torch.Tensor] = []  # gathered batch by batch until the evaluation logs

    def record(self, accelerator: Any, state: Any, mode: str, policy: SequenceLogps, logps: tuple, rewards: tuple,
               reference: tuple, inputs: dict[str, torch.Tensor]) -> None:
        """`logps`, `rewards`, `reference`: (chosen, rejected) [B] halves; the reference's are None without one."""
        chosen_logps, rejected_logps = logps[0].detach(), logps[1].detach()
        per_pair = {"chosen_rewards": rewards[0], "rejected_rewards": rewards[1], "chosen_logps": chosen_logps,
                    "rejected_logps": rejected_logps, **metric_halves(policy)}
        if reference[0] is not None:
            per_pair |= {"chosen_drift": chosen_logps - reference[0], "rejected_drift": rejected_logps - reference[1]}
        # Only per-pair [B] tensors go through gather_for_metrics: it trims the last batch to the dataset's length.
        pairs = accelerator.gather_for_metrics(per_pair)
        metrics = self.by_mode[mode]
        tokens = pairs["chosen_lengths"].sum() + pairs["rejected_lengths"].sum()
        # TRL's definitions: entropy over every completion token; token accuracy (argmax = label) over the chosen
        # ones; num_tokens the running count of training tokens computed, padding excluded.
        metrics["entropy"].append(((pairs["chosen_entropy"].sum() + pairs["rejected_entropy"].sum()) / tokens).item())
        metrics["mean_token_accuracy"].append((pairs["chosen_top1"].sum() / pairs["chosen_lengths"].sum()).item())
        # TRL's GRPO uses state.num_input_tokens_seen, which Trainer itself adds to under include_num_input_tokens_seen.
        count = state.stateful_callbacks.setdefault("dpo_min", {"num_tokens": 0})
        if mode == "train":
            count["num_tokens"] += int(accelerator.gather(computed_tokens(inputs)).sum())
        metrics["num_tokens"] = [count["num_tokens"]]
        if policy.aux_loss is not None:
            metrics["aux_loss"].append(accelerator.gather_for_metrics(policy.aux_loss.detach()).mean().item())
        chosen, rejected = pairs["chosen_rewards"], pairs["rejected_rewards"]
        if mode == "eval":
            self._pending_margins.append((chosen - rejected).float().cpu())
        metrics["rewards/chosen"].append(chosen.mean().item())
        metrics["rewards/rejected"].append(rejected.mean().item())
        metrics["rewards/accuracies"].append((chosen > rejected).float().mean().item())
        metrics["rewards/margins"].append((chosen - rejected).mean().item())
        for half in ("chosen", "rejected"):
            metrics[f"logps/{half}"].append(pairs[f"{half}_logps"].mean().item())
        for half in ("chosen", "rejected"):  # mean logit over completion tokens, token-weighted across the batch (TRL)
            metrics[f"logits/{half}"].append((pairs[f"{half}_logits"].sum() / pairs[f"{half}_lengths"].sum()).item())
        for half in ("chosen", "rejected") if reference[0] is not None else ():
            # Drift from the reference: mean policy - reference log-ratio per completion token, token-weighted. A
            # model that collapses can still rank pairs "right"; this shows how far it went to do so.
            metrics[f"drift/{half}"].append((pairs[f"{half}_drift"].sum() / pairs[f"{half}_lengths"].sum()).item())

    def averages(self, mode: str) -> dict[str, float]:
        """The mean of each metric over every micro-batch since the last log (then forgotten); at an evaluation, its
        margins become `eval_margins`."""
        logs = {key: sum(values) / len(values) for key, values in self.by_mode[mode].items() if values}
        self.by_mode[mode].clear()
        if mode == "eval" and self._pending_margins:
            self.eval_margins, self._pending_margins = torch.cat(self._pending_margins).tolist(), []
        return logs
