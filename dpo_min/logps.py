"""Per-sequence log-probs of a batch, computed from the completion positions only.

Only positions whose next token is a completion token need the output layer, so the model is asked for those
logits alone (`logits_to_keep` as a boolean mask: a [K, V] tensor, K = completion tokens in the batch). The
log-prob of each label is its logit minus the logsumexp of its row, in float32 (`LabelLogProbs`, at the end: its
forward takes each chunk's logsumexp and its backward recomputes the softmax chunk by chunk, so that no float32 [K, V]
log-softmax is ever held). The grouped layout's gather of its distinct completions into the pairs: logps_groups.py.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import logps_groups
from .collator import IGNORE_INDEX, NON_MODEL_KEYS
from .scale.attention import packed_forward_kwargs

CHUNK_TOKENS = 256  # rows of logits per float32 chunk (LabelLogProbs)


@dataclass
class SequenceLogps:
    """Log-probs of the 2B sequences of a batch: the B chosen completions, then the B rejected ones, so that
    `.chunk(2)` of any [2B] value gives its chosen and rejected halves.

    logps:           [2B] sum over completion tokens of log p(token).
    lengths:         [2B] completion tokens per sequence (float): dpo_loss's chosen_lengths, rejected_lengths.
    logits_sums:     [2B] sum over completion tokens of the mean logit over the vocabulary (no grad), for metrics.
    token_logps:     [K]  log p of every completion token, in batch order.
    token_sequence:  [K]  which sequence each of those tokens belongs to.
    token_positions: [K]  index of each token inside its completion (0 = first completion token).
    token_log_sum_sq_probs: [K] log sum_v p(v)^2 of each token's distribution (no grad), only when asked for (WPO).
    entropy_sums:    [2B] sum over completion tokens of the entropy of the predicted distribution (no grad).
    top1_counts:     [2B] completion tokens whose label is the argmax of the predicted distribution (no grad).
    aux_loss:        the model's router load-balancing loss (a scalar), when asked for (mixture-of-experts).
    """

    logps: torch.Tensor
    lengths: torch.Tensor
    logits_sums: torch.Tensor
    token_logps: torch.Tensor
    token_sequence: torch.Tensor
    token_positions: torch.Tensor
    token_log_sum_sq_probs: torch.Tensor | None = None
    entropy_sums: torch.Tensor | None = None
    top1_counts: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None

    def _per_sequence(self, values: torch.Tensor) -> torch.Tensor:
        return values.new_zeros(self.logps.shape).index_add(0, self.token_sequence, values)

    def summed_logps(self, ld_alpha: float | None = None) -> torch.Tensor:
        """[2B] log-probs summed per sequence, what the loss reads: `logps` itself, or with `ld_alpha` (LD-DPO, arXiv
        2409.06411) the tokens of a completion beyond the length of the shorter completion of its pair counted
        `ld_alpha` times."""
        if ld_alpha is None:
            return self.logps
        shared_lengths = torch.minimum(*self.lengths.chunk(2)).repeat(2)
        beyond_shared = self.token_positions >= shared_lengths[self.token_sequence]
        return self._per_sequence(torch.where(beyond_shared, ld_alpha * self.token_logps, self.token_logps))

    def wpo_weights(self) -> torch.Tensor:
        """[B] WPO pair weights (arXiv 2406.11827), no grad: per sequence exp(mean over tokens of log p - log sum_v
        p(v)^2), the probability of the completion under its own sampling-like reweighting; chosen * rejected."""
        if self.token_log_sum_sq_probs is None:
            raise ValueError("WPO weights need sequence_logps(..., with_sum_sq_probs=True)")
        aligned = self._per_sequence((self.token_logps - self.token_log_sum_sq_probs).detach())
        chosen, rejected = torch.exp(aligned / self.lengths).chunk(2)
        return chosen * rejected


def sequence_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                   with_sum_sq_probs: bool = False, with_aux_loss: bool = False) -> SequenceLogps:
    """One forward of `model` over a collated batch -> log-probs of each of its sequences.

    `with_sum_sq_probs` also fills `token_log_sum_sq_probs` (for WPO weights), at the cost of one more pass over
    each chunk of logits; `with_aux_loss` asks a mixture-of-experts model for its router load-balancing loss."""
    labels, sequence_index = batch["labels"], batch["sequence_index"]
    # The grouped layout's sequences are its distinct completions, gathered into the 2B of the pairs at the end.
    pairs_of = batch.get("completion_index")
    num_sequences = 2 * _num_pairs(batch) if pairs_of is None else int(pairs_of.max()) + 1
    # Position t predicts token t+1: keep the positions whose next token is a completion token.
    next_labels = labels[:, 1:]
    predicts_completion = F.pad(next_labels != IGNORE_INDEX, (0, 1), value=False)
    model_inputs = {key: value for key, value in batch.items() if key not in NON_MODEL_KEYS}
    mask = batch.get("attention_mask")
    if "segment_ids" in batch or mask is None or mask.dim() != 2:  # a packed layout (collator_packed.py)
        model_inputs |= packed_forward_kwargs(model, batch)
    # No cache: with one, transformers would not keep packed sequences apart.
    if with_aux_loss:
        model_inputs["output_router_logits"] = True
    outputs = model(**model_inputs, logits_to_keep=predicts_completion, use_cache=False)
    logits = outputs.logits
    logits = logits.reshape(-1, logits.size(-1))  # [K, V], in row-major order of the mask
    keep = predicts_completion[:, :-1]
    token_labels = next_labels[keep]
    token_sequence = sequence_index[:, 1:][keep]
    token_logps, mean_logits, entropy, is_top1, log_sum_sq_probs = LabelLogProbs.apply(logits, token_labels,
                                                                                        with_sum_sq_probs, CHUNK_TOKENS)

    def per_sequence(values: torch.Tensor) -> torch.Tensor:
        return values.new_zeros(num_sequences).index_add(0, token_sequence, values)

    lengths = per_sequence(torch.ones_like(token_logps))
    computed = SequenceLogps(
        logps=per_sequence(token_logps),
        lengths=lengths,
        logits_sums=per_sequence(mean_logits),
        token_logps=token_logps,
        token_sequence=token_sequence,
        token_positions=_positions_in_sequence(token_sequence, lengths.long()),
        token_log_sum_sq_probs=log_sum_sq_probs,
        entropy_sums=per_sequence(entropy),
        top1_counts=per_sequence(is_top1),
        aux_loss=outputs.aux_loss if with_aux_loss else None,
    )
    return computed if pairs_of is None else logps_groups.pairs_of_completions(computed, pairs_of)


def _positions_in_sequence(token_sequence: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """[K] rank of each token among the tokens of its sequence, in batch order (any row layout)."""
    order = torch.argsort(token_sequence, stable=True)
    starts = torch.cumsum(counts, 0) - counts  # index in `order` of each sequence's first token
    positions = torch.empty_like(token_sequence)
    positions[order] = torch.arange(len(order), device=order.device) - starts[token_sequence[order]]
    return positions


def _num_pairs(batch: dict[str, torch.Tensor]) -> int:
    # Every sequence has at least one completion token, so the highest index is 2B - 1.
    return (int(batch["sequence_index"].max()) + 1) // 2


class LabelLogProbs(torch.autograd.Function):
    """log_softmax(logits)[label] for [K, V] logits, `chunk` rows at a time; saves only the logits and a [K]
    logsumexp.

    Also returns, without gradient, the mean logit of each row, its entropy, whether its argmax is the label, and
    (when asked) log sum_v p(v)^2 for WPO."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, with_sum_sq_probs: bool, chunk_tokens: int):
        dtype = torch.promote_types(logits.dtype, torch.float32)
        token_logps = logits.new_empty(labels.shape, dtype=dtype)
        logsumexp = torch.empty_like(token_logps)
        mean_logits = torch.empty_like(token_logps)
        entropy = torch.empty_like(token_logps)
        is_top1 = torch.empty_like(token_logps)
        log_sum_sq_probs = torch.empty_like(token_logps) if with_sum_sq_probs else None
        for start in range(0, logits.size(0), chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            chunk = logits[rows].to(dtype)
            logsumexp[rows] = torch.logsumexp(chunk, dim=-1)
            token_logps[rows] = chunk.gather(-1, labels[rows, None]).squeeze(-1) - logsumexp[rows]
            mean_logits[rows] = chunk.mean(dim=-1)
            # H = lse - sum_v p(v) z_v: one exp of the chunk, no log of a probability that may underflow
            entropy[rows] = logsumexp[rows] - (chunk - logsumexp[rows, None]).exp_().mul_(chunk).sum(dim=-1)
            is_top1[rows] = (chunk.argmax(dim=-1) == labels[rows]).to(dtype)
            if with_sum_sq_probs:
                # log sum exp(2 z - 2 lse) without forming the probabilities
                log_sum_sq_probs[rows] = torch.logsumexp(2 * chunk, dim=-1) - 2 * logsumexp[rows]
        ctx.save_for_backward(logits, labels, logsumexp)
        ctx.chunk_tokens = chunk_tokens
        ctx.mark_non_differentiable(*(t for t in (mean_logits, entropy, is_top1, log_sum_sq_probs) if t is not None))
        return token_logps, mean_logits, entropy, is_top1, log_sum_sq_probs

    @staticmethod
    def backward(ctx, grad_token_logps: torch.Tensor, *_grads_without_use):
        logits, labels, logsumexp = ctx.saved_tensors
        grad_logits, chunk_tokens = torch.empty_like(logits), ctx.chunk_tokens
        for start in range(0, logits.size(0), chunk_tokens):
            stop = start + chunk_tokens
            # d/dlogits of (logit[label] - logsumexp) = onehot(label) - softmax; in place, so that one float32
            # [chunk_tokens, V] buffer is the only temporary while every activation of the model is still held.
            grad = torch.sub(logits[start:stop].to(logsumexp.dtype), logsumexp[start:stop, None]).exp_()
            grad.mul_(-grad_token_logps[start:stop, None])
            grad.scatter_add_(-1, labels[start:stop, None], grad_token_logps[start:stop, None])
            grad_logits[start:stop] = grad
        return grad_logits, None, None, None
