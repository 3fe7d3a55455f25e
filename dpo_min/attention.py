"""Attention over a packed row, one segment at a time.

A packed row (padding_free, share_prompt) holds independent segments: sequences, or pairs sharing their prompt. Its
mask is block-diagonal, but torch's sdpa kernels compute every block of an [N, N] mask, so a packed row of S
segments would pay about S times the attention it needs (a third of a DPO step at batch 4 on CPU).

`use_segmented_attention(model)` switches a model from transformers' "sdpa" attention to "dpo_min_segmented_sdpa":
the same function, except that when a forward passes `dpo_min_segments` (see `segment_kwargs`) each segment attends
on its own, with its diagonal block of the mask, which holds every key the segment may see. The switch stays for the
model's life, so gradient checkpointing recomputes the same way; other attention implementations stay dense.
"""

import itertools

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

SEGMENTED_SDPA = "dpo_min_segmented_sdpa"


def _segmented_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dpo_min_segments: tuple[int, ...] | None = None,
                    **kwargs) -> tuple[torch.Tensor, None]:
    if dpo_min_segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    outputs = []
    for start, stop in itertools.pairwise(dpo_min_segments):
        mask = None if attention_mask is None else attention_mask[..., start:stop, start:stop]
        output, _ = sdpa_attention_forward(module, query[:, :, start:stop], key[:, :, start:stop],
                                           value[:, :, start:stop], mask, **kwargs)
        outputs.append(output)  # [batch, segment length, heads, head dim]
    return torch.cat(outputs, dim=1), None


AttentionInterface.register(SEGMENTED_SDPA, _segmented_sdpa)
AttentionMaskInterface.register(SEGMENTED_SDPA, sdpa_mask)  # the same block-diagonal mask as sdpa


def use_segmented_attention(model: torch.nn.Module) -> None:
    """Switch a model that uses sdpa attention to the segmented sdpa; leave any other model as it is."""
    if _attention(model) == "sdpa":
        model.set_attn_implementation(SEGMENTED_SDPA)


def segment_kwargs(model: torch.nn.Module, segment_bounds: torch.Tensor | None) -> dict:
    """Forward kwargs that make a model with segmented sdpa attend segment by segment.

    segment_bounds: [S + 1] start of each segment in the packed row, then the row's length. None, or a model with
    another attention, gets no kwargs (and dense attention: the mask alone keeps the segments apart).
    """
    if segment_bounds is None or _attention(model) != SEGMENTED_SDPA:
        return {}
    return {"dpo_min_segments": tuple(segment_bounds.tolist())}


def _attention(model: torch.nn.Module) -> str | None:
    return getattr(getattr(model, "module", model).config, "_attn_implementation", None)
