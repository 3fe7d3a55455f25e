"""Attention over a packed row: which implementations keep its segments apart, and how.

A packed row (padding_free, share_prompt) holds independent segments: sequences, or pairs sharing their prompt (the
prompt, then two branches that each see the prompt and themselves). `PACKED_ATTENTION` is the table of attention
implementations that can run such a row, each with the forward kwargs that keep its segments apart; any other
implementation is refused by `packed_attention`.

- eager / sdpa: the collator's boolean 4D mask, made additive (or, padding_free without it, the block-diagonal mask
  transformers builds from the restarting `position_ids`).
- "dpo_min_segmented_sdpa" (what packed layouts switch sdpa to): torch's sdpa kernels compute every block of an
  [N, N] mask, so a packed row of S segments would pay about S times the attention it needs (a third of a DPO step at
  batch 4 on CPU). Here each segment attends on its own, with its diagonal block of the mask.
- flex_attention (switched to "dpo_min_flex_attention"): a `BlockMask` built from the collator's `segment_ids` and
  `branch_ids`, so no [N, N] mask is built and fully masked blocks are skipped. On CPU, where torch has no flex
  backward and compiling the forward takes about a minute per shape, the forward runs uncompiled.

The switches stay for the model's life, so gradient checkpointing recomputes the same way.

The mask is half of it: the model must also place each segment by its restarting `position_ids`. Models with ALiBi
(MPT, Bloom) ignore them, so packed sequences see each other's tokens. `PACKED_FAMILIES` is therefore an allow-list:
a model family runs packed layouts only once a test has shown them to give its padded log-probs.
"""

import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from transformers import AttentionInterface
from transformers.integrations.flex_attention import flex_attention_forward
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, flex_attention_mask, sdpa_mask

SEGMENTED_SDPA = "dpo_min_segmented_sdpa"
FLEX = "dpo_min_flex_attention"
# The segment calls of the segmented sdpa on a GPU, without cuDNN's attention: cuDNN builds an execution plan per
# (query, key) shape, and every segment has its own length. On an H200 (torch 2.11) it made padding_free 3x slower
# than padded (4.06 against 1.16 s a step) and failed on share_prompt's masked segments ("mha_graph.execute ... is
# good"); without it the same steps took 1.38 and 1.13 s (docs/speed.md, "On a GPU").
SEGMENT_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _segmented_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dpo_min_segments: tuple[int, ...] | None = None,
                    **kwargs) -> tuple[torch.Tensor, None]:
    if dpo_min_segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    outputs = []
    with sdpa_kernel(SEGMENT_BACKENDS) if query.is_cuda else contextlib.nullcontext():
        for start, stop in itertools.pairwise(dpo_min_segments):
            mask = None if attention_mask is None else attention_mask[..., start:stop, start:stop]
            output, _ = sdpa_attention_forward(module, query[:, :, start:stop], key[:, :, start:stop],
                                               value[:, :, start:stop], mask, **kwargs)
            outputs.append(output)  # [batch, segment length, heads, head dim]
    return torch.cat(outputs, dim=1), None


def _flex(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          attention_mask: torch.Tensor | BlockMask | None, scaling: float | None = None,
          **kwargs) -> tuple[torch.Tensor, None]:
    if query.device.type != "cpu" or not isinstance(attention_mask, BlockMask):
        return flex_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise ValueError("flex attention on CPU runs uncompiled here, without softcap or attention sinks")
    output = flex_attention(query, key, value, block_mask=attention_mask, scale=scaling,
                            enable_gqa=query.size(1) != key.size(1))
    return output.transpose(1, 2).contiguous(), None  # [batch, length, heads, head dim], as transformers expects


AttentionInterface.register(SEGMENTED_SDPA, _segmented_sdpa)
AttentionMaskInterface.register(SEGMENTED_SDPA, sdpa_mask)  # the same block-diagonal mask as sdpa
AttentionInterface.register(FLEX, _flex)
AttentionMaskInterface.register(FLEX, flex_attention_mask)  # batches that carry no BlockMask of ours


def packed_mask_mod(segment_ids: torch.Tensor, branch_ids: torch.Tensor) -> Callable:
    """flex attention's mask_mod of a packed batch: a token sees earlier tokens of its segment whose branch is its
    own or 0 (the shared prompt). segment_ids, branch_ids: [rows, T] from the collator, -1 on padding."""

    def may_attend(batch, head, query, key):
        same_segment = segment_ids[batch, query] == segment_ids[batch, key]
        visible_branch = (branch_ids[batch, key] == 0) | (branch_ids[batch, query] == branch_ids[batch, key])
        return (query >= key) & same_segment & visible_branch

    return may_attend


def packed_block_mask(segment_ids: torch.Tensor, branch_ids: torch.Tensor) -> BlockMask:
    rows, length = segment_ids.shape
    return create_block_mask(packed_mask_mod(segment_ids, branch_ids), rows, None, length, length,
                             device=segment_ids.device)


def _additive_mask(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    mask = batch.get("attention_mask")
    if mask is None or mask.dim() != 4 or mask.dtype != torch.bool:
        return {}
    # transformers hands a 4D mask to attention as given, and eager attention adds it to the scores: it must be
    # additive (0 where allowed, the dtype's min elsewhere) and in the dtype of the hidden states.
    dtype = getattr(model, "module", model).get_input_embeddings().weight.dtype
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return {"attention_mask": additive.masked_fill_(~mask, torch.finfo(dtype).min)}


def _additive_mask_and_segments(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict:
    kwargs = _additive_mask(model, batch)
    if batch.get("segment_bounds") is not None:
        kwargs["dpo_min_segments"] = tuple(batch["segment_bounds"].tolist())
    return kwargs


def _block_mask(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict:
    return {"attention_mask": packed_block_mask(batch["segment_ids"], batch["branch_ids"])}


@dataclass(frozen=True)
class PackedAttention:
    """How one attention implementation runs a packed batch.

    forward_kwargs: (model, batch) -> kwargs that replace or join the batch's model inputs.
    switch_to: the implementation a model is switched to for packed layouts (None: keep it).
    dense_mask: whether it reads the collator's [rows, 1, T, T] share_prompt mask (else the collator skips it).
    """

    forward_kwargs: Callable[[torch.nn.Module, dict], dict]
    switch_to: str | None = None
    dense_mask: bool = True


PACKED_ATTENTION: dict[str, PackedAttention] = {
    "eager": PackedAttention(_additive_mask),
    "sdpa": PackedAttention(_additive_mask, switch_to=SEGMENTED_SDPA),
    SEGMENTED_SDPA: PackedAttention(_additive_mask_and_segments),
    "flex_attention": PackedAttention(_block_mask, switch_to=FLEX, dense_mask=False),
    FLEX: PackedAttention(_block_mask, dense_mask=False),
}


# config.model_type of the families whose packed layouts give the padded log-probs, tested on a tiny random model of
# each (tests/test_layouts.py, test_every_layout_gives_the_log_probs_of_one_sequence_at_a_time). A family joins the
# set with its test; any other is refused, however its attention is implemented.
PACKED_FAMILIES = frozenset({"gemma", "gpt_neox", "llama", "mistral", "mixtral", "phi3", "qwen2", "qwen3"})


def check_packed_model(config: Any) -> PackedAttention:
    """The table entry of a model's attention for packed layouts; refuses a family not tested packed, or an attention
    that cannot keep packed segments apart."""
    family = getattr(config, "model_type", None)
    if family not in PACKED_FAMILIES:
        raise ValueError(f"padding_free and share_prompt are tested to keep packed sequences apart only for the model "
                         f"families {', '.join(sorted(PACKED_FAMILIES))}; this model is {family!r} (ALiBi models such "
                         "as mpt and bloom ignore position_ids and would mix them): turn both off")
    return packed_attention(getattr(config, "_attn_implementation", None))


def packed_attention(name: str | None) -> PackedAttention:
    """The table entry of an attention implementation; refuses one that cannot keep packed segments apart."""
    if name not in PACKED_ATTENTION:
        raise ValueError(f"padding_free and share_prompt need an attention implementation that keeps packed "
                         f"sequences apart, one of {sorted(PACKED_ATTENTION)}; got {name!r}")
    return PACKED_ATTENTION[name]


def use_packed_attention(model: torch.nn.Module) -> None:
    """Switch a model to the implementation its attention runs packed batches with (sdpa -> segmented sdpa,
    flex_attention -> dpo_min's flex); raise if its attention cannot run them."""
    switch_to = packed_attention(_attention(model)).switch_to
    if switch_to is not None:
        getattr(model, "module", model).set_attn_implementation(switch_to)


def packed_forward_kwargs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict:
    """Forward kwargs that keep a packed batch's segments apart under the model's attention ({} for a padded
    batch); raises for an attention that cannot."""
    if "segment_ids" not in batch:
        return _additive_mask(model, batch)  # a 4D mask from a collator of the user's own
    return packed_attention(_attention(model)).forward_kwargs(model, batch)


def _attention(model: torch.nn.Module) -> str | None:
    return getattr(getattr(model, "module", model).config, "_attn_implementation", None)
