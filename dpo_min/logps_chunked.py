"""The log-prob autograd of `logps.sequence_logps`: log_softmax(logits)[label] for [K, V] logits, in float32 chunks.

Only positions whose next token is a completion token reach it (K of them), and no float32 [K, V] log-softmax is ever
held: the forward takes each chunk's logsumexp, the backward recomputes the softmax chunk by chunk.
"""

import torch


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
