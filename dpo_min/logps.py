"""Per-sequence log-probs of a batch, computed from the completion positions only.

Only positions whose next token is a completion token need the output layer, so the model is asked for those
logits alone (`logits_to_keep` as a boolean mask: a [K, V] tensor, K = completion tokens in the batch). The
log-prob of each label is its logit minus the logsumexp of its row, taken in float32 chunk by chunk, and the
backward recomputes the softmax per chunk: no float32 [2B, T, V] log-softmax is ever held.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import segment_kwargs
from .collator import IGNORE_INDEX, NON_MODEL_KEYS

CHUNK_TOKENS = 256


@dataclass
class SequenceLogps:
    """Log-probs of the 2B sequences of a batch (chosen first, then rejected).

    logps:         [2B] sum over completion tokens of log p(token).
    token_counts:  [2B] completion tokens per sequence.
    logits_sums:   [2B] sum over completion tokens of the mean logit over the vocabulary (no grad), for metrics.
    token_logps:   [K]  log p of every completion token, in batch order.
    token_sequence:[K]  which sequence each of those tokens belongs to.
    """

    logps: torch.Tensor
    token_counts: torch.Tensor
    logits_sums: torch.Tensor
    token_logps: torch.Tensor
    token_sequence: torch.Tensor


class _LabelLogProbs(torch.autograd.Function):
    """log_softmax(logits)[label] for [K, V] logits, in float32 chunks; saves only the logits and a [K] logsumexp."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor):
        token_logps = logits.new_empty(labels.shape, dtype=torch.float32)
        logsumexp = torch.empty_like(token_logps)
        mean_logits = torch.empty_like(token_logps)
        for start in range(0, logits.size(0), CHUNK_TOKENS):
            chunk = logits[start:start + CHUNK_TOKENS].float()
            logsumexp[start:start + CHUNK_TOKENS] = torch.logsumexp(chunk, dim=-1)
            label_logits = chunk.gather(-1, labels[start:start + CHUNK_TOKENS, None]).squeeze(-1)
            token_logps[start:start + CHUNK_TOKENS] = label_logits - logsumexp[start:start + CHUNK_TOKENS]
            mean_logits[start:start + CHUNK_TOKENS] = chunk.mean(dim=-1)
        ctx.save_for_backward(logits, labels, logsumexp)
        ctx.mark_non_differentiable(mean_logits)
        return token_logps, mean_logits

    @staticmethod
    def backward(ctx, grad_token_logps: torch.Tensor, _grad_mean_logits: torch.Tensor):
        logits, labels, logsumexp = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.size(0), CHUNK_TOKENS):
            stop = start + CHUNK_TOKENS
            # d/dlogits of (logit[label] - logsumexp) = onehot(label) - softmax; in place, so that one float32
            # [CHUNK_TOKENS, V] buffer is the only temporary while every activation of the model is still held.
            grad = torch.sub(logits[start:stop].float(), logsumexp[start:stop, None]).exp_()
            grad.mul_(-grad_token_logps[start:stop, None])
            grad.scatter_add_(-1, labels[start:stop, None], grad_token_logps[start:stop, None])
            grad_logits[start:stop] = grad
        return grad_logits, None


def label_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(label), mean logit) per row of [K, V] logits, both float32 [K]."""
    return _LabelLogProbs.apply(logits, labels)


def sequence_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> SequenceLogps:
    """One forward of `model` over a collated batch -> log-probs of each of its sequences."""
    labels, sequence_index = batch["labels"], batch["sequence_index"]
    num_sequences = 2 * _num_pairs(batch)
    # Position t predicts token t+1: keep the positions whose next token is a completion token.
    next_labels = labels[:, 1:]
    predicts_completion = F.pad(next_labels != IGNORE_INDEX, (0, 1), value=False)
    model_inputs = _model_inputs(model, batch) | segment_kwargs(model, batch.get("segment_bounds"))
    # No cache: with one, transformers would not keep packed sequences apart.
    logits = model(**model_inputs, logits_to_keep=predicts_completion, use_cache=False).logits
    logits = logits.reshape(-1, logits.size(-1))  # [K, V], in row-major order of the mask
    keep = predicts_completion[:, :-1]
    token_labels = next_labels[keep]
    token_sequence = sequence_index[:, 1:][keep]
    token_logps, mean_logits = label_logps(logits, token_labels)

    def per_sequence(values: torch.Tensor) -> torch.Tensor:
        return values.new_zeros(num_sequences).index_add(0, token_sequence, values)

    return SequenceLogps(
        logps=per_sequence(token_logps),
        token_counts=per_sequence(torch.ones_like(token_logps)),
        logits_sums=per_sequence(mean_logits),
        token_logps=token_logps,
        token_sequence=token_sequence,
    )


def _model_inputs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    inputs = {key: value for key, value in batch.items() if key not in NON_MODEL_KEYS}
    mask = inputs.get("attention_mask")
    if mask is not None and mask.dim() == 4 and mask.dtype == torch.bool:
        # transformers hands a 4D mask to attention as given, and eager attention adds it to the scores: it must be
        # additive (0 where allowed, the dtype's min elsewhere) and in the dtype of the hidden states.
        dtype = getattr(model, "module", model).get_input_embeddings().weight.dtype
        additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        inputs["attention_mask"] = additive.masked_fill_(~mask, torch.finfo(dtype).min)
    return inputs


def _num_pairs(batch: dict[str, torch.Tensor]) -> int:
    # Every sequence has at least one completion token, so the highest index is 2B - 1.
    return (int(batch["sequence_index"].max()) + 1) // 2
